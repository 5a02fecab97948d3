"""One GRPO training step (reference log-prob pass + policy forward/backward), longrl vs TRL, same GPU.

Random-weight models of real shapes, LoRA r=32 on every linear projection, bf16 base, G completions of a
fixed length (prompt 512), one fabricated batch shared by every implementation. Runs the variants
alternately after a warm-up and writes a markdown + JSON table to benchmarks/results/.

    python benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 4096,20480 --impls longrl,longrl-plain,trl-frugal,trl-default
    python benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 131072 --G 1 --impls longrl   # length probe
    python benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 20480 --impls longrl --load-in-4bit  # QLoRA
    python benchmarks/grpo_memory.py --shape llama-3.1-8b --lengths 20480 --impls longrl --mlp-tile 0,4096  # tiling
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import trl_baseline as tb  # noqa: E402

from longrl.config.schema import LoraConfig  # noqa: E402
from longrl.memory import disable_mlp_tiling, enable_mlp_tiling, enable_offloaded_checkpointing, token_budget_groups  # noqa: E402,E501
from longrl.memory.planner import GIB, ModelShape, Plan, PlanError, make_plan, predict  # noqa: E402
from longrl.ops.attention_backend import sdpa_priority  # noqa: E402
from longrl.models import apply_lora, calibration_ids, quantize_model, set_lora_input_casting  # noqa: E402
from longrl.models.fused_layers import disable_fused_layers, enable_fused_layers  # noqa: E402
from longrl.rollout.sampling import triton_available  # noqa: E402
from longrl.models.lora_training import fused_lora_training  # noqa: E402
from longrl.ops.losses import PolicyLossSettings, loss_token_weights, per_token_policy_loss, weighted_loss  # noqa: E402
from longrl.models.policy import reference_mode, sequence_logprobs  # noqa: E402


def _host_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def set_checkpointing(model, mode: str, gpu_resident: int = 0):
    base = model.get_base_model()
    if mode in ("offload", "reuse"):  # reuse: attention outputs kept with the inputs (model.reuse_attention)
        return enable_offloaded_checkpointing(model, gpu_resident=gpu_resident, reuse_attention=mode == "reuse")
    from torch.utils.checkpoint import checkpoint
    import functools

    base._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=functools.partial(checkpoint, use_reentrant=False))
    return None


def longrl_step(model, batch, *, beta: float, token_budget: int, chunk: int, mode: str, gpu_resident: int = 0,
                mlp_tile: int | None = None, fused: bool = False, fused_lora: bool = False):
    """One step the way longrl's trainer runs it (the MLP in tiles of ``mlp_tile`` tokens if set, the fused
    RMSNorm and SiLU·up kernels if ``fused``, the policy's LoRA through models/lora_training.py if
    ``fused_lora``); returns timings and peaks. Leaves the model untiled and unfused."""
    offloader = set_checkpointing(model, mode, gpu_resident)
    if mlp_tile:
        enable_mlp_tiling(model, mlp_tile)
    if fused:
        enable_fused_layers(model)
    model.train()
    prompts = batch["prompt_ids"].tolist()
    completions = batch["completion_ids"].tolist()
    adv = batch["advantages"].float()
    width = len(completions[0])
    mask = torch.ones(len(completions), width, device=adv.device)
    settings = PolicyLossSettings(loss_type="dapo", beta=beta)
    weights = loss_token_weights(mask, "dapo", width)
    groups = token_budget_groups([len(p) + len(c) for p, c in zip(prompts, completions)], token_budget)
    _sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    ref = None
    if beta:
        ref = torch.zeros(len(completions), width, device=adv.device)
        with torch.no_grad(), reference_mode(model):
            for idx in groups:
                lp, _ = sequence_logprobs(model, [prompts[i] for i in idx], [completions[i] for i in idx], width,
                                          pad_id=0, chunk_size=chunk)
                ref[idx] = lp
    _sync()
    t1 = time.perf_counter()
    logp_total = torch.zeros((), dtype=torch.float64, device=adv.device)  # the policy forward's output, summed
    with fused_lora_training(model) if fused_lora else contextlib.nullcontext():  # as the trainer: every
        for idx in groups:  # micro-batch's forward and backward inside one context
            lp, _ = sequence_logprobs(model, [prompts[i] for i in idx], [completions[i] for i in idx], width,
                                      pad_id=0, chunk_size=chunk)
            ptl, _ = per_token_policy_loss(lp, lp.detach(), ref[idx] if ref is not None else None, adv[idx],
                                           mask[idx], settings)
            weighted_loss(ptl, weights[idx]).backward()
            logp_total += lp.detach().sum()
            del lp, ptl
    _sync()
    t2 = time.perf_counter()
    disable_mlp_tiling(model)
    disable_fused_layers(model)
    return {"ref_s": t1 - t0, "policy_s": t2 - t1, "peak_gpu_gib": torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0,
            "pinned_pool_gib": (offloader.pool.allocated_bytes / GIB) if offloader else 0.0, "oom": False,
            "policy_logp_sum": float(logp_total)}


def grads_of(model):
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def zero_grads(model):
    for p in model.parameters():
        p.grad = None


def check_offload_equality(shape: str, device) -> dict:
    """Gradients of offloaded (and offloaded with attention reuse) vs plain checkpointing on the GPU (and plain vs
    plain, the noise floor)."""
    model = tb.build_random_model(shape, device, torch.bfloat16)
    model = apply_lora(model, LoraConfig(r=8, alpha=16, dropout=0.1))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    batch = tb.make_batch(4, 64, 200, model.config.vocab_size, device, seed=1)
    out = {}
    runs, logps = {}, {}
    for name, mode in (("plain_a", "plain"), ("plain_b", "plain"), ("offload", "offload"), ("reuse", "reuse")):
        zero_grads(model)
        torch.manual_seed(7)
        logps[name] = longrl_step(model, batch, beta=0.04, token_budget=600, chunk=256, mode=mode)["policy_logp_sum"]
        runs[name] = grads_of(model)

    def maxdiff(a, b):
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    out["plain_vs_plain_max_abs"] = maxdiff(runs["plain_a"], runs["plain_b"])
    out["offload_vs_plain_max_abs"] = maxdiff(runs["offload"], runs["plain_a"])
    out["offload_equals_plain_exactly"] = all(torch.equal(runs["offload"][k], runs["plain_a"][k]) for k in runs["plain_a"])
    out["reuse_vs_plain_max_abs"] = maxdiff(runs["reuse"], runs["plain_a"])
    out["reuse_equals_plain_exactly"] = all(torch.equal(runs["reuse"][k], runs["plain_a"][k]) for k in runs["plain_a"])
    # the policy forward's log-probs (summed) of each run: reuse's forward asks the fused attention kernel for its
    # log-sum-exp too, which some kernels (memory-efficient, used with a packing mask) compute in another order, so
    # where reuse's gradients differ this says whether its forward already did
    out["policy_logp_sum"] = logps
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


LONGRL_IMPLS = {"longrl-planned": "offload",  # the planner's layout for this GPU's free memory
                "longrl": "offload",  # the frugal layout: every layer input offloaded
                "longrl-reuse": "reuse",  # frugal layout + attention outputs kept, not recomputed
                "longrl-plain": "plain"}  # plain checkpointing


def parse_impl(impl: str) -> tuple[str, int, bool, bool]:
    """(name, MLP tile or 0, fused layers, fused LoRA) of a variant named ``name[+fused][+flora][+tileN]`` on
    the command line."""
    fused, flora = "+fused" in impl, "+flora" in impl
    name, _, tile = impl.replace("+fused", "").replace("+flora", "").partition("+tile")
    return name, int(tile or 0), fused, flora


def longrl_impl_step(model, batch, impl: str, plan, args) -> dict:
    """One step of a longrl variant named as on the command line (``name[+fused][+flora][+tileN]``)."""
    name, tile, fused, flora = parse_impl(impl)
    planned = name == "longrl-planned"
    return longrl_step(model, batch, beta=args.beta, token_budget=plan.micro_batch_tokens, chunk=args.chunk,
                       mode=LONGRL_IMPLS[name], gpu_resident=plan.gpu_resident_layers if planned else 0,
                       mlp_tile=plan.mlp_tile_tokens if planned else tile, fused=fused, fused_lora=flora)


def profile_step(model, batch, impl: str, plan, args) -> str:
    """One reference + policy step of ``impl`` (a longrl variant) under torch.profiler: the kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    zero_grads(model)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        r = longrl_impl_step(model, batch, impl, plan, args)
    head = (f"`{' '.join(['python'] + sys.argv)}`\n\n{impl}, one profiled step: ref {r['ref_s']:.2f} s, policy "
            f"{r['policy_s']:.2f} s (profiler overhead included)\n\n")
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return head + prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--lengths", default="4096,20480")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--impls", default="longrl,longrl-plain,trl-frugal,trl-default")
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--token-budget", type=int, default=0, help="0: the planner chooses")
    ap.add_argument("--mlp-tile", default="0", help="MLP tile sizes (tokens) for longrl and longrl-plain, comma-"
                    "separated, 0: untiled; each runs as its own variant (longrl+tileN). longrl-planned: the planner's")
    ap.add_argument("--check-equality", action="store_true")
    ap.add_argument("--load-in-4bit", action="store_true", help="NF4 base with dynamic 16-bit exceptions (longrl "
                    "impls only): the bf16 random-weight model is quantized in place before LoRA; files get _4bit")
    ap.add_argument("--sdpa", default="", help="SDPA backends tried first, comma-separated (model.sdpa_backends: "
                    "cudnn, flash, efficient, math); empty: PyTorch's order")
    ap.add_argument("--profile", action="store_true", help="after the measured reps, one more step of the first "
                    "impl at the last length under torch.profiler: GPU time per kernel to OUT/STEM_profile.txt")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__, "python": platform.python_version(),
           "date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv)}
    for mod in ("transformers", "peft", "trl", "triton"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    results = {"env": env, "args": vars(args), "rows": []}
    if args.check_equality:
        results["equality"] = check_offload_equality("qwen2.5-1.5b", device)
        print("equality:", results["equality"], flush=True)

    model = tb.build_random_model(args.shape, device, torch.bfloat16)
    weight_bytes = 2
    if args.load_in_4bit:  # scored and quantized where it lies (bf16 on the GPU), then the bf16 weights are freed
        if any(not i.startswith("longrl") for i in args.impls.split(",")):
            ap.error("--load-in-4bit measures the longrl impls only")
        report = quantize_model(model, calibration_ids(vocab_size=model.config.vocab_size).to(device))
        results["quantization"] = report.lines()
        print("\n".join(report.lines()), flush=True)
        weight_bytes = report.total_bytes / ModelShape.from_config(model.config).base_params()  # per parameter
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    model = apply_lora(model, LoraConfig(r=32, alpha=64, dropout=0.0))
    tokenizer = tb.make_tokenizer(model)
    shape = ModelShape.from_config(model.config)
    free, _ = torch.cuda.mem_get_info() if device.type == "cuda" else (64 * GIB, 0)
    weights_now = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    tiles = [int(t) for t in args.mlp_tile.split(",")]
    impls = [f"{i}+tile{t}" if t else i for i in args.impls.split(",")
             for t in (tiles if parse_impl(i)[0] in ("longrl", "longrl-plain", "longrl-reuse") else [0])]
    backends = sdpa_priority([b for b in args.sdpa.split(",") if b], device.type, model)
    backends.__enter__()  # for the whole run (the equality check above ran in PyTorch's order)
    kernel = device.type == "cuda" and triton_available()  # the log-prob row kernels run (ops/logprobs.py)
    for length in [int(x) for x in args.lengths.split(",")]:
        batch = tb.make_batch(args.G, args.prompt, length - args.prompt, model.config.vocab_size, device, seed=length)
        try:
            plan = make_plan(shape, sequence_lengths=[length] * args.G, lora_r=32, weight_bytes=weight_bytes,
                             gpu_free_bytes=free + weights_now,
                             host_free_bytes=int(0.7 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
                             offload=True, chunk=args.chunk, token_budget=args.token_budget, logprob_kernel=kernel)
        except PlanError as e:  # a length probe past the prediction: measure anyway, one sequence per micro-batch
            print(f"--- length {length}: the planner refuses ({e}); measuring anyway", flush=True)
            plan = Plan(max(args.token_budget, length), 0, True, args.chunk, 0, 0, {}, None)
        pred_gpu, _, _ = predict(
            shape, tokens=plan.micro_batch_tokens, lora_r=32, weight_bytes=weight_bytes, offload=True,
            gpu_resident=plan.gpu_resident_layers, chunk=args.chunk, optimizer=False, mlp_tile=plan.mlp_tile_tokens,
            logprob_kernel=kernel)
        pred0 = {t: predict(shape, tokens=plan.micro_batch_tokens, lora_r=32, weight_bytes=weight_bytes, offload=True,
                            gpu_resident=0, chunk=args.chunk, optimizer=False, mlp_tile=t, logprob_kernel=kernel)[0]
                 for t in tiles}
        print(f"--- length {length}: plan budget {plan.micro_batch_tokens} resident {plan.gpu_resident_layers} "
              f"MLP tile {plan.mlp_tile_tokens} predicted (no optimizer) {pred_gpu / GIB:.2f} GiB", flush=True)
        measured = {impl: [] for impl in impls}
        for rep in range(max(args.reps, 0) + 1 if args.reps else 1):  # rep 0 is the warm-up
            for impl in impls:
                zero_grads(model)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                try:
                    if parse_impl(impl)[0] in LONGRL_IMPLS:
                        r = longrl_impl_step(model, batch, impl, plan, args)
                    else:
                        set_lora_input_casting(model, True)  # PEFT's default, as TRL users run it
                        r = tb.trl_step(model, tokenizer, batch, layout=impl.split("-", 1)[1], beta=args.beta,
                                        reps=1)
                        tb.release_trl(model)
                        set_lora_input_casting(model, None)
                except torch.OutOfMemoryError:
                    r = {"oom": True}
                    disable_mlp_tiling(model)
                    disable_fused_layers(model)
                r["host_rss_peak_gib"] = _host_rss_gib()
                if rep > 0 or args.reps == 0:  # --reps 0: a single, unwarmed run (long-length probes)
                    measured[impl].append(r)
                print(f"  rep {rep} {impl}: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                                          for k, v in r.items() if k in ("ref_s", "policy_s", "peak_gpu_gib", "oom", "pinned_pool_gib")), flush=True)
        for impl, rs in measured.items():
            ok = [r for r in rs if not r.get("oom")]
            row = {"impl": impl, "length": length, "G": args.G, "oom": not ok}
            if ok:
                for k in ("ref_s", "policy_s", "peak_gpu_gib", "pinned_pool_gib", "host_rss_peak_gib"):
                    vals = [r[k] for r in ok if r.get(k) is not None]
                    row[k] = statistics.median(vals) if vals else None
            if impl.startswith("longrl"):
                row["planner_budget"] = plan.micro_batch_tokens
                row["planner_gpu_resident"] = plan.gpu_resident_layers if impl == "longrl-planned" else 0
                planned = impl == "longrl-planned"
                row["mlp_tile"] = plan.mlp_tile_tokens if planned else (parse_impl(impl)[1] or None)
                row["planner_predicted_gib"] = (pred_gpu if planned else pred0[row["mlp_tile"] or 0]) / GIB
            results["rows"].append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"grpo_memory_{args.shape}{'_4bit' if args.load_in_4bit else ''}{('_' + args.tag) if args.tag else ''}"
    if args.profile:
        (out / f"{stem}_profile.txt").write_text(profile_step(model, batch, impls[0], plan, args))
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    lines = [f"# GRPO step memory/time: {args.shape}{', NF4 4-bit base' if args.load_in_4bit else ''}, G={args.G}, "
             f"prompt {args.prompt}, LoRA r=32, beta={args.beta}",
             "", f"{env['gpu']}, torch {env['torch']}, transformers {env['transformers']}, peft {env['peft']}, "
                 f"trl {env['trl']}, {env['date']}", "", f"`{env['command']}`", "",
             "| impl | total tokens/seq | peak GPU GiB | ref s | policy s | ref+policy s | pinned host GiB | planner GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        if r["oom"]:
            lines.append(f"| {r['impl']} | {r['length']} | OOM | | | | | |")
            continue
        tot = (r.get("ref_s") or 0) + (r.get("policy_s") or 0)
        pg = r.get("planner_predicted_gib")
        name = r["impl"] + (f" (tile {r['mlp_tile']})" if r["impl"] == "longrl-planned" and r.get("mlp_tile") else "")
        lines.append(f"| {name} | {r['length']} | {r['peak_gpu_gib']:.2f} | {r['ref_s']:.2f} | {r['policy_s']:.2f} | "
                     f"{tot:.2f} | {r.get('pinned_pool_gib') or 0:.2f} | {'' if pg is None else f'{pg:.2f}'} |")
    if "quantization" in results:
        lines += ["", "```", *results["quantization"], "```"]
    if "equality" in results:
        lines += ["", f"GPU gradient check (qwen2.5-1.5b shape, bf16, LoRA dropout 0.1): {results['equality']}"]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)


if __name__ == "__main__":
    main()
