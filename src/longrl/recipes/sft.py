"""Supervised fine-tuning: the cross-entropy of the trained tokens, on GRPO's memory machinery.

One optimizer step reads ``sft.examples_per_step`` examples (``longrl.data.sft_rows``), splits them into micro-batches
(``train.micro_batch_tokens`` packed without padding, else ``train.micro_batch_size`` examples) and accumulates

    loss = Σ_{trained tokens t of the step} CE_t / N_step

so the loss is the mean over the step's trained tokens however the step is split. CE_t comes from the
backbone's hidden states and the LM head in chunks (``longrl.ops.cross_entropy``: no tokens × vocab tensor),
with optional label smoothing. Held-out loss and perplexity exp(mean CE) every ``output.eval_steps`` (and at
the end) on ``data.eval_source`` or, without one, on the last ``sft.eval_examples`` rows held out.

A vision dataset (rows with images) is encoded by the vision-language model's processor
(``longrl.training.vision_examples``); each step makes the image tensors of the examples it draws.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from ..config import Config, ConfigError
from ..data.in_memory import dataset_rows
from ..data.prompts import PromptSampler
from ..data.sft_rows import SFTExample, build_examples, check_rows, has_images, image_rows, read_sft_rows
from ..memory import count_groups, token_budget_groups
from ..memory.planner import StepShape
from ..models import check_model_files, resolve_device
from ..ops.attention_backend import sdpa_priority
from ..training.callbacks import check_callbacks, notify
from ..training.checkpoint import load_newest, save_checkpoint, trainer_state
from ..training.distributed import CrossEntropyModule, data_parallel, gradient_sync, init_world, shard
from ..training.guards import RunGuards, agreed, checkpoint_after_step, first_stop, step_if_finite
from ..training.model_setup import build_policy_model, given_model
from ..training.optimizer import make_optimizer
from ..training.reporting import RunReporter
from ..training.run_dir import RunDirectory, write_run_settings
from ..training.signals import StopSignals
from ..training.vision_examples import example_prompts, vision_examples
from ..training.vision_inputs import PromptImages, check_image_model, is_processor, pick

log = logging.getLogger(__name__)


def _micro_batches(examples: list[SFTExample], micro_batch_tokens: int, micro_batch_size: int) -> list[list[int]]:
    if micro_batch_tokens > 0:
        return token_budget_groups([len(e.input_ids) for e in examples], micro_batch_tokens)
    return count_groups(len(examples), micro_batch_size)


def step_loss(model, examples: list[SFTExample], groups: list[list[int]], *, pad_id: int, label_smoothing: float,
              chunk_size: int, packed: bool, backward: bool, n_total: int | None = None,
              forward: torch.nn.Module | None = None, vision: list | None = None) -> tuple[float, int]:
    """(Σ CE / N, N) over ``examples`` split into ``groups``; with ``backward`` each group's share is
    back-propagated as it is computed (gradients accumulate; the sum is the whole step's mean). ``n_total``: N
    when ``examples`` are one rank's share of the step (the trained tokens of every rank), else theirs.
    ``forward``: the module computing a micro-batch's cross-entropies (``distributed.data_parallel``'s, whose DDP
    sums the gradients over ranks at the last micro-batch); default: ``token_cross_entropy`` on ``model``.
    ``vision``: per example its VisionPrompt (training/vision_examples.py) or None; None: no images."""
    n_tokens = sum(sum(e.loss_mask) for e in examples) if n_total is None else n_total
    forward = CrossEntropyModule(model) if forward is None else forward
    total = 0.0
    for k, idx in enumerate(groups):
        mb = [examples[i] for i in idx]
        with gradient_sync(forward, last=k == len(groups) - 1):
            ce = forward([e.input_ids for e in mb], [e.loss_mask for e in mb], pad_id=pad_id,
                         label_smoothing=label_smoothing, chunk_size=chunk_size, packed=packed,
                         vision=pick(vision, idx))  # [n_mb]
            loss = ce.sum() / max(n_tokens, 1)
            if backward:
                loss.backward()
        total += float(loss.detach())
    return total, n_tokens


class SFTTrainer:
    """Supervised fine-tuning from a :class:`Config` (its ``sft:`` section and ``data.source``), or from a ready
    model/tokenizer and rows in memory (``train_rows`` / ``eval_rows``). TRL's signature,
    ``SFTTrainer(model=..., args=SFTConfig(...), train_dataset=..., ...)``, is longrl.SFTTrainer's
    (:mod:`longrl.compat.trl`), a thin layer over this class.
    """

    resume_decided_at_train = False  # as GRPOTrainer's: TRL's API defers the resume check to train()

    def __init__(self, cfg: Config, model=None, tokenizer=None, train_rows: list[dict] | None = None,
                 eval_rows: list[dict] | None = None, *, callbacks=None):
        if not isinstance(cfg, Config):
            raise TypeError(f"{type(self).__name__}(cfg, ...) takes a longrl Config; got {type(cfg).__name__} (for "
                            "TRL's arguments use longrl.SFTTrainer)")
        self.callbacks = check_callbacks(callbacks or [])
        self.cfg = cfg
        torch.manual_seed(cfg.train.seed)
        # one process, or a rank of a torchrun job (the step's examples split across the ranks); rank 0 holds the
        # run lock and writes every output
        self.world, device = init_world(cfg.model.device, cfg.distributed.timeout_s)
        if self.world.world_size > cfg.sft.examples_per_step:
            raise ConfigError(f"config key 'sft.examples_per_step': got {cfg.sft.examples_per_step}; allowed: at "
                              f"least the number of processes ({self.world.world_size}): each trains whole examples")
        self.run_dir = RunDirectory(cfg, self.world, kind="sft", command="sft",
                                    resume_decided_at_train=self.resume_decided_at_train)
        s = cfg.sft
        # the rows are read and checked (all that needs no tokenizer) before the model loads
        train_name = "train_dataset" if train_rows is not None else cfg.data.source
        train_rows = (check_rows(train_rows, s, train_name, cfg.data.max_image_pixels) if train_rows is not None
                      else read_sft_rows(cfg.data, s, seed=cfg.train.seed))
        eval_source = getattr(cfg.data, "eval_source", None)
        eval_name = "eval_dataset" if eval_rows is not None else eval_source
        if eval_rows is not None:
            check_rows(eval_rows, s, eval_name, cfg.data.max_image_pixels)
        elif eval_source:
            eval_rows = read_sft_rows(cfg.data, s, seed=cfg.train.seed, source=eval_source)
        self.run_dir.check_data(train_rows)  # a dataset file, and the image files its rows name
        if any(isinstance(row, dict) and has_images(row) for row in train_rows + (eval_rows or [])):
            check_image_model(cfg, model, "examples")  # before the weights load
        processor = tokenizer if is_processor(tokenizer) else None  # TRL's processing_class may be a processor
        tokenizer = processor.tokenizer if processor is not None else tokenizer
        if model is None:
            check_model_files(cfg.model.name_or_path)
        else:
            model, tokenizer = given_model(cfg, model, tokenizer, resolve_device(device),
                                           needed_tokens=(cfg.sft.max_length, "sft.max_length"))
        self.model, self.tokenizer, self.device, self.layout, self.offloader = build_policy_model(
            cfg, StepShape.sft(cfg), model, tokenizer, device=device)
        self._processor = processor
        self.images: PromptImages | None = None  # a vision-language model's processor, once a dataset has images
        examples = self._examples(train_rows, train_name)
        if eval_rows is not None:
            self.eval_examples = self._examples(eval_rows, eval_name)
        elif s.eval_examples and len(examples) >= 10:
            held = min(s.eval_examples, len(examples) // 10)
            examples, self.eval_examples = examples[:-held], examples[-held:]
            log.info("held out the last %d examples for evaluation (no data.eval_source)", held)
        else:
            self.eval_examples = []
        self.examples = examples
        self.max_steps = cfg.train.max_steps
        if s.num_train_epochs is not None:  # epochs → optimizer steps, before the schedule is built
            self.max_steps = max(1, math.ceil(s.num_train_epochs * len(examples) / s.examples_per_step))
            log.info("sft.num_train_epochs=%g over %d examples: %d optimizer steps", s.num_train_epochs,
                     len(examples), self.max_steps)
        self.example_order = PromptSampler(len(examples), cfg.train.seed, cfg.data.shuffle)
        self.params, self.optimizer, self.scheduler = make_optimizer(self.model, cfg.train, self.max_steps)
        # the step's forward: on several ranks under DDP (every rank starts from rank 0's trainable weights; the
        # gradients are summed over ranks at each step's last micro-batch: each rank's loss is its share of the mean)
        self.forward = data_parallel(self.model, self.world, shard_weights=False,
                                     wrapper=CrossEntropyModule(self.model))
        self.step_idx = 0
        self.output_dir = Path(cfg.output.output_dir)
        # one packed row per micro-batch on CUDA; padded rows on the CPU, where attention over a packed row costs its
        # length squared (the same loss either way)
        self.packed = cfg.train.padding_free if cfg.train.padding_free is not None else self.device.type == "cuda"

    def _examples(self, rows: list[dict], source: str) -> list[SFTExample]:
        """The examples of ``rows`` (read and checked): through the processor for a vision dataset (the first one
        finds it: the processor passed in, or the model's), else the tokenizer."""
        checked = image_rows(rows, self.cfg.sft, source, self.cfg.data.max_image_pixels)
        if checked is None:
            return build_examples(self.tokenizer, rows, self.cfg.sft, source)
        if self.images is None:
            m = self.cfg.model
            self.images = PromptImages.for_model(self.model, m.name_or_path, self._processor, revision=m.revision,
                                                 trust_remote_code=m.trust_remote_code)
        if self.images is None:
            raise ConfigError(f"dataset {source!r} holds examples with images, but the model reads text only; train a "
                              "vision-language model on it")
        return vision_examples(self.images, checked, self.cfg.sft, source)

    def _groups(self, examples: list[SFTExample]) -> list[list[int]]:
        t = self.cfg.train
        return _micro_batches(examples, self.layout.micro_batch_tokens, t.micro_batch_size)

    def train(self, resume_from_checkpoint: bool | str | None = None) -> list[dict]:
        """Train to train.max_steps (or sft.num_train_epochs' steps); return each step's metrics.
        ``resume_from_checkpoint`` (TRL's name): True, or the output directory or its latest checkpoint, resumes from
        it (as output.resume=true)."""
        cfg = self.cfg
        main = self.world.is_main  # rank 0 writes every output; the others compute and reduce
        resume_from = self.run_dir.start_training(resume_from_checkpoint)
        if resume_from is not None:
            loaded = load_newest(resume_from, self.output_dir, self.model, self.optimizer, self.scheduler)
            if loaded is not None:
                self.step_idx, self.example_order.position = loaded[1]["step"], loaded[1]["data_position"]
        self.model.train()
        reporter = (RunReporter.for_config(cfg, resume_step=self.step_idx, recipe="sft", total_steps=self.max_steps)
                    if main else None)
        if main:
            write_run_settings(self.output_dir, cfg, self.layout)
        notify(self.callbacks, "on_train_begin", self)
        history = []
        eval_every = getattr(cfg.output, "eval_steps", 0) or 0
        finished = False
        guards = RunGuards(cfg, total_steps=self.max_steps)
        stop = None  # (message, exit code) once a signal or a guard asks the run to stop
        try:
            with sdpa_priority(cfg.model.sdpa_backends, self.device.type, self.model,
                               cfg.model.grouped_attention_backward), StopSignals() as signals:
                while self.step_idx < self.max_steps:
                    if main:
                        reporter.phase_started(self.step_idx + 1, "sft", cfg)
                    metrics = self._step()
                    nonfinite = metrics.pop("nonfinite")  # the terms that were not finite: for the guard
                    last = self.step_idx == self.max_steps
                    if self.eval_examples and ((eval_every and self.step_idx % eval_every == 0) or last):
                        metrics.update(self.evaluate())
                    history.append(metrics)
                    if main:
                        reporter.log_step(metrics)
                    notify(self.callbacks, "on_step_end", self.step_idx, metrics)
                    received, save_due, _ = agreed(self.world, signals.received, guards.save_due(self.step_idx))
                    reason = guards.after_step(self.step_idx, nonfinite, None)
                    stop = first_stop(stop, received, reason)
                    checkpoint_after_step(self.save, cfg, self.output_dir, guards, self.step_idx, stop, save_due, "sft")
            finished = True
        finally:
            if main:
                reporter.close(finished)
                self.run_dir.release()
        notify(self.callbacks, "on_train_end", history)
        return history

    def _step(self) -> dict:
        start = time.perf_counter()
        cfg = self.cfg
        batch = [self.examples[i] for i in self.example_order.next(cfg.sft.examples_per_step)]  # the global step's
        self.optimizer.zero_grad(set_to_none=True)
        loss, n_tokens = self._loss(batch, label_smoothing=cfg.sft.label_smoothing, backward=True)
        clip = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))  # the same on every rank
        # no update from a non-finite step (train.max_nonfinite_steps counts it; the schedule advances)
        nonfinite = step_if_finite(self.optimizer, self.step_idx + 1, loss, grad_norm)
        self.scheduler.step()
        self.step_idx += 1
        elapsed = time.perf_counter() - start
        metrics = {"step": self.step_idx, "loss": loss, "trained_tokens": n_tokens,
                   "tokens": sum(len(e.input_ids) for e in batch), "grad_norm": grad_norm,
                   "lr": self.scheduler.get_last_lr()[0], "step_time_s": elapsed,
                   "tokens_per_s": sum(len(e.input_ids) for e in batch) / elapsed,
                   "skipped_nonfinite": int(bool(nonfinite)), "nonfinite": nonfinite}
        if self.device.type == "cuda":
            metrics["peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics

    def _loss(self, examples: list[SFTExample], label_smoothing: float, backward: bool) -> tuple[float, int]:
        """step_loss of ``examples`` (all ranks' alike): this rank's contiguous share, over the trained tokens of
        every rank, with the loss summed over ranks (one process: all of them)."""
        start, stop = shard(len(examples), self.world.rank, self.world.world_size)
        mine = examples[start:stop]
        n_total = int(self.world.all_sum(torch.tensor(sum(sum(e.loss_mask) for e in mine), dtype=torch.float64)))
        vision = example_prompts(self.images, mine)  # the image tensors of this rank's examples, for this step only
        loss, _ = step_loss(self.model, mine, self._groups(mine), pad_id=self._pad_id(),
                            label_smoothing=label_smoothing, chunk_size=self.cfg.train.logprob_chunk_size,
                            packed=self.packed, backward=backward, n_total=n_total,
                            forward=self.forward if backward else None, vision=vision)
        if self.world.distributed:
            loss = self.world.sum_floats({"loss": loss})["loss"]
        return loss, n_total

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else (self.tokenizer.eos_token_id or 0)

    @torch.no_grad()
    def evaluate(self, eval_dataset=None) -> dict:
        """``eval/loss`` (mean cross-entropy over the held-out trained tokens, no label smoothing) and
        ``eval/perplexity`` = exp(eval/loss). ``eval_dataset``: examples, or as TRL's a ``datasets.Dataset``, a list
        of rows or a path; default: the trainer's held-out examples."""
        examples = self.eval_examples if eval_dataset is None else self._eval_examples(eval_dataset)
        if not examples:
            raise ValueError("no held-out examples to evaluate on: give eval_dataset (data.eval_source)")
        was_training = self.model.training
        self.model.eval()
        try:
            loss, n = self._loss(examples, label_smoothing=0.0, backward=False)
        finally:
            self.model.train(was_training)
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0)), "eval/tokens": n}

    def _eval_examples(self, dataset) -> list[SFTExample]:
        if isinstance(dataset, list) and all(isinstance(e, SFTExample) for e in dataset):
            return dataset
        rows = dataset_rows(dataset, "eval_dataset")
        if rows is None:
            source = str(dataset)
            return self._examples(read_sft_rows(self.cfg.data, self.cfg.sft, source=source), source)
        return self._examples(check_rows(rows, self.cfg.sft, "eval_dataset", self.cfg.data.max_image_pixels),
                              "eval_dataset")

    def save_model(self, output_dir: str | Path | None = None, format: str | None = None) -> Path:
        """TRL's save_model: the model as it is now through ``longrl export`` (a PEFT adapter for LoRA runs, else a
        merged model; ``format="merged"`` or ``"gguf"``); see :func:`longrl.export.save_trained_model`."""
        from ..export import save_trained_model

        return save_trained_model(self, output_dir, format)

    def save(self) -> Path | None:
        """Write checkpoint-STEP (rank 0) and return its path (None on other ranks); every rank returns once it is
        complete."""
        path = None
        if self.world.is_main:  # the state is replicated: rank 0 writes it
            state, frozen = trainer_state(self.model, self.cfg, self.example_order.position, recipe="sft",
                                          data_fingerprint=self.run_dir.data_fingerprint, world_size=self.world.world_size)
            path = save_checkpoint(self.output_dir, self.step_idx, self.model, self.optimizer, self.scheduler, state,
                                   self.cfg.output.save_total_limit, base_weights=frozen)
            log.info("saved %s", path)
            notify(self.callbacks, "on_save", path)
        self.world.barrier()
        return path
