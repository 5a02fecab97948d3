"""A prompt with images, encoded once: its token ids (image placeholders expanded by the processor), the
processor's image tensors, where the placeholders are, and its positions (1-D, or mRoPE with its rope delta).

Every sequence of one prompt (its G completions, the rollout's and the training passes') holds the same
:class:`VisionPrompt` object: the image features are computed once per object (models/vision/features.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .families import VisionFamily, image_token_id, require_vision
from .mrope import continued_positions, mrope_positions


@dataclass(eq=False)  # compared by identity: the sequences of one prompt share the object
class VisionPrompt:
    input_ids: list[int]  # [L] the prompt's tokens, each image's placeholder repeated once per image feature
    image_inputs: dict[str, torch.Tensor]  # the processor's image tensors for this prompt (pixel_values, ...)
    family: VisionFamily
    image_positions: torch.Tensor  # [N] long: indices of the placeholder tokens in input_ids, ascending
    mrope: torch.Tensor | None = None  # [3, L] long: mRoPE positions (None: 1-D positions 0 … L−1)
    rope_delta: int = 0  # mRoPE: a token at index i ≥ L has position i + rope_delta in every section
    cached: tuple | None = field(default=None, repr=False)  # (tower key, features) kept while the tower is frozen

    def __len__(self) -> int:
        return len(self.input_ids)

    def positions(self, length: int) -> torch.Tensor:
        """Positions of the prompt followed by ``length`` − L text tokens: [3, length] (mRoPE) or [length]."""
        if self.mrope is None:
            return torch.arange(length)
        return continued_positions(self.mrope, self.rope_delta, length)

    def positions_after(self, before: torch.Tensor) -> torch.Tensor:
        """[3, L] mRoPE positions, on ``before``'s device, of this block placed inside a sequence after a token at
        position ``before`` (a 0-d tensor; mRoPE positions are relative to where they start: the block's own, moved
        to follow it)."""
        return self.mrope.to(before.device) + (before + 1)


@dataclass(eq=False)
class SequenceImages:
    """A trajectory's images: its prompt's (None: a text prompt) and the blocks an environment's messages put
    after it (a tool that answers with an image). Each block is a :class:`VisionPrompt` of the environment's
    tokens (their placeholders expanded), with the index in the sequence (prompt + completion) where its tokens
    start; its image features sit at that index + its ``image_positions``."""

    prompt: VisionPrompt | None
    blocks: tuple[tuple[int, VisionPrompt], ...]  # (index in the sequence, block), ascending

    @property
    def mrope(self) -> bool:
        return any(block.mrope is not None for _, block in self.blocks)

    def positions(self, length: int) -> torch.Tensor:
        """[3, length] mRoPE positions of the sequence (prompt, then its completion with the blocks). mRoPE
        positions are relative to where they start: a block at index a after text at position p has its tokens at
        p + 1 + the block's own positions, and every token after it moves by the block's rope delta."""
        pos = (self.prompt.positions(length) if self.prompt is not None
               else torch.arange(length)[None].repeat(3, 1)).clone()
        for at, block in self.blocks:
            n = len(block)
            pos[:, at:at + n] = block.positions_after(pos[0, at - 1])  # (the token before a block is text)
            pos[:, at + n:] += block.rope_delta
        return pos


def build_prompt(config, input_ids: list[int], image_inputs: dict[str, torch.Tensor]) -> VisionPrompt:
    """A :class:`VisionPrompt` from a processor's output for one prompt (``input_ids`` a list, the image tensors
    as returned). Raises ValueError when the placeholders do not match the image grids (mRoPE families)."""
    family = require_vision(config)
    token = image_token_id(config)
    ids = [int(t) for t in input_ids]
    where = torch.tensor([i for i, t in enumerate(ids) if t == token], dtype=torch.long)
    if where.numel() == 0:
        raise ValueError(f"the prompt has no image placeholder token (id {token}) but images were given")
    prompt = VisionPrompt(ids, dict(image_inputs), family, where)
    if family.mrope:
        merge = int(config.vision_config.spatial_merge_size)
        prompt.mrope, prompt.rope_delta = mrope_positions(ids, token, image_inputs["image_grid_thw"], merge)
    return prompt


def count_image_parts(messages) -> int:
    """The ``{"type": "image"}`` parts of ``messages`` (0 for a string prompt or contents that are strings)."""
    if not isinstance(messages, list):
        return 0
    return sum(isinstance(p, dict) and p.get("type") == "image"
               for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list) for p in m["content"])


def encode_text(processor, config, text: str, images: list) -> tuple[list[int], dict[str, torch.Tensor]]:
    """(token ids, image tensors) of a rendered chat ``text``: ``processor(text, images)`` repeats each image's
    placeholder once per image feature (the rendered template holds its special tokens already) and makes the
    family's image tensors ({} without images). ``images``: one RGB PIL image per placeholder, in order."""
    family = require_vision(config)
    if not images:
        return list(processor.tokenizer(text, add_special_tokens=False)["input_ids"]), {}
    nested = "pixel_attention_mask" in family.image_inputs  # Idefics3/SmolVLM take one image list per text
    enc = processor(text=[text], images=[list(images)] if nested else list(images), add_special_tokens=False,
                    return_tensors="pt")
    return enc["input_ids"][0].tolist(), {k: enc[k] for k in family.image_inputs if k in enc}


def encode_prompt(processor, config, messages: list[dict], images: list, tools: list | None = None) -> VisionPrompt:
    """Encode one chat prompt with images: ``processor.apply_chat_template(messages, add_generation_prompt=True)``
    renders the text (an image part where each image goes; ``tools``' schemas where the template puts them), then
    :func:`encode_text` expands each image's placeholder and makes the image tensors. ``images``: one RGB PIL image
    per image part, in order."""
    parts = count_image_parts(messages)
    if parts != len(images):
        raise ValueError(f"the messages hold {parts} image part(s) but {len(images)} image(s) were given")
    extra = {"tools": tools} if tools else {}
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    return build_prompt(config, *encode_text(processor, config, text, images))
