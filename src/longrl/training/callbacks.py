"""Callbacks: objects the loop calls at four points of a run. Each method is optional; define only those you need.

    class PrintReward:
        def on_train_begin(self, trainer): ...             # after a resume, before the first step
        def on_step_end(self, step, metrics): ...          # after each optimizer step (metrics as in metrics.jsonl)
        def on_save(self, path): ...                       # after a checkpoint is in place
        def on_train_end(self, history): ...               # after the last step (the list of each step's metrics)

``transformers.TrainerCallback`` objects are not supported (longrl's loop is not a ``transformers.Trainer``: it has
no TrainerState or TrainerControl to give them); they are refused with this protocol named.
"""

from __future__ import annotations

from typing import Protocol

EVENTS = ("on_train_begin", "on_step_end", "on_save", "on_train_end")


class Callback(Protocol):
    def on_train_begin(self, trainer) -> None: ...

    def on_step_end(self, step: int, metrics: dict) -> None: ...

    def on_save(self, path) -> None: ...

    def on_train_end(self, history: list[dict]) -> None: ...


def check_callbacks(callbacks) -> list:
    """The callbacks as a list; a transformers TrainerCallback or an object with none of the four methods is
    refused."""
    out = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    for i, cb in enumerate(out):
        cls = cb if isinstance(cb, type) else type(cb)
        if any(c.__module__.startswith("transformers") and c.__name__ == "TrainerCallback" for c in cls.__mro__):
            raise TypeError(f"callbacks[{i}]: {cls.__name__} is a transformers.TrainerCallback, which longrl does not "
                            f"run; give an object with any of {', '.join(EVENTS)} (see longrl.training.callbacks)")
        if isinstance(cb, type):
            raise TypeError(f"callbacks[{i}]: {cls.__name__} is a class; pass an instance")
        if not any(callable(getattr(cb, e, None)) for e in EVENTS):
            raise TypeError(f"callbacks[{i}]: {cls.__name__} has none of {', '.join(EVENTS)}")
    return out


def notify(callbacks: list, event: str, *args) -> None:
    """Call ``event`` on each callback that defines it, in order."""
    for cb in callbacks:
        method = getattr(cb, event, None)
        if callable(method):
            method(*args)
