"""Rollout-time LoRA: each adapted projection's delta added by one fused matrix product.

PEFT's unmerged forward costs, per adapted projection and decode step, a cast of A and B to the compute dtype
(autocast), two products, a scale and an add: about 1,300 small kernels a step for an 8B model, a large part of
a decode step. The adapters are constant during a rollout, so for the call:

    y = W x + s · B (A x) = W x + (A_g x)[rows of this projection] · (s B)ᵀ

with A_g the rows of the A matrices of the projections that read the same input (q/k/v, gate/up) stacked and
cast once per call, and the add done by the product itself (``addmm_``, β = 1). PEFT's adapters are switched
off through its public API (the LoRA tuner's ``disable_adapter_layers``, the switch ``PeftModel.disable_adapter``
throws; that context itself for a model without one) and the delta is added by forward hooks on the base layers
(any base: 16-bit ``nn.Linear`` or a 4-bit one). The stacked copies are the size of the adapters in the compute
dtype (≈ 1% of an 8B model at r = 32) and are dropped when the call returns. Results equal PEFT's up to
rounding (in 16-bit, folding the scale into B and adding inside the product round differently). Adapters this
cannot express exactly (DoRA and other variants, LoRA biases, several active adapters, merged adapters,
embedding or other non-linear targets) make it step aside for the whole model: PEFT's own forward runs.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from ..models.lora_layers import fusable_reason, lora_layers, sibling_groups

_ADDERS: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def fused_adder(base_layer: torch.nn.Module):
    """The delta hook ``hook(base_layer, (x,), y) → y + Δ(x)`` that a running :func:`fused_lora` installed on
    ``base_layer`` (None outside it, or for a layer without an adapter): for callers that compute the base
    product themselves (the NF4 decode product, rollout/fast_decode.py)."""
    return _ADDERS.get(base_layer)


@dataclass
class _Group:
    """Adapted projections that read the same input: their A rows stacked; A_g x kept until every sibling took it."""

    a_t: torch.Tensor  # [in, Σ r] stacked Aᵀ in the compute dtype
    size: int  # sibling projections
    x: torch.Tensor | None = None
    xa: torch.Tensor | None = None  # [N, Σ r]
    left: int = 0  # siblings that have not taken xa yet
    reused: int = 0  # products saved by siblings sharing the input

    def seed(self, x: torch.Tensor, xa: torch.Tensor) -> None:
        """Hand in A_g x [N, Σ r] computed elsewhere (the packed product of rollout/fast_decode.py, where the A rows
        ride along with the base weights) for the siblings about to be called on ``x``."""
        self.x, self.xa, self.left = x, xa, self.size

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """A_g x for ``x`` [..., in] as [N, Σ r], computed once per input tensor (siblings reuse it). The cache
        is dropped when the last sibling took it, so no layer's activations outlive their layer."""
        if self.x is x and self.left > 0:
            self.reused += 1
            xa = self.xa
        else:
            xa = x.reshape(-1, x.shape[-1]).to(self.a_t.dtype) @ self.a_t
            self.x, self.xa, self.left = x, xa, self.size
        self.left -= 1
        if self.left == 0:
            self.x = self.xa = None
        return xa


@contextlib.contextmanager
def fused_lora(model, dtype: torch.dtype):
    """Within the context, ``model``'s LoRA adapters run fused (see the module docstring); yields whether they
    do (False: no adapters or not fusable, PEFT's forward runs unchanged). For inference: the copies are
    detached and the delta is added in place, so no gradient reaches the adapters."""
    layers = lora_layers(model)
    if not layers or not hasattr(model, "disable_adapter") or fusable_reason(model) is not None:
        yield False
        return
    if any(getattr(m, "disable_adapters", False) for m in layers.values()):  # inside disable_adapter(): the base
        yield False  # model runs, and PEFT's forward already leaves the deltas out
        return
    hooks = []
    try:  # hooks removed whatever happens, also while they are being installed (e.g. out of memory there)
        with torch.no_grad():
            for members in sibling_groups(layers):
                active = [(m, next(a for a in m.active_adapters if a in m.lora_A)) for _, m in members]
                a_rows = [m.lora_A[a].weight for m, a in active]  # each [r, in]
                group = _Group(torch.cat(a_rows).to(dtype).t().contiguous(), len(active))
                start = 0
                for (m, a), rows in zip(active, a_rows):
                    b_t = (m.lora_B[a].weight * m.scaling[a]).to(dtype).t().contiguous()  # [r, out]
                    adder = _adder(group, start, start + rows.shape[0], b_t)
                    hooks.append(m.base_layer.register_forward_hook(adder))
                    _ADDERS[m.base_layer] = adder
                    start += rows.shape[0]
        tuner = getattr(model, "base_model", None)  # PEFT's LoraModel: the adapters' own switch
        if hasattr(tuner, "disable_adapter_layers") and hasattr(tuner, "enable_adapter_layers"):
            # what PeftModel.disable_adapter does for LoRA, without its survey of every layer's status first
            # (get_model_status: a walk of the model with a repr of each adapter layer, ~14 ms a call for 30 layers
            # on a CPU; the checks above found every adapter enabled, as enable_adapter_layers leaves them)
            tuner.disable_adapter_layers()
            try:
                yield True
            finally:
                tuner.enable_adapter_layers()
        else:
            with model.disable_adapter():
                yield True
    finally:
        for h in hooks:
            h.remove()
        for m in layers.values():
            _ADDERS.pop(m.base_layer, None)


def _adder(group: _Group, lo: int, hi: int, b_t: torch.Tensor):
    def hook(module, args, out):
        xa = group.project(args[0])[:, lo:hi].to(out.dtype)  # [N, r]
        rows = out if out.dim() == 2 else (out.view(-1, out.shape[-1]) if out.is_contiguous() else None)
        if rows is not None and rows.stride(-1) == 1:  # also a column block of a packed product's output
            rows.addmm_(xa, b_t.to(out.dtype))  # the add inside the product
            return out
        return out + (xa @ b_t.to(out.dtype)).view(out.shape)
    hook.group, hook.rows, hook.b_t = group, (lo, hi), b_t  # for the packed decode (rollout/fast_decode.py)
    return hook
