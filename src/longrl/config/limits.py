"""Sizes that cannot fit, refused before anything is allocated.

Lower bounds of the host memory a run needs, from the config alone (no model):

  task rows      data.num_examples × ROW_BYTES                       (the generated prompt rows)
  rollout batch  P·G × (max_prompt_length + max_completion_length) × TOKEN_BYTES
                 (P = train.prompts_per_step, G = grpo.num_generations; per token: the id lists, the mask, the loss
                 weights and up to four float32 log-prob rows of the step)

A config whose bound exceeds the host's physical memory raises :class:`~longrl.config.errors.ConfigError` naming the key
and the GiB it would need. These are floors, not predictions: a config that passes may still not fit (``longrl
plan`` predicts GPU peaks).
"""

from __future__ import annotations

import os

from .errors import ConfigError

GIB = 2**30
ROW_BYTES = 400  # a generated task row: a dict of two or three short strings
TOKEN_BYTES = 40  # an id in a Python list (8) + mask and weights (2 × 4) + four float32 log-prob rows (4 × 4) + slack


def host_memory_bytes() -> int | None:
    """Physical memory of this host (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_sizes(cfg, host_bytes: int | None = None) -> None:
    """Raise ConfigError when a size in ``cfg`` needs more host memory than ``host_bytes`` (default: this host's)."""
    host = host_memory_bytes() if host_bytes is None else host_bytes
    if not host:
        return
    t, g, gen, data = cfg.train, cfg.grpo, cfg.generation, cfg.data

    def refuse(key: str, value, need: int, what: str) -> None:
        raise ConfigError(f"config key '{key}': got {value!r}; {what} needs at least {need / GIB:,.1f} GiB of host "
                          f"memory, more than this host's {host / GIB:,.1f} GiB")

    if data.source.startswith("task:") and data.num_examples and data.num_examples * ROW_BYTES > host:
        refuse("data.num_examples", data.num_examples, data.num_examples * ROW_BYTES,
               f"generating {data.num_examples:,} task rows")
    rows = t.prompts_per_step * g.num_generations
    tokens = data.max_prompt_length + gen.max_completion_length
    need = rows * tokens * TOKEN_BYTES
    if need > host:
        key, value = max([("train.prompts_per_step", t.prompts_per_step), ("grpo.num_generations", g.num_generations),
                          ("generation.max_completion_length", gen.max_completion_length),
                          ("data.max_prompt_length", data.max_prompt_length)], key=lambda kv: kv[1])
        refuse(key, value, need, f"a rollout batch of {t.prompts_per_step:,} prompts × {g.num_generations:,} "
               f"completions × {tokens:,} tokens")
