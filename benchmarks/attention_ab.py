"""Whole rollout calls under decode attention launch choices, A/B in one process.

For each base (bf16, nf4) and row count R (R / G prompts of C random tokens, G = 8 completions each): one sampler,
and for each variant (entries over decode_kernel.LAUNCH; the first is the reference, by default the table as it
is) a warm-up call, then REPS rounds in which every variant's timed call of N new tokens runs once, the order
reversed every other round (A B C, C B A, ...), so drift and noise between calls fall on every variant alike.
Reports each variant's median call seconds and tokens/s, and the median and range of its per-round ratio to the
reference's seconds (< 1: faster). Every call's tokens are checked to have N tokens a sequence; the variants' first
sampled tokens are compared with the reference's (same seed: a launch choice changes only float32 summation order,
so most rows agree; reported, not asserted).

    python benchmarks/attention_ab.py --variants '{}' '{"counters": true}' '{"block": 64, "min_chunk": 128}'
    python benchmarks/attention_ab.py --smoke          # CPU, tiny shape: the program runs; nothing written
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import rollout_speed as rs  # noqa: E402
from bench_setup import random_prompts, sync  # noqa: E402
from results_io import card_tag, run_meta, write_result  # noqa: E402
from rollout_matrix import build  # noqa: E402

from longrl.rollout import Sampler, SamplingParams, decode_kernel  # noqa: E402

G = 8


def variants_of(specs: list[str]) -> list[dict]:
    """Each spec a JSON object of decode_kernel.LAUNCH entries (unknown keys refused by rs.launch_overrides)."""
    return [rs.launch_overrides(s, "--variants") for s in specs]


def timed_call(sampler, prompts, params, launch: dict) -> tuple[float, list]:
    """Seconds of one sampler call with ``launch`` over the default table, and its completions."""
    table = dict(decode_kernel.LAUNCH)
    decode_kernel.LAUNCH.update(launch)
    try:
        sync()
        t = time.perf_counter()
        out = sampler.generate(prompts, G, params)
        sync()
        return time.perf_counter() - t, out.completion_ids
    finally:
        decode_kernel.LAUNCH.clear()
        decode_kernel.LAUNCH.update(table)


def cell(model, base: str, rows: int, context: int, N: int, variants: list[dict], reps: int) -> dict:
    """One (base, rows) cell: every variant's call seconds over ``reps`` interleaved rounds."""
    prompts = random_prompts(max(1, rows // G), context, model.config.vocab_size)
    sampler = Sampler(model, None)  # the defaults: CUDA graphs, fused LoRA, the NF4 and FP8 decode products
    params = SamplingParams(max_new_tokens=N, temperature=1.0, seed=0)
    firsts = []
    for launch in variants:  # warm-up: compiles and first captures of each variant
        _, ids = timed_call(sampler, prompts, params, launch)
        firsts.append([c[0] for c in ids])
    seconds = [[] for _ in variants]
    for r in range(reps):
        order = range(len(variants)) if r % 2 == 0 else reversed(range(len(variants)))
        for i in order:
            s, ids = timed_call(sampler, prompts, params, variants[i])
            assert all(len(c) == N for c in ids), "a call stopped early (random weights, no stop tokens)"
            seconds[i].append(s)
    n_seq = len(prompts) * G
    out = dict(base=base, rows=n_seq, context=context, new_tokens=N, variants=[])
    for i, launch in enumerate(variants):
        ratios = [a / b for a, b in zip(seconds[i], seconds[0])]
        out["variants"].append(dict(
            launch=launch, seconds=seconds[i], median_s=statistics.median(seconds[i]),
            tokens_per_s=n_seq * N / statistics.median(seconds[i]), ratio_median=statistics.median(ratios),
            ratio_min=min(ratios), ratio_max=max(ratios),
            first_tokens_equal=sum(a == b for a, b in zip(firsts[i], firsts[0])) / n_seq))
    return out


def report(meta: dict, cells: list[dict]) -> list[str]:
    lines = ["# Whole rollout calls under decode attention launch choices (A/B, one process)", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; {meta['gpu']}; torch {meta['torch']}, "
             f"transformers {meta['transformers']}; {meta['seconds']} s in all.", "",
             f"{meta['shape']}, random weights, LoRA r = 32 unmerged, G = 8, {meta['new_tokens']} new tokens a "
             f"sequence after a prompt of {meta['context']} tokens, bf16 KV cache; {meta['reps']} rounds, each "
             "variant once a round (order reversed every other round). ratio: the variant's call seconds over the "
             "reference's (the first variant) in the same round; median [min, max]. first tokens: the share of "
             "sequences whose first sampled token equals the reference's.", "",
             "| base | rows | launch over LAUNCH | median call s | tokens/s | ratio | first tokens |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in cells:
        for v in c["variants"]:
            lines.append(f"| {c['base']} | {c['rows']} | `{json.dumps(v['launch'])}` | {v['median_s']:.3f} | "
                         f"{v['tokens_per_s']:,.0f} | {v['ratio_median']:.3f} [{v['ratio_min']:.3f}, "
                         f"{v['ratio_max']:.3f}] | {v['first_tokens_equal']:.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--bases", default="bf16,nf4")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["{}", '{"counters": true}'], metavar="JSON",
                    help="decode_kernel.LAUNCH entries a variant sets; the first is the reference")
    ap.add_argument("--tag", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape and sizes: the program runs; writes nothing")
    args = ap.parse_args()
    variants = variants_of(args.variants)
    if args.smoke:
        args.shape, args.bases, args.rows, args.context, args.new_tokens, args.reps = "tiny", "bf16", "8", 16, 4, 2
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("attention_ab.py times whole rollout calls on a GPU; no GPU here (--smoke runs it on the CPU)")
    dev = torch.device("cuda" if not args.smoke else "cpu")
    t0, cells = time.perf_counter(), []
    for base in args.bases.split(","):
        model, _ = build(base, args.shape, dev)  # (the matrix's models: LoRA r = 32 on bf16, NF4 or FP8)
        for rows in (int(r) for r in args.rows.split(",")):
            cells.append(cell(model, base, rows, args.context, args.new_tokens, variants, args.reps))
            print(json.dumps(cells[-1]), flush=True)
            meta = run_meta(seconds=round(time.perf_counter() - t0), shape=args.shape, context=args.context,
                            new_tokens=args.new_tokens, reps=args.reps)
            if not args.smoke:  # after every cell: a run cut off keeps what it measured
                write_result(f"attention_ab_{args.shape}_{card_tag()}{args.tag}", dict(meta=meta, cells=cells),
                             report(meta, cells), echo=False)
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(report(meta, cells)))
    if args.smoke:
        print("(smoke run: nothing written)")


if __name__ == "__main__":
    main()
