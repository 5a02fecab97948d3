"""Exact acceptance of drafted tokens: the emitted tokens have plain sampling's distribution.

A verify forward over context ++ d_1..d_k gives logits at k + 1 positions; p_i is the sampler's processed
distribution at position i (repetition penalty, temperature, top-k, top-p, min-p: rollout/sampling.py's
:func:`sampling_distribution`). The draft is deterministic (q_i = one-hot at d_i), so speculative sampling's rule
min(1, p/q) becomes: accept d_i with probability p_i(d_i), i = 1, 2, ... while accepted; at the first rejection
emit a token from p_i with d_i removed and renormalised, p_i(v)·[v ≠ d_i] / (1 − p_i(d_i)); after k acceptances
emit one more from p_{k+1}. Each emitted token then has law p_i given the tokens before it: P(emit d_i) = p_i(d_i),
P(emit v ≠ d_i) = (1 − p_i(d_i)) · p_i(v) / (1 − p_i(d_i)) = p_i(v). Greedy (temperature 0): p_i is one-hot at the
argmax, so d_i is accepted iff it is the argmax and the emitted tokens are plain greedy decoding's.

Random numbers are counter-based as the sampler's (sampling.py :func:`uniform_for`): the acceptance test at
position t uses u(seed ⊕ ACCEPT_SALT, sequence, t), the draw at the step's last emitted position t uses
u(seed ⊕ DRAW_SALT, sequence, t); each is used at most once (a verify step after a rejection at position t starts at
t + 1).

Two log-probs are returned per emitted token: ``logprobs``, the sampler's convention (log softmax(z / T) at the
token, no penalty or filtering, T = 1 for greedy: sampling.py :func:`token_logprobs`), and ``processed_logprobs``,
log p_i at the token under the processed distribution it was drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import (SamplingParams, apply_repetition_penalty, inverse_cdf, logprob_temperature,
                       sampling_distribution, token_logprobs, uniform_for)

ACCEPT_SALT = 0x5EC0A11  # keys the acceptance tests' uniforms apart from the draws'
DRAW_SALT = 0x5EC0D2A


@dataclass
class SpeculativeResult:
    """Per row b: ``accepted[b]`` drafts accepted, then ``tokens[b, :accepted[b] + 1]`` emitted (the drafts kept and
    one sampled token; −1 after). Log-probs as tokens (0 after): see the module docstring."""

    accepted: torch.Tensor  # [B] long
    tokens: torch.Tensor  # [B, k + 1] long
    logprobs: torch.Tensor  # [B, k + 1] float32
    processed_logprobs: torch.Tensor  # [B, k + 1] float32


def seen_with_drafts(seen: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The repetition penalty's token sets at the k + 1 verify positions: position i has seen the context's tokens
    (seen [B, V] bool) and d_1..d_i (drafts [B, k]). [B, k + 1, V]."""
    k = drafts.shape[1]
    out = seen[:, None, :].repeat(1, k + 1, 1)
    for i in range(k):  # (a scatter, not one_hot, whose range check reads the device from the host)
        out[:, i + 1:, :] |= torch.zeros_like(seen).scatter_(1, drafts[:, i:i + 1], True)[:, None]
    return out


def processed_logprobs(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """log p [B, n, V] of the distribution the sampler draws from at each of n positions (logits [B, n, V]; seen
    [B, n, V] bool or None). Greedy: 0 at the (penalised) argmax, −inf elsewhere."""
    B, n, V = logits.shape
    flat_seen = None if seen is None else seen.reshape(B * n, V)
    z = logits.float().reshape(B * n, V)
    if params.greedy:
        penalised = apply_repetition_penalty(z, flat_seen, params.repetition_penalty) if flat_seen is not None else z
        top = penalised.argmax(-1, keepdim=True)
        out = torch.full_like(z, float("-inf")).scatter(-1, top, 0.0)
    else:
        out = sampling_distribution(z, params, flat_seen)
    return out.reshape(B, n, V)


def accept_drafts(logp: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor, u_draw: torch.Tensor,
                  lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule on processed log-probs logp [B, k + 1, V] and drafts [B, k] long, with uniforms u_accept [B, k] and
    u_draw [B, k + 1] in [0, 1): accepted count n [B] (d_i kept while u_accept_i < p_i(d_i)) and the token [B] drawn
    at 0-based position n, with u_draw[:, n], from p_n without d_n (n < k_b) or from p_n (n = k_b). Row b has
    k_b = lengths[b] drafts (None: all k), the rest of its row padding. No host sync."""
    B, k1, V = logp.shape
    k = k1 - 1
    k_b = torch.full((B,), k, dtype=torch.long, device=logp.device) if lengths is None else lengths
    p_draft = logp[:, :k, :].gather(-1, drafts[:, :, None])[:, :, 0].exp().double()  # [B, k]
    ok = (u_accept.double() < p_draft) & (torch.arange(k, device=logp.device)[None] < k_b[:, None])  # [B, k]
    n = torch.cumprod(ok.long(), dim=1).sum(1)  # [B]: leading acceptances
    rows = torch.arange(B, device=logp.device)
    probs = logp[rows, n].exp()  # [B, V]: p at the position after the kept drafts
    rejected = n < k_b
    mask = torch.zeros_like(probs, dtype=torch.bool)
    if k > 0:
        mask[rows, drafts.gather(1, n.clamp(max=k - 1)[:, None])[:, 0]] = rejected  # d_n removed where rejected
    u = u_draw.double().gather(1, n[:, None])[:, 0]  # [B]
    token = inverse_cdf(probs.masked_fill(mask, 0.0), u)  # unnormalised: inverse_cdf scales u by the total
    return n, token


def speculative_step(logits: torch.Tensor, drafts: torch.Tensor, params: SamplingParams, sequence: torch.Tensor,
                     position: torch.Tensor, seen: torch.Tensor | None = None,
                     lengths: torch.Tensor | None = None) -> SpeculativeResult:
    """One verify step: logits [B, k + 1, V] of the forward over context ++ drafts (drafts [B, k] long), sequence
    ids [B] and the position [B] of d_1 keying the uniforms; seen [B, V] bool: the context's tokens, for the
    repetition penalty (None: no penalty); lengths [B]: the drafts of each row (None: k; a row's drafts past its
    length are padding, never accepted: it emits at most lengths[b] + 1 tokens)."""
    B, k1, V = logits.shape
    k = k1 - 1
    seen_k = None if seen is None or params.repetition_penalty == 1.0 else seen_with_drafts(seen, drafts)
    logp = processed_logprobs(logits, params, seen_k)  # [B, k + 1, V]
    seqs = sequence[:, None].expand(B, k1).reshape(-1)
    positions = (position[:, None] + torch.arange(k1, device=logits.device)).reshape(-1)  # [B·(k + 1)]
    u_accept = uniform_for(params.seed ^ ACCEPT_SALT, seqs, positions).reshape(B, k1)[:, :k]
    u_draw = uniform_for(params.seed ^ DRAW_SALT, seqs, positions).reshape(B, k1)
    n, token = accept_drafts(logp, drafts, u_accept, u_draw, lengths)
    slots = torch.arange(k1, device=logits.device)[None, :]  # [1, k + 1]
    tokens = torch.cat([drafts, drafts.new_zeros(B, 1)], dim=1)
    tokens = tokens.scatter(1, n[:, None], token[:, None])
    tokens = torch.where(slots <= n[:, None], tokens, -1)  # [B, k + 1]
    safe = tokens.clamp(min=0)
    T = logprob_temperature(params.temperature)
    z = logits.float() if T == 1.0 else logits.float() / T
    lp = token_logprobs(z.reshape(B * k1, V), safe.reshape(-1)).reshape(B, k1)
    plp = logp.gather(-1, safe[:, :, None])[:, :, 0]
    keep = slots <= n[:, None]
    return SpeculativeResult(n, tokens, torch.where(keep, lp, 0.0), torch.where(keep, plp, 0.0))


__all__ = ["SpeculativeResult", "accept_drafts", "processed_logprobs", "seen_with_drafts", "speculative_step"]
