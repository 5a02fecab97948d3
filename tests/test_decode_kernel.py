"""The Triton decode attention (the sampler's GPU fast path) against its PyTorch twin, run on the CPU through
Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported, hence a subprocess): odd shapes,
GQA, chunk-crossing lengths, per-sequence and grouped prefix reads; then the whole sampler on the kernel."""

import textwrap

import pytest
from interpreter import run_interpreted

pytest.importorskip("triton")

KERNEL_CHECK = textwrap.dedent('''
    import torch
    from longrl.rollout.attention import decode_attention_reference
    from longrl.rollout.decode_kernel import decode_attention_triton
    from longrl.rollout.merge_counters import merge_counters

    torch.manual_seed(int(__import__("sys").argv[1]))
    for (P, S, Hq, Hkv, Lp, T, D) in [(3, 7, 8, 2, 77, 131, 32), (2, 5, 6, 2, 64, 65, 16), (1, 3, 4, 4, 1, 1, 16),
                                      (2, 2, 4, 1, 130, 700, 24), (1, 2, 4, 2, 40, 1500, 16),  # > 16 partials
                                      (2, 3, 4, 1, 1100, 9, 16),  # a prompt over the largest prefix chunk (1,024)
                                      (1, 9, 16, 2, 150, 5, 16)]:  # 9 × 8 rows > 64: two subgroups per prompt
        k_pre, v_pre = torch.randn(P, Hkv, Lp, D), torch.randn(P, Hkv, Lp, D)
        k_suf, v_suf, q = torch.randn(S, Hkv, T, D), torch.randn(S, Hkv, T, D), torch.randn(S, Hq, D)
        pidx = torch.randint(0, P, (S,))
        entry_len = torch.randint(0, Lp + 1, (P,))
        entry_len[0] = Lp  # one whole prompt: every prefix chunk has keys
        slen = torch.randint(1, T + 1, (S,))
        members = torch.full((P, S), -1, dtype=torch.long)
        members[pidx, torch.arange(S)] = torch.arange(S)
        args = (q, k_pre, v_pre, pidx, entry_len[pidx], k_suf, v_suf, slen, D ** -0.5)
        ref = decode_attention_reference(*args)
        # the default launch (these calls have few (row, key head) pairs: LAUNCH["few"]'s blocks of 64 and chunks
        # of at least 128 keys), the table without it (chunks of one block), then few programs: chunks of many
        # blocks, a prompt's keys in chunks of up to 1,024
        counters = merge_counters(S * Hkv, "cpu")  # at rest
        for kw in ({}, dict(members=members, prompt_len=entry_len),
                   dict(members=members, prompt_len=entry_len, launch=dict(few=None)),
                   dict(members=members, prompt_len=entry_len, launch=dict(programs=32, prefix_programs=1))):
            torch.testing.assert_close(decode_attention_triton(*args, **kw), ref, atol=1e-5, rtol=1e-5)
            kept = decode_attention_triton(*args, **{**kw, "launch": {**kw.get("launch", {}), "counters": True}},
                                           counters=counters)  # unfilled partials, counters kept across calls
            torch.testing.assert_close(kept, ref, atol=1e-5, rtol=1e-5)
    print("kernel ok")
''')

FUSED_CHECK = textwrap.dedent('''
    import torch
    from triton.runtime import interpreter
    from longrl.rollout import decode_kernel as dk
    from longrl.rollout.attention import decode_attention_reference

    dk.LAUNCH["few"] = None  # the table's chunks of one block at these sizes (the live-chunk arithmetic below)

    class SharedCounter:  # _chunk_kernel launched with one counter buffer kept across calls: the kernel resets it
        def __init__(self, kernel):
            self.kernel, self.count = kernel, None

        def __getitem__(self, grid):
            def launch(*args, **kw):
                args = list(args)
                if self.count is None:
                    self.count = torch.full_like(args[11], dk.COUNT0)  # COUNT: B · Hkv int32
                args[11] = self.count
                self.kernel[grid](*args, **kw)
                assert bool((self.count == dk.COUNT0).all()), self.count  # back at rest after the launch
            return launch

    builder = interpreter.interpreter_builder  # runs the programs one by one, chunk index c innermost, ascending
    ascending = builder.set_grid_idx

    def descending(x, y, z):  # each (b, h)'s chunk programs the other way round: another program merges
        ascending(x, y, builder.grid_dim[2] - 1 - z)

    torch.manual_seed(0)
    P, S, Hq, Hkv, Lp, T, D = 2, 6, 4, 2, 50, 300, 16
    k_pre, v_pre = torch.randn(P, Hkv, Lp, D), torch.randn(P, Hkv, Lp, D)
    k_suf, v_suf, q = torch.randn(S, Hkv, T, D), torch.randn(S, Hkv, T, D), torch.randn(S, Hq, D)
    pidx = torch.tensor([0, 1, 1, 0, 1, 0])
    entry_len = torch.tensor([Lp, 0])
    members = torch.full((P, S), -1, dtype=torch.long)
    members[pidx, torch.arange(S)] = torch.arange(S)
    shared = SharedCounter(dk._chunk_kernel)
    # sequences: prompt only (suffix 0: the first suffix chunk merges with no keys), one suffix chunk only, two,
    # prompt + many suffix chunks, no keys at all (0/0: NaN, as the reference), prompt + one suffix key; the second
    # lengths other live counts on the same counter buffer
    for order in (ascending, descending):
        builder.set_grid_idx = order
        for slen in (torch.tensor([0, 5, 33, T, 0, 1]), torch.tensor([7, 40, 1, 200, 3, 64])):
            args = (q, k_pre, v_pre, pidx, entry_len[pidx], k_suf, v_suf, slen, D ** -0.5)
            ref = decode_attention_reference(*args)
            no_keys = (entry_len[pidx] == 0) & (slen == 0)
            for kw, keys in ((dict(), Lp + T), (dict(members=members, prompt_len=entry_len), T)):
                chunk = dk._chunk_size(keys, S * Hkv, dk.BLOCK, dk.LAUNCH["programs"])
                live = -(-entry_len[pidx] // chunk) * (keys > T) + -(-slen // chunk)  # chunk programs with keys
                assert 1 in live.tolist() and int(live.max()) > 2  # rows of one live chunk and of several
                fused = dk.decode_attention_triton(*args, **kw)
                unfused = dk.decode_attention_triton(*args, **kw, fused_merge=False)
                # the same partials and the same _merge_rows over the same columns in the same order (blocks of 16
                # columns both: REP = 2): exactly equal under the interpreter (numpy; on a GPU the two compiled
                # reductions may round apart, and at REP > 2 the fused merge takes smaller blocks)
                torch.testing.assert_close(fused, unfused, rtol=0, atol=0, equal_nan=True)
                torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5, equal_nan=True)
                assert bool(fused[no_keys].isnan().all()) and bool(fused[~no_keys].isfinite().all())
                dk._chunk_kernel, kernel = shared, dk._chunk_kernel
                try:
                    again = dk.decode_attention_triton(*args, **kw)
                finally:
                    dk._chunk_kernel = kernel
                torch.testing.assert_close(again, fused, rtol=0, atol=0, equal_nan=True)
                # persistent counters, partials left unfilled (here 3.0: a finite m, so a column read that no
                # program wrote would count): the merge reads the written columns alone, bit for bit the filled
                # call's result
                dk._scratch, scratch = (lambda shape, device: torch.full(shape, 3.0)), dk._scratch
                try:
                    counters = torch.full((S * Hkv + 3,), dk.COUNT0, dtype=torch.int32)
                    for _ in range(2):  # the second call on the counters the first left
                        kept = dk.decode_attention_triton(*args, **kw, counters=counters, launch=dict(counters=True))
                        torch.testing.assert_close(kept, fused, rtol=0, atol=0, equal_nan=True)
                        assert bool((counters == dk.COUNT0).all()), counters  # back at rest
                    # off by default: the counters are not touched
                    off = dk.decode_attention_triton(*args, **kw, counters=torch.zeros(S * Hkv, dtype=torch.int32))
                    torch.testing.assert_close(off, fused, rtol=0, atol=0, equal_nan=True)
                    if "members" in kw:  # a slot its entry does not list (a free one): its suffix alone, as filled
                        unlisted = members.clone()
                        unlisted[pidx[3], 3] = -1
                        filled = dk.decode_attention_triton(*args, members=unlisted, prompt_len=entry_len)
                        kept = dk.decode_attention_triton(*args, members=unlisted, prompt_len=entry_len,
                                                          counters=counters, launch=dict(counters=True))
                        torch.testing.assert_close(kept, filled, rtol=0, atol=0, equal_nan=True)
                finally:
                    dk._scratch = scratch
    print("fused ok")
''')


SAMPLER_CHECK = textwrap.dedent('''
    import sys
    sys.path.insert(0, "tests")
    import torch
    from test_sampler import PROMPTS, hf_greedy, tiny_model
    from longrl.rollout import Sampler, SamplingParams
    from longrl.rollout.attention import KVCache

    model, tok = tiny_model(seed=0, lora=True)
    n = 8
    expected = [hf_greedy(model, p, n) for p in PROMPTS]
    stop = expected[0][3]
    cut = [e[:e.index(stop) + 1] if stop in e else e for e in expected]
    per = KVCache.nbytes(layers=2, kv_heads=2, head_dim=16, tokens=1, dtype=torch.float32)
    from longrl.rollout import decode_kernel
    # all at once; 3 slots (queueing, refills, compaction); 3 slots with the cache's merge counters kept across
    # layers and steps (the partials unfilled)
    for kv, counters in ((None, False), (per * (3 * n + 3 * 9), False), (per * (3 * n + 3 * 9), True)):
        decode_kernel.LAUNCH["counters"] = counters
        sampler = Sampler(model, tok, kv_cache_bytes=kv, sync_every=2)
        sampler.use_triton = True
        r = sampler.generate(PROMPTS, 2, SamplingParams(max_new_tokens=n, temperature=0, stop_token_ids=(stop,)))
        assert r.completion_ids == [c for c in cut for _ in range(2)], (kv, r.completion_ids)
    print("sampler ok")
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_decode_attention_equals_the_reference(seed):
    assert "kernel ok" in run_interpreted(KERNEL_CHECK, str(seed))


def test_fused_merge_equals_the_merge_launch():
    """The merge inside the chunk launch (the last live chunk program of a (sequence, key head) merges its rows)
    against the separate merge launch, bit for bit, and the reference: rows of one live chunk, of several, of a
    prompt only, of no keys, the programs run in either order; its counter buffer at rest after each launch and
    kept across calls. With the caller's counters and unfilled (NaN) partials: the same result bit for bit, the
    counters back at rest."""
    assert "fused ok" in run_interpreted(FUSED_CHECK)


def test_sampler_on_the_triton_kernel_equals_transformers_greedy():
    assert "sampler ok" in run_interpreted(SAMPLER_CHECK)


SHORT_CHECK = textwrap.dedent('''
    import torch
    from longrl.rollout.attention import decode_attention_reference
    from longrl.rollout.decode_kernel import decode_attention_triton

    torch.manual_seed(0)
    P, S, Hq, Hkv, Lp, T, D = 1, 2, 4, 2, 40, 70, 16
    k_pre, v_pre = torch.randn(P, Hkv, Lp, D), torch.randn(P, Hkv, Lp, D)
    k_suf, v_suf, q = torch.randn(S, Hkv, T, D), torch.randn(S, Hkv, T, D), torch.randn(S, Hq, D)
    args = (q, k_pre, v_pre, torch.zeros(S, dtype=torch.long), torch.full((S,), Lp), k_suf, v_suf,
            torch.tensor([5, T]), D ** -0.5)
    torch.testing.assert_close(decode_attention_triton(*args), decode_attention_reference(*args), atol=1e-5, rtol=1e-5)
    print("kernel ok")
''')


def test_any_interpreter_setting_runs_the_kernels_to_chunk_end():
    """TRITON_INTERPRET=true (or on, yes) interprets as =1 does: the key loops must not stop at a bound computed in
    the kernel there (the interpreter cannot use one: it raised)."""
    import os
    import subprocess
    import sys

    from interpreter import ROOT

    out = subprocess.run([sys.executable, "-c", SHORT_CHECK], capture_output=True, text=True, cwd=ROOT, timeout=900,
                         env={**os.environ, "TRITON_INTERPRET": "true"})
    assert out.returncode == 0 and "kernel ok" in out.stdout, out.stderr[-3000:]


def test_a_least_chunk_rounds_up_to_a_power_of_two_and_keeps_the_1024_cap():
    """min_chunk's arithmetic (_chunk_size's ``least``): 8 rows × 8 key heads over a 256-position store split into
    chunks of one 32-key block by default, of 128 keys with a least chunk of 100; a 20K store keeps 1,024."""
    from longrl.rollout import decode_kernel as dk

    assert dk._chunk_size(256, 64, 32, 2048) == 32
    assert dk._chunk_size(256, 64, 32, 2048, least=100) == 128
    assert dk._chunk_size(256, 64, 64, 128) == 128  # few target programs: the same chunks
    assert dk._chunk_size(20480, 64, 32, 2048, least=128) == 1024
    assert dk._chunk_size(20480, 64, 32, 2048, least=4096) == 1024


def test_few_pairs_take_their_own_choices_and_the_caller_still_decides():
    """_launch_for: a 16-bit cache's call of at most few["pairs"] (row, key head) pairs takes the few-pair blocks
    and least chunk; one more pair, an FP8 cache, or few turned off keep the table; the caller's entries win."""
    from longrl.rollout import decode_kernel as dk

    few = dk.LAUNCH["few"]
    small = dk._launch_for(few["pairs"], False, None)
    assert (small["block"], small["min_chunk"]) == (few["block"], few["min_chunk"])
    large = dk._launch_for(few["pairs"] + 1, False, None)
    assert (large["block"], large["min_chunk"]) == (dk.LAUNCH["block"], dk.LAUNCH["min_chunk"])
    assert dk._launch_for(8, True, None)["block"] == dk.FP8_LAUNCH["block"]  # an FP8 cache: its own blocks
    assert dk._launch_for(8, False, {"few": None})["block"] == dk.LAUNCH["block"]
    assert dk._launch_for(8, False, {"block": 32})["block"] == 32
    assert dk._launch_for(8, False, {"counters": True})["min_chunk"] == few["min_chunk"]
