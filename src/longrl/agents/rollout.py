"""A GRPO rollout batch of agent episodes: environments built and reset, prompts rendered with their tools, the
sampler's multi-turn call, and what the trainer needs back (trajectories, reward columns, metrics).

One environment instance per sequence (G per dataset row), as TRL does, so that episodes never share state. The G
sequences of a row share their prompt's prefill when their resets render the same prompt (else each sequence
is its own prompt). Reward functions get, besides TRL's columns: ``completions`` as the trajectory's messages after
the prompt (assistant, tool, user ...), ``turn_rewards`` (each environment step's reward, None where it gave none),
``environments`` (the instances; TRL's reward functions call ``get_reward()`` on them) and ``stop_reason``.

A row whose environment reset raises (or times out), or whose environment cannot be built, is skipped: it is not sampled, no reward function sees it, and
its G places in the batch hold placeholders out of the loss (stop_reason ``reset_error``, reward NaN), so that
the batch keeps its shape; ``agent/reset_errors`` counts such rows. More than
``environment.max_reset_failure_share`` of a rollout batch's rows (over every rank) failing ends the run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

from ..config.errors import ConfigError
from ..config.schema import trajectory_tokens
from ..rollout.sampler import MultiTurn, Rollout
from .bounded_text import cap_messages, cap_text
from ..models.vision import SequenceImages
from .episode_images import EpisodeImages
from .environment import EnvironmentSetupError, TRLEnvironment, build_environment, check_callable, \
    load_environment_factory
from .tool_calls import detect_format
from .tool_images import ToolImages
from .tools import ToolError, call_with_timeout
from .trajectory import Episode, EpisodeRunner, EpisodeSettings

log = logging.getLogger(__name__)

BUDGET_STOPS = ("max_turns", "max_tokens", "turn_timeout", "episode_timeout")
RESET_ERROR = "reset_error"  # the stop_reason of a skipped row's placeholders


class EnvironmentResetError(ValueError):
    """More than environment.max_reset_failure_share of a rollout batch's rows failed their environment reset."""


def environment_reward(prompts, completions, turn_rewards=None, **kwargs) -> list[float | None]:
    """The environment's own score of each episode: the sum of its step rewards (None where it gave none)."""
    out = []
    for rewards in turn_rewards or [[] for _ in completions]:
        given = [r for r in rewards if r is not None]
        out.append(float(sum(given)) if given else None)
    return out


@dataclass(frozen=True)
class AgentSpec:
    """What a run's episodes are built from, resolved and checked before the model loads: the environment factory
    (or None), the tool functions, and whether the environment scores its episodes (TRL's ``get_reward``)."""

    factory: Callable | None
    tools: tuple[Callable, ...]
    owns_reward: bool = False

    @classmethod
    def resolve(cls, cfg, environment_factory=None, tools=None) -> "AgentSpec | None":
        """None unless the config or the Python API names an environment or tools. A factory or tool that cannot
        be loaded, is not callable, or cannot be built (one environment is built here as a probe) raises
        ConfigError naming its key."""
        key = "environment_factory" if environment_factory is not None else "environment.factory"
        if environment_factory is not None:
            factory = check_callable(environment_factory)
        else:
            factory = load_environment_factory(cfg.environment.factory) if cfg.environment.factory else None
        functions = [check_callable(fn, f"tools[{i}]") for i, fn in enumerate(tools or [])]
        functions += [_load_tool(ref, i) for i, ref in enumerate(cfg.tools)]
        if factory is None and not functions:
            return None
        try:  # the format is read only when a turn is parsed: any will do for the probe
            probe = build_environment(factory, functions, "qwen", cfg.data.prompt_column)
        except EnvironmentSetupError as e:
            raise ConfigError(f"config key '{key}': {e}") from None
        except ToolError as e:
            raise ConfigError(f"config key 'tools': {e}") from None
        owns = isinstance(probe, TRLEnvironment) and callable(getattr(probe.instance, "get_reward", None))
        return cls(factory, tuple(functions), owns)


@dataclass
class AgentBatch:
    rollout: Rollout  # prompt_ids per sequence; completion_ids = the whole trajectory after the prompt; env_mask
    prompts: list  # [N] the prompt each episode opened with (string or messages)
    completions: list[list[dict]]  # [N] messages after the prompt
    episodes: list[Episode]
    columns: dict = field(default_factory=dict)  # extra reward-function columns
    metrics: dict = field(default_factory=dict)
    vision: list | None = None  # [N] each episode's VisionPrompt (one object for episodes of a row that open
    #                             alike) or None, or a SequenceImages where the environment answered with images;
    #                             None: no episode has images

    @property
    def ran(self) -> list[int]:
        """Positions of the sequences whose episode ran (not a skipped row's placeholder)."""
        return [i for i, ep in enumerate(self.episodes) if ep.truncated != RESET_ERROR]

    def score(self, scorer, prompts: list, completions: list, columns: dict):
        """``scorer.score`` over the episodes that ran; a skipped row's sequences get NaN (no learning signal) and
        are never shown to a reward function. Returns (per_function [N, F], total [N], failures)."""
        import torch

        ran, n = self.ran, len(completions)
        if len(ran) == n:
            return scorer.score(prompts, completions, columns)
        per_function = torch.full((n, len(scorer.functions)), math.nan)
        total = torch.full((n,), math.nan)
        if not ran:
            return per_function, total, []
        pick = (lambda values: [values[i] for i in ran])
        per_ran, total_ran, failures = scorer.score(pick(prompts), pick(completions),
                                                    {k: pick(v) for k, v in columns.items()})
        per_function[ran], total[ran] = per_ran.to(per_function.dtype), total_ran.to(total.dtype)
        return per_function, total, [f if f.sample is None else dataclasses.replace(f, sample=ran[f.sample])
                                     for f in failures]


class AgentRollouts:
    """Runs a batch of episodes through the sampler (see the module docstring). ``sum_floats``: sums counts over
    a job's ranks (``World.sum_floats``; None: one process)."""

    def __init__(self, tokenizer, settings: EpisodeSettings, spec: AgentSpec, fmt: str = "auto",
                 prompt_column: str = "prompt", max_prompt_length: int | None = None,
                 tool_timeout_s: float | None = 30.0, max_reset_failure_share: float = 0.5, sum_floats: Callable[[dict], dict] | None = None):
        self.tokenizer, self.settings = tokenizer, settings
        self.factory, self.tools = spec.factory, list(spec.tools)
        self.prompt_column, self.max_prompt_length = prompt_column, max_prompt_length
        self.fmt = detect_format(tokenizer) if fmt == "auto" else fmt
        self.tool_timeout_s = tool_timeout_s  # text from tools and environments: capped at settings.max_message_chars
        self.max_reset_failure_share, self.sum_floats = max_reset_failure_share, sum_floats
        self.owns_reward = spec.owns_reward
        self.warned_truncation = False

    @classmethod
    def from_config(cls, cfg, tokenizer, spec: AgentSpec,
                    sum_floats: Callable[[dict], dict] | None = None) -> "AgentRollouts":
        env = cfg.environment
        settings = EpisodeSettings(max_turns=env.max_turns, max_tokens=trajectory_tokens(cfg),
                                   turn_timeout_s=env.turn_timeout_s or None,
                                   episode_timeout_s=env.episode_timeout_s or None, workers=env.workers,
                                   max_message_chars=env.max_message_chars)
        return cls(tokenizer, settings, spec, env.tool_call_format, cfg.data.prompt_column, cfg.data.max_prompt_length,
                   env.tool_timeout_s or None, env.max_reset_failure_share, sum_floats)

    def new_environment(self):
        return build_environment(self.factory, self.tools, self.fmt, self.prompt_column, self.tool_timeout_s,
                                 self.settings.max_message_chars)

    # ------------------------------------------------------------------------------------------ one batch
    def generate(self, sampler, rows: list[dict], G: int, params, images: EpisodeImages | None = None,
                 tool_images: ToolImages | None = None) -> AgentBatch:
        """The episodes of ``rows`` (G a row) through ``sampler``; ``images``: the rows' images (a vision-language
        model's run; agents.episode_images), else None; ``tool_images``: a vision-language model's encoder of
        environment messages holding images (agents.tool_images), else None (such a message ends its episode)."""
        if images is not None:
            rows = images.rows_for_reset(rows, self.prompt_column)
        envs, prompts, failed = self._start_episodes(rows, G)
        if images is not None:  # openings whose image parts the row's images cannot fill: unusable resets
            for i, p in enumerate(prompts):
                why = images.unusable(i // G, p) if i // G not in failed else None
                if why is not None:
                    failed[i // G] = why
        schemas = next((env.tool_schemas() for env in envs if env is not None), None) or None
        skipped = self._reset_failures(rows, failed)
        ran = [i for i in range(len(envs)) if i // G not in failed]
        vision = [images.prompt(i // G, p, schemas) if images is not None and i // G not in failed else None
                  for i, p in enumerate(prompts)]
        # a skipped row's: its placeholders' (text: out of the loss, without the images)
        prompt_ids = [self._checked_length(v.input_ids) if v is not None else self._prompt_ids(p, schemas)
                      for p, v in zip(prompts, vision)]
        episodes = [Episode(env, p if isinstance(p, list) else [{"role": "user", "content": p}])
                    for env, p in zip(envs, prompts)]
        for p, why in failed.items():
            for ep in episodes[p * G:(p + 1) * G]:
                ep.truncated, ep.error = RESET_ERROR, why
        running = [episodes[i] for i in ran]
        rollout, stats = self._sample(sampler, running, [prompt_ids[i] for i in ran], ran, G, params, schemas,
                                      prompt_ids[0], [vision[i] for i in ran], tool_images)
        # truncated: an episode a budget ended (its last turn may well end without a stop token: the environment
        # said done, or max_turns came)
        rollout.truncated = [ep.truncated in BUDGET_STOPS for ep in running]
        for ep in running:
            final = ep.env.final_reward() if isinstance(ep.env, TRLEnvironment) and self.owns_reward else None
            if final is not None:
                ep.turn_rewards.append(final)
        metrics = {**self._metrics(running, rollout, stats), "agent/reset_errors": skipped}
        if metrics["agent/messages_truncated"] and not self.warned_truncation:
            self.warned_truncation = True
            log.warning("environment messages were cut to environment.max_message_chars=%d characters (the model "
                        "sees '... [truncated N characters]'); agent/messages_truncated counts them per episode",
                        self.settings.max_message_chars)
        rollout = self._with_placeholders(rollout, ran, prompt_ids)
        if rollout.completion_images is not None:  # images inside completions: each such sequence's all
            vision = [SequenceImages(v, tuple(blocks)) if blocks else v
                      for v, blocks in zip(vision, rollout.completion_images)]
        return AgentBatch(rollout, prompts, [ep.messages for ep in episodes], episodes, self._columns(episodes),
                          metrics, vision if any(v is not None for v in vision) else None)

    def _start_episodes(self, rows: list[dict], G: int) -> tuple[list, list, dict[int, str]]:
        """An environment for each of the rows' G sequences, built and reset: (environments [N] (None where none
        was built), the prompt each episode opens with [N] (the row's own where its reset gave none, or the row
        failed), {row: why its environment could not be built or reset})."""
        envs: list = [None] * (len(rows) * G)
        prompts: list = [None] * len(envs)
        failed: dict[int, str] = {}
        for i in range(len(envs)):
            if i // G in failed:
                continue
            try:
                envs[i] = self.new_environment()
            except EnvironmentSetupError as e:  # a factory that failed only now (it was probed before the model)
                failed[i // G] = f"got no environment: {e}"
                continue
            prompts[i], why = self._reset(envs[i], rows[i // G])
            if why is not None:
                failed[i // G] = why
        for i in range(len(envs)):
            if i // G in failed or prompts[i] is None:
                prompts[i] = rows[i // G][self.prompt_column]
        return envs, prompts, failed

    def _reset(self, env, row: dict):
        """(the prompt the episode opens with (None: the row's), None) or (None, why the reset failed)."""
        limit = self.settings.turn_timeout_s
        finished, messages, error = call_with_timeout(env.reset, limit, dict(row))
        if not finished:
            return None, f"timed out after {limit:g} s"
        if error is not None:
            return None, f"raised {type(error).__name__}: {cap_text(str(error), 500)}"
        if isinstance(messages, str):
            return cap_text(messages, self.settings.max_message_chars), None
        if messages and not isinstance(env, TRLEnvironment):  # (a TRL reset's observation is capped there)
            return cap_messages(list(messages), self.settings.max_message_chars), None
        return messages or None, None

    def _reset_failures(self, rows: list[dict], failed: dict[int, str]) -> int:
        """Warn about the rows skipped; raise EnvironmentResetError when more than max_reset_failure_share of the
        batch's rows failed (counted over every rank, so that every rank decides alike). Returns the count."""
        counts = {"failed": float(len(failed)), "rows": float(len(rows))}
        total = self.sum_floats(counts) if self.sum_floats is not None else counts
        if not total["failed"]:
            return 0
        first = (f"first: dataset row {cap_text(repr(rows[min(failed)]), 200)} {failed[min(failed)]}" if failed
                 else "see the warnings of the other ranks")
        summary = (f"environment reset failed on {int(total['failed'])} of {int(total['rows'])} rows of this "
                   f"rollout batch; {first}")
        if total["failed"] > self.max_reset_failure_share * total["rows"]:
            raise EnvironmentResetError(f"{summary}. That is more than environment.max_reset_failure_share="
                                        f"{self.max_reset_failure_share:g} of the rows: the run stops (a row whose "
                                        "reset fails is skipped; raise the share to go on past more of them)")
        if failed:
            log.warning("%s; those rows are skipped (no learning signal)", summary)
        return int(total["failed"])

    def _sample(self, sampler, episodes: list[Episode], prompt_ids: list[list[int]], ran: list[int], G: int, params,
                schemas, idle_prompt: list[int], vision: list, tool_images=None) -> tuple[Rollout, dict]:
        """The sampler's multi-turn rollout of ``episodes`` (whole groups of G: the rows not skipped, at positions
        ``ran`` of the batch; ``vision`` each one's VisionPrompt or None) and its statistics."""
        if not episodes:
            # every row skipped on this rank: one token of a placeholder is still sampled, since under FSDP2 the
            # sampler's forwards leave the sharded layers in the state the policy update's collectives expect on
            # every rank; log-probs come back a list, as the sampler's, so that every rank reports alike
            sampler.generate([idle_prompt], 1, dataclasses.replace(params, max_new_tokens=1, sequence_ids=()))
            return Rollout([], [], [], [], []), {}
        runner = EpisodeRunner(episodes, self.tokenizer, self.settings, schemas, params.stop_token_ids, tool_images)
        multi = MultiTurn(runner, self.settings.max_tokens, self.settings.workers)
        if params.sequence_ids and len(ran) < len(params.sequence_ids):  # each sequence keeps its own draws
            params = dataclasses.replace(params, sequence_ids=tuple(params.sequence_ids[i] for i in ran))
        with_images = any(v is not None for v in vision)
        if all(prompt_ids[k] == prompt_ids[k - k % G] and vision[k] is vision[k - k % G]
               for k in range(len(prompt_ids))):  # a row's G share a prompt (and its images)
            return (sampler.generate(prompt_ids[::G], G, params, multi, vision=vision[::G] if with_images else None),
                    sampler.last_stats)
        rollout = sampler.generate(prompt_ids, 1, params, multi, vision=vision if with_images else None)
        return rollout, sampler.last_stats

    def _with_placeholders(self, rollout: Rollout, ran: list[int], prompt_ids: list[list[int]]) -> Rollout:
        """The rollout of every sequence: those in ``ran`` as sampled, each other one a placeholder out of the loss
        (its row's prompt, one filler token of environment mask 0 and log-prob 0)."""
        if len(ran) == len(prompt_ids):
            return rollout
        at = {i: k for k, i in enumerate(ran)}
        filler = next(t for t in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, 0) if t is not None)

        def spliced(values, placeholder):
            return None if values is None else [values[at[i]] if i in at else placeholder()
                                                for i in range(len(prompt_ids))]

        return dataclasses.replace(rollout, prompt_ids=list(prompt_ids),
                                   completion_ids=spliced(rollout.completion_ids, lambda: [filler]),
                                   truncated=spliced(rollout.truncated, lambda: False),
                                   logprobs=spliced(rollout.logprobs, lambda: [0.0]),
                                   env_mask=spliced(rollout.env_mask, lambda: [0]),
                                   completion_images=spliced(rollout.completion_images, list))

    def _prompt_ids(self, prompt, schemas) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        else:
            out = self.tokenizer.apply_chat_template(prompt, tools=schemas, add_generation_prompt=True, tokenize=True)
            ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        return self._checked_length(ids)

    def _checked_length(self, ids: list[int]) -> list[int]:
        """``ids``, an episode's prompt, refused when longer than data.max_prompt_length or empty."""
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
            "agent/messages_truncated": sum(ep.messages_truncated for ep in episodes) / n,
        }
        for reason in BUDGET_STOPS:
            metrics[f"agent/stopped_{reason}"] = sum(ep.truncated == reason for ep in episodes) / n
        return metrics


def _load_tool(ref: str, index: int) -> Callable:
    from ..rewards import RewardLoadError, load_reward_function

    try:
        return load_reward_function(ref)
    except RewardLoadError as e:
        raise ConfigError("config key " + str(e).replace("reward function", f"'tools[{index}]':", 1)) from None
