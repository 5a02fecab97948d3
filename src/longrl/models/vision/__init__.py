"""Vision-language models: the supported families (``families``), a prompt's images encoded once (``prompt``), its
image features (``features``), the language model's inputs with them (``inputs``), Qwen-VL's 3-D rotary
positions (``mrope``), and the attention masks of image tokens that attend both ways, Gemma 3's (``masks``).
docs/vision.md, "How vision models run", tells the design."""

from .families import (
                       FAMILIES,
                       VisionFamily,
                       VisionModelError,
                       has_vision,
                       image_token_id,
                       require_vision,
                       supported_families,
                       vision_family,
)
from .features import (
                       FeatureCache,
                       ImageFeatures,
                       compute_image_features,
                       vision_parameters,
                       vision_trains,
)
from .inputs import Placement, language_model_inputs, placements_of
from .masks import image_block_mask, layer_masks
from .mrope import continued_positions, mrope_positions
from .prompt import SequenceImages, VisionPrompt, build_prompt, encode_prompt, encode_text

__all__ = ["FAMILIES", "FeatureCache", "ImageFeatures", "Placement", "VisionFamily", "VisionModelError",
           "VisionPrompt", "build_prompt", "compute_image_features", "continued_positions", "encode_prompt",
           "encode_text", "has_vision", "image_block_mask", "image_token_id", "language_model_inputs", "layer_masks",
           "mrope_positions", "placements_of", "require_vision", "SequenceImages", "supported_families",
           "vision_family", "vision_parameters", "vision_trains"]
