"""Environments: what answers the model between its turns.

longrl's interface (subclass :class:`Environment`; either method may be ``async``)::

    reset(row) -> messages | None           the dataset row configures the episode; the messages open it
                                             (None: the row's prompt column)
    step(assistant_message) -> (new_messages, reward | None, done)

A message's content is a string or a list of parts: ``{"type": "text", "text": ...}``, and for a vision-language
model ``{"type": "image", "image": <Pillow image | bytes | file path>}`` (:mod:`.tool_images`).

Two shorthands build one:

- ``tools=[fn, ...]``: :class:`ToolEnvironment`, which parses the tool calls of each assistant message (the
  model family's format, :mod:`.tool_calls`), runs them (:class:`.tools.ToolSet`) and answers with one ``tool``
  message a call; a message without a call ends the episode.
- TRL's ``environment_factory`` classes, unchanged (:class:`TRLEnvironment`): ``reset(**row)`` returns None or a
  string appended to the last user message; every public method is a tool; an optional ``get_reward()`` scores the
  finished episode. A class that subclasses :class:`Environment` is longrl's kind; any other is TRL's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from ..config.errors import ConfigError
from .bounded_text import DEFAULT_MAX_CHARS, cap_text
from .tool_calls import parse_tool_calls
from .tools import ToolSet, run_maybe_async

TRL_RESERVED = ("reset", "get_reward")


class EnvironmentSetupError(ValueError):
    """An environment cannot be built or returned something unusable; the message names it."""


@dataclass
class StepResult:
    messages: list[dict]
    reward: float | None = None
    done: bool = False


class Environment:
    """Base class of longrl environments (override ``step``, and ``reset`` when the row configures the episode).

    ``tools``: functions whose schemas the prompt renders (``apply_chat_template(tools=...)``); ``stats``: counters
    the trainer reports (``tool_calls``, ``tool_errors``), updated by the environment."""

    tools: list[Callable] = []

    def __init__(self):
        self.stats = {"tool_calls": 0, "tool_errors": 0}

    def reset(self, row: dict) -> list[dict] | None:
        return None

    def step(self, assistant_message: dict):
        raise NotImplementedError("an Environment must define step(assistant_message)")

    def tool_schemas(self) -> list[dict]:
        return ToolSet(list(self.tools)).schemas if self.tools else []


def as_step_result(value, where: str) -> StepResult:
    """A StepResult from what ``step`` returned: a StepResult or a (messages, reward, done) tuple."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, (tuple, list)) and len(value) == 3:
        result = StepResult(list(value[0] or []), value[1], bool(value[2]))
    else:
        raise EnvironmentSetupError(f"{where}.step returned {type(value).__name__}; expected (new_messages, reward, "
                                "done) or a StepResult")
    for m in result.messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise EnvironmentSetupError(f"{where}.step returned message {cap_text(repr(m), 200)}; a message is a dict "
                                        "with role and content")
        for part in m["content"] if isinstance(m["content"], list) else ():
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind == "text" and isinstance(part.get("text"), str):
                continue
            if kind == "image" and part.get("image") is not None:  # (a vision-language model's: agents/tool_images)
                continue
            raise EnvironmentSetupError(
                f"{where}.step returned a {m['role']} message with a {kind!r} part"
                + (" without its image (the part's 'image': a Pillow image, bytes or a file path)"
                   if kind == "image" else "")
                + "; environments answer in parts of type 'text' ({'type': 'text', 'text': ...}) and 'image' "
                "({'type': 'image', 'image': ...}, for a vision-language model)")
    if result.reward is not None:
        result.reward = float(result.reward)
    return result


class ToolEnvironment(Environment):
    """Runs the tool calls in each assistant message; an assistant message without calls ends the episode."""

    def __init__(self, tools: ToolSet, fmt: str = "qwen"):
        super().__init__()
        self.toolset, self.fmt = tools, fmt

    def tool_schemas(self) -> list[dict]:
        return self.toolset.schemas

    def step(self, assistant_message: dict):
        parsed = parse_tool_calls(assistant_message.get("content") or "", self.fmt)
        if not parsed.has_calls:
            return [], None, True
        if parsed.calls:
            assistant_message["tool_calls"] = [c.as_message_entry() for c in parsed.calls]
        replies = []
        for err in parsed.errors:
            replies.append({"role": "tool", "name": "error", "content": f"Error: {err}"})
            self.stats["tool_errors"] += 1
        for call in parsed.calls:
            content, failed = self.toolset.call(call)
            self.stats["tool_calls"] += 1
            self.stats["tool_errors"] += int(failed)
            replies.append({"role": "tool", "name": call.name, "content": content})
        return replies, None, False


class TRLEnvironment(ToolEnvironment):
    """A TRL ``environment_factory`` instance: ``reset(**row)``, public methods as tools, optional ``get_reward``."""

    def __init__(self, instance, extra_tools: list[Callable], fmt: str, prompt_column: str = "prompt",
                 timeout_s: float | None = 30.0, max_chars: int = DEFAULT_MAX_CHARS):
        methods = [m for n, m in inspect.getmembers(instance, predicate=inspect.ismethod)
                   if n not in TRL_RESERVED and not n.startswith("_")]
        super().__init__(ToolSet(list(extra_tools) + methods, timeout_s, max_chars), fmt)
        self.instance, self.prompt_column = instance, prompt_column

    def reset(self, row: dict) -> list[dict] | None:
        observation = run_maybe_async(self.instance.reset, **row)
        if observation is None:
            return None
        observation = cap_text(str(observation), self.toolset.max_chars)
        prompt = row.get(self.prompt_column)
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt + str(observation)}]
        if not isinstance(prompt, list) or not prompt:
            return [{"role": "user", "content": str(observation)}]
        last = prompt[-1]
        content = last.get("content") or ""
        if isinstance(content, list):  # content parts (text, images): the observation as one more text part
            return list(prompt[:-1]) + [{**last, "content": [*content, {"type": "text", "text": str(observation)}]}]
        return list(prompt[:-1]) + [{**last, "content": content + str(observation)}]

    def final_reward(self) -> float | None:
        get = getattr(self.instance, "get_reward", None)
        return None if get is None else float(run_maybe_async(get))


def is_trl_environment(obj) -> bool:
    return not isinstance(obj, Environment) and callable(getattr(obj, "reset", None))


def build_environment(factory: Callable | None, tools: list[Callable], fmt: str, prompt_column: str = "prompt",
                      tool_timeout_s: float | None = 30.0, max_chars: int = DEFAULT_MAX_CHARS) -> Environment:
    """One episode's environment: ``factory()`` (longrl's or TRL's kind, with ``tools`` added to a TRL one), or a
    :class:`ToolEnvironment` over ``tools`` when there is no factory. ``max_chars``: the cap on a tool result
    (and on a TRL reset's observation)."""
    if factory is None:
        return ToolEnvironment(ToolSet(list(tools), tool_timeout_s, max_chars), fmt)
    name = getattr(factory, "__qualname__", repr(factory))
    try:
        obj = factory()
    except (Exception, SystemExit) as e:  # the user's constructor
        raise EnvironmentSetupError(f"environment factory {name}: constructing it failed: {type(e).__name__}: "
                                    f"{cap_text(str(e), 500)}") from e
    if isinstance(obj, Environment):
        if not hasattr(obj, "stats"):
            obj.stats = {"tool_calls": 0, "tool_errors": 0}
        return obj
    if is_trl_environment(obj):
        return TRLEnvironment(obj, tools, fmt, prompt_column, tool_timeout_s, max_chars)
    raise EnvironmentSetupError(f"environment factory {name} returned {type(obj).__name__}, which is neither a "
                            "longrl.agents.Environment nor a TRL environment (a class with a reset method)")


def load_environment_factory(ref: str) -> Callable:
    """Resolve ``path/to/file.py:Class`` or ``package.module:Class`` (the config's environment.factory) to a
    callable, or raise ConfigError naming the key (a missing file or name, an import that fails, not callable)."""
    from ..rewards import RewardLoadError, load_reward_function

    try:
        return load_reward_function(ref)
    except RewardLoadError as e:
        raise ConfigError("config key " + str(e).replace("reward function", "'environment.factory':", 1)) from None


def check_callable(value, key: str = "environment_factory") -> Callable:
    """``value`` if it is callable, else ConfigError naming ``key`` (environment_factory: a class, or a function
    returning a new environment; tools[i]: a function)."""
    if not callable(value):
        wanted = ("the environment class (or a function returning a new environment), not an instance"
                  if key == "environment_factory" else "a function")
        raise ConfigError(f"{key}: {cap_text(repr(value), 200)} ({type(value).__name__}) is not callable; pass "
                          f"{wanted}")
    return value
