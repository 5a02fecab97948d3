"""The elementwise work of a Llama-family decode step, fused: three Triton kernels (GPU) and their PyTorch twins.

transformers runs a decoder layer's glue as ~25 small kernels (norm statistics, casts, the rotary embedding's
slices and concatenations, cache writes, the activation, residual adds); at decode batch sizes each costs its
launch regardless of size, which over a model's layers is a large share of a decode step. These do the same
arithmetic, rounding to the activations' dtype wherever transformers does (``cast`` below), in three kernels:

    add_rmsnorm:   h ← cast(h + δ);  x = cast(w ⊙ cast(h · rsqrt(mean(h²) + ε)))           (statistics in float32)
    rotary_kv:     t ← cast(t + xa_t · (s B_t)ᵀ)   q, k, v's LoRA deltas, when the packed decode folds them in
                   t ← cast(w_t ⊙ cast(t · rsqrt(mean(t²) + ε)))   per head, when the model norms q/k (Qwen3)
                   t ← cast(cast(t ⊙ cos) + cast(rotate_half(t) ⊙ sin))   for q and k;  k, v → the slot store
    decode_silu_mul:  y = cast(cast(silu(g)) ⊙ u)   (g, u ← cast(t + xa_t · (s B_t)ᵀ) first, when the packed
                   decode folds gate/up's LoRA deltas in: a tiled kernel with a small matrix product per tile)

The twins are the reference (tests/test_fast_decode.py runs both, the kernels through Triton's interpreter). The
SiLU·up product here is the decode step's, not training's (ops/swiglu.silu_mul, with autograd): rows at their own
strides, the LoRA fold, no backward, and torch's float32 arithmetic exactly (the accurate exp and IEEE division),
so its twin is ops/swiglu.silu_mul_reference after the LoRA deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.rmsnorm import rmsnorm_reference
from ..ops.rotary import rotate_half
from ..ops.swiglu import silu_mul_reference

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU installs without Triton use the twins
    triton = None


# ---------------------------------------------------------------------------------------------- PyTorch twins
def add_rmsnorm_reference(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(h + δ, RMSNorm(h + δ)) for rows h, δ [B, d], as transformers' residual add and LlamaRMSNorm."""
    if delta is not None:
        h = h + delta
    return h, rmsnorm_reference(h, weight, eps)


@dataclass
class LoraFold:
    """LoRA deltas of q, k, v to add inside :func:`rotary_kv`: t ← round(t + (A x)[:, lo:lo + r] · (s B)ᵀ) per
    projection, with A x the columns of ``xa`` [B, ≥ lo + r] from ``lo`` and ``b_t`` = (s B)ᵀ [r, out]."""

    xa: torch.Tensor
    lo: tuple  # (q, k, v) column offsets into xa
    b_t: tuple  # (q, k, v) [r, out] in the projections' dtype, contiguous
    r: int


def _with_lora(t: torch.Tensor, fold: "LoraFold | None", j: int) -> torch.Tensor:
    if fold is None:
        return t
    xa = fold.xa[:, fold.lo[j]:fold.lo[j] + fold.r].float()
    return (t.float() + xa @ fold.b_t[j].float()).to(t.dtype)


def rotary_kv_reference(q, k, v, cos, sin, k_cache, v_cache, write_index, q_norm=None, k_norm=None, eps=1e-6,
                        lora: "LoraFold | None" = None, slots=None):
    """q [B, Hq·D], k and v [B, Hkv·D] (projection outputs), cos and sin [B, D]; k_cache, v_cache [S, Hkv, T, D].
    Adds the LoRA deltas of ``lora`` (rounded once each, as a product adding into its output does), norms q/k per
    head when weights are given, rotates q and k, writes row b's k and v at write_index[b] of slot b (of slot
    slots[b] when slots [B] is given: a verify step's virtual rows); returns q [B, Hq, D]."""
    q, k, v = _with_lora(q, lora, 0), _with_lora(k, lora, 1), _with_lora(v, lora, 2)
    B, D = q.shape[0], cos.shape[-1]
    q, k, v = q.view(B, -1, D), k.view(B, -1, D), v.view(B, -1, D)
    if q_norm is not None:
        q = add_rmsnorm_reference(q, None, q_norm, eps)[1]
        k = add_rmsnorm_reference(k, None, k_norm, eps)[1]
    c, s = cos[:, None, :], sin[:, None, :]
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    rows = torch.arange(B, device=q.device) if slots is None else slots
    k_cache[rows, :, write_index] = k.to(k_cache.dtype)
    v_cache[rows, :, write_index] = v.to(v_cache.dtype)
    return q


def decode_silu_mul_reference(gate: torch.Tensor, up: torch.Tensor, lora: "LoraFold | None" = None) -> torch.Tensor:
    """silu(g) · u, after adding the LoRA deltas of ``lora`` (lo and b_t: (gate, up)) to g and u."""
    return silu_mul_reference(_with_lora(gate, lora, 0), _with_lora(up, lora, 1))


# ---------------------------------------------------------------------------------------------- Triton kernels
if triton is not None:
    @triton.jit
    def _add_rmsnorm_kernel(H, DELTA, W, X, d, eps, stride_delta, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        """One program per row: h ← cast(h + δ) in place; x = cast(w · cast(h · rsqrt(mean(h²) + ε))). δ's rows at
        their own stride (a packed product's column block)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < d
        h = tl.load(H + row * d + cols, mask=ok, other=0.0)
        if HAS_DELTA:
            h = (h.to(tl.float32) + tl.load(DELTA + row * stride_delta + cols, mask=ok, other=0.0).to(tl.float32)).to(
                h.dtype)
            tl.store(H + row * d + cols, h, mask=ok)
        hf = h.to(tl.float32)
        y = (hf * tl.rsqrt(tl.sum(hf * hf, 0) / d + eps)).to(h.dtype)
        w = tl.load(W + cols, mask=ok, other=0.0)
        tl.store(X + row * d + cols, (w.to(tl.float32) * y.to(tl.float32)).to(X.dtype.element_ty), mask=ok)

    @triton.jit
    def _lora_head(lo, hi, XA_ROW, B_T, width, cols, R: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr):
        """A head's halves plus their LoRA delta: t + Σ_j xa[j] · B_T[j, cols] (float32), rounded to t's dtype."""
        j = tl.arange(0, RP)
        ok = j < R
        xa = tl.load(XA_ROW + j, mask=ok, other=0.0).to(tl.float32)  # [RP]
        b_lo = tl.load(B_T + j[None, :] * width + cols[:, None], mask=ok[None, :], other=0.0).to(tl.float32)
        b_hi = tl.load(B_T + j[None, :] * width + HALF + cols[:, None], mask=ok[None, :], other=0.0).to(tl.float32)
        lo = (lo.to(tl.float32) + tl.sum(b_lo * xa[None, :], 1)).to(lo.dtype)
        hi = (hi.to(tl.float32) + tl.sum(b_hi * xa[None, :], 1)).to(hi.dtype)
        return lo, hi

    @triton.jit
    def _rotary_kv_kernel(Q, K, V, COS, SIN, KC, VC, WIDX, QW, KW, QO, eps, stride_cs, stride_ch, stride_ct,
                          stride_q, stride_k, stride_v, XA, stride_xa, LO_Q, LO_K, LO_V, BQ, BK, BV, SLOTS,
                          HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                          HAS_NORM: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, HAS_SLOTS: tl.constexpr):
        """One program per (sequence b, head): heads < HQ are query heads (rotated into QO), the others key heads
        (rotated, with their value head, into the slot store at WIDX[b]). q, k, v rows at their own strides (column
        blocks of one packed product's output, or separate tensors). R > 0: each head first gets its LoRA delta,
        Σ_j xa[b, LO + j] · Bᵀ[j, head rows] (B*: (s B)ᵀ [R, out]), added in float32 and rounded once. HAS_SLOTS:
        row b's key/value go to slot SLOTS[b] (else slot b)."""
        b = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        i = tl.arange(0, HALF)
        is_q = head < HQ
        kvh = head - HQ
        if is_q:
            lo = tl.load(Q + b * stride_q + head * D + i)  # t[:D/2]
            hi = tl.load(Q + b * stride_q + head * D + HALF + i)  # t[D/2:]
            if R > 0:
                lo, hi = _lora_head(lo, hi, XA + b * stride_xa + LO_Q, BQ, HQ * D, head * D + i, R, RP, HALF)
        else:
            lo = tl.load(K + b * stride_k + kvh * D + i)
            hi = tl.load(K + b * stride_k + kvh * D + HALF + i)
            if R > 0:
                lo, hi = _lora_head(lo, hi, XA + b * stride_xa + LO_K, BK, HKV * D, kvh * D + i, R, RP, HALF)
        dt = lo.dtype
        if HAS_NORM:
            if is_q:
                w_lo = tl.load(QW + i).to(tl.float32)
                w_hi = tl.load(QW + HALF + i).to(tl.float32)
            else:
                w_lo = tl.load(KW + i).to(tl.float32)
                w_hi = tl.load(KW + HALF + i).to(tl.float32)
            lf, hf = lo.to(tl.float32), hi.to(tl.float32)
            r = tl.rsqrt((tl.sum(lf * lf, 0) + tl.sum(hf * hf, 0)) / D + eps)
            lo = (w_lo * (lf * r).to(dt).to(tl.float32)).to(dt)
            hi = (w_hi * (hf * r).to(dt).to(tl.float32)).to(dt)
        c_lo = tl.load(COS + b * D + i).to(tl.float32)
        c_hi = tl.load(COS + b * D + HALF + i).to(tl.float32)
        s_lo = tl.load(SIN + b * D + i).to(tl.float32)
        s_hi = tl.load(SIN + b * D + HALF + i).to(tl.float32)
        lf, hf = lo.to(tl.float32), hi.to(tl.float32)
        # rotate_half(t) = (−t[D/2:], t[:D/2]); each product and the sum rounded as transformers rounds them (the
        # launch turns off floating-point contraction: a product and sum fused into one fma would skip a rounding)
        out_lo = ((lf * c_lo).to(dt).to(tl.float32) + (-hf * s_lo).to(dt).to(tl.float32)).to(dt)
        out_hi = ((hf * c_hi).to(dt).to(tl.float32) + (lf * s_hi).to(dt).to(tl.float32)).to(dt)
        if is_q:
            dst = QO + (b * HQ + head) * D
            tl.store(dst + i, out_lo)
            tl.store(dst + HALF + i, out_hi)
        else:
            t = tl.load(WIDX + b)
            if HAS_SLOTS:
                slot = tl.load(SLOTS + b).to(tl.int64)
            else:
                slot = b
            off = slot * stride_cs + kvh * stride_ch + t * stride_ct
            tl.store(KC + off + i, out_lo.to(KC.dtype.element_ty))
            tl.store(KC + off + HALF + i, out_hi.to(KC.dtype.element_ty))
            vsrc = V + b * stride_v + kvh * D
            v_lo, v_hi = tl.load(vsrc + i), tl.load(vsrc + HALF + i)
            if R > 0:
                v_lo, v_hi = _lora_head(v_lo, v_hi, XA + b * stride_xa + LO_V, BV, HKV * D, kvh * D + i, R, RP, HALF)
            tl.store(VC + off + i, v_lo.to(VC.dtype.element_ty))
            tl.store(VC + off + HALF + i, v_hi.to(VC.dtype.element_ty))

    @triton.jit
    def _silu_times(gf, uf, dt, ACCURATE_EXP: tl.constexpr):
        """cast(cast(silu(g)) · u) for float32 g, u with the activations' dtype dt: torch's float32 arithmetic."""
        if ACCURATE_EXP:
            e = libdevice.exp(-gf)
        else:
            e = tl.exp(-gf)
        s = tl.math.div_rn(gf, 1.0 + e).to(dt)
        return s.to(tl.float32) * uf

    @triton.jit
    def _silu_mul_kernel(G, U, Y, width, stride_g, stride_u, BLOCK: tl.constexpr, ACCURATE_EXP: tl.constexpr):
        """y = cast(cast(g / (1 + e^−g)) · u) with PyTorch's float32 arithmetic: the accurate exp (tl.exp is the
        approximate ex2 on NVIDIA GPUs; Triton's CPU interpreter has only that one) and IEEE division. g and u
        [rows, width] at their own row strides (one program a row and block of columns); y contiguous."""
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = col < width
        g = tl.load(G + row * stride_g + col, mask=ok, other=0.0)
        u = tl.load(U + row * stride_u + col, mask=ok, other=0.0)
        y = _silu_times(g.to(tl.float32), u.to(tl.float32), g.dtype, ACCURATE_EXP)
        tl.store(Y + row * width + col, y.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_lora_kernel(G, U, Y, XA, BG, BU, rows, width, stride_g, stride_u, stride_xa, LO_G, LO_U,
                              R: tl.constexpr, RP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                              ACCURATE_EXP: tl.constexpr, DOT16: tl.constexpr):
        """A [BM, BN] tile of y = silu(g') · u' with g' = cast(g + xa[:, LO_G:LO_G + R] · BG), u' likewise (BG, BU:
        (s B)ᵀ [R, width]), rounded as _silu_mul_kernel rounds. The small products accumulate in float32, where the
        products of 16-bit inputs are exact: DOT16 feeds the 16-bit operands to the tensor cores as they are; else
        (Triton's interpreter, whose 16-bit dot is unusable) they are widened and multiplied in IEEE float32."""
        m = tl.program_id(1) * BM + tl.arange(0, BM)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        j = tl.arange(0, RP)
        mok, nok, jok = m < rows, n < width, j < R
        ok = mok[:, None] & nok[None, :]
        m64 = m.to(tl.int64)
        g = tl.load(G + m64[:, None] * stride_g + n[None, :], mask=ok, other=0.0)
        u = tl.load(U + m64[:, None] * stride_u + n[None, :], mask=ok, other=0.0)
        xa_rows = XA + m64[:, None] * stride_xa + j[None, :]
        xa_ok = mok[:, None] & jok[None, :]
        b_ok = jok[:, None] & nok[None, :]
        b_at = j[:, None] * width + n[None, :]
        xa_g = tl.load(xa_rows + LO_G, mask=xa_ok, other=0.0)  # [BM, RP]
        xa_u = tl.load(xa_rows + LO_U, mask=xa_ok, other=0.0)
        b_g = tl.load(BG + b_at, mask=b_ok, other=0.0)  # [RP, BN]
        b_u = tl.load(BU + b_at, mask=b_ok, other=0.0)
        if DOT16:
            dg = tl.dot(xa_g, b_g, out_dtype=tl.float32)
            du = tl.dot(xa_u, b_u, out_dtype=tl.float32)
        else:
            dg = tl.dot(xa_g.to(tl.float32), b_g.to(tl.float32), input_precision="ieee")
            du = tl.dot(xa_u.to(tl.float32), b_u.to(tl.float32), input_precision="ieee")
        gf = (g.to(tl.float32) + dg).to(g.dtype).to(tl.float32)
        uf = (u.to(tl.float32) + du).to(u.dtype).to(tl.float32)
        y = _silu_times(gf, uf, g.dtype, ACCURATE_EXP)
        tl.store(Y + m64[:, None] * width + n[None, :], y.to(Y.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------- dispatch
ROTARY_FP_FUSION = False  # the rotary kernel's launch option: no product + sum contracted into one rounding
# under Triton's interpreter (what triton.jit made of a kernel, as decode_kernel.DYNAMIC_STOP decides: any value of
# TRITON_INTERPRET it accepts counts) there is only the approximate exp and no usable 16-bit dot
INTERPRETED = triton is not None and type(_silu_mul_kernel).__name__ == "InterpretedFunction"
# launch choices of the LoRA-folding SiLU·up kernel (tile rows at most, tile columns, warps; for tuning: results do
# not depend on them beyond float32 summation order): the fastest of benchmarks/decode_glue_speed.py's sweep at both
# rollout shapes
LAUNCH = dict(silu_lora_bm=32, silu_lora_bn=64, silu_lora_warps=8)


def add_rmsnorm(h, delta, weight, eps: float, use_triton: bool):
    """(h + δ, RMSNorm(h + δ)); with Triton h is updated in place (it must be a contiguous [B, d] buffer)."""
    if not use_triton or (delta is not None and (delta.dtype != h.dtype or delta.dim() != 2 or delta.stride(-1) != 1)):
        return add_rmsnorm_reference(h, delta, weight, eps)  # the kernel keeps h's dtype; PyTorch would promote
    B, d = h.shape
    x = torch.empty(B, d, dtype=torch.result_type(weight, h), device=h.device)
    _add_rmsnorm_kernel[(B,)](h, delta if delta is not None else h, weight, x, d, float(eps),
                              delta.stride(0) if delta is not None else d,
                              HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(d),
                              num_warps=8 if d >= 2048 else 4)
    return h, x


def rotary_kv(q, k, v, cos, sin, k_cache, v_cache, write_index, use_triton: bool, q_norm=None, k_norm=None,
              eps: float = 1e-6, lora: "LoraFold | None" = None, slots=None):
    """LoRA deltas (``lora``), rotary embedding of q and k (after the per-head norms, if any), k and v into the
    slot store (row b into slot b, or slots[b]); q [B, Hq, D]."""
    D = cos.shape[-1]
    odd_norm = q_norm is not None and (q_norm.dtype != q.dtype or k_norm.dtype != k.dtype)
    odd_lora = lora is not None and any(b.dtype != t.dtype or not b.is_contiguous()
                                        for b, t in zip(lora.b_t, (q, k, v)))
    if not use_triton or odd_norm or odd_lora or D % 2 or (D // 2) & (D // 2 - 1):  # the kernel: a power-of-two
        return rotary_kv_reference(q, k, v, cos, sin, k_cache, v_cache, write_index, q_norm, k_norm, eps,  # half
                                   lora, slots)
    B = q.shape[0]
    hq, hkv = q.shape[-1] // D, k.shape[-1] // D
    out = torch.empty(B, hq, D, dtype=q.dtype, device=q.device)
    cos, sin = cos.reshape(B, D).contiguous(), sin.reshape(B, D).contiguous()
    q, k, v = (_rows(t) for t in (q, k, v))
    xa = _rows(lora.xa) if lora is not None else q
    b_q, b_k, b_v = lora.b_t if lora is not None else (q, q, q)
    lo_q, lo_k, lo_v = lora.lo if lora is not None else (0, 0, 0)
    r = lora.r if lora is not None else 0
    _rotary_kv_kernel[(B, hq + hkv)](
        q, k, v, cos, sin, k_cache, v_cache, write_index,
        q_norm if q_norm is not None else cos, k_norm if k_norm is not None else cos, out, float(eps),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), q.stride(0), k.stride(0), v.stride(0),
        xa, xa.stride(0), lo_q, lo_k, lo_v, b_q, b_k, b_v, slots if slots is not None else write_index,
        HQ=hq, HKV=hkv, D=D, HALF=D // 2, R=r, RP=triton.next_power_of_2(max(r, 1)),
        HAS_NORM=q_norm is not None, HAS_SLOTS=slots is not None, num_warps=1, enable_fp_fusion=ROTARY_FP_FUSION)
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, width] with unit column stride (a view when it is one already: a packed product's column
    block), for the kernels that take a row stride."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def decode_silu_mul(gate: torch.Tensor, up: torch.Tensor, use_triton: bool,
                    lora: "LoraFold | None" = None) -> torch.Tensor:
    """silu(g) · u (after gate/up's LoRA deltas from ``lora``, if given) for decode rows; no autograd."""
    odd_lora = lora is not None and (gate.dim() != 2 or any(b.dtype != gate.dtype or not b.is_contiguous()
                                                            for b in lora.b_t) or up.dtype != gate.dtype)
    if not use_triton or odd_lora:
        return decode_silu_mul_reference(gate, up, lora)
    shape = gate.shape
    gate, up = _rows(gate), _rows(up)
    y = torch.empty(gate.shape, dtype=torch.result_type(gate, up), device=gate.device)
    rows, width = gate.shape
    if not rows or not width:
        return y.view(shape)
    if lora is not None:
        xa = _rows(lora.xa)
        bm = min(LAUNCH["silu_lora_bm"], max(16, triton.next_power_of_2(rows)))
        bn = LAUNCH["silu_lora_bn"]
        _silu_mul_lora_kernel[(triton.cdiv(width, bn), triton.cdiv(rows, bm))](
            gate, up, y, xa, lora.b_t[0], lora.b_t[1], rows, width, gate.stride(0), up.stride(0), xa.stride(0),
            lora.lo[0], lora.lo[1], R=lora.r, RP=max(16, triton.next_power_of_2(lora.r)), BM=bm, BN=bn,
            ACCURATE_EXP=not INTERPRETED, DOT16=not INTERPRETED and xa.dtype == gate.dtype != torch.float32,
            num_warps=LAUNCH["silu_lora_warps"])
    else:
        _silu_mul_kernel[(rows, triton.cdiv(width, 1024))](gate, up, y, width, gate.stride(0), up.stride(0),
                                                           BLOCK=1024, ACCURATE_EXP=not INTERPRETED, num_warps=4)
    return y.view(shape)
