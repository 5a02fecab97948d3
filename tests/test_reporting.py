"""Logs for people and machines: one plain line per logging step outside a terminal, log records above the bar in
one, reward failures summed per step, a summary, report_to, plots at each save, checkpoint rotation."""

import io
import json
import logging
import re
import subprocess
import sys
import types

import pytest

from longrl.config import ConfigError, OutputConfig, load_config
from longrl.config.demo import demo_config
from longrl.training.reporting import (RunReporter, _fit_axis, check_report_to, plot_training_curves, report_targets,
                              reward_failure_lines, step_line)
from longrl.rewards import RewardFailure
from longrl.compat.trl import GRPOTrainer

QUICK = ["train.prompts_per_step=4", "grpo.num_generations=4", "train.micro_batch_size=8", "output.save_steps=0"]


def test_non_terminal_run_prints_one_line_per_logging_step_a_summary_and_writes_plots(tmp_path):
    """``longrl train`` with stdout on a pipe (as under nohup, Slurm, CI): a plain line at step 1, every
    logging_steps and the last, no bar, the summary; training_curves.png written at the save."""
    config = tmp_path / "run.yaml"
    config.write_text(demo_config().to_yaml())
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "longrl.cli.main", "train", str(config), *QUICK, "train.max_steps=5",
                        "output.logging_steps=2", f"output.output_dir={out}", "output.report_to=[none]"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    steps = [int(m.group(1)) for line in lines if (m := re.match(r"step (\d+)/5 ", line))]
    assert steps == [1, 2, 4, 5], r.stdout
    for line in (x for x in lines if re.match(r"step \d+/5 ", x)):
        for key in ("reward=", "loss=", "kl=", "completion_length=", "step_time_s=", "eta="):
            assert key in line, line
    assert [x.split(":")[1] for x in lines if x.startswith("step 1: ")] == [" generation started", " rewards started",
                                                                           " policy update started"]
    assert "\x1b[" not in r.stdout and "GRPO" not in r.stdout  # no progress bar outside a terminal
    assert "trained 5 steps" in r.stdout and "reward:" in r.stdout and f"outputs in {out}" in r.stdout
    assert "checkpoint-5" in r.stdout
    png = out / "training_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".*tmp*"))  # written through a temporary file and a rename
    assert not (out / "tensorboard").exists()  # report_to: none


class _FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_terminal_log_records_print_through_the_bar_console_and_handlers_come_back(tmp_path):
    tty = _FakeTTY()
    handler = logging.StreamHandler(tty)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        reporter = RunReporter(tmp_path, 3, report_to=(), progress_bar=True, stream=tty)
        assert reporter.progress is not None and handler not in root.handlers
        logging.getLogger("longrl.somewhere").warning("a warning during the run")
        reporter.log_step({"step": 1, "reward": 0.5, "loss": 0.1, "kl": None, "completion_length": 3.0})
        reporter.close()
        assert handler in root.handlers  # the original handler is back, the console handler gone
        assert not [h for h in root.handlers if type(h).__name__ == "_ConsoleHandler"]
        text = tty.getvalue()
        assert "WARNING longrl.somewhere: a warning during the run" in text
        # the record is a line of its own: nothing of the bar on the line it is printed on
        line = next(x for x in re.split(r"[\r\n]", text) if "a warning during the run" in x)
        assert "GRPO" not in line
    finally:
        root.removeHandler(handler)


def test_reward_failures_are_summed_per_step_and_function():
    failures = [RewardFailure("answer", 3, "ValueError: bad"), RewardFailure("answer", 5, "ValueError: worse"),
                RewardFailure("fmt", None, "batch call failed (TypeError: x); scored one sample at a time")]
    lines = reward_failure_lines(7, failures, 16)
    assert lines == ["step 7: reward function 'answer' failed on 2 of 16 samples; first error (sample 3): "
                     "ValueError: bad",
                     "step 7: reward function 'fmt' failed on the batch call (each sample alone worked); first error "
                     "(the batch call): batch call failed (TypeError: x); scored one sample at a time"]


def test_a_failing_reward_is_one_warning_per_step_with_its_step_number(tmp_path, caplog):
    f = tmp_path / "flaky.py"
    f.write_text("def flaky(prompts, completions, **kw):\n"
                 "    if len(completions) > 1: raise ValueError('batch')\n"
                 "    return [(_ for _ in ()).throw(ValueError('always'))]\n")
    cfg = load_config(None, QUICK + ["train.max_steps=2", f"output.output_dir={tmp_path / 'o'}",
                                     "output.report_to=[none]", "rewards=[{function: " + f"{f}:flaky" + "}]"],
                      base=demo_config())
    with caplog.at_level(logging.WARNING):
        GRPOTrainer(cfg).train()
    warnings = [r.getMessage() for r in caplog.records if "reward function" in r.getMessage()]
    assert warnings == [f"step {s}: reward function 'flaky' failed on 16 of 16 samples; first error (sample 0): "
                        "ValueError: always" for s in (1, 2)]


def test_step_line_and_report_targets():
    line = step_line({"step": 3, "reward": 0.25, "loss": None, "kl": 0.001, "completion_length": 4.0,
                      "step_time_s": 0.5}, 10, 65.0)
    assert line == "step 3/10 reward=0.25 loss=- kl=0.001 completion_length=4 step_time_s=0.5 eta=1:05"
    sft = step_line({"step": 4, "loss": 2.5, "grad_norm": 1.25, "lr": 0.001, "tokens_per_s": 1500.0, "reward": 9.0,
                     "step_time_s": 0.5, "eval/loss": 2.25}, 10, None, recipe="sft")
    assert sft == "step 4/10 loss=2.5 grad_norm=1.25 lr=0.001 tokens_per_s=1500 step_time_s=0.5 eval/loss=2.25 eta=-"
    assert report_targets(OutputConfig()) == ["tensorboard"]
    assert report_targets(OutputConfig(report_to=["none"])) == []
    assert report_targets(OutputConfig(tensorboard=False)) == []  # the deprecated alias still works
    assert report_targets(OutputConfig(report_to=["none"], tensorboard=True)) == ["tensorboard"]
    assert report_targets(OutputConfig(report_to=["wandb", "tensorboard"])) == ["wandb", "tensorboard"]
    with pytest.raises(ConfigError, match="output.report_to"):
        load_config(None, ["output.report_to=[mlflow]"], base=demo_config())


def test_wandb_missing_fails_before_training_and_a_present_one_gets_the_scalars(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match="output.report_to': wandb is not installed"):
        check_report_to(OutputConfig(report_to=["wandb"]))
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    check_report_to(OutputConfig(report_to=["wandb"]))
    reporter = RunReporter(tmp_path, 2, report_to=["wandb"], progress_bar=False, config={"a": 1},
                           stream=io.StringIO())
    reporter.log_step({"step": 1, "reward": 0.5, "eval/reward": 0.25, "note": "text"})
    reporter.close()
    assert calls[0][0] == "init" and calls[0][1]["config"] == {"a": 1} and calls[0][1]["dir"] == str(tmp_path)
    assert calls[1] == ("log", 1, {"train/reward": 0.5, "eval/reward": 0.25}) and calls[-1] == ("finish",)


def test_plot_axes_fit_the_data_and_a_run_without_metrics_plots_nothing(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    _fit_axis(ax, [5.0, 7.0, float("nan"), 9.0])
    lo, hi = ax.get_ylim()
    assert 4.7 < lo < 5.0 and 9.0 < hi < 9.3  # fitted to 5..9 with a 5% margin, not 0..1
    _fit_axis(ax, [2.0, 2.0])
    assert ax.get_ylim() == (1.5, 2.5)  # a flat series: a unit-wide window around it
    plt.close(fig)
    assert plot_training_curves(tmp_path, []) is None
    metrics = [{"step": s, "reward": 3.0 + s, "rewards/a": s / 10, "loss": 0.1, "kl": None,
                "completion_length": 4.0} for s in (1, 2, 3)] + [{"step": 4, "eval/reward": 2.0}]
    assert plot_training_curves(tmp_path, metrics).read_bytes()[:4] == b"\x89PNG"


def test_eval_during_training_logs_eval_metrics_and_rotation_keeps_the_last_three(tmp_path):
    cfg = load_config(None, QUICK + ["train.max_steps=4", "output.save_steps=1", "output.eval_steps=2",
                                     "data.eval_source=task:arithmetic", "data.eval_num_examples=6",
                                     "output.eval_num_generations=4", f"output.output_dir={tmp_path}",
                                     "output.progress_bar=false"], base=demo_config())
    history = GRPOTrainer(cfg).train()
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    evaluated = [m["step"] for m in metrics if "eval/reward" in m]
    assert evaluated == [2, 4] and history[1]["eval/num_prompts"] == 6
    for m in (metrics[1], metrics[3]):
        for f in ("format_reward", "answer_reward"):
            assert 0.0 <= m[f"eval/pass@1/{f}"] <= m[f"eval/pass@2/{f}"] <= m[f"eval/pass@4/{f}"] <= 1.0
            assert 0.0 <= m[f"eval/rewards/{f}"] <= 1.0
    # TensorBoard has the eval scalars under eval/
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "eval/reward" in tags and "eval/pass@4/answer_reward" in tags and "train/reward" in tags
    assert [e.step for e in acc.Scalars("eval/reward")] == [2, 4]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]


def test_eval_steps_without_eval_data_fail_before_the_model_loads(tmp_path, monkeypatch):
    import longrl.training.model_setup as model_setup

    monkeypatch.setattr(model_setup, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cfg = load_config(None, [f"output.output_dir={tmp_path}", "output.eval_steps=2"], base=demo_config())
    with pytest.raises(ConfigError, match="output.eval_steps.*data.eval_source"):
        GRPOTrainer(cfg)
    cfg = load_config(None, [f"output.output_dir={tmp_path}", "data.eval_source=nowhere.jsonl"], base=demo_config())
    with pytest.raises(ValueError, match="data.eval_source: dataset file not found: nowhere.jsonl"):
        GRPOTrainer(cfg)


def test_an_sft_run_sums_up_its_loss_not_a_reward(tmp_path):
    out = io.StringIO()
    reporter = RunReporter(tmp_path, 4, report_to=(), progress_bar=False, stream=out, recipe="sft")
    for step, loss in enumerate([3.0, 2.0, 1.5, 1.0], start=1):
        reporter.log_step({"step": step, "loss": loss, "grad_norm": 1.0, "lr": 0.1, "tokens_per_s": 10.0,
                           "step_time_s": 0.1, **({"eval/loss": 2.0 - step / 4} if step % 2 == 0 else {})})
    reporter.close()
    text = out.getvalue()
    assert "step 2/4 loss=2 grad_norm=1 lr=0.1 tokens_per_s=10 step_time_s=0.1 eval/loss=1.5" in text
    assert "loss: 3.000 (mean of the first 1 steps) → 1.000 (last 1)" in text
    assert "eval loss: 1.500 (step 2) → 1.000 (step 4)" in text and "reward" not in text
