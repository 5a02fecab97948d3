"""Images from environments and tools inside a trajectory (CPU, float32): the sampler's resume prefill places an
image block's features at its placeholders (Qwen-VL: at mRoPE positions after the text before it; Gemma 3: its
image tokens attending each other both ways), so that greedy tokens and log-probs after it equal transformers' full
forward of the whole sequence with every image; the training passes place them at the index the rollout recorded;
episodes over the vision demo's tiny LLaVA train with images from their environment; a text model ends such an
episode naming why; a tool returning a Pillow image answers with an image part."""

import json

import pytest
import torch
from test_vision_sampler import _model, _prompts
from vision_models import IMAGE_TEXT, full_forward_inputs, images

from longrl.agents.environment import Environment
from longrl.models.policy import sequence_logprobs
from longrl.models.vision import SequenceImages, build_prompt, encode_text, image_token_id
from longrl.rollout.sampler import EnvTokens, MultiTurn, Sampler
from longrl.rollout.sampling import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore")
G = 2
TEXT_OF = {"llava": "llava", "llava_next": "llava", "idefics3": "idefics", "qwen2_vl": "qwen", "qwen2_5_vl": "qwen",
           "qwen3_vl": "qwen", "gemma3": "gemma"}


class _ImageReturn:
    """Answers each sequence's first turn with a short text around one image (its own picture a sequence), then
    ends the episode; ``blocks``: what it returned, by sequence."""

    def __init__(self, processor, config, family):
        self.processor, self.config, self.family = processor, config, family
        self.turns, self.blocks = {}, {}

    def step(self, seq, tokens, room):
        self.turns[seq] = self.turns.get(seq, 0) + 1
        if self.turns[seq] > 1:
            return None
        (pic,) = images(1, seed=100 + seq, sizes=((56, 56),) if seq % 2 else ((28, 56),))  # (Qwen: rope delta -2, 0)
        ids, tensors = encode_text(self.processor, self.config, "T:" + IMAGE_TEXT[TEXT_OF[self.family]] + "ok\n",
                                   [pic])
        self.blocks[seq] = build_prompt(self.config, ids, tensors)
        return EnvTokens(ids, self.blocks[seq])


def _merged(family, enc, block):
    """transformers' inputs with the block's image tensors after the prompt's (Idefics3: one more image of the
    sample, dim 1; else more images, dim 0; LLaVA-NeXT's patches padded to the most of either, as its processor
    pads a batch's: image_sizes says which are real)."""
    out = dict(enc)
    dim = 1 if family == "idefics3" else 0
    for key, value in block.image_inputs.items():
        if key not in out:
            out[key] = value
            continue
        pair = [out[key], value]
        if family == "llava_next" and key == "pixel_values":
            most = max(t.shape[1] for t in pair)
            pair = [torch.nn.functional.pad(t, (0, 0, 0, 0, 0, 0, 0, most - t.shape[1])) for t in pair]
        out[key] = torch.cat(pair, dim=dim)
    return out


def _full_forward(family, model, enc, block, completion, at):
    """transformers' forward of the prompt ``enc`` + ``completion`` holding ``block`` at completion index ``at``,
    with every image (Qwen-VL: the block's placeholders typed as image tokens, from which transformers computes
    the mRoPE positions of the whole sequence itself)."""
    inputs = full_forward_inputs(_merged(family, enc, block), completion)
    for key in ("mm_token_type_ids", "token_type_ids"):  # (Gemma 3's image-block masks are built from the latter)
        if key in inputs:
            inputs[key][0, enc["input_ids"].shape[1] + at + block.image_positions] = 1
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", ["llava", "llava_next", "idefics3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_resume_with_an_image_block_equals_full_forward(family):
    model, processor = _model(family)
    prompts = _prompts(model, processor)  # 1 image, 2 images, a text prompt
    handler = _ImageReturn(processor, model.config, family)
    sampler = Sampler(model, processor.tokenizer, sync_every=2)
    rollout = sampler.generate([p for p, _, _ in prompts], G, SamplingParams(max_new_tokens=4, temperature=0),
                               multi_turn=MultiTurn(handler, max_tokens=40, workers=1),
                               vision=[v for _, v, _ in prompts])
    image_id = image_token_id(model.config)
    assert rollout.completion_images is not None and len(rollout.completion_images) == len(prompts) * G
    for i, completion in enumerate(rollout.completion_ids):
        prompt_ids, _, enc = prompts[i // G]
        ((at, block),) = rollout.completion_images[i]
        assert block is handler.blocks[i] and at == len(prompt_ids) + 4  # after the 4 sampled tokens
        assert completion[4:4 + len(block)] == block.input_ids and image_id in block.input_ids
        logits = _full_forward(family, model, enc, block, completion, 4)
        logps = torch.log_softmax(logits[0, len(prompt_ids) - 1:-1].float(), -1)  # [n, V]
        sampled = [j for j in range(len(completion)) if rollout.env_mask[i][j]]
        assert len(sampled) == 8  # two turns of 4
        assert [completion[j] for j in sampled] == logps.argmax(-1)[sampled].tolist(), f"sequence {i}"
        expected = logps.gather(1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(rollout.logprobs[i])[sampled], expected[sampled], rtol=0, atol=2e-5)
    # the prompts' towers once each (2 with images), and each block's once
    assert sampler.last_stats["vision_tower_calls"] == 2 + len(rollout.completion_ids)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl", "gemma3"])
def test_training_passes_place_the_blocks_where_the_rollout_recorded_them(family):
    """sequence_logprobs with SequenceImages entries give the sampler's log-probs (packed rows, padded rows, and
    with train.shared_prompt's option on, which takes the repeated layout for them); without the blocks (their
    placeholders read as text) they do not; a block whose tokens are not where it says is refused."""
    model, processor = _model(family)
    prompts = _prompts(model, processor)
    sampler = Sampler(model, processor.tokenizer, sync_every=2)
    rollout = sampler.generate([p for p, _, _ in prompts], G, SamplingParams(max_new_tokens=4, temperature=0),
                               multi_turn=MultiTurn(_ImageReturn(processor, model.config, family), max_tokens=40,
                                                    workers=1),
                               vision=[v for _, v, _ in prompts])
    vision = [prompts[i // G][1] for i in range(len(rollout.completion_ids))]
    entries = [SequenceImages(v, tuple(b)) for v, b in zip(vision, rollout.completion_images)]
    width = max(len(c) for c in rollout.completion_ids)
    pad = processor.tokenizer.pad_token_id
    mask = torch.zeros(len(entries), width, dtype=torch.bool)
    sampler_logps = torch.zeros(len(entries), width)
    for i, (m, lp) in enumerate(zip(rollout.env_mask, rollout.logprobs)):
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
        sampler_logps[i, :len(lp)] = torch.tensor(lp)
    for packed, shared in [(True, False), (False, False), (True, True)]:
        with torch.no_grad():
            logps, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.completion_ids, width, pad_id=pad,
                                         packed=packed, shared_prompt=shared, vision=entries)
        torch.testing.assert_close(logps[mask], sampler_logps[mask], rtol=0, atol=2e-5)
    with torch.no_grad():
        without, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.completion_ids, width, pad_id=pad,
                                       vision=vision)
    assert (without[mask] - sampler_logps[mask]).abs().max() > 1e-3
    moved = [SequenceImages(e.prompt, tuple((at + 1, b) for at, b in e.blocks)) for e in entries]
    with pytest.raises(ValueError, match="does not hold its image block's tokens at index"):
        sequence_logprobs(model, rollout.prompt_ids, rollout.completion_ids, width, pad_id=pad, vision=moved)


def test_the_sampler_refuses_a_block_it_cannot_place():
    """A handler returning images to a text model's sampler, or a block whose tokens are not those returned."""
    model, processor = _model("llava")
    prompts = _prompts(model, processor)

    class Mismatch(_ImageReturn):
        def step(self, seq, tokens, room):
            out = super().step(seq, tokens, room)
            return out if out is None else EnvTokens(out.ids[:-1], out.images)

    sampler = Sampler(model, processor.tokenizer, sync_every=2)
    with pytest.raises(ValueError, match="input_ids are not the tokens returned"):
        sampler.generate([prompts[0][0]], 1, SamplingParams(max_new_tokens=2, temperature=0),
                         multi_turn=MultiTurn(Mismatch(processor, model.config, "llava"), max_tokens=30, workers=1),
                         vision=[prompts[0][1]])


class ChartEnvironment(Environment):
    """Answers the first turn with a user message holding a picture (a Pillow image) and a question; the second
    turn ends the episode."""

    def step(self, assistant_message):
        from PIL import Image

        self.turns = getattr(self, "turns", 0) + 1
        if self.turns > 1:
            return [], 1.0, True
        picture = Image.new("RGB", (28, 28), (0, 0, 255))
        return [{"role": "user", "content": [{"type": "image", "image": picture},
                                             {"type": "text", "text": "what colour ?"}]}], None, False


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_grpo_episodes_with_images_from_the_environment(tmp_path, shared_prompt):
    """The vision demo's tiny LLaVA (LoRA, the tower frozen) over episodes whose environment answers with a
    picture: the tower runs once per prompt and once per returned picture in all (the rollout's features kept for
    the passes), the passes score the sampled tokens as the sampler did, and the batch's entries hold the blocks."""
    from test_vision_grpo import _cfg, _count_tower_calls

    from longrl.recipes.grpo import GRPOTrainer
    from longrl.training.reporting import read_metrics

    cfg = _cfg(tmp_path, "lora.enabled=true", "train.max_steps=1", "environment.max_turns=2",
               "environment.max_tokens=48", "generation.max_completion_length=16",
               f"train.shared_prompt={str(shared_prompt).lower()}")
    trainer = GRPOTrainer(cfg, environment_factory=ChartEnvironment)
    calls = _count_tower_calls(trainer)
    trainer.train()
    (metrics,) = read_metrics(tmp_path)
    b = trainer.batch
    returned = [e for e in b.vision if isinstance(e, SequenceImages)]
    assert metrics["agent/env_errors"] == 0 and returned  # (an episode whose first turn left no room has none)
    assert len(calls) == 3 + sum(len(e.blocks) for e in returned)
    assert metrics["sampler/logp_abs_diff"] < 1e-4
    for e, completion in zip(b.vision, b.completion_ids):
        if isinstance(e, SequenceImages):
            (at, block), = e.blocks
            start = at - len(e.prompt)
            assert completion[start:start + len(block)] == block.input_ids
    # completions.jsonl names the pictures rather than writing an object's repr
    logged = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    parts = [p for s in logged for m in s["completion"] if isinstance(m["content"], list) for p in m["content"]
             if p["type"] == "image"]
    assert parts and all(p["image"] == "a Pillow image given in memory" for p in parts)


def test_a_text_model_ends_an_episode_whose_environment_answers_with_an_image():
    from test_agents_env import _runner

    runner, ep = _runner(ChartEnvironment())
    assert runner.step(0, [5], room=10) is None
    assert ep.truncated == "env_error"
    assert ep.error == "ChartEnvironment.step returned 1 image(s): the model has no vision tower"


def test_a_tool_that_returns_a_pillow_image_answers_with_an_image_part():
    from PIL import Image

    from longrl.agents.tool_calls import ToolCall
    from longrl.agents.tools import ToolSet

    def look(name: str):
        """Shows a picture.

        Args:
            name: what to show
        """
        return Image.new("RGB", (8, 8))

    content, failed = ToolSet([look], timeout_s=None).call(ToolCall("look", {"name": "x"}))
    assert not failed and len(content) == 1 and content[0]["type"] == "image"
    assert content[0]["image"].size == (8, 8)
    from longrl.agents.environment import ToolEnvironment, as_step_result

    env = ToolEnvironment(ToolSet([look], timeout_s=None), "qwen")
    reply = env.step({"role": "assistant",
                      "content": '<tool_call>{"name": "look", "arguments": {"name": "x"}}</tool_call>'})
    (message,) = as_step_result(reply, "ToolEnvironment").messages  # (image parts with their image pass the check)
    assert message["role"] == "tool" and message["content"][0]["type"] == "image"


def _vision_runner(env, max_pixels: int = 1_000_000):
    from longrl.agents.tool_images import ToolImages
    from longrl.agents.trajectory import Episode, EpisodeRunner, EpisodeSettings
    from longrl.models.tiny_vision import build_tiny_vision_model
    from longrl.training.vision_inputs import PromptImages

    model, processor = build_tiny_vision_model()
    tok = processor.tokenizer
    ep = Episode(env, [{"role": "user", "content": "what ?"}])
    images = ToolImages(PromptImages(processor, model.config), max_pixels)
    return EpisodeRunner([ep], tok, EpisodeSettings(), None, (tok.eos_token_id,), images), ep, model


def test_the_runner_encodes_an_environment_picture_as_a_block():
    runner, ep, model = _vision_runner(ChartEnvironment())
    out = runner.step(0, [5, 2], room=40)  # a turn ending with <eos>
    assert isinstance(out, EnvTokens) and out.images.input_ids == out.ids
    assert out.ids.count(image_token_id(model.config)) == 4  # the tiny LLaVA's 4 tokens an image
    assert tuple(out.images.image_inputs["pixel_values"].shape) == (1, 3, 28, 28)
    assert ep.truncated is None and ep.messages[-1]["content"][0]["type"] == "image"


class MissingPicture(Environment):
    def __init__(self, path):
        super().__init__()
        self.path = path

    def step(self, assistant_message):
        return [{"role": "user", "content": [{"type": "image", "image": self.path}]}], None, False


def test_an_unreadable_or_oversized_picture_ends_its_episode_naming_it(tmp_path):
    runner, ep, _ = _vision_runner(MissingPicture(str(tmp_path / "gone.png")))
    assert runner.step(0, [5, 2], room=40) is None
    assert ep.truncated == "env_error" and "MissingPicture.step (turn 1), image 1" in ep.error
    assert "gone.png" in ep.error
    from PIL import Image

    big = tmp_path / "big.png"
    Image.new("RGB", (40, 40)).save(big)
    runner, ep, _ = _vision_runner(MissingPicture(str(big)), max_pixels=100)
    assert runner.step(0, [5, 2], room=40) is None
    assert ep.truncated == "env_error" and "big.png" in ep.error and "more than data.max_image_pixels=100" in ep.error
