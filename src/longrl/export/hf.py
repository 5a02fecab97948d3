"""Hugging Face outputs: the PEFT adapter as trained, or the merged 16-bit model, each with its tokenizer (a
vision-language model's processor: tokenizer, image processor and chat template, so that ``AutoProcessor`` loads
it beside ``AutoModelForImageTextToText``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..models.loading import BUILTIN_MODELS
from .destination import EXPORT_MARKER
from .source import Checkpoint, ExportError, is_vision_checkpoint, load_base, load_processing

MERGED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BUILTIN_BASE_DIR = "base_model"  # the builtin base, saved beside its adapter since no hub holds it


def merged_dtype(ckpt: Checkpoint, dtype: str) -> torch.dtype:
    """``auto``: float16 when the run's base was float16, else bfloat16."""
    if dtype == "auto":
        return torch.float16 if ckpt.dtype == "float16" else torch.bfloat16
    if dtype not in MERGED_DTYPES:
        raise ExportError(f"--dtype must be auto or one of {', '.join(MERGED_DTYPES)}; got {dtype!r}")
    return MERGED_DTYPES[dtype]


def write_adapter(out: Path, ckpt: Checkpoint) -> None:
    """The checkpoint's adapter files, the tokenizer (or processor), and (builtin base only) the base model in
    ``base_model/``."""
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy2(ckpt.path / name, out / name)
    processing = load_processing(ckpt)
    processing.save_pretrained(out)
    if ckpt.base_name in BUILTIN_MODELS:
        base = load_base(ckpt)
        base.save_pretrained(out / BUILTIN_BASE_DIR)
        processing.save_pretrained(out / BUILTIN_BASE_DIR)


def write_merged(out: Path, model, processing, dtype: torch.dtype) -> None:
    """The merged model in ``dtype`` and its tokenizer or processor (``processing``)."""
    model.to(dtype).save_pretrained(out)
    processing.save_pretrained(out)


def write_card(out: Path, ckpt: Checkpoint, fmt: str, details: dict) -> None:
    """``longrl_export.json`` (machine-readable provenance; it also marks the directory as an export, which
    ``--overwrite`` may replace) and a short README.md on how to load the output."""
    meta = {"format": fmt, "checkpoint": str(ckpt.path.resolve()), "step": ckpt.state.get("step"),
            "base_model": ckpt.base_name, "revision": ckpt.model.get("revision"), "base_dtype": ckpt.dtype,
            "load_in_4bit": bool(ckpt.model.get("load_in_4bit", False)),
            "load_in_fp8": bool(ckpt.model.get("load_in_fp8", False)), **details}
    (out / EXPORT_MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    base_ref = f"./{BUILTIN_BASE_DIR}" if ckpt.base_name in BUILTIN_MODELS else ckpt.base_name
    auto, reader = (("AutoModelForImageTextToText", "AutoProcessor") if fmt != "gguf" and is_vision_checkpoint(ckpt)
                    else ("AutoModelForCausalLM", "AutoTokenizer"))
    name = "processor" if reader == "AutoProcessor" else "tokenizer"
    usage = {
        "adapter": (f"```python\nfrom peft import PeftModel\nfrom transformers import {auto}, {reader}\n\n"
                    f"base = {auto}.from_pretrained({base_ref!r})\n"
                    f"model = PeftModel.from_pretrained(base, \".\")\n{name} = {reader}.from_pretrained(\".\")\n```"),
        "merged": (f"```python\nfrom transformers import {auto}, {reader}\n\n"
                   f"model = {auto}.from_pretrained(\".\")\n{name} = {reader}.from_pretrained(\".\")\n```"),
        "gguf": "```bash\nllama-cli -m model.gguf\nollama create my-model -f Modelfile\n```",
    }[fmt]
    (out / "README.md").write_text(
        f"# {fmt} export of {ckpt.path.name}\n\nTrained with longrl (GRPO) from `{ckpt.base_name}` "
        f"(step {ckpt.state.get('step')}); details in `longrl_export.json`.\n\n{usage}\n")
