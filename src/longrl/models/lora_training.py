"""Training-time LoRA in fewer, larger kernels: the scale and the add inside the B product, one A product for
sibling projections.

PEFT's forward of an adapted projection, ``y = base(x) + lora_B(lora_A(dropout(x))) · s``, writes the B product,
reads and writes it again for the scale, then reads it and y for the add: about five passes over an [N, out]
activation per projection and direction. At 20K-token micro-batches of an 8B model (out summed over a layer's
seven projections: 43,008) that is ~1 GB a layer a pass. Here, for the active adapter (A [r, in], B [out, r]):

    xa = dropout(x) Aᵀ                      [N, r]  (with dropout off: one product [N, Σ r] for q/k/v, one for gate/up)
    y  = addmm(base(x), xa, (s · B)ᵀ)       the add inside the product (β = 1), the scale on the [out, r] matrix

with autograd through it all (A and B get their gradients; frozen bases none). Results equal PEFT's up to rounding
(the sum happens inside the product). Within :func:`fused_lora_training` the adapted projections are replaced in
their parents' slots by :class:`FusedLoraLinear` wrappers sharing their parameters (names and state dicts
unchanged) and put back on exit, so outside it PEFT's own machinery (``disable_adapter`` for the reference pass,
saving, merging) never sees a wrapper; inside it, PEFT calls that walk the adapter layers find none (run them
outside), and a nested :func:`fused_lora_training` or rollout ``fused_lora`` steps aside (the wrappers already add
the adapters). The context must hold the forward and the backward of what it computes
(checkpointed layers recompute their forward during backward). Models whose adapters the rollout fusion cannot
express exactly (rollout/lora_fusion.fusable_reason) keep PEFT's forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from ..memory.tiling import SharedWrapper
from ..rollout.lora_fusion import fusable_reason, lora_layers, sibling_groups


def _a_product(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """x [..., in] times Aᵀ (a [r, in]) as [N, r]: under autocast in its dtype, else in A's (PEFT's input cast)."""
    x2 = x.reshape(-1, x.shape[-1])
    return (x2 if torch.is_autocast_enabled(x.device.type) else x2.to(a.dtype)) @ a.t()


@dataclass
class _SharedProjection:
    """A products of siblings that read the same input and have no dropout: computed once per input tensor."""

    members: list  # (lora layer, adapter) in stacking order
    x: torch.Tensor | None = None
    xa: torch.Tensor | None = None
    left: int = 0

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] → [N, Σ r]; the cache is dropped when every sibling took it (no activation outlives it)."""
        if self.x is not x or self.left == 0:
            a = torch.cat([m.lora_A[name].weight for m, name in self.members])  # [Σ r, in]: adapter-sized, autograd reaches each A
            self.x, self.xa, self.left = x, _a_product(x, a), len(self.members)
        xa = self.xa
        self.left -= 1
        if self.left == 0:
            self.x = self.xa = None
        return xa


class FusedLoraLinear(SharedWrapper):
    """An adapted projection as ``base(x) + (A x)(s B)ᵀ`` in one addmm (see the module docstring)."""

    def __init__(self, inner: nn.Module, adapter: str, shared: _SharedProjection | None, lo: int, hi: int):
        super().__init__(inner)
        self.adapter, self.shared, self.lo, self.hi = adapter, shared, lo, hi

    in_place = True  # add into the base product's own output (False: out-of-place addmm, the reference twin)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        inner, a = self.inner, self.adapter
        base = inner.base_layer
        # a plain Linear's product of the 2-D input is a fresh tensor its backward does not keep: the B product
        # adds into it in place (an out-of-place addmm first copies the whole [N, out] product)
        in_place = self.in_place and type(base) is nn.Linear and not args and not kwargs
        y = base(x.reshape(-1, x.shape[-1])) if in_place else base(x, *args, **kwargs)  # [N, out] / [..., out]
        if self.shared is not None:
            xa = self.shared.project(x)[:, self.lo:self.hi]  # [N, r]
        else:
            xa = _a_product(inner.lora_dropout[a](x), inner.lora_A[a].weight)
        b = inner.lora_B[a].weight * inner.scaling[a]  # [out, r]
        if in_place:
            return y.addmm_(xa.to(y.dtype), b.t().to(y.dtype)).view(*x.shape[:-1], y.shape[-1])  # y += xa (s B)ᵀ
        out = torch.addmm(y.reshape(-1, y.shape[-1]), xa.to(y.dtype), b.t().to(y.dtype))  # y + xa (s B)ᵀ
        return out.view(y.shape)


@contextlib.contextmanager
def fused_lora_training(model):
    """Within the context the adapted projections of ``model`` run as :class:`FusedLoraLinear` (forward and
    backward); yields whether they do (False: no adapters, adapters disabled, or not expressible: PEFT's forward)."""
    layers = lora_layers(model)
    if (not layers or not hasattr(model, "disable_adapter") or fusable_reason(model) is not None
            or any(getattr(m, "disable_adapters", False) for m in layers.values())):
        yield False
        return
    slots = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    swapped = []
    try:
        for members in sibling_groups(layers):
            active = [(m, next(a for a in m.active_adapters if a in m.lora_A)) for _, m in members]
            no_dropout = all(isinstance(m.lora_dropout[a], nn.Identity) for m, a in active)
            shared = _SharedProjection(active) if no_dropout and len(active) > 1 else None
            lo = 0
            for m, a in active:
                r = m.lora_A[a].weight.shape[0]
                parent, name = slots[id(m)]
                setattr(parent, name, FusedLoraLinear(m, a, shared, lo, lo + r))
                swapped.append((parent, name, m))
                lo += r
        yield True
    finally:
        for parent, name, m in reversed(swapped):
            setattr(parent, name, m)
