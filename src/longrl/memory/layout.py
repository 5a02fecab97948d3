"""A run's memory layout and GPU budget: what the planner chose, what the user pinned, and the cap that holds it.

On CUDA the planner (memory/planner.py: plan_for_config) decides every layout key left null or 0 —
model.gradient_checkpointing, model.offload_activations, model.gpu_resident_layers, model.no_recompute_layers,
model.reuse_attention, train.micro_batch_tokens, train.mlp_tile_tokens — for the memory the run may use:
train.gpu_memory_gib when set (capped at what is free), else what is free. A pinned key is an input to the plan,
never overridden. On the CPU nothing is planned: null layout keys mean off (attention reuse: on with offloading).
The result is a :class:`Layout` value handed to model set-up and the recipes; the config is never written (a run
saves its config.yaml as asked and its layout.yaml beside it). With a budget the caching allocator is capped too
(torch.cuda.set_per_process_memory_fraction: an allocation past the budget raises out-of-memory), and the sampler
sizes its KV cache within it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from .planner import GIB, Plan, StepShape, plan_for_config, shared_prompt_applies

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


@dataclass(frozen=True)
class Layout:
    """How a run holds its activations: the planner's choices and the user's pinned keys, resolved."""
    offload_activations: bool  # layer inputs checkpointed to pinned host memory (memory/offload.py)
    gradient_checkpointing: bool  # layers recomputed in the backward (offloaded or plain)
    gpu_resident_layers: int  # offloaded checkpointing: layer inputs kept on the GPU
    no_recompute_layers: int  # the last layers not checkpointed (every activation kept)
    reuse_attention: bool  # offloaded layers keep their attention outputs (memory/attention_reuse.py)
    micro_batch_tokens: int  # token budget of a micro-batch; 0: train.micro_batch_size sequences
    mlp_tile_tokens: int  # MLP sequence tile (memory/tiling.py); 0: untiled
    shared_prompt: bool = False  # the log-prob passes run grouped rows, each prompt once (models/shared_prompt.py)
    plan: Plan | None = dataclasses.field(default=None, compare=False)  # the planner's, on CUDA

    @property
    def transformers_checkpointing(self) -> bool:
        """Layers recomputed through transformers' own checkpointing: checkpointing without offloading (offloading
        installs its own checkpoint function)."""
        return self.gradient_checkpointing and not self.offload_activations

    def to_dict(self) -> dict:
        """The resolved keys by their config names, and whether a plan chose them (layout.yaml)."""
        return {"model.offload_activations": self.offload_activations,
                "model.gradient_checkpointing": self.gradient_checkpointing,
                "model.gpu_resident_layers": self.gpu_resident_layers,
                "model.no_recompute_layers": self.no_recompute_layers,
                "model.reuse_attention": self.reuse_attention,
                "train.micro_batch_tokens": self.micro_batch_tokens,
                "train.mlp_tile_tokens": self.mlp_tile_tokens,
                "train.shared_prompt": self.shared_prompt,
                "planned": self.plan is not None}


def pinned_transformers_checkpointing(cfg) -> bool:
    """Layout.transformers_checkpointing from the pinned keys alone (before a plan exists: a model loaded or given
    before planning)."""
    return bool(cfg.model.gradient_checkpointing) and not cfg.model.offload_activations


def resolve_layout(cfg, model_config, device: torch.device, step: StepShape | None = None,
                   world_size: int = 1) -> Layout:
    """The run's layout: on CUDA from the plan of ``step`` (PlanError when the job cannot fit, naming its
    length_key), on the CPU the pinned keys with null as off (grouped rows checked against ``model_config`` as the
    plan checks them). ``world_size``: the plan of one GPU of a data-parallel
    job. Pinned keys (not null, not 0) win over the plan's choice."""
    m, t = cfg.model, cfg.train
    if device.type != "cuda":
        offload = bool(m.offload_activations)
        return Layout(offload_activations=offload,
                      gradient_checkpointing=bool(m.gradient_checkpointing) or offload,  # offloading recomputes
                      gpu_resident_layers=m.gpu_resident_layers or 0, no_recompute_layers=m.no_recompute_layers or 0,
                      reuse_attention=offload if m.reuse_attention is None else bool(m.reuse_attention),
                      micro_batch_tokens=t.micro_batch_tokens, mlp_tile_tokens=t.mlp_tile_tokens or 0,
                      shared_prompt=bool(t.shared_prompt) and step is not None and step.shared_prompt
                      and (model_config is None or shared_prompt_applies(cfg, step, model_config)))
    plan = plan_for_config(cfg, model_config, usable_gpu_bytes(cfg, device), world_size=world_size, step=step)
    log.info("memory plan:\n%s", plan.table())
    return Layout(offload_activations=plan.offload, gradient_checkpointing=plan.checkpointing,
                  gpu_resident_layers=m.gpu_resident_layers or plan.gpu_resident_layers,
                  no_recompute_layers=plan.no_recompute_layers if m.no_recompute_layers is None else m.no_recompute_layers,
                  reuse_attention=plan.reuse_attention if m.reuse_attention is None else bool(m.reuse_attention),
                  micro_batch_tokens=t.micro_batch_tokens or plan.micro_batch_tokens,
                  mlp_tile_tokens=(plan.mlp_tile_tokens or 0) if t.mlp_tile_tokens is None else t.mlp_tile_tokens,
                  shared_prompt=plan.shared_prompt,
                  plan=plan)
