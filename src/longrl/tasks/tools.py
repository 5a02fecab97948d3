"""A lookup task that cannot be solved without its tool: the built-in multi-turn demo (``longrl demo --task tools``).

Each row holds a key digit and a secret digit drawn independently of it (``{"prompt": "k=", "key": k,
"secret": v}``), so that nothing in the prompt tells the answer. The tiny demo model's vocabulary (digits, signs,
space) cannot spell JSON, so the task has its own one-character tool-call format: a turn that ends with ``?``
looks the key up, and the environment answers with the secret as a tool message. Any other turn is the answer
and ends the episode. The demo samples one token a turn (generation.max_completion_length=1)::

    prompt "3="  →  model "?"  →  tool "7"  →  model "7"        answer_reward 1, lookup_reward 1

Without the tool (``NoLookupEnvironment``: a lookup answers "-") the best policy guesses one digit in ten:
answer_reward ≤ 0.1 on average, so the demo's total (0.2 · lookup + 0.8 · answer) stays ≤ 0.08.
"""

from __future__ import annotations

import random

from ..agents.environment import Environment

CALL = "?"
NO_ANSWER = "-"


def make_lookup_rows(num_examples: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        key, secret = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{key}=", "key": key, "secret": secret})
    return rows


class LookupEnvironment(Environment):
    """Answers a turn ending with '?' with the row's secret; any other turn ends the episode (reward 1 if it is the
    secret)."""

    tool_available = True

    def reset(self, row: dict):
        self.secret = str(row["secret"])
        return None  # the row's prompt opens the episode

    def step(self, assistant_message: dict):
        text = (assistant_message.get("content") or "").strip()
        if text.endswith(CALL):
            self.stats["tool_calls"] += 1
            if not self.tool_available:
                self.stats["tool_errors"] += 1
            return [{"role": "tool", "name": "lookup",
                     "content": self.secret if self.tool_available else NO_ANSWER}], None, False
        return [], float(text == self.secret), True


class NoLookupEnvironment(LookupEnvironment):
    """The same episodes with the tool unavailable (the control: nothing to learn from)."""

    tool_available = False


def _messages(completion) -> list[dict]:
    return completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]


def lookup_reward(prompts, completions, **kwargs) -> list[float]:
    """1 if the episode looked its key up and got the secret back."""
    return [float(any(m["role"] == "tool" and m["content"].isdigit() for m in _messages(c))) for c in completions]


def answer_reward(prompts, completions, secret, **kwargs) -> list[float]:
    """1 if the episode's last message is the model's answer and it is the secret."""
    out = []
    for c, s in zip(completions, secret):
        msgs = _messages(c)
        last = msgs[-1] if msgs else {"role": "none", "content": ""}
        out.append(float(last["role"] == "assistant" and last["content"].strip() == str(s)))
    return out
