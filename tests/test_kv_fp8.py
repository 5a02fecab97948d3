"""The FP8 KV cache (generation.kv_cache_dtype=fp8): the quantizer's scale and error bound, its Triton store kernel
and the FP8 decode attention kernel against their PyTorch twins under Triton's interpreter (odd head sizes, GQA,
chunk-crossing lengths, grouped prefix reads), the attention and the sampled log-probs within stated tolerances of
full-precision keys/values, slots that move keep their scales, and the memory arithmetic (twice the sequences)."""

import textwrap

import pytest
import torch
from interpreter import run_interpreted

from longrl.memory.planner import V_ALIGN, ModelShape, kv_bytes_per_token, max_rollout_slots
from longrl.ops.rollout_correction import rollout_correction_weights
from longrl.rollout import Sampler, SamplingParams
from longrl.rollout.attention import KVCache, decode_attention_reference
from longrl.rollout.kv_quant import (FP8, FP8_MAX, dequantize, dequantize_values, pow2, quantize_cache, quantize_reference,
                                     quantize_values)

# Stated tolerances. e4m3 keeps 3 mantissa bits: each normal element within 2^-4 of itself (relative). Attention
# over unit-variance random keys/values: output within ATTN_REL of full precision (‖Δ‖ / ‖o‖; measured 0.04 at
# these shapes); sampled log-probs of the tiny model within LOGP_MEAN (mean |Δ|) and LOGP_MAX of its own.
ATTN_REL, LOGP_MEAN, LOGP_MAX = 0.08, 0.02, 0.15


def _rows(n=600, d=40):
    x = torch.randn(n, d) * torch.logspace(-7, 5, n)[:, None]
    x[0] = 0.0  # an all-zero row
    x[1, 3] = 448.0 * 2.0 ** 5  # exactly 448 · 2^e: the largest value of its scale
    x[2, :] = 1e-38  # near float32's normal limit
    return x


def test_quantizer_picks_the_smallest_power_of_two_scale_and_bounds_the_error():
    x = _rows()
    q, e = quantize_reference(x)
    assert q.dtype == FP8 and e.dtype == torch.int8 and q.shape == x.shape and e.shape == x.shape[:1]
    amax = x.abs().amax(-1)
    scale = pow2(e.int())
    assert torch.all(amax <= FP8_MAX * scale)  # nothing clipped
    live = (amax > 0) & (amax > 2.0 ** -100)
    assert torch.all(amax[live] > FP8_MAX * scale[live] / 2)  # and the smallest such scale
    assert int(e[1]) == 5 and float(q[1, 3].float()) == FP8_MAX
    xh = dequantize(q, e)
    normal = (x.abs() >= 2.0 ** -6 * scale[:, None])
    assert torch.all((xh - x).abs()[normal] <= 2.0 ** -4 * x.abs()[normal])
    assert torch.all((xh - x).abs()[~normal] <= 2.0 ** -10 * scale[:, None].expand_as(x)[~normal])
    assert torch.equal(dequantize(q[:1], e[:1]), torch.zeros(1, 40))


def test_values_are_stored_position_minor_and_read_back_as_the_keys_are():
    torch.manual_seed(3)
    x = torch.randn(2, 3, 70, 24)
    q, e = quantize_values(x)
    assert q.shape == (2, 3, 24, 128) and e.shape == (2, 3, 70)  # 70 positions → a capacity of 128
    assert torch.equal(q[..., 70:].view(torch.uint8), torch.zeros(2, 3, 24, 58, dtype=torch.uint8))
    kq, ke = quantize_reference(x)
    assert torch.equal(q[..., :70].transpose(-1, -2).view(torch.uint8), kq.view(torch.uint8)) and torch.equal(e, ke)
    assert torch.equal(dequantize_values(q, e), dequantize(kq, ke))


def test_the_kv_budget_counts_the_value_stores_padding():
    from longrl.memory.planner import rollout_kv_bytes

    # 1 prompt entry of 9 positions and 1 slot of 12: the value stores hold 128 each, 119 + 116 positions of padding
    kv = dict(prompts=1, G=1, prompt_len=9, completion_len=12, kv_token=10)
    assert rollout_kv_bytes(1, **kv) == 210
    assert rollout_kv_bytes(1, **kv, value_pad_token=3) == 210 + 3 * (119 + 116)
    assert rollout_kv_bytes(1, **{**kv, "prompt_len": 128, "completion_len": 256}, value_pad_token=3) == 3840
    assert rollout_kv_bytes(1, **{**kv, "prompt_len": 64, "completion_len": 129}, value_pad_token=3) == \
        1930 + 3 * (64 + 127)


def test_a_nan_element_is_stored_as_zero_so_every_code_is_finite():
    x = torch.randn(4, 16)
    x[1, 3] = float("nan")
    x[2] = float("nan")
    q, e = quantize_reference(x)
    assert torch.isfinite(q.float()).all()
    assert float(q[1, 3].float()) == 0.0 and torch.equal(q[2].float(), torch.zeros(16))
    clean = x.clone()
    clean[1, 3] = 0.0
    assert torch.equal(q[1].view(torch.uint8), quantize_reference(clean[1])[0].view(torch.uint8))


def test_fp8_attention_is_within_its_tolerance_of_full_precision():
    torch.manual_seed(0)
    for (P, S, Hq, Hkv, Lp, T, D) in [(2, 6, 8, 2, 300, 700, 64), (1, 3, 6, 3, 17, 45, 24)]:
        k_pre, v_pre = torch.randn(P, Hkv, Lp, D), torch.randn(P, Hkv, Lp, D)
        k_suf, v_suf, q = torch.randn(S, Hkv, T, D), torch.randn(S, Hkv, T, D), torch.randn(S, Hq, D)
        pidx, slen = torch.randint(0, P, (S,)), torch.randint(1, T + 1, (S,))
        plen = torch.full((S,), Lp)
        ref = decode_attention_reference(q, k_pre, v_pre, pidx, plen, k_suf, v_suf, slen, D ** -0.5)
        (kp, kpe), (vp, vpe), (ks, kse), (vs, vse) = quantize_cache(k_pre, v_pre, k_suf, v_suf)
        out = decode_attention_reference(q, kp, vp, pidx, plen, ks, vs, slen, D ** -0.5, kv_exp=(kpe, vpe, kse, vse))
        rel = float((out - ref).norm() / ref.norm())
        assert 0 < rel <= ATTN_REL, rel


FP8_KERNEL_CHECK = textwrap.dedent('''
    import sys
    import torch
    from longrl.rollout.attention import decode_attention_reference
    from longrl.rollout.decode_kernel import FP8_F16_LAUNCH, decode_attention_triton
    from longrl.rollout.kv_quant import quantize_reference, quantize_values, store_decode, value_capacity

    torch.manual_seed(int(sys.argv[1]))
    # the store kernel: bit for bit the twin's fp8 codes and exponents, at odd head sizes and magnitudes
    for (B, S, H, T, D) in [(5, 7, 3, 11, 24), (2, 2, 1, 3, 80), (4, 4, 2, 9, 16)]:
        k = torch.randn(B, H, D) * torch.logspace(-8, 6, B * H).view(B, H, 1)
        v = torch.randn(B, H, D) * 3
        k[0, 0] = 0.0
        v[-1, -1, 1] = float("nan")  # stored as 0
        idx = torch.randint(0, T, (B,))
        caches = [[torch.zeros(S, H, T, D, dtype=torch.float8_e4m3fn),
                   torch.zeros(S, H, D, value_capacity(T), dtype=torch.float8_e4m3fn),  # values position-minor
                   torch.zeros(S, H, T, dtype=torch.int8), torch.zeros(S, H, T, dtype=torch.int8)] for _ in range(2)]
        for c, tri in zip(caches, (False, True)):
            store_decode(k, v, *c, idx, tri)
        for a, b in zip(*caches):
            assert torch.equal(a.view(torch.uint8) if a.dtype != torch.int8 else a,
                               b.view(torch.uint8) if b.dtype != torch.int8 else b)
    # the decode kernel on FP8 caches: the twin on the same codes
    for (P, S, Hq, Hkv, Lp, T, D) in [(3, 5, 8, 2, 77, 131, 32), (2, 3, 6, 2, 33, 65, 24), (1, 3, 4, 4, 1, 1, 16)]:
        raw = [torch.randn(P, Hkv, Lp, D), torch.randn(P, Hkv, Lp, D), torch.randn(S, Hkv, T, D) * 5,
               torch.randn(S, Hkv, T, D)]
        (kp, kpe), (ks, kse) = quantize_reference(raw[0]), quantize_reference(raw[2])
        # values position-minor, at a capacity of exactly the positions (a value block past it is masked) and at
        # whole blocks (value_capacity: read whole, the padding holding finite codes that must add exactly 0)
        (vp, vpe), (vs, vse) = quantize_values(raw[1], Lp), quantize_values(raw[3], T)
        (vp_w, _), (vs_w, _) = quantize_values(raw[1]), quantize_values(raw[3])
        for whole, n in ((vp_w, Lp), (vs_w, T)):
            pad = torch.randint(0, 0x7F, whole[..., n:].shape, dtype=torch.uint8)  # finite codes (0x7F is NaN)
            whole[..., n:] = (pad | (torch.randint(0, 2, pad.shape, dtype=torch.uint8) << 7)).view(torch.float8_e4m3fn)
        q = torch.randn(S, Hq, D)
        pidx = torch.randint(0, P, (S,))
        entry_len = torch.randint(0, Lp + 1, (P,))
        entry_len[0] = Lp
        slen = torch.randint(1, T + 1, (S,))
        members = torch.full((P, S), -1, dtype=torch.long)
        members[pidx, torch.arange(S)] = torch.arange(S)
        exp = (kpe, vpe, kse, vse)
        args = (q, kp, vp, pidx, entry_len[pidx], ks, vs, slen, D ** -0.5)
        ref = decode_attention_reference(*args, kv_exp=exp)
        q16 = q.bfloat16().float()  # a query of bf16 values, as the sampler's
        for kw in ({}, dict(members=members, prompt_len=entry_len),  # many chunks of one block: chunk-crossing
                   dict(members=members, prompt_len=entry_len, launch=dict(programs=4096, prefix_programs=4096))):
            launch = kw.pop("launch", {})
            # products in the query's bf16 (fp8_f16 off): within float32 summation order of the twin
            got = decode_attention_triton(*args, **kw, kv_exp=exp,
                                          launch={**launch, "fp8_f16": False, "fp8_mma": False})
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            # the FP8 default (FP8_LAUNCH: e4m3 products) on a query of bf16 values: within bf16 rounding of p, below
            torch.testing.assert_close(decode_attention_triton(q16, *args[1:], **kw, kv_exp=exp, launch=launch),
                                       decode_attention_reference(q16, *args[1:], kv_exp=exp), atol=4e-3, rtol=4e-3)
        # float16 products (launch fp8_f16): q and p 2^(ev - E) rounded to float16 (2^-11), the rest as above
        got = decode_attention_triton(*args, members=members, prompt_len=entry_len, kv_exp=exp,
                                      launch=dict(FP8_F16_LAUNCH, programs=4096, prefix_programs=4096))
        torch.testing.assert_close(got, ref, atol=4e-3, rtol=4e-3)
        # the exponents loaded one block ahead (launch fp8_prefetch): the same results bit for bit, both products;
        # chunks of one block (4,096 programs) and of several (1 program: a chunk of up to 1,024 positions)
        for f16 in (False, True):
            for kw in (dict(launch=dict(programs=1)), dict(members=members, prompt_len=entry_len,
                                                           launch=dict(programs=1, prefix_programs=1)),
                       dict(members=members, prompt_len=entry_len, launch=dict(programs=4096,
                                                                               prefix_programs=4096))):
                base = {**FP8_F16_LAUNCH, **kw.pop("launch", {}), "fp8_f16": f16, "fp8_prefetch": False}
                plain = decode_attention_triton(*args, **kw, kv_exp=exp, launch=base)
                ahead = decode_attention_triton(*args, **kw, kv_exp=exp, launch={**base, "fp8_prefetch": True})
                assert torch.equal(plain, ahead), (f16, kw.keys())
                # whole value blocks: the same results bit for bit
                args_w = (q, kp, vp_w, pidx, entry_len[pidx], ks, vs_w, slen, D ** -0.5)
                assert torch.equal(decode_attention_triton(*args_w, **kw, kv_exp=exp, launch=base), plain)
                tol = 4e-3 if f16 else 1e-5
                torch.testing.assert_close(plain, ref, atol=tol, rtol=tol)
        # e4m3 products (launch fp8_mma): a query of bf16 values splits exactly into two e4m3 terms, p 2^(ev - E) to
        # bf16's 8 significant bits (2^-9), so within bf16 rounding of p of the twin; whole value blocks bit for bit;
        # heads below 32 fall back to the float16 products
        args16 = (q16,) + args[1:]
        ref16 = decode_attention_reference(*args16, kv_exp=exp)
        # blocks of 128 keys need value capacities of whole 128-position blocks (else they run at 64)
        (vp_c, _), (vs_c, _) = quantize_values(raw[1], -(-Lp // 128) * 128), quantize_values(raw[3], -(-T // 128) * 128)
        args_c = (q16, kp, vp_c, pidx, entry_len[pidx], ks, vs_c, slen, D ** -0.5)
        for a, kw in ((args16, dict(launch=dict(programs=1, block=64))), (args_c, dict(launch=dict(programs=1))),
                      (args16, dict(members=members, prompt_len=entry_len,
                                    launch=dict(programs=4096, prefix_programs=4096, block=64)))):
            launch = {"block": 128, **kw.pop("launch"), "fp8_mma": True, "warps": 4}
            got = decode_attention_triton(*a, **kw, kv_exp=exp, launch=launch)
            torch.testing.assert_close(got, ref16, atol=4e-3, rtol=4e-3)
            args_w = (q16, kp, vp_w, pidx, entry_len[pidx], ks, vs_w, slen, D ** -0.5)
            if launch["block"] == 64:
                assert torch.equal(decode_attention_triton(*args_w, **kw, kv_exp=exp, launch=launch), got)
            if D >= 32:  # and not the float16 products' result
                f16 = launch | dict(fp8_mma=False, fp8_f16=True)
                assert not torch.equal(decode_attention_triton(*args16, **kw, kv_exp=exp, launch=f16), got)
    print("fp8 kernels ok")
''')


@pytest.mark.parametrize("seed", [0])
def test_fp8_kernels_equal_their_twins_under_the_interpreter(seed):
    pytest.importorskip("triton")
    assert "fp8 kernels ok" in run_interpreted(FP8_KERNEL_CHECK, str(seed))


def _tiny(seed=5):
    import sys

    sys.path.insert(0, "tests")
    from test_sampler import PROMPTS, tiny_model

    model, tok = tiny_model(seed=seed, lora=True)
    return model, tok, PROMPTS


def test_fp8_rollouts_log_probs_within_tolerance_and_slot_moves_keep_the_scales():
    """Sampled completions through 3 slots (queueing, refills, compaction moving codes and exponents) equal those of
    all slots at once; their log-probs stay within LOGP_MEAN / LOGP_MAX of the model's own."""
    model, tok, prompts = _tiny()
    n = 12
    params = SamplingParams(max_new_tokens=n, seed=3, stop_token_ids=(13,))
    per = KVCache.nbytes(layers=2, kv_heads=2, head_dim=16, tokens=1, dtype=FP8)
    wide = Sampler(model, tok, kv_cache_dtype="fp8", sync_every=3).generate(prompts, 2, params)
    # 3 slots of n positions and 3 prompt entries of 9, the value stores padded to V_ALIGN positions each
    budget = per * (3 * n + 3 * 9) + 2 * 2 * 16 * (3 * (V_ALIGN - n) + 3 * (V_ALIGN - 9))
    narrow_sampler = Sampler(model, tok, kv_cache_dtype="fp8", kv_cache_bytes=budget, sync_every=3)
    narrow = narrow_sampler.generate(prompts, 2, params)
    assert narrow_sampler.last_stats["slots"] == 3 and narrow_sampler.last_stats["compactions"] > 0
    stage = 3 * (2 * 2 * 16 * 4 + 8)  # the decode step's float32 keys/values before quantization, and their index
    counters = 3 * 2 * 4  # the decode attention's merge counters: one int32 a slot and key head
    assert narrow_sampler.last_stats["kv_cache_bytes"] - stage - counters <= budget  # the stores: within the budget
    assert narrow.completion_ids == wide.completion_ids
    torch.testing.assert_close(torch.tensor(sum(narrow.logprobs, [])), torch.tensor(sum(wide.logprobs, [])))
    diffs = []
    for p, c, lps in zip(wide.prompt_ids, wide.completion_ids, wide.logprobs):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits[0].float(), -1)
        want = logp[len(p) - 1:len(p) + len(c) - 1].gather(-1, torch.tensor(c)[:, None])[:, 0]
        diffs.append((torch.tensor(lps) - want).abs())
    d = torch.cat(diffs)
    assert 0 < float(d.mean()) <= LOGP_MEAN and float(d.max()) <= LOGP_MAX, (float(d.mean()), float(d.max()))
    # the rollout correction (token_truncate at its default cap of 2) leaves every weight uncapped: e^0.15 < 2
    pad = lambda rows: torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # noqa: E731
    sampler_lp = pad([torch.tensor(lp) for lp in wide.logprobs])
    trainer_lp = pad([torch.tensor(lp) - sd for lp, sd in zip(wide.logprobs, _signed(wide, model))])
    mask = pad([torch.ones(len(c)) for c in wide.completion_ids])
    w, stats = rollout_correction_weights(trainer_lp, sampler_lp, mask, "token_truncate", cap=2.0)
    assert float(w.max()) <= 2.0 and stats["sampler/is_weight_changed"] == 0.0
    assert stats["sampler/logp_abs_diff"] == pytest.approx(float(d.mean()), rel=1e-4)


def _signed(rollout, model):
    """Per completion: sampler log-prob − the model's own, token by token."""
    out = []
    for p, c, lps in zip(rollout.prompt_ids, rollout.completion_ids, rollout.logprobs):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits[0].float(), -1)
        out.append(torch.tensor(lps) - logp[len(p) - 1:len(p) + len(c) - 1].gather(-1, torch.tensor(c)[:, None])[:, 0])
    return out


def test_fp8_cache_holds_twice_the_sequences_in_the_same_bytes():
    shape = ModelShape(32, 4096, 14336, 1024, 4096, 128256, False, 32)  # Llama-3.1-8B
    fp8, bf16 = kv_bytes_per_token(shape, 2, fp8=True), kv_bytes_per_token(shape, 2)
    assert fp8 == KVCache.nbytes(layers=32, kv_heads=8, head_dim=128, tokens=1, dtype=FP8)
    assert bf16 == KVCache.nbytes(layers=32, kv_heads=8, head_dim=128, tokens=1, dtype=torch.bfloat16)
    assert bf16 / fp8 == pytest.approx(256 / 129)
    kv = dict(prompts=8, G=8, prompt_len=512, completion_len=16384)
    for gib in (8, 20, 40):
        a = max_rollout_slots(gib << 30, sequences=64, **kv, kv_token=bf16)
        b = max_rollout_slots(gib << 30, sequences=64, **kv, kv_token=fp8)
        assert b >= 2 * a - 1 and b > a, (gib, a, b)  # 1.98 × the bytes: at most one short of double
