"""Which linear layers of a vision-language model get LoRA adapters, and which stay in 16-bit under a 4-bit base.

LoRA goes on the language model's linear layers (all of them, or those named by ``lora.target_modules``), and on
the vision side as ``lora.vision_modules`` says: ``none``, ``projector`` (the layers mapping image features to the
language model's width) or ``tower_and_projector`` (every linear layer of the vision encoder and projector). The
LM head never gets adapters. The result is a list of qualified module names, PEFT's exact-name targets.
"""

from __future__ import annotations

from torch import nn

from ..structure import base_model
from .families import VisionFamily, module_names

VISION_MODULE_CHOICES = ("none", "projector", "tower_and_projector")


def _linears_under(model, prefixes: list[str]) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
            and any(n.startswith(p + ".") for p in prefixes)]


def language_model_name(model) -> str:
    """The qualified name of the language model (the decoder whose hidden states feed the LM head)."""
    decoder = base_model(model).get_decoder()
    return next(n for n, m in base_model(model).named_modules() if m is decoder)


def vision_module_prefixes(model, family: VisionFamily, which: str = "tower_and_projector") -> list[str]:
    """Qualified names of the vision modules ``which`` covers (``projector`` or ``tower_and_projector``)."""
    if which not in VISION_MODULE_CHOICES:
        raise ValueError(f"config key 'lora.vision_modules': {which!r}; choose {', '.join(VISION_MODULE_CHOICES)}")
    if which == "none":
        return []
    paths = family.projector if which == "projector" else family.tower + family.projector
    return module_names(base_model(model), paths)


def lora_targets(model, family: VisionFamily, target_modules: list[str], vision_modules: str) -> list[str]:
    """Module names (relative to the transformers model) that get adapters: the language model's linear layers
    matching ``target_modules`` (names or dotted suffixes; ``all-linear``: all), then the vision modules' linear
    layers as ``vision_modules`` says."""
    base = base_model(model)
    language = _linears_under(base, [language_model_name(model)])
    if list(target_modules) != ["all-linear"]:
        language = [n for n in language if any(n == t or n.endswith("." + t) for t in target_modules)]
        if not language:
            raise ValueError(f"config key 'lora.target_modules': {list(target_modules)} match no linear layer of the "
                             "language model")
    vision = _linears_under(base, vision_module_prefixes(model, family, vision_modules))
    if vision_modules != "none" and not vision:
        bare = (" (its projector holds no nn.Linear, Gemma 3's a bare weight matrix: train it with full weights, "
                "lora.enabled: false)") if vision_modules == "projector" else ""
        raise ValueError(f"config key 'lora.vision_modules': {vision_modules} found no linear layer in the "
                         f"{family.name} model's vision modules{bare}")
    return language + vision
