"""Vision-language rollouts on the GPU: decode steps of the language model on the fast path, replayed as CUDA graphs
(sampler._graph_safe says why they may be), against transformers' full forward with the pixel values and against
the same steps run eagerly. Runs on a GPU machine; without CUDA there is nothing to run (the CPU twins:
tests/test_vision_sampler.py, tests/test_vision_fast_decode.py)."""

import pytest
import torch
from test_vision_fast_decode import _generate
from test_vision_sampler import G, _model, _OneReturn, _prompts
from vision_models import FAMILIES, FAST_DECODE, full_forward_inputs

from longrl.rollout.sampler import MultiTurn, Sampler
from longrl.rollout.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("ignore")]


def _cuda_model(family: str):
    model, processor = _model(family)
    return model.cuda(), processor


@torch.no_grad()
def _full_forward_logps(model, enc, tokens: list[int]) -> torch.Tensor:
    """log softmax [n, V] of the positions predicting ``tokens`` (after the prompt): one full forward on the GPU."""
    inputs = {k: v.cuda() for k, v in full_forward_inputs(enc, tokens).items()}
    logits = model(**inputs).logits[0, enc["input_ids"].shape[1] - 1:-1].float()
    return torch.log_softmax(logits, -1).cpu()


@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_fast_decode_equals_full_forward(family):
    model, processor = _cuda_model(family)
    prompts = _prompts(model, processor)
    sampler = Sampler(model, processor.tokenizer, sync_every=4)
    fast = family in FAST_DECODE  # Gemma 3: transformers' forward, graphed (its prefill masked by image blocks)
    assert sampler.cuda_graphs and sampler.use_triton and (sampler.fast is not None) is fast
    rollout = _generate(sampler, prompts, SamplingParams(max_new_tokens=12, temperature=0))
    assert sampler.last_stats["fast_decode"] is fast  # the kernels built and ran under the graphs (no fallback)
    for i, completion in enumerate(rollout.completion_ids):
        logps = _full_forward_logps(model, prompts[i // G][2], completion)  # [n, V]
        assert completion == logps.argmax(-1).tolist(), f"sequence {i}"
        expected = logps.gather(1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(rollout.logprobs[i]), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava"])
def test_graph_replay_equals_the_eager_steps(family):
    """Temperature-1 sampling, single and multi-turn: the replayed graphs give the eager fast path's tokens and
    log-probs (the same kernels), and transformers' eager forward's tokens."""
    model, processor = _cuda_model(family)
    prompts = _prompts(model, processor)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7)
    for multi in (False, True):
        runs = {}
        for graphs, fast in ((True, True), (False, True), (False, False)):
            sampler = Sampler(model, processor.tokenizer, cuda_graphs=graphs, fast_decode=fast, sync_every=3)
            assert sampler.cuda_graphs is graphs
            turns = MultiTurn(_OneReturn(), max_tokens=20, workers=1) if multi else None  # (a fresh environment)
            runs[graphs, fast] = _generate(sampler, prompts, params, multi_turn=turns)
            assert sampler.last_stats["fast_decode"] is fast
        graphed, eager, plain = runs[True, True], runs[False, True], runs[False, False]
        assert graphed.completion_ids == eager.completion_ids == plain.completion_ids
        torch.testing.assert_close(torch.tensor(sum(graphed.logprobs, [])), torch.tensor(sum(eager.logprobs, [])),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(sum(graphed.logprobs, [])), torch.tensor(sum(plain.logprobs, [])),
                                   rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava", "gemma3"])
def test_graphed_decode_after_an_environment_picture_equals_full_forward(family):
    """A multi-turn rollout whose environment answers with a picture (tests/test_vision_tool_images.py's): the
    resume prefill places the block's features (Qwen2.5-VL: its mRoPE positions and the shift after it; Gemma 3:
    its image tokens both ways), and the decode steps after it, replayed as CUDA graphs, give transformers' full
    forward's greedy tokens and log-probs with every image."""
    from test_vision_tool_images import _full_forward, _ImageReturn

    model, processor = _cuda_model(family)
    prompts = _prompts(model, processor)
    handler = _ImageReturn(processor, model.config, family)
    sampler = Sampler(model, processor.tokenizer, sync_every=2)
    assert sampler.cuda_graphs
    rollout = sampler.generate([p for p, _, _ in prompts], G, SamplingParams(max_new_tokens=6, temperature=0),
                               multi_turn=MultiTurn(handler, max_tokens=60, workers=1),
                               vision=[v for _, v, _ in prompts])
    model.cpu()
    for i, completion in enumerate(rollout.completion_ids):
        ((at, block),) = rollout.completion_images[i]
        logits = _full_forward(family, model, prompts[i // G][2], block, completion, 6)
        logps = torch.log_softmax(logits[0, len(prompts[i // G][0]) - 1:-1].float(), -1)
        sampled = [j for j in range(len(completion)) if rollout.env_mask[i][j]]
        assert len(sampled) == 12 and [completion[j] for j in sampled] == logps.argmax(-1)[sampled].tolist()
        expected = logps.gather(1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(rollout.logprobs[i])[sampled], expected[sampled], rtol=0, atol=1e-4)
