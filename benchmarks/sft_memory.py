"""One supervised step (forward + backward of one long sequence), longrl vs TRL's SFTTrainer, same GPU.

Random-weight model of a real shape, LoRA r=32 on every linear projection, bf16 base, one sequence of each
length (random token ids, every token but the first trained). longrl: the planner's layout for that length
(offloaded checkpointing, MLP tiles), fused kernels, the chunked cross-entropy (sft.step_loss). TRL: its
SFTTrainer.compute_loss (TRL 1.15: the fused LM-head log-probs of transformers) with gradient checkpointing and
padding-free inputs, backward after it. Lengths run in ascending order; an out-of-memory is recorded and that
implementation skips the longer lengths. Writes markdown + JSON to benchmarks/results/.

    python benchmarks/sft_memory.py --shape llama-3.1-8b --lengths 32768,131072 --impls longrl,trl
    python benchmarks/sft_memory.py --shape tiny --lengths 64,200 --impls longrl,trl    # CPU smoke run

The longest trainable sequence: memory is linear in the length for every implementation here (flash attention,
offloaded or checkpointed layer inputs), so ``--offload-all`` pins the layout the planner takes at its longest
lengths (no GPU-resident layer inputs, MLP tiles of --mlp-tile) and the table's slope column (GiB per 1K tokens
between consecutive lengths) predicts the longest length a budget holds; ``--cap-gib`` enforces a budget on the
allocator (an allocation past it fails) so a run near the predicted limit checks the prediction.
``--load-in-4bit``: NF4 base with dynamic 16-bit exceptions (longrl's quantize_model: bitsandbytes' Linear4bit
layers, which TRL's row trains through PEFT as it would a model loaded with BitsAndBytesConfig, on the same
weights). Unsloth runs in its own process (it patches transformers on import): benchmarks/sft_unsloth.py, same
table.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import longrl  # noqa: E402,F401  (first: its allocator default, longrl/allocator.py, as the longrl command has it)
import torch  # noqa: E402

import trl_baseline as tb  # noqa: E402

from longrl.config.schema import LoraConfig  # noqa: E402
from longrl.memory import disable_mlp_tiling, enable_mlp_tiling, enable_offloaded_checkpointing  # noqa: E402
from longrl.memory.planner import GIB, ModelShape, Plan, PlanError, make_plan  # noqa: E402
from longrl.models import apply_lora, calibration_ids, quantize_model, set_lora_input_casting  # noqa: E402
from longrl.models.fused_layers import disable_fused_layers, enable_fused_layers  # noqa: E402
from longrl.models.lora_training import fused_lora_training  # noqa: E402
from longrl.ops.attention_backend import sdpa_priority, training_attention_kernel  # noqa: E402
from longrl.rollout.sampling import triton_available  # noqa: E402
from longrl.recipes.sft import step_loss  # noqa: E402
from longrl.data.sft_rows import SFTExample  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_reset():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else float("nan")


def _reserved_gib() -> float:
    """The allocator's peak reservation (what a budget cap compares against), beside max_memory_allocated."""
    return torch.cuda.max_memory_reserved() / GIB if torch.cuda.is_available() else float("nan")


def longrl_step(model, ids: list[int], plan: Plan, chunk: int, cuda: bool, grouped: bool = False) -> dict:
    enable_offloaded_checkpointing(model, gpu_resident=plan.gpu_resident_layers, no_recompute=plan.no_recompute_layers)
    if plan.mlp_tile_tokens:
        enable_mlp_tiling(model, plan.mlp_tile_tokens)
    if cuda and triton_available():
        enable_fused_layers(model)
    try:
        example = SFTExample(ids, [False] + [True] * (len(ids) - 1))
        _peak_reset()
        start = time.perf_counter()
        # --grouped-attention: the attention backward per key head (model.grouped_attention_backward)
        with fused_lora_training(model) if cuda else _null(), sdpa_priority([], "cuda" if cuda else "cpu", model,
                                                                             grouped):
            loss, n = step_loss(model, [example], [[0]], pad_id=0, label_smoothing=0.0, chunk_size=chunk,
                                packed=True, backward=True)
        _sync()
        return {"time_s": time.perf_counter() - start, "peak_gib": _peak_gib(), "reserved_gib": _reserved_gib(),
                "loss": loss, "tokens": n}
    finally:
        disable_mlp_tiling(model)
        disable_fused_layers(model)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def trl_step(model, tokenizer, ids: list[int]) -> dict:
    """TRL's SFTTrainer.compute_loss on one padding-free sequence, gradient checkpointing on, then backward."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, gradient_checkpointing=True, bf16=torch.cuda.is_available(),
                         padding_free=True, per_device_train_batch_size=1, max_length=None, report_to=[],
                         use_cpu=not torch.cuda.is_available())
        trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                             train_dataset=Dataset.from_list([{"input_ids": ids}]))
        from torch.utils.checkpoint import checkpoint  # transformers' own checkpointing, as Trainer.train() sets it

        model.get_base_model()._set_gradient_checkpointing(
            enable=True, gradient_checkpointing_func=functools.partial(checkpoint, use_reentrant=False))
        batch = trainer.data_collator([{"input_ids": ids}])
        device = next(model.parameters()).device
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        trainer.model.train()
        _peak_reset()
        start = time.perf_counter()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        _sync()
        result = {"time_s": time.perf_counter() - start, "peak_gib": _peak_gib(), "reserved_gib": _reserved_gib(),
                  "loss": float(loss.detach()),
                  "tokens": len(ids) - 1}
        del trainer, loss
    return result


KERNEL_KINDS = (  # GPU kernels by name, first match wins (cuDNN/flash/efficient attention, cuBLAS GEMMs, copies)
    ("attention", ("flash", "fmha", "sdpa", "attention", "cutlass::kernel<pytorch")),
    ("GEMM", ("nvjet", "gemm", "sm90_xmma", "cublas", "cutlass")),
    ("host/device copies", ("memcpy", "memset")),
    ("PyTorch elementwise/reductions", ("at::native", "elementwise", "reduce")),
)


def profiled(step, title: str) -> tuple[dict, str]:
    """``step()`` once under torch.profiler: its result, and GPU time by kernel kind then per kernel (top 40)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        result = step()
    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total]
    total = sum(e.self_device_time_total for e in kernels) or 1.0
    kinds: dict[str, float] = {}
    for e in kernels:
        name = e.key.lower()
        kind = next((k for k, marks in KERNEL_KINDS if any(m.lower() in name for m in marks)), "other (Triton, ...)")
        kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total
    lines = [f"`{' '.join(['python'] + sys.argv)}`", "", f"{title}: one profiled step, {result['time_s']:.2f} s "
             f"(profiler overhead included); GPU kernel time {total / 1e6:.3f} s", "",
             "| kernel kind | GPU s | share |", "|---|---|---|"]
    lines += [f"| {k} | {v / 1e6:.3f} | {v / total:.1%} |" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    lines += ["", averages.table(sort_by=sort, row_limit=40, max_name_column_width=90)]
    return result, "\n".join(lines) + "\n"


def slope_gib_per_1k(rows: list[dict], row: dict) -> float | None:
    """GiB per 1,000 tokens between ``row`` and the same implementation's previous measured length."""
    before = [r for r in rows if r["impl"] == row["impl"] and "peak_gib" in r and r["length"] < row["length"]]
    if "peak_gib" not in row or not before:
        return None
    prev = max(before, key=lambda r: r["length"])
    return (row["peak_gib"] - prev["peak_gib"]) / ((row["length"] - prev["length"]) / 1000)


def write_results(args, rows: list[dict], cuda: bool, extra_meta: dict | None = None) -> list[str]:
    """The table so far, as markdown and JSON (rewritten after every row: a run cut short keeps what it measured)."""
    meta = {"command": "python " + " ".join(sys.argv), "date": datetime.date.today().isoformat(),
            "allocator": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "gpu": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "shape": args.shape, "base": "nf4" if args.load_in_4bit else "bf16",
            "cap_gib": args.cap_gib or None, "offload_all": args.offload_all, **(extra_meta or {})}
    for mod in ("transformers", "peft", "trl", "unsloth"):
        if mod in sys.modules:
            meta[mod] = getattr(sys.modules[mod], "__version__", None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"sft_memory_{args.shape}{args.tag}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# SFT step, {args.shape}, LoRA r=32, one sequence, {meta['base']} base", "",
             f"`{meta['command']}` — {meta}", "",
             "| length | impl | step time | tokens/s | peak GPU | reserved | GiB / 1K tokens | layout | loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "time_s" in r:
            slope = slope_gib_per_1k(rows, r)
            lines.append(f"| {r['length']:,} | {r['impl']} | {r['time_s']:.2f} s | {r['tokens_per_s']:,.0f} | "
                         f"{r['peak_gib']:.2f} GiB | {r.get('reserved_gib', float('nan')):.2f} GiB | "
                         f"{'' if slope is None else f'{slope:.4f}'} | "
                         f"{r.get('layout', '')} | {r['loss']:.4f} |")
        else:
            lines.append(f"| {r['length']:,} | {r['impl']} | {'out of memory' if r.get('oom') else r.get('skipped')} "
                         "| | | | | | |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return lines


def trl_step_cast(model, tokenizer, ids: list[int]) -> dict:
    """trl_step with PEFT's default input casting to the adapters' dtype, as TRL users run it."""
    set_lora_input_casting(model, True)
    try:
        return trl_step(model, tokenizer, ids)
    finally:
        set_lora_input_casting(model, None)


def write_profile(args, impl: str, table: str) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"sft_memory_{args.shape}{args.tag}_profile_{impl}.txt").write_text(table)


def write_snapshot(args, length: int, step) -> None:
    """One more ``step`` with the allocator's history recorded; what is live at its peak, by the code that allocated
    it (benchmarks/memory_peak.py), to results/sft_memory_<shape><tag>_snapshot_<length>.{md,json}."""
    from memory_peak import summarize

    _sync()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        r = step()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    figures, lines = summarize(snapshot, torch.cuda.current_device(), baseline)
    stem = str(Path(args.out) / f"sft_memory_{args.shape}{args.tag}_snapshot_{length}")  # the shape has dots
    Path(stem + ".json").write_text(json.dumps({"command": "python " + " ".join(sys.argv), "length": length,
                                                "step": r, **figures}, indent=1))
    head = [f"# SFT step's peak, {args.shape}, {length:,} tokens", "",
            f"`python {' '.join(sys.argv)}`; max_memory_allocated {r['peak_gib']:.2f} GiB", ""]
    Path(stem + ".md").write_text("\n".join(head + lines) + "\n")
    print("\n".join(lines[:12]), flush=True)


def add_budget_args(ap) -> None:
    """The flags sft_memory.py and sft_unsloth.py share: base precision, budget, layout pins."""
    ap.add_argument("--load-in-4bit", action="store_true", help="NF4 base (files get _4bit)")
    ap.add_argument("--cap-gib", type=float, default=0.0, help="cap the allocator at this many GiB (0: no cap)")
    ap.add_argument("--offload-all", action="store_true",
                    help="longrl: no GPU-resident layer inputs, MLP tiles of --mlp-tile (the longest lengths' layout)")
    ap.add_argument("--mlp-tile", type=int, default=4096)
    ap.add_argument("--memory-snapshot", action="store_true", help="after each length's longrl runs, one more step "
                    "with the allocator's history recorded: what is live at its peak (memory_peak.py)")
    ap.add_argument("--grouped-attention", action="store_true", help="the attention backward per key head "
                    "(model.grouped_attention_backward); the planner counts it")
    ap.add_argument("--no-recompute", type=int, default=-1,
                    help="longrl: the last N layers not recomputed (model.no_recompute_layers); -1: the planner's choice")
    ap.add_argument("--profile", action="store_true", help="after the last length's reps, one more step of each "
                    "implementation there under torch.profiler: GPU time by kernel kind and per kernel to "
                    "OUT/STEM_profile_IMPL.txt")


def apply_cap(cap_gib: float) -> None:
    """An allocation past ``cap_gib`` fails (the budget is enforced, so a peak under it is a measurement)."""
    if cap_gib and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / torch.cuda.get_device_properties(0)
                                                       .total_memory))


def budget_free_bytes(cap_gib: float) -> int:
    """What the planner may plan with: the cap (or the free memory) plus what this process already holds."""
    have = torch.cuda.mem_get_info()[0] + torch.cuda.memory_allocated()
    return min(have, int(cap_gib * GIB)) if cap_gib else have


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--impls", default="longrl,trl")
    ap.add_argument("--reps", type=int, default=1, help="timed reps after one warm-up per length")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    add_budget_args(ap)
    args = ap.parse_args()
    if args.load_in_4bit:
        args.tag = "_4bit" + args.tag
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = tb.build_random_model(args.shape, device, torch.bfloat16 if cuda else torch.float32)
    weight_bytes = 2 if cuda else 4
    if args.load_in_4bit:  # scored and quantized where it lies, then the 16-bit weights are freed
        report = quantize_model(model, calibration_ids(vocab_size=model.config.vocab_size).to(device))
        print("\n".join(report.lines()), flush=True)
        weight_bytes = report.total_bytes / ModelShape.from_config(model.config).base_params()
        _peak_reset()
    model = apply_lora(model, LoraConfig(r=32, alpha=64, dropout=0.0))
    tokenizer = tb.make_tokenizer(model)
    shape = ModelShape.from_config(model.config)
    apply_cap(args.cap_gib)  # after the set-up: the budget is the training step's (as Unsloth's, loaded in 4 bits)
    free = budget_free_bytes(args.cap_gib) if cuda else 64 * GIB
    impls = args.impls.split(",")
    failed: set[str] = set()
    planner_refused: set[int] = set()
    rows = []
    lengths = [int(x) for x in args.lengths.split(",")]
    for length in lengths:
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(0, model.config.vocab_size, (length,), generator=g).tolist()
        try:
            pins = (dict(gpu_resident=0, mlp_tile_tokens=args.mlp_tile, no_recompute=0) if args.offload_all
                    else dict(no_recompute=None if args.no_recompute < 0 else args.no_recompute))
            plan = make_plan(shape, sequence_lengths=[length], lora_r=32, weight_bytes=weight_bytes,
                             gpu_free_bytes=free,
                             host_free_bytes=int(0.7 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
                             offload=True, chunk=args.chunk, logprob_kernel=cuda and triton_available(),
                             fused_norms=cuda and triton_available(),
                             grouped_attention=cuda and args.grouped_attention,
                             attention_kernel=training_attention_kernel(
                                 [], shape.query_heads, shape.kv_heads, shape.head_dim,
                                 "cuda" if cuda else "cpu"), length_key="sft.max_length", **pins)
        except PlanError as e:  # measured anyway in the leanest layout: the run says whether the planner was right
            print(f"--- {length}: the planner refuses ({e}); measuring anyway with no resident layer inputs and "
                  f"MLP tiles of {args.mlp_tile}", flush=True)
            plan = Plan(length, 0, True, args.chunk, 0, 0, {}, args.mlp_tile)
            planner_refused.add(length)
        print(f"--- {length}: resident {plan.gpu_resident_layers}, MLP tile {plan.mlp_tile_tokens}, not recomputed "
              f"{plan.no_recompute_layers}", flush=True)
        for impl in impls:
            if impl in failed:
                rows.append({"length": length, "impl": impl, "skipped": "out of memory at a shorter length"})
                continue
            step = (functools.partial(longrl_step, model, ids, plan, args.chunk, cuda, args.grouped_attention)
                    if impl == "longrl" else functools.partial(trl_step_cast, model, tokenizer, ids))  # PEFT casting
            runs = []
            for _ in range(args.reps + 1):  # the first is the warm-up
                model.zero_grad(set_to_none=True)
                try:
                    runs.append(step())
                except torch.OutOfMemoryError:
                    runs = [{"oom": True}]
                    failed.add(impl)
                    break
            if args.memory_snapshot and cuda and impl == "longrl" and "oom" not in runs[-1]:
                model.zero_grad(set_to_none=True)
                write_snapshot(args, length, step)
            if args.profile and length == lengths[-1] and "oom" not in runs[-1]:
                model.zero_grad(set_to_none=True)
                write_profile(args, impl, *profiled(step, f"{impl}, {length:,} tokens")[1:])
            r = runs[-1] if len(runs) == 1 else {**runs[-1], "warmup_time_s": runs[0]["time_s"]}
            r.update(length=length, impl=impl, tokens_per_s=(length / r["time_s"]) if "time_s" in r else None)
            if impl == "longrl":
                r.update(layout=f"resident {plan.gpu_resident_layers}, tile {plan.mlp_tile_tokens or 0}, "
                                f"not recomputed {plan.no_recompute_layers}"
                         + (" (planner refused)" if length in planner_refused else ""),
                         planner_gib=plan.predicted_gpu_bytes / GIB)
            rows.append(r)
            print(json.dumps(r), flush=True)
            write_results(args, rows, cuda)
            model.zero_grad(set_to_none=True)
            _peak_reset()
    print("\n".join(write_results(args, rows, cuda)))


if __name__ == "__main__":
    main()
