"""Decode glue kernels on the GPU: SiLU·up and the rotary/KV-store kernel, plain and with the packed decode's LoRA
fold (rollout/fused_ops.py), at the decode shapes of the rollout benchmarks, CUDA-graph timed; a sweep of the
LoRA-folding SiLU·up kernel's launch choices (fused_ops.LAUNCH), each checked against its PyTorch twin.

    python benchmarks/decode_glue_speed.py [--tag _x]     # → results/decode_glue_h200<tag>.{md,json}

Inputs are laid out as the packed decode has them: gate/up (q/k/v) and the adapters' A x are column blocks of one
product's output [rows, Σ out + Σ r], so every kernel reads strided rows.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from results_io import card_tag, graph_seconds, run_meta, write_result  # noqa: E402

from longrl.rollout import fused_ops  # noqa: E402

# (name, rows, intermediate, query heads, key/value heads, head dim); LoRA rank 32 as in rollout_speed
SHAPES = [("llama-3.1-8b 16x8", 128, 14336, 32, 8, 128), ("qwen2.5-1.5b 64x8", 512, 8960, 12, 2, 128)]
RANK = 32
SWEEP = [dict(silu_lora_bm=bm, silu_lora_bn=bn, silu_lora_warps=w)
         for bm, bn, w in itertools.product((16, 32, 64, 128), (32, 64, 128, 256), (4, 8))]


def silu_inputs(rows: int, width: int, dev):
    """gate, up and A x as column blocks of one [rows, 2·width + 2r] product, and the fold's (s B)ᵀ."""
    y = torch.randn(rows, 2 * width + 2 * RANK, device=dev).to(torch.bfloat16)
    b_t = tuple((0.05 * torch.randn(RANK, width, device=dev)).to(torch.bfloat16) for _ in range(2))
    fold = fused_ops.LoraFold(y[:, 2 * width:], (0, RANK), b_t, RANK)
    return y[:, :width], y[:, width:2 * width], fold


def rotary_inputs(rows: int, hq: int, hkv: int, D: int, dev, T: int = 1024):
    width = (hq + 2 * hkv) * D
    y = torch.randn(rows, width + 3 * RANK, device=dev).to(torch.bfloat16)
    q, k, v = y[:, :hq * D], y[:, hq * D:(hq + hkv) * D], y[:, (hq + hkv) * D:width]
    b_t = tuple((0.05 * torch.randn(RANK, n, device=dev)).to(torch.bfloat16) for n in (hq * D, hkv * D, hkv * D))
    fold = fused_ops.LoraFold(y[:, width:], (0, RANK, 2 * RANK), b_t, RANK)
    angle = torch.rand(rows, D, device=dev) * 6.3
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    caches = [torch.zeros(rows, hkv, T, D, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    widx = torch.randint(0, T, (rows,), device=dev)
    return (q, k, v, cos, sin, *caches, widx), fold


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    default = dict(fused_ops.LAUNCH)
    payload = run_meta(default_launch=default, rank=RANK, shapes={}, best={})
    lines = [f"# Decode glue kernels, bf16, LoRA rank {RANK}, {payload['gpu']}", "",
             f"{payload['date']}; torch {payload['torch']}.  ", f"`{payload['command']}`", "",
             "GPU µs a call, replayed from CUDA graphs; inputs as column blocks of one packed product's output. "
             "max err: against the PyTorch twin, in units of the output's bf16 spacing at 1.0 (0.0078).", "",
             "| shape | kernel | µs | max err |", "|---|---|---|---|"]
    for name, rows, inter, hq, hkv, D in SHAPES:
        gate, up, fold = silu_inputs(rows, inter, dev)
        want = fused_ops.decode_silu_mul_reference(gate, up, fold).float()
        rotary_args, rfold = rotary_inputs(rows, hq, hkv, D, dev)
        cases = {
            "silu_mul": (lambda: fused_ops.decode_silu_mul(gate, up, True), None),
            "silu_mul + LoRA fold": (lambda: fused_ops.decode_silu_mul(gate, up, True, lora=fold), want),
            "rotary_kv": (lambda: fused_ops.rotary_kv(*rotary_args, True), None),
            "rotary_kv + LoRA fold": (lambda: fused_ops.rotary_kv(*rotary_args, True, lora=rfold),
                                      fused_ops.rotary_kv_reference(*rotary_args, lora=rfold).float()),
        }
        shape_rows = {}
        for kname, (fn, ref) in cases.items():
            err = float((fn().float() - ref).abs().max()) / 2 ** -7 if ref is not None else float("nan")
            us = graph_seconds(fn) * 1e6
            shape_rows[kname] = dict(us=us, err_units=err)
            lines.append(f"| {name} | {kname} | {us:.1f} | {err:.1f} |")
        sweep = []
        for launch in SWEEP:
            fused_ops.LAUNCH.update(launch)
            try:
                err = float((fused_ops.decode_silu_mul(gate, up, True, lora=fold).float() - want).abs().max()) / 2 ** -7
                us = graph_seconds(lambda: fused_ops.decode_silu_mul(gate, up, True, lora=fold)) * 1e6
                sweep.append({**launch, "us": us, "err_units": err})
            except Exception as e:  # noqa: BLE001 - a launch choice that does not build is skipped, and said
                sweep.append({**launch, "error": f"{type(e).__name__}: {str(e)[:80]}"})
        fused_ops.LAUNCH.update(default)
        timed = sorted((r for r in sweep if "us" in r), key=lambda r: r["us"])
        payload["shapes"][name] = dict(kernels=shape_rows, sweep=sweep)
        payload["best"][name] = {k: timed[0][k] for k in default}
        lines += ["", f"SiLU·up + LoRA fold launch choices at {name} (rows {rows}, width {inter}), fastest first "
                  f"(default {default}):", "", "| tile rows | tile columns | warps | µs | max err |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['silu_lora_bm']} | {r['silu_lora_bn']} | {r['silu_lora_warps']} | {r['us']:.1f} | "
                  f"{r['err_units']:.1f} |" for r in timed[:12]]
        lines += [f"| {r['silu_lora_bm']} | {r['silu_lora_bn']} | {r['silu_lora_warps']} | {r['error']} | |"
                  for r in sweep if "error" in r]
        lines += ["", "| shape | kernel | µs | max err |", "|---|---|---|---|"]
    write_result(f"decode_glue_{card_tag()}{args.tag}", payload, lines[:-3])


if __name__ == "__main__":
    main()
