"""TRL's trainers over longrl's recipes: ``GRPOTrainer`` and ``SFTTrainer`` taking TRL's arguments
(``GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=..., peft_config=...)``), normalised
here into what the recipes take (a :class:`~longrl.config.Config`, a model and tokenizer, a reward scorer, rows)
before any model loads. They take longrl's own form too (``GRPOTrainer(cfg, ...)``), handed to the recipe unchanged.
The batch is counted as TRL counts it (compat/trl_config.py: batch_arithmetic).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config, ConfigError, RewardSpec, validate
from ..data.in_memory import dataset_rows, rows_fingerprint
from ..recipes import grpo, sft
from ..training.evaluation import held_out_rows
from .trl_config import GRPOConfig, SFTConfig, apply_epochs, trl_epochs

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------- the trainer's inputs

@dataclass
class TrainerInputs:
    cfg: Config
    model: object  # None: the trainer loads cfg.model.name_or_path
    tokenizer: object
    scorer: object
    rows: list[dict] | None  # training rows given in memory (None: read cfg.data.source)
    eval_rows: list[dict] | None = None  # held-out rows, read and checked (cfg.data.eval_source names them)
    callbacks: list = field(default_factory=list)


def trainer_inputs(slots: tuple, *, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                   processing_class=None, peft_config=None, reward_weights=None, callbacks=None,
                   environment: bool = False) -> TrainerInputs:
    """Normalise TRL-style ``GRPOTrainer`` arguments; every check here runs before any model loads.

    ``slots``: what came in the trainer's first four parameters (cfg, model, tokenizer, scorer). A first one that is
    not a Config means TRL's positional order, (model, reward_funcs, args, train_dataset); else they are keywords
    (model=, and tokenizer= as processing_class). ``environment``: an environment_factory or tools were given, whose
    episodes may be the only reward source (no reward_funcs)."""
    from ..training.callbacks import check_callbacks

    first, second, third, fourth = slots
    if isinstance(first, Config):
        given = [k for k, v in dict(reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                                    eval_dataset=eval_dataset, processing_class=processing_class,
                                    peft_config=peft_config, reward_weights=reward_weights).items() if v is not None]
        raise TypeError(f"GRPOTrainer(cfg, ...) is the Config API (model=, tokenizer=, scorer=, callbacks=); for "
                        f"{', '.join(given)} use TRL's form, GRPOTrainer(model=..., reward_funcs=..., args=cfg, ...)")
    if first is not None:
        model, reward_funcs = first, reward_funcs if second is None else second
        args, train_dataset = (args if third is None else third), (train_dataset if fourth is None else fourth)
    else:
        model, processing_class = second, processing_class if third is None else third
        if fourth is not None:
            raise TypeError("GRPOTrainer(scorer=...) is the Config-based API's; with TRL's arguments give "
                            "reward_funcs=...")

    cfg = _args_config(args, GRPOConfig, "GRPOTrainer")
    model, rows = _model_and_rows(cfg, model, peft_config, train_dataset, "GRPOTrainer")
    rows = epochs_to_steps(cfg, rows)  # the rows it read to count steps (None: it read none)
    processing_class = _described(cfg, model, vision_processor(model, processing_class))
    eval_rows = None
    if eval_dataset is not None:
        eval_rows, cfg.data.eval_source = held_out_rows(cfg, eval_dataset)
    only_environment = environment and reward_funcs is None and not cfg.rewards
    scorer = None if only_environment else reward_scorer(cfg, reward_funcs, reward_weights)
    validate(cfg, require_rewards=not only_environment)
    return TrainerInputs(cfg, model, processing_class, scorer, rows, eval_rows, check_callbacks(callbacks or []))


def _args_config(args, cls, trainer: str) -> Config:
    """A copy of TRL's ``args`` (a longrl Config), or ``cls()`` for None."""
    if args is not None and not isinstance(args, Config):
        raise TypeError(f"{trainer}(args=...) takes a longrl.{cls.__name__} (or longrl.Config); got "
                        f"{type(args).__module__}.{type(args).__name__}: build it with `from longrl import "
                        f"{cls.__name__}` and the same arguments")
    return copy.deepcopy(args) if args is not None else cls()


def _model_and_rows(cfg: Config, model, peft_config, train_dataset, trainer: str):
    """(model or None to load cfg.model.name_or_path, training rows in memory or None); cfg.model, cfg.lora and
    cfg.data.source record what was given (rows in memory as ``memory:<digest>``)."""
    if model is None:
        raise TypeError(f"{trainer} needs a model: a hub id or local directory, a transformers model or a PEFT model")
    if isinstance(model, (str, Path)):
        cfg.model.name_or_path = str(model)
        model = None
    if peft_config is not None:
        lora_from_peft(cfg, peft_config)
    rows = None
    if train_dataset is not None:
        rows = dataset_rows(train_dataset, "train_dataset")
        cfg.data.source = str(train_dataset) if rows is None else f"memory:{rows_fingerprint(rows)}"
    return model, rows


def epochs_to_steps(cfg: Config, rows: list[dict] | None) -> list[dict] | None:
    """A GRPOConfig's num_train_epochs as train.max_steps, counted over the training prompts (``rows``, or
    data.source's), as TRL counts them (compat.trl_config.steps_for_epochs). Returns the rows counted (``rows``
    when there are no epochs to count), for the trainer to take instead of reading data.source again."""
    if trl_epochs(cfg) is None:
        return rows
    from ..data.prompts import read_prompt_rows

    rows = read_prompt_rows(cfg.data, seed=cfg.train.seed, rows=rows)
    apply_epochs(cfg, len(rows))
    return rows


def sft_trainer_inputs(slots: tuple, *, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                       processing_class=None, peft_config=None, formatting_func=None,
                       callbacks=None) -> TrainerInputs:
    """Normalise TRL-style ``SFTTrainer`` arguments (checks before any model loads).

    ``slots``: the trainer's first five parameters (cfg, model, tokenizer, train_rows, eval_rows). A first one that
    is not a Config means TRL's positional order, (model, args, data_collator, train_dataset, eval_dataset); else
    keywords (model=, and tokenizer= as processing_class). ``formatting_func(row) -> str``: each row becomes a text
    row of that string (every token trained), as in TRL."""
    from ..training.callbacks import check_callbacks
    from ..data.prompts import read_rows

    first, second, third, fourth, fifth = slots
    if first is not None:
        model, args = first, args if second is None else second
        data_collator = data_collator if third is None else third
        train_dataset = train_dataset if fourth is None else fourth
        eval_dataset = eval_dataset if fifth is None else fifth
    else:
        model, processing_class = second, processing_class if third is None else third
        train_dataset = train_dataset if fourth is None else fourth
        eval_dataset = eval_dataset if fifth is None else fifth
    if data_collator is not None:
        raise TypeError("SFTTrainer(data_collator=...): longrl builds its micro-batches itself (packed into one row "
                        "or padded, the same loss); leave it out (packing / padding_free in SFTConfig)")
    if formatting_func is not None and not callable(formatting_func):
        raise TypeError(f"SFTTrainer(formatting_func=...): expected a callable row -> str; got "
                        f"{type(formatting_func).__name__}")
    cfg = _args_config(args, SFTConfig, "SFTTrainer")
    model, rows = _model_and_rows(cfg, model, peft_config, train_dataset, "SFTTrainer")
    processing_class = _described(cfg, model, processing_class)
    if formatting_func is not None:
        d = cfg.data
        rows = _formatted(rows if rows is not None else read_rows(d.source, d.split, d.num_examples, cfg.train.seed),
                          formatting_func, cfg.sft.text_column, "train_dataset")
        cfg.data.source = f"memory:{rows_fingerprint(rows)}"
    eval_rows = None
    if eval_dataset is not None:
        eval_rows = dataset_rows(eval_dataset, "eval_dataset")
        if eval_rows is None and formatting_func is not None:
            eval_rows = read_rows(str(eval_dataset), cfg.data.eval_split)
        if eval_rows is None:
            cfg.data.eval_source = str(eval_dataset)
        else:
            if formatting_func is not None:
                eval_rows = _formatted(eval_rows, formatting_func, cfg.sft.text_column, "eval_dataset")
            cfg.data.eval_source = f"memory:{rows_fingerprint(eval_rows)}"
    validate(cfg, require_rewards=False)
    return TrainerInputs(cfg, model, processing_class, None, rows, eval_rows, check_callbacks(callbacks or []))


def _formatted(rows: list[dict], formatting_func, column: str, name: str) -> list[dict]:
    """TRL's formatting_func: each row → {column: formatting_func(row)}, a text row (a row with images is refused:
    the text would train without them)."""
    from ..data.sft_rows import has_images

    out = []
    for i, row in enumerate(rows):
        if isinstance(row, dict) and has_images(row):
            raise ConfigError(f"formatting_func: {name} row {i + 1} holds images, and formatting_func makes text rows, "
                              "which would train without them; leave formatting_func out: rows with an image/images "
                              "column and messages or prompt/completion columns go through the model's processor")
        try:
            text = formatting_func(row)
        except Exception as e:
            raise ConfigError(f"formatting_func on {name} row {i + 1} raised {type(e).__name__}: {e}") from e
        if not isinstance(text, str) or not text:
            raise ConfigError(f"formatting_func on {name} row {i + 1}: returned {text!r:.60}; expected a non-empty "
                              "string (the text to train on)")
        out.append({column: text})
    return out


def lora_from_peft(cfg: Config, peft_config) -> None:
    """A ``peft.LoraConfig`` onto cfg.lora (enabled); options longrl does not train with are refused."""
    if type(peft_config).__name__ != "LoraConfig":
        raise ConfigError(f"peft_config: only peft.LoraConfig is supported; got {type(peft_config).__name__}")
    unsupported = {"use_dora": False, "use_rslora": False, "bias": "none", "modules_to_save": None,
                   "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
    for name, default in unsupported.items():
        value = getattr(peft_config, name, default)
        if value not in (default, None) and value != default:
            raise ConfigError(f"peft_config.{name}={value!r} is not supported by longrl (its fused LoRA kernels "
                              f"train plain adapters); leave it at {default!r}")
    targets = peft_config.target_modules
    cfg.lora.enabled = True
    cfg.lora.r = int(peft_config.r)
    cfg.lora.alpha = float(peft_config.lora_alpha)
    cfg.lora.dropout = float(peft_config.lora_dropout)
    cfg.lora.target_modules = (["all-linear"] if targets in (None, "all-linear")
                               else [targets] if isinstance(targets, str) else sorted(targets))


def reward_scorer(cfg: Config, reward_funcs, reward_weights):
    """A RewardScorer from callables and/or 'file.py:function' strings; cfg.rewards records them."""
    from ..rewards import RewardScorer, load_reward_function

    if reward_funcs is None:
        if not cfg.rewards or any(":" not in r.function and not r.url for r in cfg.rewards):
            raise ConfigError("GRPOTrainer needs reward_funcs: a callable f(prompts, completions, **columns), a "
                              "'path/to/file.py:function' string, or a list of them")
        return RewardScorer.from_specs(cfg.rewards)
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    weights = reward_weights if reward_weights is not None else (
        [r.weight for r in cfg.rewards] if cfg.rewards else [1.0] * len(funcs))
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights: {len(weights)} weights for {len(funcs)} reward functions")
    specs, entries = [], []
    for i, fn in enumerate(funcs):
        if isinstance(fn, str):
            ref, call, name = fn, load_reward_function(fn), fn.rsplit(":", 1)[-1]
        elif callable(fn) and not hasattr(fn, "config"):
            name = getattr(fn, "__name__", type(fn).__name__)
            ref, call = f"{getattr(fn, '__module__', None) or 'python'}:{getattr(fn, '__qualname__', name)}", fn
        else:
            raise ConfigError(f"reward_funcs[{i}]: {type(fn).__name__} is not supported (reward models are not); give "
                              "a callable f(prompts, completions, **columns) -> list[float | None] or "
                              "'file.py:function'")
        taken = [n for n, _, _ in entries]
        name = name if name not in taken else f"{name}_{taken.count(name) + 1}"
        entries.append((name, call, float(weights[i])))
        specs.append(RewardSpec(ref, float(weights[i])))
    cfg.rewards = specs
    return RewardScorer(entries)


def _described(cfg: Config, model, processing_class):
    """For a model object given (not a name): cfg.model / cfg.lora describe it (checkpoints and export read them),
    and its tokenizer is the one saved with it unless processing_class is given. Returns the tokenizer (or None)."""
    if model is None:
        return processing_class
    # a PEFT model with lora.enabled=false is left to the recipe, which refuses it (models.ensure_adapters)
    describe_model(cfg, model, had_adapters=hasattr(model, "peft_config") and cfg.lora.enabled)
    return tokenizer_for(model) if processing_class is None else processing_class


def vision_processor(model, processing_class):
    """``processing_class`` for a vision-language model object given: its processor (tokenizer and image
    processor), or, when None, the processor saved with the model (TRL's default); a tokenizer alone cannot encode
    images and is refused. Other models' processing_class is returned as given."""
    from ..models import base_model
    from ..models.loading import load_processor
    from ..models.vision import vision_family
    from ..training.vision_inputs import is_processor

    if model is None or is_processor(processing_class) or vision_family(base_model(model).config) is None:
        return processing_class
    if processing_class is not None:
        raise ConfigError(f"processing_class: the model is a vision-language model, which needs its processor "
                          f"(tokenizer and image processor: AutoProcessor.from_pretrained(...), or the second value "
                          f"of FastVisionModel.from_pretrained); got a {type(processing_class).__name__}")
    name = getattr(base_model(model).config, "_name_or_path", "")
    if not name:
        raise ConfigError("processing_class: the vision-language model given has no name_or_path to load its "
                          "processor from; pass processing_class=processor")
    return load_processor(name)


def tokenizer_for(model):
    """TRL's default processing_class: the tokenizer saved with the model."""
    from transformers import AutoTokenizer

    from ..models import ModelLoadError, base_model

    name = getattr(base_model(model).config, "_name_or_path", "")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"no tokenizer found for the given model ({name or 'no name_or_path'}): pass "
                             f"processing_class=tokenizer ({type(e).__name__}: {e})") from e


def describe_model(cfg: Config, model, had_adapters: bool) -> None:
    """cfg.model (and cfg.lora for a model that came with adapters) as the given model really is: checkpoints record
    it, ``longrl export`` reads it."""
    from ..models import base_model
    from ..models.fp8_linear import is_fp8_model

    base = base_model(model)
    name = getattr(base, "name_or_path", None) or getattr(base.config, "_name_or_path", "") or "in-memory-model"
    cfg.model.name_or_path = str(name)
    cfg.model.dtype = str(base.get_input_embeddings().weight.dtype).removeprefix("torch.")
    report = getattr(base, "longrl_quant_report", None)
    cfg.model.load_in_fp8 = is_fp8_model(base)
    cfg.model.load_in_4bit = bool(getattr(base, "is_loaded_in_4bit", False) or
                                  (report is not None and not cfg.model.load_in_fp8))
    if had_adapters:
        lora_from_peft(cfg, next(iter(model.peft_config.values())))


# ----------------------------------------------------------------------------------------- the trainers

class GRPOTrainer(grpo.GRPOTrainer):
    """The GRPO recipe (:class:`longrl.recipes.grpo.GRPOTrainer`) with TRL's signature as well:
    ``GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=..., eval_dataset=...,
    processing_class=..., peft_config=..., reward_weights=..., callbacks=..., environment_factory=..., tools=...)``
    (positionally too: model, reward_funcs, args, train_dataset), or longrl's ``GRPOTrainer(cfg, model=None,
    tokenizer=None, scorer=None, ...)``. In TRL's form, ``train(resume_from_checkpoint=...)`` decides whether a run
    directory with checkpoints is resumed."""

    def __init__(self, cfg=None, model=None, tokenizer=None, scorer=None, *, reward_funcs=None, args=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, peft_config=None, reward_weights=None,
                 callbacks=None, environment_factory=None, tools=None):
        trl = dict(reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                   processing_class=processing_class, peft_config=peft_config, reward_weights=reward_weights)
        agents = dict(environment_factory=environment_factory, tools=tools)
        if isinstance(cfg, Config) and isinstance(model, (str, Path)):
            raise TypeError(f"GRPOTrainer({type(cfg).__name__}(...), {str(model)!r}): TRL's positional order is the "
                            f"model first, GRPOTrainer({str(model)!r}, reward_funcs, args, train_dataset); or name "
                            "them: GRPOTrainer(model=..., reward_funcs=..., args=...). (longrl's GRPOTrainer(cfg, "
                            "model=...) takes a loaded model; a model name goes in cfg.model.name_or_path)")
        if isinstance(cfg, Config) and all(v is None for v in trl.values()):  # longrl's own form
            rows = epochs_to_steps(cfg, None)  # read once: the recipe takes them instead of reading again
            super().__init__(cfg, model, tokenizer, scorer, rows=rows, callbacks=callbacks, **agents)
            return
        inputs = trainer_inputs((cfg, model, tokenizer, scorer), callbacks=callbacks,
                                environment=environment_factory is not None or bool(tools), **trl)
        self.resume_decided_at_train = True
        self.owns_given_scorer = True  # built here from reward_funcs: an environment's reward may join it
        super().__init__(inputs.cfg, inputs.model, inputs.tokenizer, inputs.scorer, rows=inputs.rows,
                         eval_rows=inputs.eval_rows, callbacks=inputs.callbacks, **agents)


class SFTTrainer(sft.SFTTrainer):
    """The supervised recipe (:class:`longrl.recipes.sft.SFTTrainer`) with TRL's signature as well:
    ``SFTTrainer(model=..., args=SFTConfig(...), train_dataset=..., eval_dataset=..., processing_class=...,
    peft_config=..., formatting_func=..., callbacks=...)`` (positionally too: model, args, data_collator,
    train_dataset, eval_dataset), or longrl's ``SFTTrainer(cfg, model=None, tokenizer=None, train_rows=None,
    eval_rows=None, callbacks=...)``."""

    def __init__(self, cfg=None, model=None, tokenizer=None, train_rows=None, eval_rows=None, *, args=None,
                 data_collator=None, train_dataset=None, eval_dataset=None, processing_class=None, peft_config=None,
                 formatting_func=None, callbacks=None):
        trl = dict(args=args, data_collator=data_collator, train_dataset=train_dataset, eval_dataset=eval_dataset,
                   processing_class=processing_class, peft_config=peft_config, formatting_func=formatting_func)
        if isinstance(cfg, Config) and isinstance(model, (str, Path)):
            raise TypeError(f"SFTTrainer({type(cfg).__name__}(...), {str(model)!r}): TRL's positional order is the "
                            f"model first, SFTTrainer({str(model)!r}, args, data_collator, train_dataset); or name "
                            "them: SFTTrainer(model=..., args=..., train_dataset=...). (longrl's SFTTrainer(cfg, "
                            "model=...) takes a loaded model; a model name goes in cfg.model.name_or_path)")
        if isinstance(cfg, Config):
            if any(v is not None for v in trl.values()):
                given = ", ".join(k for k, v in trl.items() if v is not None)
                raise TypeError(f"SFTTrainer(cfg, ...) is the Config API (model=, tokenizer=, train_rows=, "
                                f"eval_rows=); for {given} use TRL's form, SFTTrainer(model=..., args=cfg, ...)")
            super().__init__(cfg, model, tokenizer, train_rows, eval_rows, callbacks=callbacks)
            return
        inputs = sft_trainer_inputs((cfg, model, tokenizer, train_rows, eval_rows), callbacks=callbacks, **trl)
        self.resume_decided_at_train = True
        super().__init__(inputs.cfg, inputs.model, inputs.tokenizer, inputs.rows, inputs.eval_rows,
                         callbacks=inputs.callbacks)
