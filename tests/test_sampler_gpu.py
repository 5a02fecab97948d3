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
    assert sampler.last_stats["fast_decode"]  # the fused kernels built and ran (no fallback)
    assert r.completion_ids == [c for c in cut for _ in range(2)]
    # the call's graphs: one a decode batch size it ran, each timed; the next call captures its own again
    stats = sampler.last_stats
    assert 1 <= stats["graph_captures"] <= stats["decode_steps"] and stats["graph_capture_s"] > 0
    sampler.generate(PROMPTS, 2, SamplingParams(max_new_tokens=n, temperature=0, stop_token_ids=(stop,)))
    assert sampler.last_stats["graph_captures"] == stats["graph_captures"]


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


def test_fused_decode_kernels_round_like_transformers_in_bf16():
    """The fused decode kernels in bfloat16 on the GPU = their PyTorch twins (transformers' arithmetic): residual
    adds, the rotary embedding and the activation exactly; norms within one bf16 unit (float32 sums in another
    order)."""
    from longrl.rollout import fused_ops as f

    torch.manual_seed(0)
    bf, dev = torch.bfloat16, "cuda"

    def one_unit(a, b):
        return bool(((a.float() - b.float()).abs() <= 2 ** -7 * b.float().abs().clamp(min=1)).all())

    for B, d in ((3, 48), (64, 4096), (5, 1536)):
        h, delta = torch.randn(B, d, device=dev).to(bf), torch.randn(B, d, device=dev).to(bf)
        w = (1 + 0.3 * torch.randn(d, device=dev)).to(bf)
        want_h, want_x = f.add_rmsnorm_reference(h.clone(), delta, w, 1e-5)
        got_h, got_x = f.add_rmsnorm(h.clone(), delta, w, 1e-5, True)
        assert torch.equal(got_h, want_h) and one_unit(got_x, want_x)
        g, u = (torch.randn(B, 3 * d, device=dev) * 3).to(bf), torch.randn(B, 3 * d, device=dev).to(bf)
        assert torch.equal(f.decode_silu_mul(g, u, True), f.decode_silu_mul_reference(g, u))
    for B, Hq, Hkv, D, norm in ((3, 6, 2, 16, False), (32, 32, 8, 128, False), (4, 16, 8, 128, True)):
        q, k, v = (torch.randn(B, H * D, device=dev).to(bf) for H in (Hq, Hkv, Hkv))
        ang = torch.rand(B, D // 2, device=dev) * 6
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(bf), torch.cat([ang.sin()] * 2, -1).to(bf)
        qw, kw = ((1 + 0.3 * torch.randn(D, device=dev)).to(bf) for _ in range(2)) if norm else (None, None)
        widx = torch.randperm(11, device=dev)[:B] if B <= 11 else torch.randint(0, 11, (B,), device=dev)
        caches = [[torch.zeros(B + 1, Hkv, 11, D, dtype=bf, device=dev) for _ in range(2)] for _ in range(2)]
        want = f.rotary_kv_reference(q, k, v, cos, sin, *caches[0], widx, qw, kw, 1e-6)
        got = f.rotary_kv(q, k, v, cos, sin, *caches[1], widx, True, qw, kw, 1e-6)
        same = one_unit if norm else torch.equal
        assert same(got, want) and same(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])


def test_packed_decode_lora_folds_round_like_their_twins_on_cuda():
    """The LoRA deltas folded into rotary_kv and silu_mul (the packed decode) on the GPU in bf16: within three bf16
    units of their twins (the r-term sums run in float32 in another order, so a sum on a rounding boundary may
    round the other way, and the operations after it carry that unit on), from strided column blocks as the packed
    product gives them."""
    from longrl.rollout import fused_ops as f

    torch.manual_seed(1)
    bf, dev, r = torch.bfloat16, "cuda", 32

    def units(a, b):  # three bf16 units (see above)
        return bool(((a.float() - b.float()).abs() <= 3 * 2 ** -7 * b.float().abs().clamp(min=1)).all())

    for B, Hq, Hkv, D, norm in ((32, 32, 8, 128, False), (5, 16, 8, 128, True)):
        y = torch.randn(B, (Hq + 2 * Hkv) * D + 3 * r, device=dev).to(bf)
        q, k, v = y[:, :Hq * D], y[:, Hq * D:(Hq + Hkv) * D], y[:, (Hq + Hkv) * D:(Hq + 2 * Hkv) * D]
        lora = f.LoraFold(y[:, (Hq + 2 * Hkv) * D:], (0, r, 2 * r),
                          tuple((0.05 * torch.randn(r, H * D, device=dev)).to(bf) for H in (Hq, Hkv, Hkv)), r)
        ang = torch.rand(B, D // 2, device=dev) * 6
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(bf), torch.cat([ang.sin()] * 2, -1).to(bf)
        qw, kw = ((1 + 0.3 * torch.randn(D, device=dev)).to(bf) for _ in range(2)) if norm else (None, None)
        widx = torch.randint(0, 11, (B,), device=dev)
        caches = [[torch.zeros(B, Hkv, 11, D, dtype=bf, device=dev) for _ in range(2)] for _ in range(2)]
        want = f.rotary_kv_reference(q, k, v, cos, sin, *caches[0], widx, qw, kw, 1e-6, lora)
        got = f.rotary_kv(q, k, v, cos, sin, *caches[1], widx, True, qw, kw, 1e-6, lora)
        assert units(got, want) and units(caches[1][0], caches[0][0]) and units(caches[1][1], caches[0][1])
    for rows, width in ((128, 14336), (7, 8960)):
        y = torch.randn(rows, 2 * width + 2 * r, device=dev)
        y[:, :width] *= 3
        y = y.to(bf)
        lora = f.LoraFold(y[:, 2 * width:], (0, r), tuple((0.05 * torch.randn(r, width, device=dev)).to(bf)
                                                         for _ in range(2)), r)
        g, u = y[:, :width], y[:, width:2 * width]
        assert units(f.decode_silu_mul(g, u, True, lora), f.decode_silu_mul_reference(g, u, lora))


@pytest.mark.parametrize("n", [1, 8, 257, 4096])
def test_uniform_kernel_equals_its_twin_on_cuda_and_in_a_graph(n):
    """The uniforms' compiled kernel (what uniform_for runs on CUDA) gives the PyTorch twin's bits, eagerly and
    replayed from a CUDA graph with new sequence ids and positions."""
    from longrl.rollout import sampling

    g = torch.Generator(device="cuda").manual_seed(n)
    seq = torch.randint(-2 ** 62, 2 ** 62, (n,), device="cuda", generator=g)
    pos = torch.randint(0, 1 << 20, (n,), device="cuda", generator=g)
    for seed in (0, 11, 2 ** 40 + 3, -5):
        got = sampling.uniform_for(seed, seq, pos)
        assert torch.equal(got.view(torch.int64), sampling.uniform_reference(seed, seq, pos).view(torch.int64))
    assert not sampling._UNIFORM_FAILED
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sampling.uniform_for(9, seq, pos)  # compiled before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sampling.uniform_for(9, seq, pos)
    seq.copy_(torch.randint(-2 ** 62, 2 ** 62, (n,), device="cuda", generator=g))
    pos.add_(1)
    graph.replay()
    assert torch.equal(out.view(torch.int64), sampling.uniform_reference(9, seq, pos).view(torch.int64))


@pytest.mark.parametrize("V, T", [(128_256, 1.0), (151_936, 0.7), (3001, 1.3)])
def test_fused_sampling_kernel_equals_the_pytorch_path_on_cuda(V, T):
    """The compiled temperature-sampling kernel against next_tokens' PyTorch path on the same uniforms: the same
    tokens (but where u sits within 1e-6 of a CDF boundary) and log-probs, at real vocabulary sizes."""
    from longrl.rollout.sampling import inverse_cdf_reference, next_tokens, off_boundary_rows, token_logprobs, \
        uniform_for

    g = torch.Generator(device="cuda").manual_seed(V)
    z = torch.randn(512, V, device="cuda", generator=g) * 4
    z[::7, V // 2:] = float("-inf")
    params = SamplingParams(temperature=T, seed=11)
    seq, pos = torch.arange(512, device="cuda"), torch.full((512,), 9, device="cuda")
    tok, logp = next_tokens(z, params, seq, pos)  # on CUDA: the kernel
    probs = torch.softmax(z / T, -1)
    u = uniform_for(params.seed, seq, pos)
    want = inverse_cdf_reference(probs, u)
    bad = off_boundary_rows(probs, u, tok, want)
    assert not bad, (bad, tok[bad].tolist(), want[bad].tolist())
    assert bool(torch.isfinite(z.gather(1, tok[:, None])).all())
    torch.testing.assert_close(logp, token_logprobs(z / T, tok), atol=5e-5, rtol=1e-5)
    plain = next_tokens(z, params, seq, pos, fused=False)
    assert int((plain[0] != tok).sum()) <= 2


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_packed_projections_round_like_the_separate_ones_on_cuda_graphs(arch):
    """generation.pack_projections on the GPU in bf16 under CUDA graphs (LoRA's A rows in the packed product, q/k/v's
    B products inside rotary_kv): the first decode step's log-probs are as close to the float32 model's as the
    unpacked sampler's (the prompt's prefill and first token are the same computation in both: the decode step is
    the first that differs), and every weight is back in its own storage afterwards."""
    import random

    from test_fast_decode import build

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 101) for _ in range(rng.randint(2, 40))] for _ in range(64)]
    greedy = SamplingParams(max_new_tokens=2, temperature=0)
    runs = {}
    for name, dtype, pack in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False),
                              ("packed", torch.bfloat16, True)):
        model = build(arch, seed=4, lora=True)  # drawn in float32 on the CPU: the same weights in every run
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" not in n:  # a bf16 base under float32 adapters, as apply_lora keeps them
                    p.data = p.data.to(dtype)
        model = model.cuda()
        sampler = Sampler(model, None, sync_every=4, pack_projections=pack)
        runs[name] = sampler.generate(prompts, 1, greedy)
        if pack:
            assert sampler.last_stats["fast_decode"] and sampler.last_stats["packed_groups"] == 8
            for n, p in model.named_parameters():
                assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), n
    same = [i for i in range(len(prompts)) if len({runs[k].completion_ids[i][0] for k in runs}) == 1]
    assert len(same) >= len(prompts) // 2, len(same)
    err = {k: sum(abs(runs[k].logprobs[i][1] - runs["fp32"].logprobs[i][1]) for i in same) / len(same)
           for k in ("bf16", "packed")}
    assert err["packed"] <= 2 * err["bf16"] + 1e-3, err


def test_packing_and_release_hold_one_group_of_extra_memory_at_most():
    """Moving the weights into the packed buffers and back costs at most one group's buffer above what is
    allocated at each end (the rollout's KV cache is still allocated at release: a release that cloned every
    weight before freeing any buffer held a second copy of all packed weights: +12 GiB at 8B); while packed, only
    the adapters' A rows are new; after release the allocation is what it was before packing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from longrl.config.schema import LoraConfig
    from longrl.models.loading import apply_lora, base_model
    from longrl.rollout.fast_decode import FastDecoder
    from longrl.rollout.lora_fusion import fused_lora

    cfg = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2)
    model = apply_lora(LlamaForCausalLM(cfg).to(torch.bfloat16), LoraConfig(r=16, alpha=32.0)).cuda()
    slack = 2 * 2**20  # the allocator's rounding of a few small blocks
    with fused_lora(model, torch.bfloat16):
        decoder = FastDecoder(base_model(model))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        assert decoder.prepare_packing() == 4 * cfg.num_hidden_layers
        sizes = [p.weight.numel() * p.weight.element_size() for p in decoder.packs.values()]
        largest = max(sizes)
        a_rows = sum(size - p.bounds[-1][1] * p.weight.shape[1] * p.weight.element_size()
                      for size, p in zip(sizes, decoder.packs.values()))  # the only new bytes while packed
        assert sum(sizes) > 10 * largest  # (the bound below would not tell one group from all of them otherwise)
        assert torch.cuda.max_memory_allocated() - before <= largest + a_rows + slack
        packed = torch.cuda.memory_allocated()
        assert packed - before <= a_rows + slack
        torch.cuda.reset_peak_memory_stats()
        decoder.release_packing()
        assert torch.cuda.max_memory_allocated() - packed <= largest + slack
        assert abs(torch.cuda.memory_allocated() - before) <= slack


def _peaked_greedy_setup(peaked_model, seed: int, kv_cache_dtype: str, slots: int | None):
    """(model on CUDA, tokenizer, Sampler keywords, greedy SamplingParams) of the speculative tests' peaked model:
    ``slots`` decode slots of 40 positions (None: every sequence at once)."""
    model, tok = peaked_model(seed=seed)
    per = KVCache.nbytes(layers=2, kv_heads=2, head_dim=16, tokens=1, dtype=torch.float32)
    kw = dict(kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=per * (slots * 40 + 3 * 11) if slots else None)
    return model.cuda(), tok, kw, SamplingParams(max_new_tokens=32, temperature=0, stop_token_ids=(3,))


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("slots", [None, 3, 1])
def test_speculative_verify_on_cuda_graphs_equals_plain_greedy(kv_cache_dtype, slots):
    """Verify steps as decode steps over virtual rows (the sampler's default on CUDA with Triton: graphs per batch
    bucket and draft count, the compiled kernels), random drafts of unequal counts and the n-gram proposer, continuous
    batching (one slot: every verify step at batch 1, where the fault of 2026-12-05 was), and whole queued steps
    captured as graphs: plain greedy's tokens and log-probs; then the verify forward's logits and writes against the extend forward's (test_fast_verify's check,
    on the GPU's kernels), with several slots and with one."""
    from test_fast_verify import VERIFY_PROMPTS, check_verify_forward, random_drafts
    from test_speculative_sampler import assert_same_rollout, peaked_model

    model, tok, kw, params = _peaked_greedy_setup(peaked_model, 2, kv_cache_dtype, slots)
    plain = Sampler(model, tok, **kw).generate(VERIFY_PROMPTS, 3, params)
    # host drafts; device drafts, the verify forward a graph; device drafts, each whole queued step a graph
    for speculative, whole in ((random_drafts(5, 1), False), ("ngram", False), ("ngram", True)):
        sampler = Sampler(model, tok, speculative=speculative, speculative_graphs=whole, speculative_fallback=False,
                          **kw)  # the decode-path verify: the default on CUDA
        assert sampler.cuda_graphs and sampler.fast_verify
        spec = sampler.generate(VERIFY_PROMPTS, 3, params)
        assert_same_rollout(spec, plain, tol=1e-4)
        stats = sampler.last_stats
        assert stats["spec_fast_verify_steps"] == stats["spec_verify_steps"] > 0 and stats["fast_decode"]
        assert (stats.get("spec_step_graphs", 0) > 0) == whole
    assert check_verify_forward(True, kv_cache_dtype, device="cuda") == 8
    assert check_verify_forward(True, kv_cache_dtype, device="cuda", prompts=VERIFY_PROMPTS[2:], G=1) == 1


@pytest.mark.parametrize("penalty", [1.0, 1.2])
def test_a_queued_verify_step_never_waits_for_the_host(penalty):
    """A queued speculative step (device drafts, the verify forward's CUDA graph, acceptance, kept tokens, draft
    counts; with a repetition penalty, its token sets) runs with CUDA's synchronisation check set to error: nothing
    in it reads the device from the host, so the steps of a chunk queue like plain decode steps."""
    from test_speculative_sampler import peaked_model
    from test_sampler import PROMPTS

    from longrl.rollout.sampler import _Run

    model, tok = peaked_model(seed=4)
    sampler = Sampler(model.cuda(), tok, speculative="ngram", max_draft_tokens=3)
    params = SamplingParams(max_new_tokens=40, temperature=0.8, seed=1, repetition_penalty=penalty)
    with sampler.prepared():
        run = _Run(sampler, PROMPTS, 4, params)
        run._admit()
        run._refresh_members()
        batch = run._bucket(len(PROMPTS) * 4)
        run._queued_verify(batch, 3, 40, run._fast_verify_fits(batch, 3))  # (captures its verify graph)
        torch.cuda.synchronize()
        before = run.state.generated[:batch].clone()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(4):
                run._queued_verify(batch, 3, 40, run._fast_verify_fits(batch, 3))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert bool((run.state.generated[:batch] > before).any())  # the steps emitted tokens


@pytest.mark.parametrize("slots", [None, 3])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("extra_stops", [0, 2000])
def test_whole_step_graphs_equal_forward_graphs(lora, slots, extra_stops):
    """Sampler(step_graphs=True): each plain decode step one CUDA graph (forward, draw, bookkeeping) gives the
    forward-only graphs' tokens and log-probs under one seed, as sequences stop at different steps (batch buckets
    shrink: compaction), with few slots (admissions mid-call); one capture a bucket after its eager first step.
    With thousands of stop ids (here ids past the vocabulary as well) the step still captures (a table lookup, where
    torch.isin sorts and could not be captured)."""
    from test_sampler import PROMPTS, tiny_model

    model, tok = tiny_model(seed=2, lora=lora)
    model = model.cuda()
    n = 30
    per = KVCache.nbytes(layers=2, kv_heads=2, head_dim=16, tokens=1, dtype=torch.float32)
    stops = (3, 7, 11) + tuple(range(len(tok), len(tok) + extra_stops))
    params = SamplingParams(max_new_tokens=n, temperature=0.9, seed=5, stop_token_ids=stops)
    runs, stats = [], []
    for step_graphs in (False, True):
        sampler = Sampler(model, tok, kv_cache_bytes=per * (slots * n + 3 * 9) if slots else None, sync_every=4,
                          min_decode_batch=1, step_graphs=step_graphs)
        assert sampler.step_graphs is step_graphs
        runs.append(sampler.generate(PROMPTS, 4, params))
        stats.append(dict(sampler.last_stats))
    assert runs[1].completion_ids == runs[0].completion_ids
    assert len({len(c) for c in runs[0].completion_ids}) > 1  # the sequences stopped at different steps
    assert runs[1].logprobs == runs[0].logprobs  # the same kernels on the same inputs: the same bits
    assert 1 <= stats[1]["graph_captures"] <= stats[1]["decode_steps"]


def test_a_whole_step_graph_replays_without_host_reads():
    """A graphed plain decode step (after its eager first step and its capture) runs with CUDA's synchronisation
    check set to error, and emits a token per active row each replay."""
    from test_sampler import PROMPTS, tiny_model

    from longrl.rollout.sampler import _Run

    model, tok = tiny_model(seed=3, lora=True)
    sampler = Sampler(model.cuda(), tok, step_graphs=True)
    with sampler.prepared():
        run = _Run(sampler, PROMPTS, 2, SamplingParams(max_new_tokens=40, temperature=1.0, seed=2))
        run._admit()
        run._refresh_members()
        batch = run._bucket(len(PROMPTS) * 2)
        for _ in range(2):  # eager, then captured and replayed
            run._decode_step(batch)
        torch.cuda.synchronize()
        assert ("step", batch) in run.graphs
        before = run.state.generated[:batch].clone()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                run._decode_step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        active = run.state.active[:batch]
        assert bool((run.state.generated[:batch] - before)[active].eq(3).all())


def test_whole_step_graphs_leave_other_draws_to_forward_graphs():
    """With top-p (the PyTorch draw, not checked for host reads) the decode step keeps the forward-only graph:
    the same tokens as without step_graphs, and no whole-step graph."""
    from test_sampler import PROMPTS, tiny_model

    model, tok = tiny_model(seed=4)
    model = model.cuda()
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=1)
    forward_only = Sampler(model, tok)
    plain = forward_only.generate(PROMPTS, 2, params)
    sampler = Sampler(model, tok, step_graphs=True)
    assert sampler.generate(PROMPTS, 2, params).completion_ids == plain.completion_ids
    # the same forward-only graphs: one a bucket from the first step, none held back for a whole-step capture
    assert sampler.last_stats["graph_captures"] == forward_only.last_stats["graph_captures"] >= 1


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("slots", [None, 3])
def test_attention_counters_on_cuda_graphs_equal_the_filled_partials(kv_cache_dtype, slots, monkeypatch):
    """The decode attention's launch choice `counters` (the KV cache's merge counters kept from call to call, the
    partials unfilled) on CUDA graphs: plain greedy's tokens and log-probs as with the filled partials; then the
    kernel alone, replayed from a graph, within float32 rounding of the filled call and its counters back at rest."""
    from test_fast_verify import VERIFY_PROMPTS
    from test_speculative_sampler import assert_same_rollout, peaked_model

    from longrl.rollout import decode_kernel as dk
    from longrl.rollout.merge_counters import COUNT0, merge_counters

    model, tok, kw, params = _peaked_greedy_setup(peaked_model, 3, kv_cache_dtype, slots)
    filled = Sampler(model, tok, **kw).generate(VERIFY_PROMPTS, 3, params)
    monkeypatch.setitem(dk.LAUNCH, "counters", True)
    kept = Sampler(model, tok, **kw).generate(VERIFY_PROMPTS, 3, params)
    assert_same_rollout(kept, filled, tol=1e-4)

    torch.manual_seed(0)
    P, G, Hq, Hkv, Lp, T, D = 2, 8, 32, 8, 1000, 300, 128
    dev = torch.device("cuda")
    mk = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.bfloat16)  # noqa: E731
    k_pre, v_pre, k_suf, v_suf, q = mk(P, Hkv, Lp, D), mk(P, Hkv, Lp, D), mk(P * G, Hkv, T, D), mk(P * G, Hkv, T, D), \
        mk(P * G, Hq, D)
    pidx = torch.arange(P * G, device=dev) // G
    slen = torch.randint(1, T + 1, (P * G,), device=dev)
    args = (q, k_pre, v_pre, pidx, torch.full((P * G,), Lp, device=dev), k_suf, v_suf, slen, D ** -0.5)
    grouping = dict(members=torch.arange(P * G, device=dev).view(P, G), prompt_len=torch.full((P,), Lp, device=dev))
    counters = merge_counters(P * G * Hkv, dev)
    ref = dk.decode_attention_triton(*args, **grouping, launch=dict(counters=False))
    out = dk.decode_attention_triton(*args, **grouping, counters=counters)  # warm-up (builds the kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dk.decode_attention_triton(*args, **grouping, counters=counters)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)
        assert bool((counters == COUNT0).all())
