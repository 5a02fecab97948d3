"""Qwen-VL's 3-D rotary positions (mRoPE) of a prompt holding images, computed from its token ids and image grids.

Sections (temporal, height, width). Text runs sequentially, the same position in all three sections. An image of
grid t×h×w after the spatial merge (patches t, H, W; h = H / merge, w = W / merge) starting where the next text
position would be, s, gives its token k = (a, b, c) (row-major over t, h, w) the positions (s + a, s + b, s + c);
the text after it starts at s + max(t, h, w). With L tokens whose largest position is m, the prompt's
``rope_delta`` = m + 1 − L: a token at index i ≥ L (a completion's) has position i + rope_delta in every section,
i.e. ordinary 1-D RoPE at that position.
"""

from __future__ import annotations

import torch


def mrope_positions(input_ids: list[int], image_token: int, grids_thw: torch.Tensor, merge: int
                    ) -> tuple[torch.Tensor, int]:
    """(positions [3, L] long, rope_delta) of one prompt. ``grids_thw`` [n_images, 3]: each image's patch grid in
    order (the processor's ``image_grid_thw``); the placeholders of image k are the next t·h·w ``image_token`` ids.
    Raises ValueError when the placeholder count differs from the grids'."""
    sizes = [(int(t), int(h) // merge, int(w) // merge) for t, h, w in grids_thw.tolist()]
    if sum(t * h * w for t, h, w in sizes) != sum(1 for tok in input_ids if tok == image_token):
        raise ValueError(f"the prompt has {sum(1 for tok in input_ids if tok == image_token)} image placeholder "
                         f"tokens but its {len(sizes)} image grid(s) need {sum(t * h * w for t, h, w in sizes)}")
    out = torch.empty(3, len(input_ids), dtype=torch.long)
    i, next_pos, image = 0, 0, 0
    while i < len(input_ids):
        if input_ids[i] != image_token:
            out[:, i] = next_pos
            i, next_pos = i + 1, next_pos + 1
            continue
        t, h, w = sizes[image]
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        out[:, i:i + t * h * w] = grid.reshape(3, -1) + next_pos  # [3, t·h·w]
        i, next_pos, image = i + t * h * w, next_pos + max(t, h, w), image + 1
    return out, int(out.max()) + 1 - len(input_ids)


def continued_positions(positions: torch.Tensor, rope_delta: int, length: int) -> torch.Tensor:
    """[3, length]: ``positions`` [3, L] followed by text tokens at index i ≥ L at i + rope_delta in every section."""
    tail = torch.arange(positions.shape[1], length, device=positions.device) + rope_delta
    return torch.cat([positions, tail[None].expand(3, -1)], dim=1)
