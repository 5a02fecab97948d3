"""A module standing in for another in its parent's slot, sharing its children, parameters and buffers.

The wrappers that change how a layer computes (the tiled MLP, models/tiled_mlp.py; the fused kernels,
models/fused_layers.py; the fused LoRA projections, models/lora_training.py) share the wrapped module's
``_modules``/``_parameters``/``_buffers`` dicts, so parameter and state-dict names (``...layers.0.mlp.gate_proj
.weight``) and PEFT adapters are unchanged, and a child replaced through either module (PEFT injecting LoRA after
wrapping, merging before unwrapping) is seen by both. No library class is modified.
"""

from __future__ import annotations

from torch import nn


class SharedWrapper(nn.Module):
    """A module standing in for ``inner`` in its parent's slot with the same children, parameters and buffers
    (shared dicts: names, state dicts and PEFT adapters unchanged; a child replaced through either is seen by
    both) and its other attributes read through (``variance_epsilon``, ``scaling``, ``config``, ...: code that
    inspects the model sees the wrapped module's). Subclasses define ``forward``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        object.__setattr__(self, "inner", inner)  # not a child: its children are ours
        self._modules = inner._modules
        self._parameters = inner._parameters
        self._buffers = inner._buffers
        self.training = inner.training

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("inner")  # (absent while copy or pickle rebuild the wrapper)
            if inner is None:
                raise
            return getattr(inner, name)

    def train(self, mode: bool = True):
        self.inner.training = mode
        return super().train(mode)

