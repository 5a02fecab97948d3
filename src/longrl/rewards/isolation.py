"""Containment of reward calls: a per-call time limit in the trainer's process, or a worker process.

In process (``isolation: none``), :func:`call_time_limit` arms SIGALRM for the call (main thread only) and the
handler raises :class:`RewardTimeout`, a BaseException, so that the function's own ``except Exception`` cannot
swallow it. A call blocked inside C code that never returns to Python is not interrupted: such functions belong in
a worker.

In a worker (``isolation: process``), :class:`ProcessReward` runs the function in ``python worker.py REF`` (a new
session, so a Ctrl-C at the terminal reaches only the trainer; optional address-space and CPU-second limits). A
call that overruns its limit kills the worker (SIGKILL) and fails; the next call starts a new one. Requests and
answers are JSON lines: the worker cannot send the trainer anything that runs code.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")


class RewardTimeout(BaseException):
    """A reward call ran past its time limit (a BaseException: reward code cannot catch it by accident)."""


class RewardCallError(RuntimeError):
    """A reward call in a worker failed (the worker's error, its exit, or its time limit); the message says which."""


@contextlib.contextmanager
def call_time_limit(seconds: float):
    """Raise :class:`RewardTimeout` in the body after ``seconds`` (0, or outside the main thread: no limit)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise RewardTimeout(f"timed out after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class ProcessReward:
    """A reward function run in a worker process; call it like the function (TRL's signature)."""

    def __init__(self, ref: str, timeout_s: float = 300.0, memory_limit_gib: float = 0.0, cpu_limit_s: float = 0.0,
                 start_timeout_s: float = 120.0):
        self.ref, self.timeout_s, self.start_timeout_s = ref, timeout_s, start_timeout_s
        self.env = {**os.environ, "LONGRL_REWARD_MEMORY_BYTES": str(int(memory_limit_gib * 2**30)),
                    "LONGRL_REWARD_CPU_S": str(cpu_limit_s)}
        self.limited = memory_limit_gib > 0 or cpu_limit_s > 0
        self.proc: subprocess.Popen | None = None
        self._buffer = b""
        atexit.register(self.close)

    def start(self) -> None:
        """Start the worker and wait until the function is imported; an import failure raises
        :class:`RewardCallError` with the worker's error."""
        self.close()
        self.proc = subprocess.Popen([sys.executable, str(WORKER), self.ref], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=self.env, start_new_session=True)
        self._buffer = b""
        answer = self._answer(self.start_timeout_s, "starting")
        if "error" in answer:
            self.close()
            raise RewardCallError(f"importing it in a worker process failed: {answer['error']}")

    def _answer(self, timeout_s: float, doing: str) -> dict:
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.close()
                raise RewardCallError(f"timed out after {timeout_s:g} s while {doing} (worker killed; the next call "
                                      "starts a new one)")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                code = self.proc.wait()
                self.proc = None
                hint = " (its memory or CPU limit?)" if self.limited else ""
                raise RewardCallError(f"the worker process exited with code {code} while {doing}{hint}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def __call__(self, prompts, completions, **columns) -> list:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        request = json.dumps({"prompts": prompts, "completions": completions, "columns": columns}, default=str)
        try:
            self.proc.stdin.write(request.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.close()
            raise RewardCallError("the worker process is gone (it exited before the call)") from None
        answer = self._answer(self.timeout_s, "scoring")
        if "error" in answer:
            raise RewardCallError(answer["error"])
        return answer["values"]

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                with contextlib.suppress(OSError):
                    stream.close()
            self.proc = None
