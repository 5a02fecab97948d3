"""The sampler's CUDA path (CUDA graphs + the compiled Triton kernels) against transformers' greedy decoding.
Runs on a GPU machine (`bash benchmarks/device_run.sh kernel`); without CUDA there is nothing to run."""

import pytest
import torch

from longrl.rollout import Sampler, SamplingParams
from longrl.rollout.attention import KVCache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("slots", [None, 3])
def test_cuda_graph_sampler_equals_transformers_greedy(lora, slots):
    from test_sampler import PROMPTS, tiny_model

    model, tok = tiny_model(seed=0, lora=lora)
    model = model.cuda()
    n = 24
    with torch.no_grad():
        expected = []
        for p in PROMPTS:
            out = model.generate(input_ids=torch.tensor([p], device="cuda"), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    stop = expected[0][5]
    cut = [e[:e.index(stop) + 1] if stop in e else e for e in expected]
    per = KVCache.nbytes(layers=2, kv_heads=2, head_dim=16, tokens=1, dtype=torch.float32)
    sampler = Sampler(model, tok, kv_cache_bytes=per * (slots * n + 3 * 9) if slots else None, sync_every=4)
    assert sampler.cuda_graphs and sampler.use_triton
    r = sampler.generate(PROMPTS, 2, SamplingParams(max_new_tokens=n, temperature=0, stop_token_ids=(stop,)))
    assert r.completion_ids == [c for c in cut for _ in range(2)]


def test_fused_lora_equals_peft_on_cuda_graphs():
    """The rollout's fused LoRA (CUDA graphs, bf16 autocast off: float32) = PEFT's forward through the same path."""
    from test_sampler import PROMPTS, tiny_model

    model, tok = tiny_model(seed=1, lora=True)
    model = model.cuda()
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=3)
    runs = [Sampler(model, tok, fuse_lora=fuse, sync_every=4).generate(PROMPTS, 3, params) for fuse in (True, False)]
    assert runs[0].completion_ids == runs[1].completion_ids
    torch.testing.assert_close(torch.tensor(sum(runs[0].logprobs, [])), torch.tensor(sum(runs[1].logprobs, [])),
                               atol=1e-4, rtol=1e-4)
