"""Per-token log-probabilities of target tokens, computed from hidden states and the LM head in chunks.

For hidden state h (row of ``hidden``), LM-head weight W and target token y:

    z   = softcap(m · (W h + b)) / T            softcap(x) = c · tanh(x / c)  (only when c is set)
    lp  = z_y − logsumexp(z)                    log-probability of y
    H   = logsumexp(z) − Σ_j p_j z_j            entropy of p = softmax(z)

m is the model's logit multiplier (Cohere ``logit_scale``, 1 / Granite ``logits_scaling``), c its
``final_logit_softcapping`` (Gemma 2/3), T the sampling temperature. Only ``chunk_size`` rows of logits
exist at any time, in forward and in backward (which recomputes them). The gradient with respect to z is

    ∂lp/∂z_j = 1[j = y] − p_j            ∂H/∂z_j = −p_j (log p_j + H)

and flows back through 1/T, tanh and m to h (and to W, b only when they require grad). On a GPU (without a softcap)
each chunk's softmax statistics and its gradient with respect to the logits run as one Triton kernel a direction
over the 16-bit logits (ops/logprob_kernel.py); elsewhere their twins there, which are the PyTorch path.
"""

from __future__ import annotations

import functools
import math

import torch

from .logprob_kernel import row_grad_, row_grad_reference, row_stats, row_stats_reference, scale_logits
from .logprob_kernel import triton as _triton


def head_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, multiplier: float,
                  softcap: float | None, temperature: float):
    """Return (z, tanh_or_None) in float32 for rows h [n, H]: z = softcap(m · (W h + b)) / T, [n, V]. Also the
    sampler's logits (rollout/sampler.py)."""
    return scale_logits(torch.nn.functional.linear(h, weight, bias), multiplier, softcap, temperature)


class ChunkedLogProbs(torch.autograd.Function):
    """Autograd Function behind :func:`chunked_logprobs`; see the module docstring for the math."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, multiplier, softcap, temperature, chunk_size, with_entropy, kernel):
        n = hidden.shape[0]
        out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logps = torch.empty(n, dtype=out_dtype, device=hidden.device)  # [N]
        entropy = torch.empty(n, dtype=out_dtype, device=hidden.device) if with_entropy else None  # [N]
        lse_all = torch.empty(n, dtype=out_dtype, device=hidden.device)  # [N]
        # the logits [n, V] are handed over as a temporary, not kept here: the PyTorch path frees them once scaled
        stats = row_stats if kernel else functools.partial(row_stats_reference, softcap=softcap)
        with torch.no_grad():
            for start in range(0, n, chunk_size):
                stop = min(start + chunk_size, n)
                lse, lp, ent = stats(torch.nn.functional.linear(hidden[start:stop], weight, bias), targets[start:stop],
                                     multiplier, temperature, with_entropy)
                lse_all[start:stop], logps[start:stop] = lse, lp
                if with_entropy:
                    entropy[start:stop] = ent
        ctx.set_materialize_grads(False)  # an unused output (e.g. entropy kept for logging) costs nothing
        ctx.save_for_backward(hidden, weight, bias, targets, lse_all, entropy)
        ctx.params = (multiplier, softcap, temperature, chunk_size, with_entropy, kernel)
        if with_entropy:
            return logps, entropy
        return logps, torch.empty(0, dtype=out_dtype, device=hidden.device)

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, targets, lse_all, entropy = ctx.saved_tensors
        multiplier, softcap, temperature, chunk_size, with_entropy, kernel = ctx.params
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32 if weight.dtype != torch.float64 else weight.dtype,
                             device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=grad_w.dtype if grad_w is not None else torch.float32,
                             device=bias.device) if need_b else None
        use_entropy_grad = with_entropy and grad_entropy is not None and grad_entropy.numel() > 0
        if grad_logps is None:
            grad_logps = torch.zeros_like(lse_all)
        if kernel:  # per-row scalars the kernel reads at unit stride (autograd may hand in expanded gradients)
            grad_logps = grad_logps.to(torch.float32).contiguous()
            if use_entropy_grad:
                grad_entropy = grad_entropy.to(torch.float32).contiguous()
        # dL/d raw logits [n, V] in h's dtype (the product's own outside autocast); the logits handed over as above
        logit_grad = row_grad_ if kernel else functools.partial(row_grad_reference, softcap=softcap,
                                                                out_dtype=hidden.dtype)
        n = hidden.shape[0]
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            h = hidden[start:stop]
            dz = logit_grad(torch.nn.functional.linear(h, weight, bias), targets[start:stop], lse_all[start:stop],
                            grad_logps[start:stop], grad_entropy[start:stop] if use_entropy_grad else None,
                            entropy[start:stop] if use_entropy_grad else None, multiplier, temperature).to(h.dtype)
            if need_h:
                grad_h[start:stop] = dz @ weight
            if need_w:
                grad_w += (dz.t() @ h).to(grad_w.dtype)
            if need_b:
                grad_b += dz.sum(0).to(grad_b.dtype)
            del dz
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                     bias: torch.Tensor | None = None, temperature: float = 1.0, softcap: float | None = None,
                     multiplier: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                     kernel: bool | None = None):
    """Log-probs (and optionally entropies) of ``targets`` under ``softcap(m·(hidden Wᵀ + b)) / T``.

    hidden [N, H], weight [V, H], targets [N] (int64) → logps [N] float32 (float64 for float64 input),
    entropy [N] or None. Peak extra memory is one [chunk_size, V] block of logits. ``kernel``: the Triton row
    kernels (ops/logprob_kernel.py) for the softmax statistics and gradients; None: on a GPU with Triton, without a
    softcap, for inputs other than float64.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if softcap is not None and softcap <= 0:
        softcap = None
    if kernel is None:
        kernel = _triton is not None and hidden.is_cuda and softcap is None and hidden.dtype != torch.float64
    elif kernel and (_triton is None or softcap is not None or hidden.dtype == torch.float64):
        raise ValueError("the log-prob kernel needs Triton, no softcap and a dtype other than float64")
    logps, entropy = ChunkedLogProbs.apply(hidden, weight, bias, targets.long(), float(multiplier), softcap,
                                           float(temperature), int(chunk_size), bool(with_entropy), bool(kernel))
    return logps, (entropy if with_entropy else None)


def reference_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, softcap=None, multiplier=1.0,
                       with_entropy=False):
    """Plain full-logits twin of :func:`chunked_logprobs` (materialises [N, V]); for tests."""
    z = torch.nn.functional.linear(hidden, weight, bias) * multiplier
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logps = logp_all.gather(1, targets[:, None].long()).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logps, entropy
