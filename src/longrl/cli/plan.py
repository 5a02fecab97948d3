"""``longrl plan``: the memory plan of a run for a GPU, printed before anything loads."""

from __future__ import annotations

import math
import sys

from .exit_codes import EXIT_BAD_INPUT


def plan_command(cfg, gpu_memory_gib: float | None, world_size: int = 1, sft: bool = False) -> int:
    if gpu_memory_gib is not None and not (math.isfinite(gpu_memory_gib) and gpu_memory_gib > 0):
        print(f"longrl: error: --gpu-memory-gib must be a positive number of GiB; got {gpu_memory_gib}",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    import torch

    from ..config import trajectory_tokens
    from ..memory.planner import GIB, PlanError, StepShape, model_config_of, plan_for_config

    step = StepShape.grpo(cfg, trajectory_tokens(cfg))
    if sft:  # a supervised step: sft.examples_per_step sequences of sft.max_length tokens
        if world_size < 1 or world_size > cfg.sft.examples_per_step:
            print(f"longrl: error: --nproc-per-node must be between 1 and sft.examples_per_step "
                  f"({cfg.sft.examples_per_step}: each process trains whole examples); got {world_size}",
                  file=sys.stderr)
            return 2
        label = f"{cfg.sft.examples_per_step} examples × {cfg.sft.max_length:,} tokens"
        step = StepShape.sft(cfg)
        if world_size > 1:  # one process of the job: its share of the step's examples, the weights replicated
            step = StepShape.sft(cfg, examples=-(-cfg.sft.examples_per_step // world_size))
            label += f"; per GPU of {world_size} (replicated weights): up to {step.prompts} examples"
        world_size = 1

    if gpu_memory_gib is None:
        if not torch.cuda.is_available():
            print("longrl: error: no CUDA device here; pass --gpu-memory-gib to plan for one", file=sys.stderr)
            return 2
        gpu_memory_gib = torch.cuda.mem_get_info()[0] / GIB
    if world_size < 1 or world_size > step.prompts:
        print(f"longrl: error: --nproc-per-node must be between 1 and train.prompts_per_step "
              f"({cfg.train.prompts_per_step}: each process samples whole groups); got {world_size}", file=sys.stderr)
        return 2
    try:
        model_config = model_config_of(cfg.model.name_or_path, cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:  # no such directory or hub id, offline, no config.json, an unknown model type
        print(f"longrl: error: config key 'model.name_or_path': cannot read the model config of "
              f"{cfg.model.name_or_path!r}: {e}\n(offline? `longrl plan` needs only the model's config.json: download "
              "the model once, or point model.name_or_path at a local directory)", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        plan = plan_for_config(cfg, model_config, int(gpu_memory_gib * GIB), world_size=world_size, step=step)
    except PlanError as e:
        print(f"longrl: this job cannot fit{f' on {world_size} GPUs' if world_size > 1 else ''}: {e}", file=sys.stderr)
        return 1
    n = cfg.train.prompts_per_step * cfg.grpo.num_generations
    if sft:
        print(f"plan for {cfg.model.name_or_path} (sft): {label}, {gpu_memory_gib:.1f} GiB GPU")
        print(plan.table())
        return 0
    layout = ""
    if world_size > 1:
        per_rank = -(-cfg.train.prompts_per_step // world_size) * cfg.grpo.num_generations
        kind = ("FSDP2 full weights" if not cfg.lora.enabled else
                "data-parallel, 4-bit base replicated" if cfg.model.load_in_4bit else
                "data-parallel, FP8 base replicated" if cfg.model.load_in_fp8 else "data-parallel, LoRA replicated")
        layout = f"; per GPU of {world_size} ({kind}): up to {per_rank} completions"
    print(f"plan for {cfg.model.name_or_path}: {n} completions × "
          f"{cfg.data.max_prompt_length + cfg.generation.max_completion_length:,} tokens, {gpu_memory_gib:.1f} GiB GPU"
          f"{layout}")
    print(plan.table())
    return 0
