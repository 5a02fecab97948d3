"""Prompts with images for ``longrl generate`` (``--image PATH``, or a vision dataset's ``--data``) and ``longrl
eval`` (a vision dataset): refused for a text-only model before any weight loads, image files read and checked
before the model loads (data/images.py: each error names the file), and encoded once per prompt by the model's
processor (training/vision_inputs.py), as training encodes them."""

from __future__ import annotations

from ..data.errors import DataError
from ..data.images import image_source, open_images
from ..data.image_parts import content_parts


class ImageRequestError(ValueError):
    """Images asked of a model or with flags that cannot take them; the message names the flag and the model."""


def reads_images(reference: str, ckpt, model_cfg) -> bool:
    """Whether ``--from`` names a vision-language model (a run's base, down its warm starts, or a model), read from
    configs alone: no weights load."""
    from ..models.loading import is_image_text_model

    if ckpt is not None:
        return is_image_text_model(ckpt.base_name, model_cfg.trust_remote_code, ckpt.model.get("revision"))
    return is_image_text_model(reference, model_cfg.trust_remote_code, model_cfg.revision)


def require_image_model(reference: str, ckpt, model_cfg, what: str) -> None:
    """Refuse ``what`` (e.g. ``--image``) when ``--from`` names a text-only model, before it loads."""
    if not reads_images(reference, ckpt, model_cfg):
        base = f" (its base {ckpt.base_name!r})" if ckpt is not None else ""
        raise ImageRequestError(f"{what}: --from {reference}{base} is a text-only model (no vision tower); give a "
                                "vision-language model or run")


def read_image_files(paths: list[str], max_pixels: int) -> list:
    """``--image`` files as RGB Pillow images, in order; a missing or unreadable file raises naming it."""
    try:
        return open_images([image_source(p, f"--image {p}", None, max_pixels) for p in paths])
    except DataError as e:
        raise ImageRequestError(str(e)) from None


def image_messages(text: str, num_images: int) -> list[dict]:
    """A plain prompt and its images as one user message: one image part per image, then the text (as a dataset's
    plain-text prompt with images becomes, docs/vision.md)."""
    return [{"role": "user", "content": [{"type": "image"}] * num_images + content_parts(text, "--prompt")}]


def prompt_images(model, reference: str, ckpt, model_cfg):
    """The model's prompt encoder (:class:`~longrl.training.vision_inputs.PromptImages`, with the processor of the
    model or of the run's base), None for a text model."""
    from ..training.vision_inputs import PromptImages

    if ckpt is not None:
        return PromptImages.for_model(model, ckpt.base_name, revision=ckpt.model.get("revision"),
                                      trust_remote_code=model_cfg.trust_remote_code)
    return PromptImages.for_model(model, reference, revision=model_cfg.revision,
                                  trust_remote_code=model_cfg.trust_remote_code)


def shown_text(prompt) -> str:
    """How a prompt is printed: its text, or its last message's text with ``<image>`` where each image stands."""
    if isinstance(prompt, str):
        return prompt
    content = prompt[-1]["content"]
    if isinstance(content, str):
        return content
    return "".join("<image>" if p["type"] == "image" else p["text"] for p in content)
