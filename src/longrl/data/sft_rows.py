"""Supervised examples: token ids and the mask of tokens that count in the loss, from the formats users have.

Row formats (detected per row, the first that applies):
  messages             ``[{"role", "content"}, ...]`` rendered by the chat template. With
                       ``assistant_only_loss`` only the assistant turns' tokens are trained (each turn's
                       content and what the template closes it with, e.g. ``<|im_end|>``), else every token.
  prompt / completion  strings, or messages. With ``completion_only_loss`` only the completion is trained.
  text                 plain text (the ``text_column``), every token trained; EOS appended.

Where the assistant's tokens are, is read off the template itself: for assistant message i the conversation up
to i rendered with the generation prompt is a prefix P of the conversation up to and including i, Q; the
characters Q[len(P):] are the turn, and a token is trained when it starts inside a turn (character offsets of
the one tokenization of the whole conversation, so BPE merges at the boundaries are as the model sees them). A
template under which P or Q is not a prefix of the whole rendering (one that rewrites earlier turns) is refused,
naming the row.

Rows longer than ``max_length`` tokens follow ``overlong``: ``truncate`` (keep the first max_length tokens; the
default, as TRL), ``skip`` (counted in a warning) or ``error`` (naming the row).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .prompts import DataError, _is_chat, read_rows

log = logging.getLogger(__name__)


@dataclass
class SFTExample:
    input_ids: list[int]  # [L]
    loss_mask: list[bool]  # [L]: token t is trained (predicted from tokens < t); position 0 never is


def _render(tokenizer, messages, generation: bool, tools=None) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, tools=tools)


def _encode_with_spans(tokenizer, text: str, spans: list[tuple[int, int]], where: str) -> SFTExample:
    """Tokenize ``text`` once; a token is trained when its first character lies inside one of ``spans``."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{where}: locating trained tokens needs a fast tokenizer (character offsets)")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [any(a <= start < b for a, b in spans) and end > start for start, end in offsets]
    return SFTExample(ids, mask)


def _chat_example(tokenizer, messages: list[dict], train_roles: str, where: str, tools=None) -> SFTExample:
    """``train_roles``: 'assistant' (assistant turns only) or 'all'."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: chat messages need a tokenizer with a chat template")
    full = _render(tokenizer, messages, False, tools)
    if train_roles == "all":
        return _encode_with_spans(tokenizer, full, [(0, len(full))], where)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True, tools) if i else ""
        upto = _render(tokenizer, messages[:i + 1], False, tools)
        if not (full.startswith(before) and upto.startswith(before) and full.startswith(upto)):
            raise DataError(f"{where}: the chat template renders earlier turns differently once later turns follow "
                            f"(message {i + 1} is not a prefix of the whole conversation), so the assistant's tokens "
                            "cannot be located exactly; set sft.assistant_only_loss=false to train every token")
        spans.append((len(before), len(upto)))
    if not spans:
        raise DataError(f"{where}: no assistant message to train on (sft.assistant_only_loss=true)")
    return _encode_with_spans(tokenizer, full, spans, where)


def _text_ids(tokenizer, text: str, eos: bool) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if eos and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids


def _prompt_completion_example(tokenizer, prompt, completion, completion_only: bool, where: str,
                               tools=None) -> SFTExample:
    if _is_chat(prompt) or _is_chat(completion):
        if not (_is_chat(prompt) and _is_chat(completion)):
            raise DataError(f"{where}: prompt and completion must both be strings or both chat messages")
        messages = list(prompt) + list(completion)
        if not completion_only:
            return _chat_example(tokenizer, messages, "all", where, tools)
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{where}: chat messages need a tokenizer with a chat template")
        full = _render(tokenizer, messages, False, tools)
        before = _render(tokenizer, list(prompt), True, tools)
        if not full.startswith(before):
            raise DataError(f"{where}: the prompt rendered with the generation prompt is not a prefix of the whole "
                            "conversation, so the completion cannot be located exactly")
        return _encode_with_spans(tokenizer, full, [(len(before), len(full))], where)
    prompt_ids = _text_ids(tokenizer, prompt, eos=False)
    bos = tokenizer.bos_token_id
    if bos is not None and getattr(tokenizer, "add_bos_token", False):
        prompt_ids = [bos] + prompt_ids
    completion_ids = _text_ids(tokenizer, completion, eos=True)
    trained = [not completion_only] * len(prompt_ids) + [True] * len(completion_ids)
    return SFTExample(prompt_ids + completion_ids, trained)


def row_example(tokenizer, row: dict, settings, where: str) -> SFTExample:
    """The example of one dataset row under ``settings`` (the ``sft:`` config section)."""
    tools = row.get("tools")
    if "messages" in row and row["messages"] is not None:
        messages = row["messages"]
        if not (_is_chat(messages) and messages):
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} messages")
        return _chat_example(tokenizer, messages, "assistant" if settings.assistant_only_loss else "all", where,
                             tools)
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if not (isinstance(prompt, str) or _is_chat(prompt)) or not (isinstance(completion, str) or _is_chat(completion)):
            raise DataError(f"{where}: prompt and completion must be strings or chat messages")
        return _prompt_completion_example(tokenizer, prompt, completion, settings.completion_only_loss, where, tools)
    text = row.get(settings.text_column)
    if isinstance(text, str) and text:
        ids = _text_ids(tokenizer, text, eos=True)
        return SFTExample(ids, [True] * len(ids))
    raise DataError(f"{where}: expected a 'messages' column, 'prompt' and 'completion' columns, or a non-empty "
                    f"'{settings.text_column}' column (sft.text_column); columns: {', '.join(row) or 'none'}")


def build_examples(tokenizer, rows: list[dict], settings, source: str) -> list[SFTExample]:
    """Every row as an example (rows counted from 1 in messages), with the overlong policy applied."""
    out, skipped = [], 0
    for i, row in enumerate(rows):
        where = f"dataset {source!r} row {i + 1}"
        ex = row_example(tokenizer, row, settings, where)
        ex.loss_mask[0] = False  # nothing predicts the first token
        if len(ex.input_ids) > settings.max_length:
            if settings.overlong == "error":
                raise DataError(f"{where}: {len(ex.input_ids)} tokens, more than sft.max_length={settings.max_length}; "
                                "raise it, or set sft.overlong to truncate or skip")
            if settings.overlong == "skip":
                skipped += 1
                continue
            ex = SFTExample(ex.input_ids[:settings.max_length], ex.loss_mask[:settings.max_length])
        if not any(ex.loss_mask):
            skipped += 1
            continue
        out.append(ex)
    if skipped:
        log.warning("%s: left out %d of %d rows (longer than sft.max_length=%d with sft.overlong=skip, or no "
                    "trained token left)", source, skipped, len(rows), settings.max_length)
    if not out:
        raise DataError(f"dataset {source!r}: no row with a token to train on")
    return out


def load_examples(data_cfg, settings, tokenizer, seed: int = 0, source: str | None = None) -> list[SFTExample]:
    """Read ``source`` (default ``data_cfg.source``) and build its examples."""
    source = source or data_cfg.source
    rows = read_rows(source, data_cfg.split, data_cfg.num_examples, seed)
    if not rows:
        raise DataError(f"dataset {source!r} is empty")
    return build_examples(tokenizer, rows, settings, source)
