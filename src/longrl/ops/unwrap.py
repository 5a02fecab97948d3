"""The transformers model under a PEFT wrapper.

Code that switches a model's attention (ops/sdpa_variant.py) or walks its structure (models/) takes either a
transformers model or a PEFT model around one; this is the one place that tells them apart, through PEFT's public
``get_base_model``.
"""

from __future__ import annotations


def base_model(model):
    """The transformers model under a PEFT wrapper (the model itself if not wrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
