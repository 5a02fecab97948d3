"""A GRPO rollout batch of agent episodes: environments built and reset, prompts rendered with their tools, the
sampler's multi-turn call, and what the trainer needs back (trajectories, reward columns, metrics).

One environment instance per sequence (G per dataset row), as TRL does, so that episodes never share state. The G
sequences of a row share their prompt's prefill when their resets render the same prompt (else each sequence
is its own prompt). Reward functions get, besides TRL's columns: ``completions`` as the trajectory's messages after
the prompt (assistant, tool, user ...), ``turn_rewards`` (each environment step's reward, None where it gave none),
``environments`` (the instances; TRL's reward functions call ``get_reward()`` on them) and ``stop_reason``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from ..config.schema import trajectory_tokens
from ..rollout.sampler import MultiTurn, Rollout
from .environment import TRLEnvironment, build_environment, load_environment_factory
from .tool_calls import detect_format
from .tools import call_with_timeout
from .trajectory import Episode, EpisodeRunner, EpisodeSettings

log = logging.getLogger(__name__)

BUDGET_STOPS = ("max_turns", "max_tokens", "turn_timeout", "episode_timeout")


def environment_reward(prompts, completions, turn_rewards=None, **kwargs) -> list[float | None]:
    """The environment's own score of each episode: the sum of its step rewards (None where it gave none)."""
    out = []
    for rewards in turn_rewards or [[] for _ in completions]:
        given = [r for r in rewards if r is not None]
        out.append(float(sum(given)) if given else None)
    return out


@dataclass
class AgentBatch:
    rollout: Rollout  # prompt_ids per sequence; completion_ids = the whole trajectory after the prompt; env_mask
    prompts: list  # [N] the prompt each episode opened with (string or messages)
    completions: list[list[dict]]  # [N] messages after the prompt
    episodes: list[Episode]
    columns: dict = field(default_factory=dict)  # extra reward-function columns
    metrics: dict = field(default_factory=dict)


class AgentRollouts:
    """Runs a batch of episodes through the sampler (see the module docstring)."""

    def __init__(self, tokenizer, settings: EpisodeSettings, factory: Callable | None = None,
                 tools: list[Callable] | None = None, fmt: str = "auto", prompt_column: str = "prompt",
                 max_prompt_length: int | None = None, tool_timeout_s: float | None = 30.0):
        self.tokenizer, self.settings, self.factory = tokenizer, settings, factory
        self.tools, self.prompt_column, self.max_prompt_length = list(tools or []), prompt_column, max_prompt_length
        self.fmt = detect_format(tokenizer) if fmt == "auto" else fmt
        self.tool_timeout_s = tool_timeout_s
        probe = self.new_environment()  # fail now, before any rollout, on a factory or tool that cannot be built
        self.owns_reward = isinstance(probe, TRLEnvironment) and callable(getattr(probe.instance, "get_reward", None))

    @classmethod
    def from_config(cls, cfg, tokenizer, environment_factory: Callable | None = None,
                    tools: list[Callable] | None = None) -> "AgentRollouts | None":
        """None unless the config or the Python API names an environment or tools."""
        env = cfg.environment
        factory = environment_factory or (load_environment_factory(env.factory) if env.factory else None)
        functions = list(tools or []) + [_load_tool(ref, i) for i, ref in enumerate(cfg.tools)]
        if factory is None and not functions:
            return None
        settings = EpisodeSettings(max_turns=env.max_turns, max_tokens=trajectory_tokens(cfg),
                                   turn_timeout_s=env.turn_timeout_s or None,
                                   episode_timeout_s=env.episode_timeout_s or None, workers=env.workers)
        return cls(tokenizer, settings, factory, functions, env.tool_call_format, cfg.data.prompt_column,
                   cfg.data.max_prompt_length, env.tool_timeout_s or None)

    def new_environment(self):
        return build_environment(self.factory, self.tools, self.fmt, self.prompt_column, self.tool_timeout_s)

    # ------------------------------------------------------------------------------------------ one batch
    def generate(self, sampler, rows: list[dict], G: int, params) -> AgentBatch:
        envs = [self.new_environment() for _ in range(len(rows) * G)]
        schemas = envs[0].tool_schemas() or None
        prompts, prompt_ids = [], []
        for i, env in enumerate(envs):
            row = rows[i // G]
            finished, messages, error = call_with_timeout(env.reset, self.settings.turn_timeout_s, dict(row))
            if not finished or error is not None:
                why = "timed out" if not finished else f"raised {type(error).__name__}: {error}"
                raise RuntimeError(f"environment reset of dataset row {row!r:.120} {why}")
            prompt = messages if messages else row[self.prompt_column]
            prompts.append(prompt)
            prompt_ids.append(self._prompt_ids(prompt, schemas))
        shared = all(prompt_ids[p * G + g] == prompt_ids[p * G] for p in range(len(rows)) for g in range(G))
        episodes = [Episode(env, p if isinstance(p, list) else [{"role": "user", "content": p}])
                    for env, p in zip(envs, prompts)]
        runner = EpisodeRunner(episodes, self.tokenizer, self.settings, schemas, params.stop_token_ids)
        multi = MultiTurn(runner, self.settings.max_tokens, self.settings.workers)
        if shared:
            rollout = sampler.generate(prompt_ids[::G], G, params, multi)
        else:
            rollout = sampler.generate(prompt_ids, 1, params, multi)
        # truncated: an episode a budget ended (its last turn may well end without a stop token: the environment
        # said done, or max_turns came)
        rollout.truncated = [ep.truncated in BUDGET_STOPS for ep in episodes]
        for ep in episodes:
            final = ep.env.final_reward() if isinstance(ep.env, TRLEnvironment) and self.owns_reward else None
            if final is not None:
                ep.turn_rewards.append(final)
        return AgentBatch(rollout, prompts, [ep.messages for ep in episodes], episodes,
                          self._columns(episodes), self._metrics(episodes, rollout, sampler.last_stats))

    def _prompt_ids(self, prompt, schemas) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        else:
            out = self.tokenizer.apply_chat_template(prompt, tools=schemas, add_generation_prompt=True, tokenize=True)
            ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        if self.max_prompt_length and len(ids) > self.max_prompt_length:
            raise ValueError(f"an episode's prompt has {len(ids)} tokens (its tools' schemas included), more than "
                             f"data.max_prompt_length={self.max_prompt_length}: raise it")
        if not ids:
            raise ValueError("an episode's prompt renders to no tokens")
        return ids

    @staticmethod
    def _columns(episodes: list[Episode]) -> dict:
        return {"turn_rewards": [list(ep.turn_rewards) for ep in episodes],
                "environments": [ep.env.instance if isinstance(ep.env, TRLEnvironment) else ep.env for ep in episodes],
                "stop_reason": [ep.truncated or "done" for ep in episodes]}

    @staticmethod
    def _metrics(episodes: list[Episode], rollout: Rollout, stats: dict) -> dict:
        n = max(1, len(episodes))
        trained = sum(sum(m) for m in rollout.env_mask)
        attended = sum(len(p) + len(c) for p, c in zip(rollout.prompt_ids, rollout.completion_ids))
        metrics = {
            "agent/turns": sum(ep.turns for ep in episodes) / n,
            "agent/tool_calls": sum(getattr(ep.env, "stats", {}).get("tool_calls", 0) for ep in episodes) / n,
            "agent/tool_errors": sum(getattr(ep.env, "stats", {}).get("tool_errors", 0) for ep in episodes) / n,
            "agent/env_time_s": sum(ep.env_time_s for ep in episodes),
            "agent/env_wait_s": stats.get("env_wait_s", 0.0),
            "agent/resume_prefill_s": stats.get("resume_s", 0.0),
            "agent/tokens_trained": trained,
            "agent/tokens_attended": attended,
            "agent/env_errors": sum(ep.truncated == "env_error" for ep in episodes),
        }
        for reason in BUDGET_STOPS:
            metrics[f"agent/stopped_{reason}"] = sum(ep.truncated == reason for ep in episodes) / n
        return metrics


def _load_tool(ref: str, index: int) -> Callable:
    from ..rewards import RewardLoadError, load_reward_function

    try:
        return load_reward_function(ref)
    except RewardLoadError as e:
        raise ValueError(str(e).replace("reward function", f"tools[{index}]", 1)) from None
