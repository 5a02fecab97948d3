"""Multi-turn GRPO end to end: the tools demo, its outputs, its loss mask, and that it learns what needs the tool."""

from __future__ import annotations

import json

import pytest
import torch

from longrl.config import ConfigError, load_config
from longrl.config.demo import demo_config
from longrl.training.reporting import read_metrics
from longrl.tasks.tools import LookupEnvironment, NoLookupEnvironment
from longrl.compat.trl import GRPOTrainer

QUICK = ["train.max_steps=2", "train.prompts_per_step=4", "grpo.num_generations=4", "output.progress_bar=false",
         "output.tensorboard=false", "output.save_steps=0"]


def _tools_cfg(tmp_path, *overrides):
    return load_config(None, QUICK + [f"output.output_dir={tmp_path}", *overrides], base=demo_config("tools"))


def test_tools_run_logs_whole_trajectories_metrics_and_masks_environment_tokens(tmp_path):
    trainer = GRPOTrainer(_tools_cfg(tmp_path, "output.log_completions=16", "output.logging_steps=1"))
    trainer.train()
    metrics = read_metrics(tmp_path)
    for key in ("agent/turns", "agent/tool_calls", "agent/tool_errors", "agent/env_time_s", "agent/tokens_trained",
                "agent/tokens_attended", "agent/resume_prefill_s"):
        assert key in metrics[-1], key
    assert metrics[-1]["agent/tokens_trained"] < metrics[-1]["agent/tokens_attended"]
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert rows and all(isinstance(r["completion"], list) and "turn_rewards" in r and "stop_reason" in r for r in rows)
    assert all(m["role"] in ("assistant", "tool") for r in rows for m in r["completion"])
    # a rollout batch: every environment token (the tool's answers) is out of the loss, every sampled one in it
    b = trainer._rollout_batch()
    width = b.mask.shape[1]
    for i, c in enumerate(b.completion_ids):
        roles = [m["role"] for m in b.completions[i]]
        env_tokens = int((b.mask[i, :len(c)] == 0).sum())
        if not torch.isnan(b.rewards[i]):
            assert env_tokens == roles.count("tool")  # the tiny template: one token per tool answer
        assert b.mask[i, len(c):width].sum() == 0


def test_environment_config_errors_name_their_key(tmp_path):
    with pytest.raises(ConfigError, match="environment.max_turns"):
        _tools_cfg(tmp_path, "environment.max_turns=0")
    with pytest.raises(ConfigError, match="generation.backend"):
        _tools_cfg(tmp_path, "generation.backend=hf")
    with pytest.raises(ConfigError, match="environment.factory"):
        _tools_cfg(tmp_path, "environment.factory=nocolon")
    with pytest.raises(ValueError, match="environment.factory"):
        GRPOTrainer(_tools_cfg(tmp_path, "environment.factory=longrl.tasks.tools:Missing"))


def test_python_api_takes_an_environment_factory(tmp_path):
    cfg = _tools_cfg(tmp_path, "train.max_steps=1", "environment.factory=null")
    trainer = GRPOTrainer(cfg, environment_factory=NoLookupEnvironment)
    trainer.train()
    b = trainer.batch
    tool_answers = [m["content"] for c in b.completions for m in c if m["role"] == "tool"]
    assert all(a == "-" for a in tool_answers)  # the control environment's lookups answer nothing


@pytest.mark.slow
def test_tools_demo_learns_and_the_same_model_without_the_tool_cannot_pass(tmp_path):
    """The acceptance criterion of ``longrl demo --task tools``: the reward starts <= 0.3 and ends >= 0.8; then the
    trained model, its lookups answered with nothing, falls back to guessing (the secret is independent of the
    prompt: at best one digit in ten)."""
    cfg = load_config(None, [f"output.output_dir={tmp_path}", "output.progress_bar=false", "output.tensorboard=false",
                             "output.save_steps=0"], base=demo_config("tools"))
    trainer = GRPOTrainer(cfg)
    trainer.train()
    rewards = [m["reward"] for m in read_metrics(tmp_path)]
    start, end = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert start <= 0.3 and end >= 0.8, (start, end)
    trainer.agents.factory = NoLookupEnvironment
    without = torch.cat([trainer._rollout_batch().rewards for _ in range(3)])
    assert float(without.mean()) < 0.3, float(without.mean())
    trainer.agents.factory = LookupEnvironment
    again = torch.cat([trainer._rollout_batch().rewards for _ in range(3)])
    assert float(again.mean()) >= 0.8  # the same model, the tool back: it passes again
