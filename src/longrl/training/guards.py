"""When a run saves and when it stops early, decided from one step's outcome at a time.

- A step whose loss or gradient norm is not finite makes no update (the trainer skips the optimizer step); after
  ``train.max_nonfinite_steps`` such steps in a row the run stops (exit code :data:`EXIT_GUARD`) with a checkpoint
  of its weights, which no non-finite step touched.
- A rollout batch gives no learning signal when no sample has both tokens in the loss and a non-zero advantage
  (every reward failed or was None, or each group's rewards are equal); after ``train.max_no_signal_steps`` such
  batches in a row the run stops the same way.
- Saves fall due every ``output.save_steps`` steps, every ``output.save_minutes`` minutes, and at the last step.

Both recipes (GRPO, SFT) run their loop through :func:`agreed` (every rank takes the same decision),
:func:`save_or_stop` (a failed write stops the run, or is skipped with ``output.on_save_error=continue``) inside
:func:`checkpoint_after_step` (which then ends a stopped run with its checkpoint and the command that resumes it).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

EXIT_GUARD = 3  # a guard stopped the run (non-finite steps, no learning signal); a checkpoint was written
EXIT_SAVE_FAILED = 4  # a checkpoint could not be written (e.g. disk full)


def has_learning_signal(advantages: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether any sample has a non-zero advantage and at least one token in the loss (``mask`` [N, T])."""
    return bool(((advantages != 0) & torch.isfinite(advantages) & (mask.sum(-1) > 0)).any())


class RunGuards:
    def __init__(self, cfg, total_steps: int | None = None):
        self.cfg = cfg
        self.total_steps = cfg.train.max_steps if total_steps is None else total_steps  # the run's last step
        self.nonfinite_in_a_row = 0
        self.no_signal_in_a_row = 0
        self.last_save_s = time.monotonic()

    def after_step(self, step: int, nonfinite: list[str], new_batch_signal: bool | None) -> str | None:
        """Count this step's outcome (``nonfinite``: the terms that were not finite; ``new_batch_signal``: whether a
        new rollout batch had a learning signal, None when the step reused a batch); a stop reason, or None."""
        t = self.cfg.train
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if nonfinite else 0
        if self.nonfinite_in_a_row >= t.max_nonfinite_steps:
            return (f"{self.nonfinite_in_a_row} steps in a row (up to step {step}) had a non-finite "
                    f"{' and '.join(nonfinite)} and made no update (train.max_nonfinite_steps="
                    f"{t.max_nonfinite_steps}); lower train.learning_rate or check the rewards and data")
        if new_batch_signal is not None:
            self.no_signal_in_a_row = 0 if new_batch_signal else self.no_signal_in_a_row + 1
            if t.max_no_signal_steps and self.no_signal_in_a_row >= t.max_no_signal_steps:
                return (f"{self.no_signal_in_a_row} rollout batches in a row (up to step {step}) gave no learning "
                        "signal: every reward failed or was None, or all completions of each prompt scored the same "
                        f"(train.max_no_signal_steps={t.max_no_signal_steps}); check the reward functions")
        return None

    def save_due(self, step: int) -> bool:
        o = self.cfg.output
        by_minutes = o.save_minutes > 0 and time.monotonic() - self.last_save_s >= o.save_minutes * 60
        return bool((o.save_steps and step % o.save_steps == 0) or step == self.total_steps or by_minutes)

    def saved(self) -> None:
        self.last_save_s = time.monotonic()


def step_if_finite(optimizer, step: int, loss: float, grad_norm: float) -> list[str]:
    """``optimizer.step()`` when the step's loss and gradient norm are finite; else no update (the gradients are
    dropped, a warning names the step) and the terms that were not finite, for :meth:`RunGuards.after_step`."""
    nonfinite = [name for name, v in (("loss", loss), ("gradient norm", grad_norm)) if not math.isfinite(v)]
    if nonfinite:
        optimizer.zero_grad(set_to_none=True)
        log.warning("step %d: %s not finite (loss %s, gradient norm %s): no update", step, " and ".join(nonfinite),
                    loss, grad_norm)
    else:
        optimizer.step()
    return nonfinite


def agreed(world, received: int | None, save_due: bool, signal: bool = True) -> tuple[int | None, bool, bool]:
    """(signal received, save due, learning signal) of any rank, on every rank (one process: as given)."""
    if world.world_size == 1:
        return received, save_due, signal
    any_rank = world.max_floats({"received": received or 0, "save_due": save_due, "signal": signal})
    return int(any_rank["received"]) or None, bool(any_rank["save_due"]), bool(any_rank["signal"])


def first_stop(stop: tuple[str, int] | None, received: int | None, reason: str | None) -> tuple[str, int] | None:
    """The run's stop, (message, exit code): the first one asked for, by a signal (128 + its number) or a guard
    (:data:`EXIT_GUARD`); None while nothing asked."""
    from .signals import signal_name

    if stop is not None:
        return stop
    if received is not None:
        return f"stopped by {signal_name(received)}", 128 + received
    return (f"stopped: {reason}", EXIT_GUARD) if reason else None


def save_or_stop(save, cfg, output_dir: Path, guards: RunGuards) -> Path | None:
    """``save()``; a write that fails (disk full) stops the run (exit code :data:`EXIT_SAVE_FAILED`), or with
    ``output.on_save_error=continue`` is reported and the run goes on without that checkpoint."""
    from .checkpoint import CheckpointWriteError, latest_checkpoint
    from .signals import TrainingStopped

    try:
        path = save()
    except CheckpointWriteError as e:
        if cfg.output.on_save_error == "continue":
            log.error("%s; going on without it (output.on_save_error=continue)", e.strerror or e)
            return None
        raise TrainingStopped(f"{e.strerror or e}; stopped (output.on_save_error=continue goes on without "
                              "saving)", EXIT_SAVE_FAILED, latest_checkpoint(output_dir)) from e
    guards.saved()
    return path


def checkpoint_after_step(save, cfg, output_dir: Path, guards: RunGuards, step: int, stop: tuple[str, int] | None,
                          save_due: bool, command: str, on_saved=None) -> None:
    """Save when ``save_due`` or stopping (:func:`save_or_stop`; ``on_saved()`` once a checkpoint is written); then,
    for ``stop`` = (reason, exit code), raise the TrainingStopped naming the newest checkpoint and how to resume
    (``command``: train or sft)."""
    from .checkpoint import latest_checkpoint
    from .signals import TrainingStopped

    if (stop or save_due) and save_or_stop(save, cfg, output_dir, guards) is not None and on_saved is not None:
        on_saved()
    if stop:
        path = latest_checkpoint(output_dir)
        raise TrainingStopped(f"{stop[0]} after step {step}: checkpoint {path}; resume with: longrl {command} "
                              f"{output_dir / 'config.yaml'} output.resume=true", stop[1], path)
