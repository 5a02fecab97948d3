"""Load a Hugging Face causal LM (local directory, hub id or the builtin demo model) with its tokenizer,
and wrap it with LoRA adapters through PEFT."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .tiny import TINY_NAME, build_tiny_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """The model or tokenizer could not be loaded; the message names the path or id."""


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def _looks_local(name: str) -> bool:
    """A path rather than a hub id ("org/name" has exactly one slash and no leading . / ~)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).expanduser().exists()


def load_model(name_or_path: str, *, lora=None, dtype: str | torch.dtype = "auto", device: str = "auto",
               trust_remote_code: bool = False, revision: str | None = None,
               attn_implementation: str | None = None, gradient_checkpointing: bool = False, seed: int = 0):
    """Return (model, tokenizer). ``lora``: a :class:`longrl.config.LoraConfig` (or None for no adapters).

    The model is a ``peft.PeftModel`` when LoRA is enabled, else the plain transformers model; its base
    weights are frozen under LoRA. ``builtin:tiny-arith`` builds the demo model from ``seed``.
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if name_or_path == TINY_NAME:
        model, tokenizer = build_tiny_model(seed=seed, dtype=torch_dtype)
    else:
        model, tokenizer = _load_pretrained(name_or_path, torch_dtype, trust_remote_code, revision, attn_implementation)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(dev)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora is not None and lora.enabled:
        model = apply_lora(model, lora)
    return model, tokenizer


def _load_pretrained(name, torch_dtype, trust_remote_code, revision, attn_implementation):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(name).expanduser()
    if _looks_local(name) and not path.exists():
        raise ModelLoadError(f"model directory not found: {name}")
    if path.exists() and path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {name} has no config.json: not a Hugging Face model directory")
    kwargs = dict(trust_remote_code=trust_remote_code, revision=revision)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.exists() else name, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(path) if path.exists() else name, dtype=torch_dtype,
                                                     attn_implementation=attn_implementation, **kwargs)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load model {name!r}: {e}") from e
    return model, tokenizer


def apply_lora(model, lora):
    """Wrap ``model`` with PEFT LoRA adapters (r, alpha, dropout, target modules; 'all-linear' by default)."""
    import peft

    targets = lora.target_modules
    target = "all-linear" if targets == ["all-linear"] else list(targets)
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target,
                             task_type="CAUSAL_LM", bias="none")
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:
        raise ModelLoadError(f"config key 'lora.target_modules': {e}") from e
    if model.get_output_embeddings().weight.dtype in (torch.bfloat16, torch.float16):
        set_lora_input_casting(wrapped, False)  # longrl runs 16-bit bases under autocast (policy.compute_context)
    return wrapped


def set_lora_input_casting(model, enabled: bool) -> None:
    """PEFT up-casts each LoRA layer's input to the (float32) adapter dtype, a float32 copy of every activation
    that autograd then saves. Under autocast the copy is unnecessary; this turns it off (or back on)."""
    for module in model.modules():
        if hasattr(module, "lora_A"):
            module.cast_input_dtype_enabled = enabled


@dataclass(frozen=True)
class LogitSpec:
    """How the model turns the last hidden state into logits: softcap(multiplier · head(h))."""

    multiplier: float = 1.0
    softcap: float | None = None


def base_model(model):
    """The transformers model under a PEFT wrapper (the model itself if not wrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def model_parts(model):
    """(backbone, lm_head, LogitSpec) of a causal LM: the backbone returns the final (normed) hidden states."""
    base = base_model(model)
    cfg = base.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    multiplier = 1.0
    if getattr(text_cfg, "logit_scale", None):  # Cohere: logits * logit_scale
        multiplier = float(text_cfg.logit_scale)
    if getattr(text_cfg, "logits_scaling", None):  # Granite: logits / logits_scaling
        multiplier = 1.0 / float(text_cfg.logits_scaling)
    softcap = getattr(text_cfg, "final_logit_softcapping", None)
    return base.get_decoder(), base.get_output_embeddings(), LogitSpec(multiplier, float(softcap) if softcap else None)
