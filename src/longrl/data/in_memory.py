"""Rows given in memory instead of a file: a ``datasets.Dataset`` or a list of dicts (TRL's train_dataset and
eval_dataset), and the digest that stands for them as data.source (``memory:<digest>``), so a resume on other rows is
refused as a resume on another file is."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..config import ConfigError


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


def rows_fingerprint(rows: list[dict]) -> str:
    """A digest of the rows' content, recorded as data.source so a resume with other rows is refused."""
    text = json.dumps(rows, sort_keys=True, default=str)
    return f"{len(rows)}-rows-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
