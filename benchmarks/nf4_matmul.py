"""The decode-step product of an NF4 (QLoRA) base: bitsandbytes' path (dequantize the whole weight, then a bf16
product) against longrl's kernel that reads the 4-bit weight directly (src/longrl/ops/nf4_matmul.py), and the
bf16 weight's own product, at decode batch sizes on the Llama-3.1-8B projection shapes.

Bytes a call must read: bf16 weight 2 B/param; NF4 0.5 B/param + a float32 scale per 64 (0.0625 B/param);
bitsandbytes' batched path moves ~4.5 B/param (reads 4 bits, writes and reads back 16). GB/s below count the
kernel's own floor bytes (0.5625 B/param for NF4, 2 for bf16) over the time.

    python benchmarks/nf4_matmul.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from results_io import copy_bandwidth, gpu_seconds, run_meta, write_result  # noqa: E402

from longrl.ops.nf4_matmul import nf4_linear, nf4_operands  # noqa: E402

SHAPES = {"q/o 4096x4096": (4096, 4096), "k/v 1024x4096": (1024, 4096), "gate/up 14336x4096": (14336, 4096),
          "down 4096x14336": (4096, 14336)}


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("nf4_matmul.py times CUDA kernels; no GPU here")
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    rows = []
    for name, (N, K) in SHAPES.items():
        torch.manual_seed(0)
        W = torch.randn(N, K, dtype=torch.bfloat16, device=dev) * 0.02
        packed, state = bnbf.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=True)
        param = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, quant_type="nf4", blocksize=64)
        ops = nf4_operands(param)
        Wd = bnbf.dequantize_4bit(packed, state)
        for M in (16, 32, 64, 128):
            x = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
            want = bnb.matmul_4bit(x, param.t(), quant_state=state)
            got = nf4_linear(x, *ops)
            err = float(((got.float() - want.float()).abs() / (want.float().abs() + 1e-2)).max())
            t_bnb = gpu_seconds(lambda: bnb.matmul_4bit(x, param.t(), quant_state=state))
            t_nf4 = gpu_seconds(lambda: nf4_linear(x, *ops))
            t_bf16 = gpu_seconds(lambda: torch.nn.functional.linear(x, Wd))
            nf4_bytes, bf16_bytes = N * K * (0.5 + 4 / 64), N * K * 2
            rows.append(dict(shape=name, M=M, bnb_us=t_bnb * 1e6, nf4_us=t_nf4 * 1e6, bf16_us=t_bf16 * 1e6,
                             nf4_gbs=nf4_bytes / t_nf4 / 1e9, bf16_gbs=bf16_bytes / t_bf16 / 1e9,
                             max_rel_err_vs_bnb=err))
            print(rows[-1], flush=True)
    meta = run_meta(copy_bandwidth_gbs=bw / 1e9)
    lines = [f"# NF4 decode product: bitsandbytes vs longrl's 4-bit kernel vs bf16, {meta['gpu']}", "",
             f"{meta['date']}; torch {meta['torch']}.  ", f"`{meta['command']}`", "",
             f"Copy bandwidth {bw / 1e9:,.0f} GB/s. GB/s: floor bytes (NF4 0.5625 B/param, bf16 2 B/param) / time.",
             "", "| weight | rows | bitsandbytes µs | longrl NF4 µs | bf16 µs | NF4 GB/s | bf16 GB/s | "
             "× bitsandbytes | max rel err |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['M']} | {r['bnb_us']:.1f} | {r['nf4_us']:.1f} | {r['bf16_us']:.1f} | "
                     f"{r['nf4_gbs']:,.0f} | {r['bf16_gbs']:,.0f} | {r['bnb_us'] / r['nf4_us']:.2f} | "
                     f"{r['max_rel_err_vs_bnb']:.4f} |")
    write_result("nf4_matmul_h200", {**meta, "rows": rows}, lines)


if __name__ == "__main__":
    main()
