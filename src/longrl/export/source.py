"""Read a training checkpoint and rebuild what it trained: the base model named in its run config (the same
dtype, revision, seed for the builtin model, 4-bit or FP8 loading) with the checkpoint's adapter or full weights."""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..training.checkpoint import BASE_WEIGHTS_FILE, STATE_FILE, CheckpointError, check_finite, latest_checkpoint, \
    verify_checkpoint
from ..models import ModelLoadError, load_model
from ..models.fp8_linear import dequantize_fp8_linears
from ..models.structure import put_frozen_linear

log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """The export cannot be done; the message names the path, key or architecture."""


@dataclass(frozen=True)
class Checkpoint:
    """A validated ``checkpoint-STEP`` directory and the run config it was trained with."""

    path: Path
    config: dict  # the run's Config.to_dict()
    state: dict  # trainer_state.json
    trust_remote_code: bool = False  # the user's --trust-remote-code (never read from the checkpoint)

    @property
    def is_adapter(self) -> bool:
        return (self.path / "adapter_config.json").is_file()

    @property
    def model(self) -> dict:
        return self.config["model"]

    @property
    def base_name(self) -> str:
        return self.model["name_or_path"]

    @property
    def dtype(self) -> str:
        """The dtype the base weights had in training (recorded at save; else the config's, resolved on CPU)."""
        recorded = self.state.get("model_dtype")
        if recorded:
            return recorded
        return "float32" if self.model.get("dtype", "auto") == "auto" else self.model["dtype"]


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Validate ``path`` (a ``checkpoint-STEP`` directory, or a run's output directory: its latest checkpoint)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ExportError(f"checkpoint not found: {path}")
    if not (path / STATE_FILE).is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            raise ExportError(f"{path} is not a longrl checkpoint (no {STATE_FILE}) and holds no checkpoint-STEP")
        path = latest
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{path / STATE_FILE}: unreadable trainer state ({e})") from e
    config = state.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict) \
            or not config["model"].get("name_or_path"):
        raise ExportError(f"{path / STATE_FILE}: no run config with model.name_or_path (key 'config')")
    if state.get("base_gguf"):  # a GGUF base: the file trained on, found again and checked (models/gguf.py)
        from ..models.gguf import GgufError, recorded_gguf

        try:
            config["model"]["name_or_path"] = recorded_gguf(config["model"]["name_or_path"], state["base_gguf"])
        except GgufError as e:
            raise ExportError(f"checkpoint {path}: {e}") from None
    ckpt = Checkpoint(path, config, state)
    needed = ["adapter_config.json", "adapter_model.safetensors"] if ckpt.is_adapter else ["config.json", "model.safetensors"]
    missing = [name for name in needed if not (path / name).is_file()]
    if missing:
        raise ExportError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
    problem = verify_checkpoint(path)
    if problem:
        raise ExportError(f"checkpoint {path} does not verify: {problem}")
    _check_weights(path / needed[1])
    return ckpt


def _check_weights(path: Path) -> None:
    """A whole safetensors file with finite values (checked before any model loads)."""
    from safetensors import SafetensorError, safe_open

    from ..models import ModelLoadError
    from ..models.loading import check_safetensors_file

    try:
        check_safetensors_file(path)
        with safe_open(str(path), framework="pt") as f:  # a tensor at a time
            for name in f.keys():
                check_finite({name: f.get_tensor(name)}, str(path))
    except (ModelLoadError, CheckpointError, SafetensorError, OSError) as e:
        raise ExportError(f"checkpoint weights refused: {e}") from None


def check_remote_code(ckpt: Checkpoint, trust_remote_code: bool) -> None:
    """A checkpoint whose base needs custom code stops unless the user passed ``--trust-remote-code`` (a received
    checkpoint's own ``trust_remote_code`` is never obeyed)."""
    if ckpt.model.get("trust_remote_code") and not trust_remote_code:
        raise ExportError(f"checkpoint {ckpt.path} was trained on {ckpt.base_name!r} with "
                          "model.trust_remote_code=true: exporting it runs that model's own Python code. Pass "
                          "--trust-remote-code if you trust it (the checkpoint's setting is not taken)")


def load_tokenizer(ckpt: Checkpoint):
    """The base model's tokenizer (pad token set to eos when it has none, as in training)."""
    from ..models.loading import load_tokenizer as load_base_tokenizer

    try:
        return load_base_tokenizer(ckpt.base_name, revision=ckpt.model.get("revision"),
                                   trust_remote_code=ckpt.trust_remote_code)
    except ModelLoadError as e:
        raise ExportError(f"could not load the tokenizer of base model {ckpt.base_name!r}: {e}") from e


def is_vision_checkpoint(ckpt: Checkpoint) -> bool:
    """Whether the checkpoint trained a vision-language model (read from its base's config: no weights)."""
    from ..models.loading import is_image_text_model

    try:
        return is_image_text_model(ckpt.base_name, ckpt.trust_remote_code, ckpt.model.get("revision"))
    except ModelLoadError as e:
        raise ExportError(f"base model of {ckpt.path}: {e}") from e


def load_processing(ckpt: Checkpoint):
    """What turns the trained model's inputs into tokens: a vision-language model's processor (tokenizer, image
    processor, chat template), else the tokenizer (:func:`load_tokenizer`)."""
    if not is_vision_checkpoint(ckpt):
        return load_tokenizer(ckpt)
    from ..models.loading import load_processor

    try:
        return load_processor(ckpt.base_name, revision=ckpt.model.get("revision"),
                              trust_remote_code=ckpt.trust_remote_code)
    except ModelLoadError as e:
        raise ExportError(f"could not load the processor of base model {ckpt.base_name!r}: {e}") from e


def load_base(ckpt: Checkpoint, device: str = "cpu"):
    """The base model exactly as training loaded it, without adapters.

    Every ``model.*`` config key that :func:`longrl.models.load_model` accepts is passed on (so 4-bit loading
    options follow the run); the builtin model is rebuilt from ``train.seed`` and, when the checkpoint carries
    them, its saved base weights are loaded over it.
    """
    accepted = set(inspect.signature(load_model).parameters) - {"name_or_path", "lora", "device", "dtype", "seed",
                                                                 "gradient_checkpointing", "attn_implementation"}
    kwargs = {k: v for k, v in ckpt.model.items() if k in accepted}
    kwargs["trust_remote_code"] = ckpt.trust_remote_code  # the user's flag, never the checkpoint's
    if ckpt.state.get("quant_kept") is not None:  # the 16-bit exceptions training chose, not a re-scoring here
        kwargs.update(quant_keep_modules=list(ckpt.state["quant_kept"]), quant_exception_budget=0.0)
    try:
        model, _ = load_model(ckpt.base_name, lora=None, dtype=ckpt.dtype, device=device,
                              seed=int(ckpt.config.get("train", {}).get("seed", 0)), **kwargs)
    except ModelLoadError as e:
        raise ExportError(f"base model of {ckpt.path}: {e}") from e
    saved = ckpt.path / BASE_WEIGHTS_FILE
    if saved.is_file():
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(saved), device=str(device)), strict=True)
    return model


def load_trained(ckpt: Checkpoint, device: str = "cpu", dequantize: bool = False):
    """The trained model: a ``peft.PeftModel`` on the base (adapter checkpoints) or the full model.

    ``dequantize``: replace 4-bit bitsandbytes layers and FP8 layers (models/fp8_linear.py) of the base by
    16/32-bit ``nn.Linear`` holding their dequantized weights before the adapter goes on, so that a merge adds the adapter to exactly the weights
    training saw (rather than re-quantizing the sum).
    """
    if not ckpt.is_adapter:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from ..models.loading import DTYPES

        auto = AutoModelForImageTextToText if is_vision_checkpoint(ckpt) else AutoModelForCausalLM
        return auto.from_pretrained(str(ckpt.path), dtype=DTYPES.get(ckpt.dtype, torch.float32)).to(device)
    from peft import PeftModel

    base = load_base(ckpt, device)
    if dequantize:
        dequantize_4bit_linears(base)
        dequantize_fp8_linears(base)
    return PeftModel.from_pretrained(base, str(ckpt.path), is_trainable=False)


def dequantize_4bit_linears(model, dtype: torch.dtype | None = None) -> int:
    """Replace every bitsandbytes ``Linear4bit`` in ``model`` by an ``nn.Linear`` with its dequantized weight
    (``bitsandbytes.functional.dequantize_4bit``); return how many were replaced."""
    try:
        import bitsandbytes as bnb
        from bitsandbytes.functional import dequantize_4bit
    except ImportError:
        return 0  # without bitsandbytes there can be no 4-bit layers
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    for name, module in targets:
        data, state = module.weight.data, module.weight.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            # a layer that has run on the CPU holds bitsandbytes' repacked CPU layout; its own inverse (which it
            # also applies before saving a state dict) gives back the standard layout dequantize_4bit reads
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            data, state = _convert_weight_packed_for_cpu_inverse(data, state)
        weight = dequantize_4bit(data, state)
        out_dtype = dtype or getattr(module, "compute_dtype", None) or weight.dtype
        put_frozen_linear(model, name, weight, module.bias, out_dtype)
    if targets:
        log.info("dequantized %d 4-bit linear layers for the merge", len(targets))
        if hasattr(model, "is_loaded_in_4bit"):
            model.is_loaded_in_4bit = False
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "quantization_config", None) is not None:
            del config.quantization_config
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
    return len(targets)


def merged_model(ckpt: Checkpoint, device: str = "cpu"):
    """A plain float32 transformers model with the adapter merged in (PEFT ``merge_and_unload``)."""
    model = load_trained(ckpt, device, dequantize=True)
    model = model.float()
    if ckpt.is_adapter:
        model = model.merge_and_unload()
    model.eval()
    return model
