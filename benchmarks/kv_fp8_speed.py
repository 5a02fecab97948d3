"""FP8 KV cache (generation.kv_cache_dtype=fp8) against the bf16 cache, on the GPU, in one run:

1. decode attention alone, one layer, Llama-3.1-8B heads (32/8 × 128), P prompts × G of prefix Lp + suffix s: the
   Triton kernel on a bf16 cache and on its FP8 quantization under each of FP8_VARIANTS' launches (CUDA-graph
   timed; speed-ups are bf16's µs over the variant's), each one's error against the
   float32 reference on the unquantized keys/values (‖Δ‖ / ‖o‖), and the cache bytes;
2. whole-model decode at long sequences: the 8B shape (random weights, LoRA r=32), P prompts × G of a
   --long-prompt-token prompt, longrl's sampler with each cache; decode seconds a step from two rollouts of
   --short and --long new tokens (the difference: prefill and graph capture cancel; --reps pairs, the medians), the
   KV cache each allocates, and how many sequences each cache holds in the same bytes (memory/planner.py's rollout
   arithmetic); the FP8 cache under each of FP8_VARIANTS' launches (KV_VARIANTS picks them).

    python benchmarks/kv_fp8_speed.py                        # 2 × 8, suffixes 1,024 / 8,192 / 16,384; 16K decode
    python benchmarks/kv_fp8_speed.py --no-model             # the attention part alone
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from results_io import card_tag, graph_seconds, run_meta, write_result  # noqa: E402

from longrl.rollout.attention import decode_attention_reference  # noqa: E402
from longrl.rollout.kv_quant import quantize_cache  # noqa: E402

GIB = 2 ** 30
# the FP8 kernel's launches measured beside the bf16 cache: its default (decode_kernel.FP8_LAUNCH over LAUNCH), and
# LAUNCH's own choices (the default until 2026-12-02: bf16 products, exponents loaded with their block, 4 warps, 2
# stages)
FP8_VARIANTS = {"fp8": {}, "fp8_bf16": dict(fp8_mma=False, fp8_f16=False, fp8_prefetch=False, block=32, warps=4,
                                             stages=2),
                "fp8_f16a": dict(fp8_mma=False, fp8_f16=True, fp8_prefetch=True, block=32, warps=2, stages=3)}
# e4m3 tensor-core products (decode_kernel fp8_mma), with 2 and 3 pipeline stages; KV_VARIANTS=fp8,fp8_mma,... picks
FP8_VARIANTS.update(fp8_mma=dict(fp8_mma=True, block=64, warps=4, stages=2),
                    fp8_mma3=dict(fp8_mma=True, block=64, warps=4, stages=3),
                    fp8_mma128=dict(fp8_mma=True, block=128, warps=4, stages=2),
                    fp8_mma128s3=dict(fp8_mma=True, block=128, warps=4, stages=3),
                    fp8_s4=dict(stages=4), fp8_p4096=dict(programs=4096, prefix_programs=1024),
                    fp8_p1024=dict(programs=1024, prefix_programs=256), fp8_w8=dict(warps=8),
                    fp8_ss=dict(fp8_ss=True), fp8_ss2=dict(fp8_ss=True, stages=2),
                    fp8_ssw8=dict(fp8_ss=True, warps=8), fp8_ssw8s2=dict(fp8_ss=True, warps=8, stages=2),
                    fp8_r168=dict(maxnreg=168))
if os.environ.get("KV_VARIANTS"):
    FP8_VARIANTS = {v: FP8_VARIANTS[v] for v in os.environ["KV_VARIANTS"].split(",")}
# the variants under each launch choice of the sweep: products in the query's bf16 or in float16 (fp8_f16), the
# scale exponents loaded one block ahead or not (fp8_prefetch)
SWEEP_VARIANTS = {name: {"fp8_mma": False, "fp8_f16": f16, "fp8_prefetch": ahead} for name, f16, ahead in
                  (("fp8_plain", False, False), ("fp8_f16", True, False), ("fp8_ahead", False, True),
                   ("fp8_f16_ahead", True, True))}
# the launch choices swept at the longest suffix: the FP8 kernel reads half the bytes a block, so it may want longer
# blocks, fewer warps or deeper pipelines than the bf16 kernel's defaults (decode_attention_speed.SWEEP: warps 8, which
# were slower for every variant at 16K, kv_fp8_speed_h200_s15.md)
FP8_SWEEP = [dict(block=b, warps=w, stages=st, programs=pr, prefix_programs=512) for b in (32, 64, 128)
             for w in (2, 4) for st in (2, 3) for pr in (2048, 4096)]
FP8_TITLES = {"fp8": "fp8 (default launch)", "fp8_bf16": "fp8, LAUNCH's choices", "fp8_plain": "fp8, bf16 products",
              "fp8_f16": "fp8, float16 products", "fp8_ahead": "fp8, exponents ahead",
              "fp8_f16_ahead": "fp8, float16 + ahead", "fp8_mma": "fp8, e4m3 products",
              "fp8_mma3": "fp8, e4m3 products, 3 stages",
              "fp8_f16a": "fp8, float16 + ahead, 2 warps, 3 stages", "fp8_mma128": "fp8, e4m3 products, blocks of 128",
              "fp8_mma128s3": "fp8, e4m3 products, blocks of 128, 3 stages", "fp8_s4": "fp8, 4 stages",
              "fp8_p4096": "fp8, 4,096 programs", "fp8_p1024": "fp8, 1,024 programs", "fp8_w8": "fp8, 8 warps",
              "fp8_ss": "fp8, shared-memory operands", "fp8_ss2": "fp8, shared-memory operands, 2 stages",
              "fp8_ssw8": "fp8, shared-memory operands, 8 warps",
              "fp8_ssw8s2": "fp8, shared-memory operands, 8 warps, 2 stages",
              "fp8_r168": "fp8, at most 168 registers (3 programs an SM)"}


def attention_case(P, G, Hq, Hkv, D, Lp, T, s, dev, timed: bool = True) -> dict:
    from longrl.rollout.decode_kernel import decode_attention_triton

    B = P * G
    mk = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.bfloat16)  # noqa: E731
    raw = [mk(P, Hkv, Lp, D), mk(P, Hkv, Lp, D), mk(B, Hkv, T, D), mk(B, Hkv, T, D)]
    q = mk(B, Hq, D)
    pidx = torch.arange(B, device=dev) // G
    lens = (torch.full((B,), Lp, device=dev), torch.full((B,), s, device=dev))
    kw = dict(members=torch.arange(B, device=dev).view(P, G), prompt_len=torch.full((P,), Lp, device=dev))
    quant = quantize_cache(*raw)  # values position-minor
    codes, exps = [c for c, _ in quant], tuple(e for _, e in quant)
    bf16_args = (q, raw[0], raw[1], pidx, lens[0], raw[2], raw[3], lens[1], D ** -0.5)
    fp8_args = (q, codes[0], codes[1], pidx, lens[0], codes[2], codes[3], lens[1], D ** -0.5)
    calls = {"bf16": lambda: decode_attention_triton(*bf16_args, **kw)}
    for name, launch in FP8_VARIANTS.items():
        calls[name] = lambda launch=launch: decode_attention_triton(*fp8_args, **kw, kv_exp=exps, launch=launch)
    row = dict(P=P, G=G, Lp=Lp, suffix=s)
    if B * (Lp + s) <= 2 ** 20:  # the float32 reference materializes [B, Hkv, Lp + s, D]
        ref = decode_attention_reference(q.float(), *[t.float() for t in raw[:2]], pidx, lens[0],
                                         *[t.float() for t in raw[2:]], lens[1], D ** -0.5)
        twin = decode_attention_reference(*fp8_args, **kw, kv_exp=exps).float()
        for name, call in calls.items():
            out = call().float()
            row[f"{name}_rel_err"] = float((out - ref).norm() / ref.norm())
            if name != "bf16":
                row[f"{name}_kernel_vs_twin_max_abs"] = float((out - twin).abs().max())
    if timed:
        for name, call in calls.items():
            row[f"{name}_us"] = graph_seconds(call) * 1e6
            if name != "bf16":
                row[f"speedup_{name}"] = row["bf16_us"] / row[f"{name}_us"]
    row["bf16_kv_mb"] = 2 * Hkv * D * 2 * (P * Lp + B * s) / 1e6
    row["fp8_kv_mb"] = 2 * Hkv * (D + 1) * (P * Lp + B * s) / 1e6
    return row


def sweep(P, G, Lp, T, s, dev) -> list[dict]:
    """Both caches' decode attention under each launch choice of FP8_SWEEP at suffix s."""
    from longrl.rollout.decode_kernel import decode_attention_triton

    B, Hq, Hkv, D = P * G, 32, 8, 128
    mk = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.bfloat16)  # noqa: E731
    raw = [mk(P, Hkv, Lp, D), mk(P, Hkv, Lp, D), mk(B, Hkv, T, D), mk(B, Hkv, T, D)]
    quant = quantize_cache(*raw)  # values position-minor
    q, pidx = mk(B, Hq, D), torch.arange(B, device=dev) // G
    lens = (torch.full((B,), Lp, device=dev), torch.full((B,), s, device=dev))
    kw = dict(members=torch.arange(B, device=dev).view(P, G), prompt_len=torch.full((P,), Lp, device=dev))
    cases = {"bf16": ((q, raw[0], raw[1], pidx, lens[0], raw[2], raw[3], lens[1], D ** -0.5), {}),
             "fp8": ((q, *[c for c, _ in quant[:2]], pidx, lens[0], *[c for c, _ in quant[2:]], lens[1], D ** -0.5),
                     {"kv_exp": tuple(e for _, e in quant)})}
    variants = {"bf16": {}, **SWEEP_VARIANTS}  # every FP8 variant on the same codes
    rows = []
    for launch in FP8_SWEEP:
        row = dict(launch)
        for name, variant in variants.items():
            a, extra = cases["bf16" if name == "bf16" else "fp8"]
            chosen = {**launch, **variant}
            try:
                row[f"{name}_us"] = graph_seconds(lambda: decode_attention_triton(*a, **kw, **extra,
                                                                                  launch=chosen)) * 1e6
            except Exception as e:  # noqa: BLE001 - a launch choice that does not build is skipped, and said
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:80]}"
        rows.append(row)
        print(row, flush=True)
    return rows


def decode_model(args, dev):
    """The whole-model decodes' model: --shape with random weights, LoRA r=32."""
    import trl_baseline as tb

    from longrl.config.schema import LoraConfig
    from longrl.models import apply_lora

    model = tb.build_random_model(args.shape, dev, torch.bfloat16, attn_implementation="sdpa")
    return apply_lora(model, LoraConfig(r=32, alpha=64.0, dropout=0.0))


def model_decode(model, args, n_prompts: int, G: int) -> dict:
    """Decode seconds a step at --long-prompt + new tokens with each cache (decode_model's ``model``),
    n_prompts distinct prompts × G sequences each."""
    from longrl.memory.planner import ModelShape, kv_bytes_per_token, max_rollout_slots
    from longrl.rollout import decode_kernel

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size - 1, (args.long_prompt,), generator=g).tolist()
               for _ in range(n_prompts)]
    out = dict(prompts=n_prompts, G=G)
    default_launch = dict(decode_kernel.FP8_LAUNCH)
    try:
        for name, cache, launch in (("bf16", "bf16", {}), *((v, "fp8", launch) for v, launch in FP8_VARIANTS.items())):
            decode_kernel.FP8_LAUNCH.update(default_launch, **launch)  # the sampler's decode attention reads it
            out[name] = _decode_run(model, prompts, G, args, cache)
    finally:
        decode_kernel.FP8_LAUNCH.clear()
        decode_kernel.FP8_LAUNCH.update(default_launch)
    for v in FP8_VARIANTS:
        out[f"speedup_{v}"] = out["bf16"]["step_ms"] / out[v]["step_ms"]
    shape = ModelShape.from_config(model.config)
    kv = dict(prompts=8, G=8, prompt_len=512, completion_len=16384)
    out["sequences_in_20_gib"] = {d: max_rollout_slots(20 * GIB, sequences=64, **kv,
                                                       kv_token=kv_bytes_per_token(shape, 2, d == "fp8"))
                                  for d in ("bf16", "fp8")}
    return out


def _decode_run(model, prompts, G: int, args, cache: str) -> dict:
    """One sampler with KV cache ``cache``: decode seconds a step from the --short and --long rollouts."""
    from longrl.rollout import Sampler, SamplingParams

    sampler = Sampler(model, None, kv_cache_dtype=cache)
    try:
        sampler.generate(prompts, G, SamplingParams(max_new_tokens=args.short, seed=0))  # warm-up: compiles
        times = {args.short: [], args.long: []}  # the kernels (and their launch choices) outside the timed rollouts
        for _ in range(args.reps):  # short and long in turn: a drift of the GPU's clocks reaches both
            for n in (args.short, args.long):
                torch.cuda.synchronize()
                start = time.perf_counter()
                r = sampler.generate(prompts, G, SamplingParams(max_new_tokens=n, seed=1))
                torch.cuda.synchronize()
                times[n].append(time.perf_counter() - start)
                assert all(len(c) == n for c in r.completion_ids)  # random weights: no EOS in the vocabulary's noise
        steps = [(b - a) / (args.long - args.short) for a, b in zip(times[args.short], times[args.long])]
        step = (statistics.median(times[args.long]) - statistics.median(times[args.short])) / (args.long - args.short)
        return dict(step_ms=step * 1e3, tokens_per_s=len(prompts) * G / step, seconds=times,
                    rep_step_ms=[t * 1e3 for t in steps],
                    kv_cache_gib=sampler.last_stats["kv_cache_bytes"] / GIB, slots=sampler.last_stats["slots"],
                    mismatch=mismatch(model, r, rows=4))
    finally:
        del sampler
        torch.cuda.empty_cache()


def mismatch(model, rollout, rows: int) -> dict:
    """The trainer's sampler/trainer mismatch metrics (ops/rollout_correction.py: sampler/k3_kl,
    sampler/logp_abs_diff, ...) of the first ``rows`` completions of ``rollout``: the model's own log-probs of the
    sampled tokens (one training-style forward, longrl.models.policy.sequence_logprobs) against the sampler's."""
    from longrl.ops.rollout_correction import rollout_correction_weights
    from longrl.models.policy import sequence_logprobs

    prompts, comps = rollout.prompt_ids[:rows], rollout.completion_ids[:rows]
    width = max(len(c) for c in comps)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        trainer_lp = sequence_logprobs(model, prompts, comps, width, pad_id=0)[0].float()
    model.train(was_training)
    dev = trainer_lp.device
    sampler_lp = torch.zeros_like(trainer_lp)
    mask = torch.zeros_like(trainer_lp)
    for i, lp in enumerate(rollout.logprobs[:rows]):
        sampler_lp[i, :len(lp)] = torch.tensor(lp, device=dev)
        mask[i, :len(lp)] = 1.0
    w, stats = rollout_correction_weights(trainer_lp, sampler_lp, mask, "token_truncate", cap=2.0)
    return {**stats, "is_weight_max": float(w.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-suffix", type=int, default=16384)
    ap.add_argument("--suffix", default="1024,8192,16384")
    ap.add_argument("--long-prompt", type=int, default=16128, help="prompt tokens of the whole-model decode")
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--long", type=int, default=320)
    ap.add_argument("--reps", type=int, default=1, help="short and long rollouts a cache, in turn; the step from "
                    "their medians (the prefill's noise over long − short steps)")
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--model-cases", default="2x8,16x1", help="whole-model decodes, PROMPTSxG each: 2x8 shares each "
                    "long prompt among 8 sequences (its keys read once for them), 16x1 reads 16 sequences' own keys")
    ap.add_argument("--sweep", action="store_true", help="also every kernel variant under FP8_SWEEP's "
                    "launch choices at the longest suffix")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kv_fp8_speed.py times CUDA kernels; no GPU here")
    dev = torch.device("cuda")
    rows = [attention_case(args.prompts, args.G, 32, 8, 128, args.prompt_len, args.max_suffix, int(s), dev)
            for s in args.suffix.split(",")]
    small = attention_case(2, 4, 32, 8, 128, 77, 1500, 1300, dev, timed=False)  # errors at a size the
    for r in rows + [small]:  # reference can hold
        print(r, flush=True)
    swept = sweep(args.prompts, args.G, args.prompt_len, args.max_suffix, int(args.suffix.split(",")[-1]), dev) \
        if args.sweep else None
    model = None if args.no_model else decode_model(args, dev)  # one model for every case
    decodes = [] if args.no_model else [model_decode(model, args, *map(int, c.split("x")))
                                        for c in args.model_cases.split(",")]
    print(decodes, flush=True)
    meta = run_meta()
    lines = [f"# FP8 KV cache vs bf16, Llama-3.1-8B heads, {meta['gpu']}", "", f"{meta['date']}; torch {meta['torch']}, "
             f"transformers {meta['transformers']}.  ", f"`{meta['command']}`", "",
             f"## Decode attention, one layer, {args.prompts} prompts × {args.G}, prefix {args.prompt_len}", "",
             "| suffix | bf16 KV MB | fp8 KV MB | bf16 µs | " + " | ".join(f"{FP8_TITLES[v]} µs (speed-up)"
                                                                    for v in FP8_VARIANTS) + " |",
             "|---|---|---|---|" + "---|" * len(FP8_VARIANTS)]
    lines += [f"| {r['suffix']} | {r['bf16_kv_mb']:.1f} | {r['fp8_kv_mb']:.1f} | {r['bf16_us']:.1f} | "
              + " | ".join(f"{r[f'{v}_us']:.1f} ({r[f'speedup_{v}']:.2f} ×)" for v in FP8_VARIANTS) + " |"
              for r in rows]
    lines += ["", f"Errors (2 × 4 sequences, prefix 77 + suffix 1,300, against float32 attention on the unquantized "
              f"keys/values): bf16 cache ‖Δ‖/‖o‖ = {small['bf16_rel_err']:.4f}, FP8 cache {small['fp8_rel_err']:.4f}; "
              f"FP8 kernel vs its PyTorch twin on the same codes: max |Δ| = {small['fp8_kernel_vs_twin_max_abs']:.2e}; "
              + "; ".join(f"{FP8_TITLES[v]}: ‖Δ‖/‖o‖ = {small[f'{v}_rel_err']:.4f}, max |Δ| vs the twin "
                          f"{small[f'{v}_kernel_vs_twin_max_abs']:.2e}" for v in FP8_VARIANTS if v != "fp8") + "."]
    for decode in decodes:
        names = ["bf16", *FP8_VARIANTS]
        lines += ["", f"## Whole-model decode, {args.shape} (random weights, LoRA r=32), {decode['prompts']} prompts "
                  f"× {decode['G']}, prompt {args.long_prompt:,} + {args.short}–{args.long} new tokens", "",
                  f"| KV cache | ms a decode step (median of {args.reps}) | each pair's ms | tokens/s "
                  "| KV cache GiB (allocated) |", "|---|---|---|---|---|"]
        lines += [f"| {FP8_TITLES.get(d, d)} | {decode[d]['step_ms']:.2f} | "
                  f"{', '.join(f'{t:.2f}' for t in decode[d]['rep_step_ms'])} | {decode[d]['tokens_per_s']:,.0f} | "
                  f"{decode[d]['kv_cache_gib']:.2f} |" for d in names]
        lines += ["", "Sampler/trainer mismatch (the trainer's metrics, token_truncate at cap 2, first 4 completions of "
                  f"the {args.long}-token rollout, each cache's own rollout of the same prompts and seed):", "",
                  "| KV cache | sampler/k3_kl | sampler/logp_abs_diff | is_weight_mean | is_weight_changed "
                  "| max weight |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {FP8_TITLES.get(d, d)} | {m['sampler/k3_kl']:.2e} | {m['sampler/logp_abs_diff']:.2e} | "
                  f"{m['sampler/is_weight_mean']:.4f} | {m['sampler/is_weight_changed']:.4f} | "
                  f"{m['is_weight_max']:.3f} |"
                  for d in names for m in [decode[d]["mismatch"]]]
        s = decode["sequences_in_20_gib"]
        lines += ["", f"Decode speed-up at {args.long_prompt + args.long:,}-token sequences: "
                  + "; ".join(f"{FP8_TITLES[v]} **{decode[f'speedup_{v}']:.2f} ×**" for v in FP8_VARIANTS)
                  + f". Sequences of 512 + 16,384 tokens (8 prompts × 8) in 20 GiB of KV cache: bf16 {s['bf16']}, "
                  f"FP8 {s['fp8']} ({s['fp8'] / s['bf16']:.2f} ×)."]
    if swept:
        names = ["bf16", *SWEEP_VARIANTS]
        best = {d: min((r for r in swept if f"{d}_us" in r), key=lambda r: r[f"{d}_us"], default=None) for d in names}
        lines += ["", f"## Launch sweep at suffix {args.suffix.split(',')[-1]} (FP8_SWEEP)", "",
                  "| block | warps | stages | programs | prefix programs | bf16 µs | "
                  + " | ".join(f"{FP8_TITLES[v]} µs" for v in SWEEP_VARIANTS) + " |",
                  "|---|---|---|---|---|---|" + "---|" * len(SWEEP_VARIANTS)]
        lines += [f"| {r['block']} | {r['warps']} | {r['stages']} | {r['programs']} | {r['prefix_programs']} | "
                  + " | ".join(f"{r.get(f'{d}_us', float('nan')):.1f}" for d in names) + " |" for r in swept]
        bf = best["bf16"]["bf16_us"] if best["bf16"] else float("nan")
        lines += ["", f"Fastest: bf16 {bf:.1f} µs; " + "; ".join(
            f"{FP8_TITLES[v]} {best[v][f'{v}_us']:.1f} µs ({bf / best[v][f'{v}_us']:.2f} × bf16's speed)"
            if best[v] else f"{FP8_TITLES[v]}: no launch built" for v in SWEEP_VARIANTS) + "."]
    write_result(f"kv_fp8_speed_{card_tag()}{args.tag}", dict(meta=meta, attention=rows, errors=small, decode=decodes,
                                                      sweep=swept), lines)


if __name__ == "__main__":
    main()
