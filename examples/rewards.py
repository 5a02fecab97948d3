"""Example reward functions for examples/prompts.jsonl, in TRL's signature:
``f(prompts, completions, **columns) -> list[float | None]``.

``completions`` holds, for chat prompts, ``[{"role": "assistant", "content": text}]`` per completion (plain
strings for plain-text prompts); every other dataset column arrives as a keyword argument (here ``answer``),
with ``completion_ids`` and ``truncated`` besides. Use them in a config as
``rewards: [{function: examples/rewards.py:correct_answer, weight: 1.0}]``.
"""

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def correct_answer(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number in the completion equals the row's answer, else 0.0."""
    out = []
    for completion, expected in zip(completions, answer):
        numbers = _NUMBER.findall(_text(completion))
        out.append(1.0 if numbers and float(numbers[-1]) == float(expected) else 0.0)
    return out


def number_only(prompts, completions, truncated=None, **kwargs) -> list[float]:
    """1.0 when the whole completion is one number and it ended before the length limit, else 0.0."""
    ended = truncated if truncated is not None else [False] * len(completions)
    return [1.0 if _NUMBER.fullmatch(_text(c).strip()) and not cut else 0.0 for c, cut in zip(completions, ended)]
