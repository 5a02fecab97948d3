"""How fast the FP8 decode attention's loads can stream, by value-store layout, on the GPU: the chunk kernel's
memory traffic alone (keys [T, D] as tiles of BLOCK positions; values as tiles [D, BLOCK]; one e4m3 tensor-core
product a tile, as the kernel feeds them, so the loads go through the same cp.async pipeline) without its softmax.

Layouts of a value store of T' positions and D dimensions (one head):
- ``minor``: position-minor [D, T'] (kv_quant.py's layout): a tile is D rows of BLOCK bytes, T' bytes apart;
- ``tiled``: [T' / VB, D, VB], VB positions a tile (a block of VB positions is one contiguous D × VB bytes);
- ``keys``: the values read like the keys, [T', D] (not a layout the product can use: the bound of contiguity).

    python benchmarks/value_layout_bandwidth.py                  # 16 x 8 heads x 16,384 positions, D = 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import card_tag, graph_seconds, run_meta, write_result  # noqa: E402

LAYOUTS = {"minor": 0, "tiled": 1, "keys": 2}


@triton.jit
def _stream_kernel(K, V, OUT, T, LAYOUT: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                   CHUNK: tl.constexpr, VB: tl.constexpr):
    """One program per (head sequence bh, chunk c): Σ over the chunk's tiles of k8 · 1 and v8 · 1 ([·, 16] e4m3
    products, as decode_kernel's), stored so that no load is dead."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    dims = tl.arange(0, D)
    pos = tl.arange(0, BLOCK)
    ones_d = tl.full([D, 16], 1.0, tl.float32).to(tl.float8e4nv)
    ones_t = tl.full([BLOCK, 16], 1.0, tl.float32).to(tl.float8e4nv)
    acc_k = tl.zeros([BLOCK, 16], tl.float32)
    acc_v = tl.zeros([D, 16], tl.float32)
    kbase = K + bh * T * D
    vbase = V + bh * T * D
    for off in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
        t = off + pos
        k = tl.load(kbase + t[:, None] * D + dims[None, :]).to(tl.float8e4nv, bitcast=True)  # [BLOCK, D]
        if LAYOUT == 0:
            v = tl.load(vbase + dims[:, None] * T + t[None, :])  # [D, BLOCK]
        elif LAYOUT == 1:
            v = tl.load(vbase + (off // VB) * (D * VB) + dims[:, None] * VB + (off % VB + pos)[None, :])
        else:
            v = tl.trans(tl.load(vbase + t[:, None] * D + dims[None, :]))
        acc_k = tl.dot(k, ones_d, acc_k)
        acc_v = tl.dot(v.to(tl.float8e4nv, bitcast=True), ones_t, acc_v)
    total = tl.sum(tl.sum(acc_k, 1), 0) + tl.sum(tl.sum(acc_v, 1), 0)
    tl.store(OUT + bh * tl.num_programs(1) + c, total)


def stream(k, v, layout: str, block: int, chunk: int, warps: int, stages: int, vb: int = 128) -> torch.Tensor:
    BH, T, D = k.shape
    out = torch.empty(BH, T // chunk, dtype=torch.float32, device=k.device)
    _stream_kernel[(BH, T // chunk)](k, v, out, T, LAYOUT=LAYOUTS[layout], D=D, BLOCK=block, CHUNK=chunk, VB=vb,
                                     num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=128, help="sequences × key heads")
    ap.add_argument("--positions", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    BH, T, D = args.heads, args.positions, args.dim
    codes = lambda: torch.randint(0, 0x7F, (BH, T, D), dtype=torch.uint8, device=dev)  # noqa: E731 (finite)
    k, v = codes(), codes()
    # every layout reads the same bytes: check the sums agree (the tiled and minor stores hold v's codes rearranged)
    minor = v.transpose(1, 2).contiguous()  # [BH, D, T]
    tiled = v.view(BH, T // 128, 128, D).transpose(2, 3).contiguous()  # [BH, T / 128, D, 128]
    stores = {"minor": minor, "tiled": tiled, "keys": v}
    rows = []
    mb = 2 * BH * T * D / 1e6
    for block, warps, stages in ((128, 4, 3), (128, 4, 4), (64, 4, 3), (64, 4, 5)):
        sums = {name: stream(k, store, name, block, args.chunk, warps, stages) for name, store in stores.items()}
        agree = all(torch.allclose(s, sums["keys"]) for s in sums.values())
        row = dict(block=block, warps=warps, stages=stages, sums_agree=agree)
        for name, store in stores.items():
            us = graph_seconds(lambda: stream(k, store, name, block, args.chunk, warps, stages)) * 1e6
            row[f"{name}_us"], row[f"{name}_tb_s"] = us, mb / us  # MB / µs = TB/s
        rows.append(row)
    meta = run_meta(heads=BH, positions=T, dim=D, chunk=args.chunk)
    lines = [f"# FP8 decode attention's loads alone, by value layout, {meta['gpu']}", "",
             f"{meta['date']}; torch {meta['torch']}.  ", f"`{meta['command']}`", "",
             f"{BH} head sequences × {T:,} positions × D {D}: {mb:,.0f} MB of key and value codes, chunks of "
             f"{args.chunk} positions ({BH * T // args.chunk} programs), one e4m3 product a tile.", "",
             "| block | warps | stages | position-minor µs (TB/s) | tiled [T'/128, D, 128] µs (TB/s) | "
             "as keys [T', D] µs (TB/s) | sums agree |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = " | ".join(f"{r[n + '_us']:.1f} ({r[n + '_tb_s']:.2f})" for n in stores)
        lines.append(f"| {r['block']} | {r['warps']} | {r['stages']} | {cells} | {r['sums_agree']} |")
    write_result(f"value_layout_bandwidth_{card_tag()}{args.tag}", dict(meta=meta, rows=rows), lines)


if __name__ == "__main__":
    main()
