"""Reward functions with TRL's signature ``f(prompts, completions, **columns) -> list[float | None]``.

A reward function is referenced as ``path/to/file.py:function`` or ``package.module:function``. Scoring
never stops the run: a function that raises, returns the wrong number of values or a non-number is
reported (which function, which sample) and the samples it failed on get no learning signal (NaN total
reward, zero advantage, no tokens in the loss). ``None`` means "does not apply to this sample", as in
TRL: that function is left out of the sample's weighted sum.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)


class RewardLoadError(ValueError):
    """A reward function reference cannot be resolved; the message names the reference."""


def load_reward_function(ref: str) -> Callable:
    """Resolve ``file.py:function`` or ``package.module:function`` to a callable."""
    if ":" not in ref:
        raise RewardLoadError(f"reward function {ref!r}: expected 'path/to/file.py:function' or 'package.module:function'")
    target, name = ref.rsplit(":", 1)
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise RewardLoadError(f"reward function {ref!r}: file not found: {path}")
        module_name = f"longrl_reward_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # the user's file failed to import
            raise RewardLoadError(f"reward function {ref!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise RewardLoadError(f"reward function {ref!r}: cannot import module {target!r}: {e}") from e
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardLoadError(f"reward function {ref!r}: {target} has no attribute {name!r}")
    if not callable(fn):
        raise RewardLoadError(f"reward function {ref!r}: {name!r} is not callable")
    return fn


@dataclass
class RewardFailure:
    function: str
    sample: int | None  # None: the whole call failed
    reason: str

    def __str__(self) -> str:
        where = "every sample" if self.sample is None else f"sample {self.sample}"
        return f"reward function {self.function!r} failed on {where}: {self.reason}"


def _as_float(value):
    """float, None, or raise TypeError for anything else (bools and NaN count as bad values)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise TypeError(f"returned {value!r} ({type(value).__name__}); expected a finite number or None")
    return float(value)


class RewardScorer:
    """Calls each reward function on a batch and combines them with weights."""

    def __init__(self, functions: list[tuple[str, Callable, float]]):
        if not functions:
            raise RewardLoadError("at least one reward function is needed")
        self.functions = functions  # (name, callable, weight)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.functions]

    @classmethod
    def from_specs(cls, specs) -> "RewardScorer":
        return cls([(s.function.rsplit(":", 1)[1], load_reward_function(s.function), s.weight) for s in specs])

    def _call(self, name, fn, prompts, completions, columns) -> tuple[list, list[RewardFailure]]:
        """Per-sample values (float, None, or NaN for a failure) of one function."""
        n = len(completions)
        try:
            out = list(fn(prompts=prompts, completions=completions, **columns))
            if len(out) != n:
                raise ValueError(f"returned {len(out)} values for {n} completions")
            return [_as_float(v) for v in out], []
        except Exception as e:  # isolate the failing samples by calling one at a time
            batch_reason = f"{type(e).__name__}: {e}"
        values, failures = [], []
        for i in range(n):
            try:
                one = list(fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                              **{k: v[i:i + 1] for k, v in columns.items()}))
                if len(one) != 1:
                    raise ValueError(f"returned {len(one)} values for 1 completion")
                values.append(_as_float(one[0]))
            except Exception as e:
                values.append(math.nan)
                failures.append(RewardFailure(name, i, f"{type(e).__name__}: {e}"))
        if not failures:  # each sample works alone but the batch call did not
            failures.append(RewardFailure(name, None, f"batch call failed ({batch_reason}); scored one sample at a time"))
        return values, failures

    def score(self, prompts: list, completions: list, columns: dict[str, list]):
        """Return (per_function [N, F] float tensor with NaN for None/failure, total [N] with NaN where no
        learning signal, failures)."""
        n = len(completions)
        per_function = torch.full((n, len(self.functions)), math.nan)
        weights = torch.tensor([w for _, _, w in self.functions], dtype=torch.float32)
        failed = torch.zeros(n, dtype=torch.bool)
        failures: list[RewardFailure] = []
        for j, (name, fn, _) in enumerate(self.functions):
            values, errs = self._call(name, fn, prompts, completions, columns)
            failures += errs
            for i, v in enumerate(values):
                if v is None:
                    continue
                if isinstance(v, float) and math.isnan(v):
                    failed[i] = True
                else:
                    per_function[i, j] = v
        applies = ~torch.isnan(per_function)
        total = torch.where(applies, per_function * weights, torch.zeros_like(per_function)).sum(-1)
        total[failed | ~applies.any(-1)] = math.nan
        for f in failures:  # the caller reports them summed per function (reporting.reward_failure_lines)
            log.debug(str(f))
        return per_function, total, failures
