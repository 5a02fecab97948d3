"""Stop signals reach every rank of ``longrl train --nproc-per-node N`` (cli/launcher.py, training/signals.py).

The issue's case: SIGTERM to the command ended it at once and left both training processes running unsupervised
to the last step, with no checkpoint-on-signal."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from longrl.cli.launcher import child_pids, launch
from longrl.config.demo import demo_config
from longrl.training.signals import EXIT_REPORT_ENV, StopSignals, read_exit_reports, report_exit


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_to_the_launcher_checkpoints_both_ranks_and_exits_143(tmp_path):
    """``longrl train --nproc-per-node 2`` (gloo, CPU, the tiny builtin model, full weights: FSDP2 writes one optimizer
    shard per rank) gets SIGTERM in the middle of the run: both ranks stop after the same step, both write their
    part of one checkpoint, the command exits 143, and no training process is left."""
    config = tmp_path / "demo.yaml"
    config.write_text(demo_config().to_yaml())
    out = tmp_path / "out"
    args = ["train.prompts_per_step=2", "grpo.num_generations=4", "train.max_steps=1000", "output.save_steps=0",
            "output.save_minutes=0", "output.progress_bar=false", "output.tensorboard=false", "lora.enabled=false",
            "generation.max_completion_length=8", "distributed.timeout_s=120", f"output.output_dir={out}"]
    log = tmp_path / "log.txt"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "longrl", "train", str(config), "--nproc-per-node", "2", *args],
                                stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_for(lambda: proc.poll() is not None or ((out / "metrics.jsonl").exists()
                                                      and (out / "metrics.jsonl").read_text().strip() != ""),
                  600, "the first step")
        assert proc.poll() is None, log.read_text()[-3000:]
        torchrun = child_pids(proc.pid)
        assert len(torchrun) == 1
        workers = child_pids(torchrun[0])
        assert len(workers) == 2
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 143, text[-3000:]
    assert "SIGTERM: passed to 2 training processes" in text
    stops = [line for line in text.splitlines() if line.startswith("longrl: stopped by SIGTERM after step ")]
    assert len(stops) == 2 and stops[0] == stops[1], text[-3000:]  # both ranks, after the same step
    step = int(stops[0].split("after step ")[1].split(":")[0])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{step}"]
    state = json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == step
    shards = sorted(p.name for p in (out / f"checkpoint-{step}" / "optimizer").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its part
    assert not any(_alive(pid) for pid in [*torchrun, *workers])


FAKE_TORCHRUN = textwrap.dedent("""
    # torchrun's shape: workers in sessions of their own; the agent exits 1 when a worker fails
    import os, subprocess, sys
    worker = '''
    import json, os, signal, sys, time
    def stop(signum, frame):
        if os.environ.get("FAKE_REPORT") == "1":
            folder, rank = os.environ["LONGRL_EXIT_REPORT_DIR"], os.environ["RANK"]
            with open(os.path.join(folder, "rank-" + rank + ".json"), "w") as f:
                json.dump({"rank": int(rank), "exit_code": 128 + signum, "message": "stopped"}, f)
        sys.exit(128 + signum)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(s, stop)
    open(sys.argv[1] + "/ready-" + os.environ["RANK"], "w").close()
    time.sleep(60)
    '''
    procs = [subprocess.Popen([sys.executable, "-c", worker, sys.argv[1]], env={**os.environ, "RANK": str(r)},
                              start_new_session=True) for r in range(2)]
    codes = [p.wait() for p in procs]
    open(sys.argv[1] + "/codes", "w").write(" ".join(map(str, codes)))
    sys.exit(0 if not any(codes) else 1)
""")


@pytest.mark.parametrize("reported", [True, False])
def test_launcher_forwards_each_stop_signal_to_every_worker_group(tmp_path, monkeypatch, reported):
    """With a stand-in for torchrun (workers in sessions of their own, exit 1 when one fails): SIGUSR1 to the
    launcher reaches both workers (not the agent, which has no handler for it and would die); the launcher exits
    with the ranks' reported code, or 128 + n without reports."""
    monkeypatch.setenv("FAKE_REPORT", "1" if reported else "0")

    def send_when_ready():
        _wait_for(lambda: all((tmp_path / f"ready-{r}").exists() for r in range(2)), 60, "the fake workers")
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=send_when_ready, daemon=True).start()
    code = launch([sys.executable, "-c", FAKE_TORCHRUN, str(tmp_path)])
    assert (tmp_path / "codes").read_text() == f"{128 + signal.SIGUSR1} {128 + signal.SIGUSR1}"  # both workers
    assert code == 128 + signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the launcher's handlers are gone


def test_launcher_returns_torchruns_code_without_a_signal(tmp_path):
    assert launch([sys.executable, "-c", "import sys; sys.exit(5)"]) == 5
    assert launch([sys.executable, "-c", "pass"]) == 0


def test_exit_reports_round_trip(tmp_path, monkeypatch):
    report_exit(143, "not reported: no launcher")  # no report directory: nothing written, no error
    monkeypatch.setenv(EXIT_REPORT_ENV, str(tmp_path))
    for rank, code in ((1, 143), (0, 3)):
        monkeypatch.setenv("RANK", str(rank))
        report_exit(code, f"rank {rank}")
    (tmp_path / "rank-7.json").write_text("{not json")  # a damaged report is ignored
    assert read_exit_reports(tmp_path) == {0: {"exit_code": 3, "message": "rank 0"},
                                           1: {"exit_code": 143, "message": "rank 1"}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json", "rank-7.json"]


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_a_stopping_rank_ignores_later_stop_signals_while_it_exits(monkeypatch, world_size):
    """torchrun SIGTERMs the ranks still running once one has exited: a rank of a job that is already stopping
    ignores it (SIG_IGN, which holds while the interpreter finalizes); one process gets its handlers back."""
    monkeypatch.setenv("WORLD_SIZE", world_size)
    monkeypatch.setenv("RANK", "0")
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for(lambda: stop.received is not None, 10, "the handler")
        after = signal.getsignal(signal.SIGTERM)
        assert after is (signal.SIG_IGN if world_size == "2" else before[signal.SIGTERM])
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]  # a Ctrl-C still stops at once
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_killing_the_launcher_sends_sigterm_to_torchrun(tmp_path):
    """The launcher SIGKILLed (nothing to forward with): torchrun's process gets SIGTERM, which its agent passes on
    to the ranks. Here a stand-in for torchrun records the signal."""
    agent = textwrap.dedent(f"""
        import os, signal, sys, time
        def record(signum, frame):  # written whole, then renamed: the test never reads a half-written file
            open({str(tmp_path / 'agent-got.part')!r}, 'w').write(signal.Signals(signum).name)
            os.replace({str(tmp_path / 'agent-got.part')!r}, {str(tmp_path / 'agent-got')!r})
            sys.exit(0)
        signal.signal(signal.SIGTERM, record)
        open({str(tmp_path / 'agent-ready')!r}, 'w').close()
        time.sleep(60)
    """)
    run_launcher = "import sys\nfrom longrl.cli.launcher import launch\nsys.exit(launch(sys.argv[1:]))"
    launcher = subprocess.Popen([sys.executable, "-c", run_launcher, sys.executable, "-c", agent],
                                env={**os.environ, "TMPDIR": str(tmp_path)})  # (its report directory stays behind)
    try:
        _wait_for(lambda: (tmp_path / "agent-ready").exists(), 60, "the stand-in for torchrun")
        launcher.kill()
        launcher.wait()
        _wait_for(lambda: (tmp_path / "agent-got").exists(), 30, "torchrun's SIGTERM")
    finally:
        launcher.kill()
    assert (tmp_path / "agent-got").read_text() == "SIGTERM"
