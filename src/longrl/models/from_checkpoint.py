"""A longrl checkpoint as a model (warm starts): ``model.name_or_path`` may name a ``checkpoint-STEP`` directory or a
run's output directory (its newest checkpoint), e.g. an SFT run that a GRPO run continues.

The trained model is rebuilt in memory: the base its run config names (loaded as that run loaded it: revision, seed
of the builtin model, saved base weights), then an adapter checkpoint's LoRA merged into the base weights (PEFT's
``merge_and_unload``: W ← W + (α/r)·B·A) or a full checkpoint's weights. The merged model is a plain transformers
model; the new run's own adapters (if any) go on top of it. The base may itself be a checkpoint (SFT → GRPO → GRPO).

This reads the files ``training/checkpoint.py`` writes (its names are repeated here, as models/ sits below training/;
tests/test_warm_start.py keeps them equal). Nothing read runs code: JSON, and weights as safetensors. Refused before
any weights load: a checkpoint whose files are missing or whose sizes differ from its manifest, and one trained on a
4-bit base (its adapter learned the quantized weights: merge it with ``longrl export --format merged`` first).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError
from .files import file_sha256

log = logging.getLogger(__name__)

STATE_FILE, MANIFEST_FILE, BASE_WEIGHTS_FILE = "trainer_state.json", "manifest.json", "base_model.safetensors"
ADAPTER_FILES, FULL_FILES = ("adapter_config.json", "adapter_model.safetensors"), ("config.json", "model.safetensors")
_CHECKPOINT = re.compile(r"checkpoint-(\d+)$")
MAX_DEPTH = 8  # checkpoints whose base is a checkpoint, nested: more is taken for a loop


class CheckpointModelError(ModelLoadError):
    """A checkpoint named as a model cannot be used; the message names the file and what to do."""


@dataclass(frozen=True)
class WarmStart:
    """A checkpoint named as a model, read and checked (no weights loaded)."""

    path: Path  # the checkpoint-STEP directory
    model: dict  # its run config's model section
    seed: int  # its run's train.seed (the builtin model's weights)

    @property
    def base(self) -> str:
        return self.model["name_or_path"]

    @property
    def is_adapter(self) -> bool:
        return (self.path / ADAPTER_FILES[0]).is_file()


def checkpoint_path(name_or_path: str) -> Path | None:
    """The checkpoint directory ``name_or_path`` names: itself when it holds a trainer state, else a run directory's
    newest ``checkpoint-STEP`` that does; None when it is neither (a model directory, a hub id, builtin:...)."""
    if not isinstance(name_or_path, str) or name_or_path.startswith("builtin:"):
        return None
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        return None
    if (path / STATE_FILE).is_file():
        return path
    found = sorted((int(m.group(1)), p) for p in path.glob("checkpoint-*")
                   if (m := _CHECKPOINT.search(p.name)) and (p / STATE_FILE).is_file())
    return found[-1][1] if found else None


def read_warm_start(name_or_path: str, depth: int = 0) -> WarmStart | None:
    """The checkpoint ``name_or_path`` names, checked before anything loads (its trainer state and run config, its
    weight files against the manifest's sizes, its base, recursively), or None when it names no checkpoint."""
    path = checkpoint_path(name_or_path)
    if path is None:
        return None
    where = f"config key 'model.name_or_path': checkpoint {path}"
    try:
        state = json.loads((path / STATE_FILE).read_text())
        model = state["config"]["model"]
        base, seed = model["name_or_path"], int(state["config"].get("train", {}).get("seed", 0))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointModelError(f"{where}: {STATE_FILE} holds no run config with model.name_or_path "
                                   f"({type(e).__name__}: {e})") from None
    warm = WarmStart(path, model, seed)
    files = ADAPTER_FILES if warm.is_adapter else FULL_FILES
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise CheckpointModelError(f"{where} is incomplete: missing {', '.join(missing)}")
    _check_sizes(path, where)
    quantized = "a 4-bit" if model.get("load_in_4bit") else "an FP8" if model.get("load_in_fp8") else None
    if warm.is_adapter and quantized:
        raise CheckpointModelError(f"{where} trained LoRA on {quantized} base: its adapter fits the quantized weights. "
                                   f"Merge it first (`longrl export DIR --from {path} --format merged`) and give DIR")
    if depth >= MAX_DEPTH:
        raise CheckpointModelError(f"{where}: its base is a checkpoint nested {MAX_DEPTH} deep (a loop?)")
    read_warm_start(base, depth + 1)  # a base that is a checkpoint is checked too
    return warm


def _manifest(path: Path) -> dict:
    try:
        return json.loads((path / MANIFEST_FILE).read_text())["files"] if (path / MANIFEST_FILE).is_file() else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _check_sizes(path: Path, where: str) -> None:
    """Each file the manifest lists is there with its size (the checksums are compared at load)."""
    for name, entry in _manifest(path).items():
        f = path / name
        if not f.is_file() or f.stat().st_size != entry.get("size"):
            raise CheckpointModelError(f"{where}: {f} is missing or cut short (the manifest says {entry.get('size')} "
                                       "bytes)")


def _check_checksum(path: Path, name: str) -> None:
    entry = _manifest(path).get(name)
    if entry is None:
        return
    if file_sha256(path / name) != entry.get("sha256"):
        raise CheckpointModelError(f"config key 'model.name_or_path': {path / name}: checksum differs from the "
                                   "manifest (corrupted)")


def config_source(name_or_path: str) -> str:
    """Where the transformers config of the model ``name_or_path`` names can be read without its weights: a full
    checkpoint itself (it holds config.json), an adapter checkpoint's base (recursively); other references as given."""
    warm = read_warm_start(name_or_path)
    if warm is None:
        return name_or_path
    return str(warm.path) if not warm.is_adapter else config_source(warm.base)


def tokenizer_source(name_or_path: str) -> tuple[str, str | None]:
    """(reference, revision) of the model whose tokenizer ``name_or_path`` uses: for a checkpoint, the first base
    down its chain that is not a checkpoint (checkpoints hold no tokenizer files); other references as given."""
    warm = read_warm_start(name_or_path)
    if warm is None:
        return name_or_path, None
    base, revision = tokenizer_source(warm.base)
    return base, revision if base != warm.base else warm.model.get("revision")


def load_checkpoint_model(name_or_path: str, load_model, torch_dtype, device, trust_remote_code: bool = False,
                          attn_implementation: str | None = None):
    """(model, tokenizer): the model the checkpoint trained, merged, in ``torch_dtype`` on ``device``.

    ``load_model``: :func:`longrl.models.load_model`, which loads the base (passed in: loading.py calls this module).
    ``trust_remote_code`` is the caller's own setting, never the checkpoint's."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    warm = read_warm_start(name_or_path)
    files = ADAPTER_FILES if warm.is_adapter else FULL_FILES
    _check_checksum(warm.path, files[1])
    base, tokenizer = load_model(warm.base, lora=None, dtype=torch_dtype, device=str(device),
                                 trust_remote_code=trust_remote_code, revision=warm.model.get("revision"),
                                 attn_implementation=attn_implementation, seed=warm.seed)
    try:
        saved_base = warm.path / BASE_WEIGHTS_FILE  # the builtin model's frozen base, saved beside its adapter
        if warm.is_adapter and saved_base.is_file():
            _check_checksum(warm.path, BASE_WEIGHTS_FILE)
            weights = load_file(str(saved_base), device=str(device))
            base.load_state_dict({k: v.to(torch_dtype) for k, v in weights.items()}, strict=True)
        if warm.is_adapter:
            model = _merged_adapter(base, warm.path)
        else:
            model = _full_weights(base, load_file(str(warm.path / FULL_FILES[1]), device=str(device)), warm.path)
    except (OSError, SafetensorError, ValueError, RuntimeError, KeyError) as e:
        raise CheckpointModelError(f"config key 'model.name_or_path': checkpoint {warm.path} does not fit its base "
                                   f"{warm.base!r}: {type(e).__name__}: {str(e)[:300]}") from e
    model.to(torch_dtype).requires_grad_(True)  # as a model from_pretrained: every weight trainable (LoRA freezes)
    log.info("model.name_or_path: %s, %s merged into %s", warm.path, "its adapter" if warm.is_adapter else
             "its full weights", warm.base)
    return model, tokenizer


def _merged_adapter(base, path: Path):
    """The base with the checkpoint's LoRA adapter merged into its weights (PEFT's merge_and_unload)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(path), is_trainable=False).merge_and_unload()


def _full_weights(base, weights: dict, path: Path):
    """The base with every weight replaced by the checkpoint's (tied weights, which save_pretrained writes once,
    follow the one saved)."""
    state = base.state_dict()
    unexpected = sorted(set(weights) - set(state))
    if unexpected:
        raise KeyError(f"{path / FULL_FILES[1]}: weights the base has no place for: {unexpected[:5]}")
    tied = {name for name in state if name not in weights}
    untied = [n for n in tied if not any(state[n].data_ptr() == state[w].data_ptr() for w in weights)]
    if untied:
        raise KeyError(f"{path / FULL_FILES[1]}: weights missing: {untied[:5]}")
    base.load_state_dict(weights, strict=False)
    return base
