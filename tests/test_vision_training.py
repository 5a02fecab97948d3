"""Training passes with images (float64): log-probs, cross-entropies and gradients (LoRA parameters, and the vision
tower's with LoRA on it) equal transformers' model run on each sequence with its pixel values (Gemma 3: and its
token_type_ids, its image tokens attending both ways); the vision tower runs once per distinct prompt per call."""

import pytest
import torch
from vision_models import (
    build,
    chat_prompts,
    full_forward_inputs,
    vision_tower,
    with_lora,
)

from longrl.models.policy import sequence_logprobs, token_cross_entropy

GRAD_TOL = 1e-6  # relative: the models' RMSNorm and Qwen's vision rotary compute in float32 even in float64 models,
#                  so layouts that sum in another order differ by float32 rounding (with those in float64, < 1e-12)
pytestmark = pytest.mark.filterwarnings("ignore")


def _setup(family: str, vision_modules: str):
    model, processor = build(family, seed=1, dtype=torch.float64, window=5)  # Gemma 3: a window inside a prompt
    return with_lora(model, vision_modules, seed=2), processor


def _reference_logps(model, enc, completion):
    """log p(completion tokens) [n] from transformers' full forward on prompt + completion with the pixel values."""
    n = len(completion)
    logits = model(**full_forward_inputs(enc, completion, torch.float64)).logits[0, -n - 1:-1]  # [n, V]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def _grads(model, names):
    return {n: p.grad.clone() for n, p in model.named_parameters() if n in names}


@pytest.mark.parametrize("family,vision_modules,packed", [
    ("qwen2_vl", "none", True), ("qwen2_vl", "tower_and_projector", False), ("qwen2_vl", "projector", True),
    ("llava", "none", False), ("llava", "tower_and_projector", True), ("qwen3_vl", "tower_and_projector", True),
    ("idefics3", "projector", True), ("gemma3", "tower_and_projector", True), ("gemma3", "none", False)])
def test_logprobs_and_gradients_equal_per_sequence_forward(family, vision_modules, packed):
    model, processor = _setup(family, vision_modules)
    G, prompts = 2, chat_prompts(model, processor, [((56, 56),), ((56, 28), (28, 56)), ()])
    g = torch.Generator().manual_seed(3)
    prompt_ids, completion_ids, vision, hf = [], [], [], []
    for enc, prompt in prompts:
        for j in range(G):
            length = 3 + 2 * j + len(prompt_ids) % 3  # unequal completion lengths
            completion = torch.randint(40, 90, (length,), generator=g).tolist()
            prompt_ids.append(enc["input_ids"][0].tolist())
            completion_ids.append(completion)
            vision.append(prompt)
            hf.append((enc, completion))
    width = max(len(c) for c in completion_ids)
    weights = torch.randn(len(completion_ids), width, generator=g, dtype=torch.float64)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    calls = []
    hook = vision_tower(model).register_forward_hook(lambda *a: calls.append(1))

    logps, _ = sequence_logprobs(model, prompt_ids, completion_ids, width, pad_id=0, packed=packed, vision=vision)
    (logps * weights).sum().backward()
    assert len(calls) == 2  # the two prompts with images, once each (G = 2 sequences each)
    got = _grads(model, trained)
    model.zero_grad()

    hook.remove()
    ref = torch.zeros_like(logps)
    for i, (enc, completion) in enumerate(hf):
        ref[i, :len(completion)] = _reference_logps(model, enc, completion)
    (ref * weights).sum().backward()
    expected = _grads(model, trained)
    torch.testing.assert_close(logps, ref, rtol=0, atol=1e-10)
    vision_names = [n for n in trained if any(k in n for k in ("visual", "vision_tower", "projector", "connector"))]
    assert bool(vision_names) == (vision_modules != "none")
    for n in trained:
        assert float(expected[n].norm()) > 0, n
        assert float((got[n] - expected[n]).norm() / expected[n].norm()) < GRAD_TOL, n
    assert any(got[n].abs().sum() > 0 for n in vision_names) or vision_modules == "none"

    # token cross-entropy over the same sequences (SFT) through the same inputs
    seqs = [p + c for p, c in zip(prompt_ids, completion_ids)]
    masks = [[False] * len(p) + [True] * len(c) for p, c in zip(prompt_ids, completion_ids)]
    with torch.no_grad():
        ce = token_cross_entropy(model, seqs, masks, pad_id=0, packed=not packed, vision=vision)
    torch.testing.assert_close(-ce, torch.cat([ref[i, :len(c)] for i, c in enumerate(completion_ids)]).detach(),
                               rtol=0, atol=1e-10)


def test_frozen_tower_features_kept_across_calls_and_refusals():
    model, processor = _setup("llava", "none")
    (_, prompt), = chat_prompts(model, processor, [((56, 56),)])
    calls = []
    vision_tower(model).register_forward_hook(lambda *a: calls.append(1))
    ids = [prompt.input_ids] * 3
    completions = [[50, 51], [52], [53, 54, 55]]
    with torch.no_grad():
        first, _ = sequence_logprobs(model, ids, completions, 3, pad_id=0, vision=[prompt] * 3)
        with model.disable_adapter():  # the reference pass: a frozen tower gives the same features
            sequence_logprobs(model, ids, completions, 3, pad_id=0, vision=[prompt] * 3)
        again, _ = sequence_logprobs(model, ids, completions, 3, pad_id=0, vision=[prompt] * 3)
    assert len(calls) == 1 and torch.equal(first, again)
    with torch.no_grad():  # equal completion lengths: stacked rows, no padding or mask; against padded rows
        stacked, _ = sequence_logprobs(model, ids, [[50, 51]] * 3, 2, pad_id=0, vision=[prompt] * 3)
        padded, _ = sequence_logprobs(model, ids, [[50, 51]] * 3, 2, pad_id=0, vision=[prompt] * 3, packed=False)
    torch.testing.assert_close(stacked, padded, rtol=0, atol=1e-12)
    torch.testing.assert_close(stacked[0], first[0, :2], rtol=0, atol=1e-12)
    with torch.no_grad():  # grouped rows take images (tests/test_vision_shared_prompt.py): the kept features serve them
        grouped, _ = sequence_logprobs(model, ids, completions, 3, pad_id=0, vision=[prompt] * 3, shared_prompt=True)
    assert len(calls) == 1
    torch.testing.assert_close(grouped, first, rtol=0, atol=1e-5)  # eager attention: its softmax in float32
    other, _ = build("llava", seed=9, dtype=torch.float64)  # another model's tower does not read the kept features
    other_calls = []
    vision_tower(other).register_forward_hook(lambda *a: other_calls.append(1))
    with torch.no_grad():
        sequence_logprobs(other, ids, completions, 3, pad_id=0, vision=[prompt] * 3)
    assert len(other_calls) == 1
    with pytest.raises(ValueError, match="sequence 1 does not begin"):
        sequence_logprobs(model, [ids[0], ids[0][1:], ids[0]], completions, 3, pad_id=0, vision=[prompt] * 3)
