"""The few-row NF4 group product as a CUDA kernel (nf4_mma.cu), built at first use by NVRTC (ops/cuda_build.py).

Triton's lookup of the NF4 codes costs 5 to 6.4 instructions a code in the sm_90 SASS (byte permutes on the
table's planes, ops/nf4_matmul.py), and at 8-16 rows a layer's products run at a fraction of the copy bandwidth,
bound by instructions and their latencies (H200 and H100 equally: 98.9 and 99.2 µs a layer at 16 rows). This
kernel turns a code byte into the tensor cores' register of two values with one conflict-free shared-memory load
(a 256-entry table of value pairs, a copy a lane) and feeds mma.sync directly, with the codes read where
bitsandbytes keeps them (the k order permuted alike in x and W, so no re-layout):

    y[m, n] = Σ_b absmax[n, b] · Σ_{k in b} x[m, k] · cast(code[q[n, k]])     (lut 4's arithmetic; its twin:
                                                                               nf4_group_reference(scale_after=True))

for x of at most :data:`MAX_ROWS` rows, K a multiple of 64, 16-bit x, on sm_80 and newer. :func:`nf4_mma_linear`
returns None where it does not apply or the build is missing (the caller's Triton path runs).

Two kernels compute it. nf4_mma.cu: a block's warps split an item's K range and load their codes into registers a
pass at a time. nf4_mma_staged.cu (launch key ``staged``): the codes, their absmax and x staged in shared memory by
cp.async ``mma_stages`` - 1 stages ahead of the products, a block's warps on the rows of one K range.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import cuda_build

_HERE = Path(__file__).parent
_COMMON = (_HERE / "nf4_mma_common.cuh").read_text()  # what both kernels share, put before each
SOURCE = _COMMON + (_HERE / "nf4_mma.cu").read_text()
STAGED_SOURCE = _COMMON + (_HERE / "nf4_mma_staged.cu").read_text()
MAX_ROWS = 32  # rows of x: n8 tiles 1, 2 or 4
WARPS = 4  # a block's warps (both kernels' WARPS)
UNIT = 32  # rows of the group a work item owns (nf4_mma.cu UNIT; its K range shared by a block's warps)
STAGED_UNIT = 32 * WARPS  # rows an item of the staged kernel owns (nf4_mma_staged.cu UNIT: 32 a warp)
STAGE_BLOCKS = 4  # blocks of K a stage of the staged kernel (nf4_mma_staged.cu UNR)
BLOCK = 64  # K a code block (one absmax)


def staged_shared_bytes(nt8: int, stages: int) -> int:
    """The staged kernel's dynamic shared memory: ``stages`` stages of an item's codes (32 bytes a row a block),
    their absmax (4 bytes) and x's 8·nt8 rows (128 bytes a block)."""
    return stages * STAGE_BLOCKS * (STAGED_UNIT * 32 + STAGED_UNIT * 4 + 8 * nt8 * 128)


def why_not(x2: torch.Tensor, group) -> str | None:
    """Why the kernel cannot take this product (None: it can)."""
    if not x2.is_cuda or torch.cuda.get_device_capability(x2.device)[0] < 8:
        return "not a CUDA device of compute capability 8.0 or newer"
    if x2.dtype not in (torch.bfloat16, torch.float16):
        return f"x in {x2.dtype}"
    if not 1 <= x2.shape[0] <= MAX_ROWS:
        return f"{x2.shape[0]} rows of x (1 to {MAX_ROWS})"
    if group.halves:
        return "the codes in the halves layout"
    if group.K % BLOCK:
        return f"K = {group.K} (a multiple of {BLOCK})"
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        return "x's rows not 16-byte aligned"
    if any(p.data_ptr() % 16 for p in group.packed):
        return "codes not 16-byte aligned"
    if group.dense is not None and (group.dense.dtype != x2.dtype or group.dense.data_ptr() % 16):
        return "dense rows not in x's dtype or not 16-byte aligned"
    return None


def takes(group, launch: dict) -> bool:
    """Whether a launch entry gives ``group`` to the kernel by its size: its NF4 code bytes at least the entry's
    ``min_bytes`` (default 0). Read cold from DRAM at 8 rows (H100, 2026-12-07, nf4_matmul_h100_mma.md) the kernel
    beat Triton's on gate/up (59 MB of codes: 44.8 against 48.4 µs) and down (29 MB: 26.4 against 26.9) and lost on
    q/k/v (13 MB: 16.2 against 14.9) and o (8 MB: 14.8 against 11.6)."""
    return sum(p.numel() for p in group.packed) >= launch.get("min_bytes", 0)


def split_for(units: int, n_blocks: int, resident: int, min_blocks: int, fixup_blocks: float,
              granule: int = 1) -> tuple[int, int]:
    """(K splits, blocks of K a split) for ``units`` row units of ``n_blocks`` blocks on a grid holding
    ``resident`` blocks at once: the split whose items finish soonest, counting whole waves of items (a wave
    part-full costs a full one) times the blocks an item reads, plus ``fixup_blocks`` for partial sums; each split
    at least ``min_blocks`` blocks and a multiple of ``granule`` (the staged kernel's stage), the fewest splits on a
    tie. E.g. 898 units of 64 blocks on 660: one split takes 2 waves × 64, two 3 × 32."""
    best = None
    for split in range(1, max(1, n_blocks // max(1, min_blocks)) + 1):
        split, per_split = _whole_splits(n_blocks, split, granule)
        cost = -(-units * split // resident) * per_split + (fixup_blocks if split > 1 else 0)
        if best is None or cost < best[0]:
            best = (cost, split, per_split)
    return best[1], best[2]


def _whole_splits(n_blocks: int, split: int, granule: int) -> tuple[int, int]:
    """(splits, blocks a split) for about ``split`` splits of ``n_blocks``: each a multiple of ``granule`` blocks,
    none empty."""
    per_split = -(-n_blocks // split)
    per_split = -(-per_split // granule) * granule  # (rounded up to whole granules)
    return -(-n_blocks // per_split), per_split


def _operands(group, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the 16 code values' 16-bit patterns as int32 [16], the bias in float32 or None), made once a group."""
    key = ("mma", dtype)
    if key not in group.lookups:
        code16 = group.code.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
        bias = group.bias.float().contiguous() if group.bias is not None else None
        group.lookups[key] = (code16.contiguous(), bias)
    return group.lookups[key]


def nf4_mma_linear(x2: torch.Tensor, group, launch: dict | None = None) -> torch.Tensor | None:
    """x2 [M, K] → [M, Σ N_i + R] (module docstring), or None where the kernel does not apply or was not built.
    launch: ``min_blocks`` (64-wide blocks of K an item at least, shared by its block's warps; default 16) and
    ``fixup_blocks`` (what a split's partial sums cost, in a block's time; default 2): see :func:`split_for`; or
    ``waves``: items ≈ waves × the blocks the GPU holds at once (each split still ≥ min_blocks); ``staged``: the
    staged kernel, with ``mma_stages`` stages (default 3; ``stages`` is the Triton kernel's); ``min_bytes``: groups
    of fewer code bytes are left to the caller's Triton path (:func:`takes`)."""
    launch = launch or {}
    if why_not(x2, group) is not None or not takes(group, launch):
        return None
    M, K = x2.shape
    nt8 = 1 if M <= 8 else 2 if M <= 16 else 4
    options = [f"-DNT8={nt8}", f"-DHALF={int(x2.dtype == torch.float16)}"]
    if launch.get("staged"):
        stages = int(launch.get("mma_stages", 3))
        shared, unit, granule = staged_shared_bytes(nt8, stages), STAGED_UNIT, STAGE_BLOCKS
        kernel = cuda_build.build(STAGED_SOURCE, "nf4_mma_staged", [*options, f"-DSTAGES={stages}"], x2.device)
        if kernel is not None and not kernel.allow_shared(shared):
            return None
    else:
        shared, unit, granule = 0, UNIT, 1
        kernel = cuda_build.build(SOURCE, "nf4_mma", options, x2.device)
    if kernel is None or kernel.blocks_per_sm(WARPS * 32, shared) < 1:
        return None
    code16, bias = _operands(group, x2.dtype)
    NQ, NT = group.nf4_rows, group.out_features
    R = NT - NQ
    dense_units, units = -(-R // unit), -(-R // unit) + -(-NQ // unit)
    n_blocks = K // BLOCK
    sms = torch.cuda.get_device_properties(x2.device).multi_processor_count
    resident = sms * kernel.blocks_per_sm(WARPS * 32, shared)  # blocks the GPU holds at once
    if "waves" in launch:  # items ≈ waves × the blocks the GPU holds, each split at least min_blocks blocks
        split = max(1, min(n_blocks // launch.get("min_blocks", 16), -(-int(launch["waves"] * resident) // units)))
        split, per_split = _whole_splits(n_blocks, split, granule)
    else:
        split, per_split = split_for(units, n_blocks, resident, launch.get("min_blocks", 16),
                                     launch.get("fixup_blocks", 2), granule)
    grid = min(resident, units * split)
    out = torch.empty(M, NT, dtype=x2.dtype, device=x2.device)
    part = torch.empty(split, M, NT, dtype=torch.float32, device=x2.device) if split > 1 else out
    rows = group.rows
    N0 = rows[0]
    N01 = N0 + (rows[1] if len(rows) > 1 else NQ)
    p = group.packed + [group.packed[0]] * (3 - len(group.packed))
    dense = group.dense if group.dense is not None else x2
    kernel.launch((grid, 1, 1), (WARPS * 32, 1, 1), [
        x2, cuda_build.I64(x2.stride(0)), M, p[0], p[1], p[2], N0, N01, NQ, group.scales, dense, R,
        bias if bias is not None else code16, bias is not None, code16, part, out, group.locks,
        K, NT, dense_units, units, split, per_split], shared=shared)
    return out
