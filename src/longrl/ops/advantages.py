"""Group-relative advantages.

Rewards r [P·G] come grouped by prompt (G completions per prompt, contiguous). With μ_g the group mean,

    A = r − μ_g                       scale_rewards = "none"   (Dr. GRPO)
    A = (r − μ_g) / (σ_g + 1e-4)      scale_rewards = "group"  (GRPO; σ_g the group's std)
    A = (r − μ_g) / (σ + 1e-4)        scale_rewards = "batch"  (σ the std over the whole batch)

Samples whose reward is NaN (a reward function failed on them) are left out of μ and σ and get A = 0.
A group whose rewards are all equal gets A = 0. Standard deviations are unbiased (as torch.std).

That is ``multi_objective_aggregation = "sum_then_normalize"``: r is the weighted sum of the reward functions.
``"normalize_then_sum"`` (GDPO, TRL's name) normalises each function k within each group first, then the
weighted sum over the whole rollout batch:

    r̂_k = (r_k − μ_g(r_k)) / (σ_g(r_k) + 1e-4),   s = Σ_k w_k r̂_k,   A = (s − μ(s)) / (σ(s) + 1e-4)

(functions that returned None for a sample are left out of its sum; scale_rewards does not apply).

``all_sum`` (a function summing a tensor over data-parallel ranks; None in one process) makes σ of
``scale_rewards="batch"`` and GDPO's μ(s), σ(s) the global batch's; group statistics never need it (a group
stays on one rank).
"""

from __future__ import annotations

import torch

SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def _nanstd(x: torch.Tensor, dim: int, all_sum=None) -> torch.Tensor:
    """Unbiased std along ``dim`` ignoring NaNs (0 where fewer than two values); keeps ``dim``. ``all_sum``:
    the sums (count, values, squared deviations) taken over every rank too."""
    total = all_sum or (lambda t: t)
    valid = ~torch.isnan(x)
    n = total(valid.sum(dim, keepdim=True))
    mean = total(torch.nansum(x, dim, keepdim=True)) / n.clamp(min=1)
    sq = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x))
    return (total(sq.sum(dim, keepdim=True)) / (n - 1).clamp(min=1)).sqrt()


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group",
                     all_sum=None) -> torch.Tensor:
    """Advantages [P·G] from rewards [P·G] (float; NaN marks a sample with no learning signal)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}; got {scale_rewards!r}")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {num_generations}")
    r = rewards.to(torch.float32).view(-1, num_generations)  # [P, G]
    valid = ~torch.isnan(r)
    count = valid.sum(-1, keepdim=True).clamp(min=1)
    mean = torch.nansum(r, -1, keepdim=True) / count  # [P, 1]
    centred = torch.where(valid, r - mean, torch.zeros_like(r))
    if scale_rewards == "group":
        centred = centred / (_nanstd(r, dim=-1) + 1e-4)
    elif scale_rewards == "batch":
        centred = centred / (_nanstd(r.reshape(-1), dim=0, all_sum=all_sum) + 1e-4)
    return centred.reshape(-1)


def decoupled_group_advantages(rewards_per_function: torch.Tensor, weights: torch.Tensor, num_generations: int,
                               invalid: torch.Tensor | None = None, all_sum=None) -> torch.Tensor:
    """GDPO advantages [P·G] from per-function rewards [P·G, F] (NaN: not applicable) and weights [F].

    invalid [P·G] (bool): samples with no learning signal (a reward function failed): A = 0, left out of μ, σ.
    The batch statistics are over the whole rollout batch, all of its optimizer steps (``all_sum``: of every rank).
    """
    n, f = rewards_per_function.shape
    if n % num_generations:
        raise ValueError(f"{n} rewards do not split into groups of {num_generations}")
    r = rewards_per_function.to(torch.float32).view(-1, num_generations, f)  # [P, G, F]
    valid = ~torch.isnan(r)
    mean = torch.nansum(r, 1, keepdim=True) / valid.sum(1, keepdim=True).clamp(min=1)  # [P, 1, F]
    normalised = (r - mean) / (_nanstd(r, dim=1) + 1e-4)  # NaN where the function did not apply
    total = torch.nansum(normalised * weights.to(torch.float32), -1).reshape(-1)  # [P·G]
    if invalid is not None:
        total[invalid] = float("nan")
    ok = ~torch.isnan(total)
    batch = all_sum or (lambda t: t)
    mean = batch(torch.nansum(total, 0, keepdim=True)) / batch(ok.sum(0, keepdim=True)).clamp(min=1)  # [1]
    scaled = (total - mean) / (_nanstd(total, dim=0, all_sum=all_sum) + 1e-4)
    return torch.where(ok, scaled, torch.zeros_like(scaled))


def reference_group_advantages(rewards, num_generations, scale_rewards="group"):
    """Loop-per-group twin of :func:`group_advantages`; for tests."""
    out = []
    flat_valid = [x for x in rewards.tolist() if x == x]
    batch_std = torch.tensor(flat_valid).std() if len(flat_valid) > 1 else torch.tensor(0.0)
    for g in range(0, rewards.numel(), num_generations):
        group = rewards[g:g + num_generations].tolist()
        valid = [x for x in group if x == x]
        mean = sum(valid) / len(valid) if valid else 0.0
        std = torch.tensor(valid).std().item() if len(valid) > 1 else 0.0
        for x in group:
            if x != x:
                out.append(0.0)
            elif scale_rewards == "group":
                out.append((x - mean) / (std + 1e-4))
            elif scale_rewards == "batch":
                out.append((x - mean) / (float(batch_std) + 1e-4))
            else:
                out.append(x - mean)
    return torch.tensor(out)
