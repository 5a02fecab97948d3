"""``longrl export``: a training checkpoint as a PEFT adapter, a merged 16-bit Hugging Face model, or a GGUF
file (f16 / q8_0) with an Ollama Modelfile.

Everything is checked (checkpoint, format, architecture, output directory) before any model loads, and the
output is written into a hidden directory beside ``output_dir`` and renamed into place, so a failure never
leaves a half-written export. An export never goes into, over or inside a training run, and ``overwrite``
replaces only a previous export (:mod:`.destination`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

from .destination import EXPORT_MARKER, check_destination
from .source import (Checkpoint, ExportError, check_remote_code, dequantize_4bit_linears, is_vision_checkpoint,
                     load_processing, load_tokenizer, merged_model, read_checkpoint)

log = logging.getLogger(__name__)

FORMATS = ("adapter", "merged", "gguf")

__all__ = ["EXPORT_MARKER", "FORMATS", "Checkpoint", "ExportError", "dequantize_4bit_linears", "export_checkpoint",
           "read_checkpoint", "save_trained_model"]


def _base_config(ckpt: Checkpoint):
    """The transformers config of the trained model (read without loading weights)."""
    from ..models import TINY_NAME
    from ..models.tiny_vision import TINY_VISION_NAME, build_vision_tokenizer, tiny_vision_config

    if not ckpt.is_adapter:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(ckpt.path))
    if ckpt.base_name == TINY_NAME:
        from transformers import LlamaConfig

        from ..models.tiny import tiny_config_dict

        return LlamaConfig(**tiny_config_dict())
    if ckpt.base_name == TINY_VISION_NAME:
        return tiny_vision_config(build_vision_tokenizer())
    from ..models.gguf import GgufError, gguf_model_config, is_gguf

    if is_gguf(ckpt.base_name):
        try:
            return gguf_model_config(ckpt.base_name)
        except GgufError as e:
            raise ExportError(f"could not read the config of base model {ckpt.base_name!r}: {e}") from e
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(ckpt.base_name, revision=ckpt.model.get("revision"),
                                          trust_remote_code=ckpt.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ExportError(f"could not read the config of base model {ckpt.base_name!r}: {e}") from e


def _check_gguf(ckpt: Checkpoint, quant: str):
    """Everything a GGUF export needs decided before any output: the architecture, an exact tokenizer plan and
    an exact Modelfile template. Returns the tokenizer's VocabPlan."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ExportError("GGUF export needs the gguf package: pip install -e \".[export]\" in a longrl "
                          "checkout, or pip install \"longrl[export]\"") from e
    from .gguf_vocab import UnsupportedTokenizer, vocab_plan
    from .gguf_writer import QUANTS, UnsupportedArchitecture, gguf_arch
    from .modelfile import TemplateMismatch, chat_parts, check_template, go_template

    if quant not in QUANTS:
        raise ExportError(f"--quant must be one of {', '.join(QUANTS)}; got {quant!r}")
    try:
        gguf_arch(_base_config(ckpt))
    except UnsupportedArchitecture as e:
        raise ExportError(f"checkpoint {ckpt.path}: {e}") from e
    tokenizer = load_tokenizer(ckpt)
    try:
        plan = vocab_plan(tokenizer)
    except UnsupportedTokenizer as e:
        raise ExportError(f"GGUF export of {ckpt.base_name!r}: llama.cpp cannot tokenize exactly as its tokenizer "
                          f"does: {e}") from e
    try:
        check_template(tokenizer, go_template(chat_parts(tokenizer, plan.add_bos)), plan.add_bos)
    except TemplateMismatch as e:
        raise ExportError(f"GGUF export of {ckpt.base_name!r}: {e}") from e
    for note in plan.notes:
        log.warning("GGUF export of %s: %s", ckpt.base_name, note)
    return plan


def export_checkpoint(checkpoint: str | Path, output_dir: str | Path, fmt: str = "merged", quant: str = "f16",
                      dtype: str = "auto", overwrite: bool = False, device: str = "cpu",
                      trust_remote_code: bool = False, _own_run: Path | None = None) -> Path:
    """Export ``checkpoint`` (a ``checkpoint-STEP`` directory or a run directory: its latest checkpoint) to
    ``output_dir`` as ``fmt`` (adapter, merged, gguf). ``quant``: gguf tensor type (f16, q8_0); ``dtype``: merged
    weights (auto = the base's 16-bit type, bfloat16, float16, float32); ``overwrite``: replace a previous export
    (never anything else). Returns the output directory. ``_own_run``: :func:`save_trained_model`'s run, which
    its own trainer may export under."""
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    ckpt = dataclasses.replace(read_checkpoint(checkpoint), trust_remote_code=trust_remote_code)
    check_remote_code(ckpt, trust_remote_code)
    if fmt == "gguf" and is_vision_checkpoint(ckpt):
        raise ExportError(f"checkpoint {ckpt.path} trained the vision-language model {ckpt.base_name!r}: GGUF export "
                          "of vision models is not supported (longrl does not write llama.cpp's image projector, "
                          "the mmproj file); export it with --format merged or --format adapter")
    # "out/.", "..", "out/sub/..": a name and a parent to stage beside (".." read lexically, as cd reads it)
    output_dir = Path(os.path.normpath(Path(output_dir).expanduser().absolute()))
    check_destination(output_dir, overwrite, Path(ckpt.path), own_run=_own_run)
    from .hf import merged_dtype, write_adapter, write_card, write_merged

    torch_dtype = merged_dtype(ckpt, dtype) if fmt == "merged" else None
    if fmt == "adapter" and not ckpt.is_adapter:
        raise ExportError(f"checkpoint {ckpt.path} holds full weights (lora.enabled=false), not an adapter; "
                          "export it with --format merged")
    plan = _check_gguf(ckpt, quant) if fmt == "gguf" else None
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = output_dir.parent / f".{output_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        details: dict = {}
        if fmt == "adapter":
            write_adapter(staging, ckpt)
        else:
            model = merged_model(ckpt, device)
            if fmt == "merged":
                write_merged(staging, model, load_processing(ckpt), torch_dtype)
                details["dtype"] = str(torch_dtype).removeprefix("torch.")
            else:
                _write_gguf(staging, model, load_tokenizer(ckpt), quant, ckpt, plan)
                details["quant"] = quant
        write_card(staging, ckpt, fmt, details)
        _replace(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("exported %s as %s to %s", ckpt.path, fmt, output_dir)
    return output_dir


def save_trained_model(trainer, output_dir: str | Path | None = None, fmt: str | None = None) -> Path:
    """TRL's ``trainer.save_model``, for either recipe: the trainer's model as it is now, through
    :func:`export_checkpoint`: a PEFT adapter (LoRA runs) or a merged model (full weights, or ``fmt="merged"``), or
    ``fmt="gguf"``; a checkpoint of the current step is saved first if there is none. ``output_dir``: new or empty,
    or the run's own output directory (TRL's ``save_model(args.output_dir)``: the files land beside the
    checkpoints, replacing an earlier save's); default output_dir/final. ``trainer``: has ``model``, ``output_dir``,
    ``step_idx`` and ``save()``, and under torchrun a ``world`` (every rank calls this; rank 0 exports)."""
    run_dir = Path(trainer.output_dir)
    fmt = fmt or ("adapter" if hasattr(trainer.model, "peft_config") else "merged")
    target = Path(output_dir) if output_dir is not None else run_dir / "final"
    world = getattr(trainer, "world", None)
    ckpt = run_dir / f"checkpoint-{trainer.step_idx}"
    if not ckpt.is_dir():
        ckpt = trainer.save()  # every rank (a collective under torchrun)
    if world is not None and not world.is_main:
        world.barrier()  # until rank 0 has exported
        return target
    try:
        if target.resolve() != run_dir.resolve():
            return export_checkpoint(ckpt, target, fmt=fmt, overwrite=True, _own_run=run_dir)
        staged = export_checkpoint(ckpt, run_dir / f".save_model-{os.getpid()}", fmt=fmt, _own_run=run_dir)
        for entry in sorted(staged.iterdir()):  # none is named like a checkpoint, metrics or logs of the run
            if (run_dir / entry.name).is_dir():
                shutil.rmtree(run_dir / entry.name)
            os.replace(entry, run_dir / entry.name)
        staged.rmdir()
        return run_dir
    finally:
        if world is not None:
            world.barrier()


def _write_gguf(out: Path, model, tokenizer, quant: str, ckpt: Checkpoint, plan) -> None:
    from .gguf_writer import write_gguf
    from .modelfile import modelfile_text

    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    eos_ids = eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
    modelfile = modelfile_text(tokenizer, "model.gguf", eos_ids, plan.add_bos, generation)
    write_gguf(out / "model.gguf", model, tokenizer, quant, name=f"{Path(ckpt.base_name).name}-{ckpt.path.name}",
               plan=plan)
    (out / "Modelfile").write_text(modelfile)


def _replace(staging: Path, output_dir: Path) -> None:
    """Rename ``staging`` to ``output_dir``; an existing (empty or --overwrite) output is moved aside first."""
    if not output_dir.exists():
        os.replace(staging, output_dir)
        return
    old = output_dir.parent / f".{output_dir.name}.old-{os.getpid()}"
    os.replace(output_dir, old)
    os.replace(staging, output_dir)
    shutil.rmtree(old, ignore_errors=True)
