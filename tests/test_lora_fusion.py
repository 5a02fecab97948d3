"""Rollout-time fused LoRA (rollout/lora_fusion.py) against PEFT's own forward."""

from __future__ import annotations

import peft
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from longrl.config.schema import LoraConfig
from longrl.models import apply_lora
from longrl.models.lora_layers import fusable_reason
from longrl.rollout import Sampler, SamplingParams, lora_fusion
from longrl.rollout.lora_fusion import fused_lora


def llama(seed: int, layers: int = 3):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def randomise_adapters(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT starts B at zero; make every adapter matter
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj", "down_proj"], ["k_proj"]])
def test_fused_forward_equals_peft(targets):
    model = apply_lora(llama(0), LoraConfig(r=5, alpha=7.0, target_modules=targets))
    randomise_adapters(model, 1)
    ids = torch.randint(0, 97, (3, 11))  # odd shapes: batch 3, 11 tokens, r 5
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with fused_lora(model, torch.float32) as fused:
            got = model(input_ids=ids).logits
            hooks = sum(len(m._forward_hooks) for m in model.modules())
            inside = model.get_model_status().enabled  # PEFT's own adapters switched off (the hooks add them)
        after = model(input_ids=ids).logits
    assert fused and inside is False and model.get_model_status().enabled is True
    adapted = sum(1 for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer))
    assert hooks == adapted  # one delta per adapted projection
    with torch.no_grad():
        base = model.get_base_model()
        with model.disable_adapter():
            plain = base(input_ids=ids).logits
    assert (want - plain).abs().max() > 1e-2  # the adapters change the output, so equality below means something
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(after, want)  # hooks gone, adapters back on
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_siblings_share_one_product(monkeypatch):
    model = apply_lora(llama(2, layers=2), LoraConfig(r=4, alpha=8.0))
    randomise_adapters(model, 3)
    groups = []
    real_group = lora_fusion._Group

    def spy(*a, **k):
        groups.append(real_group(*a, **k))
        return groups[-1]

    monkeypatch.setattr(lora_fusion, "_Group", spy)
    with torch.no_grad(), fused_lora(model, torch.float32):
        model(input_ids=torch.randint(0, 97, (2, 7)))
    widths = sorted(g.a_t.shape[1] for g in groups)
    # per layer: q/k/v stacked (3r), gate/up (2r), o and down alone (r each)
    assert widths == sorted([12, 8, 4, 4] * 2)
    assert sorted(g.reused for g in groups) == sorted([2, 1, 0, 0] * 2)


def test_variants_step_aside_and_peft_runs():
    model = llama(4)
    dora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True))
    assert "DoRA" in fusable_reason(dora)
    with fused_lora(dora, torch.float32) as fused:
        assert not fused
        assert all(not m._forward_hooks for m in dora.modules())


@pytest.mark.parametrize("seed", [0, 1])
def test_sampler_fused_equals_unfused(seed):
    model = apply_lora(llama(seed), LoraConfig(r=6, alpha=12.0))
    randomise_adapters(model, seed + 10)
    prompts = [[1, 5, 6, 7, 9], [2, 8], [3, 4, 4, 4, 4, 4, 5, 11, 12]]
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=seed)
    runs = []
    for fuse in (True, False):
        sampler = Sampler(model, None, fuse_lora=fuse, sync_every=4)
        runs.append(sampler.generate(prompts, 3, params))
        assert sampler.last_stats["lora_fused"] is fuse
    assert runs[0].completion_ids == runs[1].completion_ids
    torch.testing.assert_close(torch.tensor(sum(runs[0].logprobs, [])), torch.tensor(sum(runs[1].logprobs, [])),
                               atol=1e-5, rtol=1e-5)


def test_embedding_adapters_keep_pefts_forward():
    """An adapter fusion cannot take (here on the embedding) keeps PEFT's forward for the whole model, since
    disabling adapters would drop it too."""
    model = apply_lora(llama(6), LoraConfig(r=4, alpha=8.0, target_modules=["embed_tokens", "q_proj"]))
    randomise_adapters(model, 7)
    assert "not a linear adapter" in fusable_reason(model)
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with fused_lora(model, torch.float32) as fused:
            got = model(input_ids=ids).logits
    assert not fused and torch.equal(got, want)


def test_a_failure_while_fusing_leaves_no_hook(monkeypatch):
    """Out of memory (say) while the adapters are being stacked: every hook installed so far is removed, so
    PEFT's own forward is not doubled by leftover deltas afterwards."""
    model = apply_lora(llama(4, layers=2), LoraConfig(r=3, alpha=6.0))
    randomise_adapters(model, 5)
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    real_group, built = lora_fusion._Group, []

    def failing(*a, **k):
        if len(built) == 2:
            raise torch.OutOfMemoryError("simulated")
        built.append(real_group(*a, **k))
        return built[-1]

    monkeypatch.setattr(lora_fusion, "_Group", failing)
    with pytest.raises(torch.OutOfMemoryError), torch.no_grad(), fused_lora(model, torch.float32):
        pass
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)


def test_inside_disable_adapter_nothing_is_fused():
    model = apply_lora(llama(6, layers=2), LoraConfig(r=3, alpha=6.0))
    randomise_adapters(model, 7)
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=ids).logits
        with fused_lora(model, torch.float32) as fused:
            got = model(input_ids=ids).logits
    assert not fused and torch.equal(got, base)
