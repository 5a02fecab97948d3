"""The vision tower's share of a step's GPU memory, for the planner (memory/planner.py ``plan_for_config``).

The language model's side of an image is already in the plan: its placeholder tokens are prompt tokens, counted in
``data.max_prompt_length``. What a vision-language model adds is counted here, from its config alone (the tower
is built on the meta device to count its parameters exactly, no memory):

- **weights**: the vision tower and projector, ``tower_params × b`` (b: compute bytes; they stay 16-bit under a
  4-bit or FP8 base); with full weights (lora.enabled=false) also their gradient (b) and AdamW's two float32
  moments (8): ``tower_params × (2b + 8)``;
- **image features**: computed once per prompt and kept for its G completions (never once per completion):
  ``prompts × image_tokens × H × b`` (H: the language model's width);
- **tower activations**, once per prompt: with the tower training (full weights, or lora.vision_modules other than
  none) autograd keeps every tower layer's activations for all the step's images,
  ``prompts × patches × L_v × (6·h_v + 2·i_v) × b`` (q, k, v, attention output, the MLP input, residuals: 6·h_v;
  the MLP's two intermediates: 2·i_v); frozen, the tower runs without autograd one prompt at a time and only one
  layer's activations live at once, ``patches × (6·h_v + 2·i_v) × b``.

Assumptions (stated in the plan's row): one image a prompt; an image of ``vision_config.image_size`` pixels a side,
or ASSUMED_IMAGE_SIDE for the families that take any resolution (Qwen-VL: ``patches = (side / patch_size)²``,
``image_tokens = patches / spatial_merge_size²``; Gemma 3: ``image_tokens = mm_tokens_per_image``, its pooled
count, without pan-and-scan crops).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
ASSUMED_IMAGE_SIDE = 1024  # pixels a side of an image, for families without a fixed image size


def _first(config, *names, default=None):
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), default)


def tower_parameters(model_config) -> int:
    """Parameters of the vision tower and projector (everything outside the language model and its LM head),
    counted on a model built on the meta device."""
    import torch
    from transformers import AutoModelForImageTextToText

    from ..models.structure import base_model
    from ..models.vision.adapters import language_model_name

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(model_config)
    language = language_model_name(model)
    head = base_model(model).get_output_embeddings()
    head_ids = {id(p) for p in head.parameters()}
    return sum(p.numel() for n, p in model.named_parameters()
               if not n.startswith(language + ".") and id(p) not in head_ids)


@dataclass(frozen=True)
class VisionMemory:
    """What the vision side adds to a step (module docstring: the arithmetic)."""

    tower_params: int
    patches: int  # the tower's tokens for one image
    image_tokens: int  # the language model's placeholder tokens for one image
    weight_bytes: int
    feature_bytes: int
    activation_bytes: int

    @classmethod
    def of(cls, model_config, *, prompts: int, compute_bytes: int, tower_trains: bool, full_weights: bool):
        v = model_config.vision_config
        text = model_config.get_text_config()
        hidden = _first(v, "hidden_size", "embed_dim")
        layers = _first(v, "num_hidden_layers", "depth")
        inner = _first(v, "intermediate_size", default=int(hidden * _first(v, "mlp_ratio", default=4)))
        side = _first(v, "image_size", default=ASSUMED_IMAGE_SIDE)
        side = side[0] if isinstance(side, (list, tuple)) else side
        patches = (int(side) // int(v.patch_size)) ** 2
        image_tokens = int(_first(model_config, "mm_tokens_per_image",  # Gemma 3: the tower's patches pooled to it
                                  default=patches // int(_first(v, "spatial_merge_size", default=1)) ** 2))
        params = tower_parameters(model_config)
        b = compute_bytes
        per_layer = patches * (6 * hidden + 2 * inner) * b
        return cls(tower_params=params, patches=patches, image_tokens=image_tokens,
                   weight_bytes=params * (2 * b + 8 if full_weights else b),
                   feature_bytes=prompts * image_tokens * text.hidden_size * b,
                   activation_bytes=prompts * layers * per_layer if tower_trains else per_layer)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.feature_bytes + self.activation_bytes

    def parts(self) -> dict[str, int]:
        """The plan's rows: GPU bytes by part."""
        return {"vision tower + projector weights": self.weight_bytes,
                "image features (once per prompt)": self.feature_bytes,
                "vision tower activations": self.activation_bytes}

    def describe(self) -> str:
        return (f"{self.tower_params:,} tower + projector parameters; one image a prompt of {self.patches:,} "
                f"patches → {self.image_tokens:,} image tokens (counted in data.max_prompt_length), "
                f"{self.total_bytes / GIB:.2f} GiB")
