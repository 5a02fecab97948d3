"""The optimizer and its schedule, the same for every recipe: AdamW over the trainable parameters and a LambdaLR
whose multiplier of the base learning rate is

    m(s) = (s + 1) / (w + 1)                          for s < w (linear warm-up over w steps)
    m(s) = 1 | 1 − p | ½ (1 + cos π p)                after, p = (s − w) / (S − w): constant, linear, cosine
"""

from __future__ import annotations

import math


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):
    """m(step) for ``schedule`` (constant, linear or cosine) after ``warmup_steps`` of ``total_steps``."""
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0
    return f


def make_optimizer(model, train_cfg, total_steps: int | None = None):
    """(trainable parameters, AdamW, its LambdaLR schedule) of ``model`` from the ``train:`` section; the schedule
    spans ``total_steps`` (default train.max_steps)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    t = train_cfg
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                                  weight_decay=t.weight_decay)
    steps = t.max_steps if total_steps is None else total_steps
    return params, optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(t.lr_scheduler_type, t.warmup_steps, steps))
