"""Verify steps on the decode path (Sampler(fast_verify=...), _Run._verify_forward): a verify step of k + 1
positions a slot as a decode step of B·(k + 1) virtual rows, against its twin, the extend forward (transformers'
forward with ExtendMeta): the same logits at every real position and the same keys/values written; the per-row slot
of the decode kernel, the rotary KV write and the FP8 store against their twins; greedy rollouts through it, on the
PyTorch twins and on the Triton kernels under the interpreter. (The sampling law through it: the parametrized tests
of test_speculative_sampler.py.)"""

from __future__ import annotations

import random
import textwrap

import pytest
import torch
from interpreter import run_interpreted
from test_speculative_sampler import assert_same_rollout, fixed, peaked_model

from longrl.rollout import Sampler, SamplingParams
from longrl.rollout.sampler import _Run

# prompts sharing a prefix entry (G = 3 each), of odd lengths
VERIFY_PROMPTS = [[1, 5, 6, 7, 5, 6, 7, 5, 9], [1, 8], [1, 4, 4, 4, 4, 4, 5, 11, 12, 13, 2]]


def random_drafts(k: int, seed: int):
    """Drafts of 0 … k random tokens a step (unequal counts across rows; most rejected)."""
    rng = random.Random(seed)
    return fixed(lambda prompt, i, done: [rng.randrange(20) for _ in range(rng.randint(0, k))])


@torch.no_grad()
def check_verify_forward(use_triton: bool, kv_cache_dtype: str, k: int = 5, seed: int = 0,
                         device: str = "cpu", prompts: list[list[int]] = VERIFY_PROMPTS, G: int = 3,
                         warm_steps: int = 4) -> int:
    """After ``warm_steps`` speculative steps (write indices apart), one more verify step's logits and written
    keys/values by the virtual-row forward equal the extend forward's on the same cache: logits at each row's n + 1
    real positions, the slot stores (dequantized when FP8) at every position either wrote for a real token, and
    nothing else of the cache changed. Returns the rows compared. On the Triton kernels (the interpreter: the
    approximate exp, other summation orders) the logits agree to 2e-3 (the head is scaled × 16) and an FP8 store's
    values to one code step (a key on a rounding boundary may land on either side)."""
    logit_tol = 2e-3 if use_triton else 2e-4
    kv_tol = dict(atol=2e-2, rtol=0.13) if use_triton and kv_cache_dtype == "fp8" else dict(atol=1e-4, rtol=1e-4)
    model, tok = peaked_model(seed=seed)
    model = model.to(device)
    sampler = Sampler(model, tok, kv_cache_dtype=kv_cache_dtype, speculative=random_drafts(k, seed), fast_verify=True)
    sampler.use_triton = use_triton
    params = SamplingParams(max_new_tokens=40, temperature=0.8, seed=seed)
    batch = len(prompts) * G
    with sampler.prepared():
        run = _Run(sampler, prompts, G, params)
        run._admit()
        run._refresh_members()
        for _ in range(warm_steps):
            run._speculative_step(batch)
        state, cache = run.state, run.cache
        assert batch == 1 or len(set(state.write_index[:batch].tolist())) > 1  # rows at different write indices
        rng = random.Random(seed + 1)
        slots = [s for s in range(batch) if s != 4]  # one row not verified (its slot's padding rows run anyway)
        drafts = [[rng.randrange(20) for _ in range(rng.randint(0, k))] for _ in slots]
        drafts[0] = [rng.randrange(20) for _ in range(k)]  # the longest: k
        width = max(map(len, drafts)) + 1
        rows = torch.tensor(slots, device=device)
        padded = torch.zeros(len(slots), width - 1, dtype=torch.long)
        for j, d in enumerate(drafts):
            padded[j, :len(d)] = torch.tensor(d, dtype=torch.long)
        padded = padded.to(device)
        every = torch.zeros(batch, width - 1, dtype=torch.long, device=device)  # the unverified row's: padding
        every[rows] = padded
        before = [t.clone() for t in cache.slot_tensors()]
        fast = run._fast_verify(batch, width - 1, every).clone()  # [batch, width, V]
        after_fast = [t.clone() for t in cache.slot_tensors()]
        for t, b in zip(cache.slot_tensors(), before):
            t.copy_(b)
        lengths = torch.tensor([len(d) for d in drafts], device=device) + 1
        inputs = torch.cat([state.last_token[rows, None], padded], dim=1)
        with sampler.compute_context():
            hidden = run._extend_forward(rows, inputs, state.write_index[rows], lengths)
            twin = sampler.logits(hidden.flatten(0, 1)).view(len(slots), width, -1)
        for j, slot in enumerate(slots):
            n = int(lengths[j])
            torch.testing.assert_close(fast[slot, :n], twin[j, :n], atol=logit_tol, rtol=logit_tol)
        # the keys/values each wrote for real tokens, and everything else of the slot stores unchanged
        real = torch.zeros(cache.k_suf.shape[1], cache.k_suf.shape[3], dtype=torch.bool, device=device)  # [S, T]
        for slot, n in zip(slots, lengths.tolist()):
            w = int(state.write_index[slot])
            real[slot, w:w + n] = True
        got, want = _stores(cache, after_fast), _stores(cache, [t for t in cache.slot_tensors()])
        old = _stores(cache, before)
        for g, w, o in zip(got, want, old):  # [L, S, T, Hkv, D] each (keys, values)
            torch.testing.assert_close(g[:, real], w[:, real], **kv_tol)
            torch.testing.assert_close(w[:, ~real], o[:, ~real], atol=0, rtol=0)  # the twin writes real tokens only
            beyond = ~real.clone()  # the fast path's padding rows write past their row's real tokens only
            for slot in range(batch):
                beyond[slot, int(state.write_index[slot]):] = False
            torch.testing.assert_close(g[:, beyond], o[:, beyond], atol=0, rtol=0)
    return len(slots)


def _stores(cache, tensors: list) -> tuple:
    """(keys, values) [L, S, T, Hkv, D] float32 of the slot tensors (KVCache.slot_tensors' order), dequantized."""
    from longrl.rollout.kv_quant import FP8, dequantize, dequantize_values

    if not cache.fp8:
        return tensors[0].float().transpose(2, 3), tensors[1].float().transpose(2, 3)
    k, v, ke, ve = tensors
    return dequantize(k.view(FP8), ke).transpose(2, 3), dequantize_values(v.view(FP8), ve).transpose(2, 3)


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
def test_virtual_row_verify_equals_the_extend_forward_on_the_twins(kv_cache_dtype):
    assert check_verify_forward(False, kv_cache_dtype) == 8
    assert check_verify_forward(False, kv_cache_dtype, k=3, prompts=VERIFY_PROMPTS[2:], G=1) == 1  # one slot


@pytest.mark.parametrize("B", [1, 2, 3])
@pytest.mark.parametrize("width", [1, 2, 5])
def test_verify_rows_are_copies_with_unit_stride(B, width):
    """Each of a verify step's [B·width] row tensors holds slot b's entry at rows b·width … b·width + width − 1 in
    its own storage with unit stride, the layout the kernels read (row r at base + r). At B = 1 a flattened
    expand is a stride-0 view of one element, which the kernels read past: the fault of fast verify steps with one
    slot left on a GPU."""
    from longrl.rollout.attention import KVCache, verify_meta

    cache = KVCache.allocate(layers=1, kv_heads=1, head_dim=4, prefix_slots=2, prefix_len=8, slots=B, suffix_len=16,
                             dtype=torch.float32, device="cpu")
    prefix_index, prefix_len = torch.arange(B) % 2, torch.arange(B) + 3
    write_index = torch.arange(B) * 4 + 1
    meta = verify_meta(cache, prefix_index, prefix_len, write_index, width, use_triton=False)
    i = torch.arange(width).repeat(B)
    want = dict(prefix_index=prefix_index.repeat_interleave(width), prefix_len=prefix_len.repeat_interleave(width),
                slots=torch.arange(B).repeat_interleave(width),
                write_index=(write_index.repeat_interleave(width) + i).clamp(max=15))
    want["suffix_len"] = want["write_index"] + 1
    for name, expected in want.items():
        got = getattr(meta, name)
        assert got.stride() == (1,) and got.untyped_storage().nbytes() >= got.numel() * got.element_size(), name
        assert torch.equal(got, expected), (name, got, expected)


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("fast_verify", [False, True])
def test_greedy_speculation_on_either_verify_path_equals_plain(kv_cache_dtype, fast_verify):
    """Random drafts (mostly rejected, unequal counts) and the n-gram proposer: plain greedy's tokens and log-probs;
    the verify steps ran on the path asked for."""
    model, tok = peaked_model(seed=2)
    params = SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=(3,))
    plain = Sampler(model, tok, kv_cache_dtype=kv_cache_dtype).generate(VERIFY_PROMPTS, 3, params)
    for speculative in (random_drafts(5, 1), "ngram"):
        sampler = Sampler(model, tok, kv_cache_dtype=kv_cache_dtype, speculative=speculative, fast_verify=fast_verify)
        spec = sampler.generate(VERIFY_PROMPTS, 3, params)
        assert_same_rollout(spec, plain)
        stats = sampler.last_stats
        assert stats["spec_verify_steps"] > 0
        assert stats["spec_fast_verify_steps"] == (stats["spec_verify_steps"] if fast_verify else 0)


def test_fast_verify_by_default_where_triton_runs():
    """The decode-path verify is the default where the sampler runs Triton kernels on CUDA (its one-slot fault's fix,
    test_verify_rows_are_copies_with_unit_stride, ran clean on an H200); on the CPU the extend forward is, unless
    asked."""
    model, tok = peaked_model(seed=0)
    sampler = Sampler(model, tok)
    assert sampler.use_triton is False and sampler.fast_verify is False
    assert Sampler(model, tok, fast_verify=True).fast_verify is True
    assert Sampler(model, tok, fast_verify=False).fast_verify is False


# Under Triton's interpreter: the kernels with a slot per row against their twins (odd shapes, block-crossing
# lengths, several rows a slot, an FP8 cache), then the sampler's verify forward and greedy rollouts on them.
KERNEL_CHECK = textwrap.dedent('''
    import torch
    from longrl.rollout import fused_ops as f
    from longrl.rollout.attention import decode_attention_reference
    from longrl.rollout.decode_kernel import decode_attention_triton
    from longrl.rollout.kv_quant import FP8, quantize_cache, store_decode, store_reference, store_rows

    torch.manual_seed(0)
    for (P, S, W, Hq, Hkv, Lp, T, D) in [(2, 3, 4, 8, 2, 77, 131, 32), (1, 2, 3, 4, 1, 40, 70, 16),
                                         (2, 5, 2, 6, 2, 33, 300, 16)]:
        k_pre, v_pre = torch.randn(P, Hkv, Lp, D), torch.randn(P, Hkv, Lp, D)
        k_suf, v_suf = torch.randn(S, Hkv, T, D), torch.randn(S, Hkv, T, D)
        B = S * W  # W virtual rows a slot, causal by length
        slots = torch.arange(S).repeat_interleave(W)
        slen = (torch.randint(1, T - W + 1, (S,))[:, None] + torch.arange(W)).flatten()
        q = torch.randn(B, Hq, D)
        entry = torch.randint(0, P, (S,))
        entry_len = torch.randint(1, Lp + 1, (P,))
        members = torch.full((P, B), -1, dtype=torch.long)
        members[entry[slots], torch.arange(B)] = torch.arange(B)
        args = (q, k_pre, v_pre, entry[slots], entry_len[entry[slots]], k_suf, v_suf, slen, D ** -0.5)
        ref = decode_attention_reference(*args, slots=slots)
        for kw in ({}, dict(members=members, prompt_len=entry_len)):
            torch.testing.assert_close(decode_attention_triton(*args, slots=slots, **kw), ref, atol=1e-5, rtol=1e-5)
        (kp, kpe), (vp, vpe), (ks, kse), (vs, vse) = quantize_cache(k_pre, v_pre, k_suf, v_suf)
        exp = (kpe, vpe, kse, vse)
        fargs = (q, kp, vp, entry[slots], entry_len[entry[slots]], ks, vs, slen, D ** -0.5)
        ref = decode_attention_reference(*fargs, slots=slots, kv_exp=exp)
        for kw in ({}, dict(members=members, prompt_len=entry_len)):
            torch.testing.assert_close(decode_attention_triton(*fargs, slots=slots, kv_exp=exp, **kw), ref,
                                       atol=2e-2, rtol=2e-2)
        # the FP8 store and the rotary write with a slot per row: the twins' bytes
        widx = torch.randint(0, T, (B,))
        widx = widx[torch.randperm(B)]
        k_new, v_new = torch.randn(B, Hkv, D), torch.randn(B, Hkv, D)
        order = torch.argsort(slots * T + widx)  # distinct (slot, index) pairs
        keep = torch.ones(B, dtype=torch.bool)
        keep[order[1:]] = (slots * T + widx)[order[1:]] != (slots * T + widx)[order[:-1]]
        rows, at = torch.nonzero(keep)[:, 0], widx[keep]
        stores = [[t.clone() for t in (ks, vs, kse, vse)] for _ in range(2)]
        store_decode(k_new[rows], v_new[rows], *stores[0], at, True, slots[rows])
        store_rows(k_new[rows], v_new[rows], *stores[1], slots[rows], at)
        for a, b in zip(*stores):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        cos, sin = torch.randn(len(rows), D), torch.randn(len(rows), D)
        qkv = [torch.randn(len(rows), H * D) for H in (Hq, Hkv, Hkv)]
        caches = [[torch.zeros(S, Hkv, T, D) for _ in range(2)] for _ in range(2)]
        got = f.rotary_kv(*qkv, cos, sin, *caches[0], at, True, slots=slots[rows])
        want = f.rotary_kv_reference(*qkv, cos, sin, *caches[1], at, slots=slots[rows])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        for a, b in zip(*caches):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    print("kernels ok")
''')


def test_kernels_with_a_slot_per_row_equal_their_twins():
    pytest.importorskip("triton")
    assert "kernels ok" in run_interpreted(KERNEL_CHECK)


SAMPLER_CHECK = textwrap.dedent('''
    import sys
    sys.path.insert(0, "tests")
    import torch
    from test_fast_verify import VERIFY_PROMPTS, check_verify_forward, random_drafts
    from test_speculative_sampler import peaked_model
    from longrl.rollout import Sampler, SamplingParams

    for kv in ("bf16", "fp8"):  # (three warm steps: the interpreter's time; the twins' test takes four)
        assert check_verify_forward(True, kv, k=3, warm_steps=3) == 8
        assert check_verify_forward(True, kv, k=3, prompts=VERIFY_PROMPTS[2:], G=1, warm_steps=3) == 1  # one slot
    model, tok = peaked_model(seed=2)
    params = SamplingParams(max_new_tokens=7, temperature=0, stop_token_ids=(3,))
    plain = Sampler(model, tok).generate(VERIFY_PROMPTS, 2, params)
    for speculative in (random_drafts(4, 3), "ngram"):  # host drafts; device drafts in queued chunks
        sampler = Sampler(model, tok, speculative=speculative, fast_verify=True, speculative_fallback=False)
        sampler.use_triton = True
        spec = sampler.generate(VERIFY_PROMPTS, 2, params)
        assert spec.completion_ids == plain.completion_ids, (spec.completion_ids, plain.completion_ids)
        assert sampler.last_stats["spec_fast_verify_steps"] == sampler.last_stats["spec_verify_steps"] > 0
    print("sampler ok")
''')


def test_verify_forward_and_greedy_rollouts_on_the_triton_kernels():
    pytest.importorskip("triton")
    assert "sampler ok" in run_interpreted(SAMPLER_CHECK)
