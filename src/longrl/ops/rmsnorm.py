"""RMSNorm with autograd in two Triton kernels (training fast path) and its PyTorch twin.

transformers' Llama-family RMSNorm, for x [..., D] in a 16-bit dtype and weight w [D]:

    r = (mean_j x_j² + eps)^(−1/2)   (float32),   n = round_x(x · r),   y = w · n

runs as about eight elementwise kernels forward (float32 copies of x) and as many backward, each a pass over the
[N, D] activations: at long micro-batches a sizeable share of a training step. Here one kernel a direction, one
program a row:

    forward:   y, r                 (r [N] float32 kept for backward: 4 bytes a row)
    backward:  g = dy · w,  dx = r · (g − n̂ · Σ_j g_j n̂_j / D)  with n̂ = x · r (float32)
               dw = Σ_rows dy · n   (PyTorch, only when w needs a gradient: a LoRA base's norms do not)

The forward rounds where transformers does (n to x's dtype, then the product), so y equals the twin's up to the
float32 sum order of Σ x²; the backward keeps g and n̂ in float32 where autograd rounds g to 16 bits, so dx is at
least as accurate. tests/test_fused_kernels.py compares both directions with the twin under Triton's interpreter.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton run the twin
    triton = None


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm forward (Llama, Mistral, Qwen2, Qwen3): the twin and the CPU path."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


if triton is not None:
    @triton.jit
    def _rmsnorm_fwd(X, W, Y, RSTD, stride_x, stride_y, D, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, 0) / D + eps)
        n = (x * r).to(X.dtype.element_ty)
        w = tl.load(W + cols, mask=ok, other=0.0)
        y = w.to(tl.float32) * n.to(tl.float32)  # the 16-bit product's rounding, as torch's w * n
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=ok)
        tl.store(RSTD + row, r)

    @triton.jit
    def _rmsnorm_bwd(DY, X, W, RSTD, DX, stride_dy, stride_x, stride_dx, D, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        r = tl.load(RSTD + row)
        g = dy * w
        n = x * r
        dx = r * (g - n * (tl.sum(g * n, 0) / D))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=ok)


def _launch(D: int) -> dict:
    block = triton.next_power_of_2(D)
    return dict(BLOCK=block, num_warps=min(16, max(1, block // 256)))


class RMSNormFunction(torch.autograd.Function):
    """y = RMSNorm(x; w, eps) through the Triton kernels; x [..., D] (any leading shape), w [D]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        N, D = x2.shape
        y = torch.empty(N, D, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        rstd = torch.empty(N, dtype=torch.float32, device=x.device)
        if N:
            _rmsnorm_fwd[(N,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), D, float(eps), **_launch(D))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(*shape[:-1], D)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        N, D = x2.shape
        dy2 = dy.reshape(N, D)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x2)
            if N:
                _rmsnorm_bwd[(N,)](dy2, x2, weight, rstd, dx, dy2.stride(0), x2.stride(0), dx.stride(0), D,
                                   **_launch(D))
            dx = dx.view(ctx.shape)
        if ctx.needs_input_grad[1]:
            n = (x2.float() * rstd[:, None]).to(x2.dtype)
            dw = (dy2.float() * n.float()).sum(0).to(weight.dtype)
        return dx, dw, None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D]: the Triton kernels on a GPU with Triton, the twin elsewhere."""
    if triton is not None and x.is_cuda:
        return RMSNormFunction.apply(x, weight, eps)
    return rmsnorm_reference(x, weight, eps)
