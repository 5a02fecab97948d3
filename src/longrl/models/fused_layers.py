"""Put the fused training kernels (ops/rmsnorm.py, ops/swiglu.py, ops/rotary.py) into a transformers model, and
take them out.

``enable_fused_layers(model)`` replaces, in their parents' slots, every Llama-family RMSNorm by a
:class:`FusedRMSNorm`, every SiLU MLP by a :class:`FusedSwiGLU` and every Llama-family attention by a
:class:`FusedRotaryAttention`: wrappers sharing the wrapped module's children and parameters like the tiled MLP
(models/shared_wrapper.py), so parameter and state-dict names are unchanged and PEFT adapters on the projections keep
working (the wrappers call the projections). No library class is modified. On the CPU (or without Triton) the
norm and MLP wrappers run the wrapped module's own forward and the attention wrapper the rotary twin, so results
there are transformers' exactly.
"""

from __future__ import annotations

import sys

from torch import nn

from ..ops.rmsnorm import rmsnorm
from ..ops.rotary import rotary
from ..ops.swiglu import silu_mul
from .shared_wrapper import SharedWrapper
from .tiled_mlp import TiledMLP

# forward y = w · round(x · rsqrt(mean x² + eps)), weight initialised to ones (Gemma's 1 + w is another formula)
RMSNORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
# forward down(act(gate(x)) · up(x))
SWIGLU_CLASSES = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
# attention whose forward (transformers 5.x, no cache) is: q, k, v projections viewed [B, T, H, D] (q, k through the
# per-head norms q_norm, k_norm where the class has them), apply_rotary_pos_emb, the configured attention function
# with the sliding window where noted, o_proj. Value: where the sliding window comes from ("" = not passed).
ATTENTION_CLASSES = {"LlamaAttention": "", "MistralAttention": "config", "Qwen2Attention": "module",
                     "Qwen3Attention": "module"}


class FusedRMSNorm(SharedWrapper):
    """RMSNorm through :func:`longrl.ops.rmsnorm.rmsnorm` (``weight`` and ``variance_epsilon`` as the original)."""

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


class FusedRotaryAttention(SharedWrapper):
    """transformers' attention forward with the rotary embedding through :func:`longrl.ops.rotary.rotary`.

    Everything but the rotary embedding is the wrapped class's own code path: the same projections (PEFT's or the
    fused LoRA's layers), the attention function ``config._attn_implementation`` names (so attention reuse,
    memory/attention_reuse.py, and packed sequences see the same call), called with the wrapped module itself. A
    call with a KV cache (generation) runs the wrapped module's forward."""

    def __init__(self, inner: nn.Module):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # (here: `longrl` starts without it)

        super().__init__(inner)
        self.attention_functions = ALL_ATTENTION_FUNCTIONS
        self.window_from = ATTENTION_CLASSES[type(inner).__name__]
        self.qk_norm = hasattr(inner, "q_norm") and hasattr(inner, "k_norm")
        self.eager = getattr(sys.modules[type(inner).__module__], "eager_attention_forward", None)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None or position_embeddings is None or self.eager is None:
            return self.inner(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                              **kwargs)
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        attn = self.inner
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)  # [B, T, Hq, D]
        k = self.k_proj(hidden_states).view(hidden_shape)  # [B, T, Hk, D]
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, Hk, T, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k, *position_embeddings)  # [B, Hq, T, D], [B, Hk, T, D]
        attention = self.attention_functions.get_interface(attn.config._attn_implementation, self.eager)
        if self.window_from == "module":
            kwargs["sliding_window"] = attn.sliding_window
        elif self.window_from == "config":
            kwargs["sliding_window"] = getattr(attn.config, "sliding_window", None)
        out, weights = attention(attn, q, k, v, attention_mask, dropout=0.0 if not self.training else
                                 attn.attention_dropout, scaling=attn.scaling, **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _is_rotary_attention(module: nn.Module) -> bool:
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "config", "attention_dropout")
    return (type(module).__name__ in ATTENTION_CLASSES and all(hasattr(module, a) for a in names)
            and (ATTENTION_CLASSES[type(module).__name__] != "module" or hasattr(module, "sliding_window")))


def _slots(model: nn.Module):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            yield parent, name, child


def _is_silu_mlp(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)  # transformers' SiLUActivation (5.x) or torch's SiLU: F.silu both
    return (type(module).__name__ in SWIGLU_CLASSES and type(act).__name__ in ("SiLUActivation", "SiLU")
            and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")))


def enable_fused_layers(model: nn.Module) -> dict[str, int]:
    """Wrap ``model``'s RMSNorms, SiLU MLPs and rotary attentions (idempotent; other norms, activations and
    attentions are left alone). A tiled MLP (models/tiled_mlp.py) is wrapped inside: its tiles run the fused product.
    Returns how many of each."""
    counts = {"rmsnorm": 0, "swiglu": 0, "attention": 0}
    for parent, name, child in _slots(model):
        if type(child).__name__ in RMSNORM_CLASSES and hasattr(child, "variance_epsilon"):
            setattr(parent, name, FusedRMSNorm(child))
            counts["rmsnorm"] += 1
        elif _is_silu_mlp(child):
            setattr(parent, name, FusedSwiGLU(child))
            counts["swiglu"] += 1
        elif _is_rotary_attention(child):
            setattr(parent, name, FusedRotaryAttention(child))
            counts["attention"] += 1
        elif isinstance(child, TiledMLP) and _is_silu_mlp(child.inner):
            object.__setattr__(child, "inner", FusedSwiGLU(child.inner))
            counts["swiglu"] += 1
    return counts


def disable_fused_layers(model: nn.Module) -> int:
    """Put the wrapped modules back (inside tiled MLPs too). Returns how many."""
    count = 0
    for parent, name, child in _slots(model):
        if isinstance(child, (FusedRMSNorm, FusedSwiGLU, FusedRotaryAttention)):
            child.inner.training = child.training
            setattr(parent, name, child.inner)
            count += 1
        elif isinstance(child, TiledMLP) and isinstance(child.inner, FusedSwiGLU):
            object.__setattr__(child, "inner", child.inner.inner)
            count += 1
    return count
