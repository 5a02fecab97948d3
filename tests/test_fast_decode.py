"""The fused decode step (rollout/fast_decode.py + fused_ops.py) against transformers' own forward, for each
architecture it takes; its Triton kernels against their PyTorch twins through Triton's interpreter."""

from __future__ import annotations

import textwrap

import pytest
import torch
import transformers
from interpreter import run_interpreted

from longrl.config.schema import LoraConfig
from longrl.models import apply_lora
from longrl.rollout import Sampler, SamplingParams
from longrl.rollout.fast_decode import FastDecoder, unsupported_reason

PROMPTS = [[1, 5, 6, 7, 9], [2, 8], [3, 4, 4, 4, 4, 4, 5, 11, 12]]
COMMON = dict(vocab_size=101, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=256)
ARCHS = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
         "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"use_sliding_window": False}),
         "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"use_sliding_window": False,
                                                                             "head_dim": 16})}


def build(arch: str, seed: int, dtype=torch.float32, lora: bool = False):
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**COMMON, **extra)).to(dtype).eval()
    with torch.no_grad():  # larger weights than the init's, so that logits are far apart and the layers matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0, 0.15)
            else:
                p.normal_(0, 0.1)  # biases (Qwen2's q/k/v)
    if lora:
        model = apply_lora(model, LoraConfig(r=4, alpha=8.0))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_sampling_is_unchanged_by_the_fused_training_layers(arch):
    """The trainer wraps norms, MLPs and attentions for training (models/fused_layers.py); rollouts on the wrapped
    model, fast decode step or transformers' forward, give the unwrapped model's tokens and log-probs."""
    from longrl.models.fused_layers import enable_fused_layers

    model = build(arch, seed=3, lora=True)
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    want = Sampler(model, None, fast_decode=True).generate(PROMPTS, 2, greedy)
    assert enable_fused_layers(model)["attention"] == 2
    for fast in (True, False):
        sampler = Sampler(model, None, fast_decode=fast)
        got = sampler.generate(PROMPTS, 2, greedy)
        assert sampler.last_stats["fast_decode"] is fast  # (a failing fast step falls back with a warning)
        assert got.completion_ids == want.completion_ids
        torch.testing.assert_close(torch.tensor(sum(got.logprobs, [])), torch.tensor(sum(want.logprobs, [])),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("lora", [False, True])
def test_fast_decode_equals_transformers_forward(arch, lora):
    model = build(arch, seed=len(arch), lora=lora)
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    runs = {}
    for fast in (True, False):
        sampler = Sampler(model, None, fast_decode=fast, sync_every=3)
        runs[fast] = sampler.generate(PROMPTS, 2, greedy)
        assert sampler.last_stats["fast_decode"] is fast
    assert runs[True].completion_ids == runs[False].completion_ids
    torch.testing.assert_close(torch.tensor(sum(runs[True].logprobs, [])), torch.tensor(sum(runs[False].logprobs, [])),
                               atol=1e-5, rtol=1e-5)
    for prompt, comp in zip(PROMPTS, runs[True].completion_ids[::2]):  # and transformers' own greedy decoding
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == comp


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_twins_round_exactly_like_transformers(arch):
    """In bfloat16 (with LoRA) the twins round where transformers rounds: sampled tokens and log-probs are
    bit-identical to the sampler on transformers' forward. (Projections unpacked: the packed decode adds q/k/v's
    and gate/up's LoRA deltas to the 16-bit base outputs in float32 and rounds once, where PEFT rounds the delta's
    products and the sum; it is held to the float32 model instead, tests/test_sampler_gpu.py.)"""
    model = build(arch, seed=3, dtype=torch.bfloat16, lora=True)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1)
    fast, plain = (Sampler(model, None, fast_decode=f, pack_projections=False).generate(PROMPTS, 2, params)
                   for f in (True, False))
    assert fast.completion_ids == plain.completion_ids
    assert torch.equal(torch.tensor(sum(fast.logprobs, [])), torch.tensor(sum(plain.logprobs, [])))


def test_other_architectures_keep_transformers_forward():
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**COMMON, head_dim=8))
    assert "architecture" in unsupported_reason(gemma) and FastDecoder.build(gemma) is None
    gelu = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, hidden_act="gelu"))
    assert "activation" in unsupported_reason(gelu)


# Triton's interpreter rounds float32 → bfloat16 toward zero where GPUs (and torch) round to nearest even, so in
# bfloat16 the kernels are held here to 2^-5 relative (each of up to three rounding steps may differ by one bf16
# unit, 2^-8..2^-7 relative); the exact bf16
# comparison runs on the GPU (tests/test_sampler_gpu.py). float32 is compared to 1e-6.
KERNEL_CHECK = textwrap.dedent('''
    import torch
    from longrl.rollout import fused_ops as f

    def close(got, want, dtype):
        unit = 2 ** -5 if dtype == torch.bfloat16 else 0.0
        return bool(((got.float() - want.float()).abs() <= 1e-6 + unit * want.float().abs().clamp(min=1)).all())

    torch.manual_seed(int(__import__("sys").argv[1]))
    for dtype in (torch.float32, torch.bfloat16):
        for B, d in ((3, 48), (1, 100), (5, 256)):
            h, delta = torch.randn(B, d).to(dtype), torch.randn(B, d).to(dtype)
            w = (1 + 0.3 * torch.randn(d)).to(dtype)
            strided = torch.randn(B, d + 9).to(dtype)[:, 4:4 + d]  # a packed product's column block
            for dl in (None, delta, strided):
                want_h, want_x = f.add_rmsnorm_reference(h.clone(), dl, w, 1e-5)
                got_h, got_x = f.add_rmsnorm(h.clone(), dl, w, 1e-5, True)
                assert close(got_h, want_h, dtype) and close(got_x, want_x, dtype), ("add_rmsnorm", dtype, B, d)
            g, u = (torch.randn(B, 3 * d + 5) * 3).to(dtype), torch.randn(B, 3 * d + 5).to(dtype)
            assert close(f.decode_silu_mul(g, u, True), f.decode_silu_mul_reference(g, u), dtype), \
                ("silu_mul", dtype, B, d)
            packed = torch.randn(B, 2 * (3 * d + 5) + 7)  # gate and up: column blocks of one product
            packed[:, :3 * d + 5] *= 3
            packed = packed.to(dtype)
            g, u = packed[:, :3 * d + 5], packed[:, 3 * d + 5:2 * (3 * d + 5)]
            assert close(f.decode_silu_mul(g, u, True), f.decode_silu_mul_reference(g, u), dtype), \
                ("silu_mul strided", dtype, B)
            for rows, r in ((B, 3), (40, 32)):  # gate/up's LoRA deltas folded in (row tiles of 16 and 64)
                packed = torch.randn(rows, 2 * (3 * d + 5) + 2 * r + 7)
                packed[:, :3 * d + 5] *= 3
                packed = packed.to(dtype)
                w = 3 * d + 5
                g, u, xa = packed[:, :w], packed[:, w:2 * w], packed[:, 2 * w + 1:]
                b_t = tuple((0.3 * torch.randn(r, w)).to(dtype) for _ in range(2))
                lora = f.LoraFold(xa, (0, r), b_t, r)
                want, got = f.decode_silu_mul_reference(g, u, lora), f.decode_silu_mul(g, u, True, lora)
                # (float32: the r-term sums in another order, relative to the values' size)
                ok = close(got, want, dtype) if dtype == torch.bfloat16 else torch.allclose(got, want, 2e-5, 2e-5)
                assert ok, ("silu_mul lora", dtype, rows, d, r, (got - want).abs().max())
        for B, Hq, Hkv, D, norm in ((3, 6, 2, 16, False), (2, 4, 4, 32, True), (1, 8, 1, 64, True)):
            S, T = B + 2, 9
            q, k, v = (torch.randn(B, H * D).to(dtype) for H in (Hq, Hkv, Hkv))
            if norm:  # q, k, v as column blocks of one packed product (row stride > width), as the packed decode
                packed = torch.randn(B, (Hq + 2 * Hkv) * D + 5).to(dtype)
                q, k, v = packed[:, :Hq * D], packed[:, Hq * D:(Hq + Hkv) * D], packed[:, (Hq + Hkv) * D:-5]
            ang = torch.rand(B, D // 2) * 6
            cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
            qw, kw = ((1 + 0.3 * torch.randn(D)).to(dtype) for _ in range(2)) if norm else (None, None)
            widx = torch.randperm(T)[:B]
            for r in (0, 3):  # without LoRA, and with q/k/v's deltas folded in (rank 3: not a power of two)
                lora = None
                if r:
                    xa = torch.randn(B, 3 * r + 4).to(dtype)[:, 1:]  # a strided column block, as the packed product's
                    b_t = tuple((0.3 * torch.randn(r, H * D)).to(dtype) for H in (Hq, Hkv, Hkv))
                    lora = f.LoraFold(xa, (0, r, 2 * r), b_t, r)
                caches = [[torch.zeros(S, Hkv, T, D, dtype=dtype) for _ in range(2)] for _ in range(2)]
                want = f.rotary_kv_reference(q, k, v, cos, sin, *caches[0], widx, qw, kw, 1e-6, lora)
                got = f.rotary_kv(q, k, v, cos, sin, *caches[1], widx, True, qw, kw, 1e-6, lora)
                for a, b in ((got, want), (caches[1][0], caches[0][0]), (caches[1][1], caches[0][1])):
                    assert close(a, b, dtype), ("rotary_kv", dtype, B, D, norm, r)
    print("fused ops ok")
''')


@pytest.mark.parametrize("seed", ["0", "1"])
def test_triton_kernels_equal_their_twins(seed):
    pytest.importorskip("triton")
    assert "fused ops ok" in run_interpreted(KERNEL_CHECK, seed)


# The rotary kernel with and without LoRA folded in, with and without the per-head norms, ranks that are not powers of
# two, q/k/v and A x as column blocks of one packed product, several row counts. Inputs are multiples of 1/8: every
# float32 sum is exact in any order, so the kernel must equal its twin bit for bit.
ROTARY_CHECK = textwrap.dedent('''
    import torch
    from longrl.rollout import fused_ops as f

    def eighths(*shape):
        return torch.randint(-16, 17, shape).float() / 8

    def no_twin(*args, **kwargs):
        raise AssertionError("rotary_kv ran its twin, not the kernel")

    torch.manual_seed(0)
    twin, f.rotary_kv_reference = f.rotary_kv_reference, no_twin
    checked = 0
    for B in (1, 4, 11):
        for Hq, Hkv, D, norm, r in ((4, 2, 16, False, 7), (4, 2, 16, True, 3), (3, 1, 32, True, 0),
                                    (2, 2, 16, False, 0), (6, 1, 32, False, 20)):
            S, T = B + 1, 5
            packed = eighths(B, (Hq + 2 * Hkv) * D + 3 * r + 5)
            q, k, v = (packed[:, a * D:b * D] for a, b in ((0, Hq), (Hq, Hq + Hkv), (Hq + Hkv, Hq + 2 * Hkv)))
            ang = torch.rand(B, D // 2) * 6
            cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
            qw, kw = (1 + 0.3 * torch.randn(D), 1 + 0.3 * torch.randn(D)) if norm else (None, None)
            widx = torch.randint(0, T, (B,))
            lora = None
            if r:
                xa = packed[:, (Hq + 2 * Hkv) * D + 2:]  # A x: a strided column block after q, k, v
                lora = f.LoraFold(xa, (0, r, 2 * r), tuple(eighths(r, H * D) for H in (Hq, Hkv, Hkv)), r)
            caches = [[torch.full((S, Hkv, T, D), 7.0) for _ in range(2)] for _ in range(2)]
            want = twin(q, k, v, cos, sin, *caches[0], widx, qw, kw, 1e-6, lora)
            got = f.rotary_kv(q, k, v, cos, sin, *caches[1], widx, True, qw, kw, 1e-6, lora)
            for a, b in ((got, want), (caches[1][0], caches[0][0]), (caches[1][1], caches[0][1])):
                assert torch.equal(a, b), ("rotary_kv", B, Hq, Hkv, D, norm, r,
                                           float((a - b).abs().max()))
            checked += 1
    print("rotary ok", checked)
''')


def test_rotary_kernel_equals_the_twin_exactly_on_packed_blocks():
    pytest.importorskip("triton")
    assert "rotary ok 15" in run_interpreted(ROTARY_CHECK)


def test_a_failing_fast_path_falls_back_on_its_first_step(monkeypatch, caplog):
    """Kernels that cannot build on the first decode step: a warning, then transformers' forward, same tokens."""
    model = build("llama", seed=5)
    want = Sampler(model, None, fast_decode=False).generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, temperature=0))
    sampler = Sampler(model, None, pack_projections=False)  # (packed: the next test)

    def broken(*a, **k):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(sampler, "fast", broken)
    got = sampler.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, temperature=0))
    assert got.completion_ids == want.completion_ids and sampler.fast is None
    assert "fast decode path failed" in caplog.text


def test_packed_weights_are_released_when_the_fast_step_fails(caplog):
    """A first fast step that fails with the weights packed: transformers' forward decodes on the packed views (same
    tokens), and the weights are back in storage of their own afterwards."""
    model = build("qwen2", seed=5, lora=True)
    want = Sampler(model, None, fast_decode=False).generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, temperature=0))
    sampler = Sampler(model, None, pack_projections=True)
    packer = sampler.fast

    class Failing:  # the decoder that fails on its first step, packing like the real one
        packed = 0

        def prepare_packing(self):
            self.packed = packer.prepare_packing()
            return self.packed

        def release_packing(self):
            packer.release_packing()

        def __call__(self, *a, **k):
            raise RuntimeError("no kernel today")

    failing = sampler.fast = Failing()
    got = sampler.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, temperature=0))
    assert failing.packed == 4 * COMMON["num_hidden_layers"]  # q/k/v, o, gate/up, down (with their A rows)
    assert got.completion_ids == want.completion_ids and sampler.fast is None
    assert "fast decode path failed" in caplog.text and not packer.packs and not _views_of_other_storage(model)


def _views_of_other_storage(model) -> list:
    return [n for n, p in model.named_parameters() if p.untyped_storage().nbytes() != p.numel() * p.element_size()]


def test_a_release_that_fails_part_way_can_be_finished(monkeypatch):
    """An out-of-memory error while the weights are copied back: the groups not yet out stay registered, so the
    next release (the sampler's next rollout packs after one) gives every weight its own storage, values unchanged."""
    model = build("qwen2", seed=5)  # biased q/k/v
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    decoder = FastDecoder(model)
    assert decoder.prepare_packing() == 2 * COMMON["num_hidden_layers"]
    clone, calls = torch.Tensor.clone, [0]

    def failing_third(self, *a, **k):
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("no memory today")
        return clone(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "clone", failing_third)
    with pytest.raises(torch.OutOfMemoryError):
        decoder.release_packing()
    monkeypatch.setattr(torch.Tensor, "clone", clone)
    assert decoder.packs and _views_of_other_storage(model)  # (the failure left weights in a packed buffer)
    decoder.release_packing()
    assert not decoder.packs and not _views_of_other_storage(model)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_siblings_with_biases_of_different_dtypes_stay_unpacked():
    """One bias buffer has one dtype: q/k/v whose biases differ in dtype keep a product each (packing them would
    round k's float32 bias to the others' dtype for good); gate/up still pack."""
    model = build("qwen2", seed=5).to(torch.bfloat16)
    attn = model.model.layers[0].self_attn
    attn.k_proj.bias.data = attn.k_proj.bias.data.float()
    decoder = FastDecoder(model)
    assert decoder.prepare_packing() == 2 * COMMON["num_hidden_layers"] - 1
    assert (0, "q_proj") not in decoder.packs and (0, "gate_proj") in decoder.packs
    decoder.release_packing()
    assert attn.k_proj.bias.dtype == torch.float32 and not _views_of_other_storage(model)


def test_trainer_switch(tmp_path):
    """generation.fast_decode and fuse_lora reach the trainer's sampler (the demo model is a Llama: on by default)."""
    from longrl.config import load_config
    from longrl.config.demo import demo_config
    from longrl.compat.trl import GRPOTrainer

    for flag, on in (("true", True), ("false", False)):
        cfg = load_config(None, [f"output.output_dir={tmp_path / flag}", f"generation.fast_decode={flag}",
                                 f"generation.fuse_lora={flag}"], base=demo_config())
        sampler = GRPOTrainer(cfg).sampler
        assert (sampler.fast is not None) is on and sampler.fuse_lora is on


def test_add_rmsnorm_promotes_like_pytorch_when_dtypes_differ():
    """A float32 δ onto a bf16 residual (e.g. float32 norms over a 4-bit base): PyTorch promotes the sum; the
    kernel would keep bf16, so the twin runs (also for a non-contiguous δ)."""
    from longrl.rollout import fused_ops as f

    torch.manual_seed(0)
    h, delta = torch.randn(3, 40).to(torch.bfloat16), torch.randn(3, 40)
    w = torch.rand(40) + 0.5
    got = f.add_rmsnorm(h.clone(), delta, w, 1e-6, True)
    want = f.add_rmsnorm_reference(h.clone(), delta, w, 1e-6)
    assert got[0].dtype == torch.float32 and all(torch.equal(a, b) for a, b in zip(got, want))
    strided = torch.randn(40, 3).t().to(torch.bfloat16)
    got = f.add_rmsnorm(h.clone(), strided, w.to(torch.bfloat16), 1e-6, True)
    want = f.add_rmsnorm_reference(h.clone(), strided, w.to(torch.bfloat16), 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("rope, safe", [(None, True), ({"rope_type": "dynamic", "factor": 2.0}, False)])
def test_decode_graphs_only_where_capture_is_safe(rope, safe):
    from transformers import LlamaConfig, LlamaForCausalLM

    from longrl.rollout.sampler import _graph_safe

    kw = {"rope_parameters": {"rope_theta": 10000.0, **rope}} if rope else {}
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, **kw)
    model = LlamaForCausalLM(cfg)
    assert _graph_safe(model, use_triton=True) is safe
    assert _graph_safe(model, use_triton=False) is False  # the PyTorch attention twin syncs with the host


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("lora", [False, True])
def test_packed_projections_decode_as_the_separate_ones(arch, lora):
    """generation.pack_projections: q/k/v and gate/up read by one product a group (their LoRA A rows appended)
    decode the same tokens with the same log-probs as one product a projection, and afterwards every weight is
    back in storage of its own with its values and parameter object unchanged."""
    model = build(arch, seed=7, lora=lora)
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    want = Sampler(model, None, pack_projections=False).generate(PROMPTS, 2, greedy)
    sampler = Sampler(model, None, pack_projections=True, sync_every=3)
    got = sampler.generate(PROMPTS, 2, greedy)
    groups = (4 if lora else 2) * COMMON["num_hidden_layers"]  # o and down alone only with their A rows
    stats = sampler.last_stats
    assert stats["fast_decode"] and stats["packed_groups"] == groups
    # the host seconds around the decoding (packing and its undoing among them) are parts of the call's
    assert 0 < stats["prepare_s"] and 0 < stats["release_s"]
    assert stats["prepare_s"] + stats["release_s"] < stats["seconds"]
    assert got.completion_ids == want.completion_ids
    torch.testing.assert_close(torch.tensor(sum(got.logprobs, [])), torch.tensor(sum(want.logprobs, [])),
                               atol=1e-5, rtol=1e-5)
    assert dict(model.named_parameters()) == params  # the same parameter objects
    with torch.inference_mode():  # a rollout called in inference mode leaves trainable parameters behind
        Sampler(model, None, pack_projections=True).generate(PROMPTS[:1], 1, greedy)
    assert not any(p.is_inference() for p in model.parameters())
    for n, p in params.items():
        assert torch.equal(p, before[n]), n
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), n  # its own storage again


def test_packing_puts_a_groups_weights_and_a_rows_in_one_buffer():
    from longrl.rollout.lora_fusion import fused_lora

    model = build("qwen2", seed=2, lora=True)  # q/k/v with biases
    fast = FastDecoder(model.base_model.model)
    attn = model.base_model.model.model.layers[0].self_attn
    bases = [attn.q_proj.base_layer, attn.k_proj.base_layer, attn.v_proj.base_layer]
    weights = [b.weight.detach().clone() for b in bases]
    with fused_lora(model, torch.float32) as fused:
        assert fused
        assert fast.prepare_packing() == 4 * COMMON["num_hidden_layers"]
        pack = fast.packs[(0, "q_proj")]
        assert pack.group is not None and pack.bias is not None
        assert pack.fold is not None and fast.packs[(0, "gate_proj")].fold is not None  # B: into the glue kernels
        assert fast.packs[(0, "o_proj")].fold is None
        assert fast.packs[(0, "o_proj")].group is not None and fast.packs[(0, "down_proj")].a_start == 48
        rows = sum(b.out_features for b in bases)
        assert pack.weight.shape == (rows + 3 * 4, COMMON["hidden_size"])  # three adapters of rank 4
        for b, w, (lo, hi) in zip(bases, weights, pack.bounds):
            assert b.weight.data_ptr() == pack.weight[lo:hi].data_ptr() and torch.equal(b.weight, w)
        torch.testing.assert_close(pack.weight[rows:], pack.group.a_t.t())
        assert torch.equal(pack.bias[rows:], torch.zeros(12))
        fast.release_packing()
    assert not fast.packs and all(b.weight.untyped_storage().nbytes() == b.weight.numel() * 4 for b in bases)
    assert all(torch.equal(b.weight, w) for b, w in zip(bases, weights))


def test_a_missing_bitsandbytes_is_looked_up_once(monkeypatch):
    """Without bitsandbytes every projection's NF4 check says so, and the import is tried once, not once a
    projection and call (a failed import searches the whole path each time)."""
    import sys

    from longrl.rollout import fast_decode

    tries = []

    class NoBitsandbytes:  # an import finder that counts and refuses bitsandbytes
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] == "bitsandbytes":
                tries.append(name)
                raise ImportError("no bitsandbytes here")
            return None

    for name in [m for m in sys.modules if m.split(".")[0] == "bitsandbytes"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NoBitsandbytes(), *sys.meta_path])
    fast_decode._linear4bit_class.cache_clear()
    try:
        reasons = [fast_decode._nf4_reason([torch.nn.Linear(4, 4)]) for _ in range(20)]
    finally:
        fast_decode._linear4bit_class.cache_clear()  # the next test finds bitsandbytes again where it is installed
    assert reasons == ["bitsandbytes is not installed"] * 20
    assert len(tries) == 1
