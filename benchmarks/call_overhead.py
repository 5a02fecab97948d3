"""Where a short rollout call's time goes: the host's fixed costs beside the decode steps.

A GRPO step of a small model (SmolLM2-135M: completions of a few dozen tokens) makes one ``Sampler.generate`` call
of a few dozen decode steps. Each call sets the model up (LoRA fused, projections packed) and undoes it, and
captures its own CUDA graphs (one per decode batch bucket, and per draft count when speculating), because its KV
cache and slots are its own. This measures, on --shape with random weights and LoRA r = 32 (bench_setup.py), the
median of --calls timed calls after an untimed warm-up of each sampler: the call's seconds, its decode steps and
wall ms a step, the graph captures and their host seconds, the set-up and undoing seconds (Sampler.last_stats
prepare_s + release_s), for each --min-batch (Sampler(min_decode_batch): fewer buckets, fewer captures) and
--speculative mode (ngram: k = 2 drafts, every chunk speculating; random weights accept nearly no draft, so this
prices the verify steps' overheads, not their gain).

Completions end as a trained policy's do, at varied lengths: a random 1/--mean-tokens of the vocabulary are stop
tokens, so each sampled token stops its sequence with probability about 1/--mean-tokens (up to --new-tokens).

    python benchmarks/call_overhead.py --shape smollm2-135m --sequences 8 32 128 --min-batch 1 16
    python benchmarks/call_overhead.py --shape smollm2-135m --sequences 8 32 --min-batch 16 --speculative off \
        --step-graphs off on          # whole-step graphs against the forward's alone
    python benchmarks/call_overhead.py --shape tiny --sequences 8 --calls 1      # CPU smoke run (no graphs)

--host-profile N adds, for each setting, one more call under cProfile: the N functions of longrl's package with the
most cumulative seconds (host time; a function that waits for the GPU, .tolist() or a synchronize, carries the wait).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_setup import random_model, random_prompts, sync  # noqa: E402
from results_io import card_tag, run_meta, write_result  # noqa: E402

from longrl.rollout.sampler import Sampler  # noqa: E402
from longrl.rollout.sampling import SamplingParams  # noqa: E402

G = 8


def stop_ids(vocab: int, mean_tokens: int, seed: int = 0) -> list[int]:
    """A random 1/mean_tokens of the vocabulary (past the special ids): each token stops with about that chance."""
    g = torch.Generator().manual_seed(seed)
    return sorted(int(t) for t in torch.randperm(vocab - 3, generator=g)[: max(1, vocab // mean_tokens)] + 3)


def measure(sampler: Sampler, prompts, params: SamplingParams, calls: int) -> dict:
    """The median call (by seconds) of ``calls`` timed calls after one untimed warm-up: its figures."""
    sampler.generate(prompts, G, params)
    runs = []
    for _ in range(calls):
        sync()
        start = time.perf_counter()
        out = sampler.generate(prompts, G, params)
        sync()
        seconds = time.perf_counter() - start
        runs.append((seconds, dict(sampler.last_stats), sum(len(c) for c in out.completion_ids)))
    seconds, stats, tokens = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    steps = max(1, stats["decode_steps"])
    return dict(seconds=seconds, tokens=tokens, tokens_s=tokens / seconds, decode_steps=stats["decode_steps"],
                wall_ms_step=1e3 * seconds / steps, captures=stats.get("graph_captures", 0),
                capture_s=stats.get("graph_capture_s", 0.0), prepare_s=stats["prepare_s"],
                release_s=stats["release_s"], compactions=stats["compactions"],
                accepted=stats.get("spec_accepted_per_step"), all_seconds=[r[0] for r in runs])


def host_profile(sampler: Sampler, prompts, params: SamplingParams, top: int) -> list[dict]:
    """One call under cProfile: longrl's ``top`` functions by cumulative seconds (file:line name, calls, own and
    cumulative seconds)."""
    profiler = cProfile.Profile()
    sync()
    profiler.enable()
    sampler.generate(prompts, G, params)
    sync()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = [dict(function=f"{Path(f).name}:{line} {name}", calls=calls, own_s=own, cumulative_s=cum)
            for (f, line, name), (_, calls, own, cum, _) in stats.items() if "/longrl/" in f.replace("\\", "/")]
    return sorted(rows, key=lambda r: -r["cumulative_s"])[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--sequences", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--min-batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--speculative", nargs="+", default=["off", "ngram"], choices=["off", "ngram"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--mean-tokens", type=int, default=32)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--tag", default="")
    ap.add_argument("--step-graphs", nargs="+", default=["off"], choices=["off", "on"],
                    help="Sampler(step_graphs): each plain decode step one CUDA graph (on) or the forward alone (off)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="one more call a setting under cProfile: longrl's N functions by cumulative seconds")
    args = ap.parse_args()
    if args.calls < 1 or args.mean_tokens < 1 or any(s % G for s in args.sequences):
        ap.error(f"--calls and --mean-tokens are >= 1 and --sequences multiples of G = {G}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    begin = time.perf_counter()
    model = random_model(args.shape, device, lora=True)
    vocab = model.config.vocab_size
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0,
                            stop_token_ids=stop_ids(vocab, args.mean_tokens))
    rows = []
    for sequences in args.sequences:
        prompts = random_prompts(sequences // G, args.prompt_len, vocab)
        for spec in args.speculative:
            for smallest, whole in [(m, w) for m in args.min_batch for w in args.step_graphs]:
                sampler = Sampler(model, None, min_decode_batch=smallest, speculative=spec, max_draft_tokens=2,
                                  speculative_fallback=False, step_graphs=whole == "on")
                row = dict(sequences=sequences, speculative=spec, min_batch=smallest, step_graphs=whole,
                           **measure(sampler, prompts, params, args.calls))
                if args.host_profile:
                    row["host_profile"] = host_profile(sampler, prompts, params, args.host_profile)
                rows.append(row)
                print({k: v for k, v in row.items() if k != "host_profile"}, flush=True)
                del sampler
    meta = run_meta(shape=args.shape, G=G, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                    mean_tokens=args.mean_tokens, calls=args.calls, seconds=time.perf_counter() - begin)
    lines = [f"# A short rollout call's time: fixed host costs beside the decode steps ({args.shape})", "",
             f"Command: `{meta['command']}`  ",
             f"Date: {meta['date']}; {meta['gpu']}; torch {meta['torch']}, transformers {meta['transformers']}; "
             f"{meta['seconds']:.0f} s in all.", "",
             f"Random weights, LoRA r = 32, G = {G}, prompts of {args.prompt_len} tokens, temperature 1; a random "
             f"1/{args.mean_tokens} of the vocabulary stops a sequence (up to {args.new_tokens} tokens). Each row: "
             f"the median of {args.calls} timed call(s) after a warm-up call. Captures: the call's CUDA-graph "
             "captures and their host seconds; set-up: Sampler.last_stats prepare_s + release_s (the model set up "
             "for the call and undone); min batch: Sampler(min_decode_batch); step graphs: Sampler(step_graphs), "
             "each plain decode step one CUDA graph (off: the forward alone); ngram: k = 2, every chunk "
             "speculating (random weights accept nearly nothing: the verify steps' overheads).", "",
             "| sequences | speculative | min batch | step graphs | call s | tokens/s | decode steps | wall ms a step "
             "| captures | capture s | set-up s | compactions |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['sequences']} | {r['speculative']} | {r['min_batch']} | {r['step_graphs']} | {r['seconds']:.3f} | "
              f"{r['tokens_s']:,.0f} | {r['decode_steps']} | {r['wall_ms_step']:.2f} | {r['captures']} | "
              f"{r['capture_s']:.3f} | {r['prepare_s'] + r['release_s']:.3f} | {r['compactions']} |" for r in rows]
    for r in rows:
        if r.get("host_profile"):
            lines += ["", f"### Host profile: {r['sequences']} sequences, speculative {r['speculative']}, min batch "
                      f"{r['min_batch']}, step graphs {r['step_graphs']} (one call under cProfile; longrl's functions "
                      "by cumulative seconds)", "",
                      "| function | calls | own s | cumulative s |", "| --- | --- | --- | --- |"]
            lines += [f"| `{h['function']}` | {h['calls']} | {h['own_s']:.4f} | {h['cumulative_s']:.4f} |"
                      for h in r["host_profile"]]
    write_result(f"call_overhead_{args.shape}_{card_tag()}{args.tag}", dict(meta=meta, rows=rows), lines + [""])


if __name__ == "__main__":
    main()
