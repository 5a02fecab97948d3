"""The decode step's LM-head product three ways, to pick the fastest layout for the sampler's batch sizes.

A decode step multiplies B final hidden states [B, d] by the head [V, d]: memory-bound (the head is read once),
so its floor is V·d·2 bytes / bandwidth. Compared here, each as the median of 50 timed calls after warm-ups:
``F.linear(h, W)`` (what the sampler does), ``(W @ hᵀ)ᵀ`` (the tall-skinny layout), and F.linear over vocabulary
chunks; all bf16 with float32 accumulation, results checked equal to within bf16 rounding. (The first 8B results,
lm_head_gemm_v128256_d4096.md, were the mean of 50 back-to-back calls; F.linear was at the floor.)

    python benchmarks/lm_head_gemm.py --vocab 128256 --hidden 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import gpu_seconds, run_meta, write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batches", default="16,32,64,128,256,512")
    ap.add_argument("--chunk", type=int, default=16384)
    args = ap.parse_args()
    dev = torch.device("cuda")
    w = torch.randn(args.vocab, args.hidden, device=dev, dtype=torch.bfloat16) * 0.02
    floor = w.numel() * 2 / 4.2e12  # seconds at ~4.2 TB/s (the H200's measured copy bandwidth)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        h = torch.randn(b, args.hidden, device=dev, dtype=torch.bfloat16)
        ways = {"linear": lambda: F.linear(h, w), "W·hT": lambda: (w @ h.t()).t(),
                "chunked": lambda: torch.cat([F.linear(h, w[i:i + args.chunk])
                                              for i in range(0, args.vocab, args.chunk)], dim=1)}
        ref = ways["linear"]().float()
        row = {"batch": b}
        for name, fn in ways.items():
            err = float((fn().float() - ref).abs().max())
            row[name] = gpu_seconds(fn)
            row[f"{name}_max_abs_diff"] = err
        rows.append(row)
        print(row, flush=True)
    meta = run_meta(vocab=args.vocab, hidden=args.hidden)
    lines = [f"# LM-head product layouts, V={args.vocab}, d={args.hidden}, bf16, {meta['gpu']}", "",
             f"{meta['date']}; torch {meta['torch']}.  ", f"`{meta['command']}`", "",
             f"Floor (head bytes / 4.2 TB/s): {floor * 1e3:.3f} ms.", "",
             "| batch | F.linear ms | (W·hᵀ)ᵀ ms | chunked ms |", "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['linear'] * 1e3:.3f} | {r['W·hT'] * 1e3:.3f} | {r['chunked'] * 1e3:.3f} |"
              for r in rows]
    write_result(f"lm_head_gemm_v{args.vocab}_d{args.hidden}", {**meta, "rows": rows}, lines)


if __name__ == "__main__":
    main()
