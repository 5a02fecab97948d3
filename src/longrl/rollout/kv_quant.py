"""FP8 (e4m3) keys and values for the sampler's KV cache, with a power-of-two scale per position and key head.

A row x [D] (one position of one key head) is stored as q = fp8(clamp(x · 2^−e, ±448)) [D] and e [1] (int8):

    e = the smallest integer with max|x| ≤ 448 · 2^e,  from the bits of a = max|x| = m · 2^E (1 ≤ m < 2):
        e = E − 8 + [m > 1.75]                        (448 = 1.75 · 2^8), clamped to [−EXP_LIMIT, EXP_LIMIT]

and read back as x̂ = float(q) · 2^e. Scaling by a power of two is exact in float32, so the only rounding is e4m3's
(3 mantissa bits: |x̂ − x| ≤ 2^−4 |x| for normal values, 2^−9 · 2^e absolute below them), and the kernel and its
twin compute e and q bit for bit alike (integer arithmetic on the float32 bits; the cast rounds to nearest even).
Per position: D bytes + 1 exponent byte, against 2 D for bf16 ((D + 1) / 2D of the bytes: 0.504 at D = 128; the
value stores' capacity padding, below 128 positions a store, adds to that).
A NaN element is stored as 0, so that every code in a store is finite (the attention kernel reads whole blocks of
values past a sequence's end, where they are weighed by p = 0).

The value codes are stored position-minor, [..., D, T'] with T' = T rounded up to planner.V_ALIGN (value_capacity):
the decode attention's second product reads them as its k-major operand, four positions a 32-bit word, with no
byte gathers and no position mask (:func:`quantize_values`, :func:`dequantize_values`). Keys stay [..., T, D].

:func:`store_decode` is the decode step's write (a Triton kernel on CUDA, one program per row and key head);
:func:`quantize_reference` its PyTorch twin (and the prefill's write).
"""

from __future__ import annotations

import torch

from ..memory.planner import value_capacity  # T' (planner.V_ALIGN: the e4m3 decode attention's key block)
from .sampling import triton_available

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
EXP_LIMIT = 120  # |e| bound: 2^±e stays a normal float32 (and far past any key or value magnitude)


def exponent_reference(amax: torch.Tensor) -> torch.Tensor:
    """e (int32) with amax ≤ 448 · 2^e, the smallest such, from amax's float32 bits (module docstring)."""
    bits = amax.float().contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return e.clamp(-EXP_LIMIT, EXP_LIMIT)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer e within ±EXP_LIMIT (built from its bits: exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] → (q [..., D] float8_e4m3fn, e [...] int8): x ≈ float(q) · 2^e per row."""
    xf = torch.nan_to_num(x.float(), nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    e = exponent_reference(xf.abs().amax(-1))
    q = (xf * pow2(-e)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, e.to(torch.int8)


def dequantize(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """float32 float(q) · 2^e: q [..., D] float8_e4m3fn, e [...] int8."""
    return q.float() * pow2(e)[..., None]


def quantize_values(x: torch.Tensor, capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Values x [..., T, D] → (q [..., D, T'] float8_e4m3fn, position-minor, T' = ``capacity`` or
    value_capacity(T); positions past T hold 0) and e [..., T] int8: quantize_reference's codes, transposed."""
    q, e = quantize_reference(x)
    T = x.shape[-2]
    out = torch.zeros(*x.shape[:-2], x.shape[-1], capacity or value_capacity(T), dtype=FP8, device=x.device)
    out[..., :T] = q.transpose(-1, -2)
    return out, e


def quantize_cache(k_pre, v_pre, k_suf, v_suf) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(codes, exponents) of a whole cache as decode attention reads it: keys by quantize_reference, values
    position-minor by quantize_values (whole blocks)."""
    return [quantize_reference(k_pre), quantize_values(v_pre), quantize_reference(k_suf), quantize_values(v_suf)]


def dequantize_values(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """float32 [..., T, D] of a position-minor value store q [..., D, T'] and its exponents e [..., T] (T ≤ T')."""
    return dequantize(q[..., : e.shape[-1]].transpose(-1, -2), e)


def store_rows(k, v, k_cache, v_cache, k_exp, v_exp, slots, positions) -> None:
    """k, v [M, Hkv, D] quantized into position positions[m] of slot slots[m]: k_cache [S, Hkv, T, D] and v_cache
    [S, Hkv, D, T'] (position-minor) fp8, k_exp, v_exp [S, Hkv, T] int8."""
    (kq, ke), (vq, ve) = quantize_reference(k), quantize_reference(v)
    k_cache[slots, :, positions] = kq
    v_cache[slots, :, :, positions] = vq  # [M, Hkv, D]: the indexed dimensions go first
    k_exp[slots, :, positions] = ke
    v_exp[slots, :, positions] = ve


def store_reference(k, v, k_cache, v_cache, k_exp, v_exp, write_index) -> None:
    """k, v [B, Hkv, D] into position write_index[b] of slot b (store_rows)."""
    store_rows(k, v, k_cache, v_cache, k_exp, v_exp, torch.arange(k.shape[0], device=k.device), write_index)


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def scale_exponent(amax, EXP_LIMIT: tl.constexpr):
        """e (int32) with amax ≤ 448 · 2^e, the smallest such, clamped to ±EXP_LIMIT (exponent_reference's rule,
        from amax's float32 bits; amax a scalar or a tensor)."""
        bits = amax.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        return tl.minimum(tl.maximum(e, -EXP_LIMIT), EXP_LIMIT)

    @triton.jit
    def _quantize_row(x, FP8_MAX: tl.constexpr, EXP_LIMIT: tl.constexpr):
        """(q bits [DP] uint8, e int32) of one row x [DP] float32 (masked lanes 0): the twin's arithmetic."""
        x = tl.where(x != x, 0.0, x)  # NaN → 0: every stored code is finite
        e = scale_exponent(tl.max(tl.abs(x), 0), EXP_LIMIT)
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^−e
        y = tl.minimum(tl.maximum(x * inv, -FP8_MAX), FP8_MAX)
        return round_e4m3(y).to(tl.float8e4nv).to(tl.uint8, bitcast=True), e

    @triton.jit
    def round_e4m3(y):
        """y (|y| ≤ 448, float32) rounded to the nearest e4m3 value, ties to even, still in float32, so that the cast
        after it is exact (Triton's interpreter rounds a carry out of the 3-bit mantissa down an octave): normal
        values (≥ 2^−6) keep 3 mantissa bits, subnormal ones become multiples of 2^−9."""
        bits = y.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # low 20 bits cleared
        sub = ((y * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)  # 1.5 · 2^23: rounds to an integer, to even
        return tl.where(tl.abs(y) >= 0.015625, normal, sub)

    @triton.jit
    def _store_kernel(K, V, KC, VC, KE, VE, WIDX, SLOTS, stride_kb, stride_kh, stride_vb, stride_vh,
                      stride_cs, stride_ch, stride_ct, stride_vcs, stride_vch, stride_vcd, stride_es, stride_eh,
                      D: tl.constexpr, DP: tl.constexpr, FP8_MAX: tl.constexpr, EXP_LIMIT: tl.constexpr,
                      HAS_SLOTS: tl.constexpr):
        """One program per (row b, key head h): k[b, h], v[b, h] quantized into position WIDX[b] of slot b, or of slot
        SLOTS[b] (HAS_SLOTS) (the key store [S, Hkv, T, D], the value store position-minor [S, Hkv, D, T'])."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        dims = tl.arange(0, DP)
        ok = dims < D
        t = tl.load(WIDX + b)
        if HAS_SLOTS:
            s = tl.load(SLOTS + b).to(tl.int64)
        else:
            s = b
        k = tl.load(K + b * stride_kb + h * stride_kh + dims, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(V + b * stride_vb + h * stride_vh + dims, mask=ok, other=0.0).to(tl.float32)
        kq, ke = _quantize_row(k, FP8_MAX, EXP_LIMIT)
        vq, ve = _quantize_row(v, FP8_MAX, EXP_LIMIT)
        tl.store(KC + s * stride_cs + h * stride_ch + t * stride_ct + dims, kq, mask=ok)
        tl.store(VC + s * stride_vcs + h * stride_vch + dims * stride_vcd + t, vq, mask=ok)
        tl.store(KE + s * stride_es + h * stride_eh + t, ke.to(tl.int8))
        tl.store(VE + s * stride_es + h * stride_eh + t, ve.to(tl.int8))


def store_decode(k, v, k_cache, v_cache, k_exp, v_exp, write_index, use_triton: bool, slots=None) -> None:
    """store_reference's result (slots [B]: row b into slot slots[b], store_rows'); through the Triton kernel when
    ``use_triton`` (one launch for k and v)."""
    if not use_triton:
        if slots is not None:
            store_rows(k, v, k_cache, v_cache, k_exp, v_exp, slots, write_index)
        else:
            store_reference(k, v, k_cache, v_cache, k_exp, v_exp, write_index)
        return
    B, H, D = k.shape
    kc, vc = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    assert kc.stride(3) == 1 and vc.stride(3) == 1, "key rows and value positions run contiguously"
    _store_kernel[(B, H)](k, v, kc, vc, k_exp, v_exp, write_index, slots if slots is not None else write_index,
                          k.stride(0), k.stride(1), v.stride(0),
                          v.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1),
                          vc.stride(2), k_exp.stride(0), k_exp.stride(1),
                          D=D, DP=triton.next_power_of_2(D), FP8_MAX=FP8_MAX, EXP_LIMIT=EXP_LIMIT,
                          HAS_SLOTS=slots is not None, num_warps=1)
