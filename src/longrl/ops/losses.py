"""GRPO-family policy losses, with normalisation that does not depend on how a batch is split.

Per token t of completion i, with log-ratio r = log π(t) − log π_old(t) and advantage A_i:

    token level (GRPO):     w = exp(r)
    sequence level (GSPO):  w = exp(Σ_t r · m / Σ_t m), one weight for every token of the sequence
    clipped surrogate:      ℓ = −min(w A, clip(w, 1 − ε, 1 + ε_high) A)      (w capped at δ first when δ is set)
                            (grpo, bnpo, dr_grpo, dapo, luspo)
    cispo:                  ℓ = −sg(min(w, ε_high)) · A · log π(t)
    sapo:                   ℓ = −(4/τ) σ(τ (w − 1)) · A                      τ = τ_pos if A > 0 else τ_neg
    vespo:                  ℓ = −sg(φ(W_i)) · A · log π(t),   φ(W) = e^λ W^k e^(−λW),
                            W_i = exp(Σ_t m r) (× the sampler correction), k, λ by the sign of A
    KL penalty (k3):        ℓ += β · w · (exp(q − log π) − (q − log π) − 1)   q = reference log-prob;
                            the factor w only with use_bias_correction_kl (then ∇ is the reverse-KL gradient)

Masks on the policy term (not on the KL): the off-policy sequence mask (drops a sequence with A < 0 whose mean
log π_sampler − log π exceeds ``off_policy_mask_threshold``) and the high-entropy token mask
(``top_entropy_quantile``). The entropy bonus subtracts ``entropy_coef`` × the mean entropy of the kept tokens.

The step loss is Σ_{i,t} ω_{i,t} ℓ_{i,t}, where the weights ω come from the whole optimizer step's
completion mask m [B, T] (so that any micro-batch split sums to the same loss and gradient):

    grpo, sapo:               ω = m / (B · |i|)      mean over sequences of each sequence's token mean
    bnpo:                     ω = m / Σ m            mean over every completion token of the step
    dapo, cispo, vespo:       ω = m / (Σ' m / S)     Σ' over the rollout batch of S = steps_per_generation steps
    dr_grpo:                  ω = m / (B · L_max)    L_max = max_completion_length
    luspo:                    ω = m / B              mean over sequences of each sequence's token sum

These follow TRL's GRPOConfig (1.15). TRL's ``bnpo`` normalises per local micro-batch; here it uses the step's
token count, which is what makes it split-invariant (equal to TRL's when the micro-batch is the whole step).

B and Σ m are the global step's: with data-parallel ranks each holds its share of every step's rows, and ``all_sum``
(a function summing a tensor over the ranks; None in one process) makes the normalisers global, so that the ranks'
losses add up to the single-process loss (the process split is one more split of the step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED_SURROGATE = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def loss_token_weights(completion_mask: torch.Tensor, loss_type: str, max_completion_length: int,
                       steps_per_generation: int = 1, all_sum=None) -> torch.Tensor:
    """Per-token weights ω [S·B, T] for a rollout batch's completion mask [S·B, T] (float32 unless float64).

    The batch holds S = ``steps_per_generation`` optimizer steps, step s owning rows [s·B, (s+1)·B). ``all_sum``:
    this rank's rows of a data-parallel step (sequence and token counts summed over the ranks).
    """
    total = all_sum or (lambda t: t)
    mask = completion_mask if completion_mask.dtype == torch.float64 else completion_mask.to(torch.float32)
    rows, width = mask.shape
    if rows % steps_per_generation:
        raise ValueError(f"{rows} completions do not split into {steps_per_generation} steps")
    steps = mask.view(steps_per_generation, rows // steps_per_generation, width)  # [S, B, T]
    num_sequences = total(torch.tensor(float(steps.shape[1]), dtype=mask.dtype))
    if loss_type in ("grpo", "sapo"):
        w = steps / (steps.sum(-1, keepdim=True).clamp(min=1.0) * num_sequences)
    elif loss_type == "bnpo":
        w = steps / total(steps.sum((1, 2), keepdim=True)).clamp(min=1.0)
    elif loss_type in ("dapo", "cispo", "vespo"):
        w = steps / (total(steps.sum()) / steps_per_generation).clamp(min=1.0)
    elif loss_type == "dr_grpo":
        w = steps / (num_sequences * max_completion_length)
    elif loss_type == "luspo":
        w = steps / num_sequences
    else:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")
    return w.reshape(rows, width)


@dataclass(frozen=True)
class PolicyLossSettings:
    """The hyper-parameters of the objective, named as in TRL's GRPOConfig."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: same as epsilon (for cispo: the ratio cap, e.g. 5.0)
    delta: float | None = None
    beta: float = 0.0
    importance_sampling_level: str = "token"  # "token" or "sequence" (GSPO)
    use_bias_correction_kl: bool = True
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None


def per_token_policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
                          advantages: torch.Tensor, mask: torch.Tensor, s: PolicyLossSettings,
                          sampler_weights: torch.Tensor | None = None, token_keep: torch.Tensor | None = None,
                          sampling_logps: torch.Tensor | None = None):
    """Per-token loss ℓ [B, T] and a dict of per-token diagnostics ([B, T] each, detached).

    logps, old_logps, ref_logps, mask: [B, T]; advantages: [B]. sampler_weights [B, T]: importance weights
    for the sampler/trainer mismatch (``ops.rollout_correction``), applied to the policy term, not the KL (for
    vespo: folded into the sequence weight W instead). token_keep [B, T]: 0/1 mask of the policy term (the
    high-entropy tokens). sampling_logps [B, T]: the log-probs the completions were sampled with, for the
    off-policy mask (None: old_logps).
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
    no_clip = torch.zeros_like(logps)
    diagnostics = {}
    if s.loss_type == "cispo":
        capped = torch.clamp(ratio, max=eps_high).detach()
        loss = -capped * adv * logps
        diagnostics["clipped"] = (ratio > eps_high).to(logps.dtype).expand_as(logps).detach()
    elif s.loss_type in CLIPPED_SURROGATE:
        ratio_unclipped = torch.clamp(ratio, max=s.delta) if s.delta is not None else ratio
        ratio_clipped = torch.clamp(ratio, 1.0 - s.epsilon, 1.0 + eps_high)
        loss = -torch.min(ratio_unclipped * adv, ratio_clipped * adv)
        is_low = (ratio < 1.0 - s.epsilon) & (adv < 0)
        is_high = (ratio > 1.0 + eps_high) & (adv > 0)
        diagnostics["clipped"] = (is_low | is_high).to(logps.dtype).expand_as(logps).detach()
    elif s.loss_type == "sapo":
        loss = -sapo_gate(ratio, adv, s.sapo_temperature_pos, s.sapo_temperature_neg) * adv
        diagnostics["clipped"] = no_clip
    elif s.loss_type == "vespo":
        phi = vespo_gamma_weights(adv, log_ratio, mask, sampler_weights, s.vespo_k_pos, s.vespo_lambda_pos,
                                  s.vespo_k_neg, s.vespo_lambda_neg)  # [B, 1], detached
        loss = -phi * adv * logps
        diagnostics["clipped"] = no_clip
        diagnostics["vespo_phi"] = phi.expand_as(logps)
    else:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {s.loss_type!r}")
    loss = loss.expand_as(logps)  # sequence-level weights give [B, 1] for some types
    if s.off_policy_mask_threshold is not None:
        sampled = old_logps if sampling_logps is None else sampling_logps
        keep = off_policy_sequence_mask(adv[:, 0], logps, sampled, mask, s.off_policy_mask_threshold)  # [B, 1]
        loss = loss * keep
        diagnostics["off_policy_masked"] = (1.0 - keep).expand_as(logps)
    if token_keep is not None:
        loss = loss * token_keep.to(loss.dtype)
    if sampler_weights is not None and s.loss_type != "vespo":
        loss = loss * sampler_weights.to(loss.dtype)
    if s.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs reference log-probs")
        kl = k3_kl(logps, ref_logps)
        if s.use_bias_correction_kl:
            kl = kl * ratio
        loss = loss + s.beta * kl
        diagnostics["kl"] = kl.detach()
    return loss, diagnostics


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π ‖ π_ref) per token: exp(q − p) − (q − p) − 1 ≥ 0."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1.0


def sapo_gate(ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float,
              temperature_neg: float) -> torch.Tensor:
    """SAPO's soft gate (4/τ) σ(τ (w − 1)) [B, T or 1]: slope 1 at w = 1 (as the plain surrogate w), flat far from it.

    ratio: w [B, T] or [B, 1]; advantages [B, 1]; τ = temperature_pos where A > 0, else temperature_neg.
    """
    tau = _where(advantages > 0, temperature_pos, temperature_neg, ratio)  # [B, 1]
    return torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau


@torch.no_grad()
def vespo_gamma_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                        sampler_weights: torch.Tensor | None, k_pos: float, lambda_pos: float, k_neg: float,
                        lambda_neg: float) -> torch.Tensor:
    """VESPO's sequence weights φ(W) = exp(λ + k log W − λ W) [B, 1] (detached; φ(1) = 1).

    log W = clamp(Σ_t m (clamp(r, ±20) + clamp(log w_sampler, log 1e-8, 20)), log 1e-8, 20) with r = log π − log π_old
    [B, T] and w_sampler the sampler-correction weights [B, T] (or none); k, λ: the _pos pair where A ≥ 0
    (advantages [B, 1]), the _neg pair below. Computed in log space, as TRL does.
    """
    lower = math.log(1e-8)
    seq_log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)  # [B, 1]
    if sampler_weights is not None:
        log_is = torch.clamp(torch.log(sampler_weights.to(log_ratio.dtype)), lower, 20.0)
        seq_log_w = seq_log_w + (log_is * mask).sum(-1, keepdim=True)
    log_w = torch.clamp(seq_log_w, lower, 20.0)
    nonneg = advantages >= 0
    k = _where(nonneg, k_pos, k_neg, log_w)
    lam = _where(nonneg, lambda_pos, lambda_neg, log_w).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def off_policy_sequence_mask(advantages: torch.Tensor, logps: torch.Tensor, sampling_logps: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask [B, 1]: 1 where A ≥ 0 or mean_t(log π_sampling − log π) ≤ δ.

    advantages [B]; logps (the current policy's), sampling_logps, mask: [B, T]. Per sequence, so any
    micro-batch split gives the same mask.
    """
    diff = torch.nan_to_num((sampling_logps - logps) * mask, nan=0.0)
    mean_kl = diff.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # [B, 1]
    return ((advantages[:, None] >= 0) | (mean_kl <= threshold)).to(logps.dtype)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, top_quantile: float,
                      all_gather=None) -> torch.Tensor:
    """The top-ρ tokens by entropy [B, T] (bool): H ≥ the (1 − ρ) quantile of H over the masked tokens.

    entropies, mask: [B, T], the whole optimizer step's (the threshold is a statistic of the step, so it must
    not be taken per micro-batch). ρ = 0 keeps the highest-entropy token(s), ρ = 1 every token. Quantiles
    interpolate linearly, as torch.quantile (and TRL) do; by a sort, since torch.quantile refuses more than 2^24
    values (a long-context step can have more tokens). ``all_gather``: this rank's rows of a data-parallel step (a
    function concatenating a 1-D tensor over the ranks; None in one process): the quantile of every rank's tokens.
    """
    valid = mask.bool()
    values = entropies[valid]  # [n] this rank's
    if all_gather is not None:
        values = all_gather(values)  # [N] the step's, every rank's
    if values.numel() == 0:
        return torch.zeros_like(valid)
    values = values.sort().values
    rank = (1.0 - top_quantile) * (values.numel() - 1)
    below = math.floor(rank)
    threshold = torch.lerp(values[below], values[min(below + 1, values.numel() - 1)], rank - below)
    return (entropies >= threshold) & valid


def entropy_bonus_weights(mask: torch.Tensor, steps_per_generation: int = 1, all_sum=None) -> torch.Tensor:
    """Weights [S·B, T] of the entropy bonus: each step's mean over its kept tokens, m / Σ_step m (``all_sum``: the
    sum over the ranks of a data-parallel step too, as in :func:`loss_token_weights`)."""
    total = all_sum or (lambda t: t)
    rows, width = mask.shape
    steps = mask.view(steps_per_generation, rows // steps_per_generation, width)
    return (steps / total(steps.sum((1, 2), keepdim=True)).clamp(min=1.0)).reshape(rows, width)


def _where(cond: torch.Tensor, a: float, b: float, like: torch.Tensor) -> torch.Tensor:
    """a where cond else b, in like's dtype (python floats kept exact in float64)."""
    return torch.where(cond, torch.tensor(a, dtype=like.dtype, device=like.device),
                       torch.tensor(b, dtype=like.dtype, device=like.device))


def weighted_loss(per_token_loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ ω ℓ over a micro-batch: summing this over any split of the step gives the step loss."""
    return (per_token_loss * weights.to(per_token_loss.dtype)).sum()
