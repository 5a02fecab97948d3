"""x · Wᵀ for bitsandbytes NF4 weights, read in their 4-bit form (the decode-step products of a QLoRA base).

bitsandbytes multiplies a batch of rows (decode steps have 16–128) by first writing the whole weight out in 16 bits
and then running a 16-bit product: 0.5 + 2 + 2 bytes moved per parameter, more than a 16-bit base's 2. This
kernel dequantizes in registers instead, reading 0.5 byte per parameter plus its block scale (4 bytes per 64):

    W[n, k] = cast(code[q[n, k]] · absmax[n, k // 64])          (exactly bitsandbytes' dequantized value)
    y = x · [W_0; W_1; W_2; D]ᵀ (+ bias)                         (float32 sums, split over K, one rounding)

or, the default launch at ≤ 16 rows (lut 4), each 64-wide block's product with the unscaled codes scaled afterwards:

    y[m, n] = Σ_b absmax[n, b] · Σ_{k in b} x[m, k] · cast(code[q[n, k]])      (one bf16 rounding of W fewer)

or, at 32–128 rows (lut 5), the looked-up values scaled before the product, so that the block products accumulate
in the tensor cores' sum:

    W[n, k] = cast(cast(code[q[n, k]]) · cast(absmax[n, k // 64]))             (three roundings of W)

A product reads a *group*: up to three NF4 weights of the same input width stacked by rows (q/k/v, gate/up), and
optionally 16-bit rows D after them (the stacked LoRA A rows of the packed decode, rollout/fast_decode.py), so a
layer's q/k/v + A is one launch, as in the 16-bit packed decode. The NF4 codes stay where bitsandbytes keeps them
(one pointer a weight, nothing moved or copied); the group holds the block scales, expanded from bitsandbytes'
nested 8-bit form once, transposed to [K/64, Σ N] so that a tile's scales are one coalesced load.

Layout (bitsandbytes ``quantize_4bit``, blocksize 64): W [N, K] row-major, two 4-bit codes per byte, the element
of even k in the high nibble. A program owns BN rows and a range of K in chunks of 128 (64 bytes a row, two
scales); the byte j of a chunk holds k0 + 2j (high) and k0 + 2j + 1 (low), so a chunk is two tensor-core products,
W_hi · x[:, even k]ᵀ + W_lo · x[:, odd k]ᵀ, with the dequantized tile as the left operand (the rows of x, few at
decode, are the narrow side). Each code is looked up in the 16-entry table (one cached line) and scaled in float32.
K is split over programs so that a small group still fills the GPU; the splits' float32 partial sums are added in
a fixed order by a second kernel, or (launch choice ``fixup``) by each tile's last program (the same result every
call, and either way).

A group may hold its codes in the *halves* layout instead (:func:`set_halves`, ops/nf4_halves.py: byte j of a chunk
holds k0 + j and k0 + 64 + j), read by the same kernel's HALVES path: one lookup of the byte tile (its only operand,
so that Triton loads the bytes in the tensor-core operand's register layout) gives both blocks' values, each block
multiplied by its contiguous 64 elements of x, with :data:`HALVES_LAUNCH`'s choices.

:func:`nf4_group_reference` is the plain twin (bitsandbytes' dequantized weights stacked, then ``F.linear``;
``scale_after=True``: lut 4's code values scaled after each block's product; :func:`twin_options` gives each
lookup's);
tests/test_nf4_matmul.py checks both against bitsandbytes, the kernel through Triton's interpreter and on the GPU;
benchmarks/nf4_matmul.py times them and sweeps :data:`LAUNCH`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch

from .nf4_halves import (from_halves_, halves_codes, halves_ok, lookup_constraints, lookup_ptx, scratch_for,
                         table_planes, to_halves_)
from .nf4_mma import nf4_mma_linear

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton use the twin
    triton = None

log = logging.getLogger(__name__)

BLOCKSIZE = 64  # bitsandbytes' NF4 block (elements per absmax)
CHUNK = 128  # elements of K a program reads per step: two blocks, 64 bytes a row
MAX_NF4 = 3  # NF4 weights one group stacks (q/k/v)

# launch choice by rows of x (the smallest bucket ≥ M; above 128 rows, the 128 entry in row tiles of 128):
# bn rows of the group a program owns, whether the NF4 tile is the left operand (swap), whether it is interleaved
# into k order in registers so that x is read contiguously (join; else two products on even and odd k; lut 3 and 4
# always join), how a code becomes its value (lut: 3 byte permutes on per-block 16-bit tables, PRMT_ASM; 4 the same
# permutes on one table of the 16 unscaled values, built once, each block's product then scaled by its row's
# absmax: no per-block table, but the weights are cast(code)·absmax rather than bitsandbytes' cast(code·absmax),
# nf4_group_reference(scale_after=True) its twin; 5 and 6 lut 4's lookup with each value then scaled by its row's
# block absmax before the product, so that the block products accumulate in the tensor cores' sum with no float32
# multiply of the accumulator between them: 5 in 16 bits, cast(cast(code)·cast(absmax)), 6 in float32,
# cast(cast(code)·absmax) (twin_options gives each one's twin); 1 a register gather from them, tl.gather; 2 a
# tree of selects; 0 a load from the 16-entry table in memory, which Triton's pipeliner stages through shared
# memory one element at a time: far slower), warps, pipeline stages, and the programs the K split aims at (split =
# ⌈programs / row tiles⌉, each split ≥ 4 chunks). benchmarks/nf4_matmul.py --sweep times the alternatives; the table
# below is its fastest at 16, 32 and 128 rows on an H100 (2026-12-06: nf4_matmul_h100_call1.md, then around its
# winners nf4_matmul_h100_sweep.md): at 16 rows lut 4 with kord a layer's products in 99.2 µs at 528 programs with
# fixup (98.6 and 99.5 without, 112.4 the day's first table, lut 5 with kord 113.7 against lut 4's 109.0 at 264
# programs, lut 3's best 148); at 32 rows lut 5 with kord, 114.4 µs at 528 programs with fixup (116.0 without; at
# 264 programs 122.2, and 136.3 without kord; lut 4's best 128.5; bf16 168.1); at 128 rows lut 5 with kord in 64-row
# tiles of 4 warps, 199.6 µs at 396 programs (209.8 without kord the day before, 242.3 in 128-row tiles of 8 warps,
# lut 4's best 223.1, bf16 180.8), 64 rows taking the 128-row choice; unroll 2 was slower at every row count (113.9
# against 109.0 µs at 16 rows, 342.5 against 205.5 at 128). Their weights differ from the trainer's by bf16
# roundings; on SmolLM2-135M the sampled tokens' log-probs move from the trainer's by 0.041 on average with lut 4,
# 0.042 with lut 5, against 0.036 for lut 3's float32 sums of the trainer's own weights
# (nf4_scale_after_mismatch_cpu.md), and the rollout correction weighs the sampler's log-probs in any case.
# permutes_packed guards lut 3's assumption. kord (absent: off; luts 4 to 6): the permutes pair the values in k order
# (PRMT_ASM_K, its selectors made once for four bytes), so the tile needs no interleaving of the high- and low-nibble
# values after them: 5.2 instructions a code in the sm_90 SASS at 16 rows against 6.1 (lut 4), 5.7 against 6.6 at 128
# rows (lut 5; decode_product_sass.md); it assumes each thread's four bytes consecutive in one row, as lut 3 does
# (permutes_packed; where not, the build runs without it). maxnreg (absent: the compiler's choice): registers a thread
# at most, so that more programs share an SM. unroll (absent: 1; luts 3 to 6): chunks of K an iteration of the K loop
# (Triton's loop_unroll_factor), more loads and lookups in flight for the latency-bound few-row products. fixup (absent:
# off): with several K splits and one m tile, each row tile's last program to finish sums the splits' partials (an
# arrival count a tile, NF4Group.locks) instead of _split_sum_kernel's launch after the product (127 launches, ≈ 0.33 ms
# of a 5.9 ms 8B decode step at 8 rows on an H100); the same sums in the same order, so bit for bit the same result. On
# at 16 and 32 rows, where the sweeps found it fastest or tied (H100, 2026-12-06: 112.4 µs against 116.6 without, then
# 99.2 against 99.5 with kord at 16 rows; 114.4 against 116.0 at 32), for one launch less; at 128 rows it was slower.
LAUNCH = {16: dict(bn=64, swap=True, join=True, lut=4, warps=4, stages=3, programs=528, fixup=True, kord=True),
          32: dict(bn=64, swap=True, join=True, lut=5, warps=4, stages=3, programs=528, fixup=True, kord=True),
          64: dict(bn=64, swap=True, join=True, lut=5, warps=4, stages=3, programs=396, kord=True),
          128: dict(bn=64, swap=True, join=True, lut=5, warps=4, stages=3, programs=396, kord=True)}
# the launch table of groups whose codes take the halves layout (set_halves; ops/nf4_halves.py), the fastest of
# benchmarks/nf4_matmul.py --sweep --halves --table-only on an H200 (2026-12-06, nf4_matmul_h200_halves.md: a
# layer's four packed products at 16 rows 92.4 µs against LAUNCH's 98.9 on the same card, at 32 rows 111.7 against
# 116.7, at 128 rows 202.5 against 201.4); pack: code bytes a lookup (2 beat 4 at every row count)
HALVES_LAUNCH = {16: dict(bn=64, swap=True, join=True, lut=4, warps=4, stages=3, programs=528, fixup=True, pack=2),
                 32: dict(bn=64, swap=True, join=True, lut=4, warps=4, stages=3, programs=528, fixup=True, pack=2),
                 64: dict(bn=64, swap=True, join=True, lut=5, warps=4, stages=3, programs=264, fixup=True, pack=2),
                 128: dict(bn=64, swap=True, join=True, lut=5, warps=4, stages=3, programs=264, fixup=True, pack=2)}
# launch choice mma (absent: off): the products of up to 32 rows on the CUDA kernel built at first use
# (ops/nf4_mma.py: a shared table of value pairs feeding mma.sync, 2.6 instructions a code; lut 4's arithmetic),
# where it applies and was built (else the entry's Triton choices run); its own keys min_blocks, fixup_blocks or
# waves, staged with mma_stages for the staged kernel, and min_bytes (nf4_mma_linear). Timed with the weights read
# from DRAM (H100, 2026-12-07, nf4_matmul_h100_mma.md) the kernel beats the table's Triton choice only on the large
# groups at 8 rows (gate/up 44.8 against 48.4 µs, down 26.4 against 26.9; q/k/v 16.2 against 14.9, o 14.8 against
# 11.6), and a whole 8-row call on it for every group was slower (1,306 against 1,348 tokens/s,
# rollout_matrix_llama-3.1-8b_h100_cold.md). MMA_LAUNCH gives it the groups of at least 16 MiB of codes: ≈ 97.7
# against 101.8 µs a layer by those per-group times, not yet measured as one launch or in a whole call. Off by
# default until a whole call with it is faster.
MMA_LAUNCH = dict(mma=True, min_blocks=32, fixup_blocks=2, min_bytes=16 << 20)


def with_mma(table: dict, rows: int = 8, launch: dict | None = None) -> dict:
    """``table`` with an entry for up to ``rows`` rows that runs ``launch`` (default MMA_LAUNCH; its Triton choices:
    the table's for those rows, where the kernel does not apply)."""
    return {**table, rows: {**launch_for(rows, table=table)[1], **(launch or MMA_LAUNCH)}}


MIN_CHUNKS_PER_SPLIT = 4
MIN_BN = 16  # the smallest row tile (a tensor-core operand's side)


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


@dataclass
class NF4Group:
    """The operands of one grouped product: NF4 weights stacked by rows, then optional 16-bit rows."""

    packed: list  # each NF4 weight's codes, uint8 [N_i·K/2] (bitsandbytes' own storage)
    rows: list  # N_i
    scales: torch.Tensor  # float32 [K/64, Σ N_i]: absmax of block b of row n at [b, n]
    code: torch.Tensor  # float32 [16]
    K: int
    dense: torch.Tensor | None = None  # [R, K] 16-bit rows after the NF4 ones (LoRA A), or None
    bias: torch.Tensor | None = None  # [Σ N_i + R] (zeros on the dense rows), or None
    locks: torch.Tensor | None = None  # int32 [row tiles]: split_locks, the fixup launch choice's counts
    halves: bool = False  # the codes in the halves layout (ops/nf4_halves.py; set_halves), not bitsandbytes' order
    table: tuple | None = None  # the code's 16 values on the host (set_halves: the lookup's immediates)
    lookups: dict = field(default_factory=dict)  # (dtype, pack) → the halves lookup's PTX; ("mma", dtype):
    # nf4_mma's operands

    def __post_init__(self):
        if self.locks is None:
            self.locks = split_locks(self.out_features, self.scales.device)

    @property
    def nf4_rows(self) -> int:
        return sum(self.rows)

    @property
    def out_features(self) -> int:
        return self.nf4_rows + (self.dense.shape[0] if self.dense is not None else 0)


def groupable(weights: list) -> str | None:
    """Why these bitsandbytes NF4 weights cannot be one group (None: they can): NF4 in blocks of 64 stored as
    bytes, one input width that is a multiple of 64, every weight but the last a multiple of 16 rows (a row tile
    never straddles two weights: tiles shrink to the largest power of two dividing them), on one device."""
    if not 1 <= len(weights) <= MAX_NF4:
        return f"{len(weights)} weights (1 to {MAX_NF4})"
    shapes = []
    for w in weights:
        state = getattr(w, "quant_state", None)
        if state is None or state.quant_type != "nf4" or state.blocksize != BLOCKSIZE or w.data.dtype != torch.uint8:
            return "not NF4 codes in bytes with blocks of 64"
        shapes.append(tuple(state.shape))
    if len({k for _, k in shapes}) > 1 or shapes[0][1] % BLOCKSIZE:
        return f"input widths {sorted({k for _, k in shapes})} (one, a multiple of {BLOCKSIZE})"
    if any(n % MIN_BN for n, _ in shapes[:-1]):
        return f"row counts {[n for n, _ in shapes]} (all but the last a multiple of {MIN_BN})"
    if len({w.device for w in weights}) > 1:
        return "weights on several devices"
    return None


def nf4_group(weights: list, dense: torch.Tensor | None = None, biases: list | None = None) -> NF4Group:
    """The group of bitsandbytes NF4 ``Params4bit`` weights (q/k/v, gate/up, or one), their biases (a list with
    None for none; all None: no bias) and the 16-bit rows ``dense`` [R, K] after them. Expands the scales (4 bytes
    per 64 parameters, alive with the group); the codes are not copied."""
    reason = groupable(weights)
    if reason:
        raise ValueError(f"nf4_group: {reason}")
    ops = [nf4_operands(w) for w in weights]
    K = ops[0][4]
    scales = torch.cat([a.view(n, K // BLOCKSIZE) for _, a, _, n, _ in ops]).t().contiguous()  # [K/64, Σ N]
    check_dense(dense, K, "nf4_group")
    bias = stacked_bias(biases, [n for *_, n, _ in ops], dense, scales.device)
    return NF4Group([p for p, *_ in ops], [n for *_, n, _ in ops], scales, ops[0][2], K,
                    dense.contiguous() if dense is not None else None, bias)


def set_halves(group: NF4Group, on: bool) -> None:
    """Put the group's NF4 codes into the halves layout (on) or back into bitsandbytes' order, in place: the
    weights' own bytes change, so whatever else reads them (bitsandbytes' forward) must wait for the way back."""
    if on == group.halves:
        return
    if on and not halves_ok(group.K):
        raise ValueError(f"set_halves: the halves layout needs K a multiple of 128; got {group.K}")
    if on and group.table is None:
        group.table = tuple(float(v) for v in group.code.tolist())
    scratch = scratch_for(max(group.packed, key=torch.Tensor.numel))  # (before any byte changes)
    for packed in group.packed:
        (to_halves_ if on else from_halves_)(packed, group.K, scratch)
    group.halves = on


def bnb_codes(group: NF4Group, packed: torch.Tensor) -> torch.Tensor:
    """One of the group's weights' codes in bitsandbytes' order (a copy when the group is in the halves layout)."""
    return halves_codes(packed, group.K) if group.halves else packed


def check_dense(dense: torch.Tensor | None, K: int, what: str) -> None:
    """Refuse a group's dense rows that are not [R, K]."""
    if dense is not None and (dense.dim() != 2 or dense.shape[1] != K):
        raise ValueError(f"{what}: dense rows {tuple(dense.shape)} do not have the input width {K}")


def stacked_bias(biases: list | None, rows: list[int], dense: torch.Tensor | None, device) -> torch.Tensor | None:
    """A group's bias [Σ N_i + R]: each weight's bias (zeros for one without), zeros for the dense rows; None when
    no weight has one. In the dtype of the first bias given."""
    if biases is None or all(b is None for b in biases):
        return None
    dtype = next(b.dtype for b in biases if b is not None)
    parts = [b if b is not None else torch.zeros(n, device=device) for b, n in zip(biases, rows)]
    tail = [torch.zeros(dense.shape[0], device=device)] if dense is not None else []
    return torch.cat([p.to(dtype) for p in parts + tail])


ROUNDINGS = ("", "code", "code+scale")  # how a weight's value is formed: bitsandbytes', lut 6's, lut 5's


def nf4_group_weight(group: NF4Group, dtype: torch.dtype, scale_after: bool = False,
                     rounded: str = "") -> torch.Tensor:
    """The group's stacked weight [Σ N_i + R, K] in ``dtype``, each NF4 weight dequantized as bitsandbytes does,
    cast(code[q] · absmax). scale_after: W[n, k] = cast(code[q]) · absmax in float32 (the kernel's lut 4, which
    scales after the product; the 16-bit rows in float32 too). rounded "code": cast(cast(code[q]) · absmax) (lut 6);
    "code+scale": cast(cast(code[q]) · cast(absmax)) (lut 5)."""
    if rounded not in ROUNDINGS:
        raise ValueError(f"nf4_group_weight: rounded is one of {ROUNDINGS}, not {rounded!r}")
    parts, start = [], 0
    for packed, n in zip(group.packed, group.rows):
        packed = bnb_codes(group, packed)
        absmax = group.scales[:, start:start + n].t().reshape(-1)  # [n·K/64], row-major blocks
        if scale_after or rounded:
            unscaled = dequantize_nf4(packed, torch.ones_like(absmax), group.code, n, group.K, dtype).float()
            if rounded == "code+scale":  # (exact in float32: both factors have at most 11 significant bits)
                absmax = absmax.to(dtype).float()
            scaled = unscaled * absmax.view(n, -1).repeat_interleave(BLOCKSIZE, dim=1)[:, :group.K]
            parts.append(scaled.to(dtype) if rounded else scaled)
        else:
            parts.append(dequantize_nf4(packed, absmax, group.code, n, group.K, dtype))
        start += n
    if group.dense is not None:
        parts.append(group.dense.to(torch.float32 if scale_after else dtype))
    return torch.cat(parts)


def nf4_group_reference(x: torch.Tensor, group: NF4Group, scale_after: bool = False,
                        rounded: str = "") -> torch.Tensor:
    """x [..., K] → [..., Σ N_i + R]: the stacked dequantized weight, then ``F.linear`` (the kernel's twin).
    scale_after: the twin of lut 4, x · (cast(code[q]) · absmax)ᵀ summed in float32, then cast; rounded: the
    weights of lut 6 or 5 (:func:`nf4_group_weight`)."""
    if scale_after:
        bias = group.bias.float() if group.bias is not None else None
        return torch.nn.functional.linear(x.float(), nf4_group_weight(group, x.dtype, True), bias).to(x.dtype)
    bias = group.bias.to(x.dtype) if group.bias is not None else None
    return torch.nn.functional.linear(x, nf4_group_weight(group, x.dtype, rounded=rounded), bias)


def twin_options(lut: int) -> dict:
    """The keywords of :func:`nf4_group_weight` / :func:`nf4_group_reference` whose weights launch choice ``lut``
    multiplies: lut 4 scales after each block's product, 5 and 6 scale the looked-up values before it."""
    return {4: dict(scale_after=True), 5: dict(rounded="code+scale"), 6: dict(rounded="code")}.get(lut, {})


if triton is not None:
    @triton.jit
    def _select16(q, c00, c01, c02, c03, c04, c05, c06, c07, c08, c09, c10, c11, c12, c13, c14, c15):
        """c[q] for 4-bit q (int32 tensor) by a tree of selects on its bits."""
        b0, b1, b2, b3 = (q & 1) != 0, (q & 2) != 0, (q & 4) != 0, (q & 8) != 0
        v0 = tl.where(b1, tl.where(b0, c03, c02), tl.where(b0, c01, c00))
        v1 = tl.where(b1, tl.where(b0, c07, c06), tl.where(b0, c05, c04))
        v2 = tl.where(b1, tl.where(b0, c11, c10), tl.where(b0, c09, c08))
        v3 = tl.where(b1, tl.where(b0, c15, c14), tl.where(b0, c13, c12))
        return tl.where(b3, tl.where(b2, v3, v2), tl.where(b2, v1, v0))


    # PRMT selects 4 bytes of an 8-byte pair of registers by the 4 nibbles of its selector: the 16 bits of two code
    # bytes are already such nibbles (element order 1, 0, 3, 2), so one permute looks up four 4-bit codes in an 8-entry
    # byte table. A 16-entry table of 16-bit values (the activations' bf16 or float16) is two byte planes (low,
    # high) of four registers each: per plane, entries 0-7 and 8-15 are looked up with the nibbles' low 3 bits, and
    # a third permute picks between them by bit 3 (selector 0x3210 + 4 · bit3 a nibble); two more interleave the
    # planes into the 16-bit pairs of the high- and low-nibble elements. 11 instructions per two bytes.
    # (tests/test_nf4_matmul.py replays it on the CPU.)
    _PRMT_SELECTORS = """
    and.b32 s, {w}, 0x7777;
    shr.b32 t, {w}, 1;
    and.b32 t, t, 0x4444;
    or.b32 t, t, 0x3210;"""  # the permutes' selectors of two code bytes (the low 16 bits of {w})
    _PRMT_LOOKUP = """
    prmt.b32 a, $5, $9, s;
    prmt.b32 b, $13, $17, s;
    prmt.b32 rl, a, b, t;
    prmt.b32 a, $21, $25, s;
    prmt.b32 b, $29, $33, s;
    prmt.b32 rh, a, b, t;
    prmt.b32 {first}, rl, rh, {first_order};
    prmt.b32 {second}, rl, rh, {second_order};"""  # two code bytes' values (low plane rl, high rh) → 16-bit pairs
    _BY_NIBBLE = dict(first_order="0x7351", second_order="0x6240")  # (hi of byte 0, hi of byte 1), (lo 0, lo 1)
    _K_ORDER = dict(first_order="0x4051", second_order="0x6273")  # (hi 0, lo 0), (hi 1, lo 1)
    # operands: $0 $1 the high-nibble values, $2 $3 the low-nibble ones (2 bf16 each), $4 four code bytes, then the
    # planes L0..L3, H0..H3 (each 4 times: pack=4 gives every element of an int32 input its own register)
    PRMT_ASM = tl.constexpr("{\n.reg .b32 s, t, a, b, rl, rh, w;" + _PRMT_SELECTORS.format(w="$4")
                            + _PRMT_LOOKUP.format(first="$0", second="$2", **_BY_NIBBLE)
                            + "\nshr.b32 w, $4, 16;" + _PRMT_SELECTORS.format(w="w")
                            + _PRMT_LOOKUP.format(first="$1", second="$3", **_BY_NIBBLE) + "\n}")
    # The same lookups with the values paired in k order, (hi, lo) of byte 0 and of byte 1 (the first output), of
    # bytes 2 and 3 (the second), so the eight values of four bytes in k order are the first output's four, then
    # the second's (no interleaving after it); the selectors made once for the four bytes (a permute reads the low
    # 16 bits of its selector), then shifted for bytes 2 and 3. 9 instructions per two bytes.
    PRMT_ASM_K = tl.constexpr("{\n.reg .b32 s, t, a, b, rl, rh;\n    and.b32 s, $4, 0x77777777;\n"
                              "    shr.b32 t, $4, 1;\n    and.b32 t, t, 0x44444444;\n    or.b32 t, t, 0x32103210;"
                              + _PRMT_LOOKUP.format(first="$0", second="$1", **_K_ORDER)
                              + "\n    shr.b32 s, s, 16;\n    shr.b32 t, t, 16;"
                              + _PRMT_LOOKUP.format(first="$2", second="$3", **_K_ORDER) + "\n}")
    PRMT_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 33))

    @triton.jit
    def _bits16(c, s, DT: tl.constexpr):
        """The 16 bits of DT(c · s) (DT bf16 or float16, s float32 [BN]) as int32."""
        return (c * s).to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF

    @triton.jit
    def _planes(v0, v1, v2, v3):
        """(low bytes, high bytes) of four 16-bit patterns, each packed into an int32 (entry t in byte t)."""
        lo = (v0 & 0xFF) | ((v1 & 0xFF) << 8) | ((v2 & 0xFF) << 16) | ((v3 & 0xFF) << 24)
        hi = (v0 >> 8) | ((v1 >> 8) << 8) | ((v2 >> 8) << 16) | ((v3 >> 8) << 24)
        return lo, hi

    @triton.jit
    def _prmt_tables(s, c00, c01, c02, c03, c04, c05, c06, c07, c08, c09, c10, c11, c12, c13, c14, c15,
                     DT: tl.constexpr):
        """The byte planes (L0..L3, H0..H3) of the table DT(code[i] · s), i = 0..15 (s: float32, any shape; DT the
        activations' 16-bit type, which the tensor-core product takes)."""
        L0, H0 = _planes(_bits16(c00, s, DT), _bits16(c01, s, DT), _bits16(c02, s, DT), _bits16(c03, s, DT))
        L1, H1 = _planes(_bits16(c04, s, DT), _bits16(c05, s, DT), _bits16(c06, s, DT), _bits16(c07, s, DT))
        L2, H2 = _planes(_bits16(c08, s, DT), _bits16(c09, s, DT), _bits16(c10, s, DT), _bits16(c11, s, DT))
        L3, H3 = _planes(_bits16(c12, s, DT), _bits16(c13, s, DT), _bits16(c14, s, DT), _bits16(c15, s, DT))
        return L0, L1, L2, L3, H0, H1, H2, H3

    @triton.jit
    def _prmt_apply(byte, L0, L1, L2, L3, H0, H1, H2, H3, DT: tl.constexpr):
        """(table[hi nibble], table[lo nibble]) in DT of bytes [BN, 32] (PRMT_ASM), the planes broadcast to them."""
        z = tl.zeros(byte.shape, tl.int32)
        return tl.inline_asm_elementwise(PRMT_ASM, PRMT_CONSTRAINTS,
                                         [byte, L0 + z, L1 + z, L2 + z, L3 + z, H0 + z, H1 + z, H2 + z, H3 + z],
                                         dtype=(DT.value, DT.value), is_pure=True, pack=4)

    @triton.jit
    def _prmt_apply_k(byte, L0, L1, L2, L3, H0, H1, H2, H3, DT: tl.constexpr):
        """PRMT_ASM_K's two outputs [BN, 32] of bytes [BN, 32] (each thread's four bytes consecutive in one row, as
        permutes_packed checks; _kord_tile puts them in k order)."""
        z = tl.zeros(byte.shape, tl.int32)
        return tl.inline_asm_elementwise(PRMT_ASM_K, PRMT_CONSTRAINTS,
                                         [byte, L0 + z, L1 + z, L2 + z, L3 + z, H0 + z, H1 + z, H2 + z, H3 + z],
                                         dtype=(DT.value, DT.value), is_pure=True, pack=4)

    @triton.jit
    def _kord_pairs(w_hi, w_lo, BN: tl.constexpr):
        """What PRMT_ASM_K gives for bytes whose high- and low-nibble values are w_hi, w_lo [BN, 32] (Triton's
        interpreter runs no PTX): the first output holds at 4g + 2r + h the value (h: 0 high, 1 low nibble) of byte
        4g + r, the second that of byte 4g + 2 + r."""
        t = tl.reshape(tl.join(w_hi, w_lo), [BN, 8, 2, 2, 2])  # [row, group g, pair q, byte r, nibble h]
        first, second = tl.split(tl.permute(t, (0, 1, 3, 4, 2)))  # q last: q = 0, q = 1
        return tl.reshape(first, [BN, 32]), tl.reshape(second, [BN, 32])

    @triton.jit
    def _kord_tile(first, second, BN: tl.constexpr):
        """The block's values in k order [BN, 64] from PRMT_ASM_K's outputs [BN, 32]: the 8 values of bytes
        4g..4g+3 are first's 4g..4g+3, then second's (a relabelling of each thread's registers)."""
        w = tl.join(tl.reshape(first, [BN, 8, 4]), tl.reshape(second, [BN, 8, 4]))  # [BN, 8, 4, 2]
        return tl.reshape(tl.permute(w, (0, 1, 3, 2)), [BN, 64])

    @triton.jit
    def _prmt_lookup(byte, s, c00, c01, c02, c03, c04, c05, c06, c07, c08, c09, c10, c11, c12, c13, c14, c15,
                     DT: tl.constexpr):
        """(DT(code[hi nibble] · s), DT(code[lo nibble] · s)) of a block's bytes [BN, 32], s [BN] a row."""
        L0, L1, L2, L3, H0, H1, H2, H3 = _prmt_tables(s[:, None], c00, c01, c02, c03, c04, c05, c06, c07, c08, c09,
                                                      c10, c11, c12, c13, c14, c15, DT)
        return _prmt_apply(byte, L0, L1, L2, L3, H0, H1, H2, H3, DT)

    @triton.jit
    def _last_split_sums(Y, OUT, BIAS, LOCK, stride_ys, offs, mask, col, c_ok, SWAP: tl.constexpr,
                         ADD_BIAS: tl.constexpr):
        """After a program stored its K split's partial sums of a tile (at ``offs`` of each split's slice of Y): the
        tile's program that arrives last (LOCK: the tile's count of arrivals, back to 0 after) adds the splits'
        partials in split order (+ bias) and writes OUT, cast: _split_sum_kernel's result, without its launch."""
        tl.debug_barrier()  # every thread's partials stored before the count (released with it)
        arrived = tl.atomic_add(LOCK, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            total = tl.zeros(offs.shape, tl.float32)
            for s in range(0, tl.num_programs(1)):  # (.cg: from L2, never a stale L1 line)
                total += tl.load(Y + s * stride_ys + offs, mask=mask, other=0.0, cache_modifier=".cg")
            if ADD_BIAS:
                b = tl.load(BIAS + col, mask=c_ok, other=0.0).to(tl.float32)
                if SWAP:
                    total += b[:, None]
                else:
                    total += b[None, :]
            tl.store(OUT + offs, total.to(OUT.dtype.element_ty), mask=mask)
            tl.store(LOCK, 0)

    @triton.jit
    def _nf4_group_kernel(X, P0, P1, P2, S, CODE, D, BIAS, Y, OUT, LOCK, M, K, KB, N0, N01, NQ, R, stride_xm,
                          stride_ym, stride_ys, n_chunks, chunks_per_split, dense_tiles,
                          HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr,
                          JOIN: tl.constexpr, LUT: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                          FIXUP: tl.constexpr = False, SUM_BIAS: tl.constexpr = False, KORD: tl.constexpr = False,
                          UNROLL: tl.constexpr = 1, HALVES: tl.constexpr = False, LOOKUP: tl.constexpr = "",
                          LOOKUP_CONS: tl.constexpr = "", PACK: tl.constexpr = 4):
        """Program (row tile, K split, m tile). Row tiles [0, dense_tiles) are the 16-bit rows D (first, so that
        their heavier programs start early), the rest the NF4 rows; an NF4 tile lies inside one weight (P0 rows
        [0, N0), P1 [N0, N01), P2 [N01, NQ)). acc is [BN, BM] (SWAP: weight tile on the left) or [BM, BN]; it goes
        to split ps's float32 slice of Y, or (one split) to Y itself with the bias, cast. FIXUP (one m tile, several
        splits): the tile's last program sums the splits into OUT (_last_split_sums; LOCK: a count a row tile,
        SUM_BIAS: with the bias). HALVES (SWAP, LUT 4 to 6, K a multiple of 128): the codes in the halves layout
        (ops/nf4_halves.py), looked up PACK bytes at a time by the PTX LOOKUP (constraints LOOKUP_CONS)."""
        pn, ps, pm = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        m = pm * BM + tl.arange(0, BM)
        m_ok = m < M
        x_rows = X + m.to(tl.int64) * stride_xm  # [BM]
        c_start = ps * chunks_per_split
        c_stop = tl.minimum(c_start + chunks_per_split, n_chunks)
        if SWAP:
            acc = tl.zeros([BN, BM], tl.float32)
        else:
            acc = tl.zeros([BM, BN], tl.float32)
        if pn < dense_tiles:  # 16-bit rows: plain product
            r = pn * BN + tl.arange(0, BN)
            r_ok = r < R
            col, c_ok = NQ + r, r_ok
            kk = tl.arange(0, 128)
            d_rows = D + r.to(tl.int64) * K
            for c in tl.range(c_start, c_stop, num_stages=1):  # (few programs: no staging, whose buffers would be
                # the kernel's largest and cut how many NF4 programs share an SM)
                k = c * 128 + kk
                k_ok = k < K
                d = tl.load(d_rows[:, None] + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, 128]
                if SWAP:
                    xt = tl.load(x_rows[None, :] + k[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
                    acc += tl.dot(d.to(xt.dtype), xt, out_dtype=tl.float32)
                else:
                    xk = tl.load(x_rows[:, None] + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                    acc += tl.dot(xk, tl.trans(d.to(xk.dtype)), out_dtype=tl.float32)
        else:
            row0 = (pn - dense_tiles) * BN
            n = row0 + tl.arange(0, BN)  # rows of the group
            n_ok = n < NQ
            col, c_ok = n, n_ok  # (not col < NT: the dense rows' columns follow)
            base = tl.where(row0 >= N01, P2, tl.where(row0 >= N0, P1, P0))  # this tile's weight
            local0 = tl.where(row0 >= N01, row0 - N01, tl.where(row0 >= N0, row0 - N0, row0))
            w_rows = base + (local0 + tl.arange(0, BN)).to(tl.int64) * KB  # [BN] first byte of each row
            j = tl.arange(0, 64)  # byte of the chunk: elements 2j (high nibble), 2j + 1 (low)
            first_block = (j < 32)[None, :]  # bytes 0..31: block 2c, 32..63: block 2c + 1
            x_dtype = X.dtype.element_ty
            i32 = tl.arange(0, 32)
            code2 = tl.load(CODE + i32 % 16)  # [32] the table twice (LUT 1)
            c00, c01, c02, c03 = tl.load(CODE), tl.load(CODE + 1), tl.load(CODE + 2), tl.load(CODE + 3)
            c04, c05, c06, c07 = tl.load(CODE + 4), tl.load(CODE + 5), tl.load(CODE + 6), tl.load(CODE + 7)
            c08, c09, c10, c11 = tl.load(CODE + 8), tl.load(CODE + 9), tl.load(CODE + 10), tl.load(CODE + 11)
            c12, c13, c14, c15 = tl.load(CODE + 12), tl.load(CODE + 13), tl.load(CODE + 14), tl.load(CODE + 15)
            j32 = tl.arange(0, 32)
            if LUT >= 4:  # one table for every row and block (the scale comes after the lookup): built once
                U0, U1, U2, U3, V0, V1, V2, V3 = _prmt_tables(1.0, c00, c01, c02, c03, c04, c05, c06, c07, c08, c09,
                                                              c10, c11, c12, c13, c14, c15, x_dtype)
            if HALVES:  # byte j of chunk c: k0 + j (high nibble), k0 + 64 + j (low); both blocks from one lookup
                for c in tl.range(c_start, c_stop, loop_unroll_factor=UNROLL):
                    k0 = c * 128 + j  # [64] the chunk's first block in k order (+ 64: its second)
                    byte = tl.load(w_rows[:, None] + (c * 64 + j)[None, :], mask=n_ok[:, None], other=0)  # [BN, 64]
                    x0 = tl.load(x_rows[None, :] + k0[:, None], mask=m_ok[None, :], other=0.0)  # [64, BM]
                    x1 = tl.load(x_rows[None, :] + (k0 + 64)[:, None], mask=m_ok[None, :], other=0.0)
                    s0 = tl.load(S + (2 * c) * NQ + n, mask=n_ok, other=0.0)  # [BN] the two blocks' scales
                    s1 = tl.load(S + (2 * c + 1) * NQ + n, mask=n_ok, other=0.0)
                    if ASM:  # one operand (the bytes): its layout conversion moves ahead of it, onto the load
                        w0, w1 = tl.inline_asm_elementwise(LOOKUP, LOOKUP_CONS, [byte], dtype=(x_dtype, x_dtype),
                                                           is_pure=True, pack=PACK)
                    else:  # (Triton's interpreter runs no PTX: the same values from the table in memory)
                        w0 = tl.load(CODE + (byte >> 4).to(tl.int32)).to(x_dtype)  # W[n, k0 + j] unscaled
                        w1 = tl.load(CODE + (byte & 15).to(tl.int32)).to(x_dtype)  # W[n, k0 + 64 + j]
                    if LUT == 4:
                        acc += tl.dot(w0, x0, out_dtype=tl.float32) * s0[:, None]
                        acc += tl.dot(w1, x1, out_dtype=tl.float32) * s1[:, None]
                    else:
                        if LUT == 5:
                            w0 = (w0 * s0.to(x_dtype)[:, None]).to(x_dtype)
                            w1 = (w1 * s1.to(x_dtype)[:, None]).to(x_dtype)
                        else:
                            w0 = (w0.to(tl.float32) * s0[:, None]).to(x_dtype)
                            w1 = (w1.to(tl.float32) * s1[:, None]).to(x_dtype)
                        acc += tl.dot(w0, x0, out_dtype=tl.float32)
                        acc += tl.dot(w1, x1, out_dtype=tl.float32)
            elif LUT >= 3:  # a block at a time, looked up by byte permutes (GPU only); UNROLL chunks an iteration
                for c in tl.range(c_start, c_stop, loop_unroll_factor=UNROLL):
                    k = c * 128 + tl.arange(0, 64)
                    for blk in tl.static_range(2):
                        kb = k + 64 * blk
                        if EVEN_K:
                            byte = tl.load(w_rows[:, None] + (c * 64 + 32 * blk + j32)[None, :], mask=n_ok[:, None],
                                           other=0)  # [BN, 32] uint8
                            xt = tl.load(x_rows[None, :] + kb[:, None], mask=m_ok[None, :], other=0.0)  # [64, BM]
                        else:
                            kb_ok = (c * 128 + 64 * blk + 2 * j32) < K
                            byte = tl.load(w_rows[:, None] + (c * 64 + 32 * blk + j32)[None, :],
                                           mask=n_ok[:, None] & kb_ok[None, :], other=0)
                            xt = tl.load(x_rows[None, :] + kb[:, None], mask=m_ok[None, :] & (kb < K)[:, None],
                                         other=0.0)
                        if EVEN_K:  # [BN] this block's scales (every block of a whole chunk exists)
                            sb = tl.load(S + (2 * c + blk) * NQ + n, mask=n_ok, other=0.0)
                        else:
                            sb = tl.load(S + (2 * c + blk) * NQ + n, mask=n_ok & (n * 0 + c * 128 + 64 * blk < K),
                                         other=0.0)
                        if ASM and LUT >= 4 and KORD:
                            first, second = _prmt_apply_k(byte, U0, U1, U2, U3, V0, V1, V2, V3, x_dtype)
                        elif ASM and LUT >= 4:
                            w_hi, w_lo = _prmt_apply(byte, U0, U1, U2, U3, V0, V1, V2, V3, x_dtype)
                        elif ASM:
                            w_hi, w_lo = _prmt_lookup(byte, sb, c00, c01, c02, c03, c04, c05, c06, c07, c08, c09, c10,
                                                      c11, c12, c13, c14, c15, x_dtype)
                        elif LUT >= 4:  # (Triton's interpreter runs no PTX: the same values from the table in memory)
                            w_hi = tl.load(CODE + (byte >> 4).to(tl.int32)).to(x_dtype)
                            w_lo = tl.load(CODE + (byte & 15).to(tl.int32)).to(x_dtype)
                        else:
                            w_hi = (tl.load(CODE + (byte >> 4).to(tl.int32)) * sb[:, None]).to(x_dtype)
                            w_lo = (tl.load(CODE + (byte & 15).to(tl.int32)) * sb[:, None]).to(x_dtype)
                        if LUT >= 4 and KORD:  # W[n, k0 + 64 blk + i] (unscaled), the permutes' values in k order
                            if not ASM:
                                first, second = _kord_pairs(w_hi, w_lo, BN)
                            w = _kord_tile(first, second, BN)
                        else:
                            w = tl.reshape(tl.join(w_hi, w_lo), [BN, 64])  # W[n, k0 + 64 blk + i] (LUT 4: unscaled)
                        if LUT == 5:  # cast(cast(code) · cast(absmax)): one 16-bit multiply a value pair
                            w = (w * sb.to(w.dtype)[:, None]).to(x_dtype)
                        elif LUT == 6:  # cast(cast(code) · absmax), the product in float32
                            w = (w.to(tl.float32) * sb[:, None]).to(x_dtype)
                        if LUT == 4:  # Σ_k cast(code)·x of the block, times the block's scale of each row
                            if SWAP:
                                acc += tl.dot(w, xt, out_dtype=tl.float32) * sb[:, None]
                            else:
                                acc += tl.dot(tl.trans(xt), tl.trans(w), out_dtype=tl.float32) * sb[None, :]
                        elif SWAP:
                            acc += tl.dot(w, xt, out_dtype=tl.float32)
                        else:
                            acc += tl.dot(tl.trans(xt), tl.trans(w), out_dtype=tl.float32)
            else:
                for c in range(c_start, c_stop):
                    k_even = c * 128 + 2 * j  # [64]
                    k_ok = k_even < K
                    if EVEN_K:  # no mask along k: the loads stay 16-byte vectors
                        byte = tl.load(w_rows[:, None] + (c * 64 + j)[None, :], mask=n_ok[:, None], other=0)
                    else:
                        byte = tl.load(w_rows[:, None] + (c * 64 + j)[None, :], mask=n_ok[:, None] & k_ok[None, :],
                                       other=0)  # [BN, 64] uint8
                    s0 = tl.load(S + (2 * c) * NQ + n, mask=n_ok, other=0.0)  # [BN]
                    s1 = tl.load(S + (2 * c + 1) * NQ + n, mask=n_ok & (n * 0 + c * 128 + 64 < K),
                                 other=0.0)  # (a tensor: a bare bool breaks the interpreter)
                    q_hi, q_lo = (byte >> 4).to(tl.int32), (byte & 15).to(tl.int32)
                    if LUT == 1:  # this chunk's 32 values bf16(code[i] · s) a row (two blocks), gathered in registers
                        table = (tl.where((i32 < 16)[None, :], s0[:, None], s1[:, None]) * code2[None, :]).to(x_dtype)
                        second = tl.where(first_block, 0, 16)  # [1, 64]
                        w_hi = tl.gather(table, q_hi + second, 1)  # W[n, k0 + 2j]   [BN, 64]
                        w_lo = tl.gather(table, q_lo + second, 1)  # W[n, k0 + 2j + 1]
                    else:
                        scale = tl.where(first_block, s0[:, None], s1[:, None])  # [BN, 64]
                        if LUT == 2:  # a select tree over the 16 values held in registers
                            w_hi = (_select16(q_hi, c00, c01, c02, c03, c04, c05, c06, c07, c08, c09, c10, c11, c12,
                                              c13, c14, c15) * scale).to(x_dtype)
                            w_lo = (_select16(q_lo, c00, c01, c02, c03, c04, c05, c06, c07, c08, c09, c10, c11, c12,
                                              c13, c14, c15) * scale).to(x_dtype)
                        else:  # loads from the 16-entry table in memory (the pipeliner may stage them: slow)
                            w_hi = (tl.load(CODE + q_hi) * scale).to(x_dtype)
                            w_lo = (tl.load(CODE + q_lo) * scale).to(x_dtype)
                    if JOIN:  # the tile in k order (codes interleaved in registers), x read contiguously
                        w = tl.reshape(tl.join(w_hi, w_lo), [BN, 128])  # W[n, k0 + i]
                        k = c * 128 + tl.arange(0, 128)
                        kx_ok = k < K
                        if SWAP:
                            xt = tl.load(x_rows[None, :] + k[:, None], mask=m_ok[None, :] & kx_ok[:, None], other=0.0)
                            acc += tl.dot(w, xt, out_dtype=tl.float32)  # [BN, 128] · [128, BM]
                        else:
                            xk = tl.load(x_rows[:, None] + k[None, :], mask=m_ok[:, None] & kx_ok[None, :], other=0.0)
                            acc += tl.dot(xk, tl.trans(w), out_dtype=tl.float32)
                    elif SWAP:  # even and odd k as two products, x read with a stride of 2
                        xe = tl.load(x_rows[None, :] + k_even[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
                        xo = tl.load(x_rows[None, :] + (k_even + 1)[:, None], mask=m_ok[None, :] & k_ok[:, None],
                                     other=0.0)  # [64, BM]
                        acc += tl.dot(w_hi, xe, out_dtype=tl.float32)
                        acc += tl.dot(w_lo, xo, out_dtype=tl.float32)
                    else:
                        xe = tl.load(x_rows[:, None] + k_even[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                        xo = tl.load(x_rows[:, None] + (k_even + 1)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                                     other=0.0)  # [BM, 64]
                        acc += tl.dot(xe, tl.trans(w_hi), out_dtype=tl.float32)
                        acc += tl.dot(xo, tl.trans(w_lo), out_dtype=tl.float32)
        if SWAP:
            offs = m[None, :].to(tl.int64) * stride_ym + col[:, None]
            mask = c_ok[:, None] & m_ok[None, :]
            if HAS_BIAS:
                acc += tl.load(BIAS + col, mask=c_ok, other=0.0).to(tl.float32)[:, None]
        else:
            offs = m[:, None].to(tl.int64) * stride_ym + col[None, :]
            mask = m_ok[:, None] & c_ok[None, :]
            if HAS_BIAS:
                acc += tl.load(BIAS + col, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + ps * stride_ys + offs, acc.to(Y.dtype.element_ty), mask=mask)
        if FIXUP:
            _last_split_sums(Y, OUT, BIAS, LOCK + pn, stride_ys, offs, mask, col, c_ok, SWAP, SUM_BIAS)

    @triton.jit
    def _split_sum_kernel(PART, BIAS, Y, total, NT, splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        """Y[i] = cast(Σ_s PART[s, i] (+ bias[i mod NT])), the splits added in order."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < total
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, splits):
            acc += tl.load(PART + s * total + i, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(BIAS + i % NT, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + i, acc.to(Y.dtype.element_ty), mask=ok)


PERMUTE_FALLBACKS: set = set()  # builds whose permute operands were not four consecutive bytes (register gather)


def permutes_packed(kernel) -> bool:
    """Whether a compiled lut-3 build hands its byte permutes (PRMT_ASM) what they assume: each thread's four packed
    code bytes consecutive in one row (a blocked layout whose rows run fastest and whose per-thread width is a
    multiple of 4). Triton picks the layout by propagation; another one would pair bytes of two rows with one
    row's tables."""
    ttgir = getattr(kernel, "asm", {}).get("ttgir", "")
    uses = re.findall(r"elementwise_inline_asm[^\n]*?tensor<\d+x32xi8, #(\w+)>", ttgir)
    if not uses:
        return False
    for name in set(uses):
        d = re.search(rf"^#{name} = #ttg\.blocked<\{{sizePerThread = \[\d+, (\d+)\].*order = \[1, 0\]", ttgir, re.M)
        if d is None or int(d.group(1)) % 4:
            return False
    return True


_PACKED: dict = {}  # id of a compiled build → (it, permutes_packed of it): its IR is parsed once


def _checked(kernel) -> bool:
    key = id(kernel)
    if key not in _PACKED:
        _PACKED[key] = (kernel, permutes_packed(kernel))  # (the build kept: its id stays its own)
    return _PACKED[key][1]


def _interpreting() -> bool:
    return type(_nf4_group_kernel).__name__ == "InterpretedFunction"


def launch_for(M: int, launch: dict | None = None, table: dict | None = None) -> tuple[int, dict]:
    """(row tile BM, ``table``'s entry: default :data:`LAUNCH`) for M rows of x."""
    table = table or LAUNCH
    bucket = next((b for b in sorted(table) if b >= M), max(table))
    entry = {**table[bucket], **(launch or {})}
    return max(16, min(bucket, triton.next_power_of_2(M))), entry  # (a tensor-core tile has 16 rows at least)


def split_for(row_tiles: int, n_chunks: int, programs: int) -> int:
    """K splits: about ``programs`` programs in all, each split at least MIN_CHUNKS_PER_SPLIT chunks of K."""
    return max(1, min(n_chunks // MIN_CHUNKS_PER_SPLIT, -(-programs // row_tiles)))


@dataclass(frozen=True)
class GroupGrid:
    """The launch of a grouped product (this one's, and ops/fp8_matmul.py's): BN-row tiles of the 16-bit rows
    first, then of the quantized weights (none across two weights: BN halves until it divides all but the last),
    K split into ``split`` ranges of ``per_split`` chunks, x in m tiles of BM rows; the weights' row bounds N0, N01."""

    BM: int
    BN: int
    dense_tiles: int
    row_tiles: int
    m_tiles: int
    n_chunks: int
    split: int
    per_split: int
    N0: int
    N01: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.row_tiles, self.split, self.m_tiles


def group_grid(M: int, rows: list, R: int, K: int, chunk: int, BM: int, cfg: dict) -> GroupGrid:
    """The :class:`GroupGrid` of M rows of x times quantized weights of ``rows`` rows and R 16-bit rows, K wide,
    read ``chunk`` elements of K a step, under launch entry ``cfg`` (bn, programs)."""
    BN = cfg["bn"]
    while any(n % BN for n in rows[:-1]):  # no tile across two weights (groupable: multiples of MIN_BN)
        BN //= 2
    NQ = sum(rows)
    dense_tiles = -(-R // BN)
    row_tiles = dense_tiles + -(-NQ // BN)
    m_tiles = -(-M // BM)
    n_chunks = -(-K // chunk)
    split = split_for(row_tiles * m_tiles, n_chunks, cfg["programs"])
    per_split = -(-n_chunks // split)
    N0 = rows[0]
    return GroupGrid(BM, BN, dense_tiles, row_tiles, m_tiles, n_chunks, -(-n_chunks // per_split), per_split, N0,
                     N0 + (rows[1] if len(rows) > 1 else NQ))


def matrix_rows(x: torch.Tensor, K: int) -> tuple[torch.Size, torch.Tensor]:
    """(leading shape, rows [M, K] with unit stride along K) of x [..., K], for a product's kernel."""
    rows = x.reshape(-1, K)
    return x.shape[:-1], rows if rows.stride(-1) == 1 else rows.contiguous()


def split_target(out: torch.Tensor, split: int) -> torch.Tensor:
    """Where the product's programs write: ``out`` [M, NT] itself, or float32 partial sums [split, M, NT]."""
    return out if split == 1 else torch.empty(split, *out.shape, dtype=torch.float32, device=out.device)


def split_locks(out_features: int, device) -> torch.Tensor:
    """A group's arrival counts for the ``fixup`` launch choice: one int32 a row tile of the smallest width (zeros;
    each launch leaves them zero)."""
    return torch.zeros(-(-out_features // MIN_BN) + 2, dtype=torch.int32, device=device)


def fixes_up(cfg: dict, g: "GroupGrid", locks: torch.Tensor) -> bool:
    """Whether a launch sums its K splits in its own last programs (launch choice ``fixup``: several splits, one
    m tile, a count for every row tile) rather than by _split_sum_kernel's launch after it."""
    return bool(cfg.get("fixup")) and g.split > 1 and g.m_tiles == 1 and g.row_tiles <= locks.numel()


def sum_splits(target: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, NT] = cast(Σ_s target[s] (+ bias)), the splits added in order (nothing when target is out)."""
    if target is out:
        return
    total, NT, block = out.numel(), out.shape[-1], 1024
    _split_sum_kernel[(-(-total // block),)](target, bias if bias is not None else out, out, total, NT,
                                             target.shape[0], HAS_BIAS=bias is not None, BLOCK=block)


def nf4_group_linear(x: torch.Tensor, group: NF4Group, use_triton: bool = True,
                     launch: dict | None = None) -> torch.Tensor:
    """x [..., K] → [..., Σ N_i + R] = x · [W_0; …; D]ᵀ (+ bias) for the group (module docstring); the twin when
    Triton is off or x is not 16-bit (bitsandbytes' weights). ``launch`` overrides :data:`LAUNCH`'s entry (for
    tuning; the result depends on it through float32 summation order, and luts 4 to 6 against the others through
    how the block scale is applied: twin_options)."""
    K = group.K
    if not use_triton or triton is None or x.shape[-1] != K or x.dtype not in (torch.bfloat16, torch.float16):
        return nf4_group_reference(x, group)
    lead, x2 = matrix_rows(x, K)
    M, NQ, NT = x2.shape[0], group.nf4_rows, group.out_features
    R = NT - NQ
    BM, cfg = launch_for(M, launch, HALVES_LAUNCH if group.halves else None)
    if cfg.get("mma") and not _interpreting():  # the few-row CUDA kernel (ops/nf4_mma.py), where it applies
        y = nf4_mma_linear(x2, group, cfg)
        if y is not None:
            return y.view(*lead, NT)
    g = group_grid(M, group.rows, R, K, CHUNK, BM, cfg)
    BN, split = g.BN, g.split
    out = torch.empty(M, NT, dtype=x.dtype, device=x.device)
    target = split_target(out, split)
    p = group.packed + [group.packed[0]] * (MAX_NF4 - len(group.packed))
    dense = group.dense if group.dense is not None else x2  # (an unused pointer without dense rows)
    bias = group.bias if group.bias is not None else out
    lut, asm = cfg["lut"], not _interpreting()
    if lut not in range(7):
        raise ValueError(f"nf4_group_linear: launch choice lut is 0 to 6, not {lut!r}")
    halves = {}
    if group.halves:  # (ops/nf4_halves.py) the weight tile on the left, luts 4 to 6 (those below, which build a table
        # a block, take 4), launch choice ``pack`` bytes a lookup; the lookup needs no particular byte layout
        cfg, lut, pack = {**cfg, "swap": True}, max(4, lut), cfg.get("pack", 4)
        ptx, cons = _halves_lookup(group, x.dtype, pack)
        halves = dict(HALVES=True, LOOKUP=ptx, LOOKUP_CONS=cons, PACK=pack)
    key = (BM, BN, cfg["swap"], cfg["warps"], cfg["stages"], K % CHUNK == 0, x.dtype)
    if lut == 3 and asm and key in PERMUTE_FALLBACKS:
        lut = 1
    kord = (bool(cfg.get("kord")) and lut >= 4 and not halves
            and not (asm and ("kord", *key) in PERMUTE_FALLBACKS))
    fixup = fixes_up(cfg, g, group.locks)
    regs = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and asm else {}  # registers a thread, at most
    for _ in range(2):
        kernel = _nf4_group_kernel[g.grid](
            x2, p[0], p[1], p[2], group.scales, group.code, dense, bias, target, out, group.locks, M, K, K // 2, g.N0,
            g.N01, NQ, R, x2.stride(0), NT, M * NT, g.n_chunks, g.per_split, g.dense_tiles,
            HAS_BIAS=group.bias is not None and split == 1, BM=BM, BN=BN, SWAP=cfg["swap"], JOIN=cfg["join"],
            LUT=lut, EVEN_K=K % CHUNK == 0, ASM=asm, FIXUP=fixup, SUM_BIAS=group.bias is not None, KORD=kord,
            UNROLL=cfg.get("unroll", 1), num_warps=cfg["warps"], num_stages=cfg["stages"], **halves, **regs)
        if not (lut == 3 or kord) or not asm or _checked(kernel):
            break
        # the byte permutes read four bytes of one row a thread; this build spread them (its result is discarded:
        # the launch again with the register gather, or the values paired by nibble, rewrites every output)
        if kord:
            PERMUTE_FALLBACKS.add(("kord", *key))
            log.warning("nf4_matmul: the k-ordered lookup does not fit this build's layout (rows %d, tile %d, %d "
                        "warps); pairing the values by nibble for it", BM, BN, cfg["warps"])
            kord = False
            continue
        PERMUTE_FALLBACKS.add(key)
        log.warning("nf4_matmul: the byte-permute lookup does not fit this build's layout (rows %d, tile %d, %d "
                    "warps); using the register gather for it", BM, BN, cfg["warps"])
        lut = 1
    if not fixup:
        sum_splits(target, group.bias, out)
    return out.view(*lead, NT)


def _halves_lookup(group: NF4Group, dtype: torch.dtype, pack: int) -> tuple[str, str]:
    key = (dtype, pack)
    if key not in group.lookups:
        group.lookups[key] = lookup_ptx(table_planes(list(group.table), dtype), pack)
    return group.lookups[key], lookup_constraints(pack)


def nf4_linear(x: torch.Tensor, packed, absmax, code, N: int, K: int, bias=None, use_triton: bool = True):
    """x [..., K] → [..., N] = x · Wᵀ (+ bias) for one NF4 weight given by its :func:`nf4_operands` (the scales
    transposed per call: for tests and one-off products; decode steps hold an :class:`NF4Group`)."""
    if not use_triton or triton is None or K % BLOCKSIZE:
        return nf4_linear_reference(x, packed, absmax, code, N, K, bias)
    group = NF4Group([packed], [N], absmax.view(N, K // BLOCKSIZE).t().contiguous(), code, K, None, bias)
    return nf4_group_linear(x, group)
