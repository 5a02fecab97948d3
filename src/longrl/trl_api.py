"""TRL's Python API over longrl's one config tree: ``GRPOConfig`` with TRL's flat field names, and the
normalisation of ``GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=..., peft_config=...)``'s
arguments into what the loop takes (a :class:`~longrl.config.Config`, a model and tokenizer, a reward scorer, rows).

Flat names map through ``longrl.trl_names.TRL_NAMES`` onto dotted keys; there is no second store of settings. The
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

from .config import Config, ConfigError, RewardSpec, _build, _convert, _set_dotted, config_keys, suggest_key, \
    trl_key, validate
from .trl_names import TRL_NAMES, FlatNameError

log = logging.getLogger(__name__)

_SECTIONS = tuple(f.name for f in fields(Config))
_BATCH_NAMES = ("per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
                "steps_per_generation")
_TRL_PER_DEVICE, _TRL_ACCUMULATION = 8, 1  # TrainingArguments' defaults, used when only one of the two is given
_BATCH_NOTE_SHORT = ("train.micro_batch_size = per_device_train_batch_size, train.prompts_per_step = "
                     "per_device_train_batch_size × gradient_accumulation_steps / num_generations")
_JOINT = (*_BATCH_NAMES, "warmup_ratio", "reward_weights")  # read together with other settings: constructor only


def _leaf_key(name: str) -> str | None:
    """The dotted key whose last part is ``name``, if exactly one key has it (e.g. prompts_per_step)."""
    same = [k for k in config_keys() if k.rsplit(".", 1)[-1] == name]
    return same[0] if len(same) == 1 else None


class GRPOConfig(Config):
    """A :class:`~longrl.config.Config` built from TRL ``GRPOConfig``'s flat names (``learning_rate=1e-5``), longrl's
    own names (``prompts_per_step=4``, ``**{"model.offload_activations": True}``, ``lora={"r": 8}``), or both.

    Unset values are longrl's defaults. Every value is checked here, as a YAML file's would be; TRL names without a
    longrl equivalent are refused with what to use instead. ``cfg.learning_rate`` reads ``cfg.train.learning_rate``.
    """

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
        batch = {n: flat.pop(n) for n in _BATCH_NAMES if n in flat}
        train_section = sections.get("train") if isinstance(sections.get("train"), dict) else {}
        pinned = [k for k in ("prompts_per_step", "micro_batch_size")
                  if k in flat or f"train.{k}" in flat or k in train_section]
        if batch and pinned:
            raise ConfigError(f"GRPOConfig: give TRL's batch sizes ({', '.join(batch)}) or longrl's "
                              f"({', '.join(pinned)}), not both: {_BATCH_NOTE_SHORT}")
        warmup_ratio = flat.pop("warmup_ratio", None)
        weights = flat.pop("reward_weights", None)
        for name, value in flat.items():
            for key, v in _flat_to_dotted(name, value).items():
                _set_dotted(tree, key, v)
        built = _build(Config, tree)
        for f in fields(Config):
            object.__setattr__(self, f.name, getattr(built, f.name))
        if batch:
            batch_arithmetic(self, **batch)
        if warmup_ratio is not None:
            self.train.warmup_steps = round(float(warmup_ratio) * self.train.max_steps)
        if weights is not None:
            if self.rewards and len(self.rewards) != len(weights):
                raise ConfigError(f"reward_weights: {len(weights)} weights for {len(self.rewards)} rewards")
            self.rewards = [RewardSpec(spec.function, float(w))
                            for spec, w in zip(self.rewards or [RewardSpec()] * len(weights), weights)]
        validate(self, require_rewards=False)

    def __getattr__(self, name: str):  # only for names that are not sections: TRL's flat names and unique leaves
        key = None if name.startswith("_") else trl_key(name) or _leaf_key(name)
        if key is None or "." not in key:
            raise AttributeError(f"GRPOConfig has no setting {name!r}" + (f"; {suggest_key(name)}"
                                                                         if suggest_key(name) else ""))
        node = self
        for part in key.split("."):
            node = getattr(node, part)
        return node

    def __setattr__(self, name: str, value) -> None:
        if name in _SECTIONS:
            object.__setattr__(self, name, value)
            return
        if name in _JOINT:
            raise ConfigError(f"{name} is read with the other batch and schedule settings: pass it to GRPOConfig(...)")
        for key, v in _flat_to_dotted(name, value).items():
            section, leaf = key.rsplit(".", 1)
            node = self
            for part in section.split("."):
                node = getattr(node, part)
            setattr(node, leaf, _convert(v, typing.get_type_hints(type(node))[leaf], key))
        validate(self, require_rewards=False)


def _flat_to_dotted(name: str, value) -> dict:
    """{dotted key: longrl value} for one flat argument (a TRL name, a dotted key or a unique leaf name)."""
    if "." in name:
        return {name: value}
    entry = TRL_NAMES.get(name)
    if entry is not None:
        key = trl_key(name)
        if name == "model_init_kwargs":
            return _model_init_kwargs(value)
        if key is None:
            raise ConfigError(f"GRPOConfig({name}=...): {suggest_key(name)}")
        try:
            value = entry.convert(value) if entry.convert else value
        except FlatNameError as e:
            raise ConfigError(f"GRPOConfig({name}=...): {e}") from None
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
        raise ConfigError(f"GRPOConfig got an unknown argument {name!r}{'; ' + hint if hint else ''}")
    return {key: value}


def _model_init_kwargs(kwargs) -> dict:
    """TRL's model_init_kwargs (from_pretrained arguments) → model.* keys; others refused."""
    known = {"dtype": "model.dtype", "torch_dtype": "model.dtype", "attn_implementation": "model.attn_implementation",
             "revision": "model.revision", "trust_remote_code": "model.trust_remote_code"}
    out = {}
    for k, v in (kwargs or {}).items():
        if k not in known:
            raise ConfigError(f"GRPOConfig(model_init_kwargs={{{k!r}: ...}}): longrl loads models itself; supported: "
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
    from .callbacks import check_callbacks

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

    if args is not None and not isinstance(args, Config):
        raise TypeError(f"GRPOTrainer(args=...) takes a longrl.GRPOConfig (or longrl.Config); got "
                        f"{type(args).__module__}.{type(args).__name__}: build it with `from longrl import GRPOConfig` "
                        "and the same arguments")
    cfg = copy.deepcopy(args) if args is not None else GRPOConfig()
    if model is None:
        raise TypeError("GRPOTrainer needs a model: a hub id or local directory, a transformers model or a PEFT model")
    if isinstance(model, (str, Path)):
        cfg.model.name_or_path = str(model)
        model = None
    if peft_config is not None:
        lora_from_peft(cfg, peft_config)
    rows = eval_rows = None
    if train_dataset is not None:
        rows = dataset_rows(train_dataset, "train_dataset")
        if rows is None:
            cfg.data.source = str(train_dataset)
        else:
            cfg.data.source = f"memory:{_fingerprint(rows)}"
    if eval_dataset is not None:
        eval_rows, cfg.data.eval_source = held_out_rows(cfg, eval_dataset)
    only_environment = environment and reward_funcs is None and not cfg.rewards
    scorer = None if only_environment else reward_scorer(cfg, reward_funcs, reward_weights)
    validate(cfg, require_rewards=not only_environment)
    return TrainerInputs(cfg, model, processing_class, scorer, rows, eval_rows, check_callbacks(callbacks or []))


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
    from .data import read_prompt_rows
    from .evaluation import eval_data_config, read_eval_rows

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
    from .rewards import RewardScorer, load_reward_function

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

    from .models import ModelLoadError, base_model

    name = getattr(base_model(model).config, "_name_or_path", "")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"no tokenizer found for the given model ({name or 'no name_or_path'}): pass "
                             f"processing_class=tokenizer ({type(e).__name__}: {e})") from e


def describe_model(cfg: Config, model, had_adapters: bool) -> None:
    """cfg.model (and cfg.lora for a model that came with adapters) as the given model really is: checkpoints record
    it, ``longrl export`` reads it."""
    from .models import base_model

    base = base_model(model)
    name = getattr(base, "name_or_path", None) or getattr(base.config, "_name_or_path", "") or "in-memory-model"
    cfg.model.name_or_path = str(name)
    cfg.model.dtype = str(base.get_input_embeddings().weight.dtype).removeprefix("torch.")
    cfg.model.load_in_4bit = bool(getattr(base, "is_loaded_in_4bit", False) or
                                  getattr(base, "longrl_quant_report", None) is not None)
    if had_adapters:
        lora_from_peft(cfg, next(iter(model.peft_config.values())))


def flat_name_table() -> str:
    """The Markdown table of TRL's flat names and the longrl keys they set (docs/api.md holds it; a test keeps the
    two equal)."""
    lines = ["| TRL name | longrl key | how it maps |", "|---|---|---|"]
    for name, entry in TRL_NAMES.items():
        key = trl_key(name)
        shown = "rewards[i].weight" if key == "rewards" else key
        lines.append(f"| `{name}` | {f'`{shown}`' if key else '—'} | "
                     f"{entry.note or ('' if key else 'not in this version of longrl')} |")
    return "\n".join(lines) + "\n"


TABLE_BEGIN, TABLE_END = "<!-- flat-names:begin (python -m longrl.trl_api) -->\n", "<!-- flat-names:end -->\n"


def write_table(doc: Path) -> None:
    """Rewrite the flat-name table between the markers of ``doc`` (docs/api.md)."""
    text = doc.read_text()
    head, _, rest = text.partition(TABLE_BEGIN)
    _, _, tail = rest.partition(TABLE_END)
    doc.write_text(head + TABLE_BEGIN + flat_name_table() + TABLE_END + tail)


if __name__ == "__main__":
    write_table(Path(__file__).resolve().parents[2] / "docs" / "api.md")
