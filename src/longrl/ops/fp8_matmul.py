"""x · Wᵀ for FP8 block-scaled weights read in their 8-bit form (the decode-step products of an FP8 base).

Decode steps multiply few rows (1–32 a step, up to 128) by every weight: the product is bound by reading the
weights. An FP8 base's forward (models/fp8_linear.py) dequantizes the whole matrix to 16 bits first, 1 + 2 + 2
bytes moved per parameter; this kernel dequantizes in registers instead, reading 1 byte per parameter plus a
float32 scale per 128 × 128 block (ops/fp8_blocks.py):

    W_i[n, k] = cast(float32(q_i[n, k]) · s_i[n // 128, k // 128])     (exactly the dequantized value)
    y = x · [W_0; W_1; W_2; D]ᵀ (+ bias)                                 (float32 sums, split over K, one rounding)

A product reads a *group*, as the NF4 product does (ops/nf4_matmul.py): up to three FP8 weights of the same input
width stacked by rows (q/k/v, gate/up), then optional 16-bit rows D (the stacked LoRA A rows of the packed decode,
rollout/fast_decode.py); nothing is copied (the group holds each weight's codes and scales as the modules keep
them). A program owns BN rows of one weight (or of D) and a range of K in chunks of 128 (one block column: its
rows' scales are one small gather); the dequantized tile is the left operand of a tensor-core product with the
few rows of x. K is split over programs so that a small group still fills the GPU; the splits' float32 partial
sums are added in a fixed order (ops/nf4_matmul.py's split-sum kernel: the same result every call).

:func:`fp8_group_reference` is the plain twin (the dequantized weights stacked, then ``F.linear``);
tests/test_fp8_matmul.py checks the kernel against it through Triton's interpreter on odd and block-crossing
shapes; benchmarks/nf4_matmul.py --fp8 times both on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8_blocks import FP8_BLOCK, FP8_DTYPE, dequantize_fp8_reference, fp8_blocks
from .nf4_matmul import (MIN_BN, check_dense, fixes_up, group_grid, launch_for, matrix_rows, split_locks,
                         split_target, stacked_bias, sum_splits)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton use the twin
    triton = None

MAX_FP8 = 3  # FP8 weights one group stacks (q/k/v)
CHUNK = FP8_BLOCK  # elements of K a program reads per step: one block column

# launch choice by rows of x (the smallest bucket ≥ M; above 128 rows, the 128 entry in row tiles of 128): bn rows
# a program owns, warps, pipeline stages, and the programs the K split aims at (split = ⌈programs / row tiles⌉,
# each split ≥ 4 chunks); f16 (absent: off): the codes enter float16 tensor cores as they are (e4m3 ⊂ float16, one
# conversion per two codes) with x as float16(x · p) (pow2_scale_reference), each block's scale after its product;
# its result is the product with the unrounded weights q · s (fp8_group_reference(f16=True)), not with their bf16
# rounding that the FP8 layer's forward multiplies, so it is a tuning choice, not a default (and slower at every
# row count measured). The table: benchmarks/nf4_matmul.py --fp8 --sweep's fastest on an H100 (2026-12-06,
# fp8_matmul_h100_sweep.md), the 64-row entry taking the 128-row choice. fixup: as nf4_matmul.LAUNCH's, on at 8 and
# 32 rows where the sweep found it fastest (a layer's products 102.8 µs against 107.2 at 8 rows).
LAUNCH = {16: dict(bn=64, warps=4, stages=3, programs=528, fixup=True),
          32: dict(bn=64, warps=4, stages=3, programs=528, fixup=True),
          64: dict(bn=64, warps=4, stages=3, programs=264),
          128: dict(bn=64, warps=4, stages=3, programs=264)}


@dataclass
class FP8Group:
    """The operands of one grouped product: FP8 weights stacked by rows, then optional 16-bit rows."""

    codes: list  # each weight's float8_e4m3fn [N_i, K] (the module's own storage)
    scales: list  # each weight's float32 [⌈N_i/128⌉, ⌈K/128⌉]
    rows: list  # N_i
    K: int
    dense: torch.Tensor | None = None  # [R, K] 16-bit rows after the FP8 ones (LoRA A), or None
    bias: torch.Tensor | None = None  # [Σ N_i + R] (zeros on the dense rows), or None
    locks: torch.Tensor | None = None  # int32 [row tiles]: split_locks, the fixup launch choice's counts

    def __post_init__(self):
        if self.locks is None:
            self.locks = split_locks(self.out_features, self.codes[0].device)

    @property
    def fp8_rows(self) -> int:
        return sum(self.rows)

    @property
    def out_features(self) -> int:
        return self.fp8_rows + (self.dense.shape[0] if self.dense is not None else 0)


def fp8_groupable(codes: list, scales: list) -> str | None:
    """Why these FP8 weights cannot be one group (None: they can): 1 to 3 contiguous float8_e4m3fn matrices of one
    input width with their block scales, every weight but the last a multiple of 16 rows (a row tile never
    straddles two weights), on one device."""
    if not 1 <= len(codes) <= MAX_FP8 or len(scales) != len(codes):
        return f"{len(codes)} weights (1 to {MAX_FP8}, each with its scales)"
    for q, s in zip(codes, scales):
        if q.dim() != 2 or q.dtype != FP8_DTYPE or not q.is_contiguous():
            return "not contiguous float8_e4m3fn matrices"
        if s.dtype != torch.float32 or tuple(s.shape) != fp8_blocks(*q.shape) or not s.is_contiguous():
            return f"scales {tuple(s.shape)} {s.dtype} (float32, one per 128 × 128 block)"
    if len({q.shape[1] for q in codes}) > 1:
        return f"input widths {sorted({q.shape[1] for q in codes})} (one)"
    if any(q.shape[0] % MIN_BN for q in codes[:-1]):
        return f"row counts {[q.shape[0] for q in codes]} (all but the last a multiple of {MIN_BN})"
    if len({t.device for t in codes + scales}) > 1:
        return "weights on several devices"
    return None


def fp8_group(codes: list, scales: list, dense: torch.Tensor | None = None,
              biases: list | None = None) -> FP8Group:
    """The group of FP8 weights (codes and block scales, q/k/v, gate/up, or one), their biases (a list with None
    for none; all None: no bias) and the 16-bit rows ``dense`` [R, K] after them; nothing is copied but the
    biases."""
    reason = fp8_groupable(codes, scales)
    if reason:
        raise ValueError(f"fp8_group: {reason}")
    K = codes[0].shape[1]
    check_dense(dense, K, "fp8_group")
    rows = [q.shape[0] for q in codes]
    bias = stacked_bias(biases, rows, dense, codes[0].device)
    return FP8Group(list(codes), list(scales), rows, K, dense.contiguous() if dense is not None else None, bias)


def fp8_group_weight(group: FP8Group, dtype: torch.dtype) -> torch.Tensor:
    """The group's stacked weight [Σ N_i + R, K] in ``dtype``, each FP8 weight dequantized."""
    parts = [dequantize_fp8_reference(q, s, dtype) for q, s in zip(group.codes, group.scales)]
    if group.dense is not None:
        parts.append(group.dense.to(dtype))
    return torch.cat(parts)


def fp8_group_reference(x: torch.Tensor, group: FP8Group, f16: bool = False) -> torch.Tensor:
    """x [..., K] → [..., Σ N_i + R]: the stacked dequantized weight, then ``F.linear`` (the kernel's twin).
    f16: the twin of the f16 launch choice, the product with the weights q · s unrounded, in float32, then cast."""
    if f16:
        bias = group.bias.float() if group.bias is not None else None
        return torch.nn.functional.linear(x.float(), fp8_group_weight(group, torch.float32), bias).to(x.dtype)
    bias = group.bias.to(x.dtype) if group.bias is not None else None
    return torch.nn.functional.linear(x, fp8_group_weight(group, x.dtype), bias)


def pow2_scale_reference(amax: torch.Tensor) -> torch.Tensor:
    """p = 2^(15 − e) for float32 amax = m · 2^e (m in [0.5, 1)), its exponent kept within [2^-126, 2^126] (so 1/p
    is a normal float32 too): the f16 choice's scale of a row of x, whose largest |x| is amax. x · p then lies below
    2^15 (no float16 overflow), and every value from 2^-28 of amax up lands in float16's normal range, where it
    converts exactly (a bf16 or float16 value has at most 11 significant bits). The kernel's _pow2_scale is its
    twin, on the float's bits."""
    amax = amax.float()  # finite, ≥ 0
    e = torch.frexp(amax).exponent  # (subnormals: their true exponent, below −125)
    e = torch.where(amax > 0, e, -200)  # 0 as the smallest: the largest p
    return torch.ldexp(torch.ones_like(amax), (15 - e).clamp(-126, 126))


def float16_rows_reference(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float16(x · p) [M, K], 1/p [M]) with p = pow2_scale_reference of each row's largest |x| (the f16 choice
    computes p over each program's range of K instead: the same exactness)."""
    p = pow2_scale_reference(x2.abs().amax(dim=1).float())
    return (x2.float() * p[:, None]).to(torch.float16), 1.0 / p


if triton is not None:
    from .nf4_matmul import _last_split_sums  # (a jitted epilogue the FP8 kernel shares)

    @triton.jit
    def _pow2_scale(amax):
        """pow2_scale_reference on the bits of finite float32 amax ≥ 0: its biased exponent b (amax = m · 2^(b − 126),
        m in [0.5, 1), for b ≥ 1; 0 and subnormals: b = 0) gives p's biased exponent 127 + 15 − (b − 126) = 268 − b,
        kept in [1, 253]."""
        b = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        return (tl.minimum(tl.maximum(268 - b, 1), 253) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp8_group_kernel(X, P0, P1, P2, S0, S1, S2, D, BIAS, Y, OUT, LOCK, M, K, KB, N0, N01, NQ, R, stride_xm,
                          stride_ym, stride_ys, n_chunks, chunks_per_split, dense_tiles, HAS_BIAS: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, EVEN_K: tl.constexpr, F16: tl.constexpr,
                          FIXUP: tl.constexpr = False, SUM_BIAS: tl.constexpr = False):
        """Program (row tile, K split, m tile). Row tiles [0, dense_tiles) are the 16-bit rows D, the rest the FP8
        rows; an FP8 tile lies inside one weight (P0 rows [0, N0), P1 [N0, N01), P2 [N01, NQ)), whose scales are
        S0, S1, S2. acc [BN, BM] (weight tile on the left) goes to split ps's float32 slice of Y, or (one split)
        to Y itself with the bias, cast. F16: the FP8 rows multiply float16 codes (exact) by float16(x · p) on
        float16 tensor cores, p a power of two a row of x from its largest |x| in this program's range of K
        (_pow2_scale), each chunk's product times its rows' scales and the sum times 1/p (the f16 choice). FIXUP:
        the tile's last program sums the splits into OUT (nf4_matmul._last_split_sums)."""
        pn, ps, pm = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        m = pm * BM + tl.arange(0, BM)
        m_ok = m < M
        x_rows = X + m.to(tl.int64) * stride_xm  # [BM]
        c_start = ps * chunks_per_split
        c_stop = tl.minimum(c_start + chunks_per_split, n_chunks)
        acc = tl.zeros([BN, BM], tl.float32)
        kk = tl.arange(0, 128)
        if pn < dense_tiles:  # 16-bit rows: plain product
            r = pn * BN + tl.arange(0, BN)
            r_ok = r < R
            col, c_ok = NQ + r, r_ok
            d_rows = D + r.to(tl.int64) * K
            for c in tl.range(c_start, c_stop, num_stages=1):
                k = c * 128 + kk
                k_ok = k < K
                d = tl.load(d_rows[:, None] + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, 128]
                xt = tl.load(x_rows[None, :] + k[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)  # [128, BM]
                acc += tl.dot(d.to(xt.dtype), xt, out_dtype=tl.float32)
        else:
            row0 = (pn - dense_tiles) * BN
            n = row0 + tl.arange(0, BN)  # rows of the group
            n_ok = n < NQ
            col, c_ok = n, n_ok
            codes = tl.where(row0 >= N01, P2, tl.where(row0 >= N0, P1, P0))  # this tile's weight
            scales = tl.where(row0 >= N01, S2, tl.where(row0 >= N0, S1, S0))
            local = tl.where(row0 >= N01, row0 - N01, tl.where(row0 >= N0, row0 - N0, row0)) + tl.arange(0, BN)
            w_rows = codes + local.to(tl.int64) * K  # [BN] first code of each row
            s_rows = scales + (local // 128) * KB  # [BN] each row's block row of scales
            if F16:  # p a row of x over this program's range of K (x is small: a second read hits the cache)
                xmax = tl.zeros([BM], tl.float32)
                for c in range(c_start, c_stop):
                    k = c * 128 + kk
                    xt = tl.load(x_rows[None, :] + k[:, None], mask=m_ok[None, :] & (k < K)[:, None], other=0.0)
                    xmax = tl.maximum(xmax, tl.max(tl.abs(xt.to(tl.float32)), axis=0))
                p = _pow2_scale(xmax)  # [BM]
            for c in range(c_start, c_stop):
                k = c * 128 + kk
                k_ok = k < K
                if EVEN_K:  # no mask along k: the loads stay 16-byte vectors
                    w = tl.load(w_rows[:, None] + k[None, :], mask=n_ok[:, None], other=0.0)  # [BN, 128] e4m3
                else:
                    w = tl.load(w_rows[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x_ok = m_ok[None, :] & (k_ok[:, None] | EVEN_K)
                xt = tl.load(x_rows[None, :] + k[:, None], mask=x_ok, other=0.0)  # [128, BM]
                if F16:
                    xt = (xt.to(tl.float32) * p[None, :]).to(tl.float16)  # exact from 2^-28 of the row's largest
                s = tl.load(s_rows + c, mask=n_ok, other=0.0)  # [BN] float32
                if F16:  # e4m3 ⊂ float16: the codes as they are, the block's scale after the product
                    acc += tl.dot(w.to(tl.float16), xt, out_dtype=tl.float32) * s[:, None]
                else:
                    tile = (w.to(tl.float32) * s[:, None]).to(xt.dtype)  # the dequantized weights, as the twin's
                    acc += tl.dot(tile, xt, out_dtype=tl.float32)
            if F16:
                acc = acc * (1.0 / p)[None, :]  # (a power of two: exact)
        offs = m[None, :].to(tl.int64) * stride_ym + col[:, None]
        mask = c_ok[:, None] & m_ok[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + col, mask=c_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(Y + ps * stride_ys + offs, acc.to(Y.dtype.element_ty), mask=mask)
        if FIXUP:
            _last_split_sums(Y, OUT, BIAS, LOCK + pn, stride_ys, offs, mask, col, c_ok, True, SUM_BIAS)


def fp8_group_linear(x: torch.Tensor, group: FP8Group, use_triton: bool = True,
                     launch: dict | None = None) -> torch.Tensor:
    """x [..., K] → [..., Σ N_i + R] = x · [W_0; …; D]ᵀ (+ bias) for the group (module docstring); the twin when
    Triton is off or x is not 16-bit. ``launch`` overrides :data:`LAUNCH`'s entry (for tuning; the result depends
    on it through float32 summation order, and f16 through the unrounded weights: fp8_group_reference(f16=True))."""
    K = group.K
    if not use_triton or triton is None or x.shape[-1] != K or x.dtype not in (torch.bfloat16, torch.float16):
        return fp8_group_reference(x, group)
    lead, x2 = matrix_rows(x, K)
    M, NQ, NT = x2.shape[0], group.fp8_rows, group.out_features
    R = NT - NQ
    BM, cfg = launch_for(M, launch, LAUNCH)
    g = group_grid(M, group.rows, R, K, CHUNK, BM, cfg)
    out = torch.empty(M, NT, dtype=x.dtype, device=x.device)
    target = split_target(out, g.split)
    codes = group.codes + [group.codes[0]] * (MAX_FP8 - len(group.codes))
    scales = group.scales + [group.scales[0]] * (MAX_FP8 - len(group.scales))
    dense = group.dense if group.dense is not None else x2  # (an unused pointer without dense rows)
    bias = group.bias if group.bias is not None else out
    fixup = fixes_up(cfg, g, group.locks)
    _fp8_group_kernel[g.grid](
        x2, *codes, *scales, dense, bias, target, out, group.locks, M, K, g.n_chunks, g.N0, g.N01, NQ, R,
        x2.stride(0), NT, M * NT, g.n_chunks, g.per_split, g.dense_tiles,
        HAS_BIAS=group.bias is not None and g.split == 1, BM=BM, BN=g.BN, EVEN_K=K % CHUNK == 0,
        F16=cfg.get("f16", False), FIXUP=fixup, SUM_BIAS=group.bias is not None, num_warps=cfg["warps"],
        num_stages=cfg["stages"])
    if not fixup:
        sum_splits(target, group.bias, out)
    return out.view(*lead, NT)


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
               use_triton: bool = True) -> torch.Tensor:
    """x [..., K] → [..., N] = x · Ŵᵀ (+ bias) for one FP8 weight (for tests and one-off products; decode steps hold
    an :class:`FP8Group`)."""
    return fp8_group_linear(x, fp8_group([codes], [scales], biases=[bias]), use_triton=use_triton)
