"""The CPU thread count a run sets (train.cpu_threads, OMP_NUM_THREADS, or the CPUs left by other processes), and
the lines that say when each phase of the first step starts in a log without a progress bar."""

import io

import pytest
import torch

from longrl.config import ConfigError, load_config
from longrl.config.demo import demo_config
from longrl.training import cpu_threads
from longrl.training.reporting import RunReporter


@pytest.mark.parametrize("cpus, load, threads", [(16, 0.0, 16), (16, 1.0, 16), (16, 5.2, 12), (2, 3.0, 1),
                                                  (2, 40.0, 1), (4, 1.6, 3)])
def test_automatic_threads_leave_the_cpus_other_processes_use(cpus, load, threads):
    assert cpu_threads.automatic_threads(cpus, load) == threads


def test_the_configured_count_then_omp_num_threads_then_automatic(monkeypatch):
    assert cpu_threads.choose_threads(3, {"OMP_NUM_THREADS": "8"}) == (3, "train.cpu_threads")
    assert cpu_threads.choose_threads(0, {"OMP_NUM_THREADS": "8"}) == (None, "OMP_NUM_THREADS=8")
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: 8)
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (4.0, 0.0, 0.0))
    threads, why = cpu_threads.choose_threads(0, {})
    assert threads == 5 and why == "8 usable CPUs, load average 4.0"


def test_usable_cpus_is_within_the_affinity():
    import os

    assert 1 <= cpu_threads.usable_cpus() <= len(os.sched_getaffinity(0))


def test_set_cpu_threads_sets_torch_and_a_run_sets_it_once(tmp_path, monkeypatch, caplog):
    before = torch.get_num_threads()
    try:
        assert cpu_threads.set_cpu_threads(2) == 2 == torch.get_num_threads()
        monkeypatch.setattr(cpu_threads, "_automatic_done", False)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(cpu_threads, "choose_threads", lambda configured: (1, "test"))
        caplog.set_level("INFO", logger="longrl")
        assert cpu_threads.set_cpu_threads(0) == 1 and "CPU threads: 1 (test;" in caplog.text
        monkeypatch.setattr(cpu_threads, "choose_threads", lambda configured: (3, "test"))
        assert cpu_threads.set_cpu_threads(0) == 1  # automatic: once a process
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="train.cpu_threads"):
        load_config(None, ["train.cpu_threads=-1"], base=demo_config())


def _run(tmp_path, *overrides):
    from longrl.recipes.grpo import GRPOTrainer

    cfg = load_config(None, ["train.max_steps=2", "train.prompts_per_step=2", "grpo.num_generations=2",
                             "output.report_to=[none]", "output.log_completions=0", "data.num_examples=16",
                             f"output.output_dir={tmp_path}", *overrides], base=demo_config())
    trainer = GRPOTrainer(cfg)
    stream = io.StringIO()
    original = RunReporter.for_config
    RunReporter.for_config = classmethod(lambda cls, *a, **k: original(*a, **{**k, "stream": stream}))
    try:
        trainer.train()
    finally:
        RunReporter.for_config = original
    return stream.getvalue().splitlines()


def test_the_first_steps_phases_are_announced_without_a_progress_bar(tmp_path):
    lines = _run(tmp_path / "a", "output.progress_bar=false", "rewards=[{function: 'longrl.tasks.arithmetic:"
                 "format_reward', timeout_s: 30}]")
    starts = [line for line in lines if "started" in line]
    assert starts == ["step 1: generation started: 2 prompts × 2 completions, up to 4 tokens each",
                      "step 1: rewards started: format_reward; a call that hangs fails after 30 s "
                      "(rewards[i].timeout_s)",
                      "step 1: policy update started"]
    assert lines.index(starts[-1]) < next(i for i, line in enumerate(lines) if line.startswith("step 1/2"))
    assert not any(line.startswith("step 2:") for line in lines)  # only the first step's


def test_sft_announces_its_first_step(tmp_path):
    import json

    import yaml

    from longrl.cli.main import main
    from longrl.tasks.arithmetic import make_arithmetic_sft_rows

    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_arithmetic_sft_rows(16, seed=1)))
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump({"data": {"source": "train.jsonl"}, "sft": {
        "max_length": 16, "examples_per_step": 4, "eval_examples": 0}, "train": {"max_steps": 2},
        "output": {"output_dir": str(tmp_path / "out"), "report_to": ["none"], "progress_bar": False}}))
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["sft", str(tmp_path / "sft.yaml"), "model.device=cpu"]) == 0
    assert "step 1: started: 4 examples of up to 16 tokens, forward and backward" in out.getvalue()
