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


def pad_right(seqs: list[list], pad_id, width: int | None = None, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Rows [len(seqs), width] of ``seqs`` followed by ``pad_id``."""
    width = width or max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad_id, dtype=dtype)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = torch.tensor(s, dtype=dtype)
    return out


def completion_mask(completion_ids: list[list[int]], width: int) -> torch.Tensor:
    """[B, width] 1.0 where a completion token exists."""
    lengths = torch.tensor([len(c) for c in completion_ids])
    return (torch.arange(width)[None, :] < lengths[:, None]).to(torch.float32)


def compute_context(model):
    """Mixed precision for 16-bit base weights with float32 LoRA weights: autocast to the base dtype (PEFT's
    input up-casting is off for such models, see ``models.set_lora_input_casting``), so that no float32 copy of
    an activation is made and saved for backward. Every forward of the model runs under it, recomputes too
    (checkpointing restores the autocast state)."""
    head = model_parts(model)[1].weight
    if head.dtype not in (torch.bfloat16, torch.float16):
        return contextlib.nullcontext()
    return torch.autocast(head.device.type, dtype=head.dtype)


def reference_mode(model):
    """Context in which ``model`` is the reference policy: PEFT adapters disabled (no second model)."""
    return model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()


def _packed_inputs(seqs: list[list[int]], device):
    """One row holding every sequence back to back, with positions restarting at each: [1, Σ len].

    With ``attention_mask=None``, transformers reads sequence boundaries from the position ids and attends
    within each sequence only (no padding, no cross-sequence attention).
    """
    input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)[None]
    position_ids = torch.cat([torch.arange(len(s)) for s in seqs]).to(device)[None]
    return dict(input_ids=input_ids, position_ids=position_ids, attention_mask=None)


def _padded_inputs(seqs: list[list[int]], pad_id: int, device):
    """Right-padded rows [b, max len] with an attention mask (the reference layout)."""
    input_ids = pad_right(seqs, pad_id).to(device)
    lengths = torch.tensor([len(s) for s in seqs])
    attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long().to(device)
    return dict(input_ids=input_ids, attention_mask=attention_mask)


def sequence_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], width: int, *,
                      pad_id: int, temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                      packed: bool = True):
    """(logps [b, width], entropy [b, width] or None), zero beyond each completion's length.

    ``packed``: all sequences in one row with restarting positions (no padding), or stacked rows when all
    lengths are equal; else right-padded rows with an attention mask (the reference layout).
    Differentiable with respect to the model's trainable parameters when grad is enabled.
    """
    backbone, head, spec = model_parts(model)
    device = head.weight.device
    seqs = [p + c for p, c in zip(prompt_ids, completion_ids)]
    if packed and len({len(s) for s in seqs}) == 1 and len(seqs) > 1:
        # equal lengths: stack them without padding or a mask (plain causal attention, the fused kernels' fast path)
        packed = False
        inputs = dict(input_ids=torch.tensor(seqs, dtype=torch.long, device=device), attention_mask=None)
    elif packed:
        inputs = _packed_inputs(seqs, device)
    else:
        inputs = _padded_inputs(seqs, pad_id, device)
    with compute_context(model):
        hidden = backbone(**inputs, use_cache=False).last_hidden_state  # [1, Σ len, H] or [b, L, H]
    hidden = hidden.reshape(-1, hidden.shape[-1])  # [rows, H]
    row_stride = 0 if packed else inputs["input_ids"].shape[1]
    rows, slots, offset = [], [], 0
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        start = offset + len(p) - 1 if packed else i * row_stride + len(p) - 1
        rows += range(start, start + len(c))  # the state before each completion token predicts it
        slots += [(i, j) for j in range(len(c))]
        offset += len(p) + len(c)
    rows_t = torch.tensor(rows, device=device)
    h = hidden[rows_t]  # [N, H]
    targets = torch.tensor([t for c in completion_ids for t in c], dtype=torch.long, device=device)  # [N]
    logps_flat, ent_flat = chunked_logprobs(h, head.weight, targets, bias=head.bias, temperature=temperature,
                                            softcap=spec.softcap, multiplier=spec.multiplier, chunk_size=chunk_size,
                                            with_entropy=with_entropy)
    seq_idx = torch.tensor([i for i, _ in slots], device=device)
    tok_idx = torch.tensor([j for _, j in slots], device=device)
    logps = torch.zeros(len(seqs), width, dtype=logps_flat.dtype, device=device).index_put((seq_idx, tok_idx), logps_flat)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(len(seqs), width, dtype=ent_flat.dtype, device=device).index_put((seq_idx, tok_idx), ent_flat)
    return logps, entropy
