"""What every recipe (GRPO, SFT) does to get its model: the device, the GPU budget, the memory layout planned
before the weights load (a job that cannot fit fails first), the model with its adapters, then the layout
installed on it (offloaded checkpointing, MLP tiles) and the fused training layers."""

from __future__ import annotations

import logging

from ..memory import enable_mlp_tiling, enable_offloaded_checkpointing, keep_last_layers_whole
from ..memory.layout import Layout, cap_allocator, pinned_transformers_checkpointing, resolve_layout
from ..memory.planner import StepShape, model_config_of
from ..models import base_model, load_model, resolve_device
from ..models.loading import model_settings
from ..models.fused_layers import enable_fused_layers
from ..rollout.sampling import triton_available
from .cpu_threads import set_cpu_threads

log = logging.getLogger(__name__)


def _config_or_none(model_cfg):
    """The transformers config of the model to load, without its weights (None when it cannot be read: the loader
    then reports why)."""
    try:
        return model_config_of(model_cfg.name_or_path, model_cfg.trust_remote_code)
    except Exception:  # noqa: BLE001 - load_model raises the clear error
        return None


def build_policy_model(cfg, step: StepShape, model=None, tokenizer=None, device: str | None = None,
                       world_size: int = 1):
    """(model, tokenizer, device, layout, offloader) for ``cfg``, its memory layout planned for ``step`` (on CUDA:
    before the weights load when the model's config can be read, so a job that cannot fit fails first); a given
    ``model`` is used as it is (the layout is still installed), a given ``tokenizer`` replaces the loaded one."""
    set_cpu_threads(cfg.train.cpu_threads)  # once, before the first CPU-heavy work (training/cpu_threads.py)
    device_name = device or cfg.model.device  # a data-parallel rank: its own cuda:LOCAL_RANK
    device = resolve_device(device_name)
    cap_allocator(cfg, device)  # train.gpu_memory_gib: an allocation past the budget fails
    layout: Layout | None = None  # on the CPU it is resolved after the load, against the model's config
    if device.type == "cuda" and model is None:  # plan from the model's config: a job that cannot fit fails first
        model_config = _config_or_none(cfg.model)
        if model_config is not None:
            layout = resolve_layout(cfg, model_config, device, step, world_size)
    if model is None:
        m = cfg.model
        checkpointing = layout.transformers_checkpointing if layout else pinned_transformers_checkpointing(cfg)
        model, loaded = load_model(m.name_or_path, lora=cfg.lora, device=device_name,
                                   gradient_checkpointing=checkpointing, seed=cfg.train.seed, **model_settings(m))
        tokenizer = loaded if tokenizer is None else tokenizer
    if layout is None:  # the same plan `longrl plan` prints
        layout = resolve_layout(cfg, base_model(model).config, device, step, world_size)
    offloader = (enable_offloaded_checkpointing(model, layout.gpu_resident_layers,
                                                reuse_attention=layout.reuse_attention,
                                                no_recompute=layout.no_recompute_layers)
                 if layout.offload_activations else None)
    if layout.transformers_checkpointing:  # (0 too: a model given again keeps no stale flags)
        keep_last_layers_whole(model, layout.no_recompute_layers)
    if layout.mlp_tile_tokens:
        enable_mlp_tiling(model, layout.mlp_tile_tokens)
    if cfg.model.fused_layers and device.type == "cuda" and triton_available():
        log.info("fused layers: %s", enable_fused_layers(model))
    return model, tokenizer, device, layout, offloader


def given_model(cfg, model, tokenizer, device, needed_tokens: tuple[int, str]):
    """(model, tokenizer) of a model passed in: on ``device``, with gradient checkpointing when cfg pins it, with
    adapters when LoRA is on (``ensure_adapters``), with a tokenizer that has a pad token. ``needed_tokens``: (tokens
    a sequence may have, the keys that say so), checked against an Unsloth model's max_seq_length."""
    from ..config import ConfigError
    from ..models import ensure_adapters

    base = base_model(model)
    if not getattr(base, "is_loaded_in_4bit", False) and not hasattr(base, "hf_device_map"):
        model.to(device)
    on = getattr(base, "is_activation_checkpointing", None)  # transformers 5 (is_gradient_checkpointing before)
    on = getattr(base, "is_gradient_checkpointing", True) if on is None else on
    if pinned_transformers_checkpointing(cfg) and not on:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.config.use_cache = False
    limit, (tokens, keys) = getattr(model, "max_seq_length", None), needed_tokens
    if limit and tokens > limit:
        raise ConfigError(f"{keys} = {tokens} is more than the model's max_seq_length={limit} "
                          "(FastLanguageModel.from_pretrained)")
    model = ensure_adapters(model, cfg.lora)
    if tokenizer is None:
        raise ValueError("a model passed with a Config needs tokenizer= as well")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
