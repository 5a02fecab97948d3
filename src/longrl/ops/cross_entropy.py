"""Per-token cross-entropy (optionally label-smoothed) from hidden states and the LM head in chunks.

For hidden state h, LM-head weight W (bias b, logit multiplier m) and target token y, with z = m · (W h + b):

    nll     = −log p_y = −(z_y − logsumexp(z))                 the chunked log-prob op, no [N, V] tensor
    smooth  = −(1/V) Σ_j log p_j = logsumexp(z) − z̄            z̄ = (1/V) Σ_j z_j
    loss    = (1 − ε) · nll + ε · smooth = nll + ε · (z_y − z̄)   (torch's ``label_smoothing=ε``)

z_y and z̄ are linear in h (z̄ = m · (h · w̄ + b̄), w̄ the mean row of W), so the smoothing term needs no logits
either: one gathered row of W per token and one mean row. A logit softcap (Gemma 2/3) makes z nonlinear in h;
label smoothing is refused there (the plain loss is fine).
"""

from __future__ import annotations

import torch

from .logprobs import chunked_logprobs


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          bias: torch.Tensor | None = None, label_smoothing: float = 0.0, multiplier: float = 1.0,
                          softcap: float | None = None, chunk_size: int = 1024) -> torch.Tensor:
    """Loss per token [N] for rows ``hidden`` [N, H] predicting ``targets`` [N] (float32, or float64 inputs)."""
    if label_smoothing and softcap is not None:
        raise ValueError("label smoothing with a logit softcap is not supported (the smoothing term would need "
                         "every logit); set the smoothing to 0")
    logps, _ = chunked_logprobs(hidden, weight, targets, bias=bias, multiplier=multiplier, softcap=softcap,
                                chunk_size=chunk_size)
    loss = -logps  # [N]
    if label_smoothing:
        w_y = weight[targets]  # [N, H]
        w_mean = weight.mean(0)  # [H]
        h = hidden.to(loss.dtype)
        z_gap = (h * w_y.to(loss.dtype)).sum(-1) - h @ w_mean.to(loss.dtype)  # [N]: (W h)_y − mean_j (W h)_j
        if bias is not None:
            z_gap = z_gap + (bias[targets] - bias.mean()).to(loss.dtype)
        loss = loss + label_smoothing * multiplier * z_gap
    return loss


def reference_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                            bias: torch.Tensor | None = None, label_smoothing: float = 0.0,
                            multiplier: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """Plain twin of :func:`chunked_cross_entropy`: every logit at once and ``torch.nn.functional.cross_entropy``."""
    z = multiplier * torch.nn.functional.linear(hidden, weight, bias)  # [N, V]
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z if z.dtype == torch.float64 else z.float()
    return torch.nn.functional.cross_entropy(z, targets, reduction="none", label_smoothing=label_smoothing)
