"""Gemma 3's image-block masks (models/vision/masks.py) against transformers' full forward with the pixel values and
token_type_ids (which builds its own masks), float64: sequences packed in one row, right-padded rows and stacked rows,
SDPA (boolean masks) and eager attention (additive), a sliding window shorter than an image's tokens; the logits and
the gradients of every parameter (tower, projector, language model)."""

import pytest
import torch
from vision_models import build, chat_prompts, full_forward_inputs

from longrl.models import base_model, model_parts
from longrl.models.vision import FeatureCache, Placement, image_block_mask, language_model_inputs, layer_masks

pytestmark = pytest.mark.filterwarnings("ignore")
WINDOW = 3  # < the 4 soft tokens of an image: the window cuts into the blocks
GRAD_TOL = 1e-6  # relative: Gemma's RMSNorm computes in float32 inside the float64 model (its weights' gradients sum
#                  in float32 and differ by its rounding between layouts; every other gradient to ~1e-15)


def _sequences(model, processor, stacked: bool):
    """[(transformers inputs of the prompt, VisionPrompt or None, completion)]: prompts with 1, 2 and no images
    (stacked: the 2-image prompt twice, equal lengths)."""
    g = torch.Generator().manual_seed(7)
    prompts = chat_prompts(model, processor, [((56, 56),), ((56, 28), (28, 56)), ()])
    if stacked:
        return [(prompts[1][0], prompts[1][1], torch.randint(40, 90, (4,), generator=g).tolist()) for _ in range(2)]
    return [(enc, prompt, torch.randint(40, 90, (3 + k,), generator=g).tolist()) for k, (enc, prompt) in
            enumerate(prompts)]


def _layout(seqs, layout: str):
    """(input_ids [rows, L], text positions [rows, L], placements) of the sequences in ``layout``."""
    tokens = [enc["input_ids"][0].tolist() + c for enc, _, c in seqs]
    if layout == "packed":
        starts = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        ids = torch.tensor([sum(tokens, [])])
        positions = torch.cat([torch.arange(len(t)) for t in tokens])[None]
        return ids, positions, [Placement(0, s, len(t), p) for s, t, (_, p, _) in zip(starts, tokens, seqs)]
    width = max(len(t) for t in tokens)
    ids = torch.zeros(len(tokens), width, dtype=torch.long)
    for i, t in enumerate(tokens):
        ids[i, :len(t)] = torch.tensor(t)
    positions = torch.arange(width)[None].expand(len(tokens), -1)
    return ids, positions, [Placement(i, 0, len(t), p) for i, (t, (_, p, _)) in enumerate(zip(tokens, seqs))]


def _grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", ["packed", "padded", "stacked"])
def test_masks_give_transformers_forward_and_gradients(layout, attention):
    model, processor = build("gemma3", seed=3, dtype=torch.float64, window=WINDOW)
    model.set_attn_implementation(attention)
    seqs = _sequences(model, processor, stacked=layout == "stacked")
    ids, positions, placements = _layout(seqs, layout)
    g = torch.Generator().manual_seed(8)
    weights = [torch.randn(len(enc["input_ids"][0]) + len(c), model.config.text_config.vocab_size, generator=g,
                           dtype=torch.float64) for enc, _, c in seqs]

    backbone, head, _ = model_parts(model)
    inputs = language_model_inputs(model, ids, positions, placements, FeatureCache(model, placements[0].prompt.family))
    masks = layer_masks(backbone.config, placements, ids.shape[0], ids.shape[1], "cpu", attention, torch.float64)
    assert set(masks) == {"full_attention", "sliding_attention"}
    for m in masks.values():  # boolean for SDPA, additive for eager; no query row without a key
        assert m.shape == (ids.shape[0], 1, ids.shape[1], ids.shape[1])
        assert m.dtype == (torch.bool if attention == "sdpa" else torch.float64)
        assert bool(((m if m.dtype == torch.bool else m == 0).any(-1)).all())
    logits = head(backbone(**inputs, attention_mask=masks, use_cache=False).last_hidden_state)  # [rows, L, V]
    loss = sum((logits[p.row, p.start:p.start + p.length] * w).sum() for p, w in zip(placements, weights))
    loss.backward()
    got = _grads(model)

    for (enc, _, completion), p, w in zip(seqs, placements, weights):
        want = model(**full_forward_inputs(enc, completion, torch.float64)).logits[0]  # token_type_ids: its masks
        torch.testing.assert_close(logits[p.row, p.start:p.start + p.length], want, rtol=0, atol=1e-12)
        (want * w).sum().backward()
    expected = _grads(model)
    # eager attention's softmax runs in float32: an absolute floor for the tower's key bias, whose exact gradient is 0
    floor = 1e-14 if attention == "sdpa" else 1e-6
    assert got.keys() == expected.keys() and any(n.startswith("model.vision_tower") for n in got)
    for n in expected:
        assert float((got[n] - expected[n]).norm()) <= GRAD_TOL * float(expected[n].norm()) + floor, n


def test_blocks_are_each_images_run_and_sequences_stay_apart():
    """Two images in a prompt are two blocks (an image's first token sees its last, not the next image's); packed
    sequences never see each other; padding sees itself only; causal elsewhere."""
    model, processor = build("gemma3")
    (_, one), (_, two) = chat_prompts(model, processor, [((56, 56),), ((56, 28), (28, 56))])
    a, b = one.image_positions.tolist(), two.image_positions.tolist()
    assert len(a) == 4 and b[4] > b[3] + 1  # 4 soft tokens an image; the second image's run after the markers
    placements = [Placement(0, 0, len(one), one), Placement(0, len(one), len(two), two)]
    m = image_block_mask(placements, 1, len(one) + len(two) + 2, "cpu")[0, 0]  # 2 padding columns at the end
    s = len(one)
    assert m[a[0], a[3]] and m[a[3], a[0]] and m[a[0], a[0] - 1] and not m[a[0] - 1, a[0]]
    assert m[s + b[0], s + b[3]] and not m[s + b[0], s + b[4]] and m[s + b[4], s + b[0]]
    assert not m[s:, :s].any() and not m[:s, s:].any()
    assert torch.equal(m[-2:, -2:], torch.eye(2, dtype=torch.bool)) and not m[-2:, :-2].any()
    text = torch.tensor([i not in a for i in range(s)])
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    assert torch.equal(m[:s, :s][text], causal[text])


@pytest.mark.parametrize("reuse", [False, True])
def test_masks_under_offloaded_checkpointing(reuse):
    """The masks reach every recomputed layer: log-probs and gradients (LoRA on the tower too) under offloaded
    checkpointing, with the attention outputs replayed when ``reuse``, equal those without checkpointing."""
    from vision_models import with_lora

    from longrl.memory.offload import enable_offloaded_checkpointing
    from longrl.models.policy import sequence_logprobs

    model, processor = build("gemma3", seed=3, dtype=torch.float64, window=WINDOW)
    model = with_lora(model, "tower_and_projector", seed=2)
    base_model(model).get_decoder().set_attn_implementation("sdpa")
    seqs = _sequences(model, processor, stacked=False)
    prompt_ids = [enc["input_ids"][0].tolist() for enc, _, _ in seqs]
    completions, vision = [c for _, _, c in seqs], [p for _, p, _ in seqs]
    weights = torch.randn(len(seqs), 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def run():
        model.zero_grad(set_to_none=True)
        logps, _ = sequence_logprobs(model, prompt_ids, completions, 5, pad_id=0, vision=vision)
        (logps * weights).sum().backward()
        return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = run()
    model.train()
    enable_offloaded_checkpointing(model, reuse_attention=reuse)
    got, grads = run()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert grads.keys() == want_grads.keys() and any("vision_tower" in n for n in grads)
    for n in want_grads:
        assert float((grads[n] - want_grads[n]).norm()) <= GRAD_TOL * float(want_grads[n].norm()) + 1e-14, n
