"""Grouped rows (train.shared_prompt) against separate sequences: the reference + policy passes of one GRPO step.

A random-weight model of a real shape with LoRA (r=32 on every linear projection, bf16 base), G completions of R
tokens after one prompt of P tokens, every case run both ways in the same process: each completion with its own
copy of the prompt (today's layout), and grouped rows (the prompt once, then its G completions). Reported per case:
the tokens of the step, the reference pass's and the policy update's seconds, the GPU peak of each way, and the
largest difference between the two ways' log-probs (bf16 rounding; the float64 equality is tests/). The layout is
offloaded checkpointing with attention reuse (what the planner picks for long sequences), micro-batches of one
sequence or one group (--budget to pack more), on CUDA the fused training layers and LoRA (as the trainer runs).

    python benchmarks/shared_prompt_speed.py                               # H200: 8B, G=8, the issue's cases
    python benchmarks/shared_prompt_speed.py --shape tiny --cases 48:8,96:4,16:64 --G 4   # the CPU smoke test
    python benchmarks/shared_prompt_speed.py --cases 512:256 --prompts 8 --budget 16384 --tag _short   # short

The planner's longest prompt at G = 8 with 1K completions (one 22 GiB budget and the whole GPU, with and without
grouped rows) is printed beside the measured cases (--longest-for-gib; a prediction, no run).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import bench_setup as bs  # noqa: E402
from results_io import card_tag, run_meta, write_result  # noqa: E402

from longrl.memory import enable_offloaded_checkpointing, token_budget_groups  # noqa: E402
from longrl.memory.microbatch import prompt_group_batches  # noqa: E402
from longrl.models.lora_training import fused_lora_training  # noqa: E402
from longrl.models.policy import reference_mode, sequence_logprobs  # noqa: E402
from longrl.ops.losses import PolicyLossSettings, loss_token_weights, per_token_policy_loss, weighted_loss  # noqa: E402

GIB = 2 ** 30


def parse_cases(text: str) -> list[tuple[int, int]]:
    """"P:R,P:R" → [(prompt tokens, completion tokens)]."""
    try:
        return [(int(p), int(r)) for p, r in (c.split(":") for c in text.split(","))]
    except ValueError:
        raise SystemExit(f"--cases: expected P:R pairs separated by commas (e.g. 4096:1024,512:20480), got {text!r}")


def make_case(P: int, R: int, G: int, vocab: int, prompts: int = 1, seed: int = 0):
    """(prompt_ids [N·G], completion_ids [N·G], advantages [N·G]): ``prompts`` random prompts of P tokens, G random
    completions of R tokens each."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, vocab, (P,), generator=g).tolist() for _ in range(prompts)]
    completions = torch.randint(3, vocab, (prompts * G, R), generator=g).tolist()
    adv = torch.randn(prompts * G, generator=g)
    return [list(rows[i // G]) for i in range(prompts * G)], completions, (adv - adv.mean()) / (adv.std() + 1e-4)


def micro_batches(prompt_ids, completion_ids, shared: bool, budget: int) -> list[list[int]]:
    """One sequence (or one group) a micro-batch unless --budget packs more, as the trainer splits them; a budget
    below a group's P + ΣR cuts the group into rows of the completions that fit with the prompt (as the planner
    does where a whole group does not fit)."""
    lengths = [len(c) for c in completion_ids]
    if shared:
        group = max(len(p) for p in prompt_ids) + sum(lengths) // len({tuple(p) for p in prompt_ids})
        one = max(len(p) + r for p, r in zip(prompt_ids, lengths))  # a prompt and one completion
        return prompt_group_batches(prompt_ids, lengths, max(budget, one) if budget else group, 0)
    unit = max(len(p) + r for p, r in zip(prompt_ids, lengths))
    return token_budget_groups([len(p) + r for p, r in zip(prompt_ids, lengths)], max(budget, unit))


def step(model, prompt_ids, completion_ids, adv, *, shared: bool, budget: int, beta: float, chunk: int,
         fused_lora: bool) -> dict:
    """The reference pass (no grad, adapters off) and the policy update (forward + backward per micro-batch) of one
    step, timed; the GPU peak over both; the policy's log-probs [G, R] for the comparison."""
    device = next(model.parameters()).device
    width = len(completion_ids[0])
    mask = torch.ones(len(completion_ids), width, device=device)
    settings = PolicyLossSettings(loss_type="dapo", beta=beta)
    weights = loss_token_weights(mask, "dapo", width)
    adv = adv.to(device)
    batches = micro_batches(prompt_ids, completion_ids, shared, budget)
    kw = dict(pad_id=0, chunk_size=chunk, shared_prompt=shared)
    bs.sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    ref = torch.zeros(len(completion_ids), width, device=device)
    if beta:
        with torch.no_grad(), reference_mode(model):
            for idx in batches:
                ref[idx] = sequence_logprobs(model, [prompt_ids[i] for i in idx], [completion_ids[i] for i in idx],
                                             width, **kw)[0].to(ref.dtype)
    bs.sync()
    t1 = time.perf_counter()
    logps = torch.zeros(len(completion_ids), width, device=device)
    with fused_lora_training(model) if fused_lora else contextlib.nullcontext():
        for idx in batches:
            lp, _ = sequence_logprobs(model, [prompt_ids[i] for i in idx], [completion_ids[i] for i in idx], width,
                                      **kw)
            per_token, _ = per_token_policy_loss(lp, lp.detach(), ref[idx] if beta else None, adv[idx], mask[idx],
                                                 settings)
            weighted_loss(per_token, weights[idx]).backward()
            logps[idx] = lp.detach().to(logps.dtype)
            del lp, per_token
    bs.sync()
    t2 = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else 0.0
    model.zero_grad(set_to_none=True)
    return {"reference_s": t1 - t0, "policy_s": t2 - t1, "peak_gib": peak, "micro_batches": len(batches),
            "logps": logps.cpu(), "ref_logps": ref.cpu()}


def host_bytes(offloader) -> dict:
    """Host memory so far: the offloader pool's buffers (the bytes it asked for) and, where torch reports them, its
    pinned allocator's (which rounds each allocation up to a power of two)."""
    out = {"pool_gib": offloader.pool.allocated_bytes / GIB if offloader is not None else 0.0}
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if torch.cuda.is_available() and stats is not None:
        out.update({f"torch_pinned_{k}": v for k, v in stats().items() if "bytes" in k and "current" in k})
    return out


def longest_prompts(shape: str, G: int, R: int, budgets_gib: list[float]) -> list[str]:
    """The planner's longest prompt (a multiple of 1,024 tokens) whose step fits each budget, with and without
    grouped rows, for LoRA on a bf16 base and on a 4-bit base (predicted, not run)."""
    import trl_baseline as tb

    from longrl.config import load_config
    from longrl.memory.planner import PlanError, plan_for_config

    model_config = tb._make_config(shape, "sdpa")
    lines = ["| base | GPU memory | longest prompt, separate | longest prompt, grouped |", "| --- | --- | --- | --- |"]
    for four_bit in (False, True):
        for gib in budgets_gib:
            found = []
            for shared in ("false", "true"):
                def fits(P: int) -> bool:
                    cfg = load_config(None, ["model.dtype=bfloat16", "lora.r=32", f"model.load_in_4bit={four_bit}",
                                             f"data.max_prompt_length={P}", f"generation.max_completion_length={R}",
                                             "train.prompts_per_step=1", f"grpo.num_generations={G}",
                                             f"train.shared_prompt={shared}", "generation.backend=hf",
                                             "rewards=[{function: 'tasks:reward'}]"])
                    try:
                        plan_for_config(cfg, model_config, int(gib * GIB), 500 * GIB)
                        return True
                    except PlanError:
                        return False
                lo, hi = 0, 1024  # in units of 1,024 tokens
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if fits(mid * 1024) else (lo, mid - 1)
                found.append(f"{lo * 1024:,}" if lo else "none")
            lines.append(f"| {'4-bit' if four_bit else 'bf16'} | {gib:g} GiB | {found[0]} | {found[1]} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--cases", default="4096:1024,16384:1024,32768:1024,512:20480",
                    help="prompt:completion token pairs (default: the issue's cases)")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=1, help="prompts a step (each with G completions)")
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--beta", type=float, default=0.04, help="> 0: the reference pass runs (adapters off)")
    ap.add_argument("--budget", type=int, default=0, help="micro-batch token budget (0: one sequence or group)")
    ap.add_argument("--chunk", type=int, default=4096, help="log-prob chunk rows")
    ap.add_argument("--layout", choices=["reuse", "offload", "plain"], default="reuse")
    ap.add_argument("--no-fused", action="store_true", help="transformers' own norms/MLP/rotary and PEFT's LoRA")
    ap.add_argument("--order", default="grouped,separate", help="which way runs first in each case")
    ap.add_argument("--longest-for-gib", default="22,139", help="GPU budgets of the planner's longest-prompt table "
                    "('' skips it)")
    ap.add_argument("--repeat", type=int, default=2, help="steps a way and case, the last one timed (the earlier "
                    "ones warm the host pool at these lengths, as a run's later steps find it)")
    ap.add_argument("--exact-pinned", action="store_true",
                    help="the offloader's host buffers page-locked by whole pages (PinnedPool.EXACT_PINNED), not by "
                         "torch's pinned allocator (a power of two each)")
    ap.add_argument("--tag", default="", help="appended to the results' file names")
    args = ap.parse_args()
    cases = parse_cases(args.cases)
    order = args.order.split(",")
    if sorted(order) != ["grouped", "separate"]:
        raise SystemExit("--order: grouped,separate or separate,grouped")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(min(4, torch.get_num_threads()))

    if args.exact_pinned:
        from longrl.memory.offload import PinnedPool

        PinnedPool.EXACT_PINNED = True
    lora = bs.bench_lora()
    lora.r, lora.alpha = args.lora_r, 2.0 * args.lora_r
    import trl_baseline as tb

    from longrl.models import apply_lora

    model = apply_lora(tb.build_random_model(args.shape, device, dtype, attn_implementation="sdpa"), lora)
    with torch.no_grad():  # adapters that change the output (B = 0 would make policy and reference one model)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    if args.layout != "plain":
        offloader = enable_offloaded_checkpointing(model, reuse_attention=args.layout == "reuse")
    else:
        from torch.utils.checkpoint import checkpoint
        import functools

        model.get_base_model()._set_gradient_checkpointing(
            enable=True, gradient_checkpointing_func=functools.partial(checkpoint, use_reentrant=False))
    model.train()
    vocab = model.config.vocab_size
    fused_lora = device.type == "cuda" and not args.no_fused
    if fused_lora:  # the trainer's model.fused_layers (RMSNorm, SiLU·up, rotary kernels)
        from longrl.models.fused_layers import enable_fused_layers

        enable_fused_layers(model)
    run = dict(budget=args.budget, beta=args.beta, chunk=args.chunk, fused_lora=fused_lora)

    # warm-up: kernels, autotuning and the allocator, on the smallest case both ways
    P0, R0 = min(cases, key=lambda c: c[0] + c[1])
    warm = make_case(min(P0, 1024), min(R0, 256), args.G, vocab, args.prompts, seed=99)
    for shared in (True, False):
        step(model, *warm, shared=shared, **run)

    rows, payload = [], {"cases": []}
    for P, R in cases:
        prompt_ids, completion_ids, adv = make_case(P, R, args.G, vocab, args.prompts)
        out = {}
        for way in order:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            for _ in range(max(1, args.repeat)):
                out[way] = step(model, prompt_ids, completion_ids, adv, shared=way == "grouped", **run)
        g, s = out["grouped"], out["separate"]
        diff = float((g["logps"] - s["logps"]).abs().max())
        ref_diff = float((g["ref_logps"] - s["ref_logps"]).abs().max())
        tokens = {"separate": args.prompts * args.G * (P + R), "grouped": args.prompts * (P + args.G * R)}
        total = {w: out[w]["reference_s"] + out[w]["policy_s"] for w in out}
        host = host_bytes(offloader if args.layout != "plain" else None)
        record = dict(P=P, R=R, G=args.G, prompts=args.prompts, tokens=tokens, host=host,
                      max_abs_logp_diff=diff, max_abs_ref_logp_diff=ref_diff,
                      **{w: {k: v for k, v in out[w].items() if k not in ("logps", "ref_logps")} for w in out},
                      speedup=total["separate"] / total["grouped"])
        payload["cases"].append(record)
        rows.append(f"| {P:,} | {R:,} | {tokens['separate']:,} / {tokens['grouped']:,} | "
                    f"{s['reference_s']:.2f} / {g['reference_s']:.2f} | {s['policy_s']:.2f} / {g['policy_s']:.2f} | "
                    f"{total['separate'] / total['grouped']:.2f}× | {s['peak_gib']:.1f} / {g['peak_gib']:.1f} | "
                    f"{diff:.3g} / {ref_diff:.3g} |")
        print(rows[-1], flush=True)

    meta = run_meta(shape=args.shape, G=args.G, repeat=args.repeat, prompts=args.prompts,
                    lora_r=args.lora_r, beta=args.beta, layout=args.layout,
                    budget=args.budget, fused_lora=fused_lora, dtype=str(dtype))
    lines = ["# Grouped rows (train.shared_prompt) vs separate sequences: reference + policy passes", "",
             f"{meta['gpu']}, torch {meta['torch']}, transformers {meta['transformers']}, {meta['date']}; "
             f"`{meta['command']}`", "",
             f"{args.shape}, LoRA r={args.lora_r} ({dtype} base), G={args.G}, {args.prompts} prompt(s) a step, "
             f"beta={args.beta}, "
             f"layout {args.layout}, each way's step {args.repeat} times a case (the last timed), micro-batches: "
             + (f"{args.budget:,} tokens" if args.budget else "one sequence / one group") + "; each cell separate / "
             "grouped.", "",
             "| prompt | completion | tokens a step | reference s | policy s | speed-up | peak GiB "
             "| max abs Δ log-prob (policy / reference) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows]
    budgets = [float(x) for x in args.longest_for_gib.split(",") if x]
    if budgets:
        lines += ["", f"The planner's longest prompt at G={args.G} with 1,024-token completions (predicted):", "",
                  *longest_prompts(args.shape, args.G, 1024, budgets)]
    payload["meta"] = meta
    gpu = "cpu" if device.type == "cpu" else card_tag()
    write_result(f"shared_prompt_speed_{args.shape}_{gpu}{args.tag}", payload, lines)


if __name__ == "__main__":
    main()
