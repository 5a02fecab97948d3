"""Token-exact trajectories: the sampler's tokens as sampled, the environment's messages tokenized once and appended.

A trajectory after its prompt is one token list that only grows::

    [turn 1 as sampled (ends with its stop token)] [env 1] [turn 2 as sampled] [env 2] ... [last turn]
    env_mask:  1 … 1                                0 … 0   1 … 1              0 … 0       1 … 1

``env k`` is the template's rendering of the environment's messages *after* the sampled stop token: the rest of the
assistant block the template writes after it (e.g. Qwen's "\\n" after <|im_end|>), the tool/user blocks, and the
generation prompt of the next assistant turn. It is rendered against a fixed stand-in conversation, so the
history is never re-rendered nor re-tokenized (re-applying the template to the history changes tokens: what is
trained would not be what was sampled). The mask keeps env tokens out of the loss; they are attended.

:class:`EpisodeRunner` is what the sampler calls at the end of each turn (in a worker thread): it decodes the
turn, steps the sequence's environment under the per-turn and per-episode timeouts, caps the content of each message
it returns at ``max_message_chars`` characters (:mod:`.bounded_text`) and returns the tokens to append, or None when
the episode is over (done, max_turns, a timeout, the trajectory's token budget).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from ..data.errors import DataError
from ..rollout.sampler import EnvTokens
from .bounded_text import DEFAULT_MAX_CHARS, cap_messages, cap_text, is_capped
from .environment import Environment, as_step_result
from .tool_images import ToolImages, as_parts, image_values
from .tools import call_with_timeout

log = logging.getLogger(__name__)

_STAND_IN = [{"role": "user", "content": "longrl-user"}, {"role": "assistant", "content": "longrl-assistant"}]


class TemplateError(ValueError):
    """The chat template cannot append messages to a conversation without re-rendering it."""


def continuation_text(template, new_messages: list[dict], tools: list[dict] | None = None,
                      stop_text: str | None = None, add_generation_prompt: bool = True, parts: bool = False) -> str:
    """The text that follows a sampled assistant turn (ending with ``stop_text``, its stop token's text) when the
    environment answers ``new_messages``; the next assistant turn's generation prompt included. ``template``: a
    tokenizer or processor (its ``apply_chat_template``); ``parts``: every string content rendered as one text part
    (a vision processor's template)."""
    kwargs = dict(tokenize=False, tools=tools or None)
    stand_in, new_messages = (as_parts(_STAND_IN), as_parts(new_messages)) if parts else (_STAND_IN, new_messages)
    base = template.apply_chat_template(stand_in, **kwargs)
    full = template.apply_chat_template(stand_in + list(new_messages), add_generation_prompt=add_generation_prompt,
                                        **kwargs)
    if not full.startswith(base):
        raise TemplateError("the chat template renders a conversation differently once messages follow it (the "
                            f"first {len(base)} characters changed), so environment messages cannot be appended "
                            "token-exactly; use a template that renders earlier turns unchanged")
    end = base.rfind(_STAND_IN[1]["content"]) + len(_STAND_IN[1]["content"])
    after = base[end:]  # what the template writes after the assistant's content: its stop text and the rest
    if stop_text and after.startswith(stop_text):
        after = after[len(stop_text):]  # the model sampled the stop token itself
    elif stop_text and stop_text in after:
        after = after[after.index(stop_text) + len(stop_text):]
    else:
        after = ""  # a template that writes no stop text (or another one): the env block follows at once
    return after + full[len(base):]


def continuation_ids(tokenizer, new_messages: list[dict], tools: list[dict] | None = None,
                     stop_text: str | None = None, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of :func:`continuation_text` (text messages)."""
    text = continuation_text(tokenizer, new_messages, tools, stop_text, add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


@dataclass
class EpisodeSettings:
    max_turns: int = 4  # assistant turns per episode
    max_tokens: int = 1024  # tokens after the prompt (model + environment) per trajectory
    turn_timeout_s: float | None = 60.0  # one environment step
    episode_timeout_s: float | None = 600.0  # all steps of an episode, from its first turn
    workers: int = 8  # threads stepping environments (slow tools never stall the decode batch)
    max_message_chars: int = DEFAULT_MAX_CHARS  # an environment message's content, capped before tokenization


@dataclass
class Episode:
    env: Environment
    prompt_messages: list[dict]
    messages: list[dict] = field(default_factory=list)  # after the prompt, with roles: assistant, tool, user ...
    turn_rewards: list[float | None] = field(default_factory=list)  # one per environment step
    turns: int = 0
    env_time_s: float = 0.0
    truncated: str | None = None  # why the episode stopped before the environment said done (None: it did)
    error: str | None = None
    started_s: float | None = None
    messages_truncated: int = 0  # environment messages cut to max_message_chars


class EpisodeRunner:
    """The sampler's turn handler for a batch of episodes (one environment instance per sequence). ``images``: a
    vision-language model's encoder of environment messages holding images (:mod:`.tool_images`), else None."""

    def __init__(self, episodes: list[Episode], tokenizer, settings: EpisodeSettings, tools: list[dict] | None,
                 stop_ids=(), images: ToolImages | None = None):
        self.episodes, self.tokenizer, self.settings = episodes, tokenizer, settings
        self.tools, self.stop_ids, self.images = tools, set(stop_ids), images
        self._lock = threading.Lock()  # tokenizers are not guaranteed thread-safe

    def _assistant(self, seq: int, tokens: list[int]) -> dict:
        with self._lock:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        ep = self.episodes[seq]
        msg = {"role": "assistant", "content": text}
        ep.messages.append(msg)
        ep.turns += 1
        return msg

    def step(self, seq: int, tokens: list[int], room: int) -> list[int] | EnvTokens | None:
        """Tokens to append after this turn (``room``: tokens left in the trajectory; EnvTokens: with their images),
        or None: the episode is over."""
        ep, st = self.episodes[seq], self.settings
        if ep.started_s is None:
            ep.started_s = time.perf_counter()
        msg = self._assistant(seq, tokens)
        limit = st.turn_timeout_s
        if st.episode_timeout_s is not None:
            left = st.episode_timeout_s - (time.perf_counter() - ep.started_s)
            if left <= 0:
                ep.truncated = "episode_timeout"
                return None
            limit = left if limit is None else min(limit, left)
        start = time.perf_counter()
        finished, value, error = call_with_timeout(ep.env.step, limit, msg)
        ep.env_time_s += time.perf_counter() - start
        if not finished:
            ep.truncated = "turn_timeout" if limit == st.turn_timeout_s else "episode_timeout"
            return None
        if error is not None:
            return self._env_error(seq, ep, f"{type(error).__name__}: {cap_text(str(error), 500)}")
        try:
            result = as_step_result(value, type(ep.env).__name__)
        except ValueError as e:
            return self._env_error(seq, ep, str(e))
        result.messages = cap_messages(result.messages, st.max_message_chars)  # before any tokenization
        ep.messages_truncated += sum(is_capped(m.get("content")) for m in result.messages)
        ep.turn_rewards.append(result.reward)
        if result.done:
            return None
        if ep.turns >= st.max_turns:
            ep.truncated = "max_turns"
            return None
        values = image_values(result.messages)
        if values and self.images is None:
            return self._env_error(seq, ep, f"{type(ep.env).__name__}.step returned {len(values)} image(s): the "
                                   "model has no vision tower")
        try:
            images = self.images.open(values, f"{type(ep.env).__name__}.step (turn {ep.turns})") if values else []
        except DataError as e:
            return self._env_error(seq, ep, str(e))
        with self._lock:  # the text of the stop token the turn ended with, if it did: the template's turn end
            stop_text = self.tokenizer.convert_ids_to_tokens(tokens[-1]) if tokens and tokens[-1] in self.stop_ids \
                else None
            if images:  # the processor renders the image parts and expands their placeholders
                out = self.images.encode(continuation_text(self.images.processor, result.messages, self.tools,
                                                           stop_text, parts=True), images)
            else:
                out = continuation_ids(self.tokenizer, result.messages, self.tools, stop_text)
        ids = out.ids if images else out
        if len(ids) + 1 > room:  # no room for the messages and one more sampled token
            ep.truncated = "max_tokens"
            return None
        ep.messages.extend(result.messages)
        return out

    @staticmethod
    def _env_error(seq: int, ep: Episode, why: str) -> None:
        """End ``ep`` as an environment error (``why``: its message), with a warning; None (the episode is over)."""
        ep.error, ep.truncated = why, "env_error"
        log.warning("environment step failed (sequence %d, turn %d): %s", seq, ep.turns, why)
        return None


def turn_spans(env_mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of model tokens (mask 1) in a trajectory: its assistant turns."""
    spans, start = [], None
    for i, m in enumerate(list(env_mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans
