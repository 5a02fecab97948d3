"""What every recipe (GRPO, SFT) does to get its model: the device, the GPU budget, the memory layout planned
before the weights load (a job that cannot fit fails first), the model with its adapters, then the layout
installed on it (offloaded checkpointing, MLP tiles) and the fused training layers."""

from __future__ import annotations

import copy
import logging

from ..memory import enable_mlp_tiling, enable_offloaded_checkpointing, keep_last_layers_whole
from ..memory.layout import cap_allocator, resolve_layout
from ..memory.planner import model_config_of
from ..models import base_model, load_model, resolve_device
from ..models.fused_layers import enable_fused_layers
from ..rollout.sampling import triton_available

log = logging.getLogger(__name__)


def _config_or_none(model_cfg):
    """The transformers config of the model to load, without its weights (None when it cannot be read: the loader
    then reports why)."""
    try:
        return model_config_of(model_cfg.name_or_path, model_cfg.trust_remote_code)
    except Exception:  # noqa: BLE001 - load_model raises the clear error
        return None


def transformers_checkpointing(model_cfg) -> bool:
    """Whether the layout recomputes layers through transformers' own checkpointing: gradient checkpointing without
    offloading. Offloading installs its own checkpoint function; transformers' would also make the embeddings'
    output require grad (one more input gradient)."""
    return bool(model_cfg.gradient_checkpointing) and not model_cfg.offload_activations


SFT_LENGTH_KEY = "sft.max_length"  # what a refused supervised plan tells the user to shorten


def sft_planning_view(cfg):
    """The config as the planner sees a supervised step: sft.examples_per_step sequences of sft.max_length
    tokens, no rollout phase."""
    view = copy.deepcopy(cfg)
    view.data.max_prompt_length, view.generation.max_completion_length = 1, max(1, cfg.sft.max_length - 1)
    view.train.prompts_per_step, view.grpo.num_generations = cfg.sft.examples_per_step, 1
    view.generation.backend = "hf"
    return view


def _resolve(cfg, model_config, device, recipe: str, world_size: int = 1):
    if recipe != "sft":
        return resolve_layout(cfg, model_config, device, world_size)
    view = sft_planning_view(cfg)
    plan = resolve_layout(view, model_config, device, length_key=SFT_LENGTH_KEY)
    for section, keys in (("model", ("offload_activations", "gradient_checkpointing", "gpu_resident_layers",
                                     "no_recompute_layers", "reuse_attention")),
                          ("train", ("micro_batch_tokens", "mlp_tile_tokens"))):
        for key in keys:
            setattr(getattr(cfg, section), key, getattr(getattr(view, section), key))
    return plan


def build_policy_model(cfg, model=None, tokenizer=None, recipe: str = "grpo", device: str | None = None,
                       world_size: int = 1):
    """(model, tokenizer, device, plan, offloader) for ``cfg``; a given ``model`` is used as it is (the layout is
    still installed), a given ``tokenizer`` replaces the loaded one. Null layout keys of ``cfg`` are filled in place (memory/layout.py)."""
    device_name = device or cfg.model.device  # a data-parallel rank: its own cuda:LOCAL_RANK
    device = resolve_device(device_name)
    cap_allocator(cfg, device)  # train.gpu_memory_gib: an allocation past the budget fails
    plan, planned = None, False
    if device.type != "cuda":  # nothing to plan: null layout keys are off
        plan, planned = _resolve(cfg, None, device, recipe, world_size), True
    elif model is None:  # plan from the model's config: a job that cannot fit fails before the weights load
        model_config = _config_or_none(cfg.model)
        if model_config is not None:
            plan, planned = _resolve(cfg, model_config, device, recipe, world_size), True
    if model is None:
        m = cfg.model
        model, loaded = load_model(m.name_or_path, lora=cfg.lora, dtype=m.dtype, device=device_name,
                                      trust_remote_code=m.trust_remote_code, revision=m.revision,
                                      attn_implementation=m.attn_implementation,
                                      gradient_checkpointing=transformers_checkpointing(m),
                                      seed=cfg.train.seed,
                                      load_in_4bit=m.load_in_4bit, quant_keep_modules=m.quant_keep_modules,
                                      quant_exception_budget=m.quant_exception_budget,
                                      quant_calibration_text=m.quant_calibration_text)
        tokenizer = loaded if tokenizer is None else tokenizer
    if not planned:  # the same plan `longrl plan` prints
        plan = _resolve(cfg, base_model(model).config, device, recipe, world_size)
    whole = cfg.model.no_recompute_layers or 0  # the plan's on CUDA when it was null
    offloader = (enable_offloaded_checkpointing(model, cfg.model.gpu_resident_layers,
                                                reuse_attention=bool(cfg.model.reuse_attention), no_recompute=whole)
                 if cfg.model.offload_activations else None)
    if transformers_checkpointing(cfg.model):  # (0 too: a model given again keeps no stale flags)
        keep_last_layers_whole(model, whole)
    tile = cfg.train.mlp_tile_tokens  # the plan's on CUDA when it was null; 0 or None: off
    if tile:
        enable_mlp_tiling(model, tile)
    if cfg.model.fused_layers and device.type == "cuda" and triton_available():
        log.info("fused layers: %s", enable_fused_layers(model))
    return model, tokenizer, device, plan, offloader


def make_optimizer(model, train_cfg):
    """(trainable parameters, AdamW, its LambdaLR schedule) of ``model`` from the ``train:`` section."""
    import torch

    from ..recipes.grpo import lr_lambda

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    t = train_cfg
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                                  weight_decay=t.weight_decay)
    return params, optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(t.lr_scheduler_type, t.warmup_steps, t.max_steps))


def given_model(cfg, model, tokenizer, device, describe: bool, needed_tokens: tuple[int, str]):
    """(model, tokenizer) of a model passed in: on ``device``, with gradient checkpointing when cfg asks, with
    adapters when LoRA is on (``ensure_adapters``), with a tokenizer (TRL-style, the one saved with the model) that
    has a pad token. ``describe`` (TRL-style): cfg.model and cfg.lora are made to describe the model (checkpoints and
    export read them). ``needed_tokens``: (tokens a sequence may have, the keys that say so), checked against an
    Unsloth model's max_seq_length."""
    from ..config.errors import ConfigError
    from ..models import ensure_adapters

    base = base_model(model)
    if not getattr(base, "is_loaded_in_4bit", False) and not hasattr(base, "hf_device_map"):
        model.to(device)
    on = getattr(base, "is_activation_checkpointing", None)  # transformers 5 (is_gradient_checkpointing before)
    on = getattr(base, "is_gradient_checkpointing", True) if on is None else on
    if transformers_checkpointing(cfg.model) and not on:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.config.use_cache = False
    limit, (tokens, keys) = getattr(model, "max_seq_length", None), needed_tokens
    if limit and tokens > limit:
        raise ConfigError(f"{keys} = {tokens} is more than the model's max_seq_length={limit} "
                          "(FastLanguageModel.from_pretrained)")
    had_adapters = hasattr(model, "peft_config")
    model = ensure_adapters(model, cfg.lora)
    if describe:
        from ..compat.trl import describe_model, tokenizer_for

        describe_model(cfg, model, had_adapters)
        tokenizer = tokenizer_for(model) if tokenizer is None else tokenizer
    if tokenizer is None:
        raise ValueError("a model passed with a Config needs tokenizer= as well")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
