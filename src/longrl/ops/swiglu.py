"""SiLU(gate) · up with autograd in two Triton kernels (training fast path) and its PyTorch twin.

A Llama-family MLP computes h = silu(g) · u on [N, I] activations (I = 14,336 for an 8B model): transformers runs
silu and the product as two kernels forward, keeps silu(g) for backward (one more [N, I] tensor) and runs three
backward. Here, elementwise over g and u in one kernel a direction, with s = σ(g):

    forward:   a = round(g · s),  h = round(a · u)                         (transformers' two roundings)
    backward:  du = dy · a,  dg = dy · u · s · (1 + g · (1 − s))           (a recomputed from g; nothing else kept)

tests/test_fused_kernels.py compares both directions with the twin under Triton's interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 2048  # elements a program


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """transformers' ``act_fn(gate_proj(x)) * up_proj(x)`` for SiLU: the twin and the CPU path."""
    return F.silu(gate) * up


if triton is not None:
    @triton.jit
    def _silu_mul_fwd(G, U, H, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty)  # torch's silu, rounded to the activations' dtype
        tl.store(H + offs, (a.to(tl.float32) * u).to(H.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_bwd(DH, G, U, DG, DU, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        dh = tl.load(DH + offs, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        a = (g * s).to(G.dtype.element_ty).to(tl.float32)
        tl.store(DU + offs, (dh * a).to(DU.dtype.element_ty), mask=ok)
        tl.store(DG + offs, (dh * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=ok)


class SiluMulFunction(torch.autograd.Function):
    """h = silu(gate) · up through the Triton kernels; gate, up of one shape and dtype."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        h = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _silu_mul_fwd[(triton.cdiv(n, BLOCK),)](gate, up, h, n, BLOCK=BLOCK, num_warps=8)
        ctx.save_for_backward(gate, up)
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        gate, up = ctx.saved_tensors
        dh = dh.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _silu_mul_bwd[(triton.cdiv(n, BLOCK),)](dh, gate, up, dg, du, n, BLOCK=BLOCK, num_warps=8)
        return dg, du


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up: the Triton kernels on a GPU with Triton (same shape and dtype), the twin elsewhere."""
    if triton is not None and gate.is_cuda and gate.shape == up.shape and gate.dtype == up.dtype:
        return SiluMulFunction.apply(gate, up)
    return silu_mul_reference(gate, up)
