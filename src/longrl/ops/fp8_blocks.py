"""FP8 e4m3 weights with one float32 scale per 128 × 128 block: quantization and dequantization.

For a weight W [N, K], block (i, j) = rows [128 i, 128 i + 128) × columns [128 j, 128 j + 128) (the last ones
partial when N or K is not a multiple of 128):

    s[i, j]  = max |W[block]| / 448                    (448: e4m3's largest finite value; 1 for an all-zero block)
    q[n, k]  = e4m3(W[n, k] / s[n // 128, k // 128])   round to nearest even, |W / s| ≤ 448 by construction
    Ŵ[n, k]  = cast(float32(q[n, k]) · s[n // 128, k // 128])

so |W − Ŵ| ≤ 2⁻⁴ |W| (half an ulp of e4m3's 3 mantissa bits) where W / s is a normal e4m3 number, and ≤ 2⁻¹⁰ s in
its subnormal range (|W / s| < 2⁻⁶), before the final cast. Storage: N·K bytes + 4 bytes a block.

:func:`dequantize_fp8_reference` is the plain twin (float32 product of the expanded scales, then the cast);
:func:`dequantize_fp8` runs a Triton kernel on CUDA that writes Ŵ tile by tile without float32 copies of the
matrix, bit for bit the twin's values (tests/test_fp8_base.py compares them through Triton's interpreter).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton use the twin
    triton = None

FP8_BLOCK = 128  # rows and columns a scale covers
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn
SLAB_ROWS = 16 * FP8_BLOCK  # rows quantized at once: bounds the float32 transients to 2048 × K


def fp8_blocks(N: int, K: int) -> tuple[int, int]:
    """(block rows, block columns) of an N × K weight: ⌈N/128⌉, ⌈K/128⌉."""
    return -(-N // FP8_BLOCK), -(-K // FP8_BLOCK)


def fp8_bytes(N: int, K: int) -> int:
    """Bytes of an N × K weight in FP8 blocks: one byte a weight + a float32 scale a block."""
    nb, kb = fp8_blocks(N, K)
    return N * K + 4 * nb * kb


FP8_BYTES_PER_PARAM = 1 + 4 / FP8_BLOCK ** 2  # ≈ 1.0002 (whole blocks)


def _padded_blocks(w: torch.Tensor) -> torch.Tensor:
    """w [n, K] (n ≤ SLAB_ROWS) in float32, zero-padded to whole blocks and viewed [nb, 128, kb, 128]."""
    n, K = w.shape
    nb, kb = fp8_blocks(n, K)
    padded = torch.zeros(nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=torch.float32, device=w.device)
    padded[:n, :K] = w
    return padded.view(nb, FP8_BLOCK, kb, FP8_BLOCK)


def quantize_fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [N, K], s float32 [⌈N/128⌉, ⌈K/128⌉]) of a 2-D weight (module docstring), on its device,
    2048 rows at a time."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_fp8_blocks: a 2-D weight; got shape {tuple(weight.shape)}")
    N, K = weight.shape
    q = torch.empty(N, K, dtype=FP8_DTYPE, device=weight.device)
    s = torch.empty(*fp8_blocks(N, K), dtype=torch.float32, device=weight.device)
    for r0 in range(0, N, SLAB_ROWS):
        w = weight[r0:r0 + SLAB_ROWS].detach()
        blocks = _padded_blocks(w)  # [nb, 128, kb, 128]
        amax = blocks.abs().amax(dim=(1, 3))  # [nb, kb]
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        scaled = (blocks / scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)  # (a rounding may reach 448 + ε)
        n = w.shape[0]
        q[r0:r0 + n] = scaled.view(-1, blocks.shape[2] * FP8_BLOCK)[:n, :K].to(FP8_DTYPE)
        s[r0 // FP8_BLOCK:r0 // FP8_BLOCK + scale.shape[0]] = scale
    return q, s


def expanded_scales(scales: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """float32 [N, K]: each weight's block scale."""
    return scales.repeat_interleave(FP8_BLOCK, 0)[:N].repeat_interleave(FP8_BLOCK, 1)[:, :K]


def dequantize_fp8_reference(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Ŵ [N, K] in ``dtype``: cast(float32(q) · s), the whole matrix in float32 first (the twin)."""
    N, K = q.shape
    return (q.float() * expanded_scales(scales, N, K)).to(dtype)


def fp8_roundtrip(weight: torch.Tensor) -> torch.Tensor:
    """Ŵ = dequantize(quantize(W)) in W's dtype (for the sensitivity scores of models/quantize.py)."""
    return dequantize_fp8_reference(*quantize_fp8_blocks(weight), weight.dtype)


if triton is not None:
    @triton.jit
    def _dequantize_kernel(Q, S, W, N, K, KB, BN: tl.constexpr, BK: tl.constexpr):
        """Program (row tile, column tile) of BN × BK inside one 128 × 128 block: W = cast(float32(Q) · S)."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        k = tl.program_id(1) * BK + tl.arange(0, BK)
        ok = (n < N)[:, None] & (k < K)[None, :]
        offs = n.to(tl.int64)[:, None] * K + k[None, :]
        s = tl.load(S + (tl.program_id(0) * BN // 128) * KB + tl.program_id(1) * BK // 128)  # this tile's scale
        q = tl.load(Q + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(W + offs, (q * s).to(W.dtype.element_ty), mask=ok)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                   use_triton: bool | None = None) -> torch.Tensor:
    """Ŵ [N, K] in ``dtype`` (module docstring): the Triton kernel on CUDA (``use_triton`` None), else the twin."""
    if use_triton is None:
        use_triton = q.is_cuda
    if not use_triton or triton is None:
        return dequantize_fp8_reference(q, scales, dtype)
    N, K = q.shape
    out = torch.empty(N, K, dtype=dtype, device=q.device)
    BN, BK = 32, 128  # (both divide 128: a tile never straddles two blocks)
    _dequantize_kernel[(math.ceil(N / BN), math.ceil(K / BK))](q, scales, out, N, K, scales.shape[1], BN=BN, BK=BK)
    return out
