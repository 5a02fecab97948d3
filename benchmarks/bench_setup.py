"""Set-up the GPU benchmarks share: random-weight models of real shapes in bf16 with the benchmarks' LoRA (r=32 on
every linear projection, unmerged, as in training), random prompt ids, a tokenizer that reads "<t17>" as one token,
and the GRPO benchmarks' prompt file and reward (grpo_e2e.py, grpo_scale.py).

Imports of torch, transformers and longrl happen inside the functions: torchrun workers and --help stay light."""

from __future__ import annotations

import json
from pathlib import Path

REWARD_FILE = '''import random

def random_reward(completions, **kwargs):
    """A reward with spread (random weights generate noise): exercises advantages and the update."""
    return [random.random() for _ in completions]
'''


def sync() -> None:
    """Wait for the GPU (nothing on the CPU): before and after a timed region."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_lora():
    """The benchmarks' LoRA: r=32, alpha 64, no dropout (a fresh config: callers may change it)."""
    from longrl.config.schema import LoraConfig

    return LoraConfig(r=32, alpha=64.0, dropout=0.0)


def add_shape_args(ap, prompts: int, G: int = 8, prompt_len: int = 512) -> None:
    """--shape (trl_baseline.SHAPES), --prompts, --G, --prompt-len on an argparse parser."""
    import trl_baseline as tb

    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(tb.SHAPES))
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--G", type=int, default=G)
    ap.add_argument("--prompt-len", type=int, default=prompt_len)


def random_model(shape: str, device, lora: bool = False, dtype=None):
    """trl_baseline's random-weight ``shape`` (bf16 unless ``dtype``, SDPA attention), with bench_lora() if ``lora``."""
    import torch
    import trl_baseline as tb

    from longrl.models import apply_lora

    model = tb.build_random_model(shape, device, dtype or torch.bfloat16, attn_implementation="sdpa")
    return apply_lora(model, bench_lora()) if lora else model


def random_prompts(prompts: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``prompts`` rows of ``length`` ids drawn from [3, vocab) (past the special ids), seeded."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (prompts, length), generator=g).tolist()


def whitespace_tokenizer(model):
    """trl_baseline's tokenizer for ``model``, split on whitespace only: "<t17>" is one token, not "<", "t17", ">"."""
    import trl_baseline as tb
    from tokenizers import pre_tokenizers

    tok = tb.make_tokenizer(model)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def write_grpo_inputs(root: Path, prompts: int, prompt_len: int, vocab: int) -> tuple[Path, Path]:
    """(prompts.jsonl of ``prompts`` rows of ``prompt_len`` random "<tN>" tokens, reward.py with random_reward)."""
    import torch

    g = torch.Generator().manual_seed(0)
    data = root / "prompts.jsonl"
    with open(data, "w") as f:
        for _ in range(prompts):
            ids = torch.randint(3, vocab - 1, (prompt_len,), generator=g).tolist()
            f.write(json.dumps({"prompt": " ".join(f"<t{i}>" for i in ids)}) + "\n")
    reward = root / "reward.py"
    reward.write_text(REWARD_FILE)
    return data, reward
