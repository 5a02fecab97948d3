"""Per-token log-probs of completions under the policy (or the reference: the same weights, adapters off).

Sequences are prompt + completion, right-padded. The backbone gives final hidden states [b, L, H]; only
the rows that predict completion tokens go through the chunked LM-head log-prob op, so no [b, L, V]
logits tensor ever exists.
"""

from __future__ import annotations

import contextlib

import torch

from .models import model_parts
from .ops.logprobs import chunked_logprobs


def pad_right(seqs: list[list[int]], pad_id: int, width: int | None = None) -> torch.Tensor:
    width = width or max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def completion_mask(completion_ids: list[list[int]], width: int) -> torch.Tensor:
    """[B, width] 1.0 where a completion token exists."""
    lengths = torch.tensor([len(c) for c in completion_ids])
    return (torch.arange(width)[None, :] < lengths[:, None]).to(torch.float32)


def reference_mode(model):
    """Context in which ``model`` is the reference policy: PEFT adapters disabled (no second model)."""
    return model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()


def sequence_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], width: int, *,
                      pad_id: int, temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False):
    """(logps [b, width], entropy [b, width] or None), zero beyond each completion's length.

    Differentiable with respect to the model's trainable parameters when grad is enabled.
    """
    backbone, head, spec = model_parts(model)
    device = head.weight.device
    seqs = [p + c for p, c in zip(prompt_ids, completion_ids)]
    input_ids = pad_right(seqs, pad_id).to(device)  # [b, L]
    lengths = torch.tensor([len(s) for s in seqs])
    attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long().to(device)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state  # [b, L, H]
    rows, cols, slots = [], [], []
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        rows += [i] * len(c)
        cols += range(len(p), len(p) + len(c))
        slots += range(len(c))
    rows_t, cols_t = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
    h = hidden[rows_t, cols_t - 1]  # [N, H]: the state before each completion token predicts it
    targets = input_ids[rows_t, cols_t]  # [N]
    logps_flat, ent_flat = chunked_logprobs(h, head.weight, targets, bias=head.bias, temperature=temperature,
                                            softcap=spec.softcap, multiplier=spec.multiplier, chunk_size=chunk_size,
                                            with_entropy=with_entropy)
    slots_t = torch.tensor(slots, device=device)
    logps = torch.zeros(len(seqs), width, dtype=logps_flat.dtype, device=device)
    logps = logps.index_put((rows_t, slots_t), logps_flat)  # differentiable scatter
    entropy = None
    if with_entropy:
        entropy = torch.zeros(len(seqs), width, dtype=ent_flat.dtype, device=device).index_put((rows_t, slots_t), ent_flat)
    return logps, entropy
