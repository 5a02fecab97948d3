"""Where an export may go: never into, over or inside a training run.

A run's directory is recognised by what a run writes there (its lock, its marker, ``config.yaml``, ``layout.yaml``,
``metrics.jsonl``, ``checkpoint-STEP`` directories and their staging); an export's by :data:`EXPORT_MARKER`, the
provenance file every export is written with (in the staging directory that is renamed into place, so a marker is
there exactly when the export is whole). ``--overwrite`` replaces a previous export and nothing else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..training.checkpoint import STATE_FILE
from ..training.run_dir import CONFIG_FILE, LAYOUT_FILE
from ..training.run_lock import LOCK_FILE, MARKER_FILE, _holder
from .source import ExportError

EXPORT_MARKER = "longrl_export.json"  # {"format": ..., "checkpoint": ..., ...}: written with every export
RUN_MARKS = (LOCK_FILE, MARKER_FILE)  # only a run writes these
RUN_FILES = (*RUN_MARKS, CONFIG_FILE, LAYOUT_FILE, "metrics.jsonl", STATE_FILE)  # a run's (or a checkpoint's),
#                                                                                  though a user's files may be named so


def run_files(directory: Path, marks_only: bool = False) -> list[str]:
    """The names in ``directory`` that a training run writes: its lock, its marker, its checkpoints (a directory
    holding a trainer state, or a checkpoint's staging) and, unless ``marks_only``, its settings and metrics files
    (which a user's own directory may hold too). Empty: not a run's directory."""
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return []
    names = RUN_MARKS if marks_only else RUN_FILES
    return [p.name for p in entries
            if p.name in names or (p.is_dir() and ((p / STATE_FILE).is_file()
                                                   or (not marks_only and p.name.startswith("checkpoint-"))))]


def lock_holder(directory: Path) -> str | None:
    """Who holds ``directory``'s run lock now ("pid ... on host ..."), or None when no live process does. Probed
    with a shared, non-blocking ``flock`` on a separate open of the lock file (never created here), released at
    once."""
    import fcntl

    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
    except OSError:
        return None
    finally:
        os.close(fd)  # closing drops a lock taken here
    return None


def is_export(directory: Path) -> bool:
    """Whether ``directory`` is a whole longrl export (its marker reads as one)."""
    try:
        meta = json.loads((directory / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "format" in meta


def _run_description(run: Path, names: list[str]) -> str:
    holder = lock_holder(run)
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return f"the longrl run {run} ({shown}){f', in use by {holder}' if holder else ''}"


def _enclosing_run(path: Path) -> Path | None:
    """The nearest directory above ``path`` (itself excluded) that holds a run's lock, marker or checkpoints, or
    None."""
    for parent in path.parents:
        if run_files(parent, marks_only=True):
            return parent
    return None


def check_destination(output_dir: Path, overwrite: bool, checkpoint: Path, own_run: Path | None = None) -> None:
    """Refuse, before anything loads, an ``output_dir`` (absolute, normalised) that is, holds or lies inside a run
    or the checkpoint read, or that is not empty and not a previous export (``overwrite``: replace one).
    ``own_run``: the run whose trainer saves its own model (TRL's ``save_model``): it may export under it."""
    out, ckpt = output_dir.resolve(), checkpoint.resolve()
    if out == ckpt or out in ckpt.parents:
        raise ExportError(f"output {output_dir} holds the checkpoint {checkpoint}: exporting there would replace it; "
                          "choose another output directory")
    if ckpt in out.parents:
        raise ExportError(f"output {output_dir} lies inside the checkpoint {checkpoint} it exports; choose an output "
                          "directory outside it")
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise ExportError(f"output {output_dir} is (or holds) the current directory: the export moves the finished "
                          "output into place by renaming, which cannot replace the directory you are in; name "
                          "another output directory, or run the command from outside it")
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {output_dir} exists and is not a directory")
    mine = own_run.resolve() if own_run is not None else None
    run = _enclosing_run(out)
    if run is not None and run != mine:
        read = " it reads" if run in ckpt.parents else ""
        raise ExportError(f"output {output_dir} lies inside {_run_description(run, run_files(run))}: an export never "
                          f"writes into a run{read}; choose an output directory outside it")
    names = run_files(out)
    if names:
        raise ExportError(f"output {output_dir} is {_run_description(out, names)}: an export never replaces a run's "
                          "checkpoints or files, with or without --overwrite; choose another output directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not is_export(out):
        raise ExportError(f"output directory {output_dir} is not empty and is not a longrl export (no {EXPORT_MARKER})"
                          + ("; --overwrite replaces only a previous export: " if overwrite else "; ")
                          + "choose a new or empty directory")
    if not overwrite:
        raise ExportError(f"output directory {output_dir} is not empty (a previous export); pass --overwrite to "
                          "replace it")
    nested = sorted(p.parent for p in out.rglob("*") if p.name in (LOCK_FILE, MARKER_FILE, STATE_FILE))
    if nested:
        raise ExportError(f"output {output_dir} is a previous export but holds run files ({nested[0]}): "
                          "--overwrite would delete them; choose another output directory")
