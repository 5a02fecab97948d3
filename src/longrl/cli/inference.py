"""Look at and score checkpoints: ``longrl generate`` and ``longrl eval``.

The trained model is rebuilt from a checkpoint exactly as ``longrl export`` rebuilds it
(:mod:`longrl.export.source`: the base as training loaded it, with the checkpoint's adapter or full weights) and
sampled through longrl's sampler (transformers' generate where the sampler does not support the model), built as
training builds it (:func:`longrl.rollout.completions.build_sampler`: every ``generation.*`` key, and the run's
``train.gpu_memory_gib`` bounding the KV cache). The sampler decodes a batch of sequences together, so ``generate``
does not stream tokens: it prints each prompt's completions as soon as that prompt's batch finishes.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import fields, replace

log = logging.getLogger(__name__)


class InferenceError(ValueError):
    """A generate / eval request cannot be served; the message names the flag, file or key."""


def load_checkpoint_model(checkpoint: str, device: str = "auto"):
    """(model in eval mode, tokenizer, :class:`longrl.export.Checkpoint`) of a checkpoint directory (or a run's
    output directory: its latest checkpoint)."""
    from ..export.source import load_tokenizer, load_trained, read_checkpoint
    from ..models import resolve_device

    ckpt = read_checkpoint(checkpoint)
    dev = resolve_device(device)
    model = load_trained(ckpt, str(dev))
    model.eval()
    return model, load_tokenizer(ckpt), ckpt


def checkpoint_section(ckpt, cls, name: str):
    """Section ``name`` of the checkpoint's run config as dataclass ``cls`` (keys this version does not know are
    left out, missing ones keep their defaults)."""
    saved = ckpt.config.get(name) or {}
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in saved.items() if k in known})


def checkpoint_memory_cap(ckpt) -> int | None:
    """The run's GPU budget (train.gpu_memory_gib) in bytes, None without one: the sampler's KV cache stays within
    it, as it did in training."""
    from ..config.schema import Config, TrainConfig
    from ..memory.layout import budget_bytes

    return budget_bytes(Config(train=checkpoint_section(ckpt, TrainConfig, "train")))


def trained_on_chat(ckpt) -> bool | None:
    """Whether the run's training prompts were chat messages (its first row), None if its data cannot be read."""
    from ..config.schema import DataConfig
    from ..data.prompts import read_rows

    data = checkpoint_section(ckpt, DataConfig, "data")
    try:
        rows = read_rows(data.source, data.split, 1, int(ckpt.config.get("train", {}).get("seed", 0)))
    except Exception:  # noqa: BLE001 - moved or remote data: decide from the tokenizer alone
        return None
    return bool(rows) and isinstance(rows[0].get(data.prompt_column), list)


def as_prompt(text_or_messages, tokenizer, chat: bool):
    """A prompt as training would tokenize it: chat messages stay as they are; a string becomes one user message
    when ``chat`` (and the tokenizer has a chat template), else stays plain text."""
    if isinstance(text_or_messages, str) and chat and getattr(tokenizer, "chat_template", None):
        return [{"role": "user", "content": text_or_messages}]
    return text_or_messages


def _prompts_from(args, ckpt) -> list:
    from ..config.schema import DataConfig
    from ..data.prompts import DataError, read_prompt_rows

    if args.prompt is not None:
        return [args.prompt]
    column = args.prompt_column or checkpoint_section(ckpt, DataConfig, "data").prompt_column
    try:
        rows = read_prompt_rows(DataConfig(source=args.data, prompt_column=column, shuffle=False))
    except DataError as e:
        raise InferenceError(f"--data: {e}") from e
    return [row[column] for row in rows[:args.limit or None]]


def generate_main(args) -> int:
    """``longrl generate``: K completions per prompt, printed as each prompt's completions finish."""
    from ..config.schema import GenerationConfig
    from ..data.prompts import tokenize_prompt
    from ..rollout.completions import build_sampler, sample, sampling_params

    if (args.prompt is None) == (args.data is None):
        raise InferenceError("give one of --prompt TEXT or --data FILE")
    if args.n < 1 or args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise InferenceError("--n and --max-new-tokens must be >= 1")
    model, tokenizer, ckpt = load_checkpoint_model(args.checkpoint, args.device)
    prompts = _prompts_from(args, ckpt)
    gen = checkpoint_section(ckpt, GenerationConfig, "generation")
    chat = {"yes": True, "no": False}.get(args.chat)
    if chat is None:
        trained = trained_on_chat(ckpt)
        chat = trained if trained is not None else bool(getattr(tokenizer, "chat_template", None))
    params = sampling_params(gen, tokenizer, seed=args.seed, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature)
    prompts = [as_prompt(p, tokenizer, chat) for p in prompts]
    longest = max(len(tokenize_prompt(tokenizer, p)) for p in prompts)
    sampler = build_sampler(model, tokenizer, gen, max_length=longest + params.max_new_tokens,
                            memory_cap_bytes=checkpoint_memory_cap(ckpt))
    out = sys.stdout
    for number, prompt in enumerate(prompts, 1):
        ids = tokenize_prompt(tokenizer, prompt)
        start = time.perf_counter()
        rollout = sample(model, tokenizer, [ids], args.n, gen, replace(params, seed=args.seed + number), sampler,
                         next(model.parameters()).device)
        seconds = time.perf_counter() - start
        texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        if args.jsonl:
            for k, (text, tokens, cut) in enumerate(zip(texts, rollout.completion_ids, rollout.truncated), 1):
                out.write(json.dumps({"prompt": prompt, "sample": k, "completion": text, "tokens": len(tokens),
                                      "truncated": cut}) + "\n")
        else:
            shown = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            out.write(f"=== prompt {number}/{len(prompts)}: {shown}\n")
            for k, (text, tokens, cut) in enumerate(zip(texts, rollout.completion_ids, rollout.truncated), 1):
                end = "cut at --max-new-tokens" if cut else "stopped"
                out.write(f"--- sample {k}/{args.n} ({len(tokens)} tokens, {end})\n{text}\n")
            out.write(f"({args.n} samples in {seconds:.2f} s)\n")
        out.flush()
    return 0


def eval_main(args) -> int:
    """``longrl eval CONFIG --from CKPT``: mean reward and pass@k per reward function on held-out prompts."""
    from ..config.loading import load_config
    from ..training.evaluation import evaluate, load_eval_prompts, read_eval_rows
    from ..rewards import RewardScorer
    from ..memory.layout import budget_bytes
    from ..rollout.completions import build_sampler

    if args.n is not None and args.n < 1:
        raise InferenceError("--n must be >= 1")
    flags = {"output.eval_num_generations": args.n, "output.eval_pass_threshold": args.pass_threshold}
    # the flags are overrides like any KEY=VALUE, validated with the config (nothing is written into it after)
    cfg = load_config(args.config, [*args.overrides, *(f"{k}={v}" for k, v in flags.items() if v is not None)])
    if args.data is None and not cfg.data.eval_source:
        raise InferenceError(f"{args.config}: no held-out prompts: pass --data FILE or set data.eval_source")
    scorer = RewardScorer.from_specs(cfg.rewards)  # reward functions and data fail before the model loads
    rows = read_eval_rows(cfg, args.data)
    model, tokenizer, ckpt = load_checkpoint_model(args.checkpoint, args.device)
    data = load_eval_prompts(cfg, tokenizer, rows, args.data)
    gen = cfg.generation
    sampler = build_sampler(model, tokenizer, gen, max_length=cfg.data.max_prompt_length + gen.max_completion_length,
                            memory_cap_bytes=budget_bytes(cfg))
    start = time.perf_counter()
    result = evaluate(model, tokenizer, scorer, data, gen, num_generations=cfg.output.eval_num_generations,
                      pass_threshold=cfg.output.eval_pass_threshold, sampler=sampler,
                      device=next(model.parameters()).device, seed=args.seed, keep_samples=args.samples)
    print(f"eval of {ckpt.path} on {len(data)} prompts × {cfg.output.eval_num_generations} samples "
          f"({time.perf_counter() - start:.1f} s; pass: reward >= {cfg.output.eval_pass_threshold:g})")
    print(result.table())
    for s in result.samples:
        print(json.dumps(s, default=str))
    if args.output:
        from pathlib import Path

        from ..training.checkpoint import atomic_write_text

        atomic_write_text(Path(args.output), json.dumps({"checkpoint": str(ckpt.path), **result.metrics}, indent=2))
    return 0
