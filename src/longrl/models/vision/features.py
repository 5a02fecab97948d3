"""A prompt's image features: the vision tower and projector, through the model's public ``get_image_features``.

The features of a prompt are computed once per :class:`FeatureCache` (one training-pass call, one rollout): the
G sequences of a prompt share its :class:`~longrl.models.vision.prompt.VisionPrompt` object, so they share one
result, and autograd sums their gradients into it when the vision modules train. While no vision parameter
requires grad the features are constants of the weights and are kept on the prompt across calls (computed once a
rollout batch: rollout, old-policy, reference and policy passes).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..structure import base_model
from .families import VisionModelError, module_names
from .prompt import VisionPrompt


@dataclass
class ImageFeatures:
    embeds: torch.Tensor  # [N, H]: one row per placeholder token of the prompt, in order
    deepstack: list[torch.Tensor] | None = None  # Qwen3-VL: per early decoder layer, [N, H] added after it


def vision_parameters(model, family) -> list[torch.nn.Parameter]:
    """The parameters of the vision tower and projector (LoRA adapters on them included)."""
    base = base_model(model)
    modules = dict(base.named_modules())
    params = [p for n in module_names(base, family.tower + family.projector) for p in modules[n].parameters()]
    extra = getattr(getattr(base, "model", base), "image_newline", None)  # LLaVA-NeXT's row separator
    return params + ([extra] if isinstance(extra, torch.nn.Parameter) else [])


def vision_trains(model, family) -> bool:
    """Whether any vision parameter requires grad (LoRA on the tower or projector, or full weights)."""
    return any(p.requires_grad for p in vision_parameters(model, family))


def _rows(x) -> torch.Tensor:
    """[N, H] from a tensor [..., H] or a list/tuple of them (one per image), concatenated in order."""
    if isinstance(x, torch.Tensor):
        return x.reshape(-1, x.shape[-1])
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in x])


def compute_image_features(model, prompt: VisionPrompt) -> ImageFeatures:
    """Run the tower and projector on ``prompt``'s images: ``get_image_features`` with the family's inputs (floating
    ones cast to the tower's dtype), its pooled output flattened to one row per placeholder."""
    base = base_model(model)
    family = prompt.family
    tower = dict(base.named_modules())[module_names(base, family.tower)[0]]
    dtype = next(p.dtype for p in tower.parameters() if p.is_floating_point())
    device = base.get_output_embeddings().weight.device
    inputs = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device))
              for k, v in prompt.image_inputs.items()}
    options = {k: getattr(base.config, k) for k in family.feature_options}  # (the forward reads them from config)
    out = base.get_image_features(**inputs, **options)
    pooled = getattr(out, "pooler_output", out)
    embeds = _rows(pooled)
    if embeds.shape[0] != len(prompt.image_positions):
        raise VisionModelError(f"{family.name}: the vision tower gave {embeds.shape[0]} image features for "
                               f"{len(prompt.image_positions)} placeholder tokens")
    deepstack = None
    if family.deepstack:
        deepstack = [_rows(layer) for layer in out.deepstack_features]
    return ImageFeatures(embeds, deepstack)


class FeatureCache:
    """Image features once per distinct prompt object for one call; ``tower_calls`` counts the computations.

    With no vision parameter requiring grad (``trains`` False) they run without autograd and are kept on the
    prompt for later calls with the same model's tower; otherwise each call computes them once with autograd (its gradient summed over the
    prompt's rows)."""

    def __init__(self, model, family):
        self.model, self.family = model, family
        params = vision_parameters(model, family)
        self.trains = any(p.requires_grad for p in params)  # (vision_trains)
        # whose features a prompt keeps: this model's tower (another model, e.g. a frozen reference copy, recomputes)
        self.key = id(params[0])
        self.features: dict[int, ImageFeatures] = {}
        self.tower_calls = 0

    def get(self, prompt: VisionPrompt) -> ImageFeatures:
        found = self.features.get(id(prompt))
        if found is not None:
            return found
        if not self.trains and prompt.cached is not None and prompt.cached[0] == self.key:
            found = prompt.cached[1]
        else:
            with torch.no_grad() if not self.trains else contextlib.nullcontext():
                found = compute_image_features(self.model, prompt)
            self.tower_calls += 1
            prompt.cached = None if self.trains else (self.key, found)
        self.features[id(prompt)] = found
        return found
