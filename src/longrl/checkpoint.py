"""Atomic checkpoints: ``output_dir/checkpoint-STEP/`` holds the adapter (PEFT format) or the full model,
the optimizer, the scheduler, the RNG states and the trainer state (step, data position).

A checkpoint is written into a hidden temporary directory and renamed into place, so a crash mid-write
leaves the previous checkpoints intact and no half-written ``checkpoint-STEP``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "trainer_state.json"
BASE_WEIGHTS_FILE = "base_model.safetensors"  # the frozen base of a builtin model, which no hub or disk holds
_CHECKPOINT = re.compile(r"checkpoint-(\d+)$")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(output_dir: Path, step: int, model, optimizer, scheduler, state: dict,
                    save_total_limit: int = 0, base_weights: dict | None = None) -> Path:
    """``base_weights``: also save these tensors as ``base_model.safetensors`` (see :func:`frozen_base_weights`)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}-{_saver_tag()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng_state.pt")
    if base_weights:
        from safetensors.torch import save_file

        save_file(base_weights, str(tmp / BASE_WEIGHTS_FILE))
    (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))
    sync_tree(tmp)  # on disk before it is renamed into place: a crash cannot leave a named but empty checkpoint
    if final.exists():  # the same step saved again (e.g. a rerun): move the old one aside first
        old = output_dir / f".old-checkpoint-{step}-{_saver_tag()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _sync_dir(output_dir)  # the rename itself
    if save_total_limit > 0:
        for old in list_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def sync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory (their entries), deepest first."""
    dirs = []
    for path in sorted(Path(root).rglob("*")) + [Path(root)]:
        if path.is_dir():
            dirs.append(path)
        elif path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        _sync_dir(d)


def _sync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory handles (Windows): the files are synced
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def frozen_base_weights(model) -> dict | None:
    """The base weights under a PEFT wrapper, in the base model's own names (adapters left out); None when the
    base is quantized (its weights are then not plain tensors and are rebuilt by loading instead)."""
    base = model.get_base_model()
    weights = {k.replace(".base_layer.", "."): v.detach().to("cpu", copy=True).contiguous()
               for k, v in base.state_dict().items() if ".lora_" not in k}
    return weights if all(v.is_floating_point() for v in weights.values()) else None


# save_checkpoint's staging directories: .tmp- (the new copy) or .old- (a moved-aside copy), the step, the saving
# host and pid (earlier versions: no host)
_STAGING = re.compile(r"^\.(tmp|old)-checkpoint-(\d+)-(?:(.+)-)?(\d+)$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _saver_tag() -> str:
    """host-pid of this process: a pid alone does not name a process on a filesystem that several machines (or
    containers with their own pid spaces) share."""
    return f"{_host()}-{os.getpid()}"


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` is running, other than this one (no save of this process is in flight while it
    starts a run, and a restarted container's trainer often has the killed one's pid)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _written_to_the_end(staged: Path, step: int) -> bool:
    """Whether a staged copy of ``checkpoint-step`` is complete: its trainer state, written last, reads as that
    step's (a kill while writing it leaves it empty or cut short)."""
    try:
        return read_state(staged).get("step") == step
    except (OSError, ValueError, AttributeError):
        return False


def recover_interrupted_saves(output_dir: Path) -> list[str]:
    """Finish or undo what a killed :func:`save_checkpoint` left in ``output_dir`` (staging directories of this
    host whose process is gone; a live one's, and other hosts', are left alone): where ``checkpoint-N`` is missing, a
    complete staged copy of it takes its place (the new one if it was complete, else the moved-aside old one);
    every other staging directory is removed. Returns what was done, one line each."""
    staged: dict[tuple[int, int], dict[str, Path]] = {}  # (step, pid) → {"tmp" / "old": directory}: one save each
    host = _host()
    for p in Path(output_dir).glob(".*-checkpoint-*"):
        m = _STAGING.match(p.name)
        if not m or not p.is_dir() or m.group(3) not in (None, host) or _process_alive(int(m.group(4))):
            continue
        staged.setdefault((int(m.group(2)), int(m.group(4))), {})[m.group(1)] = p
    done = []
    for (step, _), copies in sorted(staged.items()):
        final = Path(output_dir) / f"checkpoint-{step}"
        complete = [copies[k] for k in ("tmp", "old") if k in copies and _written_to_the_end(copies[k], step)]
        if not final.exists() and complete:
            os.replace(complete[0], final)
            done.append(f"restored {final.name} from {complete[0].name}")
        for p in copies.values():
            if p.exists():
                shutil.rmtree(p, ignore_errors=True)
                done.append(f"could not remove {p.name}" if p.exists() else f"removed {p.name}")
    return done


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    found = []
    for p in Path(output_dir).glob("checkpoint-*"):
        m = _CHECKPOINT.search(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def read_state(path: Path) -> dict:
    """A checkpoint's trainer state (its STATE_FILE)."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def checkpoint_config(path: Path) -> dict | None:
    """The run config a checkpoint was trained with (as saved in its trainer state; None if it has none)."""
    return read_state(path).get("config")


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and RNG from ``path``; return the trainer state dict."""
    from safetensors.torch import load_file

    path = Path(path)
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        weights = load_file(str(path / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(model, weights)
        if getattr(result, "unexpected_keys", None):
            raise RuntimeError(f"checkpoint {path}: adapter has unexpected keys {result.unexpected_keys[:5]}")
    else:
        weights = load_file(str(path / "model.safetensors"))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected:
            raise RuntimeError(f"checkpoint {path}: unexpected keys {unexpected[:5]}")
    device = next(model.parameters()).device
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    set_rng_state(torch.load(path / "rng_state.pt", weights_only=False))
    return read_state(path)
