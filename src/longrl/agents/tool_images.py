"""Environment messages holding images, for a vision-language model (a tool or environment that answers with a
picture: a screenshot, a chart, a crop).

An image part is ``{"type": "image", "image": value}``, the value a Pillow image, encoded bytes or a file path
(relative to the working directory), opened as dataset images are (``data.max_image_pixels``). The messages are
rendered by the processor's chat template after the sampled turn (:func:`.trajectory.continuation_text`), and the
processor expands each image part's placeholder and makes the image tensors: one
:class:`~longrl.models.vision.VisionPrompt` *block* of the environment's tokens. The sampler's resume prefill puts
its image features at its placeholders (rollout/sampler.py ``EnvTokens``), and the training passes do the same at
the index the rollout recorded (``SequenceImages``): what is trained is what was sampled.

Every supported family takes them: Qwen-VL's block at mRoPE positions relative to the text before it
(``SequenceImages.positions``), Gemma 3's with its image tokens attending each other both ways in the resume
prefill (``ExtendMeta.blocks``) and the passes. A text model's episode ends as ``env_error`` naming why.
"""

from __future__ import annotations

from ..data.images import image_source, open_images
from ..models.vision import build_prompt, encode_text
from ..rollout.sampler import EnvTokens


def image_values(messages: list[dict]) -> list:
    """The ``image`` values of the messages' image parts, in order."""
    return [p["image"] for m in messages if isinstance(m.get("content"), list) for p in m["content"]
            if isinstance(p, dict) and p.get("type") == "image"]


def loggable(messages):
    """``messages`` (a list of chat messages; anything else is returned as it is) with each image part's image
    replaced by what it was (``"a Pillow image given in memory"``, ``"file /data/p.png"``, ``"2048 bytes"``): what
    completions.jsonl writes, rather than an object's repr."""
    if not isinstance(messages, list):
        return messages

    def part(p):
        if not (isinstance(p, dict) and p.get("type") == "image" and p.get("image") is not None):
            return p
        try:
            return {**p, "image": image_source(p["image"], "", None, 1).describe()}
        except ValueError:  # (not an image value: its type)
            return {**p, "image": type(p["image"]).__name__}

    return [{**m, "content": [part(p) for p in m["content"]]}
            if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in messages]


def as_parts(messages: list[dict]) -> list[dict]:
    """Copies of ``messages`` whose string contents are one text part: the form every vision processor's chat
    template renders (some iterate over the content)."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
            for m in messages]


class ToolImages:
    """``encoder``: the model's prompt encoder (training.vision_inputs.PromptImages: processor and config);
    ``max_pixels``: data.max_image_pixels."""

    def __init__(self, encoder, max_pixels: int):
        self.processor, self.config, self.max_pixels = encoder.processor, encoder.config, max_pixels

    def open(self, values: list, where: str) -> list:
        """The images of ``values`` as RGB Pillow images; DataError naming ``where`` and the image otherwise."""
        return open_images([image_source(v, f"{where}, image {k + 1}", None, self.max_pixels)
                            for k, v in enumerate(values)])

    def encode(self, text: str, images: list) -> EnvTokens:
        """The environment's tokens of rendered ``text`` (one image placeholder a part) with ``images``: the ids
        with each placeholder expanded, and their block."""
        ids, tensors = encode_text(self.processor, self.config, text, images)
        return EnvTokens(ids, build_prompt(self.config, ids, tensors))


__all__ = ["ToolImages", "as_parts", "image_values", "loggable"]
