"""A decode step of a Llama-family model (Llama, Mistral, Qwen2, Qwen3) with its elementwise glue fused.

The sampler's decode step is one token per sequence, so a decoder layer's cost outside its matrix products is
the number of kernels it launches. This runs the same computation as transformers' decoder layers for one
position per sequence, calling the model's own modules for everything with weights (the projections, so LoRA
adapters, fused or PEFT's, and 4-bit bases work unchanged; the embedding; the rotary embedding module, so every
RoPE scaling type is transformers' own) and :mod:`longrl.rollout.fused_ops` for the rest:

    h = embed(ids)
    per layer:  h, x = add_rmsnorm(h, δ)            q, k, v = q_proj(x), k_proj(x), v_proj(x)
                q = rotary_kv(q, k, v → cache)        δ = o_proj(attention(q, cache))
                h, x = add_rmsnorm(h, δ)              δ = down_proj(silu_mul(gate_proj(x), up_proj(x)))
    x = final_norm(h + δ)

It is used only for decode steps, only for the architectures above with a SiLU MLP, and only when the sampler
can run the model at all (prefill keeps transformers' forward). tests/test_fast_decode.py checks it against
transformers' forward for each architecture.
"""

from __future__ import annotations

import torch

from .attention import DecodeMeta, decode_attend
from .fused_ops import add_rmsnorm, rotary_kv, silu_mul

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def unsupported_reason(causal_lm) -> str | None:
    """Why :class:`FastDecoder` cannot run this transformers model (None: it can)."""
    name = type(causal_lm).__name__
    if name not in SUPPORTED:
        return f"architecture {name}"
    cfg = causal_lm.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act}"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp"
    body = getattr(causal_lm, "model", None)
    if body is None or not all(hasattr(body, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "an unexpected module layout"
    return None


class FastDecoder:
    """``FastDecoder(causal_lm)(ids [B], positions [B], meta) → final hidden states [B, d]``; Triton kernels when
    ``meta.use_triton``, their PyTorch twins otherwise."""

    def __init__(self, causal_lm):
        self.body = causal_lm.model
        self.layers = list(self.body.layers[: causal_lm.config.num_hidden_layers])
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")

    @staticmethod
    def build(causal_lm) -> "FastDecoder | None":
        return None if unsupported_reason(causal_lm) else FastDecoder(causal_lm)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMeta) -> torch.Tensor:
        tri, cache = meta.use_triton, meta.cache
        h = self.body.embed_tokens(ids)  # [B, d]
        cos, sin = self.body.rotary_emb(h[:, None], positions[:, None])  # [B, 1, D] each
        cos, sin = cos[:, 0], sin[:, 0]
        delta = None
        for i, layer in enumerate(self.layers):
            norm = layer.input_layernorm
            h, x = add_rmsnorm(h, delta, norm.weight, norm.variance_epsilon, tri)
            attn = layer.self_attn
            qk_norms = (attn.q_norm.weight, attn.k_norm.weight) if self.qk_norm else (None, None)
            q = rotary_kv(attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), cos, sin, cache.k_suf[i], cache.v_suf[i],
                          meta.write_index, tri, *qk_norms,
                          eps=attn.q_norm.variance_epsilon if self.qk_norm else 1e-6)  # [B, Hq, D]
            out = decode_attend(q, i, meta, attn.scaling).to(q.dtype)  # [B, Hq, D]
            delta = attn.o_proj(out.reshape(out.shape[0], -1))
            norm = layer.post_attention_layernorm
            h, x = add_rmsnorm(h, delta, norm.weight, norm.variance_epsilon, tri)
            mlp = layer.mlp
            delta = mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x), tri))
        norm = self.body.norm
        return add_rmsnorm(h, delta, norm.weight, norm.variance_epsilon, tri)[1]
