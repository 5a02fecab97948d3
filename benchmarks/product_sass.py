"""Instructions per weight of the quantized decode products' loop over K for sm_90, compiled ahead of time (no GPU):
the SASS of each launch's loop body (per thread, one chunk of 128 weights a row of its BN-row tile).

- NF4 (ops/nf4_matmul.py): lut 3 (a bf16 table a row and block, built inside the loop, then byte permutes)
  against lut 4 (one table of the 16 unscaled codes built before the loop, the same permutes, each block's product
  then scaled by its rows' absmax); then luts 4 and 5 (the looked-up values scaled instead) with the values paired
  by nibble or in k order (kord).
- FP8 (ops/fp8_matmul.py): the default (each weight converted to float32, scaled, rounded to bf16) against f16 (the
  e4m3 codes converted to float16 as they are, two a conversion, multiplied on float16 tensor cores by float16(x · p),
  the block's scale after the product; each program scales and converts its x chunks itself, a cost that grows with
  the rows of x).

At decode row counts these products are bound by instructions more than by bytes: reading weights at the copy
bandwidth (~4 TB/s: 8·10¹² NF4 codes/s, 4·10¹² FP8 weights/s) leaves an H100/H200 (132 SMs × 128 lanes × ~1.9 GHz ≈
3.2·10¹³ instructions/s) about 4 instructions an NF4 code and 8 an FP8 weight, latencies not counted.

    python benchmarks/product_sass.py            # writes results/decode_product_sass.{md,json}

Needs Triton's CUDA backend with its ptxas and nvdisasm (the CPU wheel of Triton ships them); no GPU.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT / "src")]

from results_io import run_meta, write_result  # noqa: E402
from test_kernels_compile import _fp8_build, _nf4_build, _opcodes, _registers, _sass_loops  # noqa: E402

# (rows of x, row tile BN, warps): the launch tables' choices (NF4 16: 64/4, 32-128: 128/8; FP8 16-32: 64/4,
# 64-128: 128/8) and the sweeps' others
NF4_BUILDS = [(16, 64, 4), (16, 128, 4), (32, 64, 4), (32, 128, 8), (64, 128, 8), (128, 128, 8), (128, 64, 4)]
FP8_BUILDS = [(16, 64, 4), (16, 128, 4), (32, 64, 4), (64, 128, 8), (128, 128, 8)]


def loop_mix(kernel, bn: int, warps: int) -> dict:
    body = max(_sass_loops(kernel), key=len)
    ops = collections.Counter(_opcodes(body))
    return dict(body=len(body), per_weight=len(body) * 32 * warps / (bn * 128), registers=_registers(kernel),
                shared=kernel.metadata.shared, spills=ops["STL"] + ops["LDL"], mix=dict(ops))


def nf4_rows() -> list[dict]:
    from longrl.ops.nf4_matmul import permutes_packed

    rows = []
    for m, bn, w in NF4_BUILDS:
        for lut in (3, 4):
            kernel = _nf4_build(m, lut, bn, w)
            rows.append(dict(rows=m, bn=bn, warps=w, lut=lut, packed=permutes_packed(kernel),
                             **loop_mix(kernel, bn, w)))
    return rows


def nf4_kord_rows() -> list[dict]:
    """luts 4 and 5, the values paired by nibble (then interleaved) or in k order (kord), at each build."""
    from longrl.ops.nf4_matmul import permutes_packed

    rows = []
    for m, bn, w in NF4_BUILDS:
        for lut in (4, 5):
            for kord in (False, True):
                kernel = _nf4_build(m, lut, bn, w, kord=kord)
                rows.append(dict(rows=m, bn=bn, warps=w, lut=lut, kord=kord, packed=permutes_packed(kernel),
                                 **loop_mix(kernel, bn, w)))
    return rows


def fp8_rows() -> list[dict]:
    return [dict(rows=m, bn=bn, warps=w, f16=f16, **loop_mix(_fp8_build(m, f16, bn, w), bn, w))
            for m, bn, w in FP8_BUILDS for f16 in (False, True)]


def count(row: dict, *ops: str) -> int:
    return sum(row["mix"].get(op, 0) for op in ops)


def main() -> None:
    nf4, kord, fp8 = nf4_rows(), nf4_kord_rows(), fp8_rows()
    meta = run_meta()
    lines = ["# Quantized decode products: instructions per weight in their loop over K (sm_90 SASS, compiled on "
             "the CPU)", "",
             f"{meta['date']}; torch {meta['torch']}; `{meta['command']}`. Static counts of one loop iteration (a "
             "chunk of 128 weights of each of the tile's BN rows), per thread × threads / weights; not a timing. "
             "bf16 activations, K a multiple of the chunk.", "",
             "## NF4 (ops/nf4_matmul.py; swap and join on)", "",
             "Table work: FMUL + F2FP (a bf16 table built a row and block); scale: FFMA (lut 4's scale after each "
             "block's product, BM/64 a code). lut 3 layout: whether the build hands each thread four bytes of one row "
             "(permutes_packed; where not, the product runs the register gather instead, lut 1); lut 4 needs no such "
             "layout (one table for every row).", "",
             "| rows | BN | warps | lut 3 layout | lut 3 instr / code | lut 4 instr / code | lut 4 / lut 3 | "
             "table work (3 / 4) | PRMT (3 / 4) | scale FFMA (4) | registers (3 / 4) | spills (3 / 4) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for a, b in zip(nf4[::2], nf4[1::2]):
        lines.append(f"| {a['rows']} | {a['bn']} | {a['warps']} | {'ok' if a['packed'] else 'refused'} | "
                     f"{a['per_weight']:.2f} | {b['per_weight']:.2f} | {b['per_weight'] / a['per_weight']:.2f} | "
                     f"{count(a, 'FMUL', 'F2FP')} / {count(b, 'FMUL', 'F2FP')} | {count(a, 'PRMT')} / "
                     f"{count(b, 'PRMT')} | {count(b, 'FFMA')} | {a['registers']} / {b['registers']} | "
                     f"{a['spills']} / {b['spills']} |")
    lines += ["", "### The values in k order (kord)", "",
              "PRMT_ASM_K pairs each byte's two values in k order (its selectors made once for four bytes), so the "
              "tile needs no interleaving after the lookup; it needs each thread's four bytes consecutive in one row "
              "(layout: permutes_packed, as lut 3). lut 5 scales the looked-up values (HMUL2) instead of each "
              "block's product (lut 4's FFMA). Instructions / code, PRMT / code in brackets.", "",
              "| rows | BN | warps | layout | lut 4 | lut 4, kord | lut 5 | lut 5, kord | registers (lut 5 / kord) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in range(0, len(kord), 4):
        a, ak, b, bk = kord[r:r + 4]
        codes = a["bn"] * 128 / (32 * a["warps"])
        cell = (lambda x: f"{x['per_weight']:.2f} ({count(x, 'PRMT') / codes:.2f})")
        lines.append(f"| {a['rows']} | {a['bn']} | {a['warps']} | {'ok' if ak['packed'] else 'refused'} | "
                     f"{cell(a)} | {cell(ak)} | {cell(b)} | {cell(bk)} | {b['registers']} / {bk['registers']} |")
    lines += ["", "## FP8 (ops/fp8_matmul.py)", "",
              "Conversion work: F2FP + HADD2 + FMUL (e4m3 → float16 pairs, float16 → float32, the scale, float32 → "
              "bf16 pairs); f16 keeps only the first for the weights (F2FP, one per two) and scales each block's "
              "product (FFMA, BM/128 a weight), and adds x's scaling and conversion (FMUL, F2FP: 128·BM per chunk "
              "over the program's threads, so x's share grows with the rows).", "",
              "| rows | BN | warps | default instr / weight | f16 instr / weight | f16 / default | conversion work "
              "(default / f16) | registers (default / f16) | spills (default / f16) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for a, b in zip(fp8[::2], fp8[1::2]):
        lines.append(f"| {a['rows']} | {a['bn']} | {a['warps']} | {a['per_weight']:.2f} | {b['per_weight']:.2f} | "
                     f"{b['per_weight'] / a['per_weight']:.2f} | {count(a, 'F2FP', 'HADD2', 'FMUL')} / "
                     f"{count(b, 'F2FP', 'HADD2', 'FMUL')} | {a['registers']} / {b['registers']} | "
                     f"{a['spills']} / {b['spills']} |")
    write_result("decode_product_sass", {**meta, "nf4": nf4, "nf4_kord": kord, "fp8": fp8}, lines)


if __name__ == "__main__":
    main()
