"""Unsloth's GRPO training step (reference pass + policy forward/backward) on grpo_memory.py's batch, own process.

Unsloth patches transformers and TRL when imported, so it runs apart from longrl (grpo_memory.py) and is imported
first. The random-weight model of the shape is saved once to --model-dir (Unsloth loads from a path), loaded by
``FastLanguageModel.from_pretrained`` and wrapped by ``get_peft_model`` (LoRA r=32, alpha 64, every linear
projection, ``use_gradient_checkpointing="unsloth"``). The trainer is Unsloth's: importing unsloth replaces
``trl.GRPOTrainer`` by the UnslothGRPOTrainer it generates from TRL 1.15's source (unsloth/models/rl.py,
rl_replacements.py). The step replays what its ``_generate_and_score_completions`` and ``training_step`` do after
generation, as trl_baseline.trl_step does for TRL:

1. reference: ``_get_per_token_logps_and_entropies`` (Unsloth's: hidden states from the trunk, log-probs by
   unsloth_zoo's chunked head; sequence packing / shared-prompt PrefixGrouper where it verifies) with the adapter
   disabled (``use_adapter(..., None)``: Unsloth drops TRL's "ref" adapter copy), under no_grad;
2. policy: ``split_tensor_dict(batch, steps_per_generation)``, then per micro-batch ``compute_loss`` (Unsloth's:
   unsloth_zoo's ``grpo_accumulated_loss``, which runs the model itself in mini-batches that
   ``autotune_batch_and_chunks`` sizes from free GPU memory) and ``accelerator.backward``.

Same ids as grpo_memory.py (``make_batch(G, prompt, length - prompt, vocab, seed=length)``), dapo loss, beta 0.04.
Layouts (--layouts): ``unsloth`` = UnslothGRPOConfig's own defaults, per_device_train_batch_size 4 x
gradient_accumulation_steps 2 (what a user who sets neither runs; its check keeps them, 4 x 2 = G); ``frugal`` =
1 x G, one completion per micro-batch (TRL "frugal" in trl_baseline.py); ``default`` = G x 1. Unsloth's
mini-batching inside the loss applies in every layout. Rows tagged unsloth-<layout>; the table has grpo_memory.py's
columns (no pinned pool, no planner: blank).

    python benchmarks/grpo_unsloth.py --shape llama-3.1-8b --lengths 20480                  # layouts unsloth,frugal
    python benchmarks/grpo_unsloth.py --lengths 20480 --layouts frugal --reps 2 --load-in-4bit  # QLoRA (bitsandbytes)
"""

from __future__ import annotations

import os

os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import unsloth  # noqa: E402,F401  (first: it patches transformers and TRL on import)

import argparse  # noqa: E402
import gc  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_io  # noqa: E402
import trl_baseline as tb  # noqa: E402
from sft_unsloth import unsloth_lora_model  # noqa: E402

LAYOUTS = {"unsloth": None, "frugal": lambda G: (1, G), "default": lambda G: (G, 1)}  # None: the config's defaults


def _no_reward(completions, **kwargs):  # never called: nothing is generated
    return [0.0] * len(completions)


def build_trainer(model, tokenizer, layout: str, G: int, C: int, beta: float):
    """Unsloth's GRPOTrainer on ``model`` and the module its code runs in (use_adapter, split_tensor_dict, ... as it
    sees them). TRL's __init__ patches the base model's forward (add_fused_lm_head, trainer/utils.py:1690): the
    model's own forward is put back first, so trainers built one after another do not nest."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer  # Unsloth's, once unsloth is imported

    base = model.get_base_model()
    saved = model.__dict__.setdefault("_grpo_unsloth_forward", base.__dict__.get("forward"))
    base.__dict__.pop("forward", None)
    if saved is not None:
        base.forward = saved
    sizes = {} if LAYOUTS[layout] is None else dict(zip(("per_device_train_batch_size", "gradient_accumulation_steps"),
                                                         LAYOUTS[layout](G)))
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="grpo_unsloth_"), num_generations=G, max_completion_length=C,
                      beta=beta, bf16=True, report_to=[], save_strategy="no", seed=0, **sizes)
    trainer = GRPOTrainer(model=model, reward_funcs=_no_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * G}), processing_class=tokenizer)
    assert "Unsloth" in type(trainer).__name__, f"TRL's trainer, not Unsloth's: {type(trainer)}"
    # what Trainer.train() does before the first step (transformers 5.17 trainer.py:1461-1472; the trainer's
    # __init__ left the model in for_inference), then what Unsloth's _generate_and_score_completions does first
    if args.gradient_checkpointing:
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None, every_n_layers=1, offload=False)
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    use_gc = getattr(trainer.model, "_unsloth_gradient_checkpointing", args.gradient_checkpointing)
    trainer.model.for_training(use_gradient_checkpointing=use_gc)
    return trainer, sys.modules[type(trainer).__module__]


def unsloth_step(trainer, mod, batch) -> dict:
    """One step; timings, peak, loss (the micro-batches' losses summed, as trl_step)."""
    model, args = trainer.model, trainer.args
    prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
    G, C = completion_ids.shape
    completion_mask = torch.ones_like(completion_ids)
    gen = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
           "completion_mask": completion_mask, "advantages": batch["advantages"],
           "num_items_in_batch": trainer.accelerator.gather(completion_mask.sum()).sum(),
           # Unsloth's output extra: the prompts' largest left pad, here none (unsloth/models/rl_replacements.py:2529)
           "max_left_pad": torch.zeros(G, 1, dtype=torch.long)}
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if trainer.beta != 0.0:  # old_per_token_logps is not computed: ga % steps_per_generation == 0, no vLLM
        ids = torch.cat([prompt_ids, completion_ids], 1)
        with torch.no_grad(), mod.disable_gradient_checkpointing(model, args.gradient_checkpointing_kwargs):
            with mod.use_adapter(trainer.accelerator.unwrap_model(model), adapter_name=None):
                gen["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                    model, ids, torch.ones_like(ids), C, batch_size=args.per_device_train_batch_size)
        del ids
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    total = 0.0
    for mb in mod.split_tensor_dict(gen, args.steps_per_generation):
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, mb, num_items_in_batch=gen["num_items_in_batch"])
        trainer.accelerator.backward(loss)
        total += float(loss.detach())
        del loss
    torch.cuda.synchronize()
    return {"ref_s": t1 - t0, "policy_s": time.perf_counter() - t1, "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
            "loss": total, "oom": False, "host_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def write(args, payload):
    rows = payload["rows"]
    lines = [f"# GRPO step memory/time: {args.shape}{', NF4 4-bit base (Unsloth)' if args.load_in_4bit else ''}, G={args.G}, "
             f"prompt {args.prompt}, LoRA r=32, beta={args.beta}, Unsloth {unsloth.__version__}", "",
             f"{payload['meta']['gpu']}, torch {payload['meta']['torch']}, transformers {payload['meta']['transformers']}, "
             f"{payload['meta']['date']}", "", f"`{payload['meta']['command']}`", "",
             "| impl | total tokens/seq | peak GPU GiB | ref s | policy s | ref+policy s | pinned host GiB | planner GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["oom"]:
            lines.append(f"| {r['impl']} | {r['length']} | OOM | | | | | |")
        else:
            lines.append(f"| {r['impl']} | {r['length']} | {r['peak_gpu_gib']:.2f} | {r['ref_s']:.2f} | {r['policy_s']:.2f} | "
                         f"{r['ref_s'] + r['policy_s']:.2f} | | |")
    lines += ["", "Layouts (per-device batch x gradient accumulation): "
              + ", ".join(f"{r['impl']} {r['batch']} x {r['accumulation']}" for r in rows if "batch" in r)]
    stem = f"grpo_memory_{args.shape}{'_4bit' if args.load_in_4bit else ''}_unsloth{args.tag}"
    results_io.write_result(stem, payload, lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--lengths", default="20480", help="total tokens per sequence (prompt included), as grpo_memory")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--layouts", default="unsloth,frugal", help=f"comma-separated: {', '.join(LAYOUTS)}")
    ap.add_argument("--reps", type=int, default=1, help="timed steps after one warm-up per layout and length")
    ap.add_argument("--load-in-4bit", action="store_true", help="Unsloth's own NF4 load (needs bitsandbytes)")
    ap.add_argument("--model-dir", default="", help="default /tmp/unsloth_model_<shape>")
    ap.add_argument("--out", default="", help="results folder (default: results_io.RESULTS)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.out:
        results_io.RESULTS = Path(args.out)
    lengths = [int(x) for x in args.lengths.split(",")]
    model_dir = Path(args.model_dir or f"/tmp/unsloth_model_{args.shape}")
    model, tokenizer = unsloth_lora_model(args.shape, model_dir, max(lengths), args.load_in_4bit)
    import trl

    payload = {"meta": results_io.run_meta(unsloth=unsloth.__version__, trl=trl.__version__,
                                           peft=__import__("peft").__version__, shape=args.shape),
               "args": vars(args), "rows": []}
    for layout in args.layouts.split(","):
        for length in lengths:
            C = length - args.prompt
            batch = tb.make_batch(args.G, args.prompt, C, model.config.vocab_size, "cuda", seed=length)  # grpo_memory's ids
            trainer, mod = build_trainer(model, tokenizer, layout, args.G, C, args.beta)
            runs = []
            for rep in range(args.reps + 1):  # rep 0: the warm-up (compiles, PrefixGrouper / packing self-checks)
                try:
                    r = unsloth_step(trainer, mod, batch)
                except torch.OutOfMemoryError:
                    r = {"oom": True}
                    model.zero_grad(set_to_none=True)
                print(f"  rep {rep} unsloth-{layout} {length}: {r}", flush=True)
                runs.append(r)
                gc.collect()
                torch.cuda.empty_cache()
            ok = [r for r in runs[1:] or runs if not r["oom"]]
            row = {"impl": f"unsloth-{layout}", "length": length, "G": args.G, "oom": not ok,
                   "batch": trainer.args.per_device_train_batch_size,
                   "accumulation": trainer.args.gradient_accumulation_steps, "runs": runs}
            for k in ("ref_s", "policy_s", "peak_gpu_gib", "loss", "host_rss_peak_gib") if ok else ():
                row[k] = statistics.median(r[k] for r in ok)
            payload["rows"].append(row)
            del trainer
            gc.collect()
            torch.cuda.empty_cache()
            write(args, payload)  # after every row: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
