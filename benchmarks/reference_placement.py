"""The KL reference of a full-weight run (models/reference.py) on a GPU, its three placements side by side on a
random-weight model of a real shape in bf16: the reference pass's seconds, the GPU memory the copy holds and its
pass's peak above that, and the checks that the host placement (decoder layers copied from pinned memory on a side
stream, PREFETCH_LAYERS ahead) gives the in-place copy's log-probs bit for bit and int8 those of its plain dequantized
twin. The policy's own no-grad forward over the same micro-batches is timed beside them (what the reference pass
costs with the copy on the GPU).

    python benchmarks/reference_placement.py --shape llama-3.1-8b --sequences 8 --tokens 4096 \
        --micro-batch-tokens 16384 4096
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = 2 ** 30


CUDA = torch.cuda.is_available()  # else a dry run on the CPU (--shape tiny): no memory figures


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def _seconds(fn, reps: int) -> float:
    """Median wall seconds of fn() (synchronized) over ``reps`` calls after one warm-up."""
    fn()
    _sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    from bench_setup import random_model, random_prompts
    from results_io import card_tag, run_meta, write_result

    from longrl.memory.microbatch import token_budget_groups
    from longrl.models.policy import sequence_logprobs
    from longrl.models.reference import PREFETCH_LAYERS, ReferenceModel, int8_dequantized, int8_rows
    from longrl.models.structure import decoder_layers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens a sequence (prompt + completion)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[16384, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tag", default=card_tag(),
                    help="the result files' suffix (default: the GPU's model, or cpu)")
    args = ap.parse_args()
    if not CUDA and args.shape != "tiny":
        ap.error("needs a CUDA device (a dry run on the CPU: --shape tiny)")

    torch.manual_seed(0)
    model = random_model(args.shape, "cuda" if CUDA else "cpu", dtype=None if CUDA else torch.float32)
    vocab = model.config.vocab_size
    completion_len = args.tokens - args.prompt_len
    prompts = random_prompts(args.sequences, args.prompt_len, vocab, seed=1)
    completions = random_prompts(args.sequences, completion_len, vocab, seed=2)
    kw = dict(pad_id=0, packed=True, chunk_size=1024)
    layer_bytes = sum(p.numel() * p.element_size() for layer in decoder_layers(model) for p in layer.parameters())

    def policy_pass(splits):
        with torch.no_grad():
            for idx in splits:
                sequence_logprobs(model, [prompts[i] for i in idx], [completions[i] for i in idx], completion_len,
                                  **kw)

    rows, checks, payload = [], [], {"passes": []}
    exact = {}
    for placement in ("gpu", "host", "int8"):
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        before = _allocated()
        start = time.perf_counter()
        ref = ReferenceModel(model, placement)
        _sync()
        built_s = time.perf_counter() - start
        held = _allocated() - before
        for budget in args.micro_batch_tokens:
            splits = token_budget_groups([args.tokens] * args.sequences, budget)
            run = lambda: ref.logprobs(prompts, completions, completion_len, splits, **kw)  # noqa: E731
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            base = _allocated()
            got = run()
            peak = torch.cuda.max_memory_allocated() - base if CUDA else 0
            seconds = _seconds(run, args.reps)
            if placement == "gpu":
                exact[budget] = got
                policy_s = _seconds(lambda: policy_pass(splits), args.reps)
                rows.append(f"| policy forward (no grad), for comparison | {budget:,} | {len(splits)} | "
                            f"{policy_s:.3f} | — | — | — |")
            elif placement == "host":
                same = torch.equal(got, exact[budget])
                checks.append(f"- host, micro-batches of {budget:,} tokens: log-probs equal the gpu placement's bit "
                              f"for bit: {same}")
            streamed = len(splits) * len(decoder_layers(model)) * layer_bytes if placement == "host" else 0
            rate = f"{streamed / seconds / 1e9:.1f}" if streamed else "—"
            rows.append(f"| {placement} | {budget:,} | {len(splits)} | {seconds:.3f} | {held / GIB:.2f} | "
                        f"{peak / GIB:.2f} | {rate} |")
            payload["passes"].append(dict(placement=placement, micro_batch_tokens=budget, micro_batches=len(splits),
                                          seconds=seconds, held_gib=held / GIB, pass_peak_gib=peak / GIB,
                                          built_s=built_s, host_gb_per_s=streamed / seconds / 1e9 if streamed else None))
        if placement == "int8":  # the plain twin: a deep copy whose layer matrices are q · s
            twin = copy.deepcopy(model)
            with torch.no_grad():
                for layer in decoder_layers(twin):
                    for p in layer.parameters():
                        if p.dim() == 2:
                            p.copy_(int8_dequantized(*int8_rows(p), p.dtype))
            budget = args.micro_batch_tokens[0]
            splits = token_budget_groups([args.tokens] * args.sequences, budget)
            got = ref.logprobs(prompts, completions, completion_len, splits, **kw)
            want = torch.zeros_like(got)
            with torch.no_grad():
                for idx in splits:
                    lp, _ = sequence_logprobs(twin, [prompts[i] for i in idx], [completions[i] for i in idx],
                                              completion_len, **kw)
                    want[idx] = lp.float().cpu()
            diff = (got - exact[budget]).abs()
            checks.append(f"- int8: log-probs equal the plain dequantized twin's bit for bit: {torch.equal(got, want)}; "
                          f"against the exact reference: max |Δ log p| {diff.max():.4f}, mean {diff.mean():.5f}")
            del twin
        payload[f"{placement}_built_s"] = built_s
        del ref
    meta = run_meta(shape=args.shape, sequences=args.sequences, tokens=args.tokens, prefetch_layers=PREFETCH_LAYERS)
    payload.update(meta=meta, checks=checks)
    lines = [f"# KL reference placements, {args.shape} (random bf16 weights), {args.sequences} × {args.tokens:,} "
             "tokens", "",
             f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}, transformers {meta['transformers']}; "
             f"`{meta['command']}`", "",
             "Seconds: median of the reference pass (one forward per micro-batch, no grad) over "
             f"{args.reps} reps after a warm-up. Held: GPU memory the copy keeps (host: embeddings, head and "
             f"{PREFETCH_LAYERS + 1} layer buffers). Pass peak: the pass's peak above what was allocated before it. "
             "Host GB/s: decoder-layer bytes copied from pinned memory per second of the pass.", "",
             "| placement | micro-batch tokens | micro-batches | seconds | held GiB | pass peak GiB | host GB/s |",
             "|---|---|---|---|---|---|---|", *rows, "", *checks, "",
             "Copies made in " + ", ".join(f"{p} {payload[f'{p}_built_s']:.1f} s" for p in ("gpu", "host", "int8"))
             + " (the fingerprint's SHA-256 of the weights included)."]
    write_result(f"reference_placement_{args.shape}_{args.sequences}x{args.tokens}_{args.tag}", payload, lines)


if __name__ == "__main__":
    main()
