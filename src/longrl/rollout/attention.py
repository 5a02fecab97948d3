"""The sampler's attention, plugged into transformers through its public ``AttentionInterface``.

While the sampler runs, the model's attention implementation is switched to ``longrl_sampler`` (and back
afterwards). transformers computes q, k, v and the rotary embedding as usual and hands them to
:func:`sampler_attention`, together with the sampler's metadata (passed as the ``longrl_kv`` keyword through
the model's ``**kwargs``). The KV cache lives here, not in a transformers ``Cache``:

    prefix store  K_pre, V_pre: [L, P, Hkv, Lp, D]   one entry per prompt, shared by its G completions
    slot store    K_suf, V_suf: [L, S, Hkv, T, D]    one entry per decoding sequence (its own tokens)

Prefill runs a right-padded batch of prompts with causal SDPA and writes their keys/values into the prefix
store. A decode step writes each sequence's new key/value at its slot and attends over
prefix[:prefix_len] ++ suffix[:write_index + 1]:

    o = softmax(q Kᵀ · scale) V      over those keys (GQA: query head h reads key head h // (Hq / Hkv))
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

SAMPLER_ATTENTION = "longrl_sampler"


@dataclass
class KVCache:
    k_pre: torch.Tensor  # [L, P, Hkv, Lp, D]
    v_pre: torch.Tensor
    k_suf: torch.Tensor  # [L, S, Hkv, T, D]
    v_suf: torch.Tensor

    @classmethod
    def allocate(cls, *, layers: int, kv_heads: int, head_dim: int, prefix_slots: int, prefix_len: int, slots: int,
                 suffix_len: int, dtype: torch.dtype, device) -> "KVCache":
        pre = (layers, prefix_slots, kv_heads, prefix_len, head_dim)
        suf = (layers, slots, kv_heads, suffix_len, head_dim)
        return cls(torch.zeros(pre, dtype=dtype, device=device), torch.zeros(pre, dtype=dtype, device=device),
                   torch.zeros(suf, dtype=dtype, device=device), torch.zeros(suf, dtype=dtype, device=device))

    @staticmethod
    def nbytes(*, layers: int, kv_heads: int, head_dim: int, tokens: int, dtype: torch.dtype) -> int:
        """Bytes of keys + values for ``tokens`` positions."""
        return 2 * layers * kv_heads * head_dim * tokens * torch.empty((), dtype=dtype).element_size()


@dataclass
class PrefillMeta:
    cache: KVCache
    prompt_slots: torch.Tensor  # [Pn] long: prefix-store entry of each prompt of the batch


@dataclass
class DecodeMeta:
    cache: KVCache
    prefix_index: torch.Tensor  # [B] long: prefix-store entry of each slot's prompt
    prefix_len: torch.Tensor  # [B] long: prompt length
    write_index: torch.Tensor  # [B] long: where this step's key/value goes in the slot store
    use_triton: bool = False
    members: torch.Tensor | None = None  # [P, G] long: slots reading each prefix entry (−1: none); Triton only
    entry_len: torch.Tensor | None = None  # [P] long: prompt length of each prefix entry
    suffix_len: torch.Tensor = field(init=False)  # [B] valid slot-store keys after this step's write

    def __post_init__(self):
        self.suffix_len = self.write_index + 1  # once a step, not once a layer


def decode_attention_reference(q, k_pre, v_pre, prefix_index, prefix_len, k_suf, v_suf, suffix_len, scale,
                               members=None, prompt_len=None):
    """Plain PyTorch decode attention. q [B, Hq, D]; k_pre/v_pre [P, Hkv, Lp, D]; k_suf/v_suf [≥B, Hkv, T, D];
    prefix_index, prefix_len, suffix_len [B] (suffix_len: valid slot-store keys). Returns [B, Hq, D].

    With members [P, G] (slots of each prefix entry, −1: none) and prompt_len [P], the prefix of each slot is
    found through that table, as the grouped Triton kernel finds it (a slot listed nowhere has no prefix)."""
    B, Hq, D = q.shape
    if members is not None:
        listed = members >= 0
        if bool((members[listed] >= B).any()):
            raise RuntimeError("prefix table lists a slot outside the decode batch")
        entry = torch.full((B,), -1, dtype=torch.long, device=q.device)
        entry[members[listed]] = torch.nonzero(listed)[:, 0]
        prefix_index = entry.clamp(min=0)
        prefix_len = torch.where(entry >= 0, prompt_len[prefix_index], torch.zeros_like(prefix_index))
    Hkv, Lp, T = k_pre.shape[1], k_pre.shape[2], k_suf.shape[2]
    k = torch.cat([k_pre[prefix_index], k_suf[:B]], dim=2).float()  # [B, Hkv, Lp + T, D]
    v = torch.cat([v_pre[prefix_index], v_suf[:B]], dim=2).float()
    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    scores = torch.einsum("bhrd,bhtd->bhrt", qg, k) * scale  # [B, Hkv, rep, Lp + T]
    pos_pre = torch.arange(Lp, device=q.device)
    pos_suf = torch.arange(T, device=q.device)
    valid = torch.cat([pos_pre[None] < prefix_len[:, None], pos_suf[None] < suffix_len[:, None]], dim=1)  # [B, Lp+T]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bhrt,bhtd->bhrd", torch.softmax(scores, dim=-1), v)
    return out.reshape(B, Hq, D).to(q.dtype)


def sampler_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function: query [B, Hq, q, D], key/value [B, Hkv, q, D] →
    ([B, q, Hq, D], None)."""
    meta = kwargs.get("longrl_kv")
    if meta is None:
        raise RuntimeError("the longrl_sampler attention runs only inside longrl's sampler")
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache = meta.cache
    if isinstance(meta, PrefillMeta):
        width = key.shape[2]
        cache.k_pre[layer, meta.prompt_slots, :, :width] = key.to(cache.k_pre.dtype)
        cache.v_pre[layer, meta.prompt_slots, :, :width] = value.to(cache.v_pre.dtype)
        # right-padded rows: causal attention is exact for every real position (padding only follows it)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2), None
    B = query.shape[0]
    rows = torch.arange(B, device=query.device)
    k_suf, v_suf = cache.k_suf[layer], cache.v_suf[layer]
    k_suf[rows, :, meta.write_index] = key[:, :, 0].to(k_suf.dtype)  # [B, Hkv, D] into [S, Hkv, T, D]
    v_suf[rows, :, meta.write_index] = value[:, :, 0].to(v_suf.dtype)
    out = decode_attend(query[:, :, 0], layer, meta, scale)
    return out.to(query.dtype)[:, None], None  # [B, 1, Hq, D]


def decode_attend(q: torch.Tensor, layer: int, meta: DecodeMeta, scale: float) -> torch.Tensor:
    """Attention of each sequence's new query q [B, Hq, D] over its prompt prefix and its slot-store keys (this
    step's key already written at write_index): [B, Hq, D]."""
    cache = meta.cache
    args = (q.to(cache.k_suf.dtype), cache.k_pre[layer], cache.v_pre[layer], meta.prefix_index, meta.prefix_len,
            cache.k_suf[layer], cache.v_suf[layer], meta.suffix_len, scale)
    if meta.use_triton:
        from .decode_kernel import decode_attention_triton

        return decode_attention_triton(*args, members=meta.members, prompt_len=meta.entry_len)
    return decode_attention_reference(*args, members=meta.members, prompt_len=meta.entry_len)


def register_sampler_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(SAMPLER_ATTENTION, sampler_attention)


def unsupported_reason(config, max_length: int) -> str | None:
    """Why the sampler's attention cannot run this architecture exactly up to ``max_length`` tokens (None: it can)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(cfg, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and window < max_length:
        return f"sliding-window attention (window {window} < {max_length} tokens)"
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder models"
    return None
