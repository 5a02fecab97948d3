"""PEFT's LoRA layers of a model: which there are, whether one fused product can express them, and which read the
same input.

The fused LoRA of rollouts (rollout/lora_fusion.py) and of training (models/lora_training.py) replace PEFT's
forward of the adapted projections; both find the layers, check that the adapters are plain linear LoRA (no DoRA or
other variant, no bias, one active adapter, not merged) and group the sibling projections that models call on one
tensor (q/k/v, gate/up), whose A products can then be one.
"""

from __future__ import annotations

import torch

from .shared_wrapper import SharedWrapper

SHARED_INPUTS = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, {"w1", "w3"},
                 {"query", "key", "value"})  # sibling projections that models call on one tensor


def lora_layers(model) -> dict[str, torch.nn.Module]:
    """PEFT's adapted layers of ``model`` by name (not the wrappers standing in for them, which share their
    children: models/lora_training.py)."""
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "lora_A") and hasattr(m, "base_layer") and not isinstance(m, SharedWrapper)}


def fusable_reason(model) -> str | None:
    """Why the adapters of ``model`` cannot be fused (None: they can; also None when it has no adapters). Every
    PEFT adapter layer counts: ``disable_adapter`` turns them all off, so one that is not fused would be lost."""
    for name, m in model.named_modules():
        if not hasattr(m, "adapter_layer_names") or not hasattr(m, "active_adapters"):
            continue
        active = [a for a in m.active_adapters if any(a in (getattr(m, n, None) or {}) for n in m.adapter_layer_names)]
        if len(active) > 1:
            return f"{name}: {len(active)} active adapters"
        if not active:
            continue
        a = active[0]
        if a not in (getattr(m, "lora_A", None) or {}) or not isinstance(m.lora_A[a], torch.nn.Linear) \
                or not hasattr(m, "base_layer"):
            return f"{name}: not a linear adapter"
        variant = getattr(m, "lora_variant", {}).get(a)
        if getattr(m, "merged", False) or variant is not None or getattr(m, "use_dora", {}).get(a, False):
            return f"{name}: merged or a LoRA variant (DoRA, ...)"
        if m.lora_A[a].bias is not None or m.lora_B[a].bias is not None:
            return f"{name}: LoRA bias"
        if getattr(m, "fan_in_fan_out", False):
            return f"{name}: fan_in_fan_out"
    return None


def sibling_groups(layers: dict[str, torch.nn.Module]) -> list[list[tuple[str, torch.nn.Module]]]:
    """Adapted layers with an active adapter, grouped into siblings that share an input (same parent, names in
    one of SHARED_INPUTS); every other layer alone. Grouping only saves work: a sibling called on another tensor
    recomputes its group's product."""
    groups: dict[tuple, list] = {}
    for name, m in layers.items():
        if not any(a in m.lora_A for a in m.active_adapters):
            continue
        parent, _, leaf = name.rpartition(".")
        kind = next((i for i, names in enumerate(SHARED_INPUTS) if leaf in names), None)
        key = (parent, kind) if kind is not None else (name,)
        groups.setdefault(key, []).append((name, m))
    return list(groups.values())
