"""Reward functions with TRL's signature ``f(prompts, completions, **columns) -> list[float | None]``.

A reward function is referenced as ``path/to/file.py:function`` or ``package.module:function``. Scoring
never stops the run: a function that raises, returns the wrong number of values or a non-number is
reported (which function, which sample) and the samples it failed on get no learning signal (NaN total
reward, zero advantage, no tokens in the loss). ``None`` means "does not apply to this sample", as in
TRL: that function is left out of the sample's weighted sum.

A function's return value must hold one number or None per completion (a list, tuple, 1-D array or tensor, or an
iterator); a dict, a string, a set or a scalar fails the whole batch, naming the function.
An entry with ``url`` instead of a function is a reward server (:mod:`.server`), scored through the same failure
accounting.

Containment: each call gets its own deep copies of the inputs (a function that edits ``completions`` in place
changes nothing another function or the logs see); a call has a time limit (``timeout_s``); ``SystemExit`` and
``KeyboardInterrupt`` raised by a function (at import or in a call) are that function's failure, not the
process's exit; ``isolation: process`` runs the function in a worker process (see :mod:`.isolation`).
"""

from __future__ import annotations

import copy
import difflib
import hashlib
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

from .isolation import ProcessReward, RewardCallError, RewardTimeout, call_time_limit
from .server import ServerReward, ServerRewardError, server_name

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
            near = _near(path.name, [p.name for p in path.parent.glob("*.py")] if path.parent.is_dir() else [])
            raise RewardLoadError(f"reward function {ref!r}: file not found: {path}{near}")
        module_name = f"longrl_reward_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit, KeyboardInterrupt) as e:  # the user's file failed (or exited) at import
            sys.modules.pop(module_name, None)
            raise RewardLoadError(f"reward function {ref!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise RewardLoadError(f"reward function {ref!r}: cannot import module {target!r}: {e}") from e
        except (Exception, SystemExit, KeyboardInterrupt) as e:
            raise RewardLoadError(f"reward function {ref!r}: importing module {target!r} failed: "
                                  f"{type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if fn is None:
        functions = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                     and getattr(v, "__module__", None) == module.__name__]
        raise RewardLoadError(f"reward function {ref!r}: {target} has no attribute {name!r}"
                              f"{_near(name, functions) or _listed(functions)}")
    if not callable(fn):
        raise RewardLoadError(f"reward function {ref!r}: {name!r} is not callable")
    return fn


def _near(name: str, candidates: list[str]) -> str:
    """'; did you mean X?' for the closest of ``candidates`` to a misspelt ``name`` ('' when none is close)."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _listed(functions: list[str]) -> str:
    return f"; its functions: {', '.join(sorted(functions)[:10])}" if functions else ""


def reward_file_fingerprints(specs) -> dict[str, str]:
    """{reward file path: SHA-256} of the entries given as ``path/to/file.py:function`` (a module reference is code
    installed as a package, versioned with it; a server is not code of the run). A resume compares them."""
    out = {}
    for s in specs:
        target = s.function.rsplit(":", 1)[0] if ":" in (s.function or "") else ""
        if target.endswith(".py") or "/" in target or "\\" in target:
            path = Path(target).expanduser()
            if path.is_file():
                out[str(path.resolve())] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


class RewardReturnError(TypeError):
    """A reward function returned something other than one number or None per completion."""


def _values(out, n: int) -> list:
    """``out`` as a list of n values: a list, tuple, 1-D array or tensor, or an iterator (read once, as TRL does);
    a dict (its keys are not rewards), a string, a set (no order) or a scalar raises RewardReturnError; a wrong
    length raises ValueError."""
    if isinstance(out, torch.Tensor) or type(out).__name__ == "ndarray":
        if getattr(out, "ndim", 1) != 1:
            raise RewardReturnError(f"returned an array of shape {tuple(out.shape)}; expected one value per completion")
        out = out.tolist()
    if isinstance(out, (str, bytes, dict, set, frozenset)) or not hasattr(out, "__iter__"):
        raise RewardReturnError(f"returned {type(out).__name__} {repr(out)[:60]}; expected a list of numbers or None, "
                                "one per completion")
    out = list(out)
    if len(out) != n:
        raise ValueError(f"returned {len(out)} values for {n} completions")
    return out


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
    """Calls each reward function on a batch and combines them with weights.

    ``timeouts_s``: each function's per-call limit (0: none; default 300 s each)."""

    def __init__(self, functions: list[tuple[str, Callable, float]], timeouts_s: list[float] | None = None):
        if not functions:
            raise RewardLoadError("at least one reward function is needed")
        self.functions = functions  # (name, callable, weight)
        self.timeouts_s = list(timeouts_s) if timeouts_s is not None else [300.0] * len(functions)
        self._warned: set[tuple[str, str]] = set()

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.functions]

    @classmethod
    def from_specs(cls, specs) -> "RewardScorer":
        functions = []
        for i, s in enumerate(specs):
            if getattr(s, "url", ""):
                functions.append((server_name(s.url), _server(s, i), s.weight))
                continue
            name = s.function.rsplit(":", 1)[1]
            if getattr(s, "isolation", "none") == "process":
                fn = ProcessReward(s.function, s.timeout_s, s.memory_limit_gib, s.cpu_limit_s)
                try:
                    fn.start()  # the import fails here, before the model loads
                except RewardCallError as e:
                    raise RewardLoadError(f"reward function {s.function!r} (config key 'rewards[{i}]'): {e}") from e
            else:
                fn = load_reward_function(s.function)
            functions.append((name, fn, s.weight))
        return cls(functions, [getattr(s, "timeout_s", 300.0) for s in specs])

    def _invoke(self, fn, timeout_s: float, prompts, completions, columns) -> list:
        """One call on deep copies of the inputs, within the time limit (a worker enforces its own), its return value
        checked to be one value per completion (_values)."""
        args = copy.deepcopy((prompts, completions, columns))
        if isinstance(fn, ProcessReward):
            return _values(fn(prompts=args[0], completions=args[1], **args[2]), len(completions))
        with call_time_limit(timeout_s):
            out = fn(prompts=args[0], completions=args[1], **args[2])
        return _values(out, len(completions))

    def _call(self, name, fn, prompts, completions, columns, timeout_s: float = 300.0):
        """Per-sample values (float, None, or NaN for a failure) of one function, and one failure per failed
        sample. An exception or a wrong number of values from the batch call is retried one sample at a time
        (isolating the failing samples); a time-out, an exit, a return value of the wrong kind or a worker's
        failure fails the whole batch. A server reports its failures per request (:mod:`.server`)."""
        n = len(completions)
        if isinstance(fn, ServerReward):
            values, failed = fn.score(prompts, completions, columns)
            return values, [RewardFailure(name, i, reason) for i, reason in failed]
        try:
            out = self._invoke(fn, timeout_s, prompts, completions, columns)
        except (RewardTimeout, RewardCallError, RewardReturnError, SystemExit, KeyboardInterrupt) as e:
            return [math.nan] * n, [RewardFailure(name, i, f"{type(e).__name__}: {e}") for i in range(n)]
        except Exception as e:  # isolate the failing samples by calling one at a time
            batch_reason = f"{type(e).__name__}: {e}"
        else:
            values, failures = [], []
            for i, v in enumerate(out):
                try:
                    values.append(_as_float(v))
                except TypeError as e:
                    values.append(math.nan)
                    failures.append(RewardFailure(name, i, f"TypeError: {e}"))
            return values, failures
        values, failures = [], []
        for i in range(n):
            try:
                one = self._invoke(fn, timeout_s, prompts[i:i + 1], completions[i:i + 1],
                                   {k: v[i:i + 1] for k, v in columns.items()})
                values.append(_as_float(one[0]))
            except (Exception, RewardTimeout, SystemExit, KeyboardInterrupt) as e:
                values.append(math.nan)
                failures.append(RewardFailure(name, i, f"{type(e).__name__}: {e}"))
                if isinstance(e, RewardTimeout):  # one sample overran: the rest would too, one limit each
                    failures += [RewardFailure(name, k, f"not scored after sample {i} timed out")
                                 for k in range(i + 1, n)]
                    values += [math.nan] * (n - i - 1)
                    break
        if not failures:  # each sample works alone but the batch call did not
            self._warn_once(name, "batch", f"reward function {name!r}: the batch call failed ({batch_reason}); "
                            "scored one sample at a time")
        return values, failures

    def _warn_once(self, name: str, kind: str, message: str) -> None:
        if (name, kind) not in self._warned:
            self._warned.add((name, kind))
            log.warning(message)

    def score(self, prompts: list, completions: list, columns: dict[str, list]):
        """Return (per_function [N, F] float tensor with NaN for None/failure, total [N] with NaN where no
        learning signal, failures: one per failed (function, sample))."""
        n = len(completions)
        per_function = torch.full((n, len(self.functions)), math.nan)
        weights = torch.tensor([w for _, _, w in self.functions], dtype=torch.float32)
        failed = torch.zeros(n, dtype=torch.bool)
        failures: list[RewardFailure] = []
        for j, (name, fn, _) in enumerate(self.functions):
            values, errs = self._call(name, fn, prompts, completions, columns, self.timeouts_s[j])
            failures += errs
            for i, v in enumerate(values):
                if v is None:
                    continue
                if isinstance(v, float) and math.isnan(v):
                    failed[i] = True
                else:
                    per_function[i, j] = v
            if n and all(v is None for v in values):
                self._warn_once(name, "none", f"reward function {name!r} returned None for every sample of a batch: "
                                "it gives no learning signal there")
        applies = ~torch.isnan(per_function)
        total = torch.where(applies, per_function * weights, torch.zeros_like(per_function)).sum(-1)
        total[failed | ~applies.any(-1)] = math.nan
        for f in failures:  # the caller reports them summed per function (reporting.reward_failure_lines)
            log.debug(str(f))
        return per_function, total, failures

    def close(self) -> None:
        """Stop the worker processes (functions with ``isolation: process``) and the servers' request threads."""
        for _, fn, _ in self.functions:
            if isinstance(fn, (ProcessReward, ServerReward)):
                fn.close()


def _server(spec, i: int) -> ServerReward:
    """The ServerReward of entry ``i``, reachable (checked before the model loads)."""
    try:
        server = ServerReward(spec.url, timeout_s=spec.timeout_s, auth_env=spec.auth_env or None,
                              batch_size=spec.batch_size, max_concurrency=spec.max_concurrency,
                              max_retries=spec.max_retries, retry_backoff_s=spec.retry_backoff_s)
        server.check_reachable()
    except ServerRewardError as e:
        raise RewardLoadError(f"reward server (config key 'rewards[{i}].url'): {e}") from e
    return server
