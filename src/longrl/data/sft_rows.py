"""Supervised examples: token ids and the mask of tokens that count in the loss, from the formats users have.

Row formats (detected per row, the first that applies):
  messages             ``[{"role", "content"}, ...]`` rendered by the chat template. With
                       ``assistant_only_loss`` only the assistant turns' tokens are trained (each turn's
                       content and what the template closes it with, e.g. ``<|im_end|>``), else every token.
  prompt / completion  strings, or messages. With ``completion_only_loss`` only the completion is trained.
  text                 plain text (the ``text_column``), every token trained; EOS appended.

A message's content is a string, or a list of parts (the multimodal chat format) whose text parts
``{"type": "text", "text": ...}`` are joined with nothing between them, as chat templates render them. Every check
that needs no tokenizer (the format, the roles, empty turns, the parts, an assistant turn to train on) is
:func:`checked_row`, run on all rows by :func:`check_rows` before the model loads.

Rows with images (an ``image`` or ``images`` column, images.py; or ``{"type": "image"}`` parts) are messages or
prompt / completion rows (plain-text ones become a user and an assistant message) whose contents stay lists of text
and image parts, one image part per image (image_parts.py); :func:`check_rows` reads every image once. They are
encoded by a vision-language model's processor (training/vision_examples.py), from :func:`image_rows`; the tokenizer
path here refuses them.

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

from pathlib import Path

from .image_parts import content_parts, content_type_error, count_image_parts, place_images
from .images import MAX_IMAGE_PIXELS, dataset_folder, has_image_cells, open_images, row_image_sources
from .prompts import DataError, read_rows

log = logging.getLogger(__name__)


@dataclass
class ExampleImages:
    """Where an example's image tensors come from, remade each time a step draws it (not kept for the dataset)."""

    text: str  # the conversation as the processor's chat template renders it (image placeholders not expanded)
    sources: list  # its images (images.ImageSource), one a placeholder, in order
    end: int  # the index after its last image placeholder token: the example may not be cut before it


@dataclass
class SFTExample:
    input_ids: list[int]  # [L]
    loss_mask: list[bool]  # [L]: token t is trained (predicted from tokens < t); position 0 never is
    images: ExampleImages | None = None  # a vision dataset's example with images (None: text)


ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")  # the roles chat templates render


def message_text(content, where: str) -> str | None:
    """A message's content as text: a string as it is (None stays None: an assistant turn of tool calls only), or
    the text parts of a list of parts joined with nothing between them; DataError for any other part or type."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise content_type_error(content, where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise DataError(f"{where}: content part {j + 1} is {part!r:.80}; only text parts "
                            "{'type': 'text', 'text': ...} can be trained on (this model reads text)")
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(messages, where: str, column: str = "messages", with_images: bool = False) -> list[dict]:
    """``messages`` checked, each content as text (:func:`message_text`), or with ``with_images`` as a list of text
    and image parts (image_parts.content_parts); DataError naming the row and the message for one that is not
    ``{"role", "content"}``, a role chat templates do not know, or an empty turn (no text, no image and no tool
    calls)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: '{column}' must be a non-empty list of {{'role', 'content'}} messages")
    out = []
    for i, m in enumerate(messages):
        at = f"{where}: '{column}' message {i + 1}"
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{at} is not a {{'role', 'content'}} message: {m!r:.80}")
        if m["role"] not in ROLES:
            raise DataError(f"{at} has role {m['role']!r}; expected one of {', '.join(ROLES)}")
        if with_images:
            content = content_parts(m["content"], at)
            empty = not any(p["type"] == "image" or p["text"].strip() for p in content or [])
        else:
            content = message_text(m["content"], at)
            empty = not (content or "").strip()
        if empty and not m.get("tool_calls"):
            raise DataError(f"{at} ({m['role']}) is empty: a turn needs text (or, from the assistant, tool calls)")
        out.append({**m, "content": content})
    return out


def has_images(row: dict) -> bool:
    """Whether a row holds images: an ``image``/``images`` cell or ``{"type": "image"}`` parts."""
    return has_image_cells(row) or any(count_image_parts(row.get(c)) for c in ("messages", "prompt", "completion"))


def _checked_image_row(row: dict, settings, where: str, base_dir: Path | None, max_pixels: int) -> dict:
    """A row with images as ``{"messages", "tools", "images"}`` or ``{"prompt", "completion", "tools", "images"}``
    (the images' sources, not read), contents as lists of parts holding one image part per image."""
    images_column, images = row_image_sources(row, where, base_dir, max_pixels)
    tools = row.get("tools")
    if row.get("messages") is not None:
        messages = chat_messages(row["messages"], where, with_images=True)
        place_images(messages, len(images), where, "'messages'", images_column)
        if settings.assistant_only_loss and not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant message to train on (sft.assistant_only_loss=true)")
        return {"messages": messages, "tools": tools, "images": images}
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            prompt, completion = [{"role": "user", "content": prompt}], [{"role": "assistant", "content": completion}]
        elif not (isinstance(prompt, list) and isinstance(completion, list)):
            raise DataError(f"{where}: prompt and completion must both be strings or both chat messages")
        prompt = chat_messages(prompt, where, "prompt", with_images=True)
        completion = chat_messages(completion, where, "completion", with_images=True)
        place_images(prompt + completion, len(images), where, "'prompt' and 'completion'", images_column)
        return {"prompt": prompt, "completion": completion, "tools": tools, "images": images}
    raise DataError(f"{where}: a dataset with images needs a 'messages' column or 'prompt' and 'completion' "
                    f"columns in each row; columns: {', '.join(row)}")


def checked_row(row, settings, where: str, base_dir: Path | None = None,
                max_image_pixels: int = MAX_IMAGE_PIXELS) -> dict:
    """The row in one of the formats, checked without a tokenizer: ``{"messages", "tools"}`` (messages through
    :func:`chat_messages`; with ``assistant_only_loss`` at least one assistant turn), ``{"prompt", "completion",
    "tools"}`` (both strings or both messages, the completion not empty) or ``{"text"}``; a row with images gets
    ``"images"`` (their sources, resolved against ``base_dir``; not read) and contents as lists of parts."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a row of named columns; got {type(row).__name__}")
    if has_images(row):
        return _checked_image_row(row, settings, where, base_dir, max_image_pixels)
    tools = row.get("tools")
    if row.get("messages") is not None:
        messages = chat_messages(row["messages"], where)
        if settings.assistant_only_loss and not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant message to train on (sft.assistant_only_loss=true)")
        return {"messages": messages, "tools": tools}
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, list) and isinstance(completion, list):
            return {"prompt": chat_messages(prompt, where, "prompt"),
                    "completion": chat_messages(completion, where, "completion"), "tools": tools}
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion:
                raise DataError(f"{where}: the completion is empty: nothing to train on")
            return {"prompt": prompt, "completion": completion, "tools": tools}
        if isinstance(prompt, (str, list)) and isinstance(completion, (str, list)):
            raise DataError(f"{where}: prompt and completion must both be strings or both chat messages")
        raise DataError(f"{where}: prompt and completion must be strings or chat messages")
    text = row.get(settings.text_column)
    if isinstance(text, str) and text:
        return {"text": text}
    raise DataError(f"{where}: expected a 'messages' column, 'prompt' and 'completion' columns, or a non-empty "
                    f"'{settings.text_column}' column (sft.text_column); columns: {', '.join(row) or 'none'}")


def check_rows(rows: list, settings, source: str, max_image_pixels: int = MAX_IMAGE_PIXELS) -> list:
    """``rows`` after :func:`checked_row` on each (rows counted from 1, as :func:`build_examples` names them), every
    image read once (relative paths against ``source``'s folder when it is a file)."""
    if not rows:
        raise DataError(f"dataset {source!r} is empty")
    base_dir = dataset_folder(source)
    for i, row in enumerate(rows):
        open_images(checked_row(row, settings, f"dataset {source!r} row {i + 1}", base_dir,
                                max_image_pixels).get("images", []))
    return rows


def image_rows(rows: list, settings, source: str, max_image_pixels: int = MAX_IMAGE_PIXELS) -> list[dict] | None:
    """Each row's :func:`checked_row` (messages or prompt / completion, with ``"images"``: a row without images has
    none) for a vision-language model's processor when any row holds images; None for text rows, which
    :func:`build_examples` encodes. Reads no image: :func:`check_rows` has."""
    if not any(isinstance(row, dict) and has_images(row) for row in rows):
        return None
    base_dir = dataset_folder(source)
    out = []
    for i, row in enumerate(rows):
        where = f"dataset {source!r} row {i + 1}"
        checked = checked_row(row, settings, where, base_dir, max_image_pixels)
        out.append(checked if "images" in checked else _checked_image_row(row, settings, where, base_dir,
                                                                          max_image_pixels))
    return out


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
    return _encode_with_spans(tokenizer, full, spans, where)


def _text_ids(tokenizer, text: str, eos: bool) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if eos and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids


def _prompt_completion_example(tokenizer, prompt, completion, completion_only: bool, where: str,
                               tools=None) -> SFTExample:
    if isinstance(prompt, list):  # both chat messages (checked_row)
        messages = prompt + completion
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
    row = checked_row(row, settings, where)
    if "images" in row:
        raise DataError(f"{where} holds images, but the model reads text only; train a vision-language model on it")
    if "messages" in row:
        return _chat_example(tokenizer, row["messages"], "assistant" if settings.assistant_only_loss else "all", where,
                             row["tools"])
    if "prompt" in row:
        return _prompt_completion_example(tokenizer, row["prompt"], row["completion"], settings.completion_only_loss,
                                          where, row["tools"])
    ids = _text_ids(tokenizer, row["text"], eos=True)
    return SFTExample(ids, [True] * len(ids))


def build_examples(tokenizer, rows: list[dict], settings, source: str, encode=None) -> list[SFTExample]:
    """Every row as an example (rows counted from 1 in messages), with the overlong policy applied. ``encode(row,
    where)``: one row's example (default: :func:`row_example` with ``tokenizer``; a vision dataset's rows go through
    its processor, training/vision_examples.py). An example with images is never cut inside its image tokens."""
    encode = encode or (lambda row, where: row_example(tokenizer, row, settings, where))
    out, skipped = [], 0
    for i, row in enumerate(rows):
        where = f"dataset {source!r} row {i + 1}"
        ex = encode(row, where)
        ex.loss_mask[0] = False  # nothing predicts the first token
        if len(ex.input_ids) > settings.max_length:
            if settings.overlong == "error":
                raise DataError(f"{where}: {len(ex.input_ids)} tokens, more than sft.max_length={settings.max_length}; "
                                "raise it, or set sft.overlong to truncate or skip")
            if settings.overlong == "skip":
                skipped += 1
                continue
            if ex.images is not None and ex.images.end > settings.max_length:
                raise DataError(f"{where}: {len(ex.input_ids)} tokens, more than sft.max_length={settings.max_length}, "
                                f"and its image tokens run to token {ex.images.end}: sft.overlong=truncate would cut "
                                "them; raise sft.max_length, or set sft.overlong=skip")
            ex = SFTExample(ex.input_ids[:settings.max_length], ex.loss_mask[:settings.max_length], ex.images)
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


def read_sft_rows(data_cfg, settings, seed: int = 0, source: str | None = None) -> list[dict]:
    """Read ``source`` (default ``data_cfg.source``) and check its rows (:func:`check_rows`: no tokenizer needed)."""
    source = source or data_cfg.source
    return check_rows(read_rows(source, data_cfg.split, data_cfg.num_examples, seed), settings, source,
                      data_cfg.max_image_pixels)
