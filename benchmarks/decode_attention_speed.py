"""Decode attention alone: longrl's Triton kernels (grouped prefix + split suffix + merge) against the bytes they
must read, at the sampler's real shapes, beside PyTorch SDPA on the same keys laid out densely.

One decode step of one layer reads each prompt's prefix keys/values once (shared by its G sequences) and each
sequence's own suffix keys/values:

    bytes = 2 · Hkv · D · elt · (P · Lp + Σ_b s_b)          (K and V)

so its floor is bytes / copy bandwidth. The rollout benchmark's roofline counts these bytes with the weights;
this separates how close the attention itself comes (the 8B shape at 1,024 new tokens reads ~9 GB of KV a step
at the end, on the order of the 15 GB of weights). Times are GPU time per call replayed from a CUDA graph, as the
sampler runs a decode step (timed call by call, the host's four launches dominate short suffixes).

    python benchmarks/decode_attention_speed.py                         # Llama-3.1-8B heads, 16 × 8, prompt 512
    python benchmarks/decode_attention_speed.py --prompts 2 --max-suffix 16384 --suffix 1024,8192,16384

SDPA's row: `scaled_dot_product_attention` with enable_gqa on dense [B, Hkv, Lp + s, D] keys (the prefix copied
per sequence, so it reads G× the prefix bytes); its bytes are counted as it reads them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from results_io import card_tag, copy_bandwidth, graph_kernel_times, graph_seconds, run_meta, write_result  # noqa: E402

from longrl.rollout.attention import decode_attention_reference  # noqa: E402


SWEEP = [dict(block=b, warps=w, stages=2, programs=pr, prefix_programs=pp) for b in (32, 64) for w in (4, 8)
         for pr in (2048, 4096, 8192) for pp in (128, 512)]  # 128: the prompt in chunks of ≤ 1,024 at 16 × 8


def step_inputs(P: int, G: int, Hq: int, Hkv: int, D: int, Lp: int, T: int, s: int, dtype, dev):
    """(args, grouping kwargs, KV bytes) of one decode step of one layer: P prompts × G sequences, prefix Lp, suffix
    s valid of T allocated; args as decode_attention_triton / decode_attention_reference take them."""
    B = P * G
    mk = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype)  # noqa: E731
    k_pre, v_pre, k_suf, v_suf, q = mk(P, Hkv, Lp, D), mk(P, Hkv, Lp, D), mk(B, Hkv, T, D), mk(B, Hkv, T, D), mk(B, Hq, D)
    pidx = torch.arange(B, device=dev) // G  # [B]
    args = (q, k_pre, v_pre, pidx, torch.full((B,), Lp, device=dev), k_suf, v_suf, torch.full((B,), s, device=dev),
            D ** -0.5)
    grouping = dict(members=torch.arange(B, device=dev).view(P, G), prompt_len=torch.full((P,), Lp, device=dev))
    return args, grouping, 2 * Hkv * D * torch.empty((), dtype=dtype).element_size() * (P * Lp + B * s)


def sweep_choices(programs: str = "", prefix_programs: str = "") -> list[dict]:
    """SWEEP, its target program counts replaced by the comma-separated lists given (empty: SWEEP's own)."""
    pr = sorted({int(x) for x in programs.split(",")}) if programs else sorted({c["programs"] for c in SWEEP})
    pp = (sorted({int(x) for x in prefix_programs.split(",")}) if prefix_programs
          else sorted({c["prefix_programs"] for c in SWEEP}))
    shapes = sorted({(c["block"], c["warps"], c["stages"]) for c in SWEEP})
    return [dict(block=b, warps=w, stages=st, programs=n, prefix_programs=m) for b, w, st in shapes for n in pr
            for m in pp]


def sweep(P: int, G: int, Hq: int, Hkv: int, D: int, Lp: int, T: int, s: int, s_short: int, dev,
          choices: list[dict] | None = None) -> list[dict]:
    """Time every launch choice of ``choices`` (default SWEEP) at suffix s and at the short suffix s_short (a
    rollout passes through both; the fixed cost of a call shows at the short one); those that do not build, e.g.
    over shared memory, skipped and said; each checked against the reference."""
    from longrl.rollout.decode_kernel import decode_attention_triton

    args, kw, kv_bytes = step_inputs(P, G, Hq, Hkv, D, Lp, T, s, torch.bfloat16, dev)
    short_args, _, _ = step_inputs(P, G, Hq, Hkv, D, Lp, T, s_short, torch.bfloat16, dev)
    ref = decode_attention_reference(*args).float()
    rows = []
    for launch in choices or SWEEP:
        try:
            err = float((decode_attention_triton(*args, **kw, launch=launch).float() - ref).abs().max())
            t = graph_seconds(lambda: decode_attention_triton(*args, **kw, launch=launch))
            t_short = graph_seconds(lambda: decode_attention_triton(*short_args, **kw, launch=launch))
        except Exception as e:  # noqa: BLE001 - a launch choice that does not build is skipped, and said
            rows.append({**launch, "error": f"{type(e).__name__}: {str(e)[:80]}"})
            continue
        rows.append({**launch, "us": t * 1e6, "us_short": t_short * 1e6, "gbs": kv_bytes / t / 1e9,
                     "max_abs_err": err})
    return rows


def case(P: int, G: int, Hq: int, Hkv: int, D: int, Lp: int, T: int, s: int, dtype, dev,
         kernels: bool = False) -> dict:
    """longrl's kernels and SDPA (dense keys, the prefix copied per sequence) on one decode step of one layer;
    ``kernels``: also {kernel: GPU µs per call} of longrl's call (graph replays, profiled) as ``kernels_us``."""
    from longrl.rollout.decode_kernel import decode_attention_triton

    args, kw, kv_bytes = step_inputs(P, G, Hq, Hkv, D, Lp, T, s, dtype, dev)
    q, k_pre, v_pre, pidx, _, k_suf, v_suf, _, _ = args
    B = P * G
    longrl = lambda: decode_attention_triton(*args, **kw)  # noqa: E731
    err = float((longrl().float() - decode_attention_reference(*args).float()).abs().max()) if B * (Lp + s) <= 2 ** 21 else None
    t_longrl = graph_seconds(longrl)
    per_kernel = graph_kernel_times(longrl) if kernels else None

    kd = torch.cat([k_pre[pidx], k_suf[:, :, :s]], dim=2)  # [B, Hkv, Lp + s, D]
    vd = torch.cat([v_pre[pidx], v_suf[:, :, :s]], dim=2)
    qd = q[:, :, None, :]  # [B, Hq, 1, D]
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)  # noqa: E731
    t_sdpa = graph_seconds(sdpa)
    sdpa_bytes = 2 * Hkv * D * torch.empty((), dtype=dtype).element_size() * B * (Lp + s)
    return dict(P=P, G=G, Lp=Lp, T=T, suffix=s, kv_mb=kv_bytes / 1e6, longrl_us=t_longrl * 1e6,
                longrl_gbs=kv_bytes / t_longrl / 1e9, sdpa_us=t_sdpa * 1e6, sdpa_gbs=sdpa_bytes / t_sdpa / 1e9,
                max_abs_err=err, kernels_us=per_kernel)


def main() -> None:
    from longrl.rollout.decode_kernel import LAUNCH

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--heads", default="32,8,128", help="query heads, key/value heads, head dim")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-suffix", type=int, default=1024, help="allocated slot-store length T")
    ap.add_argument("--suffix", default="1,128,512,1024", help="valid suffix lengths to time")
    ap.add_argument("--sweep", action="store_true", help="also time the kernels' launch choices (SWEEP) at the "
                    "longest suffix")
    ap.add_argument("--sweep-programs", default="", help="the sweep's target programs for the sequences' own keys, "
                    "comma-separated (default: SWEEP's 2048,4096,8192; fewer programs: fewer partials to merge)")
    ap.add_argument("--sweep-prefix-programs", default="", help="the same for the shared prompts (default 128,512)")
    ap.add_argument("--breakdown", action="store_true", help="also the GPU time of each kernel of a call at every "
                    "suffix (profiled graph replays)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_attention_speed.py times CUDA kernels; no GPU here")
    dev = torch.device("cuda")
    Hq, Hkv, D = (int(x) for x in args.heads.split(","))
    bw = copy_bandwidth(dev)
    rows = [case(args.prompts, args.G, Hq, Hkv, D, args.prompt_len, args.max_suffix, int(s), torch.bfloat16, dev,
                 kernels=args.breakdown) for s in args.suffix.split(",")]
    for r in rows:
        r["longrl_of_copy_bw"] = r["longrl_gbs"] * 1e9 / bw
        print(r, flush=True)
    meta = run_meta(copy_bandwidth_gbs=bw / 1e9)
    stem = f"decode_attention_{args.prompts}x{args.G}_T{args.max_suffix}_{card_tag()}{args.tag}"
    lines = [f"# Decode attention, one layer, {args.prompts} prompts × {args.G}, heads {Hq}/{Hkv}×{D}, bf16, "
             f"{meta['gpu']}", "", f"{meta['date']}; torch {meta['torch']}.  ", f"`{meta['command']}`", "",
             f"Prefix {args.prompt_len} tokens shared by each prompt's {args.G} sequences; slot store of "
             f"{args.max_suffix} positions. Copy bandwidth {bw / 1e9:,.0f} GB/s. Bytes: K and V read once "
             "(prefix once per prompt); SDPA reads the prefix once per sequence.", "",
             "| suffix | KV MB | longrl µs | longrl GB/s | of copy bw | SDPA µs | SDPA GB/s | max abs err |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = f"{r['max_abs_err']:.4f}" if r["max_abs_err"] is not None else "–"
        lines.append(f"| {r['suffix']} | {r['kv_mb']:.1f} | {r['longrl_us']:.1f} | {r['longrl_gbs']:,.0f} | "
                     f"{100 * r['longrl_of_copy_bw']:.0f}% | {r['sdpa_us']:.1f} | {r['sdpa_gbs']:,.0f} | {err} |")
    swept = []
    if args.breakdown:
        kernels = {r["suffix"]: r["kernels_us"] for r in rows}
        names = sorted({k for per in kernels.values() for k in per}, key=lambda k: -max(
            per.get(k, 0.0) for per in kernels.values()))
        lines += ["", "GPU µs a call, kernel by kernel (graph replays under the profiler):", "",
                  "| kernel | " + " | ".join(f"suffix {x}" for x in kernels) + " |",
                  "|---|" + "---|" * len(kernels)]
        lines += [f"| {name[:70]} | " + " | ".join(f"{per.get(name, 0.0):.1f}" for per in kernels.values()) + " |"
                  for name in names]
    if args.sweep:
        suffixes = [int(x) for x in args.suffix.split(",")]
        s_max, s_min = max(suffixes), min(suffixes)
        swept = sweep(args.prompts, args.G, Hq, Hkv, D, args.prompt_len, args.max_suffix, s_max, s_min, dev,
                      sweep_choices(args.sweep_programs, args.sweep_prefix_programs))
        ok = sorted((r for r in swept if "us" in r), key=lambda r: r["us"] + r["us_short"])
        keys = tuple(SWEEP[0])  # block, warps, stages, programs, prefix_programs (LAUNCH also has fp8_f16)
        head = "/".join(str(LAUNCH[k]) for k in keys)
        lines += ["", f"Launch choices (block, warps, stages, target programs for the sequences' own keys and for "
                  f"the shared prompts; by the sum of the two times, fastest first; default {head}):", "",
                  f"| block | warps | stages | programs | prompt programs | µs at {s_max} | GB/s | µs at {s_min} "
                  "| max abs err |", "|---|---|---|---|---|---|---|---|---|"]
        knobs = lambda r: "| " + " | ".join(str(r[k]) for k in keys) + " |"  # noqa: E731
        lines += [f"{knobs(r)} {r['us']:.1f} | {r['gbs']:,.0f} | {r['us_short']:.1f} | {r['max_abs_err']:.4f} |"
                  for r in ok]
        lines += [f"{knobs(r)} failed: {r['error']} | | | |" for r in swept if "error" in r]
    write_result(stem, {**meta, **vars(args), "rows": rows, "sweep": swept}, lines)


if __name__ == "__main__":
    main()
