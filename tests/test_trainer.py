"""End to end on the CPU: the demo learns, resume reproduces an uninterrupted run, every loss variant trains,
outputs are written, and bad inputs fail early with clear messages."""

import json
import subprocess
import sys

import pytest

from longrl.config import ConfigError, load_config
from longrl.config.demo import demo_config
from longrl.training.reporting import read_metrics
from longrl.compat.trl import GRPOTrainer

QUICK = ["train.max_steps=4", "train.prompts_per_step=4", "grpo.num_generations=4", "train.micro_batch_size=5",
         "output.progress_bar=false", "output.tensorboard=false", "output.save_steps=0"]


def _cfg(tmp_path, *overrides):
    return load_config(None, QUICK + [f"output.output_dir={tmp_path}", *overrides], base=demo_config())


@pytest.mark.slow
def test_demo_learns_with_default_settings(tmp_path):
    """The embedded default's first half: its learning rate is constant after warm-up, so these 300 steps are the
    600-step demo's first 300. The reward starts <= 0.3 and passes 0.6 (0.71 over steps 291-300 on torch 2.13's CPU;
    the whole demo's 0.03 -> 0.92 is in benchmarks/results/demo_cpu.md)."""
    demo = demo_config()
    assert demo.train.lr_scheduler_type == "constant" and demo.train.max_steps == 600
    cfg = load_config(None, [f"output.output_dir={tmp_path}", "output.progress_bar=false", "train.max_steps=300"],
                      base=demo)
    GRPOTrainer(cfg).train()
    rewards = [m["reward"] for m in read_metrics(tmp_path)]
    assert len(rewards) == 300
    start, end = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert start <= 0.3 and end >= 0.6, (start, end)
    assert (tmp_path / "tensorboard").is_dir() and any((tmp_path / "tensorboard").iterdir())
    assert (tmp_path / f"checkpoint-{cfg.train.max_steps}" / "trainer_state.json").is_file()


def _strip_time(metrics):
    return [{k: v for k, v in m.items() if not k.endswith("time_s")} for m in metrics]


@pytest.mark.parametrize("lora", [False, True])
def test_resume_reproduces_uninterrupted_run(tmp_path, lora):
    extra = [f"lora.enabled={str(lora).lower()}", "train.max_steps=6", "output.save_steps=2",
             f"grpo.beta={0.05 if lora else 0}",  # a KL reference needs adapters to disable
             "grpo.num_iterations=2", "lora.dropout=0.1" if lora else "lora.dropout=0.0"]
    full = GRPOTrainer(_cfg(tmp_path / "full", *extra)).train()
    # interrupted after step 4 (the checkpoint at 4 exists), then resumed
    GRPOTrainer(_cfg(tmp_path / "cut", *extra, "train.max_steps=4")).train()
    (tmp_path / "cut" / "checkpoint-4").rename(tmp_path / "cut" / "checkpoint-4-ignored")  # crash before the save at 4
    resumed_cfg = _cfg(tmp_path / "cut", *extra, "output.resume=true")
    GRPOTrainer(resumed_cfg).train()
    assert _strip_time(read_metrics(tmp_path / "cut")) == _strip_time(full)


@pytest.mark.parametrize("overrides", [
    ["grpo.loss_type=grpo", "grpo.beta=0.04", "lora.enabled=true"],  # the reference: adapters disabled
    ["grpo.loss_type=bnpo", "grpo.num_iterations=2", "grpo.epsilon_high=0.28"],
    ["grpo.loss_type=dr_grpo", "grpo.scale_rewards=none", "grpo.mask_truncated_completions=true"],
    ["grpo.loss_type=cispo", "grpo.epsilon_high=5.0", "grpo.num_iterations=2"],
    ["grpo.importance_sampling_level=sequence", "grpo.num_iterations=2", "grpo.delta=2.0", "grpo.scale_rewards=batch"],
    ["lora.enabled=true", "lora.r=4", "grpo.beta=0.1", "train.lr_scheduler_type=cosine", "train.warmup_steps=2"],
])
def test_loss_variants_train(tmp_path, overrides):
    history = GRPOTrainer(_cfg(tmp_path, *overrides)).train()
    assert len(history) == 4
    for m in history:
        assert all(k in m for k in ("step", "reward", "reward_std", "loss", "kl", "completion_length", "step_time_s",
                                    "rewards/format_reward", "rewards/answer_reward"))
        assert m["grad_norm"] == m["grad_norm"]  # not NaN
    if any("beta=0.0" not in o and o.startswith("grpo.beta") for o in overrides):
        assert history[-1]["kl"] is not None and history[-1]["kl"] >= 0


def test_outputs_written(tmp_path):
    cfg = _cfg(tmp_path, "output.save_steps=2", "output.save_total_limit=1", "lora.enabled=true")
    GRPOTrainer(cfg).train()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]
    assert len((tmp_path / "completions.jsonl").read_text().splitlines()) > 0
    ckpts = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert ckpts == ["checkpoint-4"]  # save_total_limit=1
    ck = tmp_path / "checkpoint-4"
    for name in ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.json",
                 "trainer_state.json", "manifest.json"):
        assert (ck / name).is_file(), name
    assert json.loads((ck / "trainer_state.json").read_text())["data_position"] == 16
    assert not list(tmp_path.glob(".tmp-*"))
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(str(ck)).r == cfg.lora.r


def test_reward_that_raises_is_reported_and_run_goes_on(tmp_path, caplog):
    f = tmp_path / "flaky.py"
    f.write_text("def flaky(prompts, completions, **kw):\n"
                 "    return [1.0 if i % 2 else (_ for _ in ()).throw(ValueError('odd one')) for i in range(len(completions))]\n"
                 "def short(prompts, completions, **kw):\n    return [0.0]\n")
    cfg = _cfg(tmp_path / "out", "rewards=[{function: " + f"{f}:flaky" + ", weight: 1.0}]")
    history = GRPOTrainer(cfg).train()
    assert len(history) == 4 and history[0]["reward_failures"] > 0
    assert "step 1: reward function 'flaky' failed on 16 of 16 samples; first error (sample 0): ValueError: odd one" \
        in caplog.text


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "longrl.cli.main", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_missing_reward_file_fails_before_model_load(tmp_path):
    r = _cli("demo", f"output.output_dir={tmp_path}", "rewards=[{function: nowhere.py:f}]")
    assert r.returncode == 2 and "file not found: nowhere.py" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_cli_missing_dataset_column(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1="}\n')
    r = _cli("demo", f"output.output_dir={tmp_path / 'o'}", f"data.source={data}")
    assert r.returncode == 2 and "no prompt column 'prompt'" in r.stderr


def test_cli_train_runs_from_printed_config(tmp_path):
    cfg_text = _cli("demo", "--print-config").stdout
    path = tmp_path / "c.yaml"
    path.write_text(cfg_text)
    r = _cli("train", str(path), *QUICK, "train.max_steps=2", f"output.output_dir={tmp_path / 'o'}")
    assert r.returncode == 0, r.stderr
    assert len(read_metrics(tmp_path / "o")) == 2


@pytest.mark.parametrize("rows, message", [([{"prompt": "1+1="}, {"prompt": ""}], "row 2: prompt must be"),
                                           ([{"question": "1+1="}], "no prompt column 'prompt'"),
                                           ([{"prompt": "1+1="}, {"text": "2+2="}], "row 2: prompt must be")])
def test_dataset_rows_checked_before_the_model_loads(tmp_path, monkeypatch, rows, message):
    import longrl.training.model_setup as trainer_module
    from longrl.data.prompts import DataError

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(trainer_module, "load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    with pytest.raises(DataError, match=message):
        GRPOTrainer(_cfg(tmp_path / "o", f"data.source={data}"))


def test_output_dir_and_resume_settings_checked_before_the_model_loads(tmp_path, monkeypatch):
    import longrl.training.model_setup as trainer_module

    GRPOTrainer(_cfg(tmp_path, "train.max_steps=2")).train()  # leaves checkpoint-2
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')  # a line cut short by a kill
    real_load = trainer_module.load_model
    monkeypatch.setattr(trainer_module, "load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    with pytest.raises(ConfigError, match="already holds checkpoints of an earlier run \\(checkpoint-2\\)"):
        GRPOTrainer(_cfg(tmp_path, "train.max_steps=2"))  # a new run would rotate and resume the old one's files
    with pytest.raises(ConfigError, match=r"train.learning_rate: 0.0005 → 0.01"):
        GRPOTrainer(_cfg(tmp_path, "output.resume=true", "train.max_steps=3", "train.learning_rate=0.01"))
    with pytest.raises(ConfigError, match="lora.enabled: False → True"):
        GRPOTrainer(_cfg(tmp_path, "output.resume=true", "lora.enabled=true"))
    monkeypatch.setattr(trainer_module, "load_model", real_load)
    # longer, other outputs and micro-batching: allowed; the cut line is dropped
    GRPOTrainer(_cfg(tmp_path, "output.resume=true", "train.max_steps=3", "output.log_completions=0",
                     "train.micro_batch_size=3")).train()
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process
    return child.pid


def test_saves_cut_by_a_kill_are_finished_or_cleaned_at_the_next_start(tmp_path):
    import os
    import shutil

    from longrl.training.checkpoint import STATE_FILE, recover_interrupted_saves

    GRPOTrainer(_cfg(tmp_path, "train.max_steps=2")).train()  # checkpoint-2
    dead = _dead_pid()
    # a re-save of step 2 killed between its two renames: the old copy moved aside, the new one staged half-written
    os.replace(tmp_path / "checkpoint-2", tmp_path / f".old-checkpoint-2-{dead}")
    (tmp_path / f".tmp-checkpoint-2-{dead}").mkdir()
    (tmp_path / f".tmp-checkpoint-9-{dead}").mkdir()  # a first save of step 9 killed while writing
    live = tmp_path / f".tmp-checkpoint-5-{os.getppid()}"  # a running process's save: not touched
    live.mkdir()
    GRPOTrainer(_cfg(tmp_path, "output.resume=true", "train.max_steps=3")).train()
    assert (tmp_path / "checkpoint-2" / STATE_FILE).is_file() and (tmp_path / "checkpoint-3" / STATE_FILE).is_file()
    assert json.loads((tmp_path / "checkpoint-3" / STATE_FILE).read_text())["step"] == 3
    assert len(read_metrics(tmp_path)) == 3  # resumed from the restored step 2, not from scratch
    assert sorted(p.name for p in tmp_path.glob(".*checkpoint*")) == [live.name]
    # a complete new copy wins over the moved-aside old one
    shutil.copytree(tmp_path / "checkpoint-3", tmp_path / f".tmp-checkpoint-3-{dead}")
    (tmp_path / f".tmp-checkpoint-3-{dead}" / "marker").write_text("new")
    os.replace(tmp_path / "checkpoint-3", tmp_path / f".old-checkpoint-3-{dead}")
    assert recover_interrupted_saves(tmp_path)[0] == f"restored checkpoint-3 from .tmp-checkpoint-3-{dead}"
    assert (tmp_path / "checkpoint-3" / "marker").is_file()
    assert sorted(p.name for p in tmp_path.glob(".*checkpoint*")) == [live.name]


def test_staging_of_other_hosts_is_left_alone(tmp_path):
    """Saves name their staging directories host-pid: on a filesystem several machines share, a pid that is dead
    here may be another machine's save in flight. This host's dead saves are recovered; the others' are not."""
    import os

    from longrl.training.checkpoint import STATE_FILE, _saver_tag, recover_interrupted_saves

    dead = _dead_pid()
    host = _saver_tag().rsplit("-", 1)[0]
    for name in (f".tmp-checkpoint-6-{host}-{dead}", f".tmp-checkpoint-6-elsewhere-{dead}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / STATE_FILE).write_text(json.dumps({"step": 6}))
    assert recover_interrupted_saves(tmp_path) == [f"restored checkpoint-6 from .tmp-checkpoint-6-{host}-{dead}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".tmp-checkpoint-6-elsewhere-{dead}", "checkpoint-6"]
    assert _saver_tag() == f"{host}-{os.getpid()}" and "-" not in host



def test_recovery_never_trades_a_good_copy_for_a_cut_one(tmp_path):
    """A staged copy counts as complete only when its trainer state (written last) reads as its step: a save cut
    while writing it (or one whose data a crash lost) does not replace the moved-aside old copy, which is restored,
    and is not promoted where it is the only copy. A staging directory named with this process's own pid (a
    restarted container's trainer gets the killed one's) is not a save in flight."""
    import os

    from longrl.training.checkpoint import STATE_FILE, list_checkpoints, recover_interrupted_saves

    def staged(name, state):
        (tmp_path / name).mkdir()
        (tmp_path / name / "optimizer.pt").write_bytes(b"x")
        (tmp_path / name / STATE_FILE).write_text(state)

    dead, me = _dead_pid(), os.getpid()
    staged(f".old-checkpoint-4-{dead}", json.dumps({"step": 4, "data_position": 7}))  # the old copy, moved aside
    staged(f".tmp-checkpoint-4-{dead}", "")  # the new one, its state never written
    staged(f".tmp-checkpoint-6-{dead}", '{"step": 6, "data_pos')  # a first save of step 6, cut short
    staged(f".tmp-checkpoint-8-{me}", json.dumps({"step": 8}))  # complete, then killed before its rename
    done = recover_interrupted_saves(tmp_path)
    assert f"restored checkpoint-4 from .old-checkpoint-4-{dead}" in done
    assert f"restored checkpoint-8 from .tmp-checkpoint-8-{me}" in done
    assert json.loads((tmp_path / "checkpoint-4" / STATE_FILE).read_text())["data_position"] == 7
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-8"]
    assert not list(tmp_path.glob(".*checkpoint*"))

def test_demo_again_starts_over_but_leaves_other_runs(tmp_path):
    from longrl.cli.demo import start_demo_over

    cfg = _cfg(tmp_path, "train.max_steps=2")
    start_demo_over(cfg).release()  # the directory becomes a demo's (as `longrl demo` makes it)
    GRPOTrainer(cfg).train()
    other = tmp_path / "checkpoint-9"
    other.mkdir()
    (other / "trainer_state.json").write_text(json.dumps({"config": {"model": {"name_or_path": "my/model"}}}))
    start_demo_over(cfg).release()
    assert not (tmp_path / "checkpoint-2").exists() and other.is_dir()
    other.rename(tmp_path / ".kept-9")
    GRPOTrainer(cfg).train()  # the directory holds no checkpoint now: a new run is allowed


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="names fds through /proc")
def test_checkpoint_files_reach_the_disk_before_the_rename(tmp_path, monkeypatch):
    """Every file of a checkpoint (and its directories) is fsynced while staged, before the rename that names it;
    the output directory after it: a crash cannot leave checkpoint-N with empty files."""
    import os

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("sync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    GRPOTrainer(_cfg(tmp_path, "train.max_steps=1")).train()
    final = tmp_path / "checkpoint-1"
    rename = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(final))
    staged = events[rename][1]
    synced_before = {e[1] for e in events[:rename] if e[0] == "sync"}
    for path in [final, *final.rglob("*")]:
        assert staged + str(path)[len(str(final)):] in synced_before, path
    assert ("sync", str(tmp_path)) in events[rename:]


def test_old_policy_logprobs_come_from_the_update_forward(tmp_path, monkeypatch):
    """With grpo.num_iterations > 1 the old policy's log-probs are computed by the same forward as the update's
    (the fused LoRA on CUDA), so the first iteration's ratio is exactly 1 (PEFT's forward rounds apart in bf16)."""
    from longrl.models.lora_training import FusedLoraLinear, fused_lora_training

    entered = []

    def policy_forward(self):  # the CUDA choice, forced on the CPU; records that the fused layers were in place
        context = fused_lora_training(self.model)
        entered.append(context)
        return context

    real_logprobs = GRPOTrainer._logprobs

    def logprobs(self, *args, **kwargs):
        fused = any(isinstance(m, FusedLoraLinear) for m in self.model.modules())
        entered.append(("old" if fused else "plain"))
        return real_logprobs(self, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_policy_forward", policy_forward)
    monkeypatch.setattr(GRPOTrainer, "_logprobs", logprobs)
    history = GRPOTrainer(_cfg(tmp_path, "train.max_steps=2", "grpo.num_iterations=2", "lora.enabled=true",
                               "lora.r=4", "grpo.beta=0.0")).train()
    assert len(history) == 2
    assert entered.count("old") == 1 and "plain" not in entered  # old log-probs inside the fused forward
    assert sum(not isinstance(e, str) for e in entered) == 3  # old log-probs + two updates


def test_generate_batch_and_train_on_batch_are_one_step_apart(tmp_path):
    """The phase API: generate_batch makes a step's rollout batch (with its reference log-probs when beta ≠ 0),
    train_on_batch updates on it, computing the reference pass itself when the batch has none; the same batch
    with its reference log-probs or without them gives the same update, and the step counter does not move."""
    import copy

    import torch

    trainers = [GRPOTrainer(_cfg(tmp_path / name, "grpo.beta=0.04", "lora.enabled=true", "lora.r=4")) for name in ("a", "b")]
    batches = [t.generate_batch() for t in trainers]  # same seed, same prompts and samples
    a, b = trainers
    assert {"generation_time_s", "rewards_time_s", "reference_time_s"} <= a.phase_stats.keys()
    # the rollout's fixed costs apart: no CUDA graphs on the CPU; the set-up a part of the generation phase
    assert a.phase_stats["generation_capture_time_s"] == 0.0
    assert 0 < a.phase_stats["generation_setup_time_s"] < a.phase_stats["generation_time_s"]
    assert len(batches[0].completion_ids) == 4 * 4 and batches[0].ref_logps is not None
    assert batches[0].completion_ids == batches[1].completion_ids
    given = copy.copy(batches[1])
    given.ref_logps = None  # train_on_batch computes it
    before = {n: p.detach().clone() for n, p in a.model.named_parameters() if p.requires_grad}
    stats_a = a.train_on_batch(batches[0])
    stats_b = b.train_on_batch(given)
    assert "reference_time_s" not in a.phase_stats and {"reference_time_s", "update_time_s"} <= b.phase_stats.keys()
    torch.testing.assert_close(given.ref_logps, batches[0].ref_logps)
    assert stats_a["loss"] == pytest.approx(stats_b["loss"], rel=1e-6) and stats_a["kl"] is not None
    changed = [n for n, p in a.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed and a.step_idx == 0
