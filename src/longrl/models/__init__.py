from .loading import LogitSpec, ModelLoadError, apply_lora, check_model_files, ensure_adapters, load_model, model_parts, resolve_device, set_lora_input_casting
from .quantize import QuantizationError, QuantReport, calibration_ids, quantize_model
from .structure import base_model
from .tiny import TINY_NAME, build_char_tokenizer, build_tiny_model

__all__ = ["LogitSpec", "ModelLoadError", "apply_lora", "base_model", "check_model_files", "ensure_adapters", "load_model", "model_parts",
           "resolve_device", "set_lora_input_casting", "TINY_NAME", "build_char_tokenizer", "build_tiny_model",
           "QuantizationError", "QuantReport", "calibration_ids", "quantize_model"]
