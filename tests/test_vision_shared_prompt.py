"""Grouped rows with images (float64): each prompt once in a row with its image features, then its completions.
Log-probs and gradients (LoRA on the language model, and on the tower and projector) equal the repeated layout's and
transformers' model run on each sequence with its pixel values, for LLaVA, LLaVA-NeXT and Idefics3 (1-D positions),
Qwen2-VL and Qwen2.5-VL (mRoPE) and Qwen3-VL (mRoPE, deepstack), with the flash-part kernel and its masked twin, packed and padded rows;
prompts with equal tokens but other images stay apart; the tower runs once per prompt."""

import pytest
import torch
from vision_models import build, chat_prompts, full_forward_inputs, vision_tower, with_lora

from longrl.models import base_model
from longrl.models.policy import sequence_logprobs
from longrl.models.shared_prompt import attention_delegate, grouped_rows, unsupported_reason

# relative, for gradients: RMSNorm (and Qwen's vision rotary) compute in float32 even in float64 models, so the
# prompt's gradient summed once over the group, or G times over copies, differs by float32 rounding
GRAD_TOL = 1e-6
pytestmark = pytest.mark.filterwarnings("ignore")


def _setup(family: str, vision_modules: str):
    """A float64 tiny ``family`` model with LoRA, its language model on SDPA (eager attention takes its softmax in
    float32, the flash parts do not), and a batch: prompts with one image, two images, none, and one with the first
    prompt's tokens but another picture; 3 completions each of unequal lengths, the sequences interleaved."""
    model, processor = build(family, seed=1, dtype=torch.float64)
    model = with_lora(model, vision_modules, seed=2)
    base_model(model).get_decoder().set_attn_implementation("sdpa")
    prompts = (chat_prompts(model, processor, [((56, 56),), ((56, 28), (28, 56)), ()])
               + chat_prompts(model, processor, [((56, 56),)], seed=5))  # "Q0?" again, other pixels
    assert prompts[3][0]["input_ids"].tolist() == prompts[0][0]["input_ids"].tolist()
    g = torch.Generator().manual_seed(3)
    seqs = []  # (prompt index, completion)
    for j in range(3):
        for k in range(len(prompts)):
            seqs.append((k, torch.randint(40, 90, (2 + (3 * j + 2 * k) % 5,), generator=g).tolist()))
    return model, prompts, seqs


def _inputs(prompts, seqs):
    prompt_ids = [prompts[k][0]["input_ids"][0].tolist() for k, _ in seqs]
    return prompt_ids, [c for _, c in seqs], [prompts[k][1] for k, _ in seqs]


def _run(model, prompt_ids, completion_ids, vision, weights, **kwargs):
    """(log-probs [b, T], gradients of Σ weights·logps over the trainable parameters)."""
    model.zero_grad(set_to_none=True)
    logps, _ = sequence_logprobs(model, prompt_ids, completion_ids, weights.shape[1], pad_id=0, vision=vision,
                                 **kwargs)
    (logps * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return logps.detach(), grads


def _assert_grads_close(got, want):
    assert got.keys() == want.keys()
    for n in want:
        assert float((got[n] - want[n]).norm()) <= GRAD_TOL * float(want[n].norm()) + 1e-14, n


@pytest.mark.parametrize("family, vision_modules", [
    ("llava", "tower_and_projector"), ("qwen2_vl", "tower_and_projector"), ("qwen2_vl", "none"),
    ("qwen2_5_vl", "projector"), ("qwen3_vl", "tower_and_projector"), ("llava_next", "projector"),
    ("idefics3", "none")])
def test_grouped_rows_with_images_equal_the_repeated_layout_and_transformers(family, vision_modules):
    model, prompts, seqs = _setup(family, vision_modules)
    assert unsupported_reason(base_model(model).config) is None
    prompt_ids, completion_ids, vision = _inputs(prompts, seqs)
    width = max(len(c) for c in completion_ids)
    weights = torch.randn(len(seqs), width, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    calls = []
    vision_tower(model).register_forward_hook(lambda *a: calls.append(1))

    want, want_grads = _run(model, prompt_ids, completion_ids, vision, weights)  # the repeated layout
    assert len(calls) == 3  # the three prompts with images, once each (frozen: kept on the prompt from here on)
    trains = vision_modules != "none"  # features with autograd, once a call; frozen: kept on the prompt
    with torch.no_grad():  # transformers' model on each sequence with its pixel values
        for i, (k, completion) in enumerate(seqs):
            n = len(completion)
            logits = model(**full_forward_inputs(prompts[k][0], completion, torch.float64)).logits[0, -n - 1:-1]
            hf = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
            torch.testing.assert_close(want[i, :n], hf, rtol=0, atol=1e-10)
    for attention in ("kernel", "mask"):
        for packed in (True, False):
            calls.clear()
            got, grads = _run(model, prompt_ids, completion_ids, vision, weights, packed=packed,
                              shared_prompt=True if attention == "kernel" else attention)
            assert len(calls) == (3 if trains else 0), (attention, packed)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
            _assert_grads_close(grads, want_grads)
    if vision_modules != "none":  # the vision side's adapters get their gradient through the grouped rows
        assert any(("visual" in n or "vision" in n or "projector" in n) and g.abs().sum() > 0
                   for n, g in want_grads.items())
    # the vision tower keeps its own attention; the language model wraps SDPA
    assert attention_delegate(model) == "sdpa"
    assert base_model(model).config.vision_config._attn_implementation == "eager"


def test_grouped_rows_keep_equal_tokens_with_other_images_apart():
    """Two prompts of the same tokens with other pictures are two groups (without images they would be one), each
    group's features in its own prompt part; a prompt's tokens must begin its sequence."""
    model, prompts, seqs = _setup("qwen2_vl", "none")
    prompt_ids, completion_ids, vision = _inputs(prompts, seqs)
    assert grouped_rows(prompt_ids, completion_ids, 0, packed=False).layout.rows == 3
    rows = grouped_rows(prompt_ids, completion_ids, 0, packed=False, keys=vision)
    assert rows.layout.rows == 4 and [vision[i] for i in rows.firsts] == [p for _, p in prompts]
    with pytest.raises(ValueError, match="sequence 1 does not begin"):
        sequence_logprobs(model, [prompt_ids[0], prompt_ids[0][1:]], completion_ids[:2], 9, pad_id=0,
                          vision=[vision[0], vision[0]], shared_prompt=True)


@pytest.mark.parametrize("reuse", [False, True])
def test_grouped_rows_with_images_under_offloaded_checkpointing(reuse):
    """Qwen3-VL (mRoPE, deepstack) with LoRA on the tower, grouped rows under offloaded checkpointing (decoder
    layers recomputed in backward, with the attention outputs replayed when ``reuse``): the repeated layout's
    log-probs and gradients without checkpointing."""
    from longrl.memory.offload import enable_offloaded_checkpointing

    model, prompts, seqs = _setup("qwen3_vl", "tower_and_projector")
    prompt_ids, completion_ids, vision = _inputs(prompts, seqs)
    weights = torch.randn(len(seqs), max(len(c) for c in completion_ids), generator=torch.Generator().manual_seed(4),
                          dtype=torch.float64)
    want, want_grads = _run(model, prompt_ids, completion_ids, vision, weights)
    model.train()
    enable_offloaded_checkpointing(model, reuse_attention=reuse)
    got, grads = _run(model, prompt_ids, completion_ids, vision, weights, shared_prompt=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    _assert_grads_close(grads, want_grads)


def test_gemma3_grouped_rows_are_refused_with_the_reason():
    """Gemma 3's image tokens attend both ways, which the grouped rows' causal attention does not compute: refused by
    the policy pass and by the planner (a pinned train.shared_prompt=true; null falls back to separate sequences)."""
    from longrl.config import ConfigError, load_config
    from longrl.config.demo import vision_demo_config
    from longrl.memory.planner import shared_prompt_applies

    model, prompts, seqs = _setup("gemma3", "none")
    prompt_ids, completion_ids, vision = _inputs(prompts, seqs)
    reason = "Gemma 3's image tokens attend both ways"
    assert reason in unsupported_reason(base_model(model).config)
    with pytest.raises(ValueError, match=f"grouped rows \\(train.shared_prompt\\): {reason}"):
        sequence_logprobs(model, prompt_ids, completion_ids, 9, pad_id=0, vision=vision, shared_prompt=True)

    class Step:  # what shared_prompt_applies reads of a StepShape
        shared_prompt, prompt_tokens, completion_tokens = True, 40, 8

    def cfg(*overrides):
        return load_config(None, ["output.output_dir=unused", *overrides], base=vision_demo_config())

    with pytest.raises(ConfigError, match=f"train.shared_prompt.*{reason}"):
        shared_prompt_applies(cfg("train.shared_prompt=true"), Step(), base_model(model).config)
    assert not shared_prompt_applies(cfg("train.shared_prompt=null", "model.dtype=bfloat16"), Step(),
                                     base_model(model).config)
