"""Load a Hugging Face causal LM (local directory, hub id, GGUF file, the builtin demo model, or a longrl checkpoint
merged: models/from_checkpoint.py) with its tokenizer, and wrap it with LoRA adapters through PEFT."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ModelLoadError
from .fp8 import quantize_model_fp8
from .from_checkpoint import checkpoint_path, load_checkpoint_model, read_warm_start, tokenizer_source
from .gguf import GgufError, check_gguf_file, is_gguf, load_gguf_model, load_gguf_tokenizer
from .quantize import (QuantizationError, calibration_ids, choose_exceptions, disable_cpu_repacking, quantize_model,
                       require_bitsandbytes)
from .structure import base_model
from .tiny import TINY_NAME, build_tiny_model
from .tiny_vision import TINY_VISION_NAME, build_tiny_vision_model, build_vision_processor, build_vision_tokenizer
from .vision.adapters import lora_targets
from .vision.families import FAMILIES, VisionModelError, vision_family

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    """``auto``: cuda if available, else cpu. A device this host does not have raises :class:`ModelLoadError`
    naming ``model.device`` (before any model loads)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ModelLoadError(f"config key 'model.device': {device!r} is not a device ({e}); use auto, cpu, cuda or "
                             "cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ModelLoadError(f"config key 'model.device': {device!r} but this host has no usable CUDA device "
                                 "(torch.cuda.is_available() is False); use model.device=cpu or auto")
        if dev.index is not None and dev.index >= count:
            raise ModelLoadError(f"config key 'model.device': {device!r} but this host has {count} CUDA device(s) "
                                 f"(cuda:0 to cuda:{count - 1})")
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ModelLoadError(f"config key 'model.device': {device!r} but MPS is not available here")
    elif dev.type not in ("cpu", "cuda", "mps"):
        available = getattr(torch, dev.type, None)
        if available is None or not getattr(available, "is_available", lambda: False)():
            raise ModelLoadError(f"config key 'model.device': {device!r} is not available on this host")
    return dev


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_safetensors_file(path: Path) -> None:
    """Raise :class:`ModelLoadError` naming ``path`` when it is not a whole safetensors file: its header (8-byte
    length + JSON) must parse and its tensors must end where the file does (a cut-short download or copy)."""
    import json
    import struct

    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(size - 8, 100 << 20):
                raise ValueError(f"header of {n} bytes in a {size}-byte file")
            header = json.loads(f.read(n))
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as e:
        raise ModelLoadError(f"model file {path} is corrupted or cut short: not a safetensors file ({e})") from None
    if 8 + n + max(ends, default=0) != size:
        raise ModelLoadError(f"model file {path} is cut short or corrupted: its header describes "
                             f"{8 + n + max(ends, default=0):,} bytes, the file has {size:,}")


BUILTIN_MODELS = (TINY_NAME, TINY_VISION_NAME)  # built in code: the demos' models


def _build_builtin(name_or_path: str, seed: int, dtype: torch.dtype):
    """(model, tokenizer) of a builtin model, weights drawn from ``seed`` (the vision model's tokenizer is its
    processor's: :func:`load_processor` gives the processor)."""
    if name_or_path == TINY_VISION_NAME:
        model, processor = build_tiny_vision_model(seed=seed, dtype=dtype)
        return model, processor.tokenizer
    return build_tiny_model(seed=seed, dtype=dtype)


def check_model_files(name_or_path: str) -> None:
    """Cheap checks of a model reference before anything loads: unknown ``builtin:`` names; a GGUF file that is
    missing, not GGUF or unreadable without the gguf package; another file where a model directory belongs; a
    directory without config.json or tokenizer files; cut-short safetensors files."""
    if name_or_path.startswith("builtin:"):
        if name_or_path not in BUILTIN_MODELS:
            raise ModelLoadError(f"config key 'model.name_or_path': unknown builtin model {name_or_path!r}; "
                                 f"builtin models: {', '.join(BUILTIN_MODELS)}")
        return
    if (warm := read_warm_start(name_or_path)) is not None:  # a longrl checkpoint or run, merged at load
        return check_model_files(warm.base)
    if is_gguf(name_or_path):
        try:
            check_gguf_file(name_or_path)
        except GgufError as e:
            raise ModelLoadError(f"config key 'model.name_or_path': {e}") from None
        return
    path = Path(name_or_path).expanduser()
    if path.is_file():
        raise ModelLoadError(f"config key 'model.name_or_path': {name_or_path} is a file; give the model's directory "
                             f"(the one holding config.json{', i.e. ' + str(path.parent) if path.parent != Path('.') else ''})"
                             " or a .gguf file")
    if not path.is_dir():
        if _looks_local(name_or_path):
            raise ModelLoadError(f"config key 'model.name_or_path': model directory not found: {name_or_path}")
        return  # a hub id: resolved by transformers
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {name_or_path} has no config.json: not a Hugging Face model directory")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelLoadError(f"model directory {name_or_path} has no tokenizer files (one of "
                             f"{', '.join(TOKENIZER_FILES)}); save the tokenizer beside the model "
                             "(tokenizer.save_pretrained(dir))")
    for f in sorted(path.glob("*.safetensors")):
        check_safetensors_file(f)


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
               attn_implementation: str | None = None, gradient_checkpointing: bool = False, seed: int = 0,
               load_in_4bit: bool = False, quant_keep_modules: list[str] = (), quant_exception_budget: float = 0.10,
               quant_calibration_text: str | None = None, load_in_fp8: bool = False):
    """Return (model, tokenizer). ``lora``: a :class:`longrl.config.schema.LoraConfig` (or None for no adapters).

    The model is a ``peft.PeftModel`` when LoRA is enabled, else the plain transformers model; its base
    weights are frozen under LoRA. ``builtin:tiny-arith`` builds the demo model from ``seed``; a ``.gguf`` file
    loads dequantized to ``dtype``, its tokenizer and chat template from its metadata (:mod:`longrl.models.gguf`).

    ``load_in_4bit``: linear layers in bitsandbytes NF4 (double quantization) computing in ``dtype`` (auto:
    bf16 on CUDA, fp32 on CPU), except the LM head, MoE routers, ``quant_keep_modules`` and the most
    quantization-sensitive modules that fit in ``quant_exception_budget`` (see :mod:`longrl.models.quantize`;
    calibration on ``quant_calibration_text`` or on token ids drawn from the vocabulary). The choice is logged and
    kept as ``base_model(model).longrl_quant_report``.

    ``load_in_fp8``: the same linear layers in FP8 e4m3 with a scale per 128 × 128 block (:mod:`longrl.models.fp8`,
    the same exceptions scored with FP8's round trip), quantized in place from the 16-bit weights loaded to host
    memory, one matrix at a time on the device.
    """
    dev = resolve_device(device)
    check_model_files(name_or_path)
    image_text = is_image_text_model(name_or_path, trust_remote_code, revision)  # an unsupported VLM stops here
    torch_dtype = resolve_dtype(dtype, dev)
    quant = dict(keep_modules=list(quant_keep_modules), exception_budget=quant_exception_budget,
                 calibration_text=quant_calibration_text)
    if load_in_4bit and load_in_fp8:
        raise ModelLoadError("config keys 'model.load_in_4bit' and 'model.load_in_fp8' are both true: a base is "
                             "quantized one way; set one of them false")
    if load_in_4bit:
        _quantize_or_fail(require_bitsandbytes)
        if is_gguf(name_or_path):
            raise ModelLoadError("config key 'model.load_in_4bit': a GGUF file loads dequantized to model.dtype; "
                                 "4-bit (NF4) loading needs a Hugging Face model directory or hub id")
    if name_or_path in BUILTIN_MODELS or checkpoint_path(name_or_path):  # built in code, or a checkpoint merged
        model, tokenizer = (_build_builtin(name_or_path, seed, torch_dtype) if name_or_path in BUILTIN_MODELS else
                            load_checkpoint_model(name_or_path, load_model, torch_dtype, dev, trust_remote_code,
                                                  attn_implementation))
        if load_in_4bit:  # in memory: quantized in place through bitsandbytes' Linear4bit
            model.to(dev)
            model.longrl_quant_report = _quantize_or_fail(_quantize_built, model, tokenizer, dev, torch_dtype, **quant)
    elif load_in_4bit:
        model, tokenizer = _load_pretrained_4bit(name_or_path, torch_dtype, dev, trust_remote_code, revision,
                                                 attn_implementation, image_text=image_text, **quant)
    elif is_gguf(name_or_path):
        model, tokenizer = _load_gguf(name_or_path, torch_dtype, attn_implementation)
    else:
        model, tokenizer = _load_pretrained(name_or_path, torch_dtype, trust_remote_code, revision, attn_implementation,
                                            image_text=image_text)
    if load_in_fp8:  # from host memory: quantized onto the device one matrix at a time, the rest moved after
        model.longrl_quant_report = _quantize_or_fail(_quantize_fp8, model, tokenizer, dev, torch_dtype, **quant)
    elif not load_in_4bit:
        model.to(dev)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora is not None and lora.enabled:
        model = apply_lora(model, lora)
    return model, tokenizer


MODEL_KEYS = ("dtype", "trust_remote_code", "revision", "attn_implementation", "load_in_4bit", "quant_keep_modules",
              "quant_exception_budget", "quant_calibration_text", "load_in_fp8")  # the model.* keys load_model takes as they are


def model_settings(model_cfg) -> dict:
    """load_model's keyword arguments from a ``model:`` config section (MODEL_KEYS)."""
    return {key: getattr(model_cfg, key) for key in MODEL_KEYS}


def is_image_text_model(name_or_path: str, trust_remote_code: bool, revision: str | None) -> bool:
    """Whether a Hugging Face model directory or hub id is a supported vision-language model (:func:`image_text_family`
    is not None)."""
    return image_text_family(name_or_path, trust_remote_code, revision) is not None


def image_text_family(name_or_path: str, trust_remote_code: bool, revision: str | None):
    """The VisionFamily of a Hugging Face model directory or hub id, read from its config alone (no weights); None
    for a text model. Another model with a vision part raises :class:`VisionModelError` listing the supported
    families. A longrl checkpoint is what its base is (down its chain of warm starts); builtin:tiny-vision is a
    LLaVA, builtin:tiny-arith and GGUF files are text models."""
    if name_or_path == TINY_VISION_NAME:
        return FAMILIES["llava"]
    if (warm := read_warm_start(name_or_path)) is not None:
        return image_text_family(warm.base, trust_remote_code, warm.model.get("revision"))
    if name_or_path == TINY_NAME or is_gguf(name_or_path):
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not read the config of {name_or_path!r}: {str(e)[:500]}") from e
    try:
        return vision_family(config)
    except VisionModelError as e:
        raise VisionModelError(f"config key 'model.name_or_path': {name_or_path}: {e}") from None


def _load_pretrained(name, torch_dtype, trust_remote_code, revision, attn_implementation, image_text=False,
                     **model_kwargs):
    """(model, tokenizer) through transformers' Auto classes: a causal LM, or with ``image_text`` an image-text-to-
    text model (its processor: :func:`load_processor`)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    path = Path(name).expanduser()
    if _looks_local(name) and not path.exists():
        raise ModelLoadError(f"model directory not found: {name}")
    if path.exists() and path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {name} has no config.json: not a Hugging Face model directory")
    kwargs = dict(trust_remote_code=trust_remote_code, revision=revision)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.exists() else name, **kwargs)
        auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
        model = auto.from_pretrained(str(path) if path.exists() else name, dtype=torch_dtype,
                                     attn_implementation=attn_implementation, **kwargs, **model_kwargs)
    except Exception as e:  # OSError, ValueError, SafetensorError, a corrupted file's RuntimeError
        raise ModelLoadError(f"could not load model {name!r}: {type(e).__name__}: {str(e)[:500]}") from e
    return model, tokenizer


def _load_gguf(path, torch_dtype, attn_implementation):
    try:
        tokenizer = load_gguf_tokenizer(path)
        model = load_gguf_model(path, torch_dtype, attn_implementation)
    except GgufError as e:
        raise ModelLoadError(f"config key 'model.name_or_path': {e}") from e
    log.info("loaded %s: %s dequantized to %s", path, type(model).__name__, str(torch_dtype).removeprefix("torch."))
    return model, tokenizer


def load_tokenizer(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False):
    """The tokenizer of a model reference (builtin, GGUF file, directory, hub id, or a longrl checkpoint: its base's
    tokenizer), pad token set to EOS when it has none, as :func:`load_model` returns it."""
    from .tiny import build_char_tokenizer

    if checkpoint_path(name_or_path) is not None:  # a checkpoint holds no tokenizer files: its base's
        name_or_path, revision = tokenizer_source(name_or_path)
    if name_or_path == TINY_NAME:
        tokenizer = build_char_tokenizer()
    elif name_or_path == TINY_VISION_NAME:
        tokenizer = build_vision_tokenizer()
    elif is_gguf(name_or_path):
        try:
            tokenizer = load_gguf_tokenizer(name_or_path)
        except GgufError as e:
            raise ModelLoadError(str(e)) from e
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision,
                                                      trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"could not load the tokenizer of {name_or_path!r}: {e}") from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_processor(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False):
    """The processor (tokenizer + image processor) of a vision-language model reference (a directory, hub id, or a
    longrl checkpoint: its base's)."""
    if checkpoint_path(name_or_path) is not None:
        name_or_path, revision = tokenizer_source(name_or_path)
    if name_or_path == TINY_VISION_NAME:
        return build_vision_processor()
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        raise ModelLoadError(f"could not load the processor of {name_or_path!r}: {type(e).__name__}: {e}") from e
    if not hasattr(processor, "image_processor"):
        raise VisionModelError(f"{name_or_path!r} has no image processor: its processor is a "
                               f"{type(processor).__name__}")
    tokenizer = processor.tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return processor


def _quantize_or_fail(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except QuantizationError as e:
        raise ModelLoadError(str(e)) from e


def _quantize_built(model, tokenizer, dev, torch_dtype, *, keep_modules, exception_budget, calibration_text):
    ids = calibration_ids(tokenizer, calibration_text).to(dev)
    return quantize_model(model, ids, keep_modules=keep_modules, exception_budget=exception_budget,
                          compute_dtype=torch_dtype)


def _quantize_fp8(model, tokenizer, dev, torch_dtype, *, keep_modules, exception_budget, calibration_text):
    ids = calibration_ids(tokenizer, calibration_text)
    return quantize_model_fp8(model, ids, keep_modules=keep_modules, exception_budget=exception_budget,
                              compute_dtype=torch_dtype, device=dev)


def _load_pretrained_4bit(name, torch_dtype, dev, trust_remote_code, revision, attn_implementation, *,
                          keep_modules, exception_budget, calibration_text, image_text=False):
    """Score on a 16-bit copy in host memory, then load in NF4 through transformers' ``BitsAndBytesConfig``.

    The 16-bit copy stays on the CPU and runs one decoder layer at a time on ``dev`` (``layers_streamed_to``), so
    the accelerator never holds more than the final 4-bit model plus one 16-bit layer; host memory peaks at one
    16-bit copy, as a plain load to the CPU would. The copy is freed before the 4-bit load streams the weights
    from disk again.
    """
    from transformers import BitsAndBytesConfig

    model16, tokenizer = _load_pretrained(name, torch_dtype, trust_remote_code, revision, attn_implementation,
                                          image_text=image_text)  # (the same class, so the same module names)
    ids = calibration_ids(tokenizer, calibration_text)
    report = _quantize_or_fail(choose_exceptions, model16, ids, keep_modules=keep_modules,
                               exception_budget=exception_budget, compute_dtype=torch_dtype, device=dev)
    del model16
    skip = [re.escape(n) for n in sorted(report.kept)]  # transformers reads the entries as anchored regexes
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch_dtype, bnb_4bit_quant_storage=torch.uint8,
                                llm_int8_skip_modules=skip)
    model, tokenizer = _load_pretrained(name, torch_dtype, trust_remote_code, revision, attn_implementation,
                                        image_text=image_text, quantization_config=config, device_map={"": dev})
    kept16 = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    if kept16 != set(report.kept):
        raise ModelLoadError(f"4-bit load of {name!r} kept {sorted(kept16 ^ set(report.kept))[:5]} differently "
                             "from the chosen exceptions")
    disable_cpu_repacking(model)
    report.log()
    model.longrl_quant_report = report
    return model, tokenizer


def apply_lora(model, lora):
    """Wrap ``model`` with PEFT LoRA adapters (r, alpha, dropout, target modules; 'all-linear' by default).

    A vision-language model gets them on its language model's linear layers (those ``lora.target_modules`` names)
    and on its vision modules as ``lora.vision_modules`` says (models/vision/adapters.py)."""
    import peft

    targets = lora.target_modules
    target = "all-linear" if targets == ["all-linear"] else list(targets)
    vision_modules = getattr(lora, "vision_modules", "none")
    family = vision_family(base_model(model).config)
    if family is not None:
        try:
            target = lora_targets(model, family, targets, vision_modules)
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
    elif vision_modules != "none":
        raise VisionModelError(f"config key 'lora.vision_modules': {vision_modules} but "
                               f"{base_model(model).config.model_type!r} is a text-only model (no vision tower); "
                               "use none")
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target,
                             task_type="CAUSAL_LM", bias="none")
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:
        raise ModelLoadError(f"config key 'lora.target_modules': {e}") from e
    if model.get_output_embeddings().weight.dtype in (torch.bfloat16, torch.float16):
        # longrl runs 16-bit bases under autocast (policy.compute_context). A 4-bit base qualifies too: its LM head
        # stays in the compute dtype, its NF4 layers dequantize to it, and PEFT's Linear4bit LoRA skips its float32
        # cast under autocast; this skips the cast under autocast for the 16-bit exceptions' plain LoRA Linear
        # layers as well, and keeps it outside (a user's model.generate after training: 16-bit inputs, float32 A).
        set_lora_input_casting(wrapped, None)
    return wrapped


def ensure_adapters(model, lora):
    """A model given ready-made, checked against ``lora`` (a :class:`longrl.config.schema.LoraConfig`): adapters added when
    LoRA is enabled and it has none (never silent full-weight training), refused when it has adapters but LoRA is
    disabled."""
    has_adapters = hasattr(model, "peft_config")
    if lora.enabled and not has_adapters:
        log.info("the given model has no adapters and lora.enabled=true: adding LoRA (r=%d, alpha=%g)", lora.r,
                 lora.alpha)
        return apply_lora(model, lora)
    if not lora.enabled and has_adapters:
        raise ModelLoadError("the given model is a PEFT model but lora.enabled=false: set lora.enabled=true to train "
                             "its adapters, or pass the base model (model.get_base_model()) for full-weight training")
    return model


def set_lora_input_casting(model, enabled: bool | None) -> None:
    """PEFT up-casts each LoRA layer's input to the (float32) adapter dtype: a float32 copy of every such
    activation. Under autocast the copy is unnecessary (autocast runs the adapters' products in the 16-bit dtype
    anyway); outside it a 16-bit input cannot meet float32 adapters without it. ``None``: cast only
    outside autocast, decided at each call by a forward pre-hook on each LoRA layer (PEFT's
    ``cast_input_dtype_enabled``); ``True`` / ``False``: always / never (PEFT's default is always)."""
    for module in model.modules():
        if hasattr(module, "lora_A"):
            module.longrl_input_casting = enabled
            if not hasattr(module, "longrl_casting_hook"):
                module.longrl_casting_hook = module.register_forward_pre_hook(_decide_input_casting)


def _decide_input_casting(module, args) -> None:
    """Forward pre-hook of a LoRA layer: PEFT's input cast on unless ``longrl_input_casting`` says otherwise, or is
    None and autocast is on for the layer's device."""
    mode = module.longrl_input_casting
    if mode is None:
        weight = next(iter(module.lora_A.values()), None)
        device = weight.weight.device.type if weight is not None else "cpu"
        mode = not torch.is_autocast_enabled(device)
    module.cast_input_dtype_enabled = mode


@dataclass(frozen=True)
class LogitSpec:
    """How the model turns the last hidden state into logits: softcap(multiplier · head(h))."""

    multiplier: float = 1.0
    softcap: float | None = None


def logit_spec(config) -> LogitSpec:
    """How a model of this transformers ``config`` makes its logits from lm_head(h). A supported vision-language
    model's are lm_head(h) alone: its ...ForConditionalGeneration forward scales and caps none, whatever its text
    config says (Gemma3ForCausalLM applies final_logit_softcapping, Gemma3ForConditionalGeneration does not)."""
    if getattr(config, "model_type", None) in FAMILIES:
        return LogitSpec()
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    multiplier = 1.0
    if getattr(text_cfg, "logit_scale", None):  # Cohere: logits * logit_scale
        multiplier = float(text_cfg.logit_scale)
    if getattr(text_cfg, "logits_scaling", None):  # Granite: logits / logits_scaling
        multiplier = 1.0 / float(text_cfg.logits_scaling)
    softcap = getattr(text_cfg, "final_logit_softcapping", None)
    return LogitSpec(multiplier, float(softcap) if softcap else None)


def model_parts(model):
    """(backbone, lm_head, LogitSpec) of a causal LM: the backbone returns the final (normed) hidden states."""
    base = base_model(model)
    return base.get_decoder(), base.get_output_embeddings(), logit_spec(base.config)
