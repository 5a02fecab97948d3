"""Unsloth's names for loading a model and adding LoRA adapters (``FastLanguageModel``; ``FastVisionModel`` for
vision-language models, with their processor), as thin calls into :func:`longrl.load_model` and
:func:`longrl.models.apply_lora`; the model they return goes to ``longrl.GRPOTrainer(model=...)``.

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

        _refuse(unsupported, "FastLanguageModel.from_pretrained", LOAD_DEFAULTS)
        if load_in_4bit and load_in_fp8:
            raise ValueError("from_pretrained(load_in_4bit=True, load_in_fp8=True): a base is quantized one way; pass "
                             "one of them")
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
        _refuse(dict(unsupported, bias=bias, use_rslora=use_rslora, loftq_config=loftq_config),
                "FastLanguageModel.get_peft_model", PEFT_DEFAULTS)
        targets = ["all-linear"] if target_modules in (None, "all-linear") else list(target_modules)
        return _with_adapters(model, targets, "none", r, lora_alpha, lora_dropout, use_gradient_checkpointing,
                              random_state)

    @staticmethod
    def for_inference(model):
        """Evaluation mode (longrl's sampler needs nothing else)."""
        return model.eval()

    @staticmethod
    def for_training(model):
        return model.train()


class FastVisionModel(FastLanguageModel):
    """Unsloth's names for vision-language models: ``FastVisionModel.from_pretrained(...)`` returns (model,
    processor), ``FastVisionModel.get_peft_model(model, finetune_vision_layers=..., ...)`` maps Unsloth's choices onto
    ``lora.target_modules`` and ``lora.vision_modules`` (docs/vision.md, "APIs")."""

    @staticmethod
    def from_pretrained(model_name: str = "builtin:tiny-vision", max_seq_length: int | None = None, dtype=None,
                        load_in_4bit: bool | None = None, *, load_in_fp8: bool = False, device: str = "auto",
                        trust_remote_code: bool = False, revision: str | None = None,
                        attn_implementation: str | None = None, **unsupported):
        """(model, processor): :meth:`FastLanguageModel.from_pretrained`'s model (its vision tower and projector
        kept in 16-bit under a 4-bit or FP8 base) and :func:`longrl.models.loading.load_processor`'s processor. A
        text-only model is refused before its weights load."""
        from ..models.loading import is_image_text_model, load_processor
        from ..models.vision import VisionModelError, supported_families

        _refuse(unsupported, "FastVisionModel.from_pretrained", LOAD_DEFAULTS)
        if not is_image_text_model(model_name, trust_remote_code, revision):
            raise VisionModelError(f"FastVisionModel.from_pretrained({model_name!r}): a text-only model (no vision "
                                   f"tower); use FastLanguageModel, or a vision-language model ({supported_families()})")
        model, _ = FastLanguageModel.from_pretrained(
            model_name, max_seq_length, dtype, load_in_4bit, load_in_fp8=load_in_fp8, device=device,
            trust_remote_code=trust_remote_code, revision=revision, attn_implementation=attn_implementation)
        return model, load_processor(model_name, revision=revision, trust_remote_code=trust_remote_code)

    @staticmethod
    def get_peft_model(model, r: int = 16, target_modules=None, lora_alpha: float = 16, lora_dropout: float = 0.0,
                       bias: str = "none", finetune_vision_layers: bool = True,
                       finetune_language_layers: bool = True, finetune_attention_modules: bool = True,
                       finetune_mlp_modules: bool = True, use_gradient_checkpointing=False, random_state: int = 3407,
                       use_rslora: bool = False, loftq_config=None, **unsupported):
        """``model`` with LoRA adapters: on the language model's attention and/or MLP projections
        (``finetune_attention_modules`` / ``finetune_mlp_modules``: q/k/v/o_proj, gate/up/down_proj; both: every
        linear layer; ``target_modules`` names them instead) and, with ``finetune_vision_layers``, on every linear
        layer of the vision tower and projector (``lora.vision_modules: tower_and_projector``; Unsloth's attention/MLP
        choice does not narrow the tower's). The language model always trains: ``finetune_language_layers=False``
        is refused."""
        _refuse(dict(unsupported, bias=bias, use_rslora=use_rslora, loftq_config=loftq_config),
                "FastVisionModel.get_peft_model", PEFT_DEFAULTS)
        if not finetune_language_layers:
            raise ValueError("FastVisionModel.get_peft_model(finetune_language_layers=False) is not supported by "
                             "longrl: adapters always go on the language model (the vision side is added with "
                             "finetune_vision_layers=True)")
        if target_modules not in (None, "all-linear"):
            targets = list(target_modules)
        elif finetune_attention_modules and finetune_mlp_modules:
            targets = ["all-linear"]
        elif finetune_attention_modules or finetune_mlp_modules:
            targets = list(ATTENTION_MODULES if finetune_attention_modules else MLP_MODULES)
        else:
            raise ValueError("FastVisionModel.get_peft_model: finetune_attention_modules and finetune_mlp_modules are "
                             "both False, so no language layer would train; set one of them True")
        vision = "tower_and_projector" if finetune_vision_layers else "none"
        return _with_adapters(model, targets, vision, r, lora_alpha, lora_dropout, use_gradient_checkpointing,
                              random_state)


LOAD_DEFAULTS = {"load_in_8bit": False, "full_finetuning": False, "token": None, "fast_inference": False}
PEFT_DEFAULTS = {"bias": "none", "use_rslora": False, "loftq_config": None, "max_seq_length": None}
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def _with_adapters(model, targets: list[str], vision_modules: str, r: int, lora_alpha: float, lora_dropout: float,
                   use_gradient_checkpointing, random_state: int):
    """``apply_lora`` with these settings (the adapters drawn from ``random_state``); transformers' checkpointing
    on when ``use_gradient_checkpointing`` is set."""
    import torch

    from ..config.schema import LoraConfig
    from ..models import apply_lora

    if use_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    torch.manual_seed(random_state)
    return apply_lora(model, LoraConfig(enabled=True, r=r, alpha=float(lora_alpha), dropout=lora_dropout,
                                        target_modules=targets, vision_modules=vision_modules))


def _refuse(given: dict, where: str, defaults: dict) -> None:
    for name, value in given.items():
        if name not in defaults:
            raise TypeError(f"{where}() got an argument longrl does not have: {name!r}")
        if value != defaults[name]:
            raise ValueError(f"{where}({name}={value!r}) is not supported by longrl; leave it at {defaults[name]!r}")
