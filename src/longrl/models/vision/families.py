"""The vision-language families longrl trains, recognised from a model's config (``model_type``) before any weight
loads, and where each keeps its vision tower and projector.

A config with a vision part (a ``vision_config``, or a known image-text ``model_type``) that is not listed here is
refused with the list of supported families; Gemma 3n is refused with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ModelLoadError


class VisionModelError(ModelLoadError):
    """A vision-language model longrl cannot run, or images given to a text-only model; the message says why."""


@dataclass(frozen=True)
class VisionFamily:
    """How one family's prompt inputs are built. Module paths are relative to the transformers model (the
    ``...ForConditionalGeneration``), matched as a dotted suffix of the qualified name."""

    name: str  # as users know it: "Qwen2-VL"
    mrope: bool  # 3-D rotary positions (temporal, height, width) for image tokens
    tower: tuple[str, ...]  # the vision encoder's modules (LoRA with vision_modules=tower_and_projector)
    projector: tuple[str, ...]  # the modules mapping its output to the language model's width
    image_inputs: tuple[str, ...]  # the processor's outputs get_image_features reads, in its argument order
    deepstack: bool = False  # features of early tower layers added to the first decoder layers (Qwen3-VL)
    feature_options: tuple[str, ...] = ()  # config keys get_image_features takes as keywords (the forward reads
    #                                        them from the config; LLaVA: which tower layer and which of its tokens)
    image_blocks: bool = False  # each image's run of placeholder tokens attends to itself both ways (Gemma 3):
    #                             the prefill and training passes take the masks of models/vision/masks.py
    hf_generate: bool = False  # transformers' generate takes its prompts with images (rollout/hf_generate.py)


_QWEN_INPUTS = ("pixel_values", "image_grid_thw")
_LLAVA = dict(tower=("vision_tower",), projector=("multi_modal_projector",),
              feature_options=("vision_feature_layer", "vision_feature_select_strategy"))
_IDEFICS = dict(tower=("vision_model",), projector=("connector",), image_inputs=("pixel_values", "pixel_attention_mask"))

FAMILIES: dict[str, VisionFamily] = {  # model_type → family
    "qwen2_vl": VisionFamily("Qwen2-VL", True, ("visual",), ("visual.merger",), _QWEN_INPUTS),
    "qwen2_5_vl": VisionFamily("Qwen2.5-VL", True, ("visual",), ("visual.merger",), _QWEN_INPUTS),
    "qwen3_vl": VisionFamily("Qwen3-VL", True, ("visual",), ("visual.merger", "visual.deepstack_merger_list"),
                             _QWEN_INPUTS, deepstack=True),
    "llava": VisionFamily("LLaVA-1.5", False, image_inputs=("pixel_values",), **_LLAVA),
    "llava_next": VisionFamily("LLaVA-NeXT", False, image_inputs=("pixel_values", "image_sizes"), **_LLAVA),
    "idefics3": VisionFamily("Idefics3", False, **_IDEFICS),
    "smolvlm": VisionFamily("SmolVLM", False, **_IDEFICS),
    "gemma3": VisionFamily("Gemma 3", False, ("vision_tower",), ("multi_modal_projector",), ("pixel_values",),
                           image_blocks=True, hf_generate=True),
}

REFUSED = {  # model_type → why it is not run
    "gemma3n": "Gemma 3n's language model (per-layer embeddings, AltUp) is another architecture than Gemma 3's, "
               "and longrl's passes have not been checked against it",
}


def supported_families() -> str:
    """The supported families and their model_type, for messages."""
    return ", ".join(f"{f.name} ({t})" for t, f in FAMILIES.items())


def has_vision(config) -> bool:
    """Whether a transformers config describes a model with an image input."""
    return (getattr(config, "vision_config", None) is not None or config.model_type in FAMILIES
            or config.model_type in REFUSED)


def vision_family(config) -> VisionFamily | None:
    """The family of a vision-language config; None for a text-only one. Any other model with a vision part raises
    :class:`VisionModelError` naming the supported families (read from the config alone: no weights needed)."""
    if not has_vision(config):
        return None
    model_type = config.model_type
    family = FAMILIES.get(model_type)
    if family is not None and family.image_blocks and getattr(config.get_text_config(), "use_bidirectional_attention",
                                                              False):
        raise VisionModelError(f"vision-language model type {model_type!r} with use_bidirectional_attention (every "
                               "token attending both ways) is not supported: longrl runs it as a causal language model")
    if family is not None:
        return family
    why = REFUSED.get(model_type, "its family is not supported")
    raise VisionModelError(f"vision-language model type {model_type!r} is not supported: {why}. Supported "
                           f"families: {supported_families()}")


def image_token_id(config) -> int:
    """The id of the placeholder token the processor repeats once per image feature."""
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if value is not None:
            return int(value)
    raise VisionModelError(f"{config.model_type} config has no image_token_id / image_token_index")


def module_names(model, paths: tuple[str, ...]) -> list[str]:
    """Qualified names of ``model``'s modules that end with one of ``paths`` (dotted suffixes), outermost first."""
    names = [n for n, _ in model.named_modules() if any(n == p or n.endswith("." + p) for p in paths)]
    return [n for n in names if not any(n != o and n.startswith(o + ".") for o in names)]


def require_vision(config, what: str = "prompts with images") -> VisionFamily:
    """The family of ``config``; a text-only model raises :class:`VisionModelError` (``what`` needs a tower)."""
    family = vision_family(config)
    if family is None:
        raise VisionModelError(f"{what} need a vision-language model; {config.model_type!r} is text-only (no vision "
                               f"tower). Supported families: {supported_families()}")
    return family
