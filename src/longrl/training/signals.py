"""Signals that stop a run with a checkpoint.

Inside :class:`StopSignals`, SIGTERM (``docker stop``, schedulers), SIGINT (Ctrl-C), SIGHUP (a closed terminal)
and SIGUSR1 (sent by schedulers such as Slurm before pre-emption) do not kill the process: they set
:attr:`StopSignals.received`, and the trainer finishes the step it is in, writes a checkpoint and raises
:class:`TrainingStopped` with exit code 128 + the signal. A second SIGINT raises :class:`ImmediateStop` at once
(nothing half-written is ever named as a checkpoint: saves are staged and renamed, and the next start cleans up).

Handlers are installed only from the main thread (Python delivers signals there); elsewhere the block is a no-op.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")
                     if hasattr(signal, name))


class ImmediateStop(BaseException):
    """A second Ctrl-C: stop now, without the checkpoint (BaseException, so that no ``except Exception`` in a
    reward function or library swallows it)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped at once by a second {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


class TrainingStopped(Exception):
    """The run stopped before ``train.max_steps`` (a signal, or a guard such as non-finite steps), after writing
    ``checkpoint`` (None when none could be written). ``exit_code``: what the command line exits with."""

    def __init__(self, message: str, exit_code: int, checkpoint=None):
        super().__init__(message)
        self.exit_code, self.checkpoint = exit_code, checkpoint


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """Context manager: record stop signals instead of dying (see the module docstring)."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise ImmediateStop(signum)
        if self.received is None:
            self.received = signum
            log.warning("received %s: stopping after this step and writing a checkpoint%s", signal_name(signum),
                        " (Ctrl-C again stops at once, without it)" if signum == signal.SIGINT else "")

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
