"""Instructions per code of the NF4 decode product's loop over K for sm_90, compiled ahead of time (no GPU): the
SASS of each launch's loop body (per thread, one chunk of 128 codes a row of its BN-row tile) for the default lookup
(lut 3: a bf16 table a row and block, built inside the loop, then byte permutes) and lut 4 (one table of the 16
unscaled codes built before the loop, the same permutes, each block's product then scaled by its rows' absmax).
At decode row counts the product is bound by instructions, not bytes: reading a code at the copy bandwidth
(~4 TB/s, 8·10¹² codes/s) leaves an H100/H200 (132 SMs × 128 lanes × ~1.9 GHz ≈ 3.2·10¹³ instructions/s) about
4 instructions a code.

    python benchmarks/nf4_sass.py            # writes results/nf4_lut4_sass.{md,json}

Needs Triton's CUDA backend with its ptxas and nvdisasm (the CPU wheel of Triton ships them); no GPU.
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT / "src")]

from results_io import run_meta, write_result  # noqa: E402
from test_kernels_compile import _nf4_build, _registers, _sass_loops  # noqa: E402

# (rows of x, row tile BN, warps): LAUNCH's choices (16: 64/4; 32-128: 128/8) and the sweep's others
BUILDS = [(16, 64, 4), (16, 128, 4), (32, 64, 4), (32, 128, 8), (64, 128, 8), (128, 128, 8), (128, 64, 4)]


def loop_mix(rows: int, bn: int, warps: int, lut: int) -> dict:
    from longrl.ops.nf4_matmul import permutes_packed

    kernel = _nf4_build(rows, lut, bn, warps)
    body = max(_sass_loops(kernel), key=len)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0] for ins in body)
    return dict(rows=rows, bn=bn, warps=warps, lut=lut, body=len(body), per_code=len(body) * 32 * warps / (bn * 128),
                registers=_registers(kernel), packed=permutes_packed(kernel), shared=kernel.metadata.shared, spills=ops["STL"] + ops["LDL"],
                prmt=ops["PRMT"], table_work=ops["FMUL"] + ops["F2FP"], scale_ffma=ops["FFMA"], mix=dict(ops))


def main() -> None:
    rows = [loop_mix(m, bn, w, lut) for m, bn, w in BUILDS for lut in (3, 4)]
    meta = run_meta()
    lines = ["# NF4 decode product: instructions per code in its loop over K (sm_90 SASS, compiled on the CPU)", "",
             f"{meta['date']}; torch {meta['torch']}; `{meta['command']}`. Static counts of one loop iteration "
             "(a chunk of 128 codes of each of the tile's BN rows), per thread × threads / codes; not a timing. "
             "Table work: FMUL + F2FP (a bf16 table built a row and block); scale: FFMA (lut 4's scale after each "
             "block's product, BM/64 a code). swap and join on, EVEN_K, bf16 activations. lut 3 layout: whether the build "
             "hands each thread four bytes of one row (permutes_packed; where not, the product runs the register "
             "gather instead, lut 1); lut 4 needs no such layout (one table for every row).", "",
             "| rows | BN | warps | lut 3 layout | lut 3 instr / code | lut 4 instr / code | lut 4 / lut 3 | table work (3 / 4) | "
             "PRMT (3 / 4) | scale FFMA (4) | registers (3 / 4) | spills (3 / 4) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for a, b in zip(rows[::2], rows[1::2]):
        lines.append(f"| {a['rows']} | {a['bn']} | {a['warps']} | {'ok' if a['packed'] else 'refused'} | "
                     f"{a['per_code']:.2f} | {b['per_code']:.2f} | "
                     f"{b['per_code'] / a['per_code']:.2f} | {a['table_work']} / {b['table_work']} | "
                     f"{a['prmt']} / {b['prmt']} | {b['scale_ffma']} | {a['registers']} / {b['registers']} | "
                     f"{a['spills']} / {b['spills']} |")
    write_result("nf4_lut4_sass", {**meta, "builds": rows}, lines)


if __name__ == "__main__":
    main()
