"""The language model's inputs for rows holding sequences whose prompts have images: token embeddings with each
prompt's image features scattered at its placeholder positions, position ids (1-D, or mRoPE), and the family's
extra keyword arguments (Qwen3-VL's deepstack features).

A row may hold several sequences back to back (the packed layout) or one sequence then padding. ``Placement``
says where each sequence sits. For mRoPE families the positions are [3, rows, L]; a row holding several sequences
gets [4, rows, L], transformers' packed form: row 0 the sequence-restarting 1-D positions from which it builds the
block-diagonal causal mask, rows 1–3 the mRoPE sections.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..structure import base_model
from .features import FeatureCache
from .prompt import SequenceImages, VisionPrompt


@dataclass(frozen=True)
class Placement:
    row: int  # the row of the batch holding the sequence
    start: int  # its first column
    length: int  # its token count (prompt + completion)
    prompt: VisionPrompt | None  # its prompt's images (None: a text-only sequence)
    positions: torch.Tensor | None = None  # [3, length] mRoPE: the sequence's, where not its prompt's own
    block: bool = False  # an image block inside the sequence (its features only; the sequence's placement says
    #                      the positions)


def placements_of(row: int, start: int, length: int, entry) -> list[Placement]:
    """The placements of one sequence at ``row``, columns ``start`` … ``start + length``: ``entry`` its prompt's
    VisionPrompt (or None), or a :class:`SequenceImages`: the sequence's placement (with its mRoPE positions),
    then one for each image block inside its completion."""
    if not isinstance(entry, SequenceImages):
        return [Placement(row, start, length, entry)]
    whole = Placement(row, start, length, entry.prompt, entry.positions(length) if entry.mrope else None)
    return [whole] + [Placement(row, start + at, len(block), block, block=True) for at, block in entry.blocks]


def language_model_inputs(model, input_ids: torch.Tensor, text_positions: torch.Tensor, placements: list[Placement],
                          features: FeatureCache, positions: torch.Tensor | None = None) -> dict:
    """Keyword arguments for the language model (``inputs_embeds``, ``position_ids``, extras) of ``input_ids``
    [rows, L] whose 1-D positions are ``text_positions`` [rows, L] (each sequence from 0, padding arbitrary).

    embeds[r, s + p] = features of the prompt's k-th placeholder where p is its k-th placeholder index; other
    tokens keep their token embeddings. Each distinct prompt's features come from ``features`` (once per call).
    ``positions``: the position ids as the caller lays them out ([rows, L] or [3, rows, L]; grouped rows, whose
    completions restart after their prompt), else built from ``text_positions`` and the placements."""
    family = features.family
    embeds = base_model(model).get_decoder().get_input_embeddings()(input_ids)  # [rows, L, H]
    device = embeds.device
    placed = sorted((p for p in placements if p.prompt is not None), key=lambda p: (p.row, p.start))
    rows, cols, feats, deep = [], [], [], []
    for p in placed:
        f = features.get(p.prompt)
        at = p.prompt.image_positions.to(device) + p.start
        rows.append(torch.full_like(at, p.row))
        cols.append(at)
        feats.append(f.embeds)
        if f.deepstack is not None:
            deep.append(f.deepstack)
    out = {}
    if placed:
        rows_t, cols_t = torch.cat(rows), torch.cat(cols)  # [N] each, row-major order
        embeds = embeds.index_put((rows_t, cols_t), torch.cat(feats).to(embeds.dtype))
        if family.deepstack:  # per layer, the features of every placeholder in the row-major order of the mask
            mask = torch.zeros(input_ids.shape, dtype=torch.bool, device=device)
            mask[rows_t, cols_t] = True
            out["visual_pos_masks"] = mask
            out["deepstack_visual_embeds"] = [torch.cat([d[k] for d in deep]).to(embeds.dtype)
                                              for k in range(len(deep[0]))]
    out["inputs_embeds"] = embeds
    out["position_ids"] = (_positions(family, text_positions.to(device), placements) if positions is None
                           else positions.to(device))
    return out


def _positions(family, text_positions: torch.Tensor, placements: list[Placement]) -> torch.Tensor:
    """[rows, L] (1-D families), [3, rows, L] (mRoPE), or [4, rows, L] when a row holds several sequences."""
    if not family.mrope:
        return text_positions
    pos = text_positions[None].repeat(3, 1, 1)  # [3, rows, L]: text-only sequences and padding
    sequences = [p for p in placements if not p.block]
    for p in sequences:
        if p.positions is not None or p.prompt is not None:
            own = p.positions if p.positions is not None else p.prompt.positions(p.length)
            pos[:, p.row, p.start:p.start + p.length] = own.to(pos.device)
    per_row = {}
    for p in sequences:
        per_row[p.row] = per_row.get(p.row, 0) + 1
    if max(per_row.values(), default=1) > 1:
        return torch.cat([text_positions[None], pos])  # [4, rows, L]: the packed form
    return pos
