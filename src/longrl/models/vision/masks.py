"""Attention masks for a family whose image tokens attend to each other both ways (Gemma 3), for rows of sequences
laid out as :class:`~longrl.models.vision.inputs.Placement` says.

Gemma 3 attends causally, except that the soft tokens of one image (each contiguous run of placeholder tokens; the
``<start_of_image>``/``<end_of_image>`` markers around it are text) attend to one another bidirectionally. For a
row of L columns, let s(c) be the sequence holding column c (each padding column its own) and b(c) the image block of
column c (−1 for text and padding). Then, query q and key k of one row:

    M[q, k]   = s(q) = s(k) ∧ (k ≤ q ∨ b(q) = b(k) ≥ 0)        full-attention layers
    M_W[q, k] = M[q, k] ∧ k > q − W                            sliding-window layers (window W)

which is transformers' ``create_masks_for_vision_model`` (full: causal OR block; sliding: window AND (causal OR
block)) for one sequence, and keeps sequences packed in one row apart. A padding column attends to itself only, so
no query row is empty (an all-masked SDPA row is NaN, and a NaN reaches the weight gradients through the products
that read it, even where its own gradient is zero).

Cost: the masks are materialised, [rows, 1, L, L] per layer type: L² bytes a row each as booleans (SDPA), L² times
the compute dtype's size as an additive mask (eager attention). transformers' own forward with ``token_type_ids``
builds the same.
"""

from __future__ import annotations

import torch

LAYER_TYPES = ("full_attention", "sliding_attention")


def column_ids(placements, rows: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence [rows, L] long, block [rows, L] long) of every column: the index of its sequence's placement (a
    padding column: −1 − its column, distinct from every other), and its image block (−1: text or padding; blocks
    numbered from 0 across the call, one per contiguous run of a prompt's or an image block's placeholder
    positions)."""
    sequence = (-1 - torch.arange(width)).repeat(rows, 1)  # [rows, L]
    block = torch.full((rows, width), -1, dtype=torch.long)  # [rows, L]
    blocks = 0
    for i, p in enumerate(placements):
        if not p.block:  # (an image block inside a sequence: its columns are the sequence's)
            sequence[p.row, p.start:p.start + p.length] = i
        if p.prompt is not None:
            at = p.prompt.image_positions.cpu()  # [N] ascending
            starts = torch.ones_like(at, dtype=torch.bool)  # [N] whether a placeholder begins a run
            starts[1:] = at[1:] != at[:-1] + 1
            run = torch.cumsum(starts.long(), 0) - 1  # [N] the run of each placeholder
            block[p.row, p.start + at] = run + blocks
            blocks += int(run[-1]) + 1
    return sequence.to(device), block.to(device)


def image_block_mask(placements, rows: int, width: int, device) -> torch.Tensor:
    """M of the module docstring: [rows, 1, L, L] bool, True where query q may attend to key k."""
    sequence, block = column_ids(placements, rows, width, device)
    col = torch.arange(width, device=device)
    causal = col[None, :] <= col[:, None]  # [L, L]: k ≤ q
    same_block = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0)  # [rows, L, L]
    same_sequence = sequence[:, :, None] == sequence[:, None, :]  # [rows, L, L]
    return (same_sequence & (causal | same_block))[:, None]


def layer_masks(text_config, placements, rows: int, width: int, device, attn_implementation: str,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The language model's ``attention_mask`` argument: {layer type: 4-D mask} (transformers uses a dict of masks
    as it is), M for full-attention layers and M_W for sliding-window ones, booleans for an attention implementation
    with SDPA's mask builder, additive masks in ``dtype`` for eager attention. Other implementations take no 4-D
    mask: refused."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    builder = ALL_MASK_ATTENTION_FUNCTIONS.get(attn_implementation)
    if builder not in (sdpa_mask, eager_mask):
        raise ValueError(f"image tokens that attend both ways need a 4-D attention mask, which attention "
                         f"implementation {attn_implementation!r} does not take; load the model with sdpa or eager")
    kinds = set(text_config.layer_types)
    if not kinds <= set(LAYER_TYPES):
        raise ValueError(f"layer types {sorted(kinds - set(LAYER_TYPES))}: image-block masks are built for "
                         f"{', '.join(LAYER_TYPES)}")
    full = image_block_mask(placements, rows, width, device)  # [rows, 1, L, L]
    masks = {"full_attention": full}
    if "sliding_attention" in kinds:
        col = torch.arange(width, device=device)
        masks["sliding_attention"] = full & (col[None, :] > col[:, None] - text_config.sliding_window)
    if builder is eager_mask:
        masks = {k: torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(~m, torch.finfo(dtype).min)
                 for k, m in masks.items()}
    return masks
