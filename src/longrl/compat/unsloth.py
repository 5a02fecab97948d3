"""Unsloth's names for loading a model and adding LoRA adapters, as thin calls into :func:`longrl.load_model`
and :func:`longrl.models.apply_lora`; the model they return goes to ``longrl.GRPOTrainer(model=...)``.

Nothing is patched: the model is a plain transformers model (a PEFT model after ``get_peft_model``); longrl's fast
paths (fused LoRA, the sampler on the training weights, offloaded checkpointing) are switched on by the trainer.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_DTYPE_NAMES = {None: "auto", "auto": "auto", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _dtype_name(dtype) -> str:
    name = str(dtype).removeprefix("torch.") if dtype is not None else None
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype: one of None (auto), torch.bfloat16, torch.float16, torch.float32; got {dtype!r}")
    return _DTYPE_NAMES[name]


class FastLanguageModel:
    """``FastLanguageModel.from_pretrained(...)`` and ``FastLanguageModel.get_peft_model(...)`` as in Unsloth."""

    @staticmethod
    def from_pretrained(model_name: str = "builtin:tiny-arith", max_seq_length: int | None = None, dtype=None,
                        load_in_4bit: bool | None = None, *, load_in_fp8: bool = False, device: str = "auto",
                        trust_remote_code: bool = False, revision: str | None = None,
                        attn_implementation: str | None = None, **unsupported):
        """(model, tokenizer) through ``load_model``: ``dtype`` None is auto (bf16 on CUDA, fp32 on the CPU);
        ``load_in_4bit`` (None: Unsloth's default, True unless ``load_in_fp8``) is longrl's NF4 base with its
        16-bit exceptions; ``load_in_fp8`` its FP8 base (e4m3, 128 × 128 block scales, the same exceptions).
        ``max_seq_length`` is kept as ``model.max_seq_length``: longrl's lengths are
        ``max_prompt_length + max_completion_length`` of the GRPO config, and the trainer checks them against it."""
        from ..models import load_model

        _refuse(unsupported, "from_pretrained", {"load_in_8bit": False, "full_finetuning": False, "token": None,
                                                 "fast_inference": False})
        if load_in_4bit and load_in_fp8:
            raise ValueError("FastLanguageModel.from_pretrained(load_in_4bit=True, load_in_fp8=True): a base is "
                             "quantized one way; pass one of them")
        load_in_4bit = not load_in_fp8 if load_in_4bit is None else load_in_4bit
        model, tokenizer = load_model(model_name, lora=None, dtype=_dtype_name(dtype), device=device,
                                      trust_remote_code=trust_remote_code, revision=revision,
                                      attn_implementation=attn_implementation, load_in_4bit=load_in_4bit,
                                      load_in_fp8=load_in_fp8)
        model.max_seq_length = max_seq_length
        return model, tokenizer

    @staticmethod
    def get_peft_model(model, r: int = 16, target_modules=None, lora_alpha: float = 16, lora_dropout: float = 0.0,
                       bias: str = "none", use_gradient_checkpointing=False, random_state: int = 3407,
                       use_rslora: bool = False, loftq_config=None, **unsupported):
        """``model`` with LoRA adapters (``target_modules`` None: every linear layer but the LM head).
        ``use_gradient_checkpointing`` True or "unsloth" turns on transformers' checkpointing; longrl's offloaded
        checkpointing is ``model.offload_activations`` of the GRPO config."""
        import torch

        from ..config.schema import LoraConfig
        from ..models import apply_lora

        _refuse(dict(unsupported, bias=bias, use_rslora=use_rslora, loftq_config=loftq_config), "get_peft_model",
                {"bias": "none", "use_rslora": False, "loftq_config": None, "max_seq_length": None})
        if use_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        targets = ["all-linear"] if target_modules in (None, "all-linear") else list(target_modules)
        torch.manual_seed(random_state)
        return apply_lora(model, LoraConfig(enabled=True, r=r, alpha=float(lora_alpha), dropout=lora_dropout,
                                            target_modules=targets))

    @staticmethod
    def for_inference(model):
        """Evaluation mode (longrl's sampler needs nothing else)."""
        return model.eval()

    @staticmethod
    def for_training(model):
        return model.train()


def _refuse(given: dict, where: str, defaults: dict) -> None:
    for name, value in given.items():
        if name not in defaults:
            raise TypeError(f"FastLanguageModel.{where}() got an argument longrl does not have: {name!r}")
        if value != defaults[name]:
            raise ValueError(f"FastLanguageModel.{where}({name}={value!r}) is not supported by longrl; leave it at "
                             f"{defaults[name]!r}")
