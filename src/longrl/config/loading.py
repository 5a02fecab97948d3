"""A Config from defaults, a YAML file and ``dotted.key=value`` overrides, in that order, then validated.

Every value is converted to its field's type before any model loads: an unknown key, a wrong type or a non-finite
number raises :class:`ConfigError` naming the key path, the bad value and what is allowed. Relative file paths in a
YAML file (data.source, rewards[i].function) are read from the file's folder.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from pathlib import Path
from typing import Literal

import yaml

from .errors import ConfigError
from .keys import suggest_key
from .schema import Config
from .step_count import settle_step_count
from .validation import validate


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    return getattr(tp, "__name__", str(tp))


def _convert(value, tp, key: str):
    """Return ``value`` converted to type ``tp`` or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1 and "finite" in str(errors[0]):  # Optional[float] given inf/nan: say so
            raise errors[0]
        raise ConfigError(f"config key '{key}': got {value!r}; expected {_describe(tp)}")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"config key '{key}': got {value!r}; allowed: {_describe(tp)[7:]}")
    if origin is list:
        if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
            if typing.get_args(tp)[0] is str and isinstance(value, str):
                return [value]
            raise ConfigError(f"config key '{key}': got {value!r}; expected {_describe(tp)}")
        return [_convert(v, typing.get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': got {value!r}; expected {_describe(tp)}")
        return _build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value == int(value):  # 1e3 in YAML: a float
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value)  # YAML 1.1 reads "1e10" as a string
            except ValueError:
                number = None
            if number is not None and math.isfinite(number) and number == int(number) and "." not in value:
                return int(number)
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"config key '{key}': got {value!r}; expected a finite number")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"config key '{key}': got {value!r} ({type(value).__name__}); expected {_describe(tp)}")


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            path = f"{prefix}.{k}" if prefix else k
            hint = suggest_key(path)
            raise ConfigError(f"unknown config key '{path}'{'; ' + hint if hint else ''}; allowed keys here: "
                              f"{', '.join(sorted(names))}")
    obj = cls()
    for k, v in data.items():
        path = f"{prefix}.{k}" if prefix else k
        setattr(obj, k, _convert(v, hints[k], path))
    return obj


def _set_dotted(tree: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {} if node.get(part) is None else node[part]
            if not isinstance(node[part], dict):
                raise ConfigError(f"config key '{dotted}': '{part}' is not a section")
        node = node[part]
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, object]]:
    """``["train.max_steps=10", ...]`` → ``[("train.max_steps", 10), ...]`` (values parsed as YAML)."""
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. train.max_steps=10)")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
        pairs.append((key.strip(), value))
    return pairs


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: Config | None = None, recipe: str = "grpo") -> Config:
    """Config from ``base`` (or defaults), then the YAML file at ``path``, then KEY=VALUE overrides, validated for
    ``recipe`` (``grpo`` or ``sft``: supervised runs need no reward functions)."""
    tree = (base or Config()).to_dict()
    loaded, given = {}, {}  # the file's tree and the overrides' tree, as given (settle_step_count reads them)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        _paths_from_folder(loaded, path)
        _merge(tree, loaded)
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
        _set_dotted(given, key, value)
    cfg = _build(Config, tree)
    if recipe == "sft":
        settle_step_count(cfg, loaded, given, path)
    validate(cfg, require_rewards=recipe != "sft")
    return cfg


def _relative_file(value: str) -> bool:
    """A relative file path (not task:, hf: or memory:, not absolute or ~)."""
    return (isinstance(value, str) and value != "" and not value.startswith(("task:", "hf:", "memory:", "~"))
            and not os.path.isabs(value))


def _from_folder(value: str, key: str, config_file: Path) -> str:
    """``value`` (relative) as read from the config file's folder; refused when only the working directory has it
    (where such paths were read before), so a run never reads another file than the one its config names."""
    joined = os.path.join(os.path.dirname(os.path.abspath(config_file)), value)
    if not os.path.exists(joined) and os.path.exists(value):
        raise ConfigError(f"config key '{key}' in {config_file}: {value!r} is read relative to the config file's "
                          f"folder, as {joined}, which does not exist; ./{value} exists in the working directory: "
                          "write its path relative to the config file, or absolute")
    return joined


def _paths_from_folder(loaded: dict, config_file: Path) -> None:
    """Relative data and reward-file paths of a YAML file, resolved against the file's folder (in place)."""
    data = loaded.get("data")
    if isinstance(data, dict) and _relative_file(data.get("source")):
        data["source"] = _from_folder(data["source"], "data.source", config_file)
    for i, spec in enumerate(loaded.get("rewards") or []):
        ref = spec.get("function") if isinstance(spec, dict) else None
        if isinstance(ref, str) and ":" in ref:
            target, name = ref.rsplit(":", 1)
            if (target.endswith(".py") or "/" in target) and _relative_file(target):
                spec["function"] = f"{_from_folder(target, f'rewards[{i}].function', config_file)}:{name}"


def _merge(tree: dict, new: dict, prefix: str = "") -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(tree.get(k), dict):
            _merge(tree[k], v, f"{prefix}{k}.")
        else:
            tree[k] = v

