"""``longrl train|sft --nproc-per-node N``: torchrun under a launcher that passes stop signals to every rank.

torch.distributed.run starts each worker in a session of its own, so a signal sent to the command (a scheduler's
SIGTERM, Ctrl-C in its terminal, a closed terminal's SIGHUP, Slurm's SIGUSR1) reaches none of them. The launcher
runs torchrun in a session of its own too and, for each stop signal it receives, sends that signal to every
worker's process group (torchrun's children), not to torchrun: its agent would send a second one (a second SIGINT
stops a rank at once) and SIGKILL its workers 30 s later, in the middle of their checkpoint. Each rank finishes its
step, writes its checkpoint and reports its exit code (``training/signals.py`` ``report_exit``); the launcher waits
for torchrun and exits with rank 0's code (128 + n after signal n). Without reports it exits with torchrun's code,
or 128 + n when torchrun failed after signal n. If the launcher itself is killed, torchrun gets SIGTERM and
stops its workers the same way (its agent's own handling).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from ..training.signals import EXIT_REPORT_ENV, STOP_SIGNALS, read_exit_reports, signal_name

# runs first in torchrun's process, then execs it: SIGTERM to it when the launcher dies (PR_SET_PDEATHSIG survives
# exec), its agent then stops the workers; a launcher already gone by then means stop at once
DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                   "ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
                   "if os.getppid() != int(sys.argv[1]):\n"
                   "    sys.exit(128 + signal.SIGTERM)\n"
                   "os.execv(sys.argv[2], sys.argv[2:])")


def child_pids(parent: int) -> list[int]:
    """The pids of ``parent``'s children (from /proc/PID/stat; the parent's pid is its 4th field)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # after "PID (command)", which may hold spaces and parentheses
        if len(fields) > 1 and int(fields[1]) == parent:
            out.append(int(entry.name))
    return sorted(out)


def _signal_worker(pid: int, signum: int) -> None:
    """``signum`` to the worker's process group when it leads one (torchrun's workers do), else to it alone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except ProcessLookupError:
        pass


def launch(cmd: list[str]) -> int:
    """Run torchrun's ``cmd``, forward stop signals to its workers, and return the exit code (module docstring)."""
    reports = tempfile.mkdtemp(prefix="longrl-exit-")
    received: list[int] = []
    proc: subprocess.Popen | None = None

    def forward(signum, frame):
        received.append(signum)
        if proc is None:
            return
        workers = child_pids(proc.pid)
        for pid in workers:
            _signal_worker(pid, signum)
        if not workers:  # nothing started yet (or all gone): nothing to checkpoint, torchrun stops
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:
                pass
        print(f"longrl: {signal_name(signum)}: passed to {len(workers)} training processes; waiting for their "
              "checkpoint", file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        proc = subprocess.Popen([sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), *cmd],
                                env={**os.environ, EXIT_REPORT_ENV: reports}, start_new_session=True)
        if received:  # a signal came before torchrun existed
            os.killpg(proc.pid, received[0])
        code = proc.wait()
        ranks = read_exit_reports(reports)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(reports, ignore_errors=True)
    if ranks:
        return ranks[min(ranks)]["exit_code"]
    if received and code != 0:
        return 128 + received[0]
    return code
