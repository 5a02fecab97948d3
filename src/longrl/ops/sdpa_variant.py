"""Switch a transformers model on SDPA attention to another attention function for a block of code.

transformers looks a model's attention function up by name (``config._attn_implementation``) in its
``AttentionInterface``; a variant is a function registered there under its own name, with SDPA's mask builder
(transformers builds no padding or packing mask for an attention implementation without one). The variants of
ops/attention_backend.py (keys/values repeated to the query heads) and ops/grouped_attention.py (the backward one
key head group at a time) both enter through :func:`sdpa_variant`.
"""

from __future__ import annotations

import contextlib

from .unwrap import base_model


def register_sdpa_variant(name: str, function) -> None:
    """Register ``function`` as transformers attention ``name`` and, for it, SDPA's mask builder (transformers
    builds no padding or packing mask for an attention implementation without one)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@contextlib.contextmanager
def sdpa_variant(model, name: str, function):
    """Context in which ``model`` (transformers or PEFT), if it is on SDPA attention, attends through ``function``
    registered as ``name`` (register_sdpa_variant); back to SDPA after. A model on other attention is left as it
    is."""
    base = base_model(model)
    if base.config._attn_implementation != "sdpa":
        yield
        return
    register_sdpa_variant(name, function)
    base.set_attn_implementation(name)
    try:
        yield
    finally:
        base.set_attn_implementation("sdpa")
