"""What every benchmark writes beside its figures: the run's metadata, and a JSON + markdown pair in results/."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

# LONGRL_RESULTS_DIR redirects a run's files (a background run on the GPU machine writes outside the synced tree)
RESULTS = Path(os.environ.get("LONGRL_RESULTS_DIR") or Path(__file__).resolve().parent / "results")


def run_meta(**extra) -> dict:
    """Date, GPU (or CPU), library versions and the command line of this run, plus ``extra``."""
    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return dict(date=datetime.date.today().isoformat(), gpu=gpu, torch=torch.__version__,
                transformers=transformers.__version__, python=platform.python_version(),
                command="python " + " ".join(sys.argv), **extra)


def write_result(stem: str, payload: dict, lines: list[str]) -> None:
    """results/STEM.json (``payload``) and results/STEM.md (``lines``), and the markdown on stdout."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=2, default=str))
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
