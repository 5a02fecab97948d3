"""The fast decode path (rollout/fast_decode.py) on the language model of vision-language models, against
transformers' forward: mRoPE at a decode token is the 1-D rotary (checked on the model's own rotary module, Qwen3-VL's
interleaved layout and a scaling with attention_scaling ≠ 1 included); sampled tokens and log-probs equal the sampler
on transformers' forward for every family but Gemma 3, whose decode keeps transformers' forward (float32; bit for bit
in bfloat16 with the projections unpacked); 4-bit bases; Qwen3-VL's deepstack reaches the prefill only; which models
are refused; when decode steps may be graphs.
Greedy rollouts against transformers' full forward with the pixel values: tests/test_vision_sampler.py."""

import pytest
import torch
from test_vision_sampler import G, _check_against_full_forward, _model, _prompts
from vision_models import FAMILIES, FAST_DECODE, build, with_lora

from longrl.models import base_model
from longrl.rollout.fast_decode import FastDecoder, unsupported_reason
from longrl.rollout.sampler import Sampler, _graph_safe
from longrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore")
MROPE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}


def _generate(sampler, prompts, params, G: int = 2, **kw):
    """``sampler.generate`` on ``prompts`` as test_vision_sampler._prompts gives them, G completions each."""
    return sampler.generate([p for p, _, _ in prompts], G, params, vision=[v for _, v, _ in prompts], **kw)


def _assert_same_rollout(got, want) -> None:
    """The same tokens, and log-probs within float32 rounding."""
    assert got.completion_ids == want.completion_ids
    torch.testing.assert_close(torch.tensor(sum(got.logprobs, [])), torch.tensor(sum(want.logprobs, [])),
                               atol=1e-5, rtol=1e-5)


def _fast_and_plain(model, processor, prompts, params, G: int = 2, **kw) -> dict:
    """{fast: rollout} with the fast decode path on and off (transformers' forward)."""
    runs = {}
    for fast in (True, False):
        sampler = Sampler(model, processor.tokenizer, fast_decode=fast, **kw)
        runs[fast] = _generate(sampler, prompts, params, G)
        assert sampler.last_stats["fast_decode"] is fast  # (a failing first fast step would fall back: False)
    return runs


def _rotary_1d(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float):
    """The plain 1-D rotary at ``positions`` [B]: cos, sin [B, D] of cat(p·inv_freq, p·inv_freq), times scaling."""
    freqs = positions.float()[:, None] * inv_freq.float()[None]  # [B, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def _row_read_by_each_frequency(rotary, p: int) -> list[int]:
    """For each frequency i < D/2: which of the three position rows (p, p + 7, p + 19) the module's cos reads."""
    rows = torch.tensor([p, p + 7, p + 19])
    cos, _ = rotary(torch.zeros(1, 1, 8), rows[:, None, None])  # [1, 1, D]
    half = rotary.inv_freq.shape[0]
    candidates = torch.cos(rows[:, None].float() * rotary.inv_freq.float()[None]) * rotary.attention_scaling
    return [int((candidates[:, i] - cos[0, 0, i]).abs().argmin()) for i in range(half)]


@pytest.mark.parametrize("family", MROPE)
@pytest.mark.parametrize("rope", [None, YARN], ids=["default", "yarn"])
def test_mrope_at_a_decode_token_is_the_1d_rotary(family, rope):
    """Three equal rows through the model's own rotary module (what transformers' text model makes of 1-D position
    ids, and what FastDecoder.rotary passes) = the 1-D rotary with its inv_freq and attention_scaling, exactly; and
    the layouts really differ (rows apart: Qwen2-VL reads contiguous sections, Qwen3-VL interleaves them)."""
    model, _ = build(family, rope=rope)
    decoder = FastDecoder(model)
    rotary = decoder.body.rotary_emb
    assert decoder.mrope and (rotary.attention_scaling != 1.0) is (rope is not None)
    g = torch.Generator().manual_seed(len(family))
    positions = torch.cat([torch.randint(0, 5000, (6,), generator=g), torch.tensor([0, 1, 255, 256, 511])])
    h = torch.zeros(len(positions), 32)
    want = _rotary_1d(positions, rotary.inv_freq, rotary.attention_scaling)
    got = rotary(h[:, None], positions[None, :, None].expand(3, -1, -1))  # [B, 1, D] each
    for a, b in zip(got, want):
        assert torch.equal(a[:, 0], b)
    for a, b in zip(decoder.rotary(h, positions), want):
        assert torch.equal(a, b)
    layout = _row_read_by_each_frequency(rotary, 40)  # mrope_section [2, 1, 1] over D/2 = 4 frequencies
    assert layout == ([0, 1, 2, 0] if family == "qwen3_vl" else [0, 0, 1, 2])


@pytest.mark.parametrize("family", FAST_DECODE)
def test_sampled_tokens_and_logprobs_equal_transformers_forward(family):
    """Temperature-1 sampling (LoRA fused, projections packed) takes the same tokens with the same log-probs through
    the fast path as through transformers' forward, for prompts with 2, 1 and no images."""
    model, processor = _model(family)
    prompts = _prompts(model, processor)
    params = SamplingParams(max_new_tokens=9, temperature=1.0, seed=3)
    runs = _fast_and_plain(model, processor, prompts, params, G=3, sync_every=3)
    _assert_same_rollout(runs[True], runs[False])


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_sampling_is_unchanged_by_the_fused_training_layers(family):
    """The trainer's fused norms, MLPs and attentions (models/fused_layers.py) on the language model: rollouts on the
    fast path and on transformers' forward give the unwrapped model's tokens and log-probs."""
    from longrl.models.fused_layers import enable_fused_layers

    model, processor = _model(family)
    prompts = _prompts(model, processor)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4)
    want = _generate(Sampler(model, processor.tokenizer), prompts, params)
    assert enable_fused_layers(model)["swiglu"] == 2
    for got in _fast_and_plain(model, processor, prompts, params).values():
        _assert_same_rollout(got, want)



@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava"])
def test_scaled_rope_greedy_equals_full_forward(family):
    """A YaRN-scaled text model (attention_scaling ≠ 1 on q and k): greedy tokens and log-probs of the fast path
    equal transformers' full forward with the pixel values."""
    model, processor = build(family, seed=4, rope=YARN)
    from test_vision_sampler import _never_greedy_image_token

    _never_greedy_image_token(model)
    model = with_lora(model, seed=5, scale=0.2)
    prompts = _prompts(model, processor)
    sampler = Sampler(model, processor.tokenizer, sync_every=2)
    rollout = _generate(sampler, prompts, SamplingParams(max_new_tokens=6, temperature=0), G)
    assert sampler.last_stats["fast_decode"]
    _check_against_full_forward(model, prompts, rollout)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llava_next", "smolvlm"])
def test_bf16_rounds_exactly_like_transformers(family):
    """In bfloat16 with LoRA (projections unpacked, as tests/test_fast_decode.py's text twin says why) the fast
    path's tokens and log-probs are bit-identical to the sampler on transformers' forward."""
    model, processor = build(family, seed=4, dtype=torch.bfloat16)
    model = with_lora(model, seed=5, scale=0.2)
    prompts = _prompts(model, processor)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=1)
    fast, plain = (_generate(Sampler(model, processor.tokenizer, fast_decode=f, pack_projections=False), prompts,
                             params) for f in (True, False))
    assert fast.completion_ids == plain.completion_ids
    assert torch.equal(torch.tensor(sum(fast.logprobs, [])), torch.tensor(sum(plain.logprobs, [])))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava"])
def test_4bit_base_decodes_as_transformers(family):
    """An NF4 language model (bitsandbytes on the CPU: the projections' own forward; the tower and projector stay
    16-bit) with LoRA: the fast path gives transformers' forward's tokens and log-probs."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.nn import Linear4bit

    from longrl.models.quantize import quantize_model
    from longrl.models.vision import vision_family
    from longrl.models.vision.adapters import vision_module_prefixes

    model, processor = build(family, seed=4)
    keep = vision_module_prefixes(model, vision_family(model.config))
    quantize_model(model, torch.randint(20, 90, (2, 16)), exception_budget=0.0, keep_under=keep)
    assert isinstance(model.get_decoder().layers[0].self_attn.q_proj, Linear4bit)
    model = with_lora(model, seed=5, scale=0.2)
    prompts = _prompts(model, processor)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2)
    runs = _fast_and_plain(model, processor, prompts, params)
    _assert_same_rollout(runs[True], runs[False])


@pytest.mark.parametrize("fast", [True, False])
def test_deepstack_reaches_the_prefill_only(fast):
    """Qwen3-VL: the language model's forward gets the deepstack features in the prefill of prompts with images and
    never in a decode step; on the fast path decode steps do not call its forward at all."""
    model, processor = _model("qwen3_vl")
    prompts = _prompts(model, processor)
    calls = []
    hook = base_model(model).get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((kwargs["input_ids"] if "input_ids" in kwargs else None,
                                                   kwargs.get("deepstack_visual_embeds"))), with_kwargs=True)
    sampler = Sampler(model, processor.tokenizer, fast_decode=fast, sync_every=2)
    rollout = _generate(sampler, prompts, SamplingParams(max_new_tokens=5, temperature=0), G)
    hook.remove()
    prefills = sampler.last_stats["prefills"]
    assert prefills >= 1 and all(deep is not None for _, deep in calls[:prefills])  # (each prefill chunk holds a prompt with images)
    decode = calls[prefills:]
    assert all(deep is None and ids.shape[1] == 1 for ids, deep in decode)
    assert (len(decode) == 0) is fast and sampler.last_stats["decode_steps"] > 0
    _check_against_full_forward(model, prompts, rollout)


def test_other_language_models_keep_transformers_forward():
    """A LLaVA over a Gemma text model, and Gemma 3: refused by their language model's class (the vision side is
    fine)."""
    import transformers as tf

    text = dict(model_type="gemma", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    llava = tf.LlavaForConditionalGeneration(tf.LlavaConfig(vision_config=vision, text_config=text,
                                                            image_token_index=5))
    assert "language model GemmaModel" in unsupported_reason(llava) and FastDecoder.build(llava) is None
    for family in FAST_DECODE:
        assert unsupported_reason(build(family)[0]) is None, family
    gemma3 = build("gemma3")[0]  # Gemma 3's decode steps keep transformers' forward (tests/test_vision_sampler.py)
    assert "language model Gemma3TextModel" in unsupported_reason(gemma3) and FastDecoder.build(gemma3) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_graphs_for_vision_models(family):
    """_graph_safe reads the language model's rotary: graphs with the default rotary (a checkpoint's "mrope" type is
    "default" in transformers' config), none with dynamic scaling (a host-side frequency swap)."""
    assert _graph_safe(build(family)[0], use_triton=True)
    if family in MROPE + ("llava", "llava_next"):
        assert not _graph_safe(build(family, rope={"rope_type": "dynamic", "factor": 2.0})[0], use_triton=True)
