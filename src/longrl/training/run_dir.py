"""A run's output directory before training starts: a new run may not land among another run's checkpoints, and a
resume must continue the same run (settings, beyond RESUMABLE_CHANGES, data file and reward files unchanged). The
lock that keeps a second process out is training/run_lock.py's."""

from __future__ import annotations

import logging
from pathlib import Path

from ..config import RESUMABLE_CHANGES, ConfigError, resume_conflicts
from .checkpoint import CheckpointError, checkpoint_config, list_checkpoints, read_state, recover_interrupted_saves, \
    resume_candidates

log = logging.getLogger(__name__)


def check_output_dir(cfg, resume: bool, allow_existing: bool = False, recover: bool = True) -> list[Path]:
    """Refuse, before anything loads, a new run into a directory that holds another run's checkpoints (its
    checkpoint rotation and resume would mix the two), and a resume (``resume``) whose settings differ from the ones
    its checkpoint was trained with, beyond RESUMABLE_CHANGES. ``allow_existing``: leave both to a later call (TRL's
    ``train(resume_from_checkpoint=...)`` decides). Returns the checkpoints a resume may start from: those whose
    manifest verifies, newest first (the ones skipped are logged with the reason). ``recover``: first finish or
    undo the saves a killed run left (one process of a job does it)."""
    out = Path(cfg.output.output_dir)
    for line in recover_interrupted_saves(out) if out.is_dir() and recover else []:
        log.warning("%s: %s (a save of a killed run)", out, line)
    found = list_checkpoints(out)
    if not found or allow_existing:
        return []
    if not resume:
        raise ConfigError(f"output.output_dir '{out}' already holds checkpoints of an earlier run "
                          f"({', '.join(p.name for p in found[-3:])}): set output.resume=true to continue it, or "
                          "choose another output.output_dir")
    good, skipped = resume_candidates(out)
    for line in skipped:
        log.warning("resume: %s", line)
    if not good:
        raise CheckpointError(f"output.resume: no checkpoint in {out} verifies ({'; '.join(skipped)})")
    saved = checkpoint_config(good[0])
    conflicts = resume_conflicts(saved, cfg) if saved else []
    if conflicts:
        raise ConfigError(f"output.resume: {good[0]} was trained with other settings — {'; '.join(conflicts)}. "
                          "A resumed run may change only how long it runs, its outputs and speed/memory settings "
                          f"({', '.join(RESUMABLE_CHANGES)}); start a new output.output_dir for the others")
    return good


def checked_output_dir(cfg, world, resume: bool, allow_existing: bool = False) -> list[Path]:
    """check_output_dir on every rank of ``world``, rank 0 first (it alone finishes or undoes a killed run's
    saves)."""
    found = check_output_dir(cfg, resume, allow_existing=allow_existing) if world.is_main else []
    world.barrier()
    if not world.is_main:
        found = check_output_dir(cfg, resume, allow_existing=allow_existing, recover=False)
    return found


def check_data_unchanged(cfg, checkpoint: Path, fingerprint: str | None) -> None:
    """Refuse to resume on a data file that differs from the one ``checkpoint`` trained on (its position in the
    data would point elsewhere), unless ``output.resume_changed_data``."""
    saved = read_state(checkpoint).get("data_fingerprint")
    if saved and fingerprint and saved != fingerprint:
        if not cfg.output.resume_changed_data:
            raise ConfigError(f"data.source: {cfg.data.source} changed since {checkpoint} was written (SHA-256 "
                              f"{fingerprint[:12]}…, was {saved[:12]}…); restore it, or set "
                              "output.resume_changed_data=true to resume on the new file")
        log.warning("resuming %s on a changed data file %s (output.resume_changed_data=true)", checkpoint,
                    cfg.data.source)


def check_rewards_unchanged(cfg, checkpoint: Path, fingerprints: dict[str, str]) -> None:
    """Refuse to resume with a reward file (``rewards[i].function`` given as a path) edited since ``checkpoint`` was
    written (the rewards of the steps after it would mean something else), unless ``output.resume_changed_rewards``."""
    saved = read_state(checkpoint).get("reward_files") or {}
    changed = [path for path, digest in fingerprints.items() if path in saved and saved[path] != digest]
    if not changed:
        return
    if not cfg.output.resume_changed_rewards:
        raise ConfigError(f"rewards: {', '.join(changed)} changed since {checkpoint} was written (SHA-256 "
                          f"{fingerprints[changed[0]][:12]}…, was {saved[changed[0]][:12]}…); restore it, or set "
                          "output.resume_changed_rewards=true to resume with the edited reward")
    log.warning("resuming %s with edited reward files %s (output.resume_changed_rewards=true)", checkpoint,
                ", ".join(changed))


CONFIG_FILE, LAYOUT_FILE = "config.yaml", "layout.yaml"


def write_run_settings(output_dir: Path, cfg, layout) -> None:
    """The run's settings as the user asked for them (``config.yaml``: the validated config, defaults filled in,
    which ``longrl train config.yaml output.resume=true`` resumes from) and the memory layout it runs with
    (``layout.yaml``: memory/layout.py's Layout, planned or pinned); each written atomically."""
    import yaml

    from .checkpoint import atomic_write_text

    atomic_write_text(Path(output_dir) / CONFIG_FILE, cfg.to_yaml())
    atomic_write_text(Path(output_dir) / LAYOUT_FILE, yaml.safe_dump(layout.to_dict(), sort_keys=False))


class RunDirectory:
    """A recipe's hold on its output directory, from construction to the end of ``train()``: the run lock (rank 0:
    one run per directory, taken before anything is written there), the check that the directory holds nothing but
    this kind of run, the checkpoints a resume may start from, and the data file it trains on (a resume on another
    file is refused). ``resume_decided_at_train``: TRL's API, where ``train(resume_from_checkpoint=...)`` decides
    whether existing checkpoints are resumed, so they are checked there instead of here."""

    def __init__(self, cfg, world, kind: str = "grpo", command: str = "train", resume_decided_at_train: bool = False):
        import weakref

        from .run_lock import acquire_run_lock, check_output_dir_contents

        self.cfg, self.world, self.path = cfg, world, Path(cfg.output.output_dir)
        self.resume = cfg.output.resume
        self.resume_decided_at_train = resume_decided_at_train
        self.lock = None
        if world.is_main:
            self.lock = acquire_run_lock(self.path)
            weakref.finalize(self, self.lock.release)
            check_output_dir_contents(self.path, kind=kind, command=command, overwrite=cfg.output.overwrite_output_dir)
        self.resume_from = checked_output_dir(cfg, world, self.resume, allow_existing=resume_decided_at_train)
        self.data_fingerprint: str | None = None
        self.reward_files: dict[str, str] = {}  # reward file path → SHA-256, saved in each checkpoint

    def check_data(self, rows: list[dict] | None = None) -> None:
        """Fingerprint data.source (a file's SHA-256; given the ``rows`` read from it, the image files they name
        too) and the reward files, and refuse them when they differ from the ones the checkpoint to resume from
        trained with (output.resume_changed_data / resume_changed_rewards allow it)."""
        from ..data.prompts import data_fingerprint
        from ..rewards import reward_file_fingerprints

        self.data_fingerprint = data_fingerprint(self.cfg.data.source, rows)
        self.reward_files = reward_file_fingerprints(self.cfg.rewards)
        self._check_inputs_unchanged()

    def _check_inputs_unchanged(self) -> None:
        """The fingerprints taken by check_data against the checkpoint a resume starts from."""
        if self.resume_from:
            check_data_unchanged(self.cfg, self.resume_from[0], self.data_fingerprint)
            check_rewards_unchanged(self.cfg, self.resume_from[0], self.reward_files)

    def start_training(self, resume_from_checkpoint: bool | str | None = None) -> list[Path] | None:
        """At the start of ``train()``: the lock again (a second ``train()`` of a trainer), TRL's
        ``resume_from_checkpoint`` (True, the output directory or its latest checkpoint: as output.resume=true), and
        the checks it calls for. Returns the checkpoints a resume may start from, newest first (empty: a resume asked for
        where there is none), or None when no resume is asked for."""
        from .checkpoint import resume_request
        from .run_lock import acquire_run_lock

        if self.world.is_main and not self.lock.held:
            self.lock = acquire_run_lock(self.path)
        if resume_from_checkpoint:
            resume_request(self.path, resume_from_checkpoint)
            self.resume = True
        if self.resume_decided_at_train or resume_from_checkpoint:
            self.resume_from = checked_output_dir(self.cfg, self.world, self.resume)
            self._check_inputs_unchanged()  # the files were fingerprinted at construction
        return self.resume_from if self.resume else None

    def release(self) -> None:
        """Give the lock back (rank 0; at the end of ``train()``)."""
        if self.lock is not None:
            self.lock.release()
