"""How much reward signal learning_real.py's task gives the untrained model: per-sample accuracy and the share of
prompt groups with at least one correct completion (a GRPO group with none has zero advantage and teaches nothing),
by sampling temperature and completion length. Runs on the CPU (transformers' generate, float32).

    python benchmarks/learning_real_base_rates.py                 # 24 training prompts x 8, ~11 min on 2 cores
    python benchmarks/learning_real_base_rates.py --task multistep --prompts 8 --temperatures 1.0 --lengths 128

Writes benchmarks/results/learning_real_base_rates_<task>_cpu.md (or --out).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "tests", HERE.parent / "src"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import learning_real as lr  # noqa: E402


def rates(scores: list[float], group: int) -> tuple[float, float]:
    """(mean score, share of consecutive groups of ``group`` scores with a nonzero one)."""
    groups = [max(scores[i:i + group]) for i in range(0, len(scores), group)]
    return sum(scores) / len(scores), sum(g > 0 for g in groups) / len(groups)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default=lr.TASK, choices=sorted(lr.TASKS), help="learning_real.py's task")
    ap.add_argument("--prompts", type=int, default=24, help="training prompts of the task")
    ap.add_argument("--group", type=int, default=8, help="completions a prompt (learning_real's num_generations)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256], help="max new tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default="/tmp/learning_real/smollm2-135m-instruct-bf16")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/learning_real_base_rates_<task>_cpu.md")
    args = ap.parse_args()
    dest = Path(args.out or HERE / "results" / f"learning_real_base_rates_{args.task}_cpu.md")

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = lr.model_directory(None, Path(args.model_dir))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = lr.splits(2000, 256, 1, args.task)["train"][:args.prompts]
    held = lr.HeldOut(rows, max(args.lengths), len(rows))
    ids = held.prompt_ids(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    x, mask = (t.repeat_interleave(args.group, 0) for t in lr.left_padded(ids, pad))
    width = x.shape[1]
    answers = [r["answer"] for r in rows for _ in range(args.group)]
    lines = []
    for temp in args.temperatures:
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        with torch.no_grad():  # one sample of the longest length; shorter lengths are its prefixes
            out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max(args.lengths), do_sample=True,
                                 temperature=temp, top_k=0, top_p=1.0, pad_token_id=pad,
                                 eos_token_id=tok.eos_token_id)[:, width:]
        ended = [int((o != pad).sum()) for o in out]  # tokens up to and with the end token
        for length in args.lengths:
            texts = tok.batch_decode(out[:, :length], skip_special_tokens=True)
            accuracy, signal = rates(lr.correct(None, texts, answers), args.group)
            done = sum(n < length for n in ended) / len(ended)
            lines.append(f"| {temp} | {length} | {len(texts)} | {accuracy:.1%} | {signal:.1%} | {done:.1%} |")
        print(f"temperature {temp}: {time.perf_counter() - start:.0f} s", flush=True)
    text = "\n".join([
        f"# learning_real.py's task {args.task}: reward signal of the untrained SmolLM2-135M-Instruct (CPU)", "",
        "Command: `" + " ".join(["python", "benchmarks/learning_real_base_rates.py", *sys.argv[1:]]) + "`" +
        f" ({time.strftime('%Y-%m-%d')}; CPU; torch {torch.__version__}, transformers {transformers.__version__})", "",
        f"{args.prompts} training prompts of learning_real.py's task {args.task} ({lr.TASKS[args.task][1]}) × "
        f"{args.group} samples each (top-k 0, top-p 1), "
        "float32; reward as learning_real.py's (`correct`). \"groups with reward\": prompts with at least one "
        "correct sample among their group, the only groups whose GRPO advantages are nonzero. A length is the "
        "longest run's samples cut there (a cut sample counts as not ended).", "",
        "| temperature | max new tokens | samples | accuracy a sample | groups with reward | samples ended |",
        "| --- | --- | --- | --- | --- | --- |", *lines, ""])
    dest.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
