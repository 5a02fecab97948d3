"""Small-number arithmetic: prompts like ``"3+4="`` (operands 0–4); the answer is the integer alone (``"7"``).

Two rewards, both in [0, 1], weighted 0.2 / 0.8 in the demo so that the total lies in [0, 1]:
  format_reward:   1 if the completion is an integer (at most two digits) that ends with EOS
  answer_reward:   1 for the exact answer, else 0 (partial credit for near misses made the policy collapse
                   onto the mean answer in trials)
"""

from __future__ import annotations

import random
import re

_INTEGER = re.compile(r"-?\d{1,2}")


def make_arithmetic_rows(num_examples: int, seed: int = 0, max_operand: int = 4) -> list[dict]:
    """Rows {"prompt": "a+b=", "answer": int} with a, b in [0, max_operand], drawn from ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"{a}+{b}=", "answer": a + b})
    return rows


def make_arithmetic_sft_rows(num_examples: int, seed: int = 0, max_operand: int = 4) -> list[dict]:
    """Supervised rows {"prompt": "a+b=", "completion": "a+b as digits"}: the demo's warm start (``longrl sft``)."""
    return [{"prompt": r["prompt"], "completion": str(r["answer"])}
            for r in make_arithmetic_rows(num_examples, seed + 7_919, max_operand)]


def _text(completion) -> str:
    if isinstance(completion, list):  # chat format: [{"role": "assistant", "content": ...}]
        return completion[-1]["content"] if completion else ""
    return completion


def format_reward(prompts, completions, truncated=None, **kwargs) -> list[float]:
    """1 for an integer answer that ends the completion (EOS came before the length limit)."""
    ended = truncated if truncated is not None else [False] * len(completions)
    return [1.0 if _INTEGER.fullmatch(_text(c).strip()) and not t else 0.0 for c, t in zip(completions, ended)]


def answer_reward(prompts, completions, answer, **kwargs) -> list[float]:
    out = []
    for c, a in zip(completions, answer):
        text = _text(c).strip()
        if not _INTEGER.fullmatch(text):
            out.append(0.0)
            continue
        error = abs(int(text) - int(a))
        out.append(1.0 if error == 0 else 0.0)
    return out
