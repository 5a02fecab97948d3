"""Prompt datasets: files (JSONL, JSON, Parquet, CSV), the ``datasets`` library (``hf:NAME[:CONFIG]``) and
built-in tasks (``task:NAME``). Prompts are plain strings or chat messages ``[{"role", "content"}, ...]``.

A dataset whose rows hold images (an ``image`` or ``images`` column, images.py) or ``{"type": "image"}`` parts is a
vision dataset: each prompt becomes chat messages holding one image part per image (image_parts.py), prepared by
:func:`image_prompts` for a vision-language model's processor, which :func:`load_prompts` calls through its
``encode_images`` argument instead of the tokenizer. :func:`read_prompt_rows` reads every image once, so a missing or
bad one stops the run before the model loads.

Prompts longer than ``max_prompt_length`` tokens follow ``overlong_prompt``:
  error          stop before training, naming the first overlong row (default: never train on a silently
                 altered prompt)
  truncate_left  keep the last ``max_prompt_length`` tokens (the end of a prompt is where the question is)
  skip           drop the row, and report how many were dropped
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from ..models.files import file_sha256
from ..tasks import TASKS
from .errors import DataError
from .image_parts import content_parts, count_image_parts, place_images
from .images import ImageSource, dataset_folder, has_image_cells, open_images, row_image_sources, rows_images_digest

log = logging.getLogger(__name__)

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


TASK_ROWS = 2000  # rows a task: source generates when data.num_examples is null


def read_rows(source: str, split: str = "train", num_examples: int | None = None, seed: int = 0) -> list[dict]:
    """The rows of ``source`` as dicts: the first ``num_examples`` (None: all; a task generates that many)."""
    if source.startswith("task:"):
        name = source[5:]
        if name not in TASKS:
            raise DataError(f"config key 'data.source': unknown task {name!r}; built-in tasks: {', '.join(TASKS)}")
        return TASKS[name](num_examples or TASK_ROWS, seed=seed)
    if source.startswith("memory:"):
        raise DataError(f"config key 'data.source': {source!r} names rows that were given in memory "
                        "(GRPOTrainer(train_dataset=...)); to train from a config file, write them to a JSONL file "
                        "(datasets.Dataset.to_json) and set data.source to it")
    import datasets

    datasets.disable_progress_bars()
    if source.startswith("hf:"):
        name, _, config = source[3:].partition(":")
        try:
            ds = datasets.load_dataset(name, config or None, split=split)
        except Exception as e:
            raise DataError(f"config key 'data.source': cannot load dataset {name!r} split {split!r}: {e}") from e
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise DataError(f"config key 'data.source': dataset file not found: {source}")
        fmt = FILE_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise DataError(f"dataset file {source}: unsupported extension {path.suffix!r}; "
                            f"use one of {', '.join(FILE_FORMATS)}")
        check_text_file(path)
        try:
            ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
        except Exception as e:
            raise DataError(f"dataset file {source} could not be read: {type(e).__name__}: {e}") from e
    return [dict(r) for r in (ds if num_examples is None else ds.select(range(min(num_examples, len(ds)))))]


def check_text_file(path: Path) -> None:
    """Refuse, naming the file and line (counted from 1), an empty dataset file, bytes that are not UTF-8 (line and
    byte offset), and for JSON Lines a line that is not a JSON object (the parser's reason). Parquet is binary
    and left to its reader."""
    if path.suffix.lower() == ".parquet":
        return
    data = path.read_bytes()
    if not data.strip():
        raise DataError(f"dataset file {path} is empty (config key 'data.source')")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(f"dataset file {path} line {line}: byte {column} (offset {e.start}) is not UTF-8 "
                        f"({e.reason}); save the file as UTF-8") from None
    if path.suffix.lower() == ".json":
        try:
            json.loads(text)
            return
        except ValueError as e:
            first = next((ln for ln in text.splitlines() if ln.strip()), "")
            try:
                json.loads(first)  # JSON Lines in a .json file (datasets reads both): checked line by line
            except ValueError:
                raise DataError(f"dataset file {path} line {e.lineno}: not valid JSON ({e.msg}, column "
                                f"{e.colno})") from None
    if path.suffix.lower() in (".jsonl", ".json"):
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"dataset file {path} line {number}: not valid JSON ({e.msg}, column "
                                f"{e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"dataset file {path} line {number}: expected a JSON object (one row), got "
                                f"{type(row).__name__}")


def data_fingerprint(source: str, rows: list[dict] | None = None) -> str | None:
    """SHA-256 of a dataset file (None for task: and hf: sources, whose config names them exactly). Given the file's
    ``rows``, the content of the images they hold is hashed in too, so an image file changed on disk changes it."""
    if source.startswith(("task:", "hf:")):
        return None
    path = Path(source).expanduser()
    if not path.is_file():
        return None
    digest = file_sha256(path)
    images = rows_images_digest(rows, dataset_folder(source)) if rows else None
    return digest if images is None else hashlib.sha256(f"{digest}+images:{images}".encode()).hexdigest()


@dataclass
class PromptDataset:
    rows: list[dict]  # every column of each kept row
    prompt_ids: list[list[int]]  # tokenized prompt of each row (chat template applied for chat prompts)
    prompt_column: str
    images: list[list[ImageSource]] | None = None  # a vision dataset: each kept row's images (images.open_images
    #                                                reads them); None: a text dataset
    messages: list[list[dict]] | None = None  # a vision dataset: each kept row's prompt as chat messages holding
    #                                           its {"type": "image"} parts; None: a text dataset

    def __len__(self) -> int:
        return len(self.rows)


def _is_chat(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)


def tokenize_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of one prompt: chat messages through the chat template (with the generation prompt)."""
    if _is_chat(prompt):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


class ImagePrompt(NamedTuple):
    """A vision dataset's prompt, as a vision-language model's processor takes it."""

    messages: list[dict]  # chat messages; contents are lists of text and {"type": "image"} parts
    images: list[ImageSource]  # the images, in the order of the image parts (images.open_images reads them)


def _has_images(row: dict, column: str) -> bool:
    return has_image_cells(row) or count_image_parts(row.get(column)) > 0


def image_prompt(row: dict, column: str, where: str, base_dir: Path | None, max_pixels: int) -> ImagePrompt:
    """``row``'s prompt as chat messages holding one image part per image of the row (image_parts.py: a plain-text
    prompt becomes one user message), with the images' sources; no image is read."""
    images_column, sources = row_image_sources(row, where, base_dir, max_pixels)
    prompt = row[column]
    given = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    messages = [{**m, "content": content_parts(m["content"], f"{where}: '{column}' message {i + 1}")}
                for i, m in enumerate(given)]
    place_images(messages, len(sources), where, f"'{column}'", images_column)
    return ImagePrompt(messages, sources)


def is_vision_dataset(cfg, rows: list[dict]) -> bool:
    """Whether any row holds images or image parts (the rows converted by :func:`image_prompts`)."""
    return any(_has_images(row, cfg.prompt_column) for row in rows)


def image_prompts(cfg, rows: list[dict]) -> list[ImagePrompt] | None:
    """Each row's :func:`image_prompt` (rows counted from 1 in errors) when any row holds images or image parts
    (a vision dataset; a row without images gets its prompt as messages and no images); None for a text dataset,
    which :func:`load_prompts` tokenizes as ever. Reads no image: :func:`read_prompt_rows` has."""
    column = cfg.prompt_column
    if not is_vision_dataset(cfg, rows):
        return None
    base_dir = dataset_folder(cfg.source)
    return [image_prompt(row, column, f"dataset {cfg.source!r} row {i + 1}", base_dir, cfg.max_image_pixels)
            for i, row in enumerate(rows)]


def read_prompt_rows(cfg, seed: int = 0, rows: list[dict] | None = None) -> list[dict]:
    """The rows of data config ``cfg`` (or ``rows`` given in memory, the first ``cfg.num_examples`` of them),
    checked as far as no tokenizer is needed (not empty, the prompt column present, each prompt a non-empty string
    or chat; in a vision dataset each prompt's image parts against its images, and every image read): the trainer
    reads them before the model loads."""
    if rows is None:
        rows = read_rows(cfg.source, cfg.split, cfg.num_examples, seed)
    elif cfg.num_examples is not None:
        rows = rows[:cfg.num_examples]
    if not rows:
        raise DataError(f"dataset {cfg.source!r} is empty (config key 'data.source')")
    column = cfg.prompt_column
    if column not in rows[0]:
        raise DataError(f"dataset {cfg.source!r} has no prompt column {column!r} (config key 'data.prompt_column'); "
                        f"columns: {', '.join(rows[0])}")
    for i, row in enumerate(rows):
        prompt = row.get(column)
        if not (isinstance(prompt, str) and prompt) and not (_is_chat(prompt) and prompt):
            raise DataError(f"dataset {cfg.source!r} row {i + 1}: prompt must be a non-empty string or a list of "
                            f"{{'role', 'content'}} messages; got {prompt!r:.80}")
    for prepared in image_prompts(cfg, rows) or []:
        open_images(prepared.images)  # each image read once, before the model loads
    return rows


def load_prompts(cfg, tokenizer, seed: int = 0, rows: list[dict] | None = None,
                 encode_images: Callable[[list[dict], list], list[int]] | None = None) -> PromptDataset:
    """Read (unless ``rows`` from :func:`read_prompt_rows` are given), check and tokenize the prompts of data
    config ``cfg``. A vision dataset's prompts (:func:`image_prompts`) are tokenized by ``encode_images(messages,
    images)`` (the images as RGB Pillow images; the ids include the image tokens), which a vision-language model
    provides; without it such a dataset is refused. A prompt with images is never cut: with
    data.overlong_prompt=truncate_left an overlong one is refused."""
    rows = read_prompt_rows(cfg, seed) if rows is None else rows
    column = cfg.prompt_column
    prepared = image_prompts(cfg, rows)
    if prepared is not None and encode_images is None:
        first = next(i for i, p in enumerate(prepared) if p.images or count_image_parts(p.messages))
        raise DataError(f"dataset {cfg.source!r} row {first + 1} holds images, but the model reads text only; "
                        "train a vision-language model on it")
    kept_rows, kept_ids, kept_prompts, skipped = [], [], [], 0
    for i, row in enumerate(rows):
        if prepared is None:
            ids = tokenize_prompt(tokenizer, row[column])
        else:
            ids = list(encode_images(prepared[i].messages, open_images(prepared[i].images)))
        if len(ids) > cfg.max_prompt_length:
            if cfg.overlong_prompt == "error" or (prepared is not None and prepared[i].images
                                                  and cfg.overlong_prompt == "truncate_left"):
                cut = "; a prompt with images is never cut" if cfg.overlong_prompt == "truncate_left" else ""
                raise DataError(f"dataset {cfg.source!r} row {i + 1}: prompt has {len(ids)} tokens, more than "
                                f"data.max_prompt_length={cfg.max_prompt_length}{cut}; raise it, or set "
                                f"data.overlong_prompt to {'skip' if cut else 'truncate_left or skip'}")
            if cfg.overlong_prompt == "skip":
                skipped += 1
                continue
            ids = ids[-cfg.max_prompt_length:]
        kept_rows.append(row)
        kept_ids.append(ids)
        kept_prompts.append(None if prepared is None else prepared[i])
    if skipped:
        log.warning("skipped %d of %d prompts longer than %d tokens", skipped, len(rows), cfg.max_prompt_length)
    if not kept_rows:
        raise DataError(f"dataset {cfg.source!r}: every prompt is longer than data.max_prompt_length")
    if prepared is None:
        return PromptDataset(kept_rows, kept_ids, column)
    return PromptDataset(kept_rows, kept_ids, column, images=[p.images for p in kept_prompts],
                         messages=[p.messages for p in kept_prompts])


class PromptSampler:
    """Deterministic stream of row indices: epoch e is a permutation drawn from (seed, e).

    Its whole state is ``position`` (rows consumed), so a checkpoint resumes it exactly.
    """

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True, position: int = 0):
        self.num_rows, self.seed, self.shuffle, self.position = num_rows, seed, shuffle, position

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_rows, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            epoch, offset = divmod(self.position, self.num_rows)
            order = self._order(epoch)
            take = min(k - len(out), self.num_rows - offset)
            out += order[offset:offset + take]
            self.position += take
        return out
