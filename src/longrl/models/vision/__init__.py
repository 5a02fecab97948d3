"""Vision-language models: the supported families (``families``), a prompt's images encoded once (``prompt``), its
image features (``features``), the language model's inputs with them (``inputs``), and Qwen-VL's 3-D rotary
positions (``mrope``). docs/vision.md, "How vision models run", tells the design."""

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
from .inputs import Placement, language_model_inputs
from .mrope import continued_positions, mrope_positions
from .prompt import VisionPrompt, build_prompt, encode_prompt, encode_text

__all__ = ["FAMILIES", "FeatureCache", "ImageFeatures", "Placement", "VisionFamily", "VisionModelError",
           "VisionPrompt", "build_prompt", "compute_image_features", "continued_positions", "encode_prompt",
           "encode_text", "has_vision", "image_token_id", "language_model_inputs", "mrope_positions", "require_vision",
           "supported_families", "vision_family", "vision_parameters", "vision_trains"]
