"""``longrl train`` and ``longrl sft``: a recipe from a config, in this process or under torchrun."""

from __future__ import annotations

import sys


def run_grpo(cfg) -> list[dict]:
    from ..recipes.grpo import GRPOTrainer

    return _run(GRPOTrainer, cfg)


def run_sft(cfg) -> list[dict]:
    from ..recipes.sft import SFTTrainer

    return _run(SFTTrainer, cfg)


def _run(trainer_class, cfg) -> list[dict]:
    """Train; a run stopped by a signal or a guard reports its exit code to the launcher, if any
    (training/signals.py ``report_exit``); a torchrun job's process group ends with it."""
    from ..training.distributed import shutdown
    from ..training.signals import ImmediateStop, TrainingStopped, report_exit

    try:
        return trainer_class(cfg).train()
    except (TrainingStopped, ImmediateStop) as e:
        report_exit(e.exit_code, str(e))
        raise
    finally:
        shutdown()  # a torchrun job's process group (nothing in one process)


def torchrun(args) -> int:
    """``longrl train|sft --nproc-per-node N ...`` → ``torchrun --standalone --nproc-per-node N -m longrl train|sft
    ...`` under the launcher that passes stop signals to every rank (cli/launcher.py)."""
    from .launcher import launch

    if args.nproc_per_node < 1:
        print(f"longrl: error: --nproc-per-node must be >= 1; got {args.nproc_per_node}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc_per_node}",
           "-m", "longrl", args.command, args.config, *args.overrides]
    return launch(cmd)
