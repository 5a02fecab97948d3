"""Reward for math answers, with TRL's signature: the completion's final answer against the row's ``answer``.

The final answer is the content of the last ``\\boxed{...}`` if there is one, else the last number in the text.
Answers compare as numbers when both parse as one (``1,000`` = ``1000.0``), else as strings without spaces and
``$``. A row without an answer (None) gets None: the reward does not apply to it.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def completion_text(completion) -> str:
    """A completion's text: a string as it is, a chat completion's last message's content."""
    if isinstance(completion, list):  # chat: [{"role": "assistant", "content": ...}]
        return completion[-1]["content"] if completion else ""
    return completion


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normal(answer: str) -> str | float:
    s = str(answer).strip().replace("$", "").replace(" ", "")
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return s


def answer_reward(prompts, completions, answer, **kwargs) -> list[float | None]:
    """1.0 when the final answer equals the row's ``answer``, else 0.0."""
    out = []
    for completion, expected in zip(completions, answer):
        if expected is None:
            out.append(None)
            continue
        got = final_answer(completion_text(completion))
        out.append(1.0 if got is not None and _normal(got) == _normal(expected) else 0.0)
    return out
