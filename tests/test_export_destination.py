"""Exports never touch a run: `longrl export` refuses (exit 2, naming the run and the live holder of its lock) an
output that is a run's directory, holds the checkpoint it reads or lies inside a run, and ``--overwrite`` replaces
a previous export only. The three data-loss cases of issue 41 each run here on fresh copies of a tiny builtin-model
run, and every file of the runs involved is byte-identical afterwards."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from longrl.cli.main import main
from longrl.config.demo import demo_config
from longrl.export import EXPORT_MARKER, ExportError, export_checkpoint
from longrl.export.destination import is_export, lock_holder
from longrl.training.run_lock import LOCK_FILE

BASE = ["train.max_steps=2", "train.prompts_per_step=2", "grpo.num_generations=2", "train.micro_batch_size=8",
        "output.progress_bar=false", "output.tensorboard=false", "output.log_completions=0", "data.num_examples=64",
        "output.save_steps=1", "lora.enabled=true"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished two-step LoRA run of the builtin model (checkpoint-1, checkpoint-2, config.yaml, lock, marker)."""
    root = tmp_path_factory.mktemp("trained")
    cfg = root / "cfg.yaml"
    cfg.write_text(demo_config().to_yaml())
    assert main(["train", str(cfg), *BASE, f"output.output_dir={root / 'run'}"]) == 0
    return root / "run"


@pytest.fixture
def runs(trained, tmp_path) -> tuple[Path, Path]:
    """Two runs in a fresh directory w/: lora_ok and otherrun (copies of the trained one)."""
    a, b = tmp_path / "w" / "lora_ok", tmp_path / "w" / "otherrun"
    shutil.copytree(trained, a)
    shutil.copytree(trained, b)
    return a, b


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under root (the lock file's holder record included) and its SHA-256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _export(capsys, *args: str) -> tuple[int, str]:
    code = main(["export", *args])
    return code, capsys.readouterr().err


@pytest.fixture
def lock_held_by_a_process(tmp_path):
    """Hold a directory's run lock from another process (as a training run does), until the test ends."""
    procs = []

    def hold(directory: Path) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                            os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen([sys.executable, "-c", "import sys\nfrom longrl.training.run_lock import "
                                 "acquire_run_lock\nlock = acquire_run_lock(sys.argv[1])\nprint('held', flush=True)\n"
                                 "sys.stdin.read()", str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=env)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield hold
    for proc in procs:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_export_over_a_live_run_is_refused_naming_the_run_and_its_holder(runs, lock_held_by_a_process, capsys):
    """Issue 41: `export RUN_DIR --from OTHER/checkpoint-2 --format merged --overwrite` while RUN_DIR's run is
    training deleted its checkpoint-2, config.yaml and lock file."""
    source, live = runs
    holder = lock_held_by_a_process(live)
    before = _snapshot(live.parent)
    code, err = _export(capsys, str(live), "--from", str(source / "checkpoint-2"), "--format", "merged",
                        "--overwrite")
    assert code == 2, err
    assert f"is the longrl run {live}" in err and f"in use by pid {holder.pid} on host" in err, err
    assert "Traceback" not in err
    assert _snapshot(live.parent) == before
    assert not [p for p in live.parent.iterdir() if p.name.startswith(".")]  # no staging left beside it


def test_export_over_another_finished_run_is_refused(runs, capsys):
    """Issue 41: `export w/otherrun --from w/lora_ok --format adapter --overwrite` deleted otherrun's checkpoints."""
    source, other = runs
    before = _snapshot(other.parent)
    code, err = _export(capsys, str(other), "--from", str(source), "--format", "adapter", "--overwrite")
    assert code == 2 and f"is the longrl run {other}" in err and "checkpoint-1" in err, err
    assert "in use by" not in err  # nobody holds its lock
    assert _snapshot(other.parent) == before


def test_export_inside_the_run_it_reads_is_refused(runs, capsys):
    """Issue 41: `export w/lora_ok/sub --from w/lora_ok` wrote the export inside the run it reads."""
    source, _ = runs
    before = _snapshot(source)
    for target in (source / "sub", source / "checkpoint-1" / "x", source / "checkpoint-2" / "x"):
        code, err = _export(capsys, str(target), "--from", str(source), "--format", "adapter")
        assert code == 2 and ("inside the longrl run" in err or "inside the checkpoint" in err), err
        assert str(source) in err
    assert _snapshot(source) == before


def test_the_checkpoint_read_or_a_directory_holding_it_is_refused(runs, capsys):
    source, _ = runs
    before = _snapshot(source.parent)
    for target in (source / "checkpoint-2", source, source.parent):
        code, err = _export(capsys, str(target), "--from", str(source / "checkpoint-2"), "--format", "adapter",
                            "--overwrite")
        assert code == 2 and "holds the checkpoint" in err, err
    assert _snapshot(source.parent) == before


def test_inside_another_run_or_its_checkpoint_is_refused(runs, lock_held_by_a_process, capsys):
    source, other = runs
    holder = lock_held_by_a_process(other)
    for target in (other / "exports" / "a", other / "checkpoint-1" / "sub"):
        code, err = _export(capsys, str(target), "--from", str(source), "--format", "adapter")
        assert code == 2 and f"inside the longrl run {other}" in err and f"pid {holder.pid}" in err, err
        assert not target.exists()


def test_overwrite_replaces_a_previous_export_and_nothing_else(runs, tmp_path, capsys):
    source, _ = runs
    out = tmp_path / "exported"
    assert _export(capsys, str(out), "--from", str(source), "--format", "adapter")[0] == 0
    meta = json.loads((out / EXPORT_MARKER).read_text())
    assert meta["format"] == "adapter" and meta["step"] == 2
    code, err = _export(capsys, str(out), "--from", str(source / "checkpoint-1"), "--format", "adapter")
    assert code == 2 and "(a previous export); pass --overwrite" in err, err
    (out / "stray.txt").write_text("left by hand")
    assert _export(capsys, str(out), "--from", str(source / "checkpoint-1"), "--format", "adapter",
                   "--overwrite")[0] == 0
    assert json.loads((out / EXPORT_MARKER).read_text())["step"] == 1 and not (out / "stray.txt").exists()

    mine = tmp_path / "mine"  # a user's directory: never replaced
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    code, err = _export(capsys, str(mine), "--from", str(source), "--format", "adapter", "--overwrite")
    assert code == 2 and "is not a longrl export" in err and "--overwrite replaces only a previous export" in err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    (out / "nested").mkdir()  # an export someone trained into: --overwrite would delete a run's files
    (out / "nested" / LOCK_FILE).write_text("")
    code, err = _export(capsys, str(out), "--from", str(source), "--format", "adapter", "--overwrite")
    assert code == 2 and "holds run files" in err, err
    assert (out / "nested" / LOCK_FILE).exists()


@pytest.mark.parametrize("name", ["config.yaml", ".longrl-run.json", LOCK_FILE, "checkpoint-7"])
def test_any_trace_of_a_run_makes_a_directory_a_run(runs, tmp_path, name):
    source, _ = runs
    out = tmp_path / "looks_like_a_run"
    out.mkdir()
    (out / EXPORT_MARKER).write_text(json.dumps({"format": "adapter"}))  # even beside an export marker
    (out / name).mkdir() if name.startswith("checkpoint-") else (out / name).write_text("")
    with pytest.raises(ExportError, match=f"is the longrl run {out} .*{name}"):
        export_checkpoint(source, out, fmt="adapter", overwrite=True)
    assert (out / name).exists()


def test_lock_holder_probe(tmp_path, lock_held_by_a_process):
    d = tmp_path / "d"
    d.mkdir()
    assert lock_holder(d) is None and not (d / LOCK_FILE).exists()  # never creates the lock file
    proc = lock_held_by_a_process(d)
    assert f"pid {proc.pid} on host" in lock_holder(d)
    proc.stdin.close()
    proc.wait(timeout=30)
    assert lock_holder(d) is None  # a lock left by a process that is gone is nobody's


class _Trainer:
    """What save_trained_model reads of a trainer (a LoRA run at step 2, whose checkpoint exists)."""

    def __init__(self, run: Path):
        self.output_dir, self.step_idx, self.model = run, 2, type("Peft", (), {"peft_config": {}})()

    def save(self):
        raise AssertionError("checkpoint-2 exists: nothing to save")


def test_save_model_writes_under_its_own_run_and_nowhere_into_another(runs):
    """TRL's trainer.save_model(): output_dir/final (again: replaced), or beside its own checkpoints; another run's
    directory or a directory inside it is refused."""
    from longrl.export import save_trained_model

    own, other = runs
    trainer = _Trainer(own)
    assert save_trained_model(trainer) == own / "final" and is_export(own / "final")
    (own / "final" / "stray.txt").write_text("x")
    save_trained_model(trainer)  # an earlier save: replaced
    assert not (own / "final" / "stray.txt").exists()
    assert save_trained_model(trainer, own) == own and (own / "adapter_model.safetensors").is_file()
    before = _snapshot(other)
    for target in (other, other / "final"):
        with pytest.raises(ExportError, match=f"longrl run {other}"):
            save_trained_model(trainer, target)
    assert _snapshot(other) == before
