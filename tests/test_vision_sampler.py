"""The sampler with images (float32): greedy tokens and log-probs equal transformers' full forward (with the pixel
values), for every supported family (mRoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL with deepstack; 1-D: LLaVA, LLaVA-NeXT,
Idefics3, SmolVLM), decode steps on the fast path (rollout/fast_decode.py on the language model) and on transformers'
forward, over single and multi-turn rollouts; the vision tower runs once per prompt, not once per completion. Gemma 3
(image tokens attending both ways: the prefill's image-block mask; decode steps on transformers' forward) also with a
sliding window shorter than the rollout, through transformers' generate (rollout/hf_generate.py)."""

import pytest
import torch
from vision_models import (
    FAMILIES,
    FAST_DECODE,
    build,
    chat_prompts,
    full_forward_inputs,
    vision_tower,
    with_lora,
)

from longrl.models import base_model
from longrl.models.vision import VisionModelError
from longrl.rollout.sampler import MultiTurn, Sampler
from longrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore")
G = 2


def _model(family: str):
    model, processor = build(family, seed=4)
    _never_greedy_image_token(model)
    return with_lora(model, seed=5, scale=0.2), processor


@torch.no_grad()
def _never_greedy_image_token(model):
    """Zero the LM head's row of the image placeholder (its logit 0, below the largest of ~100 random logits):
    a greedy chain that emitted it would make transformers' full forward, the reference here, count it as an image
    token (longrl's passes place features at the prompt's placeholders only). Without this the chain depends on
    near-ties that the CPU's thread count decides."""
    from longrl.models.vision import image_token_id

    model.get_output_embeddings().weight[image_token_id(model.config)] = 0.0


def _prompts(model, processor):
    """(prompt ids, VisionPrompt or None, transformers inputs) for prompts with 1 image, 2 images, and none."""
    shapes = [((56, 56),), ((28, 56), (56, 28)), ()]
    return [(enc["input_ids"][0].tolist(), prompt, enc) for enc, prompt in chat_prompts(model, processor, shapes, 10)]


@torch.no_grad()
def _full_forward_logps(model, enc, tokens: list[int]) -> torch.Tensor:
    """log softmax [n, V] of the positions predicting ``tokens`` (after the prompt), one full forward."""
    logits = model(**full_forward_inputs(enc, tokens)).logits[0, enc["input_ids"].shape[1] - 1:-1].float()
    return torch.log_softmax(logits, -1)


def _check_against_full_forward(model, prompts, rollout, n_env=None):
    for i, completion in enumerate(rollout.completion_ids):
        enc = prompts[i // G][2]
        logps = _full_forward_logps(model, enc, completion)  # [n, V]
        sampled = [j for j in range(len(completion)) if rollout.env_mask is None or rollout.env_mask[i][j]]
        chosen = logps.argmax(-1)
        assert [completion[j] for j in sampled] == chosen[sampled].tolist(), f"sequence {i}"
        expected = logps.gather(1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(rollout.logprobs[i])[sampled], expected[sampled], rtol=0, atol=2e-5)


@pytest.mark.parametrize("family, fast", [(f, True) for f in FAMILIES] + [("qwen2_vl", False), ("qwen3_vl", False),
                                                                          ("llava", False)])
def test_greedy_and_logprobs_equal_full_forward_tower_once_per_prompt(family, fast):
    model, processor = _model(family)
    prompts = _prompts(model, processor)
    sampler = Sampler(model, processor.tokenizer, sync_every=2, fast_decode=fast)
    fast = fast and family in FAST_DECODE  # Gemma 3's decode steps run transformers' forward
    assert (sampler.fast is not None) is fast  # every other family's language model takes the fast path
    calls = []
    hook = vision_tower(model).register_forward_hook(lambda *a: calls.append(1))
    rollout = sampler.generate([p for p, _, _ in prompts], G, SamplingParams(max_new_tokens=7, temperature=0),
                               vision=[v for _, v, _ in prompts])
    hook.remove()
    assert len(calls) == 2 and sampler.last_stats["vision_tower_calls"] == 2  # 2 prompts with images, G = 2
    assert sampler.last_stats["fast_decode"] is fast  # (a failing first fast step would fall back: False)
    assert all(len(c) == 7 for c in rollout.completion_ids)
    _check_against_full_forward(model, prompts, rollout)
    assert base_model(model).config._attn_implementation == "eager"  # restored
    assert base_model(model).get_decoder().config._attn_implementation == "eager"


class _OneReturn:
    """An environment answering a sequence's first turn with two fixed tokens, then ending the episode."""

    def __init__(self):
        self.turns = {}

    def step(self, seq, tokens, room):
        self.turns[seq] = self.turns.get(seq, 0) + 1
        return [41, 42] if self.turns[seq] == 1 else None


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava", "gemma3"])
def test_multi_turn_resume_positions_equal_full_forward(family):
    model, processor = _model(family)
    prompts = _prompts(model, processor)
    sampler = Sampler(model, processor.tokenizer, sync_every=2)
    # decode steps between the turns on the fast path (Gemma 3: transformers' forward), at the resumed positions
    assert (sampler.fast is not None) is (family in FAST_DECODE)
    rollout = sampler.generate([p for p, _, _ in prompts], G, SamplingParams(max_new_tokens=4, temperature=0),
                               multi_turn=MultiTurn(_OneReturn(), max_tokens=12, workers=1),
                               vision=[v for _, v, _ in prompts])
    assert sampler.last_stats["fast_decode"] is (family in FAST_DECODE)
    assert all(len(c) == 10 and c[4:6] == [41, 42] for c in rollout.completion_ids)
    _check_against_full_forward(model, prompts, rollout)


def test_request_errors():
    model, processor = _model("llava")
    (ids, prompt, _), *_ = _prompts(model, processor)
    sampler = Sampler(model, processor.tokenizer)
    params = SamplingParams(max_new_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="prompt 0's token ids are not its VisionPrompt"):
        sampler.generate([ids[1:]], 1, params, vision=[prompt])
    with pytest.raises(ValueError, match="1 entries for 2 prompts"):
        sampler.generate([ids, ids], 1, params, vision=[prompt])
    from longrl.models import build_tiny_model

    text_model, tok = build_tiny_model()
    with pytest.raises(VisionModelError, match="text-only"):
        Sampler(text_model, tok).generate([[5, 6]], 1, params, vision=[prompt])


@pytest.mark.parametrize("pre_encoded", [True, False])
def test_gemma3_with_a_short_window_samples_through_generate_as_the_full_forward(pre_encoded, monkeypatch):
    """A sliding window shorter than the rollout (real checkpoints': 1,024 tokens): the sampler refuses it and the
    run samples with transformers' generate, which takes the prompts with images (each prompt's features computed once
    for its G completions, given as mm_encoder_outputs; token_type_ids for the image blocks, left-padded): greedy
    tokens and every step's logits equal transformers' full forward with the pixel values, for prompts with 1, 2 and
    no images in one left-padded batch. ``pre_encoded`` False: a transformers whose forward has no
    mm_encoder_outputs (5.17) gets each row's pixel values instead, with the same result."""
    from longrl.config.schema import GenerationConfig
    from longrl.rollout import hf_generate
    from longrl.rollout.attention import unsupported_reason
    from longrl.rollout.completions import build_sampler, sample

    if pre_encoded and not hf_generate.takes_encoder_outputs(build("gemma3", seed=4, window=6)[0]):
        pytest.skip("this transformers' Gemma 3 forward takes no mm_encoder_outputs")
    if not pre_encoded:
        monkeypatch.setattr(hf_generate, "takes_encoder_outputs", lambda model: False)

    model, processor = build("gemma3", seed=4, window=6)
    _never_greedy_image_token(model)
    model = with_lora(model, seed=5, scale=0.2)
    prompts = _prompts(model, processor)
    assert "sliding-window attention (window 6" in unsupported_reason(base_model(model).config, 30)
    gen = GenerationConfig(max_completion_length=6, temperature=0.0, ignore_eos=True)
    assert build_sampler(model, processor.tokenizer, gen, max_length=40) is None
    calls, steps = [], []
    tower = vision_tower(model).register_forward_hook(lambda *a: calls.append(1))
    head = base_model(model).lm_head.register_forward_hook(lambda m, i, out: steps.append(out[:, -1].detach()))
    params = SamplingParams(max_new_tokens=6, temperature=0.0, seed=0)
    rollout = sample(model, processor.tokenizer, [p for p, _, _ in prompts], G, gen, params, None, "cpu",
                     vision=[v for _, v, _ in prompts])
    tower.remove()
    head.remove()
    if pre_encoded:
        assert len(calls) == 2  # the two prompts with images, once each (not once a completion)
    assert all(len(c) == 6 for c in rollout.completion_ids)
    logits = torch.stack(steps, 1)  # [P·G, 6, V]: generate's logits of each step, row by row
    for i, completion in enumerate(rollout.completion_ids):
        want = _full_forward_logps(model, prompts[i // G][2], completion)  # [6, V] log softmax
        assert completion == want.argmax(-1).tolist(), f"sequence {i}"
        torch.testing.assert_close(torch.log_softmax(logits[i], -1), want, rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="LLaVA-1.5 models are sampled by longrl's sampler only.*Gemma 3"):
        llava, llava_processor = _model("llava")
        (ids, prompt, _), *_ = _prompts(llava, llava_processor)
        sample(llava, llava_processor.tokenizer, [ids], 1, gen, params, None, "cpu", vision=[prompt])
