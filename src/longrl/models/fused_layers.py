"""Put the fused training kernels (ops/rmsnorm.py, ops/swiglu.py) into a transformers model, and take them out.

``enable_fused_layers(model)`` replaces, in their parents' slots, every Llama-family RMSNorm by a
:class:`FusedRMSNorm` and every SiLU MLP by a :class:`FusedSwiGLU`: wrappers sharing the wrapped module's
children and parameters like the tiled MLP (memory/tiling.py), so parameter and state-dict names are unchanged and
PEFT adapters on the MLP's projections keep working (the wrapper calls the projections). No library class is
modified. On the CPU (or without Triton) the wrappers run the wrapped module's own forward, so results there are
transformers' exactly.
"""

from __future__ import annotations

from torch import nn

from ..memory.tiling import SharedWrapper, TiledMLP
from ..ops.rmsnorm import rmsnorm
from ..ops.swiglu import silu_mul

# forward y = w · round(x · rsqrt(mean x² + eps)), weight initialised to ones (Gemma's 1 + w is another formula)
RMSNORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
# forward down(act(gate(x)) · up(x))
SWIGLU_CLASSES = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")


class FusedRMSNorm(SharedWrapper):
    """RMSNorm through :func:`longrl.ops.rmsnorm.rmsnorm` (``weight`` and ``variance_epsilon`` as the original)."""

    def __init__(self, inner: nn.Module):
        super().__init__(inner)
        self.variance_epsilon = inner.variance_epsilon

    def forward(self, x):
        if not x.is_cuda:
            return self.inner(x)
        return rmsnorm(x, self.weight, self.variance_epsilon)


class FusedSwiGLU(SharedWrapper):
    """down(silu(gate(x)) · up(x)) with the product through :func:`longrl.ops.swiglu.silu_mul`."""

    def forward(self, x):
        if not x.is_cuda:
            return self.inner(x)
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _slots(model: nn.Module):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            yield parent, name, child


def _is_silu_mlp(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)  # transformers' SiLUActivation (5.x) or torch's SiLU: F.silu both
    return (type(module).__name__ in SWIGLU_CLASSES and type(act).__name__ in ("SiLUActivation", "SiLU")
            and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")))


def enable_fused_layers(model: nn.Module) -> dict[str, int]:
    """Wrap ``model``'s RMSNorms and SiLU MLPs (idempotent; other norms and activations are left alone). A tiled
    MLP (memory/tiling.py) is wrapped inside: its tiles run the fused product. Returns how many of each."""
    counts = {"rmsnorm": 0, "swiglu": 0}
    for parent, name, child in _slots(model):
        if type(child).__name__ in RMSNORM_CLASSES and hasattr(child, "variance_epsilon"):
            setattr(parent, name, FusedRMSNorm(child))
            counts["rmsnorm"] += 1
        elif _is_silu_mlp(child):
            setattr(parent, name, FusedSwiGLU(child))
            counts["swiglu"] += 1
        elif isinstance(child, TiledMLP) and _is_silu_mlp(child.inner):
            object.__setattr__(child, "inner", FusedSwiGLU(child.inner))
            counts["swiglu"] += 1
    return counts


def disable_fused_layers(model: nn.Module) -> int:
    """Put the wrapped modules back (inside tiled MLPs too). Returns how many."""
    count = 0
    for parent, name, child in _slots(model):
        if isinstance(child, (FusedRMSNorm, FusedSwiGLU)):
            child.inner.training = child.training
            setattr(parent, name, child.inner)
            count += 1
        elif isinstance(child, TiledMLP) and isinstance(child.inner, FusedSwiGLU):
            object.__setattr__(child, "inner", child.inner.inner)
            count += 1
    return count
