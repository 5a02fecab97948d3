"""Per-token log-probs of completions under the policy (or the reference: the same weights, adapters off).

Sequences are prompt + completion, packed or right-padded, or grouped rows (each prompt once, then its
completions: models/shared_prompt.py). The backbone gives final hidden states [b, L, H]; only the rows that
predict completion tokens go through the chunked LM-head log-prob op, so no [b, L, V] logits tensor ever exists.
"""

from __future__ import annotations

import contextlib

import torch

from . import model_parts
from ..ops.logprobs import chunked_logprobs
from .shared_prompt import (GroupedRows, enable_shared_prompt, grouped_rows, kernel_inputs, mask_inputs,
                            unsupported_reason)
from .structure import base_model
from .vision import (FeatureCache, Placement, SequenceImages, language_model_inputs, layer_masks, placements_of,
                     require_vision)


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
    input up-casting is skipped under it for such models, see ``models.set_lora_input_casting``), so that no
    float32 copy of an activation is made. Every forward of the model runs under it, recomputes too
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


def backbone_hidden(model, seqs: list[list[int]], pad_id: int, packed: bool = True, vision=None):
    """(hidden [rows, H], starts): the backbone's final hidden states of ``seqs``, flattened, and the row at which
    each sequence begins (its token t is row starts[i] + t).

    ``packed``: all sequences in one row with restarting positions (no padding), or stacked rows when all
    lengths are equal; else right-padded rows with an attention mask (the reference layout). ``vision``: per
    sequence its prompt's :class:`~longrl.models.vision.VisionPrompt` or None (see :func:`_with_images`).
    """
    backbone, head, _ = model_parts(model)
    device = head.weight.device
    if packed and len({len(s) for s in seqs}) == 1 and len(seqs) > 1:
        # equal lengths: stack them without padding or a mask (plain causal attention, the fused kernels' fast path)
        packed = False
        inputs = dict(input_ids=torch.tensor(seqs, dtype=torch.long, device=device), attention_mask=None)
    elif packed:
        inputs = _packed_inputs(seqs, device)
    else:
        inputs = _padded_inputs(seqs, pad_id, device)
    if packed:
        starts = [0]
        for s in seqs[:-1]:
            starts.append(starts[-1] + len(s))
    else:
        starts = [i * inputs["input_ids"].shape[1] for i in range(len(seqs))]
    with compute_context(model):
        if _has_images(vision):
            inputs = _with_images(model, inputs, seqs, starts, vision)
        hidden = backbone(**inputs, use_cache=False).last_hidden_state  # [1, Σ len, H] or [b, L, H]
    return hidden.reshape(-1, hidden.shape[-1]), starts


def _has_images(vision) -> bool:
    return vision is not None and any(v is not None for v in vision)


def _has_completion_images(vision) -> bool:
    return vision is not None and any(isinstance(v, SequenceImages) and v.blocks for v in vision)


def _vision_family(model, seqs: list[list[int]], vision: list):
    """The model's vision family, after checking that sequence i begins with vision[i]'s tokens (where not None)
    and, for a :class:`SequenceImages` entry, holds each block's tokens where the block says."""
    if len(vision) != len(seqs):
        raise ValueError(f"vision has {len(vision)} entries for {len(seqs)} sequences (one VisionPrompt or None each)")
    family = require_vision(base_model(model).config, "sequences with images")
    for i, (seq, entry) in enumerate(zip(seqs, vision)):
        prompt, blocks = (entry.prompt, entry.blocks) if isinstance(entry, SequenceImages) else (entry, ())
        if prompt is not None and seq[:len(prompt)] != prompt.input_ids:
            raise ValueError(f"sequence {i} does not begin with its VisionPrompt's input_ids (the prompt's tokens with "
                             "the image placeholders expanded)")
        for at, block in blocks:
            if seq[at:at + len(block)] != block.input_ids:
                raise ValueError(f"sequence {i} does not hold its image block's tokens at index {at}")
    return family


def _with_images(model, inputs: dict, seqs: list[list[int]], starts: list[int], vision: list) -> dict:
    """``inputs`` with the token ids replaced by embeddings holding each prompt's image features, and positions
    for them (mRoPE: the prompt's 3-D positions, then its completion at index + rope_delta in every section).
    Each distinct prompt object's features are computed once for the call (models/vision/features.py). A family
    whose image tokens attend both ways (Gemma 3) gets the rows' masks per layer type (models/vision/masks.py)."""
    family = _vision_family(model, seqs, vision)
    ids = inputs["input_ids"]  # [rows, L]
    width = ids.shape[1]
    placements = [p for start, seq, entry in zip(starts, seqs, vision)
                  for p in placements_of(start // width, start % width, len(seq), entry)]
    text_positions = inputs.get("position_ids")
    if text_positions is None:
        text_positions = torch.arange(width, device=ids.device)[None].expand(ids.shape[0], -1)
    built = language_model_inputs(model, ids, text_positions, placements, FeatureCache(model, family))
    if family.image_blocks:
        decoder = model_parts(model)[0]
        built["attention_mask"] = layer_masks(decoder.config, placements, ids.shape[0], width, ids.device,
                                              decoder.config._attn_implementation, built["inputs_embeds"].dtype)
    return {**{k: v for k, v in inputs.items() if k not in ("input_ids", "position_ids")}, **built}


def grouped_backbone_hidden(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
                            packed: bool = True, attention: str = "kernel", vision=None):
    """(hidden [rows, H], predictors): the backbone's final hidden states of the sequences laid out as grouped rows
    (models/shared_prompt.py: each prompt once, then its completions), flattened, and for each sequence the rows
    whose hidden states predict its completion tokens (row predictors[i][j] predicts completion_ids[i][j]).

    ``attention``: "kernel", the flash parts merged by log-sum-exp (ops/shared_prompt_attention.py), or "mask", the
    plain twin: the layout's [rows, L, L] mask through the model's own attention. ``vision``: per sequence its
    prompt's VisionPrompt or None; sequences are grouped by their prompt's tokens and VisionPrompt object, and
    each group's image features go into its prompt part (:func:`_grouped_with_images`)."""
    backbone, head, _ = model_parts(model)
    device = head.weight.device
    family = _vision_family(model, prompt_ids, vision) if _has_images(vision) else None
    if family is not None and family.image_blocks:
        raise ValueError(f"grouped rows (train.shared_prompt): {unsupported_reason(base_model(model).config)}")
    rows = grouped_rows(prompt_ids, completion_ids, pad_id, packed, keys=vision if family is not None else None)
    if attention == "kernel":
        enable_shared_prompt(model)  # (once) grouped rows, and the layer recomputes of their backward, attend by it
        inputs = kernel_inputs(rows, device)
    elif attention == "mask":
        inputs = mask_inputs(model, rows, device)
    else:
        raise ValueError(f"grouped-row attention is 'kernel' or 'mask', not {attention!r}")
    with compute_context(model):
        if family is not None:
            inputs = _grouped_with_images(model, inputs, rows, [vision[i] for i in rows.firsts], family)
        hidden = backbone(**inputs, use_cache=False).last_hidden_state  # [rows, L, H]
    return hidden.reshape(-1, hidden.shape[-1]), rows.predictors


def _grouped_with_images(model, inputs: dict, rows: GroupedRows, prompts: list, family) -> dict:
    """``inputs`` of grouped rows (``prompts``: each group's VisionPrompt or None) with the token ids replaced by
    embeddings holding each group's image features at its prompt part's placeholders (once a group; the features
    once per prompt object for the call), and positions: 1-D, the layout's; mRoPE [3, rows, L], the prompt part's
    3-D positions and completion token j at P + j + rope_delta in every section, where it sits in its own
    sequence. Qwen3-VL's deepstack features go to the same placeholders."""
    layout = rows.layout
    text = inputs["position_ids"]  # [rows, L]: 0 … P−1, then P … P+R_g−1 for each completion g
    placements = [Placement(g.row, g.start, g.prompt, p) for g, p in zip(layout.groups, prompts)]
    positions = text
    if family.mrope:
        positions = text[None].repeat(3, 1, 1)  # [3, rows, L]; text-only groups and padding as 1-D
        for g, p in zip(layout.groups, prompts):
            if p is not None:
                positions[:, g.row, g.start:g.start + g.prompt] = p.positions(g.prompt).to(text.device)
                positions[:, g.row, g.start + g.prompt:g.end] += p.rope_delta
    built = language_model_inputs(model, inputs["input_ids"], text, placements, FeatureCache(model, family),
                                  positions=positions)
    return {**{k: v for k, v in inputs.items() if k not in ("input_ids", "position_ids")}, **built}


def sequence_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], width: int, *,
                      pad_id: int, temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                      packed: bool = True, shared_prompt: bool | str = False, vision=None):
    """(logps [b, width], entropy [b, width] or None), zero beyond each completion's length.

    ``packed``: the layout of :func:`backbone_hidden`. ``shared_prompt``: sequences with equal prompts run as
    grouped rows, each prompt computed once (:func:`grouped_backbone_hidden`; True is its "kernel" attention,
    "mask" its plain twin; with images too: each group's features in its prompt part); the same numbers as the
    repeated layout up to rounding; sequences with images inside their completions (SequenceImages) take the
    repeated layout). ``vision``: per sequence its prompt's VisionPrompt (prompt_ids[i] begins with its
    input_ids) or None; the sequences of one prompt share the object, whose image features are computed once
    for the call. Differentiable with respect to the model's
    trainable parameters when grad is enabled (with LoRA on the vision tower, its gradient summed over a prompt's
    sequences).
    """
    _, head, spec = model_parts(model)
    device = head.weight.device
    if shared_prompt and not _has_completion_images(vision):  # (images inside completions: the repeated layout)
        attention = "kernel" if shared_prompt is True else shared_prompt
        hidden, predictors = grouped_backbone_hidden(model, prompt_ids, completion_ids, pad_id, packed, attention,
                                                     vision)
    else:
        hidden, starts = backbone_hidden(model, [p + c for p, c in zip(prompt_ids, completion_ids)], pad_id, packed,
                                         vision)
        # the state before each completion token predicts it
        predictors = [range(starts[i] + len(p) - 1, starts[i] + len(p) - 1 + len(c))
                      for i, (p, c) in enumerate(zip(prompt_ids, completion_ids))]
    rows = [r for rs in predictors for r in rs]
    slots = [(i, j) for i, c in enumerate(completion_ids) for j in range(len(c))]
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    h = hidden[rows_t]  # [N, H]
    targets = torch.tensor([t for c in completion_ids for t in c], dtype=torch.long, device=device)  # [N]
    logps_flat, ent_flat = chunked_logprobs(h, head.weight, targets, bias=head.bias, temperature=temperature,
                                            softcap=spec.softcap, multiplier=spec.multiplier, chunk_size=chunk_size,
                                            with_entropy=with_entropy)
    seq_idx = torch.tensor([i for i, _ in slots], dtype=torch.long, device=device)
    tok_idx = torch.tensor([j for _, j in slots], dtype=torch.long, device=device)
    logps = torch.zeros(len(prompt_ids), width, dtype=logps_flat.dtype, device=device).index_put((seq_idx, tok_idx), logps_flat)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(len(prompt_ids), width, dtype=ent_flat.dtype, device=device).index_put((seq_idx, tok_idx), ent_flat)
    return logps, entropy


def token_cross_entropy(model, seqs: list[list[int]], loss_masks: list[list[bool]], *, pad_id: int,
                        label_smoothing: float = 0.0, chunk_size: int = 1024, packed: bool = True,
                        vision=None) -> torch.Tensor:
    """Cross-entropy [N] of each trained token (``loss_masks[i][t]``: token t of sequence i is predicted from the
    tokens before it and counted), in sequence order; only those rows go through the chunked LM head. ``vision``:
    per sequence the VisionPrompt its tokens begin with, or None (as in :func:`sequence_logprobs`)."""
    from ..ops.cross_entropy import chunked_cross_entropy

    _, head, spec = model_parts(model)
    device = head.weight.device
    hidden, starts = backbone_hidden(model, seqs, pad_id, packed, vision)
    rows = [starts[i] + t - 1 for i, m in enumerate(loss_masks) for t in range(1, len(m)) if m[t]]
    targets = [seqs[i][t] for i, m in enumerate(loss_masks) for t in range(1, len(m)) if m[t]]
    h = hidden[torch.tensor(rows, device=device)]  # [N, H]
    return chunked_cross_entropy(h, head.weight, torch.tensor(targets, dtype=torch.long, device=device),
                                 bias=head.bias, label_smoothing=label_smoothing, multiplier=spec.multiplier,
                                 softcap=spec.softcap, chunk_size=chunk_size)
