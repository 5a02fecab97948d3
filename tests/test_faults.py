"""The fault catalogue (tests/fault_cases.yaml): bad inputs and faults across config, data, rewards, model, export,
resume, signals, locks, corruption and disk full. Each case runs in this process (``longrl.cli.main.main``) and asserts
the exit code, that the message names the key / row / file, that it failed before the model loaded wherever the
input allows, and that files already written are unchanged (bytes lost: zero). A few faults need a real process:
signals sent to a running ``longrl train``, and kill -9 at random moments of checkpoint writes (resume then
reproduces the uninterrupted run).

Counts for the closing note: ``python benchmarks/fault_catalogue.py`` (runs this file with LONGRL_FAULT_REPORT).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import longrl.export.source as export_source
import longrl.training.model_setup as model_setup
import longrl.recipes.grpo as trainer_module
from longrl.training.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint, write_manifest
from longrl.cli.main import main
from longrl.config.schema import RewardSpec
from longrl.config.demo import demo_config
from longrl.training.reporting import read_metrics
from longrl.rewards import RewardScorer
from longrl.rewards.isolation import ProcessReward

HERE = Path(__file__).parent
CASES = yaml.safe_load((HERE / "fault_cases.yaml").read_text())
REWARDS = HERE / "fault_rewards.py"
BASE = ["train.max_steps=2", "train.prompts_per_step=2", "grpo.num_generations=2", "train.micro_batch_size=8",
        "output.progress_bar=false", "output.tensorboard=false", "output.log_completions=0", "data.num_examples=64"]
PAYLOAD = "PWNED"  # what a planted payload would create, were it ever run
REPORT = os.environ.get("LONGRL_FAULT_REPORT")


def test_catalogue_is_large_and_ids_unique():
    assert len(CASES) >= 120
    assert len({c["id"] for c in CASES}) == len(CASES)


# ----------------------------------------------------------------------------- shared, built once per module

@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Trained runs and a model directory, built on first use and copied into each case's directory."""
    root = tmp_path_factory.mktemp("fault_cache")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind in built:
            return built[kind]
        d = root / kind
        d.mkdir()
        cwd = os.getcwd()
        os.chdir(d)  # runs use relative data paths, as the cases do
        try:
            if kind == "model":
                from longrl.models import build_tiny_model

                model, tok = build_tiny_model(seed=0)
                model.save_pretrained(d / "model")
                tok.save_pretrained(d / "model")
            else:
                cfg = _write_config(d)
                extra = {"run": [], "lora_run": ["lora.enabled=true"], "data_run": ["data.source=data.jsonl"]}[kind]
                if kind == "data_run":
                    (d / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)})
                                                          + "\n" for i in range(8)))
                assert main(["train", str(cfg), *BASE, "output.save_steps=1", f"output.output_dir={d / 'out'}",
                             *extra]) == 0
                cfg.unlink()
        finally:
            os.chdir(cwd)
        built[kind] = d
        return d

    return get


def _write_config(d: Path) -> Path:
    path = d / "cfg.yaml"
    path.write_text(demo_config().to_yaml())
    return path


# ----------------------------------------------------------------------------- corrupting files

def _pickle_payload(path: Path, marker: Path) -> None:
    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('ran')",))

    torch.save({"state": {}, "param_groups": [], "payload": Payload()}, path)


def _corrupt(tmp: Path, item: dict) -> None:
    path = tmp / item["file"]
    how = item["how"]
    if how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    elif how == "garbage":
        data = bytearray(path.read_bytes())
        n = min(4096, len(data) // 2)
        start = (len(data) - n) // 2
        data[start:start + n] = random.Random(0).randbytes(n)
        path.write_bytes(bytes(data))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "delete":
        path.unlink()
    elif how == "header":
        data = path.read_bytes()
        path.write_bytes(b"\xff" * 8 + data[8:])
    elif how == "garbage_text":
        path.write_text("{not json")
    elif how == "nan":
        from safetensors.torch import load_file, save_file

        weights = load_file(str(path))
        name = next(k for k, v in weights.items() if v.is_floating_point())
        weights[name].view(-1)[0] = math.nan
        save_file(weights, str(path), metadata={"format": "pt"})
    elif how == "nan_optimizer":
        state = torch.load(path, weights_only=True)
        first = next(iter(state["state"].values()))
        first["exp_avg"].view(-1)[0] = math.nan
        torch.save(state, path)
    elif how == "pickle":
        _pickle_payload(path, tmp / PAYLOAD)
    elif how == "auto_map":
        config = json.loads(path.read_text())
        config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
        path.write_text(json.dumps(config))
        (path.parent / "evil.py").write_text(f"open({str(tmp / PAYLOAD)!r}, 'w').write('ran')\n")
    elif how == "remote_code_base":
        state = json.loads(path.read_text())
        state["config"]["model"]["trust_remote_code"] = True
        path.write_text(json.dumps(state))
    elif how == "append_row":
        with open(path, "a") as f:
            f.write(json.dumps({"prompt": "9+9=", "answer": "18"}) + "\n")
    else:
        raise AssertionError(how)
    if item.get("remanifest"):  # the corruption comes with a manifest that matches it
        write_manifest(path.parent)


# ----------------------------------------------------------------------------- injected faults

def _inject(name: str, monkeypatch) -> None:
    state = {"step": 0}
    real_update = trainer_module.GRPOTrainer._policy_update

    def update(self, *args, **kwargs):
        state["step"] = self.step_idx + 1
        return real_update(self, *args, **kwargs)

    if name.startswith("nan_loss"):
        real_loss = trainer_module.weighted_loss
        bad = (lambda s: s >= 2) if name == "nan_loss_from_step_2" else (lambda s: s == 2)
        monkeypatch.setattr(trainer_module.GRPOTrainer, "_policy_update", update)
        monkeypatch.setattr(trainer_module, "weighted_loss",
                            lambda *a: real_loss(*a) * math.nan if bad(state["step"]) else real_loss(*a))
    elif name == "enospc_torch_save_at_step_2":
        real_save = torch.save

        def save(obj, f, *a, **k):
            if "checkpoint-2" in str(f):
                Path(f).write_bytes(b"\0" * 100)  # part of it reached the disk
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_save(obj, f, *a, **k)

        monkeypatch.setattr(torch, "save", save)
    elif name == "enospc_safetensors_at_step_2":
        import transformers.modeling_utils as mu

        real_save_file = mu.safe_save_file

        def save_file(tensors, filename, *a, **k):
            if "checkpoint-2" in str(filename):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_save_file(tensors, filename, *a, **k)

        monkeypatch.setattr(mu, "safe_save_file", save_file)
    elif name == "enospc_metrics":
        import builtins

        import longrl.training.reporting as reporting

        def fake_open(path, mode="r", *a, **k):
            if str(path).endswith("metrics.jsonl") and "a" in mode:
                raise OSError(errno.ENOSPC, "No space left on device")
            return builtins.open(path, mode, *a, **k)

        monkeypatch.setattr(reporting, "open", fake_open, raising=False)
    elif name == "enospc_tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        def add_scalar(self, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
    else:
        raise AssertionError(name)


# ----------------------------------------------------------------------------- post-checks

def _steps_of(out: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in list_checkpoints(out)]


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _check(name: str, tmp: Path, out: Path, text: str, extra) -> None:
    if name == "checkpoint_at_1":
        assert _steps_of(out)[-1] == 1 and verify_checkpoint(out / "checkpoint-1") is None
    elif name == "checkpoint_at_2":
        assert _steps_of(out)[-1] == 2 and verify_checkpoint(out / "checkpoint-2") is None
    elif name == "checkpoint_at_1_only":
        assert _steps_of(out) == [1]
    elif name in ("resumed_from_1", "resumed_from_2"):
        step = name[-1]
        assert re.search(rf"resumed from .*checkpoint-{step} \(step {step}\)", text), text[-2000:]
        assert verify_checkpoint(latest_checkpoint(out)) is None
    elif name == "completions_not_mutated":
        lines = (out / "completions.jsonl").read_text()
        assert lines and "MUTATED" not in lines
        assert all(m["rewards/sees_original"] == 1.0 for m in read_metrics(out))
    elif name == "no_payload":
        pass  # checked for every case
    elif name == "weights_of_step_1":
        final = latest_checkpoint(out)
        a, b = _weights(out / "checkpoint-1" / "model.safetensors"), _weights(final / "model.safetensors")
        assert final.name == "checkpoint-3" and all(torch.equal(a[k], b[k]) for k in a)
    elif name == "step_2_skipped":
        assert [m["skipped_nonfinite"] for m in read_metrics(out)] == [0, 1, 0]
    elif name == "no_staging_and_ckpt1_intact":
        assert _steps_of(out) == [1] and verify_checkpoint(out / "checkpoint-1") is None
        assert not [p for p in out.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    elif name == "ckpt_1_and_3_not_2":
        assert _steps_of(out) == [1, 3]
    elif name == "inputs_unchanged":
        assert extra["inputs"] == extra["original"]
        assert extra["per_function"][:, 1].tolist() == [1.0] * 4  # the second function saw the originals
    elif name == "worker_restarts":
        fn = extra["fn"]
        assert fn.proc is None  # killed (or exited) and reaped
        fn.start()
        assert fn.proc.poll() is None
    else:
        raise AssertionError(name)


# ----------------------------------------------------------------------------- the runner

def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(root)): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".longrl.lock"}


def _fill(arg: str, paths: dict) -> str:
    for k, v in paths.items():
        arg = arg.replace("{" + k + "}", str(v))
    return arg


def _record(case: dict, **fields) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"id": case["id"], "area": case["area"], **fields}) + "\n")


def _run_scorer(case: dict, caplog):
    specs = [RewardSpec(f"{REWARDS}:{case['fn']}", timeout_s=case.get("timeout_s", 300.0),
                        isolation=case.get("isolation", "none"), memory_limit_gib=case.get("memory_limit_gib", 0.0))]
    if case.get("then"):
        specs.append(RewardSpec(f"{REWARDS}:{case['then']}"))
    scorer = RewardScorer.from_specs(specs)
    prompts, completions = [f"{i}+1=" for i in range(4)], ["1", "2", "x", ""]
    columns = {"completion_ids": [[1, 2], [3], [4, 5], [6]], "truncated": [False, True, False, False],
               "answer": ["1", "2", "3", "4"]}
    original = json.loads(json.dumps([prompts, completions, columns]))
    try:
        per_function, total, failures = scorer.score(prompts, completions, columns)
    finally:
        extra = {"inputs": [prompts, completions, columns], "original": original, "fn": scorer.functions[0][1]}
    assert len(failures) == case["failed"], [str(f) for f in failures]
    if case["fn"] != "returns_none":  # failure counts and per-function means agree
        assert int(torch.isnan(per_function[:, 0]).sum()) == case["failed"]
    extra["per_function"], extra["failures"] = per_function, failures
    return extra, scorer


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_fault(case, tmp_path, monkeypatch, capsys, caplog, cache):
    if case.get("cpu_only") and torch.cuda.is_available():
        pytest.skip("needs a host without CUDA")
    caplog.set_level("INFO", logger="longrl")
    monkeypatch.chdir(tmp_path)
    for k, v in case.get("env", {}).items():
        monkeypatch.setenv(k, v)
    setup = case.get("setup", "none")
    if setup != "none":
        shutil.copytree(cache(setup), tmp_path, dirs_exist_ok=True)
    out = tmp_path / "out"
    paths = {"tmp": tmp_path, "out": out, "rewards": REWARDS, "model": tmp_path / "model", "cfg": tmp_path / "cfg.yaml"}
    for name, text in case.get("files", {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    for name, hexed in case.get("bytes", {}).items():
        (tmp_path / name).write_bytes(bytes.fromhex(hexed))
    for item in case.get("corrupt", []):
        _corrupt(tmp_path, item)
    before = _snapshot(tmp_path)

    loaded = []
    for module in (model_setup, export_source):  # where GRPO/SFT and export load models
        real = module.load_model
        monkeypatch.setattr(module, "load_model", lambda *a, _real=real, **k: (loaded.append(1), _real(*a, **k))[1])
    if case.get("inject"):
        _inject(case["inject"], monkeypatch)
    held = None
    if case.get("hold_lock"):  # another process's lock: a separate open file description, flocked
        import fcntl

        out.mkdir(exist_ok=True)
        held = os.open(out / ".longrl.lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(held, fcntl.LOCK_EX)
        os.ftruncate(held, 0)
        os.pwrite(held, json.dumps({"pid": 4242, "host": "elsewhere", "started": "earlier"}).encode(), 0)

    cmd = case.get("cmd", "train")
    extra, scorer = None, None
    try:
        if cmd == "scorer":
            extra, scorer = _run_scorer(case, caplog)
            code = None
        else:
            args = [_fill(a, paths) for a in case.get("args", [])]
            if cmd == "train":
                _write_config(tmp_path)
                argv = ["train", str(paths["cfg"]), *BASE, f"output.output_dir={out}", *args]
            elif cmd == "train-file":
                argv = ["train", *args]
            elif cmd == "demo":
                argv = ["demo", *BASE, *args]
            else:
                argv = [cmd, *args]
            try:
                code = main(argv)
            except SystemExit as e:  # argparse refuses a bad argument by exiting (its usage line, exit 2)
                code = e.code
    finally:
        if held is not None:
            os.close(held)
    text = capsys.readouterr().err + "\n" + caplog.text
    if extra is not None:  # the scorer's failures as the trainer reports them, one line per function
        from longrl.training.reporting import reward_failure_lines

        text += "\n".join(reward_failure_lines(1, extra.get("failures", []), 4))
    if scorer is not None:
        try:
            if case.get("check"):
                _check(case["check"], tmp_path, out, text, extra)
        finally:
            scorer.close()
    elif case.get("check"):
        _check(case["check"], tmp_path, out, text, extra)
    if code is not None:
        assert code == case["exit"], text[-3000:]
    if case.get("message"):
        assert re.search(case["message"], text, re.S), text[-3000:]
    assert "Traceback" not in text
    load = case.get("load", "before")
    if load == "before":
        assert not loaded, "the model loaded before the error"
    elif load == "after":
        assert loaded
    assert not (tmp_path / PAYLOAD).exists(), "a planted payload ran"

    outcome = case.get("outcome", "refused")
    keep = case.get("unchanged", "all" if outcome == "refused" else [])
    after = _snapshot(tmp_path)
    kept = before if keep == "all" else {k: v for k, v in before.items()
                                         if any(Path(k).match(g) or k.startswith(g.rstrip("*")) for g in keep)}
    lost = sum(size for k, (size, digest) in kept.items() if after.get(k) != (size, digest))
    _record(case, outcome=outcome, load=load, exit=code, bytes_lost=lost, checked_files=len(kept))
    assert lost == 0, [k for k in kept if after.get(k) != kept[k]]


# ----------------------------------------------------------------------------- real processes

def _popen_train(tmp: Path, out: Path, *extra: str) -> subprocess.Popen:
    cfg = tmp / "cfg.yaml"
    if not cfg.exists():
        _write_config(tmp)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "longrl.cli.main", "train", str(cfg), *BASE,
                             f"output.output_dir={out}", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp)


def _wait_for(predicate, timeout_s: float = 120.0, poll_s: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return False


def test_sigterm_to_a_running_train_writes_a_checkpoint(tmp_path):
    """A real `longrl train` process: SIGTERM ends the step, a checkpoint is written, the message says where and
    how to resume, and the exit code is 143. A second run into the same directory meanwhile fails at once, naming
    the holder. (SIGINT, SIGHUP, SIGUSR1 and a second SIGINT are cases of the catalogue, sent in process.)"""
    sig = signal.SIGTERM
    out = tmp_path / "out"
    proc = _popen_train(tmp_path, out, "train.max_steps=500")
    try:
        assert _wait_for(lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip())
        assert main(["train", str(tmp_path / "cfg.yaml"), *BASE, f"output.output_dir={out}"]) == 2  # a rival
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err[-2000:]
    name = signal.Signals(sig).name
    assert re.search(rf"stopped by {name} after step (\d+): checkpoint .*checkpoint-\1; resume with: longrl train "
                     r".*config.yaml output.resume=true", err), err[-2000:]
    assert "Traceback" not in err
    step = int(re.search(r"after step (\d+)", err).group(1))
    assert verify_checkpoint(out / f"checkpoint-{step}") is None
    assert len(read_metrics(out)) == step


def _strip_time(metrics):
    return [{k: v for k, v in m.items() if not k.endswith("time_s")} for m in metrics]


def test_kill_9_during_checkpoint_writes_then_resume_reproduces_the_run(tmp_path):
    """kill -9 at random moments while a checkpoint is being written (a staging directory exists), three times in
    a row; each restart resumes; the finished run equals an uninterrupted one step for step, weight for weight."""
    steps = ["train.max_steps=5", "output.save_steps=1"]
    _write_config(tmp_path)
    ref = tmp_path / "ref"
    assert main(["train", str(tmp_path / "cfg.yaml"), *BASE, f"output.output_dir={ref}", *steps]) == 0
    out = tmp_path / "out"
    rng = random.Random(19)
    kills = 0
    for attempt in range(3):
        proc = _popen_train(tmp_path, out, *steps, *(["output.resume=true"] if attempt else []))
        try:
            staged = _wait_for(lambda: any(p.name.startswith(".tmp-checkpoint") for p in out.glob(".tmp-*"))
                               if out.is_dir() else False, timeout_s=120, poll_s=0.001)
            if staged:
                time.sleep(rng.uniform(0, 0.03))
                proc.send_signal(signal.SIGKILL)
                kills += proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            proc.kill()
            proc.communicate()
    assert kills >= 1
    assert main(["train", str(tmp_path / "cfg.yaml"), *BASE, f"output.output_dir={out}", *steps,
                 "output.resume=true"]) == 0
    assert _strip_time(read_metrics(out)) == _strip_time(read_metrics(ref))
    a, b = _weights(ref / "checkpoint-5" / "model.safetensors"), _weights(out / "checkpoint-5" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(verify_checkpoint(p) is None for p in list_checkpoints(out))
    assert not [p for p in out.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_disk_full_on_a_real_small_filesystem(tmp_path, capsys):
    """A real ENOSPC: the run writes into a 2.5 MiB tmpfs, where the first checkpoint fits and the second does not.
    The failed write says so with the space it needs, leaves no staging directory and checkpoint-1 verifying, and
    the run stops with exit code 4. Needs root and a kernel that lets it mount tmpfs (else skipped)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        _write_config(tmp_path)
        out = mnt / "out"
        code = main(["train", str(tmp_path / "cfg.yaml"), *BASE, f"output.output_dir={out}", "train.max_steps=3",
                     "output.save_steps=1"])
        err = capsys.readouterr().err
        assert code == 4, err[-2000:]
        assert re.search(r"checkpoint-2 not written: no space left on device .*about [0-9.]+ MiB needed, [0-9.]+ MiB "
                         r"free; checkpoint-1 is intact", err), err[-2000:]
        assert _steps_of(out) == [1] and verify_checkpoint(out / "checkpoint-1") is None
        assert not [p for p in out.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)

