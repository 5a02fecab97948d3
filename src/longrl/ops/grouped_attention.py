"""Causal attention whose backward runs one key/value head group at a time (less memory at long context).

PyTorch's flash attention backward for grouped-query attention (Hkv key/value heads, Hq = rep · Hkv query heads)
allocates, besides the gradients dq [T, Hq, D], dk and dv [T, Hkv, D]: a float32 dq accumulator [T, Hq, D] and
dk, dv expanded to the query heads [T, Hq, D] each (summed over each group at the end). For the Llama-3.1-8B shape
that is 32 KB a token on top of the gradients' 12 KB, the largest transient of a long-context training step. Run
per key head h instead — query heads [h·rep, (h+1)·rep) against key/value head h, each call its own flash
backward — and the transients are those of one group, 1/Hkv of that (plus the group's contiguous copies of do and
o, which the kernel makes of head slices):

    dq[:, h·rep:(h+1)·rep], dk[:, h], dv[:, h] = flash_backward(do_h, q_h, k_h, v_h, o_h, lse_h)   h = 0 … Hkv − 1

Each query head's gradient, and each key head's sum over its group, is computed by the same kernel on the same
numbers either way (tests/test_grouped_attention.py: bit for bit on the CPU's flash kernels; on the GPU the flash
backward accumulates dq with atomics, so two whole calls differ as much). The forward is the one flash call.

:data:`GROUPED_SDPA` is a transformers attention function (``AttentionInterface``). Causal calls with fewer
key/value than query heads, no mask, no dropout, no other argument that changes the attention (a position bias, a
softcap, ...: NEUTRAL_KWARGS) and at least :data:`MIN_TOKENS` query tokens take this path on a flash-capable
device; everything else (decode steps, masks, short calls) is transformers' SDPA function unchanged.
:func:`grouped_backward` switches a model on SDPA to it for a block of code (``model.grouped_attention_backward``;
off by default: where SDPA's own GQA call runs cuDNN's kernels, those can be faster than the flash kernels this
path calls).
"""

from __future__ import annotations

import contextlib

import torch

from .sdpa_variant import sdpa_variant
from .unwrap import base_model

GROUPED_SDPA = "longrl_sdpa_grouped"
# query tokens of a call (batch × length) from which the backward runs per key head: there the flash transients
# are large (32 KB a token for the 8B heads: 2 GiB at 65,536 tokens), and one head group's call still has ≥ 2,048
# blocks of keys to spread over the GPU (length / 128 for each of its query heads), so its last wave is a small
# share of it; shorter calls run whole (their transients are small)
MIN_TOKENS = 65536
# keyword arguments transformers passes to an attention function that do not change SDPA's attention: a call with
# any other one set (position_bias, softcap, attention sinks, ...) runs transformers' SDPA function unchanged
NEUTRAL_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions", "past_key_values",
                            "past_key_value", "position_embeddings", "sliding_window", "layer_idx"})


def _flash_ops(device_type: str):
    """(forward, backward) of PyTorch's flash attention on ``device_type``: forward(q, k, v, scale) →
    (out, saved), backward(do, q, k, v, out, saved, scale) → (dq, dk, dv); saved holds the log-sum-exp [B, Hq, T]
    first, then what else the backward takes."""
    aten = torch.ops.aten
    if device_type == "cpu":
        def forward(q, k, v, scale):
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
            return out, (lse,)

        def backward(do, q, k, v, out, saved, scale):
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, saved[0], 0.0, True,
                                                                             scale=scale)
        return forward, backward

    def forward(q, k, v, scale):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)
        return out, (lse, cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(do, q, k, v, out, saved, scale):
        lse, cum_q, cum_k, max_q, max_k, seed, offset = saved
        return aten._scaled_dot_product_flash_attention_backward(do, q, k, v, out, lse, cum_q, cum_k, max_q, max_k,
                                                                 0.0, True, seed, offset, scale=scale)
    return forward, backward


class GroupedBackwardAttention(torch.autograd.Function):
    """o = causal softmax(q kᵀ · scale) v with grouped-query heads, q [B, Hq, T, D], k, v [B, Hkv, T, D] → o
    [B, Hq, T, D]; the backward per key head (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        forward, _ = _flash_ops(q.device.type)
        out, saved = forward(q, k, v, scale)
        tensors = [t for t in saved if isinstance(t, torch.Tensor)]
        ctx.save_for_backward(q, k, v, out, *tensors)
        ctx.saved_kinds = [isinstance(t, torch.Tensor) for t in saved]
        ctx.saved_values = [None if isinstance(t, torch.Tensor) else t for t in saved]
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, *tensors = ctx.saved_tensors
        it = iter(tensors)
        saved = [next(it) if kind else value for kind, value in zip(ctx.saved_kinds, ctx.saved_values)]
        _, backward = _flash_ops(q.device.type)
        hkv = k.shape[1]
        rep = q.shape[1] // hkv
        lse = saved[0]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for h in range(hkv):
            qs = slice(h * rep, (h + 1) * rep)
            ks = slice(h, h + 1)
            group = [lse[:, qs].contiguous(), *saved[1:]]  # the kernels read the log-sum-exp as [B, heads, T]
            dq_h, dk_h, dv_h = backward(do[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], group, ctx.scale)
            dq[:, qs].copy_(dq_h)
            dk[:, ks].copy_(dk_h)
            dv[:, ks].copy_(dv_h)
            del dq_h, dk_h, dv_h
        return dq, dk, dv, None


def grouped_shape(tokens: int, heads: int, kv_heads: int, head_dim: int, half: bool) -> bool:
    """The shape rule of the path (shared with the planner, memory/planner.attention_groups): at least MIN_TOKENS
    query tokens (batch × length), fewer key/value heads than query heads in whole groups, and on CUDA (``half``: a
    16-bit call) a head dimension the flash kernels take, a multiple of 8 up to 256."""
    return (tokens >= MIN_TOKENS and kv_heads < heads and heads % kv_heads == 0
            and (not half or (head_dim % 8 == 0 and head_dim <= 256)))


def takes_grouped_path(query, key, attention_mask, dropout: float) -> bool:
    """Whether a call (query [B, Hq, T, D], key [B, Hkv, S, D]) runs :class:`GroupedBackwardAttention`: a causal
    self-attention call (T = S > 1, no mask, no dropout) with Hkv < Hq, at least MIN_TOKENS query tokens, on a
    device with flash kernels for it (CUDA: compute capability ≥ 8.0, 16-bit, D a multiple of 8 up to 256; the CPU:
    any floating dtype). With or without gradient: a checkpointed layer's two forwards must make the same kernel
    call (attention reuse, memory/attention_reuse.py, replays the first one's outputs by its signature)."""
    B, hq, T, D = query.shape
    if attention_mask is not None or dropout or T <= 1 or key.shape[2] != T:
        return False
    if query.device.type == "cuda":
        return (query.dtype in (torch.float16, torch.bfloat16) and grouped_shape(B * T, hq, key.shape[1], D, True)
                and torch.cuda.get_device_capability(query.device) >= (8, 0))
    return query.device.type == "cpu" and grouped_shape(B * T, hq, key.shape[1], D, False)


def grouped_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           is_causal=None, **kwargs):
    """transformers' SDPA attention function, with the grouped backward where :func:`takes_grouped_path` says and
    no keyword argument outside NEUTRAL_KWARGS is set; query [B, Hq, T, D], key/value [B, Hkv, T, D] →
    ([B, T, Hq, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    other = any(v is not None and v is not False for k, v in kwargs.items() if k not in NEUTRAL_KWARGS)
    if other or not causal or not takes_grouped_path(query, key, attention_mask, dropout):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = GroupedBackwardAttention.apply(query, key, value, float(scale))
    return out.transpose(1, 2).contiguous(), None  # flash writes [B, T, Hq, D]: the transpose is that layout


def grouped_backward(model):
    """Context in which ``model`` (transformers or PEFT), if on SDPA attention with grouped-query heads, attends
    through :data:`GROUPED_SDPA` (sdpa_variant.sdpa_variant); back to SDPA after. Any other model is left as it
    is."""
    config = base_model(model).config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads or kv_heads >= heads:
        return contextlib.nullcontext()
    return sdpa_variant(model, GROUPED_SDPA, grouped_sdpa_attention)
