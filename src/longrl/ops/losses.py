"""GRPO-family policy losses, with normalisation that does not depend on how a batch is split.

Per token t of completion i, with log-ratio r = log π(t) − log π_old(t) and advantage A_i:

    token level (GRPO):     w = exp(r)
    sequence level (GSPO):  w = exp(Σ_t r · m / Σ_t m), one weight for every token of the sequence
    clipped surrogate:      ℓ = −min(w A, clip(w, 1 − ε, 1 + ε_high) A)      (w capped at δ first when δ is set)
    cispo:                  ℓ = −sg(min(w, ε_high)) · A · log π(t)
    KL penalty (k3):        ℓ += β (exp(q − log π) − (q − log π) − 1)        q = reference log-prob

The step loss is Σ_{i,t} ω_{i,t} ℓ_{i,t}, where the weights ω come from the whole optimizer step's
completion mask m [B, T] (so that any micro-batch split sums to the same loss and gradient):

    grpo:              ω = m / (B · |i|)           mean over sequences of each sequence's token mean
    bnpo, dapo, cispo: ω = m / Σ m                 mean over every completion token of the step
    dr_grpo:           ω = m / (B · L_max)         L_max = max_completion_length

These follow TRL's GRPOConfig. TRL's ``bnpo`` normalises per local micro-batch and ``dapo`` by the global
token count; here both use the step's token count, which is what makes them split-invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")


def loss_token_weights(completion_mask: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """Per-token weights ω [B, T] for the whole step's completion mask [B, T] (float32 unless float64)."""
    mask = completion_mask if completion_mask.dtype == torch.float64 else completion_mask.to(torch.float32)
    num_sequences = mask.shape[0]
    if loss_type == "grpo":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * num_sequences)
    if loss_type in ("bnpo", "dapo", "cispo"):
        return mask / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return mask / (num_sequences * max_completion_length)
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")


@dataclass(frozen=True)
class PolicyLossSettings:
    """The hyper-parameters of the objective, named as in TRL's GRPOConfig."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: same as epsilon (for cispo: the ratio cap, e.g. 5.0)
    delta: float | None = None
    beta: float = 0.0
    importance_sampling_level: str = "token"  # "token" or "sequence" (GSPO)


def per_token_policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
                          advantages: torch.Tensor, mask: torch.Tensor, s: PolicyLossSettings,
                          sampler_weights: torch.Tensor | None = None):
    """Per-token loss ℓ [B, T] and a dict of per-token diagnostics ([B, T] each, detached).

    logps, old_logps, ref_logps, mask: [B, T]; advantages: [B]. sampler_weights [B, T]: importance weights
    for the sampler/trainer mismatch (``ops.rollout_correction``), applied to the policy term, not the KL.
    """
    mask = mask.to(logps.dtype)
    log_ratio = logps - old_logps
    if s.importance_sampling_level == "sequence":
        log_w = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # [B, 1]
    elif s.importance_sampling_level == "token":
        log_w = log_ratio
    else:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence'; got {s.importance_sampling_level!r}")
    ratio = torch.exp(log_w)
    adv = advantages.to(logps.dtype)[:, None]  # [B, 1]
    eps_high = s.epsilon if s.epsilon_high is None else s.epsilon_high
    diagnostics = {}
    if s.loss_type == "cispo":
        capped = torch.clamp(ratio, max=eps_high).detach()
        loss = -capped * adv * logps
        diagnostics["clipped"] = (ratio > eps_high).to(logps.dtype).expand_as(logps).detach()
    else:
        ratio_unclipped = torch.clamp(ratio, max=s.delta) if s.delta is not None else ratio
        ratio_clipped = torch.clamp(ratio, 1.0 - s.epsilon, 1.0 + eps_high)
        loss = -torch.min(ratio_unclipped * adv, ratio_clipped * adv)
        is_low = (ratio < 1.0 - s.epsilon) & (adv < 0)
        is_high = (ratio > 1.0 + eps_high) & (adv > 0)
        diagnostics["clipped"] = (is_low | is_high).to(logps.dtype).expand_as(logps).detach()
    if sampler_weights is not None:
        loss = loss * sampler_weights.to(loss.dtype)
    if s.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs reference log-probs")
        kl = k3_kl(logps, ref_logps)
        loss = loss + s.beta * kl
        diagnostics["kl"] = kl.detach()
    return loss, diagnostics


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π ‖ π_ref) per token: exp(q − p) − (q − p) − 1 ≥ 0."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1.0


def weighted_loss(per_token_loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ ω ℓ over a micro-batch: summing this over any split of the step gives the step loss."""
    return (per_token_loss * weights.to(per_token_loss.dtype)).sum()
