"""Rollout speed: longrl's sampler vs transformers' generate and continuous batching, same model, same GPU.

Random-weight models of real shapes in bf16 with LoRA r=32 on every linear projection (unmerged, as in
training), P prompts × G completions, fixed prompt length, exactly N new tokens each (EOS ignored). Reports
tokens/s, the decode phase's achieved memory bandwidth (weights + KV bytes read per step) against the
GPU's measured copy bandwidth, and the rollout's peak GPU memory against weights + KV cache.

    python benchmarks/rollout_speed.py --shape llama-3.1-8b --prompts 16 --G 8 --prompt-len 512 --new-tokens 1024
    python benchmarks/rollout_speed.py --shape qwen2.5-1.5b --prompts 64 --G 8 --prompt-len 512 --new-tokens 1024
    python benchmarks/rollout_speed.py --impls longrl,longrl-4bit,longrl-4bit-bnb   # bf16 vs a 4-bit (QLoRA) base
    python benchmarks/rollout_speed.py --impls longrl,longrl-4bit,longrl-fp8,longrl-fp8-dequant  # bf16, NF4, FP8

longrl-4bit / longrl-4bit-bnb: the same shape rebuilt with every decoder projection in bitsandbytes NF4 (double
quantization, blocks of 64; the head and embeddings bf16), the same LoRA, decoded with the 4-bit product that reads
the codes (generation.nf4_kernel, ops/nf4_matmul.py) or with bitsandbytes' own call (dequantize, then bf16).
Their roofline counts the codes and bitsandbytes' stored scales (8-bit, nested), not the float32 scales the kernel
reads.

longrl-fp8 / longrl-fp8-dequant: the same shape with every decoder projection in FP8 e4m3 with 128 × 128 block
scales (models/fp8_linear.py; head and embeddings bf16), the same LoRA, decoded with the FP8 product that reads the
e4m3 weights (ops/fp8_matmul.py) or with the FP8 layers' own forward (dequantize each weight to bf16, then multiply).
Their roofline counts the codes and the scales. Each base's model is built after the previous one is dropped.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_setup import add_shape_args, bench_lora, random_model, random_prompts, sync  # noqa: E402
from results_io import RESULTS, card_tag, copy_bandwidth, kernel_times, run_meta, write_result  # noqa: E402

from longrl.models import apply_lora, base_model  # noqa: E402
from longrl.rollout import Sampler, SamplingParams  # noqa: E402
from longrl.rollout.attention import KVCache, decode_attention_reference  # noqa: E402

GIB = 2 ** 30
CUDA = torch.cuda.is_available()


def _start_peak() -> int:
    """Reset the peak counter; return what is allocated now."""
    if not CUDA:
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak_above(base: int) -> float:
    return (torch.cuda.max_memory_allocated() - base) / GIB if CUDA else float("nan")


def check_kernel(device) -> float:
    """Max |triton − reference| of the decode attention on odd, block-crossing shapes, per-sequence and grouped
    prefix reads (GPU twin check)."""
    from longrl.rollout.decode_kernel import decode_attention_triton

    torch.manual_seed(0)
    worst = 0.0
    for (P, S, Hq, Hkv, Lp, T, D) in [(3, 7, 32, 8, 77, 131, 128), (2, 5, 12, 2, 64, 65, 128), (1, 3, 4, 4, 1, 1, 64),
                                      (2, 9, 32, 8, 2100, 40, 128)]:  # last: prompts over two prefix chunks
        mk = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
        k_pre, v_pre, k_suf, v_suf, q = mk(P, Hkv, Lp, D), mk(P, Hkv, Lp, D), mk(S, Hkv, T, D), mk(S, Hkv, T, D), mk(S, Hq, D)
        pidx = torch.randint(0, P, (S,), device=device)
        entry_len = torch.randint(0, Lp + 1, (P,), device=device)
        entry_len[0] = Lp
        slen = torch.randint(1, T + 1, (S,), device=device)
        members = torch.full((P, S), -1, dtype=torch.long)
        for b, e in enumerate(pidx.tolist()):
            members[e, b] = b
        args = (q, k_pre, v_pre, pidx, entry_len[pidx], k_suf, v_suf, slen, D ** -0.5)
        ref = decode_attention_reference(*args).float()
        for kw in ({}, dict(members=members.to(device), prompt_len=entry_len)):
            got = decode_attention_triton(*args, **kw).float()
            worst = max(worst, float((ref - got).abs().max()))
    return worst


def lora_in_bf16(model):
    """transformers' generators run without autocast (continuous batching in its own thread): give them bf16
    adapters, as a PEFT user would (it only makes their step cheaper than longrl's float32 adapters)."""
    for p in model.parameters():
        if p.dtype == torch.float32:
            p.data = p.data.to(torch.bfloat16)
    return model


def model_bytes(model) -> tuple[int, int]:
    """(bytes read per decode step: every parameter but the input embedding; all parameter bytes)."""
    embed = base_model(model).get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - embed.numel() * embed.element_size(), total


def kv_token_bytes(cfg, dtype=torch.bfloat16) -> int:
    """Bytes of one token's keys and values over every layer in a ``dtype`` cache (an FP8 one with its exponents)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return KVCache.nbytes(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, head_dim=head_dim, tokens=1,
                          dtype=dtype)


def run_longrl(model, prompts, G, N, *, cuda_graphs=True, fuse_lora=True, fast_decode=True, pack=True,
               nf4_kernel=False, fp8_kernel=False, kv_cache_dtype="bf16", nf4_halves=False):
    sampler = Sampler(model, None, cuda_graphs=cuda_graphs, fuse_lora=fuse_lora, fast_decode=fast_decode,
                      pack_projections=pack, nf4_kernel=nf4_kernel, fp8_kernel=fp8_kernel,
                      kv_cache_dtype=kv_cache_dtype, nf4_halves=nf4_halves)
    params = SamplingParams(max_new_tokens=N, temperature=1.0, seed=0)
    # warm-up: the very call timed below, so that its Triton compiles (kernels specialise on the slot store's length
    # and the batch) and CUDA-graph captures happen here, not in the timed run (an earlier 2-prompt, 4-token warm-up
    # left them in it)
    sampler.generate(prompts, G, params)
    one = SamplingParams(max_new_tokens=1, seed=0)
    sampler.generate(prompts, G, one)  # the one-token call's own compiles (an FP8 cache's prefill stores) likewise
    base = _start_peak()
    t = time.perf_counter()
    first = sampler.generate(prompts, G, one)  # prefill + first token
    sync()
    prefill_s = time.perf_counter() - t
    prefill_stats = dict(sampler.last_stats)
    t = time.perf_counter()
    out = sampler.generate(prompts, G, params)
    sync()
    total_s = time.perf_counter() - t
    assert all(len(c) == N for c in out.completion_ids) and len(first.completion_ids) == len(prompts) * G
    if fast_decode and not sampler.last_stats["fast_decode"]:  # a fallback must not pass for the fast path's figure
        raise RuntimeError("the fast decode step fell back to transformers' forward (see the log's warning)")
    return dict(seconds=total_s, prefill_s=prefill_s, peak_gib=_peak_above(base),
                kv_gib=sampler.last_stats["kv_cache_bytes"] / GIB, stats=sampler.last_stats, prefill_stats=prefill_stats)


def four_bit_model(shape: str, dev):
    """``shape`` with every decoder projection in bitsandbytes NF4 and LoRA r = 32 (the head stays bf16)."""
    from longrl.models.quantize import quantize_linears_

    model = random_model(shape, dev)
    model.config.use_cache = True
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    quantize_linears_(model, names, torch.bfloat16)
    return apply_lora(model, bench_lora())


def fp8_model(shape: str, dev):
    """``shape`` with every decoder projection in FP8 e4m3 (128 × 128 block scales) and LoRA r = 32 (the head stays
    bf16)."""
    from longrl.models.fp8_linear import quantize_fp8_linears_

    model = random_model(shape, dev)
    model.config.use_cache = True
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    with torch.no_grad():
        quantize_fp8_linears_(model, names, torch.bfloat16)
    return apply_lora(model, bench_lora())


def quantized_model(base: str, shape: str, dev):
    return four_bit_model(shape, dev) if base == "nf4" else fp8_model(shape, dev)


def base_of(impl: str) -> str:
    """Which base an impl runs on: bf16, nf4 (longrl-4bit*) or fp8 (longrl-fp8*)."""
    return "nf4" if impl.startswith("longrl-4bit") else "fp8" if impl.startswith("longrl-fp8") else "bf16"


def fp8_scale_bytes(model) -> int:
    """Bytes of the FP8 layers' block scales (buffers, not parameters)."""
    return sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("weight_scale"))


def nf4_state_bytes(model) -> int:
    """Bytes of bitsandbytes' stored NF4 scales (8-bit absmax, their float32 second level, the code tables)."""
    total = 0
    for m in model.modules():
        state = getattr(getattr(m, "weight", None), "quant_state", None)
        if state is None:
            continue
        parts = [state.absmax, state.code] + ([state.state2.absmax, state.state2.code] if state.nested else [])
        total += sum(t.numel() * t.element_size() for t in parts)
    return total


def run_hf_generate(model, prompts, G, N):
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=None, top_p=None, max_new_tokens=N,
                           min_new_tokens=N, eos_token_id=None, pad_token_id=0, use_cache=True)
    ids = torch.tensor([p for p in prompts for _ in range(G)], device=model.device)  # equal lengths: no padding
    model.eval()
    with torch.no_grad():
        model.generate(input_ids=ids[:2], attention_mask=torch.ones_like(ids[:2]),
                       generation_config=GenerationConfig(**{**cfg.to_dict(), "max_new_tokens": 4, "min_new_tokens": 4}))
        base = _start_peak()
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        sync()
    assert out.shape[1] == ids.shape[1] + N
    return dict(seconds=time.perf_counter() - t, peak_gib=_peak_above(base))


def run_hf_continuous(model, prompts, G, N):
    from transformers import GenerationConfig

    base_m = base_model(model)
    cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=None, top_p=None, max_new_tokens=N,
                           min_new_tokens=N, eos_token_id=None, pad_token_id=0)
    inputs = [p for p in prompts for _ in range(G)]
    saved = base_m.config._attn_implementation
    try:
        with torch.no_grad():
            base_m.generate_batch(inputs=inputs[:2], generation_config=GenerationConfig(
                **{**cfg.to_dict(), "max_new_tokens": 4, "min_new_tokens": 4}))
            base = _start_peak()
            t = time.perf_counter()
            out = base_m.generate_batch(inputs=inputs, generation_config=cfg)
            sync()
        lengths = [len(o.generated_tokens) for o in out.values()]
        if sum(lengths) != len(inputs) * N:
            raise RuntimeError(f"generate_batch returned {sum(lengths)} of {len(inputs) * N} tokens")
        return dict(seconds=time.perf_counter() - t, peak_gib=_peak_above(base),
                    generated=sum(lengths))
    finally:
        base_m.set_attn_implementation(saved)


def _launch_spec(flag: str, spec: str, known: dict, from_file) -> dict:
    """Launch entries of ``known`` from a JSON object, or ``from_file(parsed result file)``; unknown keys refused."""
    chosen = json.loads(spec) if spec.lstrip().startswith("{") else from_file(json.loads(Path(spec).read_text()))
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise SystemExit(f"{flag}: unknown keys {unknown}; the launch table has {sorted(known)}")
    return chosen


def launch_overrides(spec: str, option: str = "--launch") -> dict:
    """decode_kernel.LAUNCH entries from a JSON object, or the fastest row of a decode_attention_speed.py result's
    sweep (``option``: the command-line option errors name)."""
    from longrl.rollout.decode_kernel import LAUNCH

    def fastest(result: dict) -> dict:
        rows = [r for r in result.get("sweep", []) if "us" in r]
        if not rows:
            raise SystemExit(f"{option} {spec}: no timed sweep row in it (run decode_attention_speed.py --sweep)")
        best = min(rows, key=lambda r: r["us"] + r.get("us_short", 0.0))  # both ends of a rollout, where swept
        return {k: best[k] for k in LAUNCH if k in best}

    return _launch_spec(option, spec, LAUNCH, fastest)


def glue_launch(spec: str, shape: str) -> dict:
    """fused_ops.LAUNCH entries from a JSON object, or a decode_glue_speed.py result's fastest at ``shape``."""
    from longrl.rollout.fused_ops import LAUNCH

    def fastest(result: dict) -> dict:
        best = result.get("best", {})
        chosen = next((v for k, v in best.items() if k.split()[0] == shape), None)
        if chosen is None:
            raise SystemExit(f"--glue-launch {spec}: no fastest choice for {shape} in it (shapes: {sorted(best)})")
        return chosen

    return _launch_spec("--glue-launch", spec, LAUNCH, fastest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap, prompts=16)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--impls", default="longrl,longrl-nolora,hf-generate,hf-continuous")
    ap.add_argument("--tag", default="")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="only profile the LoRA model's decode kernels over N new tokens (CUDA graphs on) and exit")
    ap.add_argument("--profile-4bit", action="store_true",
                    help="with --profile: profile the 4-bit (NF4) model of longrl-4bit instead of the bf16 one")
    ap.add_argument("--profile-fp8", action="store_true",
                    help="with --profile: profile the FP8 model of longrl-fp8 instead of the bf16 one")
    ap.add_argument("--kv-cache-dtype", default="bf16", choices=("bf16", "fp8"),
                    help="with --profile: the sampler's KV cache (generation.kv_cache_dtype)")
    ap.add_argument("--profile-variants", default="packed,hf", metavar="LIST",
                    help="with --profile: which decode paths to profile, of packed (the defaults: fast decode, fused "
                    "LoRA, packed projections), fused (the same unpacked) and hf (transformers' forward + PEFT's LoRA)")
    ap.add_argument("--launch", default="", metavar="JSON|PATH",
                    help="decode attention launch choices to run with (decode_kernel.LAUNCH entries), as a JSON "
                    "object or a decode_attention_speed.py result whose fastest swept choice is taken")
    ap.add_argument("--nf4-launch", default="", metavar="JSON|PATH",
                    help="launch table of the NF4 product (ops/nf4_matmul.LAUNCH, by rows), as a JSON object or a "
                    "benchmarks/nf4_matmul.py --sweep result whose 'best' is taken")
    ap.add_argument("--fp8-launch", default="", metavar="JSON|PATH",
                    help="launch table of the FP8 product (ops/fp8_matmul.LAUNCH, by rows), as a JSON object or a "
                    "benchmarks/nf4_matmul.py --fp8 --sweep result (fp8_matmul_<card>_sweep.json) whose 'best' is taken")
    ap.add_argument("--glue-launch", default="", metavar="JSON|PATH",
                    help="launch choices of the LoRA-folding SiLU·up kernel (fused_ops.LAUNCH entries), as a JSON "
                    "object or a decode_glue_speed.py result whose fastest choice at this shape is taken")
    args = ap.parse_args()
    if args.launch:
        from longrl.rollout import decode_kernel

        decode_kernel.LAUNCH.update(launch_overrides(args.launch))
        print("decode attention launch", decode_kernel.LAUNCH, flush=True)
    if args.glue_launch:
        from longrl.rollout import fused_ops

        fused_ops.LAUNCH.update(glue_launch(args.glue_launch, args.shape))
        print("glue launch:", fused_ops.LAUNCH, flush=True)
    use_product_launches(args.nf4_launch, args.fp8_launch)
    dev = torch.device("cuda" if CUDA else "cpu")  # CPU: a smoke run of the script (--shape tiny)
    impls = args.impls.split(",")
    if args.profile and (args.profile_4bit or args.profile_fp8):  # a quantized model with its adapters, decode
        # products on its kernel
        model = quantized_model("nf4" if args.profile_4bit else "fp8", args.shape, dev)
        profile_decode(args, model, random_prompts(args.prompts, args.prompt_len, model.config.vocab_size))
        return
    model = random_model(args.shape, dev)
    model.config.use_cache = True
    vocab = model.config.vocab_size
    prompts = random_prompts(args.prompts, args.prompt_len, vocab)
    results: dict = {"kernel_max_abs_err": check_kernel(dev) if CUDA else float("nan"),
                     "copy_bandwidth_gbs": copy_bandwidth(dev) / 1e9 if CUDA else float("nan")}
    print(f"decode kernel vs reference: max abs err {results['kernel_max_abs_err']:.3g}; "
          f"copy bandwidth {results['copy_bandwidth_gbs']:.0f} GB/s", flush=True)
    kv_token = kv_token_bytes(model.config)
    n_seq, N, Lp = args.prompts * args.G, args.new_tokens, args.prompt_len
    if "longrl-nolora" in impls:
        step_bytes, _ = model_bytes(model)
        r = run_longrl(model, prompts, args.G, N)
        results["longrl-nolora"] = {**r, "step_weight_bytes": step_bytes, "weights_gib": model_bytes(model)[1] / GIB}
        print("longrl-nolora", {k: v for k, v in r.items() if not k.endswith("stats")}, flush=True)
    model = apply_lora(model, bench_lora())
    if args.profile:
        profile_decode(args, model, prompts)
        return
    step_bytes, weight_bytes = model_bytes(model)
    derive(results, n_seq, N, Lp, kv_token, args.prompts)
    write_tables(args, results, weight_bytes)
    bf16_weight_bytes, on_base = weight_bytes, "bf16"
    order = ("bf16", "nf4", "fp8")  # the quantized bases after the bf16 one, each built when the previous is dropped
    for name in sorted((i for i in impls if i != "longrl-nolora"), key=lambda i: order.index(base_of(i))):
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        try:
            if base_of(name) != on_base:
                model, on_base = None, base_of(name)
                gc.collect()
                torch.cuda.empty_cache() if CUDA else None
                model = quantized_model(on_base, args.shape, dev)
                step_bytes, weight_bytes = model_bytes(model)
                step_bytes += nf4_state_bytes(model) if on_base == "nf4" else fp8_scale_bytes(model)
                print(f"{on_base} model: {weight_bytes / GIB:.2f} GiB of parameters; a decode step reads "
                      f"{step_bytes / GIB:.2f} GiB of weights", flush=True)
            if name == "longrl":
                r = run_longrl(model, prompts, args.G, N)
            elif name == "longrl-4bit":
                r = run_longrl(model, prompts, args.G, N, nf4_kernel=True)
                if r["stats"]["nf4_projections"] == 0:
                    raise RuntimeError("no projection ran on the NF4 kernel")
            elif name == "longrl-4bit-bnb":
                r = run_longrl(model, prompts, args.G, N, nf4_kernel=False)
            elif name == "longrl-fp8":
                r = run_longrl(model, prompts, args.G, N, fp8_kernel=True)
                if CUDA and r["stats"]["fp8_projections"] == 0:
                    raise RuntimeError("no projection ran on the FP8 kernel")
            elif name == "longrl-fp8-dequant":
                r = run_longrl(model, prompts, args.G, N, fp8_kernel=False)
            elif name == "longrl-hf":
                r = run_longrl(model, prompts, args.G, N, fast_decode=False)
            elif name == "longrl-peft":
                r = run_longrl(model, prompts, args.G, N, fuse_lora=False, fast_decode=False)
            elif name == "longrl-packed":  # the default since 2026-11-30 (the name kept for older commands)
                r = run_longrl(model, prompts, args.G, N, pack=True)
            elif name == "longrl-unpacked":
                r = run_longrl(model, prompts, args.G, N, pack=False)
            elif name == "longrl-eager":
                r = run_longrl(model, prompts, args.G, N, cuda_graphs=False)
            elif name == "hf-generate":
                r = run_hf_generate(lora_in_bf16(model), prompts, args.G, N)
            elif name == "hf-continuous":
                r = run_hf_continuous(lora_in_bf16(model), prompts, args.G, N)
            else:
                raise ValueError(f"unknown impl {name}")
            r["step_weight_bytes"], r["weights_gib"] = step_bytes, weight_bytes / GIB
        except Exception as e:  # a baseline that fails is reported, not hidden
            r = {"error": f"{type(e).__name__}: {e}"[:300]}
        results[name] = r
        print(name, {k: v for k, v in r.items() if not k.endswith("stats")}, flush=True)
        derive(results, n_seq, N, Lp, kv_token, args.prompts)
        write_tables(args, results, bf16_weight_bytes)  # after every impl: a later one that hangs loses nothing


def profile_decode(args, model, prompts) -> None:
    """GPU time per kernel of the decode steps alone (decode graphs replayed; the profiler sees their kernels): a
    rollout of N new tokens minus one of 1 (prefill + first token), per step, for the fast path (fast decode +
    fused LoRA, optionally with packed projections) and transformers' forward + PEFT's LoRA (--profile-variants); to
    results/rollout_profile_<shape>_<card><tag>.md."""
    from torch.profiler import ProfilerActivity, profile

    N = args.profile
    titles = {"fused": "fast decode + fused LoRA, projections unpacked", "packed": "fast decode + fused LoRA + packed projections",
              "hf": "transformers forward + PEFT LoRA"}
    lines = []
    for variant in args.profile_variants.split(","):
        if variant not in titles:
            raise SystemExit(f"--profile-variants: unknown {variant!r}; choose from {', '.join(titles)}")
        fuse = variant != "hf"
        sampler = Sampler(model, None, fuse_lora=fuse, fast_decode=fuse, pack_projections=variant == "packed",
                          kv_cache_dtype=args.kv_cache_dtype)
        runs = {}
        for n in (1, N):
            params = SamplingParams(max_new_tokens=n, temperature=1.0, seed=0)
            sampler.generate(prompts, args.G, params)  # warm-up and graph capture
            sync()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                sampler.generate(prompts, args.G, params)
                sync()
                seconds = time.perf_counter() - t
            runs[n] = (seconds, kernel_times(prof))
        steps = N - 1
        per_step = {k: ((us - runs[1][1].get(k, (0, 0))[0]) / steps, (c - runs[1][1].get(k, (0, 0))[1]) / steps)
                    for k, (us, c) in runs[N][1].items()}
        per_step = {k: v for k, v in per_step.items() if v[0] > 0.05}
        wall = (runs[N][0] - runs[1][0]) / steps * 1e6
        base = "NF4 4-bit base, " if args.profile_4bit else "FP8 base, " if args.profile_fp8 else ""
        lines += [f"## {titles[variant]}, {base}{args.kv_cache_dtype} KV cache: {args.prompts} x "
                  f"{args.G}, {steps} decode steps: {wall:,.0f} µs a step wall-clock (rollout of {N} minus rollout "
                  f"of 1); GPU time of ops and kernels a step below (an op's time includes its kernels)", "",
                  "| µs a step | calls a step | name |", "|---|---|---|"]
        lines += [f"| {us:,.1f} | {c:.1f} | {name[:110]} |"
                  for name, (us, c) in sorted(per_step.items(), key=lambda kv: -kv[1][0])[:45]]
        lines.append("")
        print("\n".join(lines[-48:]), flush=True)
    out = RESULTS / f"rollout_profile_{args.shape}_{card_tag()}{args.tag}.md"
    out.write_text("\n".join([f"`{run_meta(shape=args.shape)['command']}`", ""] + lines))


def derive(results: dict, n_seq: int, N: int, Lp: int, kv_token: int, prompts: int) -> None:
    """tokens/s; decode roofline: bytes read per step = weights (all but the input embedding) + every live KV
    byte, each prompt's prefix once (as the grouped kernel reads it), summed over the N − 1 decode steps."""
    kv_bytes = sum((prompts * Lp + n_seq * (t + 1)) * kv_token for t in range(N - 1))
    bw = results["copy_bandwidth_gbs"] * 1e9
    for r in results.values():
        if not isinstance(r, dict) or "seconds" not in r:
            continue
        r["tokens_per_s"] = n_seq * N / r["seconds"]
        if "prefill_s" in r:
            decode_s = r["seconds"] - r["prefill_s"]
            if decode_s <= 0:  # the prefill call took longer than the whole call: one of them was not warm
                raise RuntimeError(f"prefill {r['prefill_s']:.2f} s >= the whole call's {r['seconds']:.2f} s: "
                                   "the timings are not comparable (a compile in one of them?)")
            moved = (N - 1) * r["step_weight_bytes"] + kv_bytes
            r["decode_s"] = decode_s
            r["decode_bandwidth_gbs"] = moved / decode_s / 1e9
            r["roofline_fraction"] = moved / decode_s / bw
            r["roofline_floor_s"] = moved / bw


def use_product_launches(nf4: str, fp8: str) -> None:
    """Replace the NF4 / FP8 products' launch tables (ops/nf4_matmul.LAUNCH, ops/fp8_matmul.LAUNCH, by rows) with
    --nf4-launch / --fp8-launch: a JSON object, or a benchmarks/nf4_matmul.py sweep result whose 'best' is taken
    (empty: keep the table)."""
    from longrl.ops import fp8_matmul, nf4_matmul

    for spec, module, name in ((nf4, nf4_matmul, "NF4"), (fp8, fp8_matmul, "FP8")):
        if spec:
            module.LAUNCH.update(launch_table(spec))
            print(f"{name} launch:", module.LAUNCH, flush=True)


def launch_table(spec: str) -> dict:
    """A launch table by rows from a JSON object or a benchmarks/nf4_matmul.py sweep result whose 'best' is taken
    ({} when empty)."""
    if not spec:
        return {}
    chosen = json.loads(spec) if spec.lstrip().startswith("{") else json.loads(Path(spec).read_text())["best"]
    return {int(k): v for k, v in chosen.items()}


def nf4_launch_table() -> dict:
    from longrl.ops.nf4_matmul import LAUNCH

    return dict(LAUNCH)


def fp8_launch_table() -> dict:
    from longrl.ops.fp8_matmul import LAUNCH

    return dict(LAUNCH)


def write_tables(args, results, weight_bytes) -> None:
    from longrl.rollout.decode_kernel import LAUNCH
    from longrl.rollout.fused_ops import LAUNCH as GLUE_LAUNCH

    meta = run_meta(shape=args.shape, prompts=args.prompts, G=args.G, prompt_len=args.prompt_len,
                    new_tokens=args.new_tokens, weight_gib=weight_bytes / GIB, decode_launch=dict(LAUNCH),
                    glue_launch=dict(GLUE_LAUNCH), nf4_launch=nf4_launch_table(), fp8_launch=fp8_launch_table())
    stem = f"rollout_speed_{args.shape}_{card_tag()}{args.tag}"
    hf = results.get("hf-generate", {}).get("tokens_per_s")
    cb = results.get("hf-continuous", {}).get("tokens_per_s")
    lines = [f"# Rollout speed, {args.shape} shape (random weights, bf16, LoRA r=32 unmerged), {meta['gpu']}",
             "", f"{meta['date']}; torch {meta['torch']}, transformers {meta['transformers']}.  ",
             f"`{meta['command']}`", "",
             f"{args.prompts} prompts × {args.G} completions, prompt {args.prompt_len} tokens, exactly "
             f"{args.new_tokens} new tokens each (EOS ignored), temperature 1. Weights {weight_bytes / GIB:.2f} GiB. "
             f"Copy bandwidth {results['copy_bandwidth_gbs']:.0f} GB/s; decode kernel vs its torch twin: max abs err "
             f"{results['kernel_max_abs_err']:.2g} (bf16). Decode attention launch: {LAUNCH}; SiLU·up LoRA fold launch: "
             f"{GLUE_LAUNCH}.", "",
             "| impl | seconds | tokens/s | × generate | × continuous | decode GB/s | of roofline | peak GiB "
             "| KV cache GiB | peak / (weights + KV) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in ("longrl", "longrl-4bit", "longrl-4bit-bnb", "longrl-fp8", "longrl-fp8-dequant", "longrl-packed", "longrl-unpacked", "longrl-hf",
                 "longrl-peft", "longrl-nolora", "longrl-eager", "hf-generate", "hf-continuous"):
        r = results.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} |" + " |" * 8)
            continue
        tps = r["tokens_per_s"]
        peak = r["peak_gib"] + r["weights_gib"]
        cells = [name, f"{r['seconds']:.2f}", f"{tps:,.0f}", f"{tps / hf:.2f}" if hf else "–",
                 f"{tps / cb:.2f}" if cb else "–",
                 f"{r['decode_bandwidth_gbs']:,.0f}" if "decode_bandwidth_gbs" in r else "–",
                 f"{100 * r['roofline_fraction']:.0f}%" if "roofline_fraction" in r else "–", f"{peak:.2f}",
                 f"{r['kv_gib']:.2f}" if "kv_gib" in r else "–",
                 f"{peak / (r['weights_gib'] + r['kv_gib']):.3f}" if "kv_gib" in r else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    base_tps = results.get("longrl", {}).get("tokens_per_s")
    for name in ("longrl-4bit", "longrl-4bit-bnb", "longrl-fp8", "longrl-fp8-dequant"):
        if base_tps and "tokens_per_s" in results.get(name, {}):
            kind = "fp8" if base_of(name) == "fp8" else "nf4"
            lines += ["", f"{name} / longrl (bf16) tokens/s in this run: {results[name]['tokens_per_s'] / base_tps:.2f}×; "
                      f"packed groups {results[name]['stats'].get('packed_groups')}, projections on the "
                      f"{kind.upper()} kernel {results[name]['stats'].get(kind + '_projections')}."]
    lines += ["", "longrl-4bit: every decoder projection in bitsandbytes NF4 (head bf16), decode products on "
              "longrl's NF4 kernel (generation.nf4_kernel; NF4 launch table " + str(nf4_launch_table()) + "); "
              "longrl-4bit-bnb: the same model through bitsandbytes' own call. Their weights column: the 4-bit "
              "model's parameters; roofline bytes: its codes + bitsandbytes' stored scales + the bf16 rest."]
    if any(base_of(n) == "fp8" for n in results):
        lines += ["", "longrl-fp8: every decoder projection in FP8 e4m3 with 128x128 block scales (head bf16), decode "
                  "products on longrl's FP8 kernel (ops/fp8_matmul.py; launch table " + str(fp8_launch_table()) + "); "
                  "longrl-fp8-dequant: the same model through the FP8 layers' forward (dequantize, then bf16). "
                  "Roofline bytes: the codes + the block scales + the bf16 rest."]
    lines += ["", "longrl: the sampler's defaults: decode steps through rollout/fast_decode.py (fused glue kernels), "
              "LoRA deltas added by fused products (rollout/lora_fusion.py), q/k/v and gate/up (and their LoRA A "
              "rows) read by one product a group (generation.pack_projections; longrl-packed: the same, named; "
              "longrl-unpacked: a product each); longrl-hf: the same as "
              "longrl with transformers' forward for decode "
              "steps; longrl-peft: transformers' forward and PEFT's own LoRA forward; longrl-nolora: the base alone "
              "(before the adapters are attached). "
              "longrl: after a warm-up run of the same call (compiles, graph captures); prefill + first token timed "
              "separately (max_new_tokens=1 run) and subtracted for the decode phase. Roofline: (decode steps × bytes of every weight but the input embedding + every live KV byte, each "
              "prompt's shared prefix counted once) / copy bandwidth. Peak: weights + the most allocated "
              "during the call above what was allocated before it. hf-generate: `model.generate` with the dynamic cache "
              "(sdpa); hf-continuous: `generate_batch` (transformers' continuous batching); both with the adapters cast to "
              "bf16 (longrl keeps them float32 under autocast)."]
    write_result(stem, {**meta, "results": results}, lines)


if __name__ == "__main__":
    main()
