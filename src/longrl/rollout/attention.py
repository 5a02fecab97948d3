"""The sampler's attention, plugged into transformers through its public ``AttentionInterface``.

While the sampler runs, the model's attention implementation is switched to ``longrl_sampler`` (and back
afterwards). transformers computes q, k, v and the rotary embedding as usual and hands them to
:func:`sampler_attention`, together with the sampler's metadata (passed as the ``longrl_kv`` keyword through
the model's ``**kwargs``). The KV cache lives here, not in a transformers ``Cache``:

    prefix store  K_pre, V_pre: [L, P, Hkv, Lp, D]   one entry per prompt, shared by its G completions
    slot store    K_suf, V_suf: [L, S, Hkv, T, D]    one entry per decoding sequence (its own tokens)

(an FP8 cache keeps its values position-minor, V_pre [L, P, Hkv, D, Lp'] and V_suf [L, S, Hkv, D, T']: kv_quant.py)

Prefill runs a right-padded batch of prompts with causal SDPA (with the prompts' image-block mask where a
family's image tokens attend both ways, Gemma 3) and writes their keys/values into the prefix store. A decode step writes each sequence's new key/value at its slot and attends over
prefix[:prefix_len] ++ suffix[:write_index + 1] (an extend step, between the turns of a multi-turn rollout, does the
same for several new tokens of a slot at once, causally):

    o = softmax(q Kᵀ · scale) V      over those keys (GQA: query head h reads key head h // (Hq / Hkv))
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kv_quant import FP8, dequantize, dequantize_values, quantize_reference, store_decode, store_rows, value_capacity
from .merge_counters import merge_counters

SAMPLER_ATTENTION = "longrl_sampler"


@dataclass
class KVCache:
    k_pre: torch.Tensor  # [L, P, Hkv, Lp, D]
    v_pre: torch.Tensor  # [L, P, Hkv, Lp, D]; FP8: position-minor [L, P, Hkv, D, Lp'] (kv_quant.value_capacity)
    k_suf: torch.Tensor  # [L, S, Hkv, T, D]
    v_suf: torch.Tensor  # [L, S, Hkv, T, D]; FP8: [L, S, Hkv, D, T']
    # FP8 caches (k_pre ... v_suf float8_e4m3fn): the int8 scale exponent of each position and key head
    # (rollout/kv_quant.py), and the decode step's keys/values before they are quantized into the slot store
    k_pre_e: torch.Tensor | None = None  # [L, P, Hkv, Lp]
    v_pre_e: torch.Tensor | None = None
    k_suf_e: torch.Tensor | None = None  # [L, S, Hkv, T]
    v_suf_e: torch.Tensor | None = None
    k_stage: torch.Tensor | None = None  # [S, Hkv, 1, D] in the compute dtype
    v_stage: torch.Tensor | None = None
    stage_index: torch.Tensor | None = None  # [S] long zeros: position 0 of the stage
    # int32 [S · Hkv] at rest: the Triton decode attention's merge counters, kept from call to call (each call leaves
    # them at rest; rollout/merge_counters.py, decode_kernel.decode_attention_triton's ``counters``)
    counters: torch.Tensor | None = None

    @classmethod
    def allocate(cls, *, layers: int, kv_heads: int, head_dim: int, prefix_slots: int, prefix_len: int, slots: int,
                 suffix_len: int, dtype: torch.dtype, device, compute_dtype: torch.dtype | None = None) -> "KVCache":
        """Zeroed stores; ``dtype`` float8_e4m3fn adds the scale exponents and the stage (``compute_dtype``), and
        keeps the values position-minor."""
        pre = (layers, prefix_slots, kv_heads, prefix_len, head_dim)
        suf = (layers, slots, kv_heads, suffix_len, head_dim)
        v_pre, v_suf = pre, suf
        if dtype == FP8:
            v_pre = (*pre[:3], head_dim, value_capacity(prefix_len))
            v_suf = (*suf[:3], head_dim, value_capacity(suffix_len))
        cache = cls(torch.zeros(pre, dtype=dtype, device=device), torch.zeros(v_pre, dtype=dtype, device=device),
                    torch.zeros(suf, dtype=dtype, device=device), torch.zeros(v_suf, dtype=dtype, device=device))
        cache.counters = merge_counters(slots * kv_heads, device)
        if dtype == FP8:
            exp = dict(dtype=torch.int8, device=device)
            cache.k_pre_e, cache.v_pre_e = torch.zeros(pre[:-1], **exp), torch.zeros(pre[:-1], **exp)
            cache.k_suf_e, cache.v_suf_e = torch.zeros(suf[:-1], **exp), torch.zeros(suf[:-1], **exp)
            stage = dict(dtype=compute_dtype or torch.bfloat16, device=device)
            cache.k_stage = torch.zeros(slots, kv_heads, 1, head_dim, **stage)
            cache.v_stage = torch.zeros(slots, kv_heads, 1, head_dim, **stage)
            cache.stage_index = torch.zeros(slots, dtype=torch.long, device=device)
        return cache

    @property
    def fp8(self) -> bool:
        return self.k_suf_e is not None

    def slot_tensors(self) -> list[torch.Tensor]:
        """The per-slot stores [L, S, ...] (what moves with a slot; FP8 codes as their bytes, which every indexing
        kernel handles)."""
        return [t.view(torch.uint8) if t.dtype == FP8 else t
                for t in (self.k_suf, self.v_suf, self.k_suf_e, self.v_suf_e) if t is not None]

    def compact_slots(self, src: torch.Tensor) -> None:
        """Move the slot stores of slots ``src`` [n] (ascending) to slots 0 … n−1 (the sampler's compaction)."""
        dst = torch.arange(len(src), device=src.device)
        for buf in self.slot_tensors():
            buf[:, dst] = buf[:, src]

    def layer_exp(self, layer: int):
        """(k_pre_e, v_pre_e, k_suf_e, v_suf_e) of ``layer``; None for a 16-bit or float32 cache."""
        if not self.fp8:
            return None
        return self.k_pre_e[layer], self.v_pre_e[layer], self.k_suf_e[layer], self.v_suf_e[layer]

    def nbytes_held(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if t is not None)

    def write_prefix(self, layer: int, entries: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """key/value [Pn, Hkv, W, D] into positions [0, W) of prefix entries ``entries`` [Pn]."""
        width = key.shape[2]
        if not self.fp8:
            self.k_pre[layer, entries, :, :width] = key.to(self.k_pre.dtype)
            self.v_pre[layer, entries, :, :width] = value.to(self.v_pre.dtype)
            return
        (kq, ke), (vq, ve) = quantize_reference(key), quantize_reference(value)
        self.k_pre[layer, entries, :, :width] = kq
        self.v_pre[layer, entries, :, :, :width] = vq.transpose(-1, -2)  # position-minor
        self.k_pre_e[layer, entries, :, :width] = ke
        self.v_pre_e[layer, entries, :, :width] = ve

    def write_decode(self, layer: int, key: torch.Tensor, value: torch.Tensor, write_index: torch.Tensor,
                     use_triton: bool, slots: torch.Tensor | None = None) -> None:
        """key/value [B, Hkv, D] of slots 0..B−1 (or of slots [B]: a verify step's virtual rows) at their
        write_index [B]."""
        if not self.fp8:
            rows = torch.arange(key.shape[0], device=key.device) if slots is None else slots
            self.k_suf[layer][rows, :, write_index] = key.to(self.k_suf.dtype)  # [B, Hkv, D] into [S, Hkv, T, D]
            self.v_suf[layer][rows, :, write_index] = value.to(self.v_suf.dtype)
            return
        store_decode(key, value, self.k_suf[layer], self.v_suf[layer], self.k_suf_e[layer], self.v_suf_e[layer],
                     write_index, use_triton, slots)

    def write_rows(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor) -> None:
        """key/value [M, Hkv, D] at slot-store (slots[m], positions[m]) [M] (an extend step's new tokens)."""
        if not self.fp8:
            self.k_suf[layer][slots, :, positions] = key.to(self.k_suf.dtype)
            self.v_suf[layer][slots, :, positions] = value.to(self.v_suf.dtype)
            return
        store_rows(key, value, self.k_suf[layer], self.v_suf[layer], self.k_suf_e[layer], self.v_suf_e[layer], slots,
                   positions)

    @staticmethod
    def nbytes(*, layers: int, kv_heads: int, head_dim: int, tokens: int, dtype: torch.dtype) -> int:
        """Bytes of keys + values for ``tokens`` positions (FP8: one byte an element and one a position and head;
        a value store's capacity padding is counted apart: planner.rollout_kv_bytes)."""
        if dtype == FP8:
            return 2 * layers * kv_heads * (head_dim + 1) * tokens
        return 2 * layers * kv_heads * head_dim * tokens * torch.empty((), dtype=dtype).element_size()


@dataclass
class PrefillMeta:
    cache: KVCache
    prompt_slots: torch.Tensor  # [Pn] long: prefix-store entry of each prompt of the batch
    # [Pn, 1, W, W] bool: which keys each query attends to, where a family's image tokens attend both ways
    # (models/vision/masks.py image_block_mask); None: causal
    mask: torch.Tensor | None = None


@dataclass
class DecodeMeta:
    cache: KVCache
    prefix_index: torch.Tensor  # [B] long: prefix-store entry of each slot's prompt
    prefix_len: torch.Tensor  # [B] long: prompt length
    write_index: torch.Tensor  # [B] long: where this step's key/value goes in the slot store
    use_triton: bool = False
    members: torch.Tensor | None = None  # [P, G] long: slots reading each prefix entry (−1: none); Triton only
    entry_len: torch.Tensor | None = None  # [P] long: prompt length of each prefix entry
    # [B] long: the slot of each row; None: row b is slot b. A verify step's virtual rows (verify_meta): row
    # b·(k+1) + i is query i of slot b, at write_index[b] + i, reading slot b's store up to it
    slots: torch.Tensor | None = None
    suffix_len: torch.Tensor = field(init=False)  # [B] valid slot-store keys after this step's write

    def __post_init__(self):  # once a step, not once a layer
        # the kernels read row b of each at base + b: unit stride (a no-op for the sampler's own rows; a verify
        # step's rows of one slot, a flattened expand, would be a stride-0 view read past its one element)
        for name in ("prefix_index", "prefix_len", "write_index", "slots"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).contiguous())
        self.suffix_len = self.write_index + 1


def verify_meta(cache: KVCache, prefix_index: torch.Tensor, prefix_len: torch.Tensor, write_index: torch.Tensor,
                width: int, use_triton: bool, members: torch.Tensor | None = None,
                entry_len: torch.Tensor | None = None) -> DecodeMeta:
    """A verify step of ``width`` = k + 1 positions a slot over slots 0 … B−1 as a decode step of B·width virtual
    rows: row b·width + i is slot b's query at slot-store index w_bi = min(write_index[b] + i, T − 1) (its key/value
    written there; it reads its prompt's prefix and the store's keys [0, w_bi], causal by length). prefix_index,
    prefix_len, write_index [B]; members [P, G] → [P, G·width] (virtual rows of the members). The clamp at T − 1
    touches only padding queries: a real draft sits below the turn's last index, whose key nothing reads."""
    i = torch.arange(width, device=write_index.device)
    T = cache.k_suf.shape[3]
    B = len(write_index)

    def each(x):  # [B] → [B·width], each entry repeated width times (no host sync: capturable; DecodeMeta copies
        return x[:, None].expand(B, width).flatten()  # it to unit stride where B = 1 leaves a stride-0 view)
    index = (write_index[:, None] + i[None]).clamp(max=T - 1).flatten()  # [B·width]
    if members is not None:
        members = torch.where(members[:, :, None] >= 0, members[:, :, None] * width + i, -1).flatten(1)
    return DecodeMeta(cache, each(prefix_index), each(prefix_len), index, use_triton, members, entry_len,
                      each(torch.arange(B, device=write_index.device)))


@dataclass
class ExtendMeta:
    """New tokens of some slots (a turn's last token + its environment's tokens), prefilled onto their own cache."""
    cache: KVCache
    slots: torch.Tensor  # [B] long: slot of each row
    prefix_index: torch.Tensor  # [B] long
    prefix_len: torch.Tensor  # [B] long
    start: torch.Tensor  # [B] long: slot-store index of each row's first new token
    lengths: torch.Tensor  # [B] long: new tokens of each row (the rest of the row is padding)
    # [B, n] long: the image block of each new token (−1: text), where a family's image tokens attend to the
    # others of their block both ways (Gemma 3; models/vision/masks.py); None: causal
    blocks: torch.Tensor | None = None


def extend_attention(query, key, value, layer: int, meta: ExtendMeta, scale: float) -> torch.Tensor:
    """Write the rows' new keys/values at slot-store indices start .. start + lengths − 1 and attend each new query
    over its prompt prefix and the slot store up to its own index (causal; with ``meta.blocks``, and the rest of its
    image block). query [B, Hq, n, D], key/value
    [B, Hkv, n, D] → [B, n, Hq, D]. Padding queries attend too (their outputs are never read; nothing is written)."""
    cache = meta.cache
    B, _, n, _ = query.shape
    k_suf, v_suf = cache.k_suf[layer], cache.v_suf[layer]
    i = torch.arange(n, device=query.device)
    valid = i[None] < meta.lengths[:, None]  # [B, n]
    q_index = meta.start[:, None] + i[None]  # [B, n] slot-store index of each query
    rows, cols = meta.slots[:, None].expand(B, n)[valid], q_index[valid]
    cache.write_rows(layer, rows, cols, key.transpose(1, 2)[valid], value.transpose(1, 2)[valid])  # [M, Hkv, D]
    stores = [cache.k_pre[layer][meta.prefix_index], k_suf[meta.slots], cache.v_pre[layer][meta.prefix_index],
              v_suf[meta.slots]]
    if cache.fp8:
        k_pre_e, v_pre_e, k_suf_e, v_suf_e = cache.layer_exp(layer)
        exps = [k_pre_e[meta.prefix_index], k_suf_e[meta.slots], v_pre_e[meta.prefix_index], v_suf_e[meta.slots]]
        stores = [dequantize(stores[0], exps[0]), dequantize(stores[1], exps[1]),
                  dequantize_values(stores[2], exps[2]), dequantize_values(stores[3], exps[3])]  # keys, then values
    k = torch.cat(stores[:2], dim=2).to(query.dtype)  # [B, Hkv, Lp + T, D]
    v = torch.cat(stores[2:], dim=2).to(query.dtype)
    Lp, T = cache.k_pre.shape[3], k_suf.shape[2]
    in_prefix = (torch.arange(Lp, device=query.device)[None] < meta.prefix_len[:, None])[:, None].expand(B, n, Lp)
    in_suffix = torch.arange(T, device=query.device)[None, None] <= q_index[:, :, None]  # [B, n, T]
    if meta.blocks is not None:  # a new token also sees the later new tokens of its image block
        new = torch.arange(T, device=query.device)[None] - meta.start[:, None]  # [B, T]: new-token index of a key
        key_block = torch.where((new >= 0) & (new < n), meta.blocks.gather(1, new.clamp(0, n - 1)), -1)  # [B, T]
        in_suffix = in_suffix | ((key_block[:, None, :] == meta.blocks[:, :, None]) & (meta.blocks[:, :, None] >= 0))
    mask = torch.cat([in_prefix, in_suffix], dim=-1)[:, None]  # [B, 1, n, Lp + T]
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


def decode_attention_reference(q, k_pre, v_pre, prefix_index, prefix_len, k_suf, v_suf, suffix_len, scale,
                               members=None, prompt_len=None, kv_exp=None, slots=None):
    """Plain PyTorch decode attention. q [B, Hq, D]; k_pre/v_pre [P, Hkv, Lp, D]; k_suf/v_suf [≥B, Hkv, T, D];
    prefix_index, prefix_len, suffix_len [B] (suffix_len: valid slot-store keys). Returns [B, Hq, D]. slots [B]:
    row b reads slot slots[b]'s store (else slot b's).

    With members [P, G] (slots of each prefix entry, −1: none) and prompt_len [P], the prefix of each slot is
    found through that table, as the grouped Triton kernel finds it (a slot listed nowhere has no prefix).
    kv_exp (k_pre_e, v_pre_e, k_suf_e, v_suf_e): an FP8 cache, its values position-minor (v_pre [P, Hkv, D, Lp'],
    v_suf [≥B, Hkv, D, T'], kv_quant.quantize_values), dequantized first."""
    if kv_exp is not None:
        k_pre_e, v_pre_e, k_suf_e, v_suf_e = kv_exp
        k_pre, k_suf = dequantize(k_pre, k_pre_e), dequantize(k_suf, k_suf_e)
        v_pre, v_suf = dequantize_values(v_pre, v_pre_e), dequantize_values(v_suf, v_suf_e)
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
    rows = slice(0, B) if slots is None else slots
    k = torch.cat([k_pre[prefix_index], k_suf[rows]], dim=2).float()  # [B, Hkv, Lp + T, D]
    v = torch.cat([v_pre[prefix_index], v_suf[rows]], dim=2).float()
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
        cache.write_prefix(layer, meta.prompt_slots, key, value)
        # right-padded rows: causal attention (or the image-block mask) is exact for every real position (padding
        # only follows it)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=meta.mask, is_causal=meta.mask is None,
                                             scale=scale, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2), None
    if isinstance(meta, ExtendMeta):
        return extend_attention(query, key, value, layer, meta, scale), None
    cache.write_decode(layer, key[:, :, 0], value[:, :, 0], meta.write_index, meta.use_triton, meta.slots)
    out = decode_attend(query[:, :, 0], layer, meta, scale)
    return out.to(query.dtype)[:, None], None  # [B, 1, Hq, D]


def decode_attend(q: torch.Tensor, layer: int, meta: DecodeMeta, scale: float) -> torch.Tensor:
    """Attention of each sequence's new query q [B, Hq, D] over its prompt prefix and its slot-store keys (this
    step's key already written at write_index): [B, Hq, D]."""
    cache = meta.cache
    exp = cache.layer_exp(layer)
    args = (q if exp is not None else q.to(cache.k_suf.dtype), cache.k_pre[layer], cache.v_pre[layer],
            meta.prefix_index, meta.prefix_len, cache.k_suf[layer], cache.v_suf[layer], meta.suffix_len, scale)
    if meta.use_triton:
        from .decode_kernel import decode_attention_triton

        return decode_attention_triton(*args, members=meta.members, prompt_len=meta.entry_len, kv_exp=exp,
                                       slots=meta.slots, counters=cache.counters)
    return decode_attention_reference(*args, members=meta.members, prompt_len=meta.entry_len, kv_exp=exp,
                                      slots=meta.slots)


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
