"""Signals that stop a run with a checkpoint.

Inside :class:`StopSignals`, SIGTERM (``docker stop``, schedulers), SIGINT (Ctrl-C), SIGHUP (a closed terminal)
and SIGUSR1 (sent by schedulers such as Slurm before pre-emption) do not kill the process: they set
:attr:`StopSignals.received`, and the trainer finishes the step it is in, writes a checkpoint and raises
:class:`TrainingStopped` with exit code 128 + the signal. A second SIGINT raises :class:`ImmediateStop` at once
(nothing half-written is ever named as a checkpoint: saves are staged and renamed, and the next start cleans up).

Handlers are installed only from the main thread (Python delivers signals there); elsewhere the block is a no-op.

One rank of a torchrun job that stopped this way keeps ignoring SIGTERM, SIGHUP and SIGUSR1 after the loop, while
it closes the run and exits: torchrun sends SIGTERM to the other ranks as soon as one has exited, and the last to
finish (rank 0, which writes the outputs) must not die in the middle. SIGKILL still ends it. Under
``longrl train|sft --nproc-per-node N`` (cli/launcher.py) each stopped rank also writes its exit code to the
launcher's report directory (:func:`report_exit`), so that the launcher exits with it: torchrun itself only says
that a rank failed (exit 1).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

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


EXIT_REPORT_ENV = "LONGRL_EXIT_REPORT_DIR"  # set by cli/launcher.py for the ranks it starts


def report_exit(exit_code: int, message: str) -> None:
    """Tell the launcher (when there is one) this rank's exit code: ``rank-R.json`` in its report directory,
    written whole or not at all."""
    folder = os.environ.get(EXIT_REPORT_ENV)
    if not folder:
        return
    rank = int(os.environ.get("RANK", "0"))
    path = Path(folder) / f"rank-{rank}.json"
    from .checkpoint import atomic_write_text  # here, not at the top: the launcher imports this module without torch

    try:
        atomic_write_text(path, json.dumps({"rank": rank, "exit_code": int(exit_code), "message": message}))
    except OSError as e:  # the launcher then exits with torchrun's own code
        log.warning("could not report the exit code to the launcher (%s): %s", folder, e)


def read_exit_reports(folder: str | Path) -> dict[int, dict]:
    """rank → {"exit_code", "message"} of every rank that reported (:func:`report_exit`)."""
    out = {}
    for path in Path(folder).glob("rank-*.json"):
        try:
            data = json.loads(path.read_text())
            out[int(data["rank"])] = {"exit_code": int(data["exit_code"]), "message": str(data["message"])}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


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
        stopping_rank = self.received is not None and _rank_of_a_job()
        for s, handler in self._previous.items():
            # a stopping rank of a torchrun job ignores SIGTERM/SIGHUP/SIGUSR1 while it closes the run and exits
            # (torchrun sends SIGTERM to the ranks still running as soon as one has exited); SIG_IGN, unlike a
            # Python handler, still holds while the interpreter finalizes
            signal.signal(s, signal.SIG_IGN if stopping_rank and s != signal.SIGINT else handler)
        self._previous.clear()


def _rank_of_a_job() -> bool:
    """Whether this process is one rank of several under torchrun (its environment says so)."""
    return os.environ.get("WORLD_SIZE", "1") != "1" and "RANK" in os.environ

