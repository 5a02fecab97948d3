"""Training-time LoRA in fewer, larger kernels: the scale and the add inside the B product, one A product for
sibling projections.

PEFT's forward of an adapted projection, ``y = base(x) + lora_B(lora_A(dropout(x))) · s``, writes the B product,
reads and writes it again for the scale, then reads it and y for the add: about five passes over an [N, out]
activation per projection and direction. At 20K-token micro-batches of an 8B model (out summed over a layer's
seven projections: 43,008) that is ~1 GB a layer a pass. Here, for the active adapter (A [r, in], B [out, r]):

    xa = dropout(x) Aᵀ                      [N, r]  (with dropout off: one product [N, Σ r] for q/k/v, one for gate/up)
    y  = addmm(base(x), xa, (s · B)ᵀ)       the add inside the product (β = 1), the scale on the [out, r] matrix

with autograd through it all (A and B get their gradients; frozen bases none). Results equal PEFT's up to rounding
(the sum happens inside the product). Projections without dropout over frozen plain ``nn.Linear`` bases run per
sibling group (q/k/v, gate/up; o and down each alone) as one :class:`_LoraGroupProduct`, whose backward also sums
the input gradient inside the products, ``dx = dxa A + Σ_i dy_i W_i`` (``addmm_``, β = 1), where autograd would add
one [N, in] tensor per extra consumer of x (seven a decoder layer). Within :func:`fused_lora_training` the adapted
projections are replaced in their parents' slots by :class:`FusedLoraLinear` wrappers sharing their parameters
(names and state dicts unchanged) and put back on exit, so outside it PEFT's own machinery (``disable_adapter`` for the reference pass,
saving, merging) never sees a wrapper; inside it, PEFT calls that walk the adapter layers find none (run them
outside), and a nested :func:`fused_lora_training` or rollout ``fused_lora`` steps aside (the wrappers already add
the adapters). The context must hold the forward and the backward of what it computes
(checkpointed layers recompute their forward during backward). Models whose adapters the rollout fusion cannot
express exactly (models/lora_layers.fusable_reason) keep PEFT's forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from .lora_layers import fusable_reason, lora_layers, sibling_groups
from .shared_wrapper import SharedWrapper


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


class _LoraGroupProduct(torch.autograd.Function):
    """Sibling projections of one input x [N, in]: frozen bases W_i [out_i, in] (biases c_i), the stacked
    A [Σ r, in] and the scaled B_i (s_i B_i [out_i, r_i]), all in A's dtype (the compute dtype):

        xa  = x Aᵀ                                   [N, Σ r]
        y_i = x W_iᵀ + c_i + xa_i (s_i B_i)ᵀ         [N, out_i]   (the add inside the product, in place)

    backward: dxa_i = dy_i (s_i B_i); d(s_i B_i) = dy_iᵀ xa_i; dA = dxaᵀ x; dx = dxa A + Σ_i dy_i W_i, summed
    inside the products (addmm_, β = 1). ``tensors``: W_1..W_n, s_1 B_1..s_n B_n, c_1..c_n (None: no bias)."""

    @staticmethod
    def forward(ctx, x, a, n, *tensors):
        weights, sbs, biases = tensors[:n], tensors[n:2 * n], tensors[2 * n:]
        dt = a.dtype
        xc = x.to(dt)
        xa = xc @ a.t()  # [N, Σ r]
        outs, lo = [], 0
        for w, sb, c in zip(weights, sbs, biases):
            y = torch.nn.functional.linear(xc, w.to(dt), None if c is None else c.to(dt))  # [N, out_i]
            outs.append(y.addmm_(xa[:, lo:lo + sb.shape[1]], sb.t()))
            lo += sb.shape[1]
        ctx.save_for_backward(xc, xa, a, *weights, *sbs)
        ctx.n, ctx.x_dtype = n, x.dtype
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        xc, xa, a, *rest = ctx.saved_tensors
        n, dt = ctx.n, a.dtype
        weights, sbs = rest[:n], rest[n:]
        dys = [None if dy is None else dy.to(dt) for dy in dys]
        dxa = torch.cat([dy @ sb if dy is not None else xa.new_zeros(xa.shape[0], sb.shape[1])
                         for dy, sb in zip(dys, sbs)], dim=1)  # [N, Σ r]
        dsbs, lo = [], 0
        for i, (dy, sb) in enumerate(zip(dys, sbs)):
            wanted = ctx.needs_input_grad[3 + n + i] and dy is not None
            dsbs.append(dy.t() @ xa[:, lo:lo + sb.shape[1]] if wanted else None)  # [out_i, r_i]
            lo += sb.shape[1]
        da = dxa.t() @ xc if ctx.needs_input_grad[1] else None  # [Σ r, in]
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dxa @ a  # [N, in]
            for dy, w in zip(dys, weights):
                if dy is not None:
                    dx.addmm_(dy, w.to(dt))  # dx += dy_i W_i
            dx = dx.to(ctx.x_dtype)
        return (dx, da, None, *([None] * n), *dsbs, *([None] * n))


def grouped_base(base: nn.Module) -> bool:
    """Whether ``base`` can run inside :class:`_LoraGroupProduct`: a plain, frozen ``nn.Linear``."""
    frozen = not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)
    return type(base) is nn.Linear and frozen


class _SiblingGroup:
    """One sibling group's outputs for one input tensor, computed by :class:`_LoraGroupProduct` at the first
    member's call and handed out per member; dropped when every member took its own."""

    def __init__(self, members: list):
        self.members = members  # (lora layer, adapter) in stacking order
        self.x: torch.Tensor | None = None
        self.outs: list | None = None

    def usable(self, x: torch.Tensor) -> bool:
        """Under autocast (one compute dtype), or with input, bases and adapters in one dtype."""
        return torch.is_autocast_enabled(x.device.type) or all(
            m.lora_A[a].weight.dtype == m.base_layer.weight.dtype == x.dtype for m, a in self.members)

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output [..., out] for x [..., in] (the group is recomputed for another tensor)."""
        if self.x is not x or self.outs is None or self.outs[index] is None:
            self.x, self.outs = x, self._compute(x)
        y, self.outs[index] = self.outs[index], None
        if all(o is None for o in self.outs):
            self.x = self.outs = None
        return y

    def _compute(self, x: torch.Tensor) -> list:
        dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        a = torch.cat([m.lora_A[name].weight for m, name in self.members]).to(dt)  # [Σ r, in]
        sbs = [(m.lora_B[name].weight * m.scaling[name]).to(dt) for m, name in self.members]  # [out_i, r_i]
        bases = [m.base_layer for m, _ in self.members]
        outs = _LoraGroupProduct.apply(x.reshape(-1, x.shape[-1]), a, len(bases), *[b.weight for b in bases],
                                       *sbs, *[b.bias for b in bases])
        return [y.view(*x.shape[:-1], y.shape[-1]) for y in outs]


class FusedLoraLinear(SharedWrapper):
    """An adapted projection as ``base(x) + (A x)(s B)ᵀ`` in one addmm (see the module docstring)."""

    grouped = True  # with a sibling group: its outputs from one _LoraGroupProduct (False: this module's own product)
    in_place = True  # add into the base product's own output (False: out-of-place addmm, the reference twin)

    def __init__(self, inner: nn.Module, adapter: str, shared: _SharedProjection | None, lo: int, hi: int,
                 group: _SiblingGroup | None = None, index: int = 0):
        super().__init__(inner)
        self.adapter, self.shared, self.lo, self.hi = adapter, shared, lo, hi
        self.group, self.index = group, index

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.grouped and self.group is not None and not args and not kwargs and self.group.usable(x):
            return self.group.output(self.index, x)
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
            group = _SiblingGroup(active) if no_dropout and all(grouped_base(m.base_layer) for m, _ in active) else None
            lo = 0
            for index, (m, a) in enumerate(active):
                r = m.lora_A[a].weight.shape[0]
                parent, name = slots[id(m)]
                setattr(parent, name, FusedLoraLinear(m, a, shared, lo, lo + r, group, index))
                swapped.append((parent, name, m))
                lo += r
        yield True
    finally:
        for parent, name, m in reversed(swapped):
            setattr(parent, name, m)
