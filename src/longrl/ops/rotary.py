"""Rotary position embedding of q and k with autograd in one Triton kernel a direction, and its PyTorch twin.

transformers' ``apply_rotary_pos_emb`` for a head x = (x₁, x₂) (halves of the head dimension D), cos c and sin s
[T, D] of its token:

    forward:    o₁ = round(x₁ c₁) − round(x₂ s₁),      o₂ = round(x₂ c₂) + round(x₁ s₂)
    backward:   d₁ = round(g₁ c₁) + round(g₂ s₂),      d₂ = round(g₂ c₂) − round(g₁ s₁)   (g = ∂L/∂o)

(round: to the result's dtype, where torch's elementwise products round). transformers runs it as ~10 kernels
forward over q and k (slices, a negation, a concatenation, two products, a sum, each) and as many backward, each
a pass over q or k: at long micro-batches a sizeable share of a training step. Here one program a token reads its
q and k heads once and writes them once, in either direction; nothing is kept for backward but cos and sin (the
model's own tensors). The products are rounded before the sum, as torch does, and the kernel is launched without
floating-point contraction, so the results equal transformers' bit for bit (tests/test_fused_kernels.py under the
interpreter, tests/test_memory_gpu.py on a GPU).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' rotary embedding (Llama, Mistral, Qwen2, Qwen3): the twin and the CPU path.

    q [B, T, Hq, D], k [B, T, Hk, D] (token-major, as the projections give them), cos, sin [B or 1, T, D]
    → rotated q [B, Hq, T, D], k [B, Hk, T, D] (head-major views, as transformers' attention takes them)."""
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


if triton is not None:
    @triton.jit
    def _rotate_heads(X, O, x_row, o_row, sx_h, so_h, c1, c2, s1, s2, H, j, okj, HALF: tl.constexpr,
                      H_P2: tl.constexpr, BACKWARD: tl.constexpr):
        """One token's H heads [H, D] of X rotated into O (halves j, j + HALF of each head)."""
        h = tl.arange(0, H_P2)[:, None]
        ok = (h < H) & okj[None, :]
        xp = X + x_row + h * sx_h + j[None, :]
        x1 = tl.load(xp, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=ok, other=0.0).to(tl.float32)
        ty = O.dtype.element_ty
        a1 = (x1 * c1[None, :]).to(ty).to(tl.float32)
        a2 = (x2 * c2[None, :]).to(ty).to(tl.float32)
        if BACKWARD:
            o1 = a1 + (x2 * s2[None, :]).to(ty).to(tl.float32)
            o2 = a2 - (x1 * s1[None, :]).to(ty).to(tl.float32)
        else:
            o1 = a1 - (x2 * s1[None, :]).to(ty).to(tl.float32)
            o2 = a2 + (x1 * s2[None, :]).to(ty).to(tl.float32)
        op = O + o_row + h * so_h + j[None, :]
        tl.store(op, o1.to(ty), mask=ok)
        tl.store(op + HALF, o2.to(ty), mask=ok)

    @triton.jit
    def _rotary_kernel(Q, K, COS, SIN, QO, KO, T, HQ, HK,
                       sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sqo_b, sqo_t, sqo_h, sko_b, sko_t, sko_h,
                       sc_b, sc_t, ss_b, ss_t,
                       HALF: tl.constexpr, HALF_P2: tl.constexpr, HQ_P2: tl.constexpr, HK_P2: tl.constexpr,
                       BACKWARD: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)  # token b · T + t
        b = n // T
        t = n % T
        j = tl.arange(0, HALF_P2)
        okj = j < HALF
        cp = COS + b * sc_b + t * sc_t + j
        sp = SIN + b * ss_b + t * ss_t + j
        c1 = tl.load(cp, mask=okj, other=0.0).to(tl.float32)
        c2 = tl.load(cp + HALF, mask=okj, other=0.0).to(tl.float32)
        s1 = tl.load(sp, mask=okj, other=0.0).to(tl.float32)
        s2 = tl.load(sp + HALF, mask=okj, other=0.0).to(tl.float32)
        _rotate_heads(Q, QO, b * sq_b + t * sq_t, b * sqo_b + t * sqo_t, sq_h, sqo_h, c1, c2, s1, s2, HQ, j, okj,
                      HALF, HQ_P2, BACKWARD)
        _rotate_heads(K, KO, b * sk_b + t * sk_t, b * sko_b + t * sko_t, sk_h, sko_h, c1, c2, s1, s2, HK, j, okj,
                      HALF, HK_P2, BACKWARD)


def _bthd(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] with unit stride along D (copied only when it has not)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(q: torch.Tensor, k: torch.Tensor, cos, sin, q_out, k_out, backward: bool) -> None:
    """Rotate q, k [B, T, H, D] into q_out, k_out [B, T, H, D] (any strides with unit stride along D)."""
    B, T, HQ, D = q.shape
    HK = k.shape[2]
    half = D // 2
    if B * T == 0:
        return
    cos_b, cos_t = (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1)
    sin_b, sin_t = (sin.stride(0) if sin.shape[0] > 1 else 0), sin.stride(1)
    _rotary_kernel[(B * T,)](
        q, k, cos, sin, q_out, k_out, T, HQ, HK,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos_b, cos_t, sin_b, sin_t,
        HALF=half, HALF_P2=triton.next_power_of_2(half), HQ_P2=triton.next_power_of_2(HQ),
        HK_P2=triton.next_power_of_2(HK), BACKWARD=backward,
        num_warps=4 if HQ * half >= 1024 else 1, enable_fp_fusion=False)


class RotaryFunction(torch.autograd.Function):
    """(q, k) ↦ their rotary embeddings through the Triton kernel; see the module docstring. q [B, T, Hq, D],
    k [B, T, Hk, D], cos, sin [B or 1, T, D] (no gradient) → q [B, Hq, T, D], k [B, Hk, T, D] views."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        q, k, cos, sin = _bthd(q), _bthd(k), _bthd(cos), _bthd(sin)
        q_out = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype), device=q.device)
        k_out = torch.empty(k.shape, dtype=torch.promote_types(k.dtype, cos.dtype), device=k.device)
        _launch(q, k, cos, sin, q_out, k_out, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = (q.dtype, k.dtype)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        dq_out, dk_out = _bthd(dq_out.transpose(1, 2)), _bthd(dk_out.transpose(1, 2))
        dq = torch.empty(dq_out.shape, dtype=ctx.dtypes[0], device=dq_out.device)
        dk = torch.empty(dk_out.shape, dtype=ctx.dtypes[1], device=dk_out.device)
        _launch(dq_out, dk_out, cos, sin, dq, dk, backward=True)
        return dq, dk, None, None


def fusable_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel applies: rotation over the whole head (not a partial rotary), cos and sin without
    gradient, one batch or a broadcast one."""
    D = q.shape[-1]
    return (cos.dim() == 3 and cos.shape == sin.shape and cos.shape[-1] == D == k.shape[-1] and D % 2 == 0
            and cos.shape[1] == q.shape[1] and cos.shape[0] in (1, q.shape[0]) and not cos.requires_grad
            and not sin.requires_grad)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary embedding of q [B, T, Hq, D] and k [B, T, Hk, D] with cos, sin [B or 1, T, D] → q [B, Hq, T, D],
    k [B, Hk, T, D]: the Triton kernel on a GPU with Triton, the twin elsewhere (or for shapes it does not take)."""
    if triton is not None and q.is_cuda and fusable_rotary(q, k, cos, sin):
        return RotaryFunction.apply(q, k, cos, sin)
    return rotary_reference(q, k, cos, sin)
