"""Score a policy on held-out prompts: mean reward and pass@k per reward function.

For each of P prompts, n completions are sampled (``output.eval_num_generations``, the training temperature) and
scored by the run's reward functions. Per function f:

    mean reward    the mean of f over the completions it applies to (None and failures left out)
    pass@k         a completion passes f when f(completion) ≥ threshold (``output.eval_pass_threshold``, default 1.0:
                   the full score of a 0/1 reward; None and failures do not pass). With c of a prompt's n
                   completions passing, the unbiased estimator (Chen et al. 2021, "Evaluating Large Language Models
                   Trained on Code") is pass@k = 1 − C(n − c, k) / C(n, k), averaged over prompts, for k = 1, 2, 4,
                   … up to n, and n.

Metric names: ``eval/reward`` (the weighted total), ``eval/rewards/<f>``, ``eval/pass@<k>/<f>``,
``eval/completion_length``, ``eval/num_prompts``. Used by ``longrl eval``, by training every ``output.eval_steps``
and by the Python API (:func:`evaluate`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field

import torch

from ..data.prompts import PromptDataset
from ..rollout.completions import reward_inputs, sample, sampling_params

log = logging.getLogger(__name__)

EVAL_SEED = 7_919  # eval sampling seeds: the same draws at every evaluation of a run (differences are the policy's)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` of ``n`` samples passing: 1 − C(n−c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k_values(n: int) -> list[int]:
    """1, 2, 4, … below n, and n."""
    return sorted({1 << i for i in range(n.bit_length()) if 1 << i <= n} | {n})


@dataclass
class EvalResult:
    metrics: dict[str, float]  # eval/... → value
    samples: list[dict] = field(default_factory=list)  # {"prompt", "completion", "rewards": {f: value}} each

    def table(self) -> str:
        """The metrics as an aligned two-column text table."""
        width = max(len(k) for k in self.metrics)
        return "\n".join(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}"
                         for k, v in self.metrics.items())


def evaluate(model, tokenizer, scorer, data: PromptDataset, gen, *, num_generations: int = 4,
             pass_threshold: float = 1.0, sampler=None, device=None, seed: int = EVAL_SEED,
             prompts_per_batch: int = 32, keep_samples: int = 0, images=None) -> EvalResult:
    """Mean reward and pass@k of ``model`` on every prompt of ``data`` (see the module docstring).

    ``scorer``: a :class:`longrl.rewards.RewardScorer`; ``gen``: a generation config (its temperature, lengths and
    stop rules); ``sampler``: longrl's sampler for ``model`` (None: transformers' generate, seeded);
    ``keep_samples``: how many scored completions to return with the metrics; ``images``: a vision-language model's
    :class:`~longrl.training.vision_inputs.PromptImages` (prompts with images), else None.
    """
    device = device or next(model.parameters()).device
    n = num_generations
    names = scorer.names
    totals: list[torch.Tensor] = []  # [P·n] each batch
    per_function: list[torch.Tensor] = []  # [P·n, F]
    lengths: list[int] = []
    samples: list[dict] = []
    for batch, start in enumerate(range(0, len(data), prompts_per_batch)):
        idx = list(range(start, min(start + prompts_per_batch, len(data))))
        rows = [data.rows[i] for i in idx]
        params = sampling_params(gen, tokenizer, seed=seed * 1_000_003 + batch)
        with _seeded(params.seed, device, sampler is None):  # transformers' generate draws from torch's RNG
            vision = images.prompts(data, idx) if images is not None else None
            rollout = sample(model, tokenizer, [data.prompt_ids[i] for i in idx], n, gen, params, sampler, device,
                             vision=vision)
        prompts, completions, columns = reward_inputs(rows, data.prompt_column, n, tokenizer, rollout)
        values, total, failures = scorer.score(prompts, completions, columns)
        if failures:
            from .reporting import reward_failure_lines

            for line in reward_failure_lines(0, failures, len(completions)):
                log.warning("eval %s", line.removeprefix("step 0: "))
        totals.append(total)
        per_function.append(values)
        lengths += [len(c) for c in rollout.completion_ids]
        for i in range(len(completions)):
            if len(samples) < keep_samples:
                samples.append({"prompt": prompts[i], "completion": completions[i],
                                "rewards": {f: _number(values[i, j]) for j, f in enumerate(names)}})
    total, values = torch.cat(totals), torch.cat(per_function)  # [P·n], [P·n, F]
    metrics: dict[str, float] = {"eval/num_prompts": len(data), "eval/reward": _nanmean(total)}
    for j, f in enumerate(names):
        metrics[f"eval/rewards/{f}"] = _nanmean(values[:, j])
    passed = (torch.nan_to_num(values, nan=-math.inf) >= pass_threshold).view(len(data), n, len(names))  # [P, n, F]
    counts = passed.sum(1)  # [P, F]
    for k in k_values(n):
        for j, f in enumerate(names):
            metrics[f"eval/pass@{k}/{f}"] = sum(pass_at_k(n, int(c), k) for c in counts[:, j]) / len(data)
    metrics["eval/completion_length"] = sum(lengths) / len(lengths)
    return EvalResult(metrics, samples)


@contextlib.contextmanager
def _seeded(seed: int, device, enabled: bool):
    """torch's RNG seeded with ``seed`` inside, and restored after (the caller's random stream is left as it was)."""
    if not enabled:
        yield
        return
    devices = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _nanmean(x: torch.Tensor) -> float:
    ok = ~torch.isnan(x)
    return float(x[ok].mean()) if ok.any() else float("nan")


def _number(value: torch.Tensor):
    v = float(value)
    return None if math.isnan(v) else v


def eval_data_config(cfg, source: str | None = None):
    """The data config of the eval prompts: ``source`` (default ``data.eval_source``), ``data.eval_split``, the
    first ``data.eval_num_examples`` rows in file order; None when there is no eval source."""
    from dataclasses import replace

    source = source or cfg.data.eval_source
    if not source:
        return None
    return replace(cfg.data, source=source, split=cfg.data.eval_split, num_examples=cfg.data.eval_num_examples,
                   shuffle=False)


def read_eval_rows(cfg, source: str | None = None) -> list[dict] | None:
    """The eval rows (checked as far as no tokenizer is needed; see :func:`longrl.data.prompts.read_prompt_rows`); task:
    sources draw them with another seed than training's. None when there is no eval source."""
    from pathlib import Path

    from ..data.prompts import DataError, read_prompt_rows

    dc = eval_data_config(cfg, source)
    if dc is None:
        return None
    key = "data.eval_source" if source is None else "--data"
    if not dc.source.startswith(("task:", "hf:")) and not Path(dc.source).expanduser().is_file():
        raise DataError(f"{key}: dataset file not found: {dc.source}")
    return read_prompt_rows(dc, seed=cfg.train.seed + 1)[:dc.num_examples]


def load_eval_prompts(cfg, tokenizer, rows: list[dict], source: str | None = None,
                      encode_images=None) -> PromptDataset:
    """Tokenize the eval rows from :func:`read_eval_rows` (chat template for chat prompts; prompts with images
    through ``encode_images``, as :func:`longrl.data.prompts.load_prompts` says)."""
    from ..data.prompts import load_prompts

    return load_prompts(eval_data_config(cfg, source), tokenizer, rows=rows, encode_images=encode_images)


def held_out_rows(cfg, dataset) -> tuple[list[dict], str]:
    """(rows, source) of an eval dataset given as TRL's eval_dataset, read and checked as data.eval_source's are;
    rows in memory get the source ``memory:<digest>``."""
    from ..data.in_memory import dataset_rows, rows_fingerprint
    from ..data.prompts import read_prompt_rows

    rows = dataset_rows(dataset, "eval_dataset")
    if rows is None:
        return read_eval_rows(cfg, str(dataset)), str(dataset)
    source = f"memory:{rows_fingerprint(rows)}"
    return read_prompt_rows(eval_data_config(cfg, source), rows=rows), source
