"""Look at and score runs and models: ``longrl generate`` and ``longrl eval``.

``--from`` names a run (its output directory: the latest checkpoint; or a ``checkpoint-STEP`` directory) or any
model: a model directory, a hub id or a ``.gguf`` file, loaded as ``model.name_or_path`` would be
(:func:`longrl.models.load_model`, with the config's other ``model.*`` keys), so a base model is scored before
training with the same prompts, rewards and sampler. A run's model is rebuilt from its checkpoint exactly as
``longrl export`` rebuilds it (:mod:`longrl.export.source`: the base as training loaded it, with the checkpoint's
adapter or full weights). Either is sampled through longrl's sampler (transformers' generate where the sampler does
not support the model), built as training builds it (:func:`longrl.rollout.completions.build_sampler`: every
``generation.*`` key, and ``train.gpu_memory_gib`` bounding the KV cache). The sampler decodes a batch of sequences
together, so ``generate`` does not stream tokens: it prints each prompt's completions as soon as that prompt's batch
finishes.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

log = logging.getLogger(__name__)


class InferenceError(ValueError):
    """A generate / eval request cannot be served; the message names the flag, file or key."""


@dataclass
class Source:
    """What ``--from`` named, loaded: the model in eval mode, its tokenizer, and the checkpoint (None: a model)."""

    model: object
    tokenizer: object
    ckpt: object | None
    name: str  # as printed: the checkpoint's path or the model reference
    images: object = None  # a vision-language model's PromptImages (its processor); None for a text model


def is_run(reference: str) -> bool:
    """Whether ``--from`` names a longrl run or checkpoint (a directory with trainer_state.json or a
    checkpoint-STEP), rather than a model."""
    from ..models.from_checkpoint import checkpoint_path

    return checkpoint_path(reference) is not None


def check_source(reference: str) -> None:
    """Cheap checks of ``--from`` before anything loads: a missing path, or a directory that is neither a run nor a
    model, is refused naming both readings."""
    from ..models import ModelLoadError, check_model_files
    from ..models.gguf import is_gguf

    path = Path(reference).expanduser()
    if is_run(reference):
        return
    if not path.exists() and (reference.startswith((".", "/", "~")) or is_gguf(reference)
                              or reference.count("/") > 1):  # a path ("org/name" and "gpt2" are hub ids)
        raise InferenceError(f"--from {reference}: not found (a run, a checkpoint-STEP directory, a model "
                             "directory, a hub id or a .gguf file)")
    try:
        check_model_files(reference)
    except ModelLoadError as e:
        hint = " and not a longrl run (no trainer_state.json, no checkpoint-STEP)" if path.is_dir() else ""
        reason = str(e).removeprefix("config key 'model.name_or_path': ")
        raise InferenceError(f"--from {reference}: {reason}{hint}") from None


def load_source(reference: str, model_cfg, device: str, ckpt=None) -> Source:
    """:class:`Source` of ``--from``: a run's trained model (``ckpt``: its checkpoint, already read), or the model
    ``reference`` names loaded with the ``model.*`` settings ``model_cfg`` (dtype, revision, 4-bit, ...; no
    adapters)."""
    from ..models import load_model
    from ..models.loading import model_settings

    from .inference_images import prompt_images

    if ckpt is not None:
        model, tokenizer = checkpoint_model(ckpt, device)
        return Source(model, tokenizer, ckpt, str(ckpt.path), prompt_images(model, reference, ckpt, model_cfg))
    model, tokenizer = load_model(reference, lora=None, device=device, **model_settings(model_cfg))
    model.eval()
    return Source(model, tokenizer, None, reference, prompt_images(model, reference, None, model_cfg))


def checkpoint_model(ckpt, device: str = "auto"):
    """(model in eval mode, tokenizer) of a :class:`longrl.export.Checkpoint`."""
    from ..export.source import load_tokenizer, load_trained
    from ..models import resolve_device

    model = load_trained(ckpt, str(resolve_device(device)))
    model.eval()
    return model, load_tokenizer(ckpt)


def load_checkpoint_model(checkpoint: str, device: str = "auto"):
    """(model in eval mode, tokenizer, :class:`longrl.export.Checkpoint`) of a checkpoint directory (or a run's
    output directory: its latest checkpoint)."""
    from ..export.source import read_checkpoint

    ckpt = read_checkpoint(checkpoint)
    return (*checkpoint_model(ckpt, device), ckpt)


def checkpoint_section(ckpt, cls, name: str):
    """Section ``name`` of the checkpoint's run config as dataclass ``cls`` (keys this version does not know are
    left out, missing ones keep their defaults)."""
    saved = ckpt.config.get(name) or {}
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in saved.items() if k in known})


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


def _prompts_from(args, column: str, max_image_pixels: int) -> list[tuple]:
    """(prompt, images) pairs: ``--prompt`` with its ``--image`` files (read and checked here), or ``--data``'s
    rows (a vision dataset's prompts as messages with image parts, their images read)."""
    from ..config.schema import DataConfig
    from ..data.images import open_images
    from ..data.prompts import DataError, image_prompts, read_prompt_rows
    from .inference_images import image_messages, read_image_files

    if args.prompt is not None:
        if not args.image:
            return [(args.prompt, [])]
        images = read_image_files(args.image, max_image_pixels)
        return [(image_messages(args.prompt, len(images)), images)]
    data = DataConfig(source=args.data, prompt_column=column, shuffle=False, max_image_pixels=max_image_pixels)
    try:
        rows = read_prompt_rows(data)[:args.limit or None]
        with_images = image_prompts(data, rows)
        if with_images is not None:
            return [(p.messages, open_images(p.images)) for p in with_images]
    except DataError as e:
        raise InferenceError(f"--data: {e}") from e
    return [(row[column], []) for row in rows]


def _encoded(source, prompt, images: list):
    """(token ids, VisionPrompt or None) of one prompt, as training encodes it."""
    from ..data.prompts import tokenize_prompt
    from ..models.vision import encode_prompt

    if source.images is None:
        return tokenize_prompt(source.tokenizer, prompt), None
    if not images:
        if isinstance(prompt, str):
            return tokenize_prompt(source.tokenizer, prompt), None
        return source.images.token_ids(prompt, []), None
    vision = encode_prompt(source.images.processor, source.images.config, prompt, images)
    return vision.input_ids, vision


def generate_settings(args, ckpt):
    """The ``Config`` generate runs with: a run's own generation, data and train sections (defaults for a model), then
    the ``KEY=VALUE`` overrides, which may set ``generation.*`` (and ``model.*`` for a model, which has no run to
    rebuild it as), validated as any config."""
    from ..config import ConfigError, load_config
    from ..config.schema import Config, DataConfig, GenerationConfig, TrainConfig

    allowed = ("generation.",) if ckpt is not None else ("generation.", "model.")
    for item in args.overrides:
        if not item.startswith(allowed):
            raise ConfigError(f"override {item!r}: generate takes {' and '.join(a + '*' for a in allowed)} overrides"
                              + (" (a run's model is rebuilt as it trained)" if ckpt is not None else ""))
    base = Config() if ckpt is None else Config(generation=checkpoint_section(ckpt, GenerationConfig, "generation"),
                                               data=checkpoint_section(ckpt, DataConfig, "data"),
                                               train=checkpoint_section(ckpt, TrainConfig, "train"))  # its GPU budget
    return load_config(None, args.overrides, base=base, recipe="sft")  # (no reward functions needed)


def generate_main(args) -> int:
    """``longrl generate``: K completions per prompt, printed as each prompt's completions finish."""
    from ..export.source import read_checkpoint
    from ..memory.layout import budget_bytes
    from ..rollout.completions import build_sampler, sample, sampling_params
    from .inference_images import require_image_model, shown_text

    if (args.prompt is None) == (args.data is None):
        raise InferenceError("give one of --prompt TEXT or --data FILE")
    if args.image and args.prompt is None:
        raise InferenceError("--image goes with --prompt TEXT; a --data file's images come from its image or images "
                             "column")
    check_source(args.checkpoint)
    ckpt = read_checkpoint(args.checkpoint) if is_run(args.checkpoint) else None  # verified before loading
    cfg = generate_settings(args, ckpt)
    prompts = _prompts_from(args, args.prompt_column or cfg.data.prompt_column, cfg.data.max_image_pixels)
    if any(images for _, images in prompts):  # before the weights load
        require_image_model(args.checkpoint, ckpt, cfg.model, "--image" if args.image else f"--data {args.data}")
    source = load_source(args.checkpoint, cfg.model, args.device or cfg.model.device, ckpt)
    model, tokenizer, gen = source.model, source.tokenizer, cfg.generation
    chat = {"yes": True, "no": False}.get(args.chat)
    if chat is None:
        trained = trained_on_chat(ckpt) if ckpt is not None else None
        chat = trained if trained is not None else bool(getattr(tokenizer, "chat_template", None))
    params = sampling_params(gen, tokenizer, seed=args.seed, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature)
    prompts = [(as_prompt(p, tokenizer, chat), images) for p, images in prompts]
    encoded = [_encoded(source, p, images) for p, images in prompts]  # each prompt's images encoded once
    longest = max(len(ids) for ids, _ in encoded)
    cap = budget_bytes(cfg)  # the run's train.gpu_memory_gib: the KV cache stays within it, as in training
    sampler = build_sampler(model, tokenizer, gen, max_length=longest + params.max_new_tokens, memory_cap_bytes=cap)
    out = sys.stdout
    for number, ((prompt, _), (ids, vision)) in enumerate(zip(prompts, encoded), 1):
        start = time.perf_counter()
        rollout = sample(model, tokenizer, [ids], args.n, gen, replace(params, seed=args.seed + number), sampler,
                         next(model.parameters()).device, vision=[vision] if vision is not None else None)
        seconds = time.perf_counter() - start
        texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        if args.jsonl:
            for k, (text, tokens, cut) in enumerate(zip(texts, rollout.completion_ids, rollout.truncated), 1):
                out.write(json.dumps({"prompt": prompt, "sample": k, "completion": text, "tokens": len(tokens),
                                      "truncated": cut}) + "\n")
        else:
            out.write(f"=== prompt {number}/{len(prompts)}: {shown_text(prompt)}\n")
            for k, (text, tokens, cut) in enumerate(zip(texts, rollout.completion_ids, rollout.truncated), 1):
                end = "cut at --max-new-tokens" if cut else "stopped"
                out.write(f"--- sample {k}/{args.n} ({len(tokens)} tokens, {end})\n{text}\n")
            out.write(f"({args.n} samples in {seconds:.2f} s)\n")
        out.flush()
    return 0


def eval_main(args) -> int:
    """``longrl eval CONFIG --from RUN_OR_MODEL``: mean reward and pass@k per reward function on held-out
    prompts."""
    from ..config.loading import load_config
    from ..data.prompts import is_vision_dataset
    from ..export.source import read_checkpoint
    from ..training.evaluation import eval_data_config, evaluate, load_eval_prompts, read_eval_rows
    from .inference_images import require_image_model
    from ..rewards import RewardScorer
    from ..memory.layout import budget_bytes
    from ..rollout.completions import build_sampler

    flags = {"output.eval_num_generations": args.n, "output.eval_pass_threshold": args.pass_threshold}
    # the flags are overrides like any KEY=VALUE, validated with the config (nothing is written into it after)
    cfg = load_config(args.config, [*args.overrides, *(f"{k}={v}" for k, v in flags.items() if v is not None)])
    if args.data is None and not cfg.data.eval_source:
        raise InferenceError(f"{args.config}: no held-out prompts: pass --data FILE or set data.eval_source")
    check_source(args.checkpoint)
    ckpt = read_checkpoint(args.checkpoint) if is_run(args.checkpoint) else None  # verified before the rest loads
    scorer = RewardScorer.from_specs(cfg.rewards)  # reward functions and data fail before the model loads
    rows = read_eval_rows(cfg, args.data)
    if is_vision_dataset(eval_data_config(cfg, args.data), rows):  # before the weights load
        require_image_model(args.checkpoint, ckpt, cfg.model, f"{args.data or cfg.data.eval_source} holds images")
    source = load_source(args.checkpoint, cfg.model, args.device or cfg.model.device, ckpt)
    model, tokenizer = source.model, source.tokenizer
    data = load_eval_prompts(cfg, tokenizer, rows, args.data,
                             encode_images=source.images.token_ids if source.images is not None else None)
    gen = cfg.generation
    sampler = build_sampler(model, tokenizer, gen, max_length=cfg.data.max_prompt_length + gen.max_completion_length,
                            memory_cap_bytes=budget_bytes(cfg))
    start = time.perf_counter()
    result = evaluate(model, tokenizer, scorer, data, gen, num_generations=cfg.output.eval_num_generations,
                      pass_threshold=cfg.output.eval_pass_threshold, sampler=sampler,
                      device=next(model.parameters()).device, seed=args.seed, keep_samples=args.samples,
                      images=source.images)
    print(f"eval of {source.name} on {len(data)} prompts × {cfg.output.eval_num_generations} samples "
          f"({time.perf_counter() - start:.1f} s; pass: reward >= {cfg.output.eval_pass_threshold:g}"
          f"{'; greedy' if gen.temperature == 0 else ''})")
    print(result.table())
    for s in result.samples:
        print(json.dumps(s, default=str))
    if args.output:
        from ..training.checkpoint import atomic_write_text

        key = "checkpoint" if source.ckpt is not None else "model"
        atomic_write_text(Path(args.output), json.dumps({key: source.name, **result.metrics}, indent=2))
    return 0
