"""TRL's configuration API over longrl's one config tree: ``GRPOConfig`` and ``SFTConfig`` with TRL's flat field
names (imports nothing heavy; the trainers are compat/trl.py's).

Flat names map through ``longrl.config.trl_names.TRL_NAMES`` onto dotted keys; there is no second store of settings. The
batch is counted as TRL counts it: per_device_train_batch_size × gradient_accumulation_steps completions an
optimizer step (one process), i.e. train.prompts_per_step × grpo.num_generations, with per_device_train_batch_size
completions a forward/backward (train.micro_batch_size).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import typing
from dataclasses import fields
from pathlib import Path

from ..config.errors import ConfigError
from ..config.keys import config_keys, suggest_key, trl_key
from ..config.loading import _build, _convert, _set_dotted
from ..config.schema import Config, RewardSpec
from ..config.validation import validate
from ..config.trl_names import GRPO_ONLY, SFT_BATCH_NOTE, SFT_NAMES, TRL_NAMES, TRL_SFT_NAMES, UNSET, Accepts, \
    FlatNameError

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
    built; ``_refused``: {TRL name of another recipe: why}. Every argument that cannot be used is listed in one
    :class:`ConfigError`, each with what to use instead or why."""

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
        warmup = flat.get("warmup_steps")
        if isinstance(warmup, float) and 0 < warmup < 1 and "warmup_ratio" not in flat:  # transformers 5: a share
            flat["warmup_ratio"] = flat.pop("warmup_steps")
        joint = {n: flat.pop(n) for n in (*self._joint, "eval_strategy") if n in flat}
        what = type(self).__name__
        refused: list[Refusal | ConfigError] = []  # every argument that cannot be used: reported together
        if _eval_strategy(joint.get("eval_strategy")):
            refused.append(Refusal(what, "eval_strategy", joint["eval_strategy"],
                                   _eval_strategy(joint["eval_strategy"])))
        for name, value in flat.items():
            try:
                for key, v in _flat_to_dotted(name, value, type(self)).items():
                    if _key_type(key) is not None:  # a wrong type, named with its argument
                        _convert(v, _key_type(key), key)
                    _set_dotted(tree, key, v)
            except Refusal as e:
                refused.append(e)
            except ConfigError as e:
                refused.append(Refusal(what, name, value, str(e)))
        try:
            self._check_joint(joint, flat, sections)
        except ConfigError as e:
            refused.append(e)
        if len(refused) == 1:
            raise ConfigError(str(refused[0]))
        if refused:
            raise ConfigError(f"{what}: {len(refused)} arguments cannot be used:\n  - "
                              + "\n  - ".join(getattr(r, "line", str(r)) for r in refused))
        built = _build(Config, tree)
        for f in fields(Config):
            object.__setattr__(self, f.name, getattr(built, f.name))
        if joint.get("eval_strategy") == "no":
            self.output.eval_steps = 0
        self._apply_joint(joint, flat)
        validate(self, require_rewards=False)

    def _check_joint(self, joint: dict, flat: dict, sections: dict) -> None:
        """Refuse combinations of joint names with other arguments, before anything is built."""

    def _apply_joint(self, joint: dict, flat: dict) -> None:
        """Set what the joint names mean on the built tree (``flat``: the other flat arguments)."""

    def __getattr__(self, name: str):  # only for names that are not sections: TRL's flat names and unique leaves
        if name == "num_train_epochs" and "num_train_epochs" in self._joint and "_trl_epochs" in self.__dict__:
            return self.__dict__["_trl_epochs"]  # GRPOConfig: the epochs until the trainer counts the prompts
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
        if name in self._joint or name == "eval_strategy":
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

    Unset values are longrl's defaults. Every value is checked here, as a YAML file's would be; a value longrl cannot
    honour is refused with what to use instead, all of one call in one error. ``num_train_epochs`` (or
    ``max_steps=-1``) is held until the trainer counts the prompts (:func:`apply_epochs`); ``max_steps`` > 0 wins
    over it, as in TRL. ``cfg.learning_rate`` reads ``cfg.train.learning_rate``.
    """

    _names = TRL_NAMES
    _joint = (*_BATCH_NAMES, "warmup_ratio", "reward_weights", "num_train_epochs")

    def _check_joint(self, joint, flat, sections):
        batch = [n for n in _BATCH_NAMES if n in joint]
        pinned = _pinned(flat, sections, "train", ("prompts_per_step", "micro_batch_size"))
        if batch and pinned:
            raise ConfigError(f"GRPOConfig: give TRL's batch sizes ({', '.join(batch)}) or longrl's "
                              f"({', '.join(pinned)}), not both: {_BATCH_NOTE_SHORT}")
        epochs = joint.get("num_train_epochs")
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or epochs <= 0):
            raise ConfigError(f"GRPOConfig(num_train_epochs={epochs!r}): expected a number > 0")
        if joint.get("warmup_ratio") is not None and _epochs(joint, flat) is not None:
            raise ConfigError("GRPOConfig(warmup_ratio=...) with num_train_epochs: the number of steps is known only "
                              "once the data is read; give warmup_steps, or max_steps")

    def _apply_joint(self, joint, flat):
        batch = {n: joint[n] for n in _BATCH_NAMES if n in joint}
        if batch:
            batch_arithmetic(self, **batch)
        if joint.get("warmup_ratio") is not None:
            self.train.warmup_steps = round(float(joint["warmup_ratio"]) * self.train.max_steps)
        epochs = _epochs(joint, flat)
        object.__setattr__(self, "_trl_epochs", epochs)  # steps follow once the trainer reads the data
        if epochs is not None:  # until then: longrl's default, in whole rollouts (validation needs a step count)
            per_rollout = self.grpo.num_iterations * self.grpo.steps_per_generation
            self.train.max_steps = -(-self.train.max_steps // per_rollout) * per_rollout
        weights = joint.get("reward_weights")
        if weights is not None:
            if self.rewards and len(self.rewards) != len(weights):
                raise ConfigError(f"reward_weights: {len(weights)} weights for {len(self.rewards)} rewards")
            self.rewards = [dataclasses.replace(spec, weight=float(w))
                            for spec, w in zip(self.rewards or [RewardSpec()] * len(weights), weights)]


_SFT_BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps")
_TRL_EPOCHS = 3.0  # TrainingArguments' num_train_epochs, used when max_steps=-1 and no num_train_epochs is given


def _epochs(joint: dict, flat: dict) -> float | None:
    """TRL's rule: max_steps > 0 decides; else num_train_epochs (TRL's default 3 when max_steps=-1 alone); None:
    max_steps (given, or longrl's default when neither is)."""
    steps = flat.get("max_steps", joint.get("max_steps"))
    if steps is not None and steps > 0:
        return None
    if joint.get("num_train_epochs") is not None:
        return float(joint["num_train_epochs"])
    return _TRL_EPOCHS if steps is not None else None


def trl_epochs(cfg) -> float | None:
    """The epoch count a GRPOConfig holds until the trainer reads the data (None: train.max_steps counts)."""
    return cfg.__dict__.get("_trl_epochs")


def steps_for_epochs(cfg, epochs: float, num_rows: int) -> int:
    """TRL's GRPO step count for ``epochs`` passes over ``num_rows`` prompts: each rollout batch draws U =
    prompts_per_step × steps_per_generation prompts (an incomplete last batch is dropped, as TRL's RepeatSampler
    drops it) and serves P = num_iterations × steps_per_generation optimizer steps, so
    max_steps = ceil(epochs × floor(num_rows / U) × P), rounded up to a multiple of P."""
    g, t = cfg.grpo, cfg.train
    per_batch, per_rollout = t.prompts_per_step * g.steps_per_generation, g.num_iterations * g.steps_per_generation
    batches = num_rows // per_batch
    if batches == 0:
        raise ConfigError(f"num_train_epochs={epochs:g}: {num_rows} prompts are fewer than one rollout batch draws "
                          f"(train.prompts_per_step × grpo.steps_per_generation = {per_batch}); give max_steps")
    steps = math.ceil(epochs * batches * per_rollout)
    return -(-steps // per_rollout) * per_rollout


def apply_epochs(cfg, num_rows: int) -> None:
    """A GRPOConfig's epoch count turned into train.max_steps now that the prompts are counted (logged)."""
    epochs = trl_epochs(cfg)
    if epochs is None:
        return
    cfg.train.max_steps = steps_for_epochs(cfg, epochs, num_rows)
    object.__setattr__(cfg, "_trl_epochs", None)
    log.info("num_train_epochs=%g over %d prompts: %d optimizer steps", epochs, num_rows, cfg.train.max_steps)
    validate(cfg, require_rewards=False)


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
        if joint.get("warmup_ratio") is not None and _epochs(joint, flat) is not None:
            raise ConfigError("SFTConfig(warmup_ratio=...) with num_train_epochs: the number of steps is known only "
                              "once the data is read; give warmup_steps, or max_steps")
        for name in ("max_steps", "num_train_epochs"):
            if name in joint and joint[name] is not None and not isinstance(joint[name], (int, float)):
                raise ConfigError(f"SFTConfig({name}={joint[name]!r}): expected a number")

    def _apply_joint(self, joint, flat):
        epochs = _epochs(joint, flat)
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


class Refusal(ConfigError):
    """One flat argument that cannot be used: ``line`` says which, with what to use instead or why."""

    def __init__(self, what: str, name: str, value, reason: str):
        self.line = f"{name}={_shown(value)}: {reason}"
        super().__init__(f"{what}({name}={_shown(value)}): {reason}")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _flat_to_dotted(name: str, value, cls=GRPOConfig) -> dict:
    """{dotted key: longrl value} for one flat argument of ``cls`` (a TRL name of its table, a dotted key or a
    unique leaf name); an accepted name that changes nothing gives {}; one that cannot be used raises
    :class:`Refusal`."""
    if "." in name:
        return {name: value}
    what = cls.__name__
    if name in cls._refused:
        raise Refusal(what, name, value, f"TRL's {name} is {cls._refused[name]}")
    entry = cls._names.get(name)
    if entry is None:
        key = _leaf_key(name)
        if key is None:
            hint = suggest_key(name)
            raise Refusal(what, name, value, f"not an argument of TRL's {what} or a longrl key"
                          + (f"; {hint}" if hint else ""))
        return {key: value}
    if name == "model_init_kwargs":
        return _model_init_kwargs(value, what)
    key = trl_key(name, cls._names)
    if entry.key is not None and key is None:
        raise Refusal(what, name, value, suggest_key(name) or f"TRL's {name} has no longrl key: {entry.note}")
    if entry.key is None and entry.convert is None:
        raise Refusal(what, name, value, f"TRL's {name} has no longrl key: {entry.note}")
    try:
        value = entry.convert(value) if entry.convert else value
    except FlatNameError as e:
        raise Refusal(what, name, value, str(e)) from None
    if value is UNSET or key is None:  # accepted: it describes what longrl does, or changes no result
        return {}
    if name == "vllm_importance_sampling_correction":
        return {} if value else {key: "none"}
    if name in ("log_completions", "num_completions_to_print"):
        return {key: 0} if value is False else {} if value is True else {key: value}
    if name == "resume_from_checkpoint":
        return {key: bool(value)}
    return {key: value}


def _eval_strategy(value) -> str | None:
    """Why TRL's eval_strategy cannot be used (None: it can): no (output.eval_steps=0) or steps."""
    if value is None or value in ("no", "steps"):
        return None
    return "no (output.eval_steps=0) or steps (every eval_steps steps); longrl counts steps, not epochs"


def _key_type(key: str):
    """The type of the dotted config key ``key``, or None when it is not a leaf of the tree."""
    node = Config
    for part in key.split("."):
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        if part not in hints:
            return None
        node = hints[part]
    return None if dataclasses.is_dataclass(node) else node


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


def flat_name_table(names: dict | None = None) -> str:
    """The Markdown table of TRL's flat names (``names``: TRL_NAMES, or SFT_NAMES) and the longrl keys they set
    (docs/api.md holds both; a test keeps them equal)."""
    names = TRL_NAMES if names is None else names
    lines = ["| TRL name | longrl key | how it maps |", "|---|---|---|"]
    for name, entry in names.items():
        key = trl_key(name, names)
        shown = "rewards[i].weight" if key == "rewards" else key
        note = entry.note or ("" if key else "not in this version of longrl")
        if isinstance(entry.convert, Accepts):
            values = " or ".join(f"`{v!r}`" for v in entry.convert.values)
            note = f"accepted: {values} (sets nothing); other values refused: {note}"
        elif entry.key is None and entry.convert is not None:
            note = f"accepted, any value (changes no result): {note}"
        lines.append(f"| `{name}` | {f'`{shown}`' if key else '—'} | {note} |")
    return "\n".join(lines) + "\n"


TABLE_BEGIN, TABLE_END = "<!-- flat-names:begin (python -m longrl.compat.trl_config) -->\n", "<!-- flat-names:end -->\n"
SFT_TABLE_BEGIN, SFT_TABLE_END = "<!-- sft-names:begin (python -m longrl.compat.trl_config) -->\n", "<!-- sft-names:end -->\n"


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
