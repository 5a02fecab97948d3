"""A run's memory layout and GPU budget: what the planner chose, what the user pinned, and the cap that holds it.

On CUDA the planner (memory/planner.py: plan_for_config) decides every layout key left null or 0 —
model.gradient_checkpointing, model.offload_activations, model.gpu_resident_layers, model.no_recompute_layers,
model.reuse_attention, train.micro_batch_tokens, train.mlp_tile_tokens — for the memory the run may use:
train.gpu_memory_gib when set (capped at what is free), else what is free. A pinned key is an input to the plan,
never overridden. With a budget the caching allocator is capped too (torch.cuda.set_per_process_memory_fraction: an
allocation past the budget raises out-of-memory), and the sampler sizes its KV cache within it. On the CPU nothing
is planned: null layout keys mean off (attention reuse: on with offloading).
"""

from __future__ import annotations

import logging

import torch

from .planner import GIB, Plan, plan_for_config

log = logging.getLogger(__name__)


def budget_bytes(cfg) -> int | None:
    """train.gpu_memory_gib in bytes (None: no budget)."""
    return int(cfg.train.gpu_memory_gib * GIB) if cfg.train.gpu_memory_gib > 0 else None


def usable_gpu_bytes(cfg, device: torch.device) -> int:
    """What this process may hold on ``device``: what it holds plus what is free, at most the budget."""
    have = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_allocated(device)
    cap = budget_bytes(cfg)
    return have if cap is None else min(have, cap)


def cap_allocator(cfg, device: torch.device) -> float | None:
    """Cap the caching allocator of ``device`` at the budget (the fraction of the device set; None: no budget)."""
    cap = budget_bytes(cfg)
    if cap is None or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()  # the call wants an index
    fraction = min(1.0, cap / torch.cuda.get_device_properties(index).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def resolve_layout(cfg, model_config, device: torch.device, world_size: int = 1,
                   length_key: str = "generation.max_completion_length") -> Plan | None:
    """Fill the config's null layout keys in place: on CUDA from the plan (returned; PlanError when the job cannot
    fit, naming ``length_key`` to shorten), on the CPU with off (None returned). ``world_size``: the plan of one GPU
    of a data-parallel job."""
    m = cfg.model
    if device.type != "cuda":
        m.offload_activations = bool(m.offload_activations)
        m.gradient_checkpointing = bool(m.gradient_checkpointing) or m.offload_activations  # offloading recomputes
        if m.reuse_attention is None:  # nothing to plan: on with offloading
            m.reuse_attention = m.offload_activations
        if m.no_recompute_layers is None:
            m.no_recompute_layers = 0
        return None
    plan = plan_for_config(cfg, model_config, usable_gpu_bytes(cfg, device), world_size=world_size,
                           length_key=length_key)
    m.offload_activations = plan.offload
    m.gradient_checkpointing = plan.checkpointing  # layers recomputed (offloading installs its own checkpointing)
    if m.reuse_attention is None:
        m.reuse_attention = plan.reuse_attention
    if cfg.train.micro_batch_tokens == 0:
        cfg.train.micro_batch_tokens = plan.micro_batch_tokens
    if not m.gpu_resident_layers:
        m.gpu_resident_layers = plan.gpu_resident_layers
    if m.no_recompute_layers is None:
        m.no_recompute_layers = plan.no_recompute_layers
    if cfg.train.mlp_tile_tokens is None:
        cfg.train.mlp_tile_tokens = plan.mlp_tile_tokens or 0
    log.info("memory plan:\n%s", plan.table())
    return plan
