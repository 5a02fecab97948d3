"""Importance-sampling correction for the mismatch between the sampler and the trainer.

The sampler's kernels (bf16 decode, other reduction orders) give slightly different probabilities from the
trainer's for the same weights, so completions come from π_sampler, not from π_old. Per token, with
log r = log π_old − log π_sampler (π_old: the trainer's log-probs before the update):

    token_truncate:     w_t = min(r_t, C)                 (truncated importance sampling)
    token_mask:         w_t = r_t · [r_t ≤ C]
    sequence_truncate:  w_t = min(R, C),  R = exp(Σ_t m_t log r_t)   (one weight per sequence)
    sequence_mask:      w_t = R · [R ≤ C]

The policy part of the per-token loss is multiplied by the (detached) w; TRL calls this
``vllm_importance_sampling_correction`` with the same four modes.
"""

from __future__ import annotations

import torch

MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def rollout_correction_weights(old_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                               cap: float) -> tuple[torch.Tensor, dict]:
    """Weights w [B, T] (detached) and diagnostics; old_logps, sampler_logps, mask: [B, T]."""
    if mode not in MODES:
        raise ValueError(f"rollout_correction must be one of {', '.join(MODES)}; got {mode!r}")
    mask = mask.to(old_logps.dtype)
    log_r = ((old_logps - sampler_logps.to(old_logps.dtype)) * mask).detach()  # [B, T]
    r = torch.exp(log_r)  # per-token ratios
    seq_r = torch.exp(log_r.sum(-1, keepdim=True)).expand_as(log_r)  # per-sequence ratio on each token
    raw = seq_r if mode.startswith("sequence") else r  # the weights before truncation or masking
    w = torch.ones_like(log_r) if mode == "none" else (
        torch.clamp(raw, max=cap) if mode.endswith("truncate") else raw * (raw <= cap))
    n = mask.sum().clamp(min=1.0)
    stats = {
        "sampler/logp_abs_diff": float((log_r.abs() * mask).sum() / n),
        # k3 on tokens drawn from the sampler: r − log r − 1 estimates KL(π_sampler ‖ π_old) ≥ 0
        "sampler/k3_kl": float(((r - log_r - 1.0) * mask).sum() / n),
        "sampler/is_weight_mean": float((w * mask).sum() / n),
        "sampler/is_weight_changed": float((((w - raw).abs() > 1e-6).to(mask.dtype) * mask).sum() / n),
    }
    return (w * mask).detach(), stats
