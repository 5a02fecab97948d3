"""Rows given in memory instead of a file: a ``datasets.Dataset`` or a list of dicts (TRL's train_dataset and
eval_dataset), and the digest that stands for them as data.source (``memory:<digest>``), so a resume on other rows is
refused as a resume on another file is. Images count by their content (pixels, bytes, the files a path names), never
by the Python object."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..config import ConfigError
from .images import is_pil_image, pixels_digest, rows_images_digest


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


def _content(value) -> str:
    """What stands for a cell JSON cannot hold: a Pillow image's pixels or bytes by their digest, else ``str``."""
    if is_pil_image(value):
        return f"image:{pixels_digest(value)}"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"bytes:{hashlib.sha256(bytes(value)).hexdigest()}"
    return str(value)


def rows_fingerprint(rows: list[dict]) -> str:
    """A digest of the rows' content, recorded as data.source so a resume with other rows is refused; rows with
    images add the images' content (image files read, relative paths against the current directory)."""
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True, default=_content).encode())
    images = rows_images_digest(rows, None)
    if images is not None:
        digest.update(f"+images:{images}".encode())
    return f"{len(rows)}-rows-{digest.hexdigest()[:16]}"
