"""The attention whose backward runs per key head (ops/grouped_attention.py) against PyTorch's SDPA: outputs and
gradients bit for bit on the CPU's flash kernels, for odd shapes and several groupings; the transformers attention
function takes the path exactly where it should; a tiny grouped-query Llama trains to the same gradients."""

import pytest
import torch

from longrl.ops import grouped_attention as ga


def _qkv(B, Hq, Hkv, T, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # the layout transformers hands SDPA: projections [B, T, H, D] viewed as [B, H, T, D]
    mk = lambda h: torch.randn(B, T, h, D, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv)


@pytest.mark.parametrize("B, Hq, Hkv, T, D, dtype", [(1, 8, 2, 37, 16, torch.float32),
                                                     (2, 6, 3, 129, 24, torch.float64),
                                                     (3, 4, 1, 300, 8, torch.bfloat16),
                                                     (1, 12, 4, 1, 32, torch.float32),
                                                     (2, 4, 4, 65, 16, torch.float32)])
def test_grouped_backward_equals_sdpa_bit_for_bit(B, Hq, Hkv, T, D, dtype):
    """o and (dq, dk, dv) of GroupedBackwardAttention equal SDPA's (enable_gqa, causal) exactly: each query head's
    gradient and each key head's sum over its group come from the same kernel on the same numbers."""
    q, k, v = _qkv(B, Hq, Hkv, T, D, dtype, seed=T)
    scale = D ** -0.5 * 1.3
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    do = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    out = ga.GroupedBackwardAttention.apply(q, k, v, scale)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert torch.equal(out, ref)
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and torch.equal(got, want)


def test_attention_function_takes_the_grouped_path_only_where_it_applies(monkeypatch):
    """grouped_sdpa_attention: the grouped Function for causal, unmasked, dropout-free grouped-query calls of at
    least MIN_TOKENS query tokens with no argument that changes the attention (with or without gradient: both
    forwards of a checkpointed layer run the same kernel call); transformers' SDPA function otherwise (a position
    bias applied, a softcap refused, as it does); the same output either way, [B, T, Hq, D]."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []
    real = ga.GroupedBackwardAttention.apply
    monkeypatch.setattr(ga.GroupedBackwardAttention, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(ga, "MIN_TOKENS", 64)
    module = SimpleNamespace(is_causal=True, num_key_value_groups=2, training=True)
    q, k, v = _qkv(2, 4, 2, 40, 8, torch.float32, seed=1)
    ref, _ = sdpa_attention_forward(module, q, k, v, None)
    cases = [((q, k, v, None), {}, True),  # 80 tokens ≥ 64
             ((q[:1], k[:1], v[:1], None), {}, False),  # 40 tokens < 64
             ((q, k, v, None), {"dropout": 0.1}, False),
             ((q, k, v, torch.ones(2, 1, 40, 40, dtype=torch.bool)), {}, False),  # a mask
             ((q, torch.cat([k, k], 1), torch.cat([v, v], 1), None), {}, False),  # as many key heads as query heads
             ((q, k, v, None), {"position_ids": torch.arange(40)[None], "use_cache": False}, True),  # neutral
             ((q, k, v, None), {"position_bias": torch.randn(1, 4, 40, 40)}, False),  # changes the attention
             ((q, k, v, None), {"s_aux": torch.randn(4)}, False)]
    for args, kw, grouped in cases:
        calls.clear()
        torch.manual_seed(0)
        out, _ = ga.grouped_sdpa_attention(module, *args, **kw)
        assert bool(calls) == grouped, (kw, args[0].shape, args[1].shape)
        assert out.shape == (args[0].shape[0], args[0].shape[2], args[0].shape[1], args[0].shape[3])
    out, _ = ga.grouped_sdpa_attention(module, q, k, v, None)
    assert torch.equal(out, ref)
    bias = torch.randn(1, 4, 40, 40)  # a position bias is SDPA's (transformers' function), not dropped
    assert torch.equal(ga.grouped_sdpa_attention(module, q, k, v, None, position_bias=bias)[0],
                       sdpa_attention_forward(module, q, k, v, None, position_bias=bias)[0])
    try:  # a softcap goes to transformers' SDPA function: refused as it refuses it (≥ 5.2x), never dropped by us
        theirs = sdpa_attention_forward(module, q, k, v, None, softcap=50.0)[0]
    except ValueError:
        with pytest.raises(ValueError, match="softcap"):
            ga.grouped_sdpa_attention(module, q, k, v, None, softcap=50.0)
    else:
        assert calls.clear() or torch.equal(ga.grouped_sdpa_attention(module, q, k, v, None, softcap=50.0)[0], theirs)
        assert not calls
    with torch.no_grad():
        calls.clear()
        assert torch.equal(ga.grouped_sdpa_attention(module, q, k, v, None)[0], ref) and calls


@pytest.mark.parametrize("reuse", [False, True])
def test_a_grouped_query_model_trains_to_the_same_gradients(monkeypatch, reuse):
    """A tiny Llama (4 query, 2 key heads) with LoRA: loss and every LoRA gradient through longrl_sdpa_grouped,
    with offloaded checkpointing as training runs it (and with attention reuse, whose replay must meet the same
    kernel call in the recompute), equal SDPA's bit for bit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from longrl.config.schema import LoraConfig
    from longrl.memory import enable_offloaded_checkpointing
    from longrl.models import apply_lora

    monkeypatch.setattr(ga, "MIN_TOKENS", 16)
    calls = []
    real = ga.GroupedBackwardAttention.apply
    monkeypatch.setattr(ga.GroupedBackwardAttention, "apply", lambda *a: calls.append(1) or real(*a))
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = apply_lora(LlamaForCausalLM(cfg), LoraConfig(r=4, dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    enable_offloaded_checkpointing(model, gpu_resident=0, reuse_attention=reuse)
    ids = torch.randint(1, 61, (2, 23), generator=torch.Generator().manual_seed(3))

    def grads():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_a, g_a = grads()
    assert not calls
    with ga.grouped_backward(model):
        assert model.get_base_model().config._attn_implementation == ga.GROUPED_SDPA
        loss_b, g_b = grads()
    assert len(calls) == 2 * 2  # each layer's forward and recompute (reuse: the recompute's kernel call replayed)
    assert model.get_base_model().config._attn_implementation == "sdpa"
    assert torch.equal(loss_a, loss_b)
    assert g_a.keys() == g_b.keys() and len(g_a) > 0
    for n in g_a:
        assert torch.equal(g_a[n], g_b[n]), n
