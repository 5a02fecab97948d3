"""``longrl train`` and ``longrl sft``: a recipe from a config, in this process or under torchrun."""

from __future__ import annotations

import sys


def run_grpo(cfg) -> list[dict]:
    from ..training.distributed import shutdown
    from ..recipes.grpo import GRPOTrainer

    try:
        return GRPOTrainer(cfg).train()
    finally:
        shutdown()  # a torchrun job's process group (nothing in one process)


def run_sft(cfg) -> list[dict]:
    from ..recipes.sft import SFTTrainer
    from ..training.distributed import shutdown

    try:
        return SFTTrainer(cfg).train()
    finally:
        shutdown()  # a torchrun job's process group (nothing in one process)


def torchrun(args) -> int:
    """``longrl train|sft --nproc-per-node N ...`` → ``torchrun --standalone --nproc-per-node N -m longrl train|sft
    ...``."""
    import subprocess

    if args.nproc_per_node < 1:
        print(f"longrl: error: --nproc-per-node must be >= 1; got {args.nproc_per_node}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc_per_node}",
           "-m", "longrl", args.command, args.config, *args.overrides]
    return subprocess.call(cmd)
