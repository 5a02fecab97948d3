"""x · Wᵀ for a bitsandbytes NF4 weight, read in its 4-bit form (the decode-step product of a QLoRA base).

bitsandbytes multiplies a batch of rows (decode steps have 16–512) by first writing the whole weight out in 16 bits
and then running a 16-bit product: 0.5 + 2 + 2 bytes moved per parameter, more than a 16-bit base's 2. This
kernel dequantizes in registers instead, reading 0.5 byte per parameter plus its block scale:

    W[n, k] = cast(code[q[n, k]] · absmax[n, k // 64])          (exactly bitsandbytes' dequantized value)
    y = x · Wᵀ                                                   (float32 accumulation, split over K)

Layout (bitsandbytes ``quantize_4bit``, blocksize 64): W [N, K] row-major, two 4-bit codes per byte, the element
of even k in the high nibble; ``absmax`` one float per 64 consecutive elements (its nested 8-bit form is expanded
once by :func:`nf4_operands`). The byte j of a row holds k = 2j (high) and 2j + 1 (low), so a chunk of K is two
products, x[:, even k] · W_hiᵀ + x[:, odd k] · W_loᵀ.

:func:`nf4_linear_reference` is the plain twin (bitsandbytes' dequantized weight, then ``F.linear``);
tests/test_nf4_matmul.py checks both against bitsandbytes, the kernel through Triton's interpreter;
benchmarks/nf4_matmul.py times them on the GPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton use the twin
    triton = None

BLOCKSIZE = 64  # bitsandbytes' NF4 block (elements per absmax)


def nf4_operands(weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(packed uint8 [N·K/2], absmax float32 [N·K/64], code float32 [16], N, K) of a bitsandbytes ``Params4bit``
    NF4 weight; the nested (8-bit) absmax expanded to float32 as bitsandbytes' own dequantization does."""
    state = weight.quant_state
    if state.quant_type != "nf4" or state.blocksize != BLOCKSIZE:
        raise ValueError(f"nf4_matmul reads NF4 with blocksize {BLOCKSIZE}; got {state.quant_type}/{state.blocksize}")
    if weight.data.dtype != torch.uint8:
        raise ValueError(f"nf4_matmul reads codes stored as uint8; got {weight.data.dtype} (bnb_4bit_quant_storage)")
    N, K = state.shape
    if state.nested:
        import bitsandbytes.functional as bnbf

        absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
    else:
        absmax = state.absmax
    return weight.data.reshape(-1), absmax.float().reshape(-1), state.code.float(), N, K


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, N: int, K: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in ``dtype``: cast(code[q] · absmax), bitsandbytes' dequantization."""
    # blocks run across rows, so the last one may be partial: both cut to the N·K elements
    nib = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[: N * K].long()  # [N·K], high nibble first
    return (code[nib] * absmax.repeat_interleave(BLOCKSIZE)[: N * K]).to(dtype).view(N, K)


def nf4_linear_reference(x: torch.Tensor, packed, absmax, code, N: int, K: int, bias=None) -> torch.Tensor:
    """x [..., K] → [..., N]: the dequantized weight, then ``F.linear`` (bitsandbytes' batched path)."""
    return torch.nn.functional.linear(x, dequantize_nf4(packed, absmax, code, N, K, x.dtype), bias)


if triton is not None:
    @triton.jit
    def _nf4_kernel(X, P, A, CODE, Y, M, N, K, KB, KS, stride_ym, stride_ys, K_PER_SPLIT: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """Program (n tile, m tile, K split): acc [BM, BN] over its K range in chunks of BK (BK/2 bytes a row,
        BK/64 scales), written to the split's float32 slice of Y. KB = K/2 bytes and KS = K/64 scales a row are
        arguments of their own, so that their divisibility is known and the byte loads are vectorised."""
        pn, pm, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = pn * BN + tl.arange(0, BN)
        m = pm * BM + tl.arange(0, BM)
        j = tl.arange(0, BK // 2)  # byte of the chunk: elements 2j (high nibble), 2j + 1 (low)
        kk = tl.arange(0, BK)
        n_ok, m_ok = n < N, m < M
        row_bytes = n.to(tl.int64)[:, None] * KB
        row_scales = n.to(tl.int64)[:, None] * KS
        x_rows = m.to(tl.int64)[:, None] * K
        first_half = (j < 32)[None, :]  # bytes 0..31 of a chunk are block k0/64, 32..63 the next one
        acc = tl.zeros([BM, BN], tl.float32)
        x_dtype = X.dtype.element_ty
        for off in range(0, K_PER_SPLIT, BK):
            k0 = ps * K_PER_SPLIT + off
            k0_t = tl.zeros([1, 1], tl.int32) + k0  # masks from tensors (a bare bool breaks the interpreter)
            in_k = (k0 + 2 * j < K)[None, :]  # [1, BK/2]
            byte = tl.load(P + row_bytes + (k0 // 2 + j)[None, :], mask=n_ok[:, None] & in_k, other=0)  # [BN, BK/2]
            s_lo = tl.load(A + row_scales + k0 // 64, mask=n_ok[:, None] & (k0_t < K), other=0.0)  # [BN, 1]
            s_hi = tl.load(A + row_scales + k0 // 64 + 1, mask=n_ok[:, None] & (k0_t + 64 < K), other=0.0)
            scale = tl.where(first_half, s_lo, s_hi)  # [BN, BK/2]
            w_hi = (tl.load(CODE + (byte >> 4).to(tl.int32)) * scale).to(x_dtype)  # W[n, k0 + 2j]
            w_lo = (tl.load(CODE + (byte & 15).to(tl.int32)) * scale).to(x_dtype)  # W[n, k0 + 2j + 1]
            x = tl.load(X + x_rows + (k0 + kk)[None, :], mask=m_ok[:, None] & (k0 + kk < K)[None, :], other=0.0)
            x_even, x_odd = tl.split(tl.reshape(x, [BM, BK // 2, 2]))  # [BM, BK/2] each: columns 2j and 2j + 1
            acc += tl.dot(x_even, tl.trans(w_hi), out_dtype=tl.float32)
            acc += tl.dot(x_odd, tl.trans(w_lo), out_dtype=tl.float32)
        y = Y + ps * stride_ys + m[:, None].to(tl.int64) * stride_ym + n[None, :]
        tl.store(y, acc, mask=m_ok[:, None] & n_ok[None, :])


def _split_k(N: int, K: int, bn: int, m_tiles: int, programs: int = 264) -> int:
    """K splits so that about ``programs`` programs run (a 4,096-row weight is only 64 tiles of 64), each split
    at least 512 of K."""
    tiles = -(-N // bn) * m_tiles
    return max(1, min(K // 512, -(-programs // tiles)))


def nf4_linear(x: torch.Tensor, packed, absmax, code, N: int, K: int, bias=None, use_triton: bool = True):
    """x [..., K] → [..., N] = x · Wᵀ (+ bias) for the NF4 weight (see the module docstring); the twin when Triton
    is off or the shapes are not the kernel's (K a multiple of 64, 16-bit x)."""
    if (not use_triton or triton is None or K % BLOCKSIZE or x.shape[-1] != K
            or x.dtype not in (torch.bfloat16, torch.float16)):
        return nf4_linear_reference(x, packed, absmax, code, N, K, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    BM = min(128, max(16, triton.next_power_of_2(M)))  # up to 128 rows in one tile: the weight is read once
    BN, BK = 64, 128
    m_tiles = -(-M // BM)
    split = _split_k(N, K, BN, m_tiles)
    per_split = -(-(-(-K // split)) // BK) * BK  # each split a multiple of BK
    split = -(-K // per_split)
    partial = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _nf4_kernel[(-(-N // BN), m_tiles, split)](x2, packed, absmax, code, partial, M, N, K, K // 2, K // BLOCKSIZE,
                                               partial.stride(1), partial.stride(0), K_PER_SPLIT=per_split, BM=BM,
                                               BN=BN, BK=BK,
                                               num_warps=8 if BM == 128 else 4, num_stages=3)
    y = partial.sum(0) if split > 1 else partial[0]  # a fixed order: the same result every call
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, N)
