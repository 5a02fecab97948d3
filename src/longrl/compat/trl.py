"""TRL's Python API over longrl's one config tree: ``GRPOConfig`` with TRL's flat field names, and the
normalisation of ``GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=..., peft_config=...)``'s
arguments into what the loop takes (a :class:`~longrl.config.schema.Config`, a model and tokenizer, a reward scorer, rows).

Flat names map through ``longrl.config.trl_names.TRL_NAMES`` onto dotted keys; there is no second store of settings. The
batch is counted as TRL counts it: per_device_train_batch_size × gradient_accumulation_steps completions an
optimizer step (one process), i.e. train.prompts_per_step × grpo.num_generations, with per_device_train_batch_size
completions a forward/backward (train.micro_batch_size).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..config.errors import ConfigError
from ..config.keys import config_keys, suggest_key, trl_key
from ..config.loading import _build, _convert, _set_dotted
from ..config.schema import Config, RewardSpec
from ..config.validation import validate
from ..config.trl_names import GRPO_ONLY, SFT_BATCH_NOTE, SFT_NAMES, TRL_NAMES, TRL_SFT_NAMES, FlatNameError

log = logging.getLogger(__name__)

_SECTIONS = tuple(f.name for f in fields(Config))
_BATCH_NAMES = ("per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
                "steps_per_generation")
_TRL_PER_DEVICE, _TRL_ACCUMULATION = 8, 1  # TrainingArguments' defaults, used when only one of the two is given
_BATCH_NOTE_SHORT = ("train.micro_batch_size = per_device_train_batch_size, train.prompts_per_step = "
                     "per_device_train_batch_size × gradient_accumulation_steps / num_generations")


def _leaf_key(name: str) -> str | None:
    """The dotted key whose last part is ``name``, if exactly one key has it (e.g. prompts_per_step)."""
    same = [k for k in config_keys() if k.rsplit(".", 1)[-1] == name]
    return same[0] if len(same) == 1 else None


class _FlatConfig(Config):
    """A :class:`~longrl.config.schema.Config` built from one recipe's TRL flat names (``_names``), longrl's own names
    (``prompts_per_step=4``, ``**{"model.offload_activations": True}``, ``lora={"r": 8}``), or both. ``_joint``:
    names read together with other settings (constructor only), handed to :meth:`_apply_joint` once the tree is
    built; ``_refused``: {TRL name of another recipe: why}."""

    _names: dict = TRL_NAMES
    _joint: tuple = ()
    _refused: dict = {}

    def __init__(self, **kwargs):
        tree = Config().to_dict()
        flat, sections = {}, {}
        for name, value in kwargs.items():
            if name in _SECTIONS:
                sections[name] = value
            else:
                flat[name] = value
        for name, value in sections.items():  # whole sections first, single keys over them
            if name == "rewards" and isinstance(value, (list, tuple)):
                value = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in value]
            elif dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            if isinstance(value, dict) and isinstance(tree.get(name), dict):
                tree[name].update(value)
            else:
                tree[name] = value  # a wrong type is reported by _build, naming the key
        joint = {n: flat.pop(n) for n in self._joint if n in flat}
        self._check_joint(joint, flat, sections)
        for name, value in flat.items():
            for key, v in _flat_to_dotted(name, value, type(self)).items():
                _set_dotted(tree, key, v)
        built = _build(Config, tree)
        for f in fields(Config):
            object.__setattr__(self, f.name, getattr(built, f.name))
        self._apply_joint(joint)
        validate(self, require_rewards=False)

    def _check_joint(self, joint: dict, flat: dict, sections: dict) -> None:
        """Refuse combinations of joint names with other arguments, before anything is built."""

    def _apply_joint(self, joint: dict) -> None:
        """Set what the joint names mean on the built tree."""

    def __getattr__(self, name: str):  # only for names that are not sections: TRL's flat names and unique leaves
        key = None if name.startswith("_") else trl_key(name, self._names) or _leaf_key(name)
        if key is None or "." not in key:
            raise AttributeError(f"{type(self).__name__} has no setting {name!r}" + (
                f"; {suggest_key(name)}" if suggest_key(name) else ""))
        node = self
        for part in key.split("."):
            node = getattr(node, part)
        return node

    def __setattr__(self, name: str, value) -> None:
        if name in _SECTIONS:
            object.__setattr__(self, name, value)
            return
        if name in self._joint:
            raise ConfigError(f"{name} is read with the other batch and schedule settings: pass it to "
                              f"{type(self).__name__}(...)")
        for key, v in _flat_to_dotted(name, value, type(self)).items():
            section, leaf = key.rsplit(".", 1)
            node = self
            for part in section.split("."):
                node = getattr(node, part)
            setattr(node, leaf, _convert(v, typing.get_type_hints(type(node))[leaf], key))
        validate(self, require_rewards=False)


def _pinned(flat: dict, sections: dict, section: str, keys: tuple) -> list[str]:
    """The longrl keys among ``section.keys`` given directly (leaf, dotted, or in a whole section)."""
    given = sections.get(section) if isinstance(sections.get(section), dict) else {}
    return [k for k in keys if k in flat or f"{section}.{k}" in flat or k in given]


class GRPOConfig(_FlatConfig):
    """A :class:`~longrl.config.schema.Config` built from TRL ``GRPOConfig``'s flat names (``learning_rate=1e-5``), longrl's
    own names (``prompts_per_step=4``, ``**{"model.offload_activations": True}``, ``lora={"r": 8}``), or both.

    Unset values are longrl's defaults. Every value is checked here, as a YAML file's would be; TRL names without a
    longrl equivalent are refused with what to use instead. ``cfg.learning_rate`` reads ``cfg.train.learning_rate``.
    """

    _names = TRL_NAMES
    _joint = (*_BATCH_NAMES, "warmup_ratio", "reward_weights")

    def _check_joint(self, joint, flat, sections):
        batch = [n for n in _BATCH_NAMES if n in joint]
        pinned = _pinned(flat, sections, "train", ("prompts_per_step", "micro_batch_size"))
        if batch and pinned:
            raise ConfigError(f"GRPOConfig: give TRL's batch sizes ({', '.join(batch)}) or longrl's "
                              f"({', '.join(pinned)}), not both: {_BATCH_NOTE_SHORT}")

    def _apply_joint(self, joint):
        batch = {n: joint[n] for n in _BATCH_NAMES if n in joint}
        if batch:
            batch_arithmetic(self, **batch)
        if joint.get("warmup_ratio") is not None:
            self.train.warmup_steps = round(float(joint["warmup_ratio"]) * self.train.max_steps)
        weights = joint.get("reward_weights")
        if weights is not None:
            if self.rewards and len(self.rewards) != len(weights):
                raise ConfigError(f"reward_weights: {len(weights)} weights for {len(self.rewards)} rewards")
            self.rewards = [RewardSpec(spec.function, float(w))
                            for spec, w in zip(self.rewards or [RewardSpec()] * len(weights), weights)]


_SFT_BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps")
_TRL_EPOCHS = 3.0  # TrainingArguments' num_train_epochs, used when max_steps=-1 and no num_train_epochs is given


class SFTConfig(_FlatConfig):
    """A :class:`~longrl.config.schema.Config` for ``longrl sft`` built from TRL ``SFTConfig``'s flat names
    (``max_length=2048, packing=True, assistant_only_loss=True``), longrl's own names, or both; GRPO's own names
    (``beta``, ``num_generations``, ...) are refused.

    The batch is counted as TRL counts it (one process): per_device_train_batch_size × gradient_accumulation_steps
    examples an optimizer step (sft.examples_per_step), per_device_train_batch_size a forward/backward
    (train.micro_batch_size), or with ``packing=True`` per_device_train_batch_size × max_length tokens packed into one
    row (train.micro_batch_tokens). ``num_train_epochs`` sets sft.num_train_epochs (the steps follow from the
    number of examples); ``max_steps`` > 0 overrides it, as in TRL. Unset values are longrl's defaults.
    """

    _names = TRL_SFT_NAMES
    _joint = (*_SFT_BATCH, "packing", "warmup_ratio", "num_train_epochs", "max_steps")
    _refused = {n: "GRPO's (the objective, sampling or rewards); a supervised run has no such setting"
                for n in GRPO_ONLY if n not in TRL_SFT_NAMES}

    def _check_joint(self, joint, flat, sections):
        batch = [n for n in _SFT_BATCH if n in joint]
        pinned = (_pinned(flat, sections, "sft", ("examples_per_step",))
                  + _pinned(flat, sections, "train", ("micro_batch_size",)))
        if batch and pinned:
            raise ConfigError(f"SFTConfig: give TRL's batch sizes ({', '.join(batch)}) or longrl's "
                              f"({', '.join(pinned)}), not both: {SFT_BATCH_NOTE}")
        if joint.get("warmup_ratio") is not None and self._epochs(joint) is not None:
            raise ConfigError("SFTConfig(warmup_ratio=...) with num_train_epochs: the number of steps is known only "
                              "once the data is read; give warmup_steps, or max_steps")
        for name in ("max_steps", "num_train_epochs"):
            if name in joint and joint[name] is not None and not isinstance(joint[name], (int, float)):
                raise ConfigError(f"SFTConfig({name}={joint[name]!r}): expected a number")

    @staticmethod
    def _epochs(joint: dict) -> float | None:
        """TRL's rule: max_steps > 0 decides; else num_train_epochs (TRL's default 3 when max_steps=-1 alone)."""
        steps = joint.get("max_steps")
        if steps is not None and steps > 0:
            return None
        if joint.get("num_train_epochs") is not None:
            return float(joint["num_train_epochs"])
        return _TRL_EPOCHS if steps is not None else None

    def _apply_joint(self, joint):
        epochs = self._epochs(joint)
        if epochs is not None:
            self.sft.num_train_epochs = _convert(epochs, float, "sft.num_train_epochs")
        elif joint.get("max_steps") is not None:
            self.train.max_steps = _convert(joint["max_steps"], int, "train.max_steps")
            self.sft.num_train_epochs = None
        per_device = joint.get("per_device_train_batch_size")
        if any(n in joint for n in _SFT_BATCH):
            per_device = per_device or _TRL_PER_DEVICE
            self.train.micro_batch_size = per_device
            self.sft.examples_per_step = per_device * (joint.get("gradient_accumulation_steps") or _TRL_ACCUMULATION)
        if joint.get("packing"):
            self.train.micro_batch_tokens = (per_device or self.train.micro_batch_size) * self.sft.max_length
            self.train.padding_free = True
        if joint.get("warmup_ratio") is not None:
            self.train.warmup_steps = round(float(joint["warmup_ratio"]) * self.train.max_steps)


def _flat_to_dotted(name: str, value, cls=GRPOConfig) -> dict:
    """{dotted key: longrl value} for one flat argument of ``cls`` (a TRL name of its table, a dotted key or a
    unique leaf name)."""
    if "." in name:
        return {name: value}
    what = cls.__name__
    if name in cls._refused:
        raise ConfigError(f"{what}({name}=...): TRL's {name} is {cls._refused[name]}")
    entry = cls._names.get(name)
    if entry is not None:
        key = trl_key(name, cls._names)
        if name == "model_init_kwargs":
            return _model_init_kwargs(value, what)
        if entry.key is None and entry.convert is not None:  # accepted; it changes no result
            try:
                entry.convert(value)
            except FlatNameError as e:
                raise ConfigError(f"{what}({name}=...): {e}") from None
            return {}
        if key is None:
            raise ConfigError(f"{what}({name}=...): " + (suggest_key(name) if name in TRL_NAMES else
                                                         f"TRL's {name} has no longrl key: {entry.note}"))
        try:
            value = entry.convert(value) if entry.convert else value
        except FlatNameError as e:
            raise ConfigError(f"{what}({name}=...): {e}") from None
        if name == "vllm_importance_sampling_correction":
            return {} if value else {key: "none"}
        if name in ("log_completions", "num_completions_to_print"):
            return {key: 0} if value is False else {} if value in (True, None) else {key: value}
        if name == "resume_from_checkpoint":
            return {key: bool(value)}
        return {key: value}
    key = _leaf_key(name)
    if key is None:
        hint = suggest_key(name)
        raise ConfigError(f"{what} got an unknown argument {name!r}{'; ' + hint if hint else ''}")
    return {key: value}


def _model_init_kwargs(kwargs, what: str = "GRPOConfig") -> dict:
    """TRL's model_init_kwargs (from_pretrained arguments) → model.* keys; others refused."""
    known = {"dtype": "model.dtype", "torch_dtype": "model.dtype", "attn_implementation": "model.attn_implementation",
             "revision": "model.revision", "trust_remote_code": "model.trust_remote_code"}
    out = {}
    for k, v in (kwargs or {}).items():
        if k not in known:
            raise ConfigError(f"{what}(model_init_kwargs={{{k!r}: ...}}): longrl loads models itself; supported: "
                              f"{', '.join(known)}")
        out[known[k]] = str(v).removeprefix("torch.") if k.endswith("dtype") else v
    return out


def batch_arithmetic(cfg: Config, per_device_train_batch_size=None, gradient_accumulation_steps=None,
                     generation_batch_size=None, steps_per_generation=None) -> None:
    """TRL's batch sizes (one process) onto longrl's: train.micro_batch_size = per_device_train_batch_size,
    train.prompts_per_step = per_device × accumulation / num_generations, and (where the tree has it)
    grpo.steps_per_generation = TRL's steps_per_generation / accumulation = generation_batch_size / (per_device ×
    accumulation): the optimizer steps one rollout serves. Without that key, one rollout an optimizer step."""
    per_device = per_device_train_batch_size or _TRL_PER_DEVICE
    accumulation = gradient_accumulation_steps or _TRL_ACCUMULATION
    completions, g = per_device * accumulation, cfg.grpo.num_generations
    if steps_per_generation is not None and generation_batch_size is not None:
        raise ConfigError("'generation_batch_size' and 'steps_per_generation' cannot both be set (as in TRL)")
    shared = 1  # optimizer steps one rollout serves
    if steps_per_generation is not None:
        shared, rest = divmod(steps_per_generation, accumulation)
        if rest or not shared:
            raise ConfigError(f"steps_per_generation={steps_per_generation}: longrl shares a rollout over whole "
                              f"optimizer steps: a multiple of gradient_accumulation_steps={accumulation}")
    if generation_batch_size is not None:
        shared, rest = divmod(generation_batch_size, completions)
        if rest or not shared:
            raise ConfigError(f"generation_batch_size={generation_batch_size}: longrl shares a rollout over whole "
                              f"optimizer steps: a multiple of per_device_train_batch_size × "
                              f"gradient_accumulation_steps = {completions} completions")
    if shared != 1:
        if "grpo.steps_per_generation" not in config_keys():
            raise ConfigError(f"steps_per_generation / generation_batch_size: {shared} optimizer steps a rollout; this "
                              "version samples one rollout an optimizer step (grpo.num_iterations reuses one)")
        cfg.grpo.steps_per_generation = shared
    if completions % g:
        raise ConfigError(f"per_device_train_batch_size × gradient_accumulation_steps = {completions} completions an "
                          f"optimizer step is not a multiple of num_generations={g}: longrl's train.prompts_per_step "
                          f"(= completions / num_generations) must be whole")
    cfg.train.micro_batch_size = per_device
    cfg.train.prompts_per_step = completions // g


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
        cfg.data.source = str(train_dataset) if rows is None else f"memory:{_fingerprint(rows)}"
    return model, rows


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
    if formatting_func is not None:
        d = cfg.data
        rows = _formatted(rows if rows is not None else read_rows(d.source, d.split, d.num_examples, cfg.train.seed),
                          formatting_func, cfg.sft.text_column, "train_dataset")
        cfg.data.source = f"memory:{_fingerprint(rows)}"
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
            cfg.data.eval_source = f"memory:{_fingerprint(eval_rows)}"
    validate(cfg, require_rewards=False)
    return TrainerInputs(cfg, model, processing_class, None, rows, eval_rows, check_callbacks(callbacks or []))


def _formatted(rows: list[dict], formatting_func, column: str, name: str) -> list[dict]:
    """TRL's formatting_func: each row → {column: formatting_func(row)}, a text row."""
    out = []
    for i, row in enumerate(rows):
        text = formatting_func(row)
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


def dataset_rows(dataset, name: str) -> list[dict] | None:
    """Rows of a ``datasets.Dataset`` or a list of dicts; None for a path (the data layer reads it)."""
    if isinstance(dataset, (str, Path)):
        return None
    kind = type(dataset).__name__
    if kind in ("DatasetDict", "IterableDatasetDict") or isinstance(dataset, dict):
        splits = ", ".join(map(str, dataset.keys())) if hasattr(dataset, "keys") else ""
        raise ConfigError(f"{name}: a dict of splits ({splits}); pass one split, e.g. {name}=dataset['train']")
    if kind == "IterableDataset":
        raise ConfigError(f"{name}: an IterableDataset has no length (longrl shuffles by epoch and resumes by "
                          "position); materialise it: datasets.Dataset.from_list(list(ds.take(N)))")
    if isinstance(dataset, list):
        bad = next((i for i, r in enumerate(dataset) if not isinstance(r, dict)), None)
        if bad is not None:
            raise ConfigError(f"{name} row {bad + 1}: expected a dict of columns; got {type(dataset[bad]).__name__}")
        return [dict(r) for r in dataset]
    if hasattr(dataset, "column_names") and hasattr(dataset, "__len__"):
        return [dict(r) for r in dataset]
    raise ConfigError(f"{name}: expected a datasets.Dataset, a list of dicts or a file path; got {kind}")


def held_out_rows(cfg: Config, dataset) -> tuple[list[dict], str]:
    """(rows, source) of an eval dataset given as TRL's eval_dataset, read and checked as data.eval_source's are;
    rows in memory get the source ``memory:<digest>``."""
    from ..data.prompts import read_prompt_rows
    from ..training.evaluation import eval_data_config, read_eval_rows

    rows = dataset_rows(dataset, "eval_dataset")
    if rows is None:
        return read_eval_rows(cfg, str(dataset)), str(dataset)
    source = f"memory:{_fingerprint(rows)}"
    return read_prompt_rows(eval_data_config(cfg, source), rows=rows), source


def _fingerprint(rows: list[dict]) -> str:
    """A digest of the rows' content, recorded as data.source so a resume with other rows is refused."""
    text = json.dumps(rows, sort_keys=True, default=str)
    return f"{len(rows)}-rows-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def reward_scorer(cfg: Config, reward_funcs, reward_weights):
    """A RewardScorer from callables and/or 'file.py:function' strings; cfg.rewards records them."""
    from ..rewards import RewardScorer, load_reward_function

    if reward_funcs is None:
        if not cfg.rewards or any(":" not in r.function for r in cfg.rewards):
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

    base = base_model(model)
    name = getattr(base, "name_or_path", None) or getattr(base.config, "_name_or_path", "") or "in-memory-model"
    cfg.model.name_or_path = str(name)
    cfg.model.dtype = str(base.get_input_embeddings().weight.dtype).removeprefix("torch.")
    cfg.model.load_in_4bit = bool(getattr(base, "is_loaded_in_4bit", False) or
                                  getattr(base, "longrl_quant_report", None) is not None)
    if had_adapters:
        lora_from_peft(cfg, next(iter(model.peft_config.values())))


def flat_name_table(names: dict | None = None) -> str:
    """The Markdown table of TRL's flat names (``names``: TRL_NAMES, or SFT_NAMES) and the longrl keys they set
    (docs/api.md holds both; a test keeps them equal)."""
    names = TRL_NAMES if names is None else names
    lines = ["| TRL name | longrl key | how it maps |", "|---|---|---|"]
    for name, entry in names.items():
        key = trl_key(name, names)
        shown = "rewards[i].weight" if key == "rewards" else key
        note = entry.note or ("" if key else "not in this version of longrl")
        if entry.key is None and entry.convert is not None:
            note = f"accepted, sets nothing: {note}"
        lines.append(f"| `{name}` | {f'`{shown}`' if key else '—'} | {note} |")
    return "\n".join(lines) + "\n"


TABLE_BEGIN, TABLE_END = "<!-- flat-names:begin (python -m longrl.compat.trl) -->\n", "<!-- flat-names:end -->\n"
SFT_TABLE_BEGIN, SFT_TABLE_END = "<!-- sft-names:begin (python -m longrl.compat.trl) -->\n", "<!-- sft-names:end -->\n"


def write_table(doc: Path) -> None:
    """Rewrite the flat-name tables between the markers of ``doc`` (docs/api.md): GRPOConfig's, SFTConfig's own."""
    text = doc.read_text()
    for begin, end, names in ((TABLE_BEGIN, TABLE_END, TRL_NAMES), (SFT_TABLE_BEGIN, SFT_TABLE_END, SFT_NAMES)):
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        text = head + begin + flat_name_table(names) + end + tail
    doc.write_text(text)


if __name__ == "__main__":
    write_table(Path(__file__).resolve().parents[3] / "docs" / "api.md")
