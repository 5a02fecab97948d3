"""The GRPO loop: rollout → rewards → advantages → log-probs → loss → optimizer step.

One optimizer step (``_step``) reads top to bottom. Every ``num_iterations × steps_per_generation`` steps a new
rollout batch is sampled (steps_per_generation × prompts_per_step prompts × num_generations completions); each
step trains on one step's share of it (whole prompt groups), the steps after the first with the old policy's
log-probs in the importance ratio. Gradients accumulate over micro-batches with the step's
loss weights (see ``longrl.ops.losses``), so the split never changes the loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..agents.episode_images import EpisodeImages
from ..agents.tool_images import ToolImages, loggable
from ..config import Config, ConfigError, RewardSpec, trajectory_tokens
from ..data.prompts import PromptDataset, PromptSampler, is_vision_dataset, load_prompts, read_prompt_rows
from ..training.vision_inputs import PromptImages, check_image_model, is_processor, pick, repeat_groups
from ..memory import count_groups, token_budget_groups
from ..memory.layout import budget_bytes
from ..memory.microbatch import prompt_group_batches
from ..memory.planner import StepShape, reference_placement
from ..models import check_model_files, resolve_device
from ..models.lora_training import fused_lora_training
from ..models.policy import completion_mask, pad_right, reference_mode
from ..models.reference import ReferenceModel
from ..ops.advantages import decoupled_group_advantages, group_advantages
from ..ops.attention_backend import sdpa_priority
from ..ops.losses import PolicyLossSettings, entropy_bonus_weights, high_entropy_mask, loss_token_weights, \
    per_token_policy_loss, weighted_loss
from ..ops.rollout_correction import rollout_correction_weights
from ..rewards import RewardScorer
from ..rollout import Sampler, SamplingParams
from ..rollout.completions import build_sampler, reward_inputs, sample, sampling_params
from ..rollout.hf_generate import check_image_generate
from ..rollout.sampling import logprob_temperature
from ..training.callbacks import check_callbacks, notify
from ..training.checkpoint import SHARDED_OPTIMIZER_DIR, load_newest, save_checkpoint, staging_dir, \
    trainer_state
from ..training.distributed import (data_parallel, full_model_state, full_weights, grad_norm_value, gradient_sync,
                                    init_world, is_sharded, lockstep, rank_prompts, save_sharded_optimizer,
                                    unsupported_with_ranks)
from ..training.evaluation import evaluate, held_out_rows, load_eval_prompts, read_eval_rows
from ..training.guards import RunGuards, agreed, checkpoint_after_step, first_stop, has_learning_signal, \
    step_if_finite
from ..training.model_setup import build_policy_model, given_model
from ..training.optimizer import make_optimizer
from ..training.reporting import RunReporter, check_report_to, reward_failure_lines
from ..training.run_dir import RunDirectory, write_run_settings
from ..training.signals import StopSignals

log = logging.getLogger(__name__)

ENVIRONMENT_REWARD = RewardSpec("longrl.agents.rollout:environment_reward", 1.0)  # the episodes' own step rewards


@dataclass
class RolloutBatch:
    prompts: list  # [P·G] prompts as given (string or chat messages)
    completions: list  # [P·G] decoded completions (string, or [{"role": "assistant", ...}] for chat prompts)
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    rewards: torch.Tensor  # [P·G] weighted total, NaN where a reward function failed
    rewards_per_function: torch.Tensor  # [P·G, F]
    advantages: torch.Tensor  # [P·G]
    mask: torch.Tensor  # [P·G, T] completion tokens that count in the loss
    weights: torch.Tensor  # [P·G, T] loss weights ω of the step
    old_logps: torch.Tensor | None  # [P·G, T] when num_iterations > 1 or steps_per_generation > 1
    ref_logps: torch.Tensor | None  # [P·G, T] when beta > 0
    sampler_logps: torch.Tensor | None  # [P·G, T] the sampler's log-probs of the sampled tokens (longrl backend)
    truncated: torch.Tensor  # [P·G] bool
    num_reward_failures: int
    episodes: list | None = None  # [P·G] agents.trajectory.Episode of multi-turn rollouts
    vision: list | None = None  # [P·G] each completion's prompt's VisionPrompt or None (one object a prompt);
    #                             None: no images in the batch


def _check_image_run(cfg, model) -> None:
    """Refuse, before the model loads, a text model (named by the config, or passed in) and what prompts with images
    do not run with yet."""
    family = check_image_model(cfg, model, "prompts")
    if cfg.generation.backend != "longrl":
        try:
            check_image_generate(family)
        except ValueError as e:
            raise ConfigError(f"config key 'generation.backend': {e}") from None


def _warn_loss_choices(g) -> None:
    """TRL's warnings for loss settings that run but probably are not what was meant."""
    if g.loss_type == "luspo" and g.importance_sampling_level != "sequence":
        log.warning("grpo.loss_type=luspo is meant with grpo.importance_sampling_level=sequence (as in the paper)")
    if g.loss_type == "vespo" and g.importance_sampling_level != "token":
        log.warning("grpo.loss_type=vespo computes its own sequence weights: importance_sampling_level=sequence "
                    "only changes the KL term's ratio")
    if g.multi_objective_aggregation == "normalize_then_sum" and g.scale_rewards != "group":
        log.warning("grpo.scale_rewards=%s does not apply with multi_objective_aggregation=normalize_then_sum "
                    "(each reward function is normalised by its group, the sum by the batch)", g.scale_rewards)


class GRPOTrainer:
    """Build everything from a :class:`Config` (or take a ready model/tokenizer/scorer) and train.

    ``rows`` / ``eval_rows``: training and held-out prompt rows given in memory (else data.source and
    data.eval_source are read). ``environment_factory`` / ``tools``: multi-turn episodes (agents/). TRL's signature,
    ``GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...)``, is longrl.GRPOTrainer's
    (:mod:`longrl.compat.trl`), a thin layer over this class.
    """

    # A run directory that already holds checkpoints is refused at construction unless output.resume; a subclass
    # whose train(resume_from_checkpoint=...) decides (TRL's API) sets this to defer the check to train().
    resume_decided_at_train = False
    # Whether a scorer passed in may gain an environment's reward source (a scorer built by the caller from reward
    # functions, as TRL's API does); a user's own scorer is left as given.
    owns_given_scorer = False

    def __init__(self, cfg: Config, model=None, tokenizer=None, scorer: RewardScorer | None = None, *,
                 rows: list[dict] | None = None, eval_rows: list[dict] | None = None, callbacks=None,
                 environment_factory=None, tools=None):
        if not isinstance(cfg, Config):
            raise TypeError(f"{type(self).__name__}(cfg, ...) takes a longrl Config; got {type(cfg).__name__} (for "
                            "TRL's arguments use longrl.GRPOTrainer)")
        self.callbacks = check_callbacks(callbacks or [])
        self.cfg = cfg
        torch.manual_seed(cfg.train.seed)
        # Cheap checks first: the output directory, reward functions and data fail before the model loads when
        # they can. One process, or a rank of a torchrun job (the step's prompts split across the ranks). Rank 0
        # holds the run lock for the job and finishes what a killed save left before the others look.
        self.world, device = init_world(cfg.model.device, cfg.distributed.timeout_s)
        unsupported_with_ranks(cfg, self.world)
        self.run_dir = RunDirectory(cfg, self.world, resume_decided_at_train=self.resume_decided_at_train)
        check_report_to(cfg.output)
        if model is None:
            check_model_files(cfg.model.name_or_path)
            resolve_device(cfg.model.device)
        own_scorer = scorer is None or self.owns_given_scorer  # ours to add an environment's reward source to
        self.scorer = scorer or RewardScorer.from_specs(cfg.rewards or [ENVIRONMENT_REWARD])  # none: an environment's
        rows = read_prompt_rows(cfg.data, seed=cfg.train.seed, rows=rows)
        self.run_dir.check_data(rows)
        eval_rows = read_eval_rows(cfg) if eval_rows is None else eval_rows
        if cfg.output.eval_steps and eval_rows is None:
            raise ConfigError(f"config key 'output.eval_steps': {cfg.output.eval_steps} needs held-out prompts in "
                              "data.eval_source (or set output.eval_steps=0)")
        from ..agents.rollout import AgentSpec

        agent_spec = AgentSpec.resolve(cfg, environment_factory, tools)  # environment and tools: before the model
        if is_vision_dataset(cfg.data, rows):  # prompts with images: what they cannot run with, before the model
            _check_image_run(cfg, model)
        self._model_source = ("the model passed in" if model is not None else
                              f"config key 'model.name_or_path': {cfg.model.name_or_path}")  # the reference's source
        processor = tokenizer if is_processor(tokenizer) else None  # TRL's processing_class may be a processor
        tokenizer = processor.tokenizer if processor is not None else tokenizer
        if model is not None:
            model, tokenizer = given_model(cfg, model, tokenizer, resolve_device(device),
                                           needed_tokens=(cfg.data.max_prompt_length + cfg.generation.max_completion_length,
                                                          "data.max_prompt_length + generation.max_completion_length"))
        model, tokenizer, self.device, self.layout, self.offloader = build_policy_model(
            cfg, StepShape.grpo(cfg, trajectory_tokens(cfg)), model, tokenizer, device=device,
            world_size=self.world.world_size)
        self.model, self.tokenizer = model, tokenizer
        # a vision-language model's prompt encoder (its processor), None for a text model
        self.images = PromptImages.for_model(model, cfg.model.name_or_path, processor, revision=cfg.model.revision,
                                             trust_remote_code=cfg.model.trust_remote_code)
        self.reference = self._make_reference()  # before FSDP2 shards the weights and any step moves them
        encode_images = self.images.token_ids if self.images is not None else None
        self.data = load_prompts(cfg.data, tokenizer, seed=cfg.train.seed, rows=rows, encode_images=encode_images)
        self.eval_data = (load_eval_prompts(cfg, tokenizer, eval_rows, encode_images=encode_images)
                          if eval_rows is not None else None)
        # micro-batch layout (the same loss either way): on the CPU, attention over one packed row of unequal
        # sequences costs the square of the packed length, so padded rows are faster there
        self.padding_free = cfg.train.padding_free if cfg.train.padding_free is not None else self.device.type == "cuda"
        # grouped rows: each prompt once in the log-prob passes (with its images' features once a group)
        self.shared_prompt = self.layout.shared_prompt
        self.prompt_order = PromptSampler(len(self.data), cfg.train.seed, cfg.data.shuffle)
        # the policy update's forward: the model, or DDP over it (replicated weights: only the adapters are
        # reduced), or FSDP2 shards of it (full weights across several processes)
        self.policy = data_parallel(model, self.world, shard_weights=self.world.distributed and not cfg.lora.enabled)
        self.sampler = self._make_rollout_sampler()  # None: transformers' generate
        self.agents = self._make_agents(agent_spec, own_scorer)
        self.params, self.optimizer, self.scheduler = make_optimizer(model, cfg.train)
        g = cfg.grpo
        self.loss_settings = PolicyLossSettings(**{f: getattr(g, f) for f in PolicyLossSettings.__dataclass_fields__})
        _warn_loss_choices(g)
        self.step_idx = 0
        self.batch: RolloutBatch | None = None
        self.phase_stats: dict[str, float] = {}
        self.output_dir = Path(cfg.output.output_dir)

    # ------------------------------------------------------------------------------------------ the loop
    def train(self, resume_from_checkpoint: bool | str | None = None) -> list[dict]:
        """Train to train.max_steps; return each step's metrics. ``resume_from_checkpoint`` (TRL's name): True, or
        the path of output_dir's latest checkpoint, resumes from it (as output.resume=true)."""
        cfg = self.cfg
        resume_from = self.run_dir.start_training(resume_from_checkpoint)
        if resume_from is not None:
            self._resume(resume_from)
        self.model.train()
        main = self.world.is_main  # rank 0 writes every output; the others compute and reduce
        reporter = RunReporter.for_config(cfg, resume_step=self.step_idx) if main else None
        self._reporter = reporter  # the first step's phases say when they start (_phase)
        if main:
            write_run_settings(self.output_dir, cfg, self.layout)
        notify(self.callbacks, "on_train_begin", self)
        history = []
        finished = False
        guards = RunGuards(cfg)
        stop = None  # (message, exit code) once a signal or a guard asks the run to stop
        try:
            with sdpa_priority(cfg.model.sdpa_backends, self.device.type, self.model,
                               cfg.model.grouped_attention_backward), StopSignals() as signals:
                while self.step_idx < cfg.train.max_steps:
                    per_rollout = cfg.grpo.num_iterations * cfg.grpo.steps_per_generation
                    new_batch = self.step_idx % per_rollout == 0
                    metrics = self._step()
                    nonfinite = metrics.pop("nonfinite")  # the terms that were not finite: for the guards
                    every = cfg.output.eval_steps
                    if every and (self.step_idx % every == 0 or self.step_idx == cfg.train.max_steps):
                        eval_start = time.perf_counter()
                        metrics.update(self.evaluate().metrics, eval_time_s=time.perf_counter() - eval_start)
                    history.append(metrics)
                    if main:
                        reporter.log_step(metrics)
                    notify(self.callbacks, "on_step_end", self.step_idx, metrics)
                    if main and cfg.output.log_completions and (self.step_idx % cfg.output.logging_steps == 0
                                                                or self.step_idx == 1):
                        reporter.log_completions(self.step_idx, self._completion_samples(cfg.output.log_completions))
                    # every rank takes the same decisions: a signal, a guard, a save by the clock of any rank
                    received, save_due, signal = agreed(self.world, signals.received, guards.save_due(self.step_idx),
                                                        new_batch and has_learning_signal(self.batch.advantages,
                                                                                          self.batch.mask))
                    reason = guards.after_step(self.step_idx, nonfinite, signal if new_batch else None)
                    stop = first_stop(stop, received, reason)
                    if self.step_idx % per_rollout:  # checkpoints fall between rollout batches
                        continue
                    checkpoint_after_step(self.save, cfg, self.output_dir, guards, self.step_idx, stop, save_due,
                                          "train", on_saved=reporter.plot if main else None)
            finished = True
        finally:
            if main:
                reporter.close(finished)
                self.run_dir.release()
        notify(self.callbacks, "on_train_end", history)
        return history

    def evaluate(self, eval_dataset=None):
        """Mean reward and pass@k on ``eval_dataset`` with the current weights: a
        :class:`longrl.training.evaluation.EvalResult`. ``eval_dataset``: a :class:`longrl.data.prompts.PromptDataset`, or as TRL's, a
        ``datasets.Dataset``, a list of dicts or a path; default: the trainer's eval_dataset, or data.eval_source's."""
        data = eval_dataset if eval_dataset is not None else self.eval_data
        if data is not None and not isinstance(data, PromptDataset):
            rows, source = held_out_rows(self.cfg, data)
            data = load_eval_prompts(self.cfg, self.tokenizer, rows, source,
                                     encode_images=self.images.token_ids if self.images is not None else None)
        if data is None:
            raise ConfigError("config key 'data.eval_source': no held-out prompts to evaluate on")
        o = self.cfg.output
        with full_weights(self.policy):
            return evaluate(self.model, self.tokenizer, self.scorer, data, self.cfg.generation,
                            num_generations=o.eval_num_generations, pass_threshold=o.eval_pass_threshold,
                            sampler=self.sampler, device=self.device, images=self.images)

    def save_model(self, output_dir: str | Path | None = None, format: str | None = None) -> Path:
        """The model as it is now, through ``longrl export``: a PEFT adapter (LoRA runs) or a merged model (full
        weights, or ``format="merged"``), or ``format="gguf"`` (:func:`longrl.export.save_trained_model`)."""
        from ..export import save_trained_model

        return save_trained_model(self, output_dir, format)

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Time a phase of the step (and its peak GPU memory on CUDA) into ``self.phase_stats``."""
        if getattr(self, "_reporter", None) is not None:
            self._reporter.phase_started(self.step_idx + 1, name, self.cfg)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize(self.device)
            self.phase_stats[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.phase_stats[f"{name}_time_s"] = time.perf_counter() - start
        log.debug("step %d %s: %.2f s", self.step_idx + 1, name, self.phase_stats[f"{name}_time_s"])

    def _step(self) -> dict:
        start = time.perf_counter()
        rollout_s = 0.0
        self.phase_stats = {}
        g = self.cfg.grpo
        local_step = self.step_idx % (g.num_iterations * g.steps_per_generation)
        if local_step == 0:
            self.batch = self._rollout_batch()
            rollout_s = time.perf_counter() - start
        share = len(self.batch.prompt_ids) // g.steps_per_generation  # completions of one step
        rows = list(range((local_step % g.steps_per_generation) * share, (local_step % g.steps_per_generation + 1) * share))
        with self._phase("update"):
            stats = self._policy_update(self.batch, rows)
        self.step_idx += 1
        timing = {"rollout_time_s": rollout_s, "step_time_s": time.perf_counter() - start,
                  **self.phase_stats}  # <phase>_time_s and <phase>_peak_gib of generation, rewards, reference, update
        return {"step": self.step_idx, **self._batch_metrics(self.batch), **stats,
                "lr": self.scheduler.get_last_lr()[0], **self._slowest(timing)}

    # ------------------------------------------------------------------------------------------ phases
    def generate_batch(self) -> RolloutBatch:
        """One step's rollouts as :meth:`train` makes them (generation, rewards, advantages, and the old-policy and
        reference log-probs the config needs), not trained on: it draws the next prompts, as a step would. The
        phases' seconds and peak GPU memory are in ``phase_stats`` (``generation_time_s``, ``rewards_time_s``,
        ``reference_time_s``, ...)."""
        self.phase_stats = {}
        return self._rollout_batch()

    def train_on_batch(self, batch: RolloutBatch) -> dict:
        """One optimizer step on every completion of ``batch`` (made by :meth:`generate_batch`, or by hand, e.g.
        fixed completions for a benchmark): the reference pass first when ``grpo.beta`` ≠ 0 and ``batch`` has no
        ``ref_logps``, then the policy update. Returns the update's statistics (loss, kl, grad_norm, ...); the
        phases' seconds and peaks are in ``phase_stats`` (``reference_*``, ``update_*``). The step counter and
        the prompt sampler stay where they are."""
        self.phase_stats = {}
        if self.cfg.grpo.beta != 0.0 and batch.ref_logps is None:
            with self._phase("reference"):
                batch.ref_logps = self._reference_logps(batch.prompt_ids, batch.completion_ids, batch.mask.shape[1],
                                                        batch.vision)
        with self._phase("update"):
            return self._policy_update(batch)

    def _make_reference(self) -> ReferenceModel | None:
        """The frozen copy of the initial weights that full-weight runs with grpo.beta ≠ 0 keep as their KL reference,
        where the plan (or grpo.reference_placement) puts it; None otherwise (LoRA: the base, adapters disabled). Each
        rank of a data-parallel job keeps its own, whole (FSDP2 shards only the policy)."""
        placement = reference_placement(self.cfg, self.layout.plan)
        if placement is None:
            return None
        reference = ReferenceModel(self.model, placement)
        log.info("KL reference: a frozen copy of the initial weights (%s)", placement)
        return reference

    def _reference_logps(self, prompt_ids, completion_ids, width: int, vision=None) -> torch.Tensor | None:
        """[P·G, T] log-probs of the reference policy when grpo.beta ≠ 0, else None: the frozen copy of the initial
        weights (full weights), or the base with the adapters disabled (LoRA)."""
        if self.cfg.grpo.beta == 0.0:
            return None
        if self.reference is not None:  # a rank's own forwards: no collective inside, no lockstep needed
            return self.reference.logprobs(prompt_ids, completion_ids, width,
                                           self._micro_batches(prompt_ids, completion_ids, vision),
                                           pad_id=self.tokenizer.pad_token_id,
                                           temperature=logprob_temperature(self.cfg.generation.temperature),
                                           chunk_size=self.cfg.train.logprob_chunk_size, packed=self.padding_free,
                                           shared_prompt=self.shared_prompt, vision=vision)
        with reference_mode(self.model):
            return self._logprobs(prompt_ids, completion_ids, width, vision=vision)

    def _rollout_batch(self) -> RolloutBatch:
        cfg, G = self.cfg, self.cfg.grpo.num_generations
        drawn = self.prompt_order.next(cfg.train.prompts_per_step * cfg.grpo.steps_per_generation)  # global
        # this rank's prompts (whole groups) of every optimizer step of the batch, and their global sequence ids
        mine = rank_prompts(cfg.train.prompts_per_step, cfg.grpo.steps_per_generation, self.world.rank,
                            self.world.world_size)
        rows_idx = [drawn[p] for p in mine]
        params = self._sampling_params(tuple(p * G + k for p in mine for k in range(G)))
        rows = [self.data.rows[i] for i in rows_idx]
        prompt_ids = [self.data.prompt_ids[i] for i in rows_idx]
        agent = None
        with self._phase("generation"), full_weights(self.policy):
            if self.agents is not None:  # multi-turn episodes (agents/rollout.py), each opening with its row's images
                sources = self.images.sources(self.data, rows_idx) if self.images is not None else None
                agent = self.agents.generate(self.sampler, rows, G, params,
                                             EpisodeImages(self.images, sources) if sources is not None else None,
                                             ToolImages(self.images, cfg.data.max_image_pixels)
                                             if self.images is not None else None)
                rollout, vision = agent.rollout, agent.vision  # [P·G]
            else:
                vision = self.images.prompts(self.data, rows_idx) if self.images is not None else None  # [P]
                rollout = sample(self.model, self.tokenizer, prompt_ids, G, cfg.generation, params,
                                 self.sampler, self.device, vision=vision)
                vision = repeat_groups(vision, G)  # [P·G]: a completion's prompt's (the same object for the group)
        if self.sampler is not None and self.sampler.last_stats:  # the rollout's fixed host costs, apart from its
            # decoding: its CUDA-graph captures (each call captures its own; with each its eager warm-up step, where
            # a process's first use compiles the decode kernels) and the model set up for it and undone
            stats = self.sampler.last_stats
            self.phase_stats["generation_capture_time_s"] = float(stats.get("graph_capture_s", 0.0))
            self.phase_stats["generation_setup_time_s"] = float(stats["prepare_s"] + stats["release_s"])
        if self.sampler is not None and self.sampler.speculative:  # verify steps, drafts, accepted (the sampler's)
            self.phase_stats.update({f"speculative/{k[5:]}": float(v) for k, v in self.sampler.last_stats.items()
                                     if k.startswith("spec_")})
        prompts, completions, columns = reward_inputs(rows, self.data.prompt_column, G, self.tokenizer, rollout)
        if agent is not None:  # the prompts the episodes opened with, their trajectories as messages with roles
            prompts, completions = agent.prompts, agent.completions
            columns.update(agent.columns)  # turn_rewards, environments, stop_reason
            self.phase_stats.update(agent.metrics)
        with self._phase("rewards"):  # (an agent batch's skipped rows are shown to no reward function)
            per_function, rewards, failures = (self.scorer.score(prompts, completions, columns) if agent is None
                                               else agent.score(self.scorer, prompts, completions, columns))
        for line in reward_failure_lines(self.step_idx + 1, failures, len(completions)):
            log.warning(line)
        if cfg.grpo.multi_objective_aggregation == "normalize_then_sum":
            weights_f = torch.tensor([w for _, _, w in self.scorer.functions], dtype=torch.float32)
            advantages = decoupled_group_advantages(per_function, weights_f, G, invalid=torch.isnan(rewards),
                                                    all_sum=self.world.all_sum)
        else:
            advantages = group_advantages(rewards, G, cfg.grpo.scale_rewards, all_sum=self.world.all_sum)
        width = max(len(c) for c in rollout.completion_ids)
        mask = completion_mask(rollout.completion_ids, width)  # [P·G, T]
        if rollout.env_mask is not None:  # environment tokens: attended, not trained
            mask *= pad_right(rollout.env_mask, 0, width, dtype=torch.float32)
        truncated = torch.tensor(rollout.truncated)
        mask[torch.isnan(rewards)] = 0.0  # no learning signal for samples whose reward failed
        if cfg.grpo.mask_truncated_completions:
            mask[truncated] = 0.0
        weights = loss_token_weights(mask, cfg.grpo.loss_type, trajectory_tokens(cfg), cfg.grpo.steps_per_generation,
                                     all_sum=self.world.all_sum)  # normalised over the global step
        with self._phase("reference"):  # old-policy and reference log-probs (no grad)
            old_logps = None
            if cfg.grpo.num_iterations > 1 or cfg.grpo.steps_per_generation > 1:
                with self._policy_forward():  # the update's own forward: the first iteration's ratio is exactly 1
                    old_logps = self._logprobs(rollout.prompt_ids, rollout.completion_ids, width, vision=vision)
            ref_logps = self._reference_logps(rollout.prompt_ids, rollout.completion_ids, width, vision)
        sampler_logps = (pad_right(rollout.logprobs, 0.0, width, dtype=torch.float32)
                         if rollout.logprobs is not None else None)
        return RolloutBatch(prompts=prompts, completions=completions, prompt_ids=rollout.prompt_ids,
                            completion_ids=rollout.completion_ids, rewards=rewards, rewards_per_function=per_function,
                            advantages=advantages, mask=mask, weights=weights, old_logps=old_logps,
                            ref_logps=ref_logps, sampler_logps=sampler_logps, truncated=truncated,
                            num_reward_failures=len(failures), episodes=agent.episodes if agent is not None else None,
                            vision=vision)

    def _make_rollout_sampler(self) -> Sampler | None:
        """longrl's sampler unless the config asks for transformers' generate or the model needs it: the builder
        `longrl generate` and `longrl eval` use too, so every generation.* key acts the same everywhere."""
        return build_sampler(self.model, self.tokenizer, self.cfg.generation,
                             max_length=self.cfg.data.max_prompt_length + trajectory_tokens(self.cfg),
                             memory_cap_bytes=budget_bytes(self.cfg),
                             pack_projections=not is_sharded(self.policy))  # FSDP2's unsharded weights stay put

    def _make_agents(self, spec, own_scorer: bool):
        """Multi-turn episodes when the config or the API names an environment or tools (``spec``, else None); an
        environment that scores its episodes (its step rewards, TRL's get_reward) becomes a reward source."""
        from ..agents.rollout import AgentRollouts, environment_reward

        agents = None if spec is None else AgentRollouts.from_config(self.cfg, self.tokenizer, spec,
                                                                     self.world.sum_floats)
        if agents is None:
            if own_scorer and self.scorer.names == ["environment_reward"]:
                raise ConfigError("config key 'rewards': at least one reward function (or an environment that "
                                  "scores its episodes)")
            return None
        if self.sampler is None:
            raise ConfigError("multi-turn episodes (environment.factory, tools) run inside longrl's sampler, which "
                              "cannot run this model (see the warning above)")
        if own_scorer and agents.owns_reward and "environment_reward" not in self.scorer.names:
            # as in TRL, an environment's get_reward is one more reward source (weight 1)
            self.scorer.functions.append(("environment_reward", environment_reward, 1.0))
        return agents

    def _sampling_params(self, sequence_ids: tuple[int, ...] = ()) -> SamplingParams:
        params = sampling_params(self.cfg.generation, self.tokenizer, seed=self.cfg.train.seed * 1_000_003 + self.step_idx)
        return dataclasses.replace(params, sequence_ids=sequence_ids)  # a rank's sequences' global ids

    def _micro_batches(self, prompt_ids, completion_ids, vision=None) -> list[list[int]]:
        """Micro-batches (sequence indices); ``vision``: per sequence its prompt's VisionPrompt or None."""
        t = self.cfg.train
        if self.shared_prompt:  # a prompt's completions together (cut only where they exceed the token budget)
            return prompt_group_batches(prompt_ids, [len(c) for c in completion_ids], self.layout.micro_batch_tokens,
                                        t.micro_batch_size, keys=vision)
        if self.layout.micro_batch_tokens > 0:
            return token_budget_groups([len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)],
                                       self.layout.micro_batch_tokens)
        return count_groups(len(prompt_ids), t.micro_batch_size)

    @torch.no_grad()
    def _logprobs(self, prompt_ids, completion_ids, width, with_entropy: bool = False, vision=None):
        """Log-probs [N, T] of the completions (and their entropies [N, T] with ``with_entropy``), no grad;
        ``vision``: per sequence its prompt's VisionPrompt or None."""
        out = torch.zeros(len(prompt_ids), width)
        ent = torch.zeros(len(prompt_ids), width) if with_entropy else None
        for idx, counts in lockstep(self.policy, self.world, self._micro_batches(prompt_ids, completion_ids, vision)):
            lp, e = self.policy([prompt_ids[i] for i in idx], [completion_ids[i] for i in idx], width,
                                pad_id=self.tokenizer.pad_token_id,
                                temperature=logprob_temperature(self.cfg.generation.temperature),
                                chunk_size=self.cfg.train.logprob_chunk_size, packed=self.padding_free,
                                with_entropy=with_entropy, shared_prompt=self.shared_prompt, vision=pick(vision, idx))
            if not counts:  # (FSDP2: a forward every rank runs, see lockstep)
                continue
            out[idx] = lp.cpu().to(out.dtype)  # kept in float32 whatever the model computes in
            if with_entropy:
                ent[idx] = e.float().cpu()
        return (out, ent) if with_entropy else out

    def _policy_forward(self):
        """The policy's forward for its log-probs: with ``lora.fused_training`` on CUDA, the fused LoRA."""
        fused = self.cfg.lora.fused_training and self.device.type == "cuda"
        return fused_lora_training(self.model) if fused else contextlib.nullcontext()

    def _step_entropy_terms(self, b: RolloutBatch, rows: list[int]):
        """Whole-step statistics the micro-batches share (before any of them runs): the high-entropy token mask
        [R, T] (top_entropy_quantile < 1, from a no-grad pass with this step's weights) or None, and the entropy
        bonus weights [R, T] (entropy_coef != 0) or None."""
        g, mask = self.cfg.grpo, b.mask[rows]
        keep = None
        if g.top_entropy_quantile < 1.0:
            with self._policy_forward():
                _, entropy = self._logprobs([b.prompt_ids[i] for i in rows], [b.completion_ids[i] for i in rows],
                                            mask.shape[1], with_entropy=True, vision=pick(b.vision, rows))
            keep = high_entropy_mask(entropy, mask, g.top_entropy_quantile,  # over every rank's tokens
                                     all_gather=self.world.all_gather_cat).to(mask.dtype)
        bonus = None
        if g.entropy_coef != 0.0:
            bonus = g.entropy_coef * entropy_bonus_weights(mask if keep is None else mask * keep,
                                                           all_sum=self.world.all_sum)
        return keep, bonus

    def _policy_update(self, b: RolloutBatch, rows: list[int] | None = None) -> dict:
        """One optimizer step on the completions ``rows`` of the rollout batch ``b`` (None: all of them): Σ ω ℓ over
        the micro-batches (and ranks), then clip and step."""
        rows = list(range(len(b.prompt_ids))) if rows is None else rows
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}  # per-token statistics summed over this rank's tokens (loss: Σ ω ℓ)
        keep, bonus = self._step_entropy_terms(b, rows)  # [R, T] each, or None
        prompt_ids, completion_ids = [b.prompt_ids[i] for i in rows], [b.completion_ids[i] for i in rows]
        batches = self._micro_batches(prompt_ids, completion_ids, pick(b.vision, rows))
        rounds = lockstep(self.policy, self.world, batches)
        with self._policy_forward():  # forwards and backwards inside the context
            for k, (local, counts) in enumerate(rounds):
                # gradients summed across ranks (ω is normalised globally); DDP reduces at the last one only
                with gradient_sync(self.policy, last=k == len(rounds) - 1):
                    loss, stats = self._micro_batch_loss(b, rows, local, keep, bonus)
                    (loss if counts else loss * 0.0).backward()
                if not counts:
                    continue
                for name, value in {"loss": float(loss.detach()), **stats}.items():
                    sums[name] = sums.get(name, 0.0) + value
        clip = self.cfg.train.max_grad_norm if self.cfg.train.max_grad_norm > 0 else float("inf")
        grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(self.params, clip))  # the same on every rank
        tokens = {"tokens": float(b.mask[rows].sum())}
        if keep is not None:
            tokens["high_entropy"] = float((keep * b.mask[rows]).sum())
        sums = self.world.sum_floats({**sums, **tokens})  # over every rank: every rank decides alike below
        # no update from a non-finite step (the guard counts it; the schedule still advances)
        nonfinite = step_if_finite(self.optimizer, self.step_idx + 1, sums["loss"], grad_norm)
        self.scheduler.step()
        denom = max(sums.pop("tokens"), 1.0)
        per_token = {k: v / denom for k, v in sums.items() if k != "loss"}  # token means of the global step
        out = {"loss": sums["loss"], "kl": per_token.pop("kl") if b.ref_logps is not None else None,
               "clip_ratio": per_token.pop("clip_ratio"), "entropy": per_token.pop("entropy"), "grad_norm": grad_norm,
               "skipped_nonfinite": int(bool(nonfinite)), "nonfinite": nonfinite}
        masked = per_token.pop("off_policy_masked")
        if self.cfg.grpo.off_policy_mask_threshold is not None:
            out["off_policy_masked_ratio"] = masked
        if keep is not None:
            out["high_entropy_ratio"] = per_token.pop("high_entropy")
        per_token.pop("kl", None)
        return {**out, **per_token}  # + the sampler/... correction statistics

    def _micro_batch_loss(self, b: RolloutBatch, rows: list[int], local: list[int], keep, bonus):
        """(Σ ω ℓ over the micro-batch ``local`` (positions in ``rows``), its per-token statistics summed over its
        tokens)."""
        cfg, dev = self.cfg, self.device
        idx = [rows[i] for i in local]  # rows of the rollout batch
        logps, entropy = self.policy([b.prompt_ids[i] for i in idx], [b.completion_ids[i] for i in idx],
                                     b.mask.shape[1], pad_id=self.tokenizer.pad_token_id,
                                     temperature=logprob_temperature(cfg.generation.temperature),
                                     chunk_size=cfg.train.logprob_chunk_size, with_entropy=True,
                                     packed=self.padding_free, shared_prompt=self.shared_prompt,
                                     vision=pick(b.vision, idx))
        mask = b.mask[idx].to(dev)
        old = b.old_logps[idx].to(dev) if b.old_logps is not None else logps.detach()
        ref = b.ref_logps[idx].to(dev) if b.ref_logps is not None else None
        is_weights, stats = None, {}
        if b.sampler_logps is not None and cfg.grpo.rollout_correction != "none":
            is_weights, correction = rollout_correction_weights(old, b.sampler_logps[idx].to(dev), mask,
                                                                cfg.grpo.rollout_correction,
                                                                cfg.grpo.rollout_correction_cap)
            n = float(mask.sum())
            stats.update({k: n * v for k, v in correction.items()})  # token means → sums
        sampled = b.sampler_logps[idx].to(dev) if b.sampler_logps is not None else None
        per_token, diag = per_token_policy_loss(logps, old, ref, b.advantages[idx].to(dev), mask, self.loss_settings,
                                                is_weights, keep[local].to(dev) if keep is not None else None, sampled)
        loss = weighted_loss(per_token, b.weights[idx].to(dev))
        if bonus is not None:  # the entropy bonus: − entropy_coef × the step's mean entropy
            loss = loss - weighted_loss(entropy, bonus[local].to(dev))
        stats["clip_ratio"] = float((diag["clipped"] * mask).sum())
        stats["entropy"] = float((entropy.detach() * mask).sum())
        stats["kl"] = float((diag["kl"] * mask).sum()) if "kl" in diag else 0.0
        stats["off_policy_masked"] = (float((diag["off_policy_masked"] * mask).sum())
                                      if "off_policy_masked" in diag else 0.0)
        return loss, stats

    def _batch_metrics(self, b: RolloutBatch) -> dict:
        """Reward and completion statistics of the global batch (sums and counts over every rank)."""
        r = b.rewards.double()  # [n]
        ok = ~torch.isnan(r)
        groups = torch.nan_to_num(r, nan=0.0).view(-1, self.cfg.grpo.num_generations)  # [P, G]
        local = {"n": len(r), "ok": ok.sum(), "reward": r[ok].sum(), "failures": b.num_reward_failures,
                 "length": sum(len(c) for c in b.completion_ids), "truncated": b.truncated.sum(),
                 "groups": groups.shape[0], "zero_std": (groups.amax(-1) == groups.amin(-1)).sum()}
        for j, name in enumerate(self.scorer.names):
            column = b.rewards_per_function[:, j].double()
            local[f"ok/{name}"], local[f"rewards/{name}"] = (~torch.isnan(column)).sum(), torch.nansum(column)
        t = self.world.sum_floats(local)
        mean = t["reward"] / t["ok"] if t["ok"] else float("nan")
        sq = self.world.sum_floats({"sq": ((r[ok] - mean) ** 2).sum()})["sq"]  # second pass: the std
        return {"reward": mean, "reward_std": math.sqrt(sq / (t["ok"] - 1)) if t["ok"] > 1 else 0.0,
                **{f"rewards/{n}": t[f"rewards/{n}"] / t[f"ok/{n}"] if t[f"ok/{n}"] else float("nan")
                   for n in self.scorer.names},
                "completion_length": t["length"] / t["n"], "truncated_ratio": t["truncated"] / t["n"],
                "reward_failures": int(t["failures"]), "frac_reward_zero_std": t["zero_std"] / t["groups"]}

    def _slowest(self, timing: dict[str, float]) -> dict[str, float]:
        """Times and GPU peaks of the step: the slowest rank's times, the largest peaks (and each rank's peak)."""
        out = self.world.max_floats(timing)
        if self.world.world_size > 1:
            for key in [k for k in timing if k.endswith("_peak_gib")]:
                out.update({f"{key}/rank{r}": v for r, v in enumerate(self.world.gather_floats(timing[key]))})
        return out

    # ------------------------------------------------------------------------------------------ helpers
    def _completion_samples(self, k: int) -> list[dict]:
        b = self.batch
        episode = (lambda i: {"turn_rewards": b.episodes[i].turn_rewards, "stop_reason": b.episodes[i].truncated
                              or "done"}) if b.episodes else (lambda i: {})
        return [{"prompt": loggable(b.prompts[i]), "completion": loggable(b.completions[i]),
                 "reward": None if math.isnan(float(b.rewards[i])) else float(b.rewards[i]), **episode(i)}
                for i in range(min(k, len(b.prompts)))]

    def save(self) -> Path | None:
        """Write checkpoint-STEP (rank 0: the state is replicated; under FSDP2 every rank its optimizer shards) and
        return its path (None on other ranks); every rank returns once it is complete."""
        state, frozen = trainer_state(self.model, self.cfg, self.prompt_order.position,
                                      data_fingerprint=self.run_dir.data_fingerprint, world_size=self.world.world_size,
                                      reward_files=self.run_dir.reward_files,
                                      **({} if self.reference is None else {"kl_reference": self.reference.state()}))
        model_state, staged = None, None
        if is_sharded(self.policy):  # every rank: the full weights gathered on rank 0, its optimizer shards (DCP)
            model_state = full_model_state(self.model)
            staged = Path(self.world.broadcast_text(str(staging_dir(self.output_dir, self.step_idx))))
            save_sharded_optimizer(self.model, self.optimizer, staged / SHARDED_OPTIMIZER_DIR)
        path = None
        if self.world.is_main:  # the rest once (replicated), the trainer state last: then it counts as complete
            path = save_checkpoint(self.output_dir, self.step_idx, self.model,
                                   None if staged else self.optimizer, self.scheduler, state,
                                   self.cfg.output.save_total_limit, base_weights=frozen, model_state=model_state,
                                   staged=staged)
            log.info("saved %s", path)
            notify(self.callbacks, "on_save", path)
        self.world.barrier()
        return path

    def _resume(self, candidates: list[Path]) -> None:
        loaded = load_newest(candidates, self.output_dir, self.model, self.optimizer, self.scheduler)
        if loaded is not None and self.reference is not None:  # rebuilt from the model as loaded at the start
            self.reference.check_resumed(loaded[1].get("kl_reference"), self._model_source)
        if loaded is not None:
            self.step_idx, self.prompt_order.position = loaded[1]["step"], loaded[1]["data_position"]
