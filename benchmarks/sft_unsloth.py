"""Unsloth's supervised step on the same sequences as benchmarks/sft_memory.py, in its own process.

Unsloth patches transformers when it is imported, so it runs apart from longrl and TRL (whose rows come from
sft_memory.py) and is imported before anything else. A random-weight model of the same shape (saved once to
--model-dir with its tokenizer, since Unsloth loads from a path), LoRA r=32 on every linear projection,
``FastLanguageModel.get_peft_model(use_gradient_checkpointing="unsloth")`` (its offloaded checkpointing), one
sequence of each length with labels = the ids (its fused chunked cross-entropy; every token but the first
trained), forward + backward timed. ``--load-in-4bit`` loads the base in NF4 (Unsloth's QLoRA); ``--cap-gib``
caps the allocator after loading, as sft_memory.py does. Writes the same table (file tag _unsloth).

    python benchmarks/sft_unsloth.py --shape llama-3.1-8b --lengths 16384,32768,65536 [--load-in-4bit]
"""

from __future__ import annotations

import os

os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import unsloth  # noqa: E402,F401  (first: it patches transformers on import)
from unsloth import FastLanguageModel  # noqa: E402

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sft_memory as sm  # noqa: E402
import trl_baseline as tb  # noqa: E402


def save_random_model(shape: str, model_dir: Path, max_length: int) -> None:
    """The shape's random-weight model (bf16) and the benchmarks' tokenizer, written where Unsloth loads them."""
    if (model_dir / "config.json").exists():
        return
    model = tb.build_random_model(shape, "cuda", torch.bfloat16)
    # past the shape's trained context Unsloth would rescale RoPE; the step's cost does not depend on it
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, max_length)
    model.save_pretrained(model_dir, safe_serialization=True)
    tb.make_tokenizer(model).save_pretrained(model_dir)
    del model
    torch.cuda.empty_cache()


def unsloth_lora_model(shape: str, model_dir: Path, max_length: int, load_in_4bit: bool):
    """(model, tokenizer): the shape's random-weight model saved once to ``model_dir``, loaded by Unsloth (NF4 with
    ``load_in_4bit``) with LoRA r=32 on every linear projection and its offloaded checkpointing."""
    save_random_model(shape, model_dir, max_length)
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=str(model_dir), max_seq_length=max_length,
                                                         dtype=torch.bfloat16, load_in_4bit=load_in_4bit,
                                                         local_files_only=True)
    model = FastLanguageModel.get_peft_model(model, r=32, lora_alpha=64, lora_dropout=0.0, bias="none",
                                             target_modules=tb.LORA_TARGETS, use_gradient_checkpointing="unsloth",
                                             random_state=0, max_seq_length=max_length)
    return model, tokenizer


def unsloth_step(model, ids: list[int]) -> dict:
    input_ids = torch.tensor([ids], device="cuda")
    sm._peak_reset()
    start = time.perf_counter()
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    sm._sync()
    return {"time_s": time.perf_counter() - start, "peak_gib": sm._peak_gib(), "reserved_gib": sm._reserved_gib(),
            "loss": float(loss.detach()),
            "tokens": len(ids) - 1}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--lengths", default="16384,32768,65536")
    ap.add_argument("--reps", type=int, default=1, help="timed reps after one warm-up per length (as sft_memory.py)")
    ap.add_argument("--model-dir", default="/tmp/sft_unsloth_model")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    sm.add_budget_args(ap)
    args = ap.parse_args()
    args.tag = ("_4bit" if args.load_in_4bit else "") + "_unsloth" + args.tag
    lengths = [int(x) for x in args.lengths.split(",")]
    model, _ = unsloth_lora_model(args.shape, Path(args.model_dir), max(lengths), args.load_in_4bit)
    FastLanguageModel.for_training(model)
    sm.apply_cap(args.cap_gib)
    vocab = model.config.vocab_size
    rows, failed = [], False
    for length in lengths:
        if failed:
            rows.append({"length": length, "impl": "unsloth", "skipped": "out of memory at a shorter length"})
            continue
        g = torch.Generator().manual_seed(length)  # the same ids as sft_memory.py
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        runs = []
        for _ in range(args.reps + 1):  # the first is the warm-up
            model.zero_grad(set_to_none=True)
            try:
                runs.append(unsloth_step(model, ids))
            except torch.OutOfMemoryError:
                runs, failed = [{"oom": True}], True
                break
        if args.profile and length == lengths[-1] and "oom" not in runs[-1]:
            model.zero_grad(set_to_none=True)
            sm.write_profile(args, "unsloth", sm.profiled(lambda: unsloth_step(model, ids),
                                                          f"unsloth, {length:,} tokens")[1])
        r = runs[-1] if len(runs) == 1 else {**runs[-1], "warmup_time_s": runs[0]["time_s"]}
        r.update(length=length, impl="unsloth", tokens_per_s=(length / r["time_s"]) if "time_s" in r else None,
                 layout='use_gradient_checkpointing="unsloth"')
        rows.append(r)
        print(json.dumps(r), flush=True)
        sm.write_results(args, rows, True)
        model.zero_grad(set_to_none=True)
        sm._peak_reset()
    print("\n".join(sm.write_results(args, rows, True)))


if __name__ == "__main__":
    main()
