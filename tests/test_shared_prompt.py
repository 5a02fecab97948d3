"""Grouped rows (train.shared_prompt): each prompt computed once for its completions.

The attention kernel (flash parts merged by log-sum-exp) against its plain twin (SDPA with the boolean mask) and the
twin against the definition (each prompt + completion attended on its own); then log-probs, entropies and gradients
of whole models on grouped rows against the repeated layout, float64, for Llama and Qwen2 heads, G = 1 and G > 1,
unequal completion lengths, packed and padded rows, full weights, LoRA and offloaded checkpointing."""

import pytest
import torch

from longrl.ops.shared_prompt_attention import (PromptGroup, SharedPromptAttention, SharedPromptLayout,
                                                reference_attention, shared_prompt_attention)

# (groups as (row, start, P, completions), rows, length): odd lengths, a single-token prompt and completion, a
# prompt alone, padding, and lengths that cross the CPU flash kernel's query blocks (32/64/256) and key block (512)
LAYOUTS = {
    "one": ([(0, 0, 1, (1,))], 1, 2),
    "odd": ([(0, 0, 13, (7, 1, 30))], 1, 51),
    "two-groups-packed": ([(0, 0, 5, (3, 9)), (0, 17, 11, (1, 2, 4, 6))], 1, 41),
    "padded-rows": ([(0, 0, 5, (3, 9)), (1, 0, 11, (1, 2, 4, 6)), (2, 0, 3, ())], 3, 26),
    "block-crossing": ([(0, 0, 300, (65, 257, 1))], 1, 623),
    "key-block-crossing": ([(0, 3, 700, (33, 129)), (1, 0, 517, (300,))], 2, 870),
}


def _layout(name) -> SharedPromptLayout:
    groups, rows, length = LAYOUTS[name]
    return SharedPromptLayout(tuple(PromptGroup(*g) for g in groups), rows, length)


def _qkv(layout, hq, hkv, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    # laid out as transformers hands them over: [B, L, H, D] in memory, viewed [B, H, L, D]
    mk = lambda h: (torch.randn(layout.rows, layout.length, h, D, generator=g, dtype=torch.float64) * 1.5  # noqa
                    ).to(dtype).transpose(1, 2).requires_grad_()
    return mk(hq), mk(hkv), mk(hkv)


def _value_and_grads(fn, q, k, v, layout, seed=1):
    out = fn(q, k, v, layout, 0.37)  # [B, L, Hq, D]
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    return out.detach(), grads


def test_mask_is_the_rule():
    """Query i sees key j: both in the prompt with j ≤ i, i in a completion and j in its prompt, or both in the same
    completion with j ≤ i; padding sees itself only. Positions continue from the prompt for every completion."""
    layout = _layout("padded-rows")
    mask = layout.mask()[:, 0]
    for b in range(layout.rows):
        segment = {}  # token → (group, part): part -1 the prompt, g the completion
        for n, grp in enumerate(layout.groups):
            if grp.row != b:
                continue
            for t in range(grp.start, grp.start + grp.prompt):
                segment[t] = (n, -1)
            for c, (s, r) in enumerate(zip(grp.completion_starts(), grp.completions)):
                for t in range(s, s + r):
                    segment[t] = (n, c)
        for i in range(layout.length):
            for j in range(layout.length):
                if i not in segment or j not in segment:
                    want = i == j and i not in segment
                else:
                    (gi, pi), (gj, pj) = segment[i], segment[j]
                    want = gi == gj and (pj == -1 and (pi != -1 or j <= i) or (pi == pj and j <= i))
                assert bool(mask[b, i, j]) == want, (b, i, j)
    pos = layout.positions()
    assert pos[0, :5].tolist() == [0, 1, 2, 3, 4] and pos[0, 5:8].tolist() == [5, 6, 7]
    assert pos[0, 8:17].tolist() == list(range(5, 14)) and pos[1, 11:12].tolist() == [11]
    assert pos[1, 12:14].tolist() == [11, 12] and pos[1, 18:24].tolist() == list(range(11, 17))
    assert pos[1, 24:].tolist() == [0, 0] and pos[2, :3].tolist() == [0, 1, 2]


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_twin_is_each_sequence_on_its_own(heads):
    """The twin on grouped rows gives every prompt token what causal attention over its prompt gives, and every
    completion token what causal attention over its own prompt + completion gives."""
    layout = _layout("two-groups-packed")
    q, k, v = _qkv(layout, *heads)
    out = reference_attention(q, k, v, layout, 0.37)
    for grp in layout.groups:
        b, p = grp.row, list(range(grp.start, grp.start + grp.prompt))
        for s, r in zip(grp.completion_starts(), grp.completions):
            idx = torch.tensor(p + list(range(s, s + r)))
            alone = torch.nn.functional.scaled_dot_product_attention(
                q[b:b + 1, :, idx], k[b:b + 1, :, idx], v[b:b + 1, :, idx], is_causal=True, scale=0.37,
                enable_gqa=heads[0] != heads[1]).transpose(1, 2)[0]
            torch.testing.assert_close(out[b, idx], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (3, 1)])
def test_kernel_equals_twin_float64(name, heads):
    """Output and dq, dk, dv of the flash parts against the masked SDPA twin, float64 on the CPU's flash kernels."""
    layout = _layout(name)
    q, k, v = _qkv(layout, *heads, seed=len(name))
    out, grads = _value_and_grads(SharedPromptAttention.apply, q, k, v, layout)
    ref, ref_grads = _value_and_grads(reference_attention, q, k, v, layout)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-11)
    for got, want, what in zip(grads, ref_grads, "qkv"):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-11, msg=lambda m: f"d{what}: {m}")
    padding = layout.padding()
    if padding.any():
        assert out[padding].abs().max() == 0 and grads[1].transpose(1, 2)[padding].abs().max() == 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_kernel_low_precision_close_to_float64(dtype, tol):
    layout = _layout("block-crossing")
    q, k, v = _qkv(layout, 4, 2, D=16, seed=3)
    ref, ref_grads = _value_and_grads(reference_attention, q, k, v, layout)
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, grads = _value_and_grads(shared_prompt_attention, *low, layout)
    assert out.dtype == dtype
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        err = (got.double() - want).norm() / want.norm()
        assert err < tol, err


def test_layout_refuses_bad_groups():
    with pytest.raises(ValueError, match="at least one token"):
        SharedPromptLayout((PromptGroup(0, 0, 0, (3,)),), 1, 3)
    with pytest.raises(ValueError, match="outside"):
        SharedPromptLayout((PromptGroup(0, 2, 4, (3,)),), 1, 8)


# ----------------------------------------------------------------------------------------------- whole models

def _model(kind: str, seed: int = 0):
    """A small float64 model with GQA heads and weights large enough that attention matters."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.25, pad_token_id=0)
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation="sdpa"))
    elif kind == "llama-eager":
        model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation="eager"))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, attn_implementation="sdpa"))
    return model.double()


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"])).double()


def _batch(G: int, seed: int = 0):
    """Two prompts (one of a single token) with G completions each of unequal lengths (one empty when G > 1), in a
    mixed order, and a third prompt with one completion."""
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(1, 40, (n,), generator=g).tolist()  # noqa: E731
    prompts = [tok(9), tok(1), tok(6)]
    pairs = [(0, tok(3 + 2 * k)) for k in range(G)] + [(1, tok(1 + 5 * k) if k != 1 else []) for k in range(G)]
    pairs.append((2, tok(4)))
    order = torch.randperm(len(pairs), generator=g).tolist()
    return [list(prompts[pairs[i][0]]) for i in order], [pairs[i][1] for i in order]


def _run(model, prompt_ids, completion_ids, seed=2, **kw):
    from longrl.models.policy import sequence_logprobs

    width = max(len(c) for c in completion_ids)
    logps, ent = sequence_logprobs(model, prompt_ids, completion_ids, width, pad_id=0, with_entropy=True,
                                   chunk_size=7, **kw)
    g = torch.Generator().manual_seed(seed)
    w1, w2 = (torch.randn(logps.shape, generator=g, dtype=torch.float64) for _ in range(2))
    model.zero_grad(set_to_none=True)
    ((logps * w1).sum() + (ent * w2).sum()).backward()  # .grad: offloaded checkpointing accumulates them itself
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return logps.detach(), ent.detach(), grads


def _assert_same(got, want, tol=1e-10, grad_tol=1e-6):
    """Log-probs and entropies to ``tol``; each parameter's gradient to ``grad_tol`` relative to its norm: the
    models' RMSNorms compute in float32 (transformers upcasts), and grouped rows sum a prompt's gradient over its
    completions before that norm's backward, the repeated layout after it, so gradients agree to float32
    rounding (a wrong gradient is off by its own size)."""
    (lp, ent, grads), (lp_r, ent_r, grads_r) = got, want
    torch.testing.assert_close(lp, lp_r, rtol=tol, atol=tol)
    torch.testing.assert_close(ent, ent_r, rtol=tol, atol=tol)
    for a, b in zip(grads, grads_r):
        assert a.shape == b.shape and float(b.norm()) > 0
        assert float((a - b).norm() / b.norm()) < grad_tol, float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama-eager"])
@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("attention", [True, "mask"])
def test_grouped_rows_equal_repeated_layout(kind, G, packed, attention):
    model = _model(kind)
    prompt_ids, completion_ids = _batch(G, seed=G)
    want = _run(model, prompt_ids, completion_ids, packed=packed)
    got = _run(model, prompt_ids, completion_ids, packed=packed, shared_prompt=attention)
    eager = kind == "llama-eager"  # transformers' eager attention takes its softmax in float32
    _assert_same(got, want, tol=1e-5 if eager else 1e-10, grad_tol=1e-5 if eager else 1e-6)
    _assert_same(_run(model, prompt_ids, completion_ids, packed=packed), want, tol=0.0, grad_tol=1e-15)


def test_installed_attention_passes_other_calls_through():
    """After a grouped forward the model attends through the shared-prompt attention, which hands every other call
    (padded rows with a mask, packed rows, a cached generation step) to the implementation it wraps, unchanged; and
    it can be taken off again."""
    from longrl.models.shared_prompt import disable_shared_prompt, enable_shared_prompt
    from longrl.ops.unwrap import base_model

    model = _model("qwen2")
    prompt_ids, completion_ids = _batch(3)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    before = [_run(model, prompt_ids, completion_ids, packed=p) for p in (True, False)]
    generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    enable_shared_prompt(model)
    enable_shared_prompt(model)  # idempotent
    assert base_model(model).config._attn_implementation == "longrl_shared_prompt_on_sdpa"
    for packed, want in zip((True, False), before):
        _assert_same(_run(model, prompt_ids, completion_ids, packed=packed), want, tol=0.0, grad_tol=1e-15)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), generated)
    disable_shared_prompt(model)
    assert base_model(model).config._attn_implementation == "sdpa"


def test_grouped_rows_fail_loudly_without_the_installed_attention():
    """A grouped forward reaching another attention function (someone switched the implementation between a
    forward and its recompute) fails on the empty mask instead of attending plainly over the grouped row."""
    from longrl.models.shared_prompt import grouped_rows, kernel_inputs
    from longrl.models.policy import model_parts

    model = _model("llama")
    prompt_ids, completion_ids = _batch(2)
    with pytest.raises(RuntimeError, match="size of tensor"):
        model_parts(model)[0](**kernel_inputs(grouped_rows(prompt_ids, completion_ids, 0, True), "cpu"))


def test_the_comparison_sees_a_wrong_mask(monkeypatch):
    """The model-level check can fail: with completions attending to each other (a plain causal mask over the
    grouped row) the log-probs move well beyond the tolerance."""
    model = _model("llama")
    prompt_ids, completion_ids = _batch(3)
    want = _run(model, prompt_ids, completion_ids)
    causal = lambda self, device=None: torch.ones(self.rows, 1, self.length, self.length, dtype=torch.bool,  # noqa
                                                  device=device).tril()
    monkeypatch.setattr(SharedPromptLayout, "mask", causal)
    wrong = _run(model, prompt_ids, completion_ids, shared_prompt="mask")
    assert (wrong[0] - want[0]).abs().max() > 1e-3


@pytest.mark.parametrize("packed", [True, False])
def test_lora_reference_and_policy(packed):
    """LoRA weights: the policy's log-probs and adapter gradients, and the reference's (adapters disabled)."""
    from longrl.models.policy import reference_mode

    model = _lora(_model("qwen2"))
    prompt_ids, completion_ids = _batch(4, seed=5)
    _assert_same(_run(model, prompt_ids, completion_ids, packed=packed, shared_prompt=True),
                 _run(model, prompt_ids, completion_ids, packed=packed))
    with reference_mode(model), torch.no_grad():
        from longrl.models.policy import sequence_logprobs

        ref = [sequence_logprobs(model, prompt_ids, completion_ids, 21, pad_id=0, packed=packed, shared_prompt=sp)[0]
               for sp in (False, True)]
    torch.testing.assert_close(ref[1], ref[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("reuse", [False, True])
def test_offloaded_checkpointing_and_attention_reuse(reuse):
    """Grouped rows under offloaded checkpointing (layer inputs to host memory, layers recomputed in backward),
    with the attention outputs replayed in the recompute (attention reuse): the repeated layout's gradients."""
    from longrl.memory.offload import enable_offloaded_checkpointing

    plain = _model("llama")
    prompt_ids, completion_ids = _batch(3, seed=7)
    want = _run(plain, prompt_ids, completion_ids)
    model = _model("llama")
    model.train()
    enable_offloaded_checkpointing(model, reuse_attention=reuse)
    _assert_same(_run(model, prompt_ids, completion_ids, shared_prompt=True), want)


def test_fused_layers_and_mlp_tiles():
    """With the fused training layers (the rotary attention wrapper calls the configured attention function) and
    the MLP in tiles: grouped rows still give the repeated layout's log-probs and gradients."""
    from longrl.memory.tiling import enable_mlp_tiling
    from longrl.models.fused_layers import enable_fused_layers

    plain = _model("qwen2")
    prompt_ids, completion_ids = _batch(3, seed=9)
    want = _run(plain, prompt_ids, completion_ids)
    model = _model("qwen2")
    enable_mlp_tiling(model, 5)
    assert enable_fused_layers(model)["attention"] == 2
    _assert_same(_run(model, prompt_ids, completion_ids, shared_prompt=True), want)


def test_unsupported_models_and_windows():
    from transformers import LlamaConfig, MistralConfig, PretrainedConfig

    from longrl.models.shared_prompt import unsupported_reason

    assert unsupported_reason(LlamaConfig()) is None
    assert "attention_dropout" in unsupported_reason(LlamaConfig(attention_dropout=0.1))
    assert "model_type" in unsupported_reason(PretrainedConfig())
    assert unsupported_reason(MistralConfig(sliding_window=4096), 4096) is None
    assert "sliding window of 4096" in unsupported_reason(MistralConfig(sliding_window=4096), 4097)


def test_attention_function_refuses_what_it_cannot_express():
    from longrl.ops.shared_prompt_attention import LAYOUT_KWARG, shared_prompt_sdpa

    layout = _layout("odd")
    q, k, v = (t.detach() for t in _qkv(layout, 4, 2))
    with pytest.raises(RuntimeError, match=LAYOUT_KWARG):
        shared_prompt_sdpa(None, q, k, v, None)
    with pytest.raises(NotImplementedError, match="sliding window of 16"):
        shared_prompt_sdpa(None, q, k, v, None, sliding_window=16, **{LAYOUT_KWARG: layout})
    with pytest.raises(NotImplementedError, match="softcap"):
        shared_prompt_sdpa(None, q, k, v, None, softcap=30.0, **{LAYOUT_KWARG: layout})
    out, _ = shared_prompt_sdpa(None, q, k, v, None, sliding_window=64, position_ids=None, **{LAYOUT_KWARG: layout})
    torch.testing.assert_close(out, reference_attention(q, k, v, layout, 8 ** -0.5))
