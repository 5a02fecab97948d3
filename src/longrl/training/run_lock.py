"""One run per output directory.

:func:`acquire_run_lock` takes an exclusive ``fcntl.flock`` on ``OUTPUT_DIR/.longrl.lock`` before anything is
written there and records the holder (pid, host, start time, command line) in it. A second run into the same
directory, fresh or resumed, fails at once naming the holder. The kernel drops the lock when its process dies, so a
lock left by a killed run is simply taken over. The lock is re-entrant within a process (the CLI and the trainer may
both take it).

:func:`check_output_dir_contents` refuses a directory that holds anything but a longrl run (a user's own files),
unless ``output.overwrite_output_dir=true``; :data:`MARKER_FILE` names the kind of run that made a directory.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_FILE = ".longrl.lock"
MARKER_FILE = ".longrl-run.json"  # {"kind": "grpo", "command": "train" | "demo"}: written when a run claims a dir
_held: dict[str, "RunLock"] = {}  # resolved lock path → this process's lock on it


class RunLockError(RuntimeError):
    """Another live process holds the output directory's lock; the message names it."""


class OutputDirError(ValueError):
    """The output directory holds files that are not a longrl run's; the message names some of them."""


class RunLock:
    """This process's hold on an output directory (release it with :meth:`release` or as a context manager)."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd, self.count = path, fd, 1

    def release(self) -> None:
        self.count -= 1
        if self.count > 0 or self.fd < 0:
            return
        import fcntl

        _held.pop(str(self.path), None)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = -1

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {info.get('pid')} on host {info.get('host')}, started {info.get('started')}: " \
               f"{info.get('command', '?')}"
    except (ValueError, AttributeError):
        return "a process that recorded no details"


def acquire_run_lock(output_dir: str | Path) -> RunLock:
    """Lock ``output_dir`` (created if missing) for this process, or raise :class:`RunLockError` naming the
    live holder."""
    import fcntl

    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"config key 'output.output_dir': {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    path = (out / LOCK_FILE).resolve()
    mine = _held.get(str(path))
    if mine is not None and mine.held:
        mine.count += 1
        return mine
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        os.close(fd)
        raise RunLockError(f"output directory {out} is in use by another run ({_holder(text)}); wait for it to "
                           f"finish or stop it, or choose another output.output_dir (lock: {path})") from None
    except OSError:
        os.close(fd)
        raise
    previous = os.pread(fd, 4096, 0).decode(errors="replace")
    if previous.strip():
        try:
            if json.loads(previous).get("pid") != os.getpid():
                log.info("%s: took over the lock of a run that is gone (%s)", out, _holder(previous))
        except (ValueError, AttributeError):
            pass
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(sys.argv)[:500]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    lock = RunLock(path, fd)
    _held[str(path)] = lock
    return lock


def _is_checkpoint(p: Path) -> bool:
    return p.name.startswith("checkpoint-") and (p / "trainer_state.json").is_file()


def run_marker(output_dir: str | Path) -> dict | None:
    """The kind of run that made ``output_dir`` ({"kind", "command"}), or None if no longrl run marked it."""
    try:
        return json.loads((Path(output_dir) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def check_output_dir_contents(output_dir: str | Path, kind: str = "grpo", command: str = "train",
                              overwrite: bool = False) -> None:
    """Refuse an output directory that is neither new, empty, nor a longrl run of ``kind``; then mark it.

    A longrl run's directory carries :data:`MARKER_FILE` (earlier versions: a ``checkpoint-STEP``) and may hold
    anything its runs wrote (metrics, plots, exports). Any other non-empty directory (a user's ``config.yaml``,
    data, another tool's outputs) raises :class:`OutputDirError` unless ``overwrite``."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"config key 'output.output_dir': {out} exists and is not a directory")
    entries = sorted(p for p in out.iterdir()) if out.is_dir() else []
    marker = run_marker(out)
    if marker is not None and marker.get("kind", kind) != kind:
        raise OutputDirError(f"config key 'output.output_dir': {out} holds a longrl {marker.get('kind')!r} run, "
                             f"not a {kind!r} one; choose another output.output_dir")
    ours = marker is not None or any(_is_checkpoint(p) for p in entries)  # a run's directory holds its own files
    foreign = [] if ours else [p.name for p in entries if p.name not in (LOCK_FILE, MARKER_FILE)]
    if foreign and not overwrite:
        raise OutputDirError(f"config key 'output.output_dir': {out} holds files that are not a longrl run's "
                             f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); longrl would "
                             "write config.yaml, metrics.jsonl and checkpoints among them. Choose a new or empty "
                             "directory, or set output.overwrite_output_dir=true to write there anyway")
    if marker is None:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{MARKER_FILE}.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"kind": kind, "command": command}) + "\n")
        os.replace(tmp, out / MARKER_FILE)
