"""Supervised fine-tuning: the cross-entropy of the trained tokens, on GRPO's memory machinery.

One optimizer step reads ``sft.examples_per_step`` examples (``longrl.sft_data``), splits them into micro-batches
(``train.micro_batch_tokens`` packed without padding, else ``train.micro_batch_size`` examples) and accumulates

    loss = Σ_{trained tokens t of the step} CE_t / N_step

so the loss is the mean over the step's trained tokens however the step is split. CE_t comes from the
backbone's hidden states and the LM head in chunks (``longrl.ops.cross_entropy``: no tokens × vocab tensor),
with optional label smoothing. Held-out loss and perplexity exp(mean CE) every ``output.eval_steps`` (and at
the end) on ``data.eval_source`` or, without one, on the last ``sft.eval_examples`` rows held out.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from .checkpoint import atomic_write_text, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import Config
from .data import PromptSampler
from .memory import count_groups, token_budget_groups
from .models import base_model
from .policy import token_cross_entropy
from .reporting import RunReporter
from .sft_data import SFTExample, build_examples, load_examples

log = logging.getLogger(__name__)


def _micro_batches(examples: list[SFTExample], micro_batch_tokens: int, micro_batch_size: int) -> list[list[int]]:
    if micro_batch_tokens > 0:
        return token_budget_groups([len(e.input_ids) for e in examples], micro_batch_tokens)
    return count_groups(len(examples), micro_batch_size)


def step_loss(model, examples: list[SFTExample], groups: list[list[int]], *, pad_id: int, label_smoothing: float,
              chunk_size: int, packed: bool, backward: bool) -> tuple[float, int]:
    """(Σ CE / N, N) over ``examples`` split into ``groups``; with ``backward`` each group's share is
    back-propagated as it is computed (gradients accumulate; the sum is the whole step's mean)."""
    n_tokens = sum(sum(e.loss_mask) for e in examples)
    total = 0.0
    for idx in groups:
        mb = [examples[i] for i in idx]
        ce = token_cross_entropy(model, [e.input_ids for e in mb], [e.loss_mask for e in mb], pad_id=pad_id,
                                 label_smoothing=label_smoothing, chunk_size=chunk_size, packed=packed)  # [n_mb]
        loss = ce.sum() / max(n_tokens, 1)
        if backward:
            loss.backward()
        total += float(loss.detach())
    return total, n_tokens


class SFTTrainer:
    """Build the model (as GRPO does), the examples and the optimizer from a :class:`Config`; :meth:`train`."""

    def __init__(self, cfg: Config, model=None, tokenizer=None, train_rows: list[dict] | None = None,
                 eval_rows: list[dict] | None = None):
        from .model_setup import build_policy_model, make_optimizer
        from .trainer import check_output_dir

        import weakref

        from .runlock import acquire_run_lock, check_output_dir_contents

        self.cfg = cfg
        torch.manual_seed(cfg.train.seed)
        self.run_lock = acquire_run_lock(cfg.output.output_dir)  # one run per directory, before anything is written
        weakref.finalize(self, self.run_lock.release)
        check_output_dir_contents(cfg.output.output_dir, kind="sft", command="sft",
                                  overwrite=cfg.output.overwrite_output_dir)
        check_output_dir(cfg)
        self.model, self.tokenizer, self.device, self.plan, self.offloader = build_policy_model(
            cfg, model, tokenizer, recipe="sft")
        s = cfg.sft
        if train_rows is not None:
            examples = build_examples(self.tokenizer, train_rows, s, "train_dataset")
        else:
            examples = load_examples(cfg.data, s, self.tokenizer, seed=cfg.train.seed)
        eval_source = getattr(cfg.data, "eval_source", None)
        if eval_rows is not None:
            self.eval_examples = build_examples(self.tokenizer, eval_rows, s, "eval_dataset")
        elif eval_source:
            self.eval_examples = load_examples(cfg.data, s, self.tokenizer, seed=cfg.train.seed, source=eval_source)
        elif s.eval_examples and len(examples) >= 10:
            held = min(s.eval_examples, len(examples) // 10)
            examples, self.eval_examples = examples[:-held], examples[-held:]
            log.info("held out the last %d examples for evaluation (no data.eval_source)", held)
        else:
            self.eval_examples = []
        self.examples = examples
        self.sampler = PromptSampler(len(examples), cfg.train.seed, cfg.data.shuffle)
        self.params, self.optimizer, self.scheduler = make_optimizer(self.model, cfg.train)
        self.step_idx = 0
        self.output_dir = Path(cfg.output.output_dir)
        # one packed row per micro-batch on CUDA; padded rows on the CPU, where attention over a packed row costs its
        # length squared (the same loss either way)
        self.packed = cfg.train.padding_free if cfg.train.padding_free is not None else self.device.type == "cuda"

    def _groups(self, examples: list[SFTExample]) -> list[list[int]]:
        t = self.cfg.train
        return _micro_batches(examples, t.micro_batch_tokens, t.micro_batch_size)

    def train(self) -> list[dict]:
        cfg = self.cfg
        if cfg.output.resume:
            self._resume()
        self.model.train()
        reporter = RunReporter.for_config(cfg, resume_step=self.step_idx)
        atomic_write_text(self.output_dir / "config.yaml", cfg.to_yaml())
        history = []
        eval_every = getattr(cfg.output, "eval_steps", 0) or 0
        try:
            while self.step_idx < cfg.train.max_steps:
                metrics = self._step()
                last = self.step_idx == cfg.train.max_steps
                if self.eval_examples and ((eval_every and self.step_idx % eval_every == 0) or last):
                    metrics.update(self.evaluate())
                history.append(metrics)
                reporter.log_step(metrics)
                save_every = cfg.output.save_steps
                if (save_every and self.step_idx % save_every == 0) or last:
                    self.save()
        finally:
            reporter.close()
        return history

    def _step(self) -> dict:
        start = time.perf_counter()
        cfg = self.cfg
        batch = [self.examples[i] for i in self.sampler.next(cfg.sft.examples_per_step)]
        self.optimizer.zero_grad(set_to_none=True)
        loss, n_tokens = step_loss(self.model, batch, self._groups(batch), pad_id=self._pad_id(),
                                   label_smoothing=cfg.sft.label_smoothing, chunk_size=cfg.train.logprob_chunk_size,
                                   packed=self.packed, backward=True)
        clip = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        self.optimizer.step()
        self.scheduler.step()
        self.step_idx += 1
        elapsed = time.perf_counter() - start
        metrics = {"step": self.step_idx, "loss": loss, "trained_tokens": n_tokens,
                   "tokens": sum(len(e.input_ids) for e in batch), "grad_norm": grad_norm,
                   "lr": self.scheduler.get_last_lr()[0], "step_time_s": elapsed,
                   "tokens_per_s": sum(len(e.input_ids) for e in batch) / elapsed}
        if self.device.type == "cuda":
            metrics["peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else (self.tokenizer.eos_token_id or 0)

    @torch.no_grad()
    def evaluate(self, examples: list[SFTExample] | None = None) -> dict:
        """``eval/loss`` (mean cross-entropy over the held-out trained tokens, no label smoothing) and
        ``eval/perplexity`` = exp(eval/loss)."""
        examples = self.eval_examples if examples is None else examples
        was_training = self.model.training
        self.model.eval()
        try:
            loss, n = step_loss(self.model, examples, self._groups(examples), pad_id=self._pad_id(),
                                label_smoothing=0.0, chunk_size=self.cfg.train.logprob_chunk_size, packed=self.packed,
                                backward=False)
        finally:
            self.model.train(was_training)
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0)), "eval/tokens": n}

    def save(self) -> Path:
        from .checkpoint import frozen_base_weights
        from .models import TINY_NAME

        dtype = base_model(self.model).get_input_embeddings().weight.dtype
        state = {"data_position": self.sampler.position, "config": self.cfg.to_dict(), "recipe": "sft",
                 "model_dtype": str(dtype).removeprefix("torch.")}
        report = getattr(base_model(self.model), "longrl_quant_report", None)
        if report is not None:
            state["quant_kept"] = sorted(report.kept)
        frozen = (frozen_base_weights(self.model)
                  if self.cfg.model.name_or_path == TINY_NAME and hasattr(self.model, "peft_config") else None)
        path = save_checkpoint(self.output_dir, self.step_idx, self.model, self.optimizer, self.scheduler, state,
                               self.cfg.output.save_total_limit, base_weights=frozen)
        log.info("saved %s", path)
        return path

    def _resume(self) -> None:
        path = latest_checkpoint(self.output_dir)
        if path is None:
            log.warning("resume=true but no checkpoint in %s: starting from scratch", self.output_dir)
            return
        state = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.step_idx = state["step"]
        self.sampler.position = state["data_position"]
        log.info("resumed from %s (step %d)", path, self.step_idx)
