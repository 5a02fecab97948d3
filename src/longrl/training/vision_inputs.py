"""Prompts with images, for the recipes: the processor's token ids when the dataset is read, and each drawn
prompt's :class:`~longrl.models.vision.VisionPrompt` (its image tensors) when a batch needs it.

A dataset's prompts are tokenized once, up front (their lengths decide the plan and the overlong rule); their image
tensors are made again for the prompts a rollout batch draws and dropped with the batch, so a large dataset's
pixels are never all in memory. The processor is deterministic, so both encodings give the same token ids (checked).
"""

from __future__ import annotations

from ..config import ConfigError
from ..data.images import open_images
from ..data.prompts import PromptDataset
from ..models import base_model
from ..models.loading import image_text_family, load_processor
from ..models.vision import VisionFamily, VisionPrompt, encode_prompt, encode_text, supported_families, vision_family


def check_image_model(cfg, model, what: str) -> VisionFamily:
    """The vision family of the model for a dataset holding ``what`` (prompts, examples) with images, read before its
    weights load (the config's model, by its config alone) or from the model passed in; a text model is refused."""
    if model is None:
        family = image_text_family(cfg.model.name_or_path, cfg.model.trust_remote_code, cfg.model.revision)
        name = f"model.name_or_path={cfg.model.name_or_path!r}"
    else:
        family, name = vision_family(base_model(model).config), "the model passed in"
    if family is None:
        raise ConfigError(f"config key 'data.source': {cfg.data.source!r} holds {what} with images, but {name} reads "
                          f"text only; train a vision-language model on it ({supported_families()})")
    return family


def is_processor(obj) -> bool:
    """Whether ``obj`` is a multimodal processor (a tokenizer with an image processor) rather than a tokenizer."""
    return hasattr(obj, "image_processor") and hasattr(obj, "tokenizer")


class PromptImages:
    """A vision-language model's prompt encoder: ``processor`` and the model's ``config``."""

    def __init__(self, processor, config):
        self.processor, self.config = processor, config

    @classmethod
    def for_model(cls, model, name_or_path: str | None, processor=None, *, revision=None, trust_remote_code=False):
        """The encoder of ``model`` when it is a vision-language model (its processor: ``processor`` when given,
        else loaded from ``name_or_path``), None for a text model."""
        config = base_model(model).config
        if vision_family(config) is None:
            return None
        if processor is None:
            if name_or_path is None:
                raise ValueError("a vision-language model passed in needs its processor (processing_class=)")
            processor = load_processor(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
        return cls(processor, config)

    def token_ids(self, messages: list[dict], images: list) -> list[int]:
        """A prompt's token ids, image placeholders expanded (``load_prompts``' ``encode_images``); a row of a
        vision dataset without images is rendered and tokenized as text."""
        if not images:
            text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return encode_text(self.processor, self.config, text, [])[0]
        return encode_prompt(self.processor, self.config, messages, images).input_ids

    def encode(self, messages: list[dict], images: list, tools: list | None = None) -> VisionPrompt:
        """One chat prompt with its (opened) images, ``tools``' schemas rendered (models.vision.encode_prompt)."""
        return encode_prompt(self.processor, self.config, messages, images, tools)

    def sources(self, data: PromptDataset, rows: list[int]) -> list[tuple[list[dict], list] | None] | None:
        """Each of ``rows``' (messages with image parts, opened images), None for a row without images; None when
        ``data`` holds no images (what a multi-turn episode of the row opens with: agents.episode_images)."""
        if data.images is None:
            return None
        return [(data.messages[i], open_images(data.images[i])) if data.images[i] else None for i in rows]

    def prompts(self, data: PromptDataset, rows: list[int]) -> list[VisionPrompt | None] | None:
        """Each of ``rows``' VisionPrompt (None for a row without images); None when ``data`` holds no images.
        Raises when the processor now gives other token ids than when the dataset was read."""
        if data.images is None:
            return None
        out = []
        for i in rows:
            if not data.images[i]:
                out.append(None)
                continue
            prompt = encode_prompt(self.processor, self.config, data.messages[i], open_images(data.images[i]))
            if prompt.input_ids != data.prompt_ids[i]:
                raise RuntimeError(f"prompt row {i + 1}: the processor gave other token ids than when the dataset "
                                   "was read")
            out.append(prompt)
        return out


def repeat_groups(prompts: list | None, num_generations: int) -> list | None:
    """Each prompt's entry repeated for its G completions (the same object: features are computed once a prompt)."""
    return None if prompts is None else [p for p in prompts for _ in range(num_generations)]


def pick(values: list | None, idx: list[int]) -> list | None:
    """``values`` at ``idx`` (None stays None)."""
    return None if values is None else [values[i] for i in idx]
