"""Where a causal LM keeps its parts: the transformers model under a PEFT wrapper and its decoder layers."""

from __future__ import annotations

import torch

from ..ops.unwrap import base_model


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM (transformers or PEFT): ``layers`` of its backbone (``get_decoder()``: a
    vision-language model's language model), the units FSDP2 shards and checkpointing recomputes one at a time."""
    base = base_model(model)
    inner = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(base_model(model)).__name__} has no model.layers: FSDP2 sharding needs a "
                         "Llama-style decoder stack")
    return list(layers)


def put_frozen_linear(model, name: str, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
    """Put a frozen ``nn.Linear`` holding ``weight`` [out, in] and ``bias`` (both cast to ``dtype``) in the place of
    ``model``'s module ``name`` (a quantized layer dequantized for a merge)."""
    out_features, in_features = weight.shape
    linear = torch.nn.Linear(in_features, out_features, bias=bias is not None, device=weight.device, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(weight.to(dtype))
        if bias is not None:
            linear.bias.copy_(bias.to(dtype))
    linear.requires_grad_(False)
    model.set_submodule(name, linear)
