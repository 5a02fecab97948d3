"""Rollout speed by base, rows, context and KV cache, in one run: the table of issue 43's measurement.

For each base (bf16, NF4 with longrl's 4-bit decode product, FP8 with its e4m3 decode product; each built when the
previous one is dropped, every decoder projection quantized, LoRA r = 32 unmerged), each prompt length C, each
number of rows R (R / G prompts of C random tokens, G = 8 completions each) and each KV cache dtype: longrl's
sampler (rollout_speed.run_longrl: a warm-up call, then prefill + first token, then the timed call of N new tokens).
Reports tokens/s, the decode phase's bandwidth against the GPU's copy bandwidth (weights and their scales read
once a step, plus every live KV byte: each prompt's prefix once, as the grouped kernel reads it; an FP8 cache's
bytes are its codes and exponents), and each quantized base's tokens/s over the bf16 base's in the same cell.
A cell whose KV cache cannot fit the GPU is reported as such (the sampler's own refusal), not skipped silently.

    python benchmarks/rollout_matrix.py                       # GPU: the whole table (~10 min on an H200)
    python benchmarks/rollout_matrix.py --bases bf16,fp8 --rows 8,32 --contexts 1024 --kv bf16
    python benchmarks/rollout_matrix.py --bases bf16,nf4 --nf4-launch benchmarks/results/nf4_matmul_h100_sweep.json
    python benchmarks/rollout_matrix.py --smoke               # CPU, tiny shape: the program runs; nothing written

The table is rewritten after every cell, so a run cut off by a time limit leaves the cells it finished (its header
says how many of how many). A log of such a run (the cells it printed) makes the table afterwards:

    python benchmarks/rollout_matrix.py --from-log matrix.log --log-meta '{"gpu": "NVIDIA H100 80GB HBM3"}' --tag _cut
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import rollout_speed as rs  # noqa: E402
from bench_setup import bench_lora, random_model, random_prompts  # noqa: E402
from results_io import card_tag, copy_bandwidth, run_meta, write_result  # noqa: E402

from longrl.models import apply_lora  # noqa: E402

G = 8
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def build(base: str, shape: str, dev):
    """(model with LoRA, bytes a decode step reads of its weights and scales) for ``base``."""
    if base == "bf16":
        model = apply_lora(random_model(shape, dev), bench_lora())
        model.config.use_cache = True
        extra = 0
    else:
        model = rs.quantized_model(base, shape, dev)
        extra = rs.nf4_state_bytes(model) if base == "nf4" else rs.fp8_scale_bytes(model)
    return model, rs.model_bytes(model)[0] + extra


VARIANTS = ("nf4h", "nf4m", "nf4t")  # NF4 ways measured beside nf4 on its model
MMA_CHOICE: dict | None = None  # nf4m's launch at up to 8 rows (--mma-launch)
NF4T_TABLE: dict = {}  # nf4t's launch table by rows (--nf4t-launch)


def mma_choice(spec: str) -> dict:
    """--mma-launch: a JSON launch entry, or a benchmarks/nf4_matmul.py --sweep --mma result whose fastest at 8 rows
    is taken where it is the CUDA kernel's (else, and by default, nf4_matmul.MMA_LAUNCH)."""
    from longrl.ops import nf4_matmul

    if spec.lstrip().startswith("{"):
        return json.loads(spec)
    best = json.loads(Path(spec).read_text()).get("best", {}).get("8") if spec else None
    return best if best and best.get("mma") else dict(nf4_matmul.MMA_LAUNCH)


def cell(model, base: str, step_bytes: int, rows: int, context: int, kv: str, N: int, bandwidth: float) -> dict:
    """One measurement: tokens/s and the decode roofline fraction (rollout_speed.derive's arithmetic). Base nf4h:
    the NF4 model with its codes in the halves layout during a call (Sampler(nf4_halves=True)); nf4: in
    bitsandbytes' order (the sampler's default); nf4m: nf4 with the products of up to 8 rows on the CUDA kernel
    (ops/nf4_mma.py, nf4_matmul.MMA_LAUNCH); nf4t: nf4 on another launch table (--nf4t-launch). (Results of
    2026-12-06 before this change name the halves nf4 and bitsandbytes' order nf4k.)"""
    prompts = random_prompts(max(1, rows // G), context, model.config.vocab_size)
    out = dict(base=base, rows=len(prompts) * G, context=context, kv=kv)
    from longrl.ops import nf4_matmul

    table = dict(nf4_matmul.LAUNCH)
    if base == "nf4m":  # the few-row CUDA kernel (ops/nf4_mma.py) at up to 8 rows, its fastest choice
        nf4_matmul.LAUNCH.update(nf4_matmul.with_mma(table, launch=MMA_CHOICE))
    if base == "nf4t":
        nf4_matmul.LAUNCH.update(NF4T_TABLE)
    try:
        r = rs.run_longrl(model, prompts, G, N, nf4_kernel=base.startswith("nf4"), fp8_kernel=base == "fp8",
                          kv_cache_dtype=kv, nf4_halves=base == "nf4h")
    except Exception as e:  # noqa: BLE001 - a cell that cannot run (KV cache too large) is a result
        return {**out, "error": f"{type(e).__name__}: {e}"[:240]}
    finally:
        nf4_matmul.LAUNCH.clear()
        nf4_matmul.LAUNCH.update(table)
    results = {"copy_bandwidth_gbs": bandwidth / 1e9, "cell": {**r, "step_weight_bytes": step_bytes}}
    try:
        rs.derive(results, len(prompts) * G, N, context, rs.kv_token_bytes(model.config, KV_DTYPES[kv]),
                  len(prompts))
    except RuntimeError as e:  # timings that cannot be compared (rollout_speed.derive says why): the cell's result
        return {**out, "error": str(e)[:240]}
    r = results["cell"]
    # the timed call's fixed host costs (Sampler.last_stats): set-up and undoing, and its CUDA-graph captures; the
    # same for the one-token call that prices the prefill
    fixed = {"setup_s": r["stats"]["prepare_s"] + r["stats"]["release_s"],
             "capture_s": r["stats"].get("graph_capture_s", 0.0), "captures": r["stats"].get("graph_captures", 0),
             "prefill_setup_s": r["prefill_stats"]["prepare_s"] + r["prefill_stats"]["release_s"],
             "prefill_capture_s": r["prefill_stats"].get("graph_capture_s", 0.0)}
    return {**out, **fixed, **{k: r[k] for k in ("seconds", "prefill_s", "tokens_per_s", "peak_gib", "kv_gib")},
            **({k: r[k] for k in ("decode_bandwidth_gbs", "roofline_fraction")} if "roofline_fraction" in r else {})}


def report(meta: dict, rows: list[dict], args) -> list[str]:
    lines = ["# Rollout speed by base, rows, context and KV cache", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; {meta['gpu']}; torch {meta['torch']}, "
             f"transformers {meta['transformers']}; {meta['seconds']} s in all; copy bandwidth "
             f"{meta['copy_bandwidth_gbs']:.0f} GB/s; cells {meta.get('cells', '?')}.", "",
             f"{args.shape}, random weights, LoRA r = 32 unmerged, G = {G}, {args.new_tokens} new tokens a sequence "
             "after a prompt of `context` tokens; × bf16: the base's tokens/s over the bf16 base's in the same cell."
             + (f" NF4 launch table: {meta['nf4_launch']}." if "nf4" in args.bases and meta.get("nf4_launch") else "")
             + (f" FP8 launch table: {meta['fp8_launch']}." if "fp8" in args.bases and meta.get("fp8_launch") else "")
             + (f" nf4m at up to 8 rows: {meta['mma_launch']}." if "nf4m" in args.bases and meta.get("mma_launch")
                else "")
             + (f" nf4t's launch table: {meta['nf4t_launch']}." if "nf4t" in args.bases else "")
             + (f" Decode attention launch choices over decode_kernel.LAUNCH: {meta['attention_launch']}."
                if meta.get("attention_launch") else "")
             + " Call: the timed call's seconds; of them set-up (the model set up for the call and undone: "
             "Sampler.last_stats prepare_s + release_s) and graphs (its CUDA-graph captures' host seconds); prefill: "
             "a one-token call's seconds (its own set-up included).",
             "", "| base | KV cache | context | rows | tokens/s | × bf16 | decode GB/s | of roofline | peak GiB | "
             "call s | set-up s | graphs s | prefill s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    bf16 = {(r["kv"], r["context"], r["rows"]): r.get("tokens_per_s") for r in rows if r["base"] == "bf16"}
    for r in sorted(rows, key=lambda r: (r["kv"], r["context"], r["rows"], args.bases.index(r["base"]))):
        if "error" in r:
            lines.append(f"| {r['base']} | {r['kv']} | {r['context']:,} | {r['rows']} | – | – | – | – | "
                         f"{r['error'][:90]} | – | – | – | – |")
            continue
        ref = bf16.get((r["kv"], r["context"], r["rows"]))
        ratio = f"{r['tokens_per_s'] / ref:.2f}×" if ref else "–"
        frac = (f"{r['decode_bandwidth_gbs']:,.0f} | {100 * r['roofline_fraction']:.0f}%"
                if "roofline_fraction" in r else "– | –")
        fixed = (f"{r['seconds']:.3f} | {r['setup_s']:.3f} | {r['capture_s']:.3f} | {r['prefill_s']:.3f}"
                 if "setup_s" in r else f"{r['seconds']:.3f} | – | – | {r['prefill_s']:.3f}")  # older logs: no set-up
        lines.append(f"| {r['base']} | {r['kv']} | {r['context']:,} | {r['rows']} | {r['tokens_per_s']:,.0f} | "
                     f"{ratio} | {frac} | {r['peak_gib']:.2f} | {fixed} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--bases", default="bf16,nf4,fp8", help="bf16, nf4 (the sampler's default: codes in "
                    "bitsandbytes' order), nf4h (NF4 in the halves layout during a call; measured beside nf4's cell on "
                    "the same model: name nf4 too), nf4m (nf4 with the few-row CUDA kernel, ops/nf4_mma.py, up to 8 "
                    "rows; likewise), nf4t (nf4 on --nf4t-launch's table; likewise), fp8")
    ap.add_argument("--rows", default="8,32,128")
    ap.add_argument("--contexts", default="1024,16384")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--tag", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape and sizes: the program runs; writes nothing")
    ap.add_argument("--from-log", default="", metavar="PATH",
                    help="write the table of the cells a run printed (its log), without measuring")
    ap.add_argument("--log-meta", default="{}", metavar="JSON",
                    help="with --from-log: what the log does not say (date, gpu, torch, transformers, command)")
    ap.add_argument("--nf4-launch", default="", metavar="JSON|PATH",
                    help="the NF4 product's launch table (rollout_speed.py's option: a JSON object or a "
                    "benchmarks/nf4_matmul.py --sweep result whose 'best' is taken)")
    ap.add_argument("--fp8-launch", default="", metavar="JSON|PATH", help="the FP8 product's, likewise")
    ap.add_argument("--mma-launch", default="", metavar="JSON|PATH",
                    help="nf4m's launch at up to 8 rows: a JSON entry or a benchmarks/nf4_matmul.py --sweep --mma "
                    "result whose fastest at 8 rows is taken where it is the CUDA kernel's (default "
                    "nf4_matmul.MMA_LAUNCH)")
    ap.add_argument("--nf4t-launch", default="", metavar="JSON|PATH",
                    help="nf4t's launch table (as --nf4-launch; nf4 keeps the other), e.g. a sweep's result beside "
                    "today's table in one run")
    ap.add_argument("--attention-launch", default="", metavar="JSON|PATH",
                    help="decode attention launch choices for every cell (rollout_speed.py's --launch: "
                    "decode_kernel.LAUNCH entries as JSON, e.g. '{\"counters\": true}', or a "
                    "benchmarks/decode_attention_speed.py --sweep result whose fastest row is taken)")
    args = ap.parse_args()
    global MMA_CHOICE
    MMA_CHOICE = mma_choice(args.mma_launch)
    NF4T_TABLE.update(rs.launch_table(args.nf4t_launch))
    if args.from_log:
        return table_from_log(args)
    rs.use_product_launches(args.nf4_launch, args.fp8_launch)
    attention_launch = rs.launch_overrides(args.attention_launch, "--attention-launch") if args.attention_launch else {}
    if attention_launch:
        from longrl.rollout import decode_kernel

        decode_kernel.LAUNCH.update(attention_launch)
    if args.smoke:
        args.shape, args.bases, args.rows, args.contexts, args.kv, args.new_tokens = "tiny", "bf16,fp8", "8", "16", \
            "bf16,fp8", 4
    args.bases = args.bases.split(",")
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    bandwidth = copy_bandwidth(dev) if dev.type == "cuda" else float("nan")
    kvs, contexts, row_counts = args.kv.split(","), [int(c) for c in args.contexts.split(",")], \
        [int(r) for r in args.rows.split(",")]
    cells = len(args.bases) * len(kvs) * len(contexts) * len(row_counts)
    stem = f"rollout_matrix_{args.shape}_{card_tag()}{args.tag}"
    t0, rows = time.perf_counter(), []
    for base in (b for b in args.bases if b not in VARIANTS):  # (the NF4 variants: beside nf4, on its model)
        model, step_bytes = build(base, args.shape, dev)
        for kv in kvs:
            for context in contexts:
                for n in row_counts:
                    for variant in [base] + [v for v in VARIANTS if base == "nf4" and v in args.bases]:
                        rows.append(cell(model, variant, step_bytes, n, context, kv, args.new_tokens, bandwidth))
                        print({k: v for k, v in rows[-1].items()}, flush=True)
                    meta = run_meta(seconds=round(time.perf_counter() - t0), copy_bandwidth_gbs=bandwidth / 1e9,
                                    cells=f"{len(rows)} of {cells}", nf4_launch=rs.nf4_launch_table(),
                                    fp8_launch=rs.fp8_launch_table(),
                                    mma_launch=MMA_CHOICE, nf4t_launch=NF4T_TABLE,
                                    attention_launch=attention_launch)
                    if not args.smoke:  # after every cell: a run cut off keeps what it measured
                        write_result(stem, dict(meta=meta, rows=rows), report(meta, rows, args),
                                     echo=len(rows) == cells)
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.smoke:
        print("\n".join(report(meta, rows, args)))
        print("(smoke run: nothing written)")


def table_from_log(args) -> None:
    """The table of the cells a run's log printed (one dict a line, read as literals: nothing in it runs), the
    run's facts the log lacks from --log-meta ("?" where not given)."""
    rows = [ast.literal_eval(line) for line in Path(args.from_log).read_text().splitlines()
            if line.startswith("{'base': ")]
    if not rows:
        raise SystemExit(f"{args.from_log}: no printed cells (lines starting with {{'base': ...}})")
    given = json.loads(args.log_meta)
    if not isinstance(given, dict):
        raise SystemExit(f"--log-meta: a JSON object expected, got {args.log_meta!r}")
    args.bases = list(dict.fromkeys(r["base"] for r in rows))
    meta = {**dict(date="?", gpu="?", torch="?", transformers="?", command="?"), **given,
            "seconds": "?", "copy_bandwidth_gbs": float("nan"), "cells": f"{len(rows)}, from {args.from_log}"}
    meta["command"] = f"{meta['command']} (cells from its log: rollout_matrix.py --from-log)"
    write_result(f"rollout_matrix_{args.shape}_from_log{args.tag}", dict(meta=meta, rows=rows),
                 report(meta, rows, args))


if __name__ == "__main__":
    main()
