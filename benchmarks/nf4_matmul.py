"""The decode-step products of an NF4 (QLoRA) base: bitsandbytes' path (dequantize the whole weight, then a bf16
product) against longrl's kernel that reads the 4-bit weight directly (src/longrl/ops/nf4_matmul.py), and the
bf16 weight's own product, on the Llama-3.1-8B projection shapes; then the packed decode's groups (q/k/v + A,
o + A, gate/up + A, down + A, as rollout/fast_decode.py runs them) under each launch choice of a sweep, against the
bf16 packed product of the same group.

Bytes a call must read: bf16 weight 2 B/param; NF4 0.5 B/param + a float32 scale per 64 (0.0625 B/param);
bitsandbytes' batched path moves ~4.5 B/param (reads 4 bits, writes and reads back 16). GB/s below count the
kernel's own floor bytes (0.5625 B/param for NF4, 2 for bf16) over the time. Every time is GPU time per call
replayed from a CUDA graph of 20 calls (as a captured decode step runs them: no host launch cost).

    python benchmarks/nf4_matmul.py            # the table
    python benchmarks/nf4_matmul.py --sweep    # and the groups' sweep; its fastest choice per row count goes to
                                               # results/nf4_matmul_h200.json "best" (rollout_speed.py --nf4-launch)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from results_io import copy_bandwidth, graph_seconds, run_meta, write_result  # noqa: E402

from longrl.ops import nf4_matmul as nm  # noqa: E402

SHAPES = {"q/o 4096x4096": (4096, 4096), "k/v 1024x4096": (1024, 4096), "gate/up 14336x4096": (14336, 4096),
          "down 4096x14336": (4096, 14336)}
# the packed decode's groups of one Llama-3.1-8B layer at LoRA r = 32: (NF4 weights' rows, A rows, K)
GROUPS = {"q/k/v + A": ((4096, 1024, 1024), 96, 4096), "o + A": ((4096,), 32, 4096),
          "gate/up + A": ((14336, 14336), 64, 4096), "down + A": ((4096,), 32, 14336)}
DECODE_ROWS = (16, 128)
SWEEP_ROWS = (128, 16)  # the rollout's first
TRAIN_ROWS = (2048,)  # training-side products (a micro-batch's tokens): bitsandbytes keeps these


def quantized(N: int, K: int, dev, seed: int = 0):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    torch.manual_seed(seed)
    W = torch.randn(N, K, dtype=torch.bfloat16, device=dev) * 0.02
    packed, state = bnbf.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=True)
    return bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, quant_type="nf4", blocksize=64,
                             bnb_quantized=True)


def sweep_choices(M: int) -> list[dict]:
    """Launch choices tried at M rows (where the rollout benchmark runs: 128 rows; and 16)."""
    def c(bn, w, st, lut=3, swap=True):
        return dict(bn=bn, swap=swap, join=True, lut=lut, warps=w, stages=st, programs=264)

    if M >= 128:
        return [c(128, 8, 2), c(128, 4, 2), c(64, 4, 2), c(64, 8, 2), c(128, 8, 3), c(128, 8, 2, lut=1)]
    return [c(128, 4, 3), c(64, 4, 3), c(128, 4, 3, lut=1)]


def table(dev, bw: float) -> list[dict]:
    import bitsandbytes as bnb

    rows = []
    for name, (N, K) in SHAPES.items():
        param = quantized(N, K, dev)
        state = param.quant_state
        ops = nm.nf4_operands(param)
        group = nm.nf4_group([param])
        Wd = nm.dequantize_nf4(*ops, torch.bfloat16)
        for M in DECODE_ROWS + TRAIN_ROWS:
            x = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
            want = bnb.matmul_4bit(x, param.t(), quant_state=state)
            got = nm.nf4_group_linear(x, group)
            err = float(((got.float() - want.float()).abs() / (want.float().abs() + 1e-2)).max())
            t_bnb = graph_seconds(lambda: bnb.matmul_4bit(x, param.t(), quant_state=state))
            t_nf4 = graph_seconds(lambda: nm.nf4_group_linear(x, group))
            t_bf16 = graph_seconds(lambda: torch.nn.functional.linear(x, Wd))
            nf4_bytes, bf16_bytes = N * K * (0.5 + 4 / 64), N * K * 2
            rows.append(dict(shape=name, M=M, bnb_us=t_bnb * 1e6, nf4_us=t_nf4 * 1e6, bf16_us=t_bf16 * 1e6,
                             nf4_gbs=nf4_bytes / t_nf4 / 1e9, bf16_gbs=bf16_bytes / t_bf16 / 1e9,
                             max_rel_err_vs_bnb=err))
            print(rows[-1], flush=True)
    return rows


def sweep(dev) -> tuple[list[dict], dict]:
    """Every group at each decode row count under each launch choice; the choice with the least summed time of a
    layer's four groups per row count ('best')."""
    groups = {}
    for name, (ns, r, K) in GROUPS.items():
        params = [quantized(n, K, dev, seed=i) for i, n in enumerate(ns)]
        a = torch.randn(r, K, dtype=torch.bfloat16, device=dev) * 0.02
        g = nm.nf4_group(params, a)
        groups[name] = (g, nm.nf4_group_weight(g, torch.bfloat16))
    rows, best = [], {}
    for M in SWEEP_ROWS:
        xs = {name: torch.randn(M, g.K, dtype=torch.bfloat16, device=dev) for name, (g, _) in groups.items()}
        bf16 = {name: graph_seconds(lambda: torch.nn.functional.linear(xs[name], W)) for name, (_, W) in groups.items()}
        choices = sweep_choices(M)
        totals = []
        for cfg in choices:
            try:
                per = {}
                for name, (g, W) in groups.items():
                    got = nm.nf4_group_linear(xs[name], g, launch=cfg).float()
                    want = torch.nn.functional.linear(xs[name].float(), W.float())
                    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
                        raise RuntimeError(f"{name}: result off by {float((got - want).abs().max()):.3g}")
                    per[name] = graph_seconds(lambda: nm.nf4_group_linear(xs[name], g, launch=cfg))
            except Exception as e:  # a launch choice that fails to build or is wrong is reported, not hidden
                rows.append(dict(M=M, **cfg, error=f"{type(e).__name__}: {e}"[:200]))
                print(rows[-1], flush=True)
                continue
            total = sum(per.values())
            totals.append((total, cfg))
            rows.append(dict(M=M, **cfg, us={k: v * 1e6 for k, v in per.items()}, layer_us=total * 1e6,
                             bf16_us={k: v * 1e6 for k, v in bf16.items()}, bf16_layer_us=sum(bf16.values()) * 1e6))
            print(rows[-1], flush=True)
        if not totals:
            continue
        top = min(totals, key=lambda t: t[0])[1]
        for programs in (132, 396, 528):  # the K split's target, for the fastest build
            cfg = {**top, "programs": programs}
            per = {name: graph_seconds(lambda: nm.nf4_group_linear(xs[name], g, launch=cfg))
                   for name, (g, _) in groups.items()}
            totals.append((sum(per.values()), cfg))
            rows.append(dict(M=M, **cfg, us={k: v * 1e6 for k, v in per.items()}, layer_us=sum(per.values()) * 1e6,
                             bf16_us={k: v * 1e6 for k, v in bf16.items()}, bf16_layer_us=sum(bf16.values()) * 1e6))
            print(rows[-1], flush=True)
        best[M] = min(totals, key=lambda t: t[0])[1]
    return rows, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="also time the packed decode's groups under launch choices")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("nf4_matmul.py times CUDA kernels; no GPU here")
    import bitsandbytes

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    sweep_rows, best = sweep(dev) if args.sweep else ([], {})
    if best:  # each bucket takes the fastest choice of the nearest swept row count at or above it
        nm.LAUNCH.update({b: best[min((m for m in best if m >= b), default=max(best))] for b in nm.LAUNCH})
        write_result("nf4_matmul_h200_sweep", {"best": {str(b): c for b, c in nm.LAUNCH.items()}, "sweep": sweep_rows},
                     [f"NF4 launch sweep (fastest per row count): {best}"])  # (rollout_speed --nf4-launch, at once)
    rows = table(dev, bw)
    meta = run_meta(copy_bandwidth_gbs=bw / 1e9, bitsandbytes=bitsandbytes.__version__, launch=dict(nm.LAUNCH))
    lines = [f"# NF4 decode product: bitsandbytes vs longrl's 4-bit kernel vs bf16, {meta['gpu']}", "",
             f"{meta['date']}; torch {meta['torch']}, bitsandbytes {meta['bitsandbytes']}.  ", f"`{meta['command']}`",
             "", f"Copy bandwidth {bw / 1e9:,.0f} GB/s. GPU time a call from CUDA graphs of 20 calls. GB/s: floor bytes "
             "(NF4 0.5625 B/param, bf16 2 B/param) / time. longrl's launch table (LAUNCH, after the sweep): "
             f"{meta['launch']}.", "",
             "| weight | rows | bitsandbytes µs | longrl NF4 µs | bf16 µs | NF4 GB/s | bf16 GB/s | × bitsandbytes "
             "| × bf16 | max rel err vs bnb |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['M']} | {r['bnb_us']:.1f} | {r['nf4_us']:.1f} | {r['bf16_us']:.1f} | "
                     f"{r['nf4_gbs']:,.0f} | {r['bf16_gbs']:,.0f} | {r['bnb_us'] / r['nf4_us']:.2f} | "
                     f"{r['bf16_us'] / r['nf4_us']:.2f} | {r['max_rel_err_vs_bnb']:.4f} |")
    if sweep_rows:
        names = list(GROUPS)
        lines += ["", "## The packed decode's groups (one 8B layer, LoRA r = 32), launch sweep", "",
                  "µs a call; 'layer' is the four groups' sum (bf16: the same groups as bf16 packed products, "
                  "rollout/fast_decode.py's 16-bit path). Fastest per row count: " +
                  ", ".join(f"{m} rows {c}" for m, c in best.items()) + ".", "",
                  "| rows | bn | lut | warps | stages | programs | " + " | ".join(names) +
                  " | layer µs | bf16 layer µs | × bf16 |", "|---" * (9 + len(names)) + "|"]
        for r in sweep_rows:
            head = f"| {r['M']} | {r['bn']} | {r['lut']} | {r['warps']} | {r['stages']} | {r['programs']} | "
            if "error" in r:
                lines.append(head + f"failed: {r['error']} |" + " |" * (len(names) + 2))
                continue
            lines.append(head + " | ".join(f"{r['us'][n]:.1f}" for n in names) +
                         f" | {r['layer_us']:.1f} | {r['bf16_layer_us']:.1f} | "
                         f"{r['bf16_layer_us'] / r['layer_us']:.2f} |")
    write_result("nf4_matmul_h200", {**meta, "rows": rows, "sweep": sweep_rows,
                                     "best": {str(m): c for m, c in best.items()}}, lines)


if __name__ == "__main__":
    main()
