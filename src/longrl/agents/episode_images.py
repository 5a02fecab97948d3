"""Episodes whose dataset row holds images (a vision-language model's multi-turn run).

The row's prompt, as chat messages holding its ``{"type": "image"}`` parts (the dataset's reading of it), is what the
environment's reset sees and what an episode opens with when the reset gives no prompt of its own. Each image part
of the opening, as the reset left it, takes the row's next image; an opening whose image parts do not match the
row's images is an unusable reset (the row is skipped, the reason named). Openings are encoded with the processor,
tools rendered, once per distinct opening of a row: the G episodes of a row that open alike share one
:class:`~longrl.models.vision.VisionPrompt`, so the vision tower runs once for the group. Environment messages after
the opening are text.
"""

from __future__ import annotations

import json

from ..models.vision.prompt import VisionPrompt, count_image_parts


class EpisodeImages:
    """``encoder``: the model's prompt encoder (training.vision_inputs.PromptImages); ``sources``: each row's
    (messages with image parts, opened images), or None for a row without images."""

    def __init__(self, encoder, sources: list[tuple[list[dict], list] | None]):
        self.encoder, self.sources = encoder, sources
        self._encoded: dict[tuple[int, str], VisionPrompt] = {}

    def rows_for_reset(self, rows: list[dict], prompt_column: str) -> list[dict]:
        """``rows`` with each image row's prompt column replaced by its messages with image parts."""
        return [row if src is None else {**row, prompt_column: src[0]} for row, src in zip(rows, self.sources)]

    def unusable(self, row: int, opening) -> str | None:
        """Why ``opening`` (a string or messages) cannot open an episode of ``row`` (None: it can)."""
        parts = count_image_parts(opening)
        images = len(self.sources[row][1]) if self.sources[row] is not None else 0
        if parts and parts != images:
            return (f"opened the episode with {parts} image part(s) in its messages, but the row holds {images} "
                    "image(s)")
        return None

    def prompt(self, row: int, opening, tools: list | None) -> VisionPrompt | None:
        """The VisionPrompt of ``opening`` with the row's images (None: an opening without image parts)."""
        if not count_image_parts(opening):
            return None
        key = (row, json.dumps(opening, sort_keys=True, default=str))
        if key not in self._encoded:
            self._encoded[key] = self.encoder.encode(opening, self.sources[row][1], tools)
        return self._encoded[key]


__all__ = ["EpisodeImages"]
