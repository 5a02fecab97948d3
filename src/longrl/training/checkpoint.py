"""Atomic checkpoints: ``output_dir/checkpoint-STEP/`` holds the adapter (PEFT format) or the full model,
the optimizer, the scheduler, the RNG states (JSON), the trainer state (step, data position) and, written last,
``manifest.json``: the size and SHA-256 of every other file.

A checkpoint is written into a hidden temporary directory and renamed into place, so a crash mid-write
leaves the previous checkpoints intact and no half-written ``checkpoint-STEP``. Loading runs no code: weights are
safetensors, optimizer and scheduler states load with ``torch.load(weights_only=True)``, RNG states are JSON.
Loading verifies the manifest and refuses non-finite weights or optimizer state (:class:`CheckpointError`);
resume takes the newest checkpoint that verifies (:func:`resume_candidates`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import torch

from ..models.files import file_sha256
from ..models.fp8_linear import is_fp8_model

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"  # written last: {"files": {relative path: {"size": bytes, "sha256": hex}}}
RNG_FILE = "rng_state.json"
LEGACY_RNG_FILE = "rng_state.pt"  # earlier versions (a pickle; read only as weights, never as code)
SHARDED_OPTIMIZER_DIR = "optimizer"  # the optimizer state as DCP shards (FSDP2 runs) instead of optimizer.pt
BASE_WEIGHTS_FILE = "base_model.safetensors"  # the frozen base of a builtin model, which no hub or disk holds
_CHECKPOINT = re.compile(r"checkpoint-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint cannot be used (missing, corrupted, non-finite, or holding code); the message names the file."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. the disk is full); its staging directory is removed and the
    checkpoints written before are intact."""


def rng_state() -> dict:
    """Python, NumPy, torch (and CUDA) RNG states as JSON-ready lists."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _legacy_rng_state(path: Path) -> dict:
    """An earlier version's ``rng_state.pt`` read as weights only (its NumPy key array allowed, nothing else)."""
    multiarray = getattr(np, "_core", None) or np.core  # NumPy 2 / 1: where the pickle's ndarray rebuilder lives
    allowed = [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        state = safe_torch_load(path)
    kind, keys, pos, has_gauss, cached = state["numpy"]
    return {"python": [state["python"][0], list(state["python"][1]), state["python"][2]],
            "numpy": [kind, np.asarray(keys).tolist(), pos, has_gauss, cached], "torch": state["torch"].tolist(),
            **({"cuda": [s.tolist() for s in state["cuda"]]} if "cuda" in state else {})}


def safe_torch_load(path: Path, map_location=None):
    """``torch.load`` without code: only tensors and plain containers (``weights_only=True``); a file holding
    anything else (a planted pickle) or cut short raises :class:`CheckpointError` naming it."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as e:  # UnpicklingError (code refused), EOFError / RuntimeError (cut short or garbled)
        raise CheckpointError(f"{path}: not a plain tensor file, refused without running it "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None


def write_manifest(root: Path) -> None:
    """``manifest.json``: size and SHA-256 of every file under ``root`` (the manifest itself excluded)."""
    root = Path(root)
    files = {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE}
    (root / MANIFEST_FILE).write_text(json.dumps({"format": 1, "files": files}, indent=1))


def verify_checkpoint(path: Path) -> str | None:
    """None if every file in ``path``'s manifest is there with its size and checksum, else the first problem
    (naming the file). A checkpoint without a manifest (an earlier version's) verifies if its trainer state reads."""
    path = Path(path)
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        try:
            read_state(path)
        except (OSError, ValueError) as e:
            return f"{path / STATE_FILE}: unreadable ({type(e).__name__}: {e})"
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
        assert isinstance(files, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        return f"{manifest}: unreadable ({type(e).__name__}: {e})"
    for name, entry in files.items():
        f = path / name
        if not f.is_file():
            return f"{f}: missing"
        try:
            size = f.stat().st_size
            if size != entry["size"]:
                return f"{f}: {size} bytes, the manifest says {entry['size']} (cut short or replaced)"
            if file_sha256(f) != entry["sha256"]:
                return f"{f}: checksum differs from the manifest (corrupted)"
        except (OSError, KeyError, TypeError) as e:
            return f"{f}: unreadable ({type(e).__name__}: {e})"
    return None


def resume_candidates(output_dir: Path) -> tuple[list[Path], list[str]]:
    """(checkpoints that verify, newest first; one line for each newer one skipped, naming the reason)."""
    good, skipped = [], []
    for p in reversed(list_checkpoints(output_dir)):
        problem = verify_checkpoint(p)
        if problem is None:
            good.append(p)
        else:
            skipped.append(f"{p.name} skipped: {problem}")
    return good, skipped


def check_finite(tensors: dict, where: str) -> None:
    """Raise :class:`CheckpointError` naming the first tensor of ``tensors`` (a flat or nested dict/list) holding
    NaN or infinity."""
    stack = [("", tensors)]
    while stack:
        name, obj = stack.pop()
        if isinstance(obj, dict):
            stack += [(f"{name}.{k}" if name else str(k), v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple)):
            stack += [(f"{name}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, torch.Tensor) and obj.is_floating_point() and not bool(torch.isfinite(obj).all()):
            raise CheckpointError(f"{where}: tensor {name!r} holds NaN or infinite values")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def staging_dir(output_dir: Path, step: int) -> Path:
    """Where this process stages ``checkpoint-step`` before the rename."""
    return Path(output_dir) / f".tmp-checkpoint-{step}-{_saver_tag()}"


def own_weight_names(model) -> dict:
    """``save_pretrained``'s argument that keeps the model's own weight names (transformers 5 otherwise writes some
    families' legacy names, e.g. LLaVA's ``language_model.model.*``, which ``load_state_dict`` on resume does not
    take; ``from_pretrained`` reads either). Empty for a PEFT model (its adapter names are its own) or a
    transformers without the argument."""
    import inspect

    if hasattr(model, "peft_config"):
        return {}
    return {"save_original_format": False} if "save_original_format" in inspect.signature(
        model.save_pretrained).parameters else {}


def save_checkpoint(output_dir: Path, step: int, model, optimizer, scheduler, state: dict,
                    save_total_limit: int = 0, base_weights: dict | None = None, model_state: dict | None = None,
                    staged: Path | None = None) -> Path:
    """``base_weights``: also save these tensors as ``base_model.safetensors`` (see :func:`frozen_base_weights`).
    Several processes (FSDP2): ``model_state`` the full weights to save (gathered from the shards), ``optimizer``
    None and ``staged`` the :func:`staging_dir` in which every rank already wrote its optimizer shards.

    A write that fails (a full disk: ENOSPC) removes its staging directory, leaves the earlier checkpoints as they
    were and raises :class:`CheckpointWriteError` saying how much space the checkpoint needs."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint-{step}"
    tmp = Path(staged) if staged is not None else staging_dir(output_dir, step)
    if staged is None:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(exist_ok=staged is not None)
        model.save_pretrained(tmp, **({"state_dict": model_state} if model_state is not None else {}),
                              **own_weight_names(model))
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / RNG_FILE).write_text(json.dumps(rng_state()))
        if base_weights:
            from safetensors.torch import save_file

            save_file(base_weights, str(tmp / BASE_WEIGHTS_FILE))
        (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))
        write_manifest(tmp)  # last: a checkpoint whose manifest verifies was written to the end
        sync_tree(tmp)  # on disk before it is renamed into place: a crash cannot leave a named but empty checkpoint
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_error(e, output_dir, step, _checkpoint_bytes(model, optimizer, base_weights)) from e
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


def _checkpoint_bytes(model, optimizer, base_weights) -> int:
    """About what a checkpoint takes on disk: the saved weights (trainable ones under PEFT), the optimizer's tensors
    and the saved base."""
    def size(t):
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    params = [p for p in model.parameters() if p.requires_grad] if hasattr(model, "peft_config") else \
        list(model.state_dict().values())
    state = [v for s in optimizer.state.values() for v in s.values()] if optimizer is not None else []
    return sum(map(size, params)) + sum(map(size, state)) + sum(map(size, (base_weights or {}).values()))


def _write_error(e: Exception, output_dir: Path, step: int, needed_bytes: int) -> CheckpointWriteError:
    """The error of a failed checkpoint write: "no space left" when the disk is full (ENOSPC, or torch's and
    safetensors' wrappers of it, or less free space than the checkpoint needs)."""
    try:
        free = shutil.disk_usage(output_dir).free
    except OSError:
        free = None
    text = f"{type(e).__name__}: {e}"
    full = getattr(e, "errno", None) == errno.ENOSPC or "No space left" in text or "ENOSPC" in text or \
        (free is not None and free < needed_bytes)
    earlier = latest_checkpoint(output_dir)
    kept = f"; {earlier.name} is intact" if earlier is not None else ""
    if full:
        where = os.stat(output_dir).st_dev if output_dir.exists() else "?"
        return CheckpointWriteError(
            errno.ENOSPC, f"checkpoint-{step} not written: no space left on device {where} (holding {output_dir}), "
            f"about {needed_bytes / 2**20:.1f} MiB needed, {(free or 0) / 2**20:.1f} MiB free{kept}")
    return CheckpointWriteError(getattr(e, "errno", None) or errno.EIO,
                                f"checkpoint-{step} not written to {output_dir}: {text[:300]}{kept}")


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
    base is quantized (4-bit codes, or FP8 codes and their block scales: rebuilt by loading and quantizing the
    original weights instead, never saved beside the adapters)."""
    base = model.get_base_model()
    if is_fp8_model(base):
        return None
    weights = {k.replace(".base_layer.", "."): v.detach().to("cpu", copy=True).contiguous()
               for k, v in base.state_dict().items() if ".lora_" not in k}
    return weights if all(v.is_floating_point() for v in weights.values()) else None


def trainer_state(model, cfg, data_position: int, **extra) -> tuple[dict, dict | None]:
    """(trainer state, frozen base weights) of a checkpoint of either recipe: the data position and the config, and
    what ``longrl export`` needs to rebuild exactly the trained model: the base's real dtype (model.dtype=auto
    depends on the device), the modules a 4-bit base kept in 16-bit, a GGUF base's file (path, size, SHA-256), and
    a builtin model's frozen base (``BUILTIN_MODELS``: the demos' text and vision models), which only a seed and
    this torch version's initializers could otherwise rebuild. ``extra``: the recipe's own entries."""
    from ..models import base_model
    from ..models.loading import BUILTIN_MODELS

    base = base_model(model)
    dtype = base.get_input_embeddings().weight.dtype
    state = {"data_position": data_position, "config": cfg.to_dict(),
             "model_dtype": str(dtype).removeprefix("torch."), **extra}
    if getattr(base, "longrl_gguf", None):  # a GGUF base: the file, so export reloads (and checks) that one
        state["base_gguf"] = base.longrl_gguf
    report = getattr(base, "longrl_quant_report", None)
    if report is not None:  # a 4-bit base: the modules kept in 16-bit, so export rebuilds exactly this base
        state["quant_kept"] = sorted(report.kept)
    frozen = (frozen_base_weights(model)
              if cfg.model.name_or_path in BUILTIN_MODELS and hasattr(model, "peft_config") else None)
    return state, frozen


def resume_request(output_dir: Path, checkpoint: bool | str | Path) -> None:
    """Check TRL's ``train(resume_from_checkpoint=...)``: True, the output directory, or its latest checkpoint
    (longrl resumes from the newest checkpoint that verifies); another path is refused."""
    if checkpoint is True:
        return
    from ..config.errors import ConfigError

    latest = latest_checkpoint(output_dir)
    given = Path(checkpoint).resolve()
    if given != Path(output_dir).resolve() and (latest is None or given != latest.resolve()):
        raise ConfigError(f"resume_from_checkpoint={str(checkpoint)!r}: longrl resumes from the latest checkpoint "
                          f"of output_dir ({latest or f'none in {output_dir}'}); pass True")


def load_newest(candidates: list[Path], output_dir: Path, model, optimizer, scheduler) -> tuple[Path, dict] | None:
    """(path, trainer state) of the newest of ``candidates`` (verified checkpoints, newest first) that loads; one that
    fails is skipped with a warning, and when none loads :class:`CheckpointError` lists why. None without
    candidates (a resume asked for in a directory without checkpoints starts from scratch, warned)."""
    if not candidates:
        log.warning("resume=true but no checkpoint in %s: starting from scratch", output_dir)
        return None
    problems = []
    for path in candidates:
        try:
            state = load_checkpoint(path, model, optimizer, scheduler)
        except CheckpointError as e:
            problems.append(f"{path.name}: {e}")
            log.warning("resume: %s skipped: %s", path.name, e)
            continue
        log.info("resumed from %s (step %d)", path, state["step"])
        return path, state
    raise CheckpointError(f"output.resume: no checkpoint in {output_dir} loads ({'; '.join(problems)})")


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
    """Whether a staged copy of ``checkpoint-step`` is complete: its manifest, written last, verifies (earlier
    versions without one: the trainer state, then written last, reads as that step's)."""
    if (staged / MANIFEST_FILE).exists():
        return verify_checkpoint(staged) is None
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
    """Restore weights, optimizer, scheduler and RNG from ``path``; return the trainer state dict. A model sharded
    by FSDP2 (on any number of processes) reads the full weights and its shards of the optimizer, from DCP shards
    (optimizer/) or from a one-process optimizer.pt; one process reads DCP shards whole.

    Everything is read and checked first (manifest, no code, finite values), then applied: a checkpoint that fails
    raises :class:`CheckpointError` naming the file and leaves the model and optimizer as they were."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from . import distributed

    path = Path(path)
    sharded = distributed.has_dtensor_parameters(model)
    problem = verify_checkpoint(path)
    if problem:
        raise CheckpointError(problem)
    adapter = hasattr(model, "peft_config")
    weights_file = path / ("adapter_model.safetensors" if adapter else "model.safetensors")
    try:
        weights = load_file(str(weights_file))
    except (OSError, SafetensorError, ValueError) as e:
        raise CheckpointError(f"{weights_file}: unreadable ({type(e).__name__}: {e})") from None
    check_finite(weights, str(weights_file))
    device = next(model.parameters()).device
    dcp_optimizer = (path / SHARDED_OPTIMIZER_DIR).is_dir()
    optimizer_state = None if dcp_optimizer else safe_torch_load(path / "optimizer.pt", map_location=device)
    check_finite(optimizer_state.get("state", {}) if isinstance(optimizer_state, dict) else {},
                 str(path / "optimizer.pt"))
    scheduler_state = safe_torch_load(path / "scheduler.pt")
    try:
        rng = json.loads((path / RNG_FILE).read_text()) if (path / RNG_FILE).is_file() \
            else _legacy_rng_state(path / LEGACY_RNG_FILE)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / RNG_FILE}: unreadable ({type(e).__name__}: {e})") from None
    state = read_state(path)
    if adapter:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, weights)
        if getattr(result, "unexpected_keys", None):
            raise CheckpointError(f"{weights_file}: adapter has unexpected keys {result.unexpected_keys[:5]}")
    else:
        unexpected = sorted(set(weights) - set(model.state_dict()))
        if unexpected:
            raise CheckpointError(f"{weights_file}: unexpected keys {unexpected[:5]}")
        if sharded:  # every rank keeps its shards of the full weights
            distributed.load_full_weights(model, weights)
        else:
            model.load_state_dict(weights, strict=False)
    try:
        if dcp_optimizer:
            distributed.load_sharded_optimizer(path / SHARDED_OPTIMIZER_DIR, model, optimizer)
        elif sharded:
            distributed.load_full_optimizer(optimizer_state, model, optimizer)
        else:
            optimizer.load_state_dict(optimizer_state)
        scheduler.load_state_dict(scheduler_state)
        set_rng_state(rng)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{path}: optimizer, scheduler or RNG state does not fit this run "
                              f"({type(e).__name__}: {e})") from None
    return state
