"""Attention reuse's gradients against plain checkpointing on the GPU, per SDPA backend, with the noise floor.

For each SDPA order (PyTorch's, flash, memory-efficient, cuDNN first) and each batch layout (equal-length rows
stacked: no mask; unequal rows packed into one: transformers' packing mask), the LoRA gradients of one forward +
backward of a random-weight model (bf16, LoRA r=8 with dropout 0.1, the same seed each run) under

    plain_a, plain_b   plain checkpointing, twice: plain_b vs plain_a is the run-to-run noise floor
    offload            offloaded checkpointing
    reuse              offloaded checkpointing + attention reuse (model.reuse_attention), every attention output
                       through the host pool
    reuse_contiguous   the same with the host copies made contiguous and the replay's layout check off: the code
                       before the fix, whose gradients differed (the cause, shown on the kernels themselves)

each compared with plain_a: the largest |difference| over every gradient element, and whether all are equal bit
for bit. Writes OUT/reuse_gradient_check[_TAG].{md,json}.

    python benchmarks/reuse_gradient_check.py                            # GPU: the Qwen2.5-1.5B shape (~1 min)
    python benchmarks/reuse_gradient_check.py --shape tiny --out /tmp    # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import trl_baseline as tb  # noqa: E402
from grpo_memory import grads_of, set_checkpointing, zero_grads  # noqa: E402

from longrl.config.schema import LoraConfig  # noqa: E402
from longrl.memory import attention_reuse, offload  # noqa: E402
from longrl.models import apply_lora  # noqa: E402
from longrl.ops.attention_backend import sdpa_priority  # noqa: E402
from longrl.models.policy import sequence_logprobs  # noqa: E402

RUNS = (("plain_a", "plain"), ("plain_b", "plain"), ("offload", "offload"), ("reuse", "reuse"),
        ("reuse_contiguous", "reuse"))


class _AttentionOps(TorchDispatchMode):
    """The names of the fused attention ops that run."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in attention_reuse.ATTENTION_OPS:
            self.names.add(func.__name__.split(".")[0].replace("_scaled_dot_product_", ""))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def layout_lost():
    """Host copies contiguous whatever the kept tensor's strides, and no layout check in the replay: the code before
    the fix."""
    saved = offload.dense_strides, attention_reuse._layout
    offload.dense_strides = lambda t: torch.empty(t.shape, device="meta").stride()
    attention_reuse._layout = lambda out: ()
    try:
        yield
    finally:
        offload.dense_strides, attention_reuse._layout = saved


def one_run(model, prompts, completions, mode: str, ops: _AttentionOps | None = None):
    """LoRA gradients (float32 copies) and the summed log-probs of one forward + backward under ``mode``."""
    zero_grads(model)
    set_checkpointing(model, mode)
    model.train()
    torch.manual_seed(7)  # LoRA dropout draws the same masks in every run
    width = max(len(c) for c in completions)
    with ops or contextlib.nullcontext():
        lp, _ = sequence_logprobs(model, prompts, completions, width, pad_id=0, chunk_size=256)
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2)).to(lp.device)
    (lp.float() * w).sum().backward()
    return grads_of(model), float(lp.detach().double().sum())


def check(model, prompts, completions, order: list[str], device) -> dict:
    runs, logp = {}, {}
    ops = _AttentionOps()
    with sdpa_priority(order, device.type, model):
        for name, mode in RUNS:
            with layout_lost() if name == "reuse_contiguous" else contextlib.nullcontext():
                runs[name], logp[name] = one_run(model, prompts, completions, mode, ops if name == "reuse" else None)
    ref = runs["plain_a"]
    row = {"attention_ops": sorted(ops.names), "policy_logp_sum": logp}
    for name in runs:
        if name != "plain_a":
            row[f"{name}_max_abs"] = max(float((runs[name][k] - ref[k]).abs().max()) for k in ref)
            row[f"{name}_exact"] = all(torch.equal(runs[name][k], ref[k]) for k in ref)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--orders", default="default,flash,efficient,cudnn",
                    help="SDPA backends tried first, one per check (default: PyTorch's order); CUDA only")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "python": platform.python_version(), "date": datetime.date.today().isoformat(),
           "command": " ".join(["python"] + sys.argv)}
    for mod in ("transformers", "peft"):
        env[mod] = __import__(mod).__version__
    env["cudnn"] = torch.backends.cudnn.version() if device.type == "cuda" else None
    offload.ActivationOffloader.EXTRA_MIN_BYTES = 0  # every attention output (log-sum-exp too) through the pool
    model = tb.build_random_model(args.shape, device, torch.bfloat16)
    model = apply_lora(model, LoraConfig(r=8, alpha=16, dropout=0.1))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    layouts = {"stacked 4 x 264 (no mask)": ([ids(64)] * 4, [ids(200) for _ in range(4)]),
               "packed 264+201+150+307 (mask)": ([ids(64), ids(1), ids(50), ids(107)], [ids(n) for n in (200, 200, 100, 200)])}
    orders = [o for o in args.orders.split(",") if o] if device.type == "cuda" else ["default"]
    rows = []
    for order in orders:
        for layout, (prompts, completions) in layouts.items():
            row = {"order": order, "layout": layout,
                   **check(model, prompts, completions, [] if order == "default" else [order], device)}
            print(row, flush=True)
            rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"reuse_gradient_check{('_' + args.tag) if args.tag else ''}"
    (out / f"{stem}.json").write_text(json.dumps({"env": env, "shape": args.shape, "rows": rows}, indent=2))
    lines = [f"# Attention reuse vs plain checkpointing: LoRA gradients, {args.shape} shape, bf16, LoRA dropout 0.1",
             "", f"{env['gpu']}, torch {env['torch']}, cuDNN {env['cudnn']}, transformers {env['transformers']}, "
                 f"peft {env['peft']}, {env['date']}", "", f"`{env['command']}`", "",
             "Largest |gradient − plain checkpointing's| over every LoRA gradient element (= bit for bit).",
             "`reuse, contiguous copies` is the code before the fix (host copies lost the output's memory layout).", "",
             "| SDPA first | batch | attention op | plain vs plain | offload | reuse | reuse, contiguous copies |",
             "|---|---|---|---|---|---|---|"]
    cell = lambda r, k: "=" if r[f"{k}_exact"] else f"{r[f'{k}_max_abs']:.3g}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['order']} | {r['layout']} | {', '.join(r['attention_ops']) or 'none (math)'} | "
                     f"{cell(r, 'plain_b')} | {cell(r, 'offload')} | {cell(r, 'reuse')} | {cell(r, 'reuse_contiguous')} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
