"""longrl's batched sampler against transformers' generate and the sampling distribution it should draw from."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from longrl.config.schema import LoraConfig
from longrl.models import apply_lora
from longrl.models.tiny import build_char_tokenizer
from longrl.ops.rollout_correction import rollout_correction_weights
from longrl.rollout import Sampler, SamplingParams
from longrl.rollout.attention import KVCache, decode_attention_reference, unsupported_reason
from longrl.rollout.sampling import filter_logits, next_tokens, sampling_distribution

PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 4, 4, 4, 4, 4, 5, 11, 12], [1, 13]]


def tiny_model(seed=0, kv_heads=2, lora=False):
    torch.manual_seed(seed)
    tok = build_char_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    if lora:
        model = apply_lora(model, LoraConfig(r=4, alpha=8.0))
        with torch.no_grad():  # PEFT starts B at zero; make the adapters matter
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.2)
    return model, tok


def hf_greedy(model, prompt, n, **kw):
    out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("budget_slots", [None, 3])  # 3 slots for 8 sequences: queueing, refills, compaction
def test_greedy_equals_transformers_generate(lora, budget_slots):
    model, tok = tiny_model(lora=lora)
    G, n = 2, 14
    kv = None
    if budget_slots:
        per = KVCache.nbytes(layers=2, kv_heads=2, head_dim=16, tokens=1, dtype=torch.float32)
        kv = per * (budget_slots * n + 3 * 9)
    sampler = Sampler(model, tok, kv_cache_bytes=kv, sync_every=3)
    r = sampler.generate(PROMPTS, G, SamplingParams(max_new_tokens=n, temperature=0))
    if budget_slots:
        assert sampler.last_stats["slots"] == budget_slots
    expected = [hf_greedy(model, p, n) for p in PROMPTS]
    assert r.completion_ids == [e for e in expected for _ in range(G)]
    assert r.prompt_ids == [p for p in PROMPTS for _ in range(G)]
    assert r.truncated == [True] * len(r.completion_ids)
    assert model.config._attn_implementation != "longrl_sampler"  # switched back


def test_repetition_penalty_greedy_equals_transformers():
    model, tok = tiny_model(seed=3)
    r = Sampler(model, tok).generate(PROMPTS, 1, SamplingParams(max_new_tokens=10, temperature=0,
                                                                repetition_penalty=1.7))
    assert r.completion_ids == [hf_greedy(model, p, 10, repetition_penalty=1.7) for p in PROMPTS]


def test_logprobs_equal_the_models():
    model, tok = tiny_model(seed=1, lora=True)
    T = 0.7
    r = Sampler(model, tok).generate(PROMPTS[:3], 3, SamplingParams(max_new_tokens=9, temperature=T, seed=5))
    for prompt, comp, lps in zip(r.prompt_ids, r.completion_ids, r.logprobs):
        ids = torch.tensor([prompt + comp])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        want = torch.log_softmax(logits / T, -1).gather(-1, torch.tensor(comp)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lps), want, atol=1e-5, rtol=1e-5)


def test_prefix_sharing_equals_separate_prefill():
    model, tok = tiny_model(seed=2)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=12, seed=11)
    shared = Sampler(model, tok).generate(PROMPTS, 3, params)
    separate = Sampler(model, tok).generate([p for p in PROMPTS for _ in range(3)], 1, params)
    assert shared.completion_ids == separate.completion_ids
    torch.testing.assert_close(torch.tensor(sum(shared.logprobs, [])), torch.tensor(sum(separate.logprobs, [])),
                               atol=1e-5, rtol=1e-5)


def test_seeded_and_reproducible():
    model, tok = tiny_model(seed=4)
    runs = [Sampler(model, tok).generate(PROMPTS, 4, SamplingParams(max_new_tokens=10, seed=s)).completion_ids
            for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_stop_ids_and_max_new_tokens_end_sequences_exactly():
    model, tok = tiny_model(seed=5)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
    free = Sampler(model, tok).generate(PROMPTS, 4, params)
    assert all(len(c) == 12 for c in free.completion_ids)
    stop = free.completion_ids[0][4]  # a token that occurs in at least one completion
    r = Sampler(model, tok).generate(PROMPTS, 4, SamplingParams(**{**params.__dict__, "stop_token_ids": (stop,)}))
    for full, cut, truncated in zip(free.completion_ids, r.completion_ids, r.truncated):
        if stop in full:  # same random stream up to the stop: the completion ends at its first occurrence
            assert cut == full[:full.index(stop) + 1] and not truncated
        else:
            assert cut == full and truncated


def test_stop_strings_end_at_the_completing_token():
    model, tok = tiny_model(seed=6)
    params = SamplingParams(max_new_tokens=16, temperature=0)
    full = Sampler(model, tok).generate([PROMPTS[0]], 1, params).completion_ids[0]
    text = tok.decode(full)
    stop = text[5:7]
    r = Sampler(model, tok, sync_every=5).generate([PROMPTS[0]], 1, SamplingParams(max_new_tokens=16, temperature=0,
                                                                                   stop_strings=(stop,)))
    cut = r.completion_ids[0]
    assert stop in tok.decode(cut) and stop not in tok.decode(cut[:-1])
    assert cut == full[:len(cut)] and not r.truncated[0]


def test_filters_match_transformers_warpers():
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    for params in [SamplingParams(temperature=0.8, top_k=7), SamplingParams(temperature=1.3, top_p=0.6),
                   SamplingParams(temperature=1.0, min_p=0.15), SamplingParams(temperature=0.5, top_k=20, top_p=0.9)]:
        want = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
        if params.top_k:
            want = TopKLogitsWarper(params.top_k)(None, want)
        if params.top_p < 1:
            want = TopPLogitsWarper(params.top_p)(None, want)
        if params.min_p:
            want = MinPLogitsWarper(params.min_p)(None, want)
        got = filter_logits(logits / params.temperature, params)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), params
        torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=6),
                                    SamplingParams(temperature=1.2, top_p=0.8),
                                    SamplingParams(temperature=1.0, min_p=0.05)])
def test_sampled_frequencies_match_the_distribution(params):
    """Pearson chi-square of 40,000 draws against the processed softmax, at a 1e-4 significance level."""
    torch.manual_seed(0)
    logits = torch.randn(1, 24) * 2
    draws = 40_000
    tokens, logps = next_tokens(logits.expand(draws, -1), params, torch.arange(draws), torch.full((draws,), 3))
    probs = sampling_distribution(logits, params)[0].exp()
    counts = torch.bincount(tokens, minlength=24).double()
    assert counts[probs == 0].sum() == 0  # nothing drawn outside the filters
    keep = probs > 0
    expected = probs[keep].double() * draws
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    # Wilson–Hilferty upper quantile of chi-square(dof) at p = 1e-4 (z = 3.719)
    bound = dof * (1 - 2 / (9 * dof) + 3.719 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < bound, (chi2, bound)
    torch.testing.assert_close(logps, torch.log_softmax(logits / params.temperature, -1)[0, tokens])


def test_decode_attention_reference_equals_dense_attention():
    torch.manual_seed(0)
    P, S, Hq, Hkv, Lp, T, D = 3, 5, 6, 2, 7, 9, 8
    k_pre, v_pre = torch.randn(P, Hkv, Lp, D), torch.randn(P, Hkv, Lp, D)
    k_suf, v_suf = torch.randn(S, Hkv, T, D), torch.randn(S, Hkv, T, D)
    q = torch.randn(S, Hq, D)
    prefix_index = torch.tensor([2, 0, 1, 1, 2])
    prefix_len = torch.tensor([7, 3, 5, 5, 1])
    suffix_len = torch.tensor([1, 9, 4, 2, 6])
    out = decode_attention_reference(q, k_pre, v_pre, prefix_index, prefix_len, k_suf, v_suf, suffix_len, 0.3)
    for b in range(S):
        p, lp, ls = int(prefix_index[b]), int(prefix_len[b]), int(suffix_len[b])
        k = torch.cat([k_pre[p, :, :lp], k_suf[b, :, :ls]], 1).repeat_interleave(Hq // Hkv, 0)  # [Hq, n, D]
        v = torch.cat([v_pre[p, :, :lp], v_suf[b, :, :ls]], 1).repeat_interleave(Hq // Hkv, 0)
        weights = torch.softmax(torch.einsum("hd,hnd->hn", q[b], k) * 0.3, -1)  # [Hq, n]
        want = torch.einsum("hn,hnd->hd", weights, v)
        torch.testing.assert_close(out[b], want, atol=1e-5, rtol=1e-5)


def test_unsupported_architectures_are_named():
    from transformers import Gemma2Config

    assert "soft-capping" in unsupported_reason(Gemma2Config(), 100)
    assert unsupported_reason(LlamaConfig(), 100000) is None
    from transformers import MistralConfig

    assert "sliding-window" in unsupported_reason(MistralConfig(sliding_window=64), 100)
    assert unsupported_reason(MistralConfig(sliding_window=4096), 100) is None


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_rollout_correction_weights(mode):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
    sampler = torch.tensor([[-1.0, -3.0, -0.4], [-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w, stats = rollout_correction_weights(old, sampler, mask, mode, cap=2.0)
    r = torch.exp((old - sampler) * mask)
    if mode == "token_truncate":
        want = torch.clamp(r, max=2.0)
    elif mode == "token_mask":
        want = r * (r <= 2.0)
    else:
        R = torch.exp(((old - sampler) * mask).sum(-1, keepdim=True)).expand_as(r)
        want = torch.clamp(R, max=2.0) if mode == "sequence_truncate" else R * (R <= 2.0)
    torch.testing.assert_close(w, want * mask)
    assert stats["sampler/logp_abs_diff"] == pytest.approx(float(((old - sampler).abs() * mask).sum() / mask.sum()))


def test_refills_and_compaction_keep_results_exact():
    """Sequences of different lengths (a stop id) through 3 slots: queueing, prompt prefills as slots free,
    compaction into smaller buckets; every completion must still equal transformers' greedy one, cut at the stop."""
    model, tok = tiny_model(seed=0)
    n = 14
    expected = [hf_greedy(model, p, n) for p in PROMPTS]
    stop = expected[0][3]
    per = KVCache.nbytes(layers=2, kv_heads=2, head_dim=16, tokens=1, dtype=torch.float32)
    sampler = Sampler(model, tok, kv_cache_bytes=per * (3 * n + 3 * 9), sync_every=2)
    r = sampler.generate(PROMPTS, 2, SamplingParams(max_new_tokens=n, temperature=0, stop_token_ids=(stop,)))
    cut = [e[:e.index(stop) + 1] if stop in e else e for e in expected]
    assert r.completion_ids == [c for c in cut for _ in range(2)]
    assert r.truncated == [stop not in e for e in expected for _ in range(2)]
    stats = sampler.last_stats
    assert stats["slots"] == 3 and stats["prefills"] > 1 and stats["compactions"] > 0, stats


def test_bad_prompts_are_named():
    model, tok = tiny_model()
    with pytest.raises(ValueError, match="prompt 1 has token id 999"):
        Sampler(model, tok).generate([[1, 2], [1, 999]], 2, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        Sampler(model, tok).generate([[]], 2, SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize("slots", [3, 5])
def test_logprobs_stay_exact_through_queueing_and_compaction(slots):
    """Sampled sequences of random lengths through few slots: every returned log-prob equals the model's own
    (a slot reading the wrong prompt prefix after a refill or compaction would show here)."""
    model, tok = tiny_model(seed=5)
    per = KVCache.nbytes(layers=2, kv_heads=2, head_dim=16, tokens=1, dtype=torch.float32)
    n, compactions = 20, 0
    for seed in range(3):
        for stop in (8, 13, 18):
            sampler = Sampler(model, tok, kv_cache_bytes=per * (slots * n + (slots // 2 + 2) * 9), sync_every=3)
            r = sampler.generate(PROMPTS, 2, SamplingParams(max_new_tokens=n, seed=seed, stop_token_ids=(stop,)))
            compactions += sampler.last_stats["compactions"]
            ids = [p + c for p, c in zip(r.prompt_ids, r.completion_ids)]
            width = max(map(len, ids))
            batch = torch.tensor([s + [0] * (width - len(s)) for s in ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=batch).logits.float(), -1)
            for row, (p, c, lps) in enumerate(zip(r.prompt_ids, r.completion_ids, r.logprobs)):
                want = logp[row, len(p) - 1:len(p) + len(c) - 1].gather(-1, torch.tensor(c)[:, None])[:, 0]
                torch.testing.assert_close(torch.tensor(lps), want, atol=1e-4, rtol=1e-4)
    assert compactions > 0


def test_sequence_modes_report_changed_weights_only_when_capped():
    old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    sampler = old - 0.01  # ratio ~1.01 per token: under any cap of 2
    mask = torch.ones_like(old)
    for mode in ("token_truncate", "sequence_truncate", "sequence_mask"):
        _, stats = rollout_correction_weights(old, sampler, mask, mode, cap=2.0)
        assert stats["sampler/is_weight_changed"] == 0.0, mode
        assert stats["sampler/k3_kl"] >= 0.0
    _, stats = rollout_correction_weights(old, old - 1.0, mask, "sequence_mask", cap=2.0)  # R = e² > 2: masked
    assert stats["sampler/is_weight_changed"] == 1.0 and stats["sampler/is_weight_mean"] == 0.0


def test_hf_backend_honours_stop_rules():
    from longrl.config.schema import GenerationConfig
    from longrl.rollout import generate_completions

    model, tok = tiny_model(seed=0)
    free = [hf_greedy(model, p, 10) for p in PROMPTS]
    stop = free[0][3]
    gen = GenerationConfig(max_completion_length=10, temperature=1e-4, stop_token_ids=[stop], ignore_eos=True)
    r = generate_completions(model, tok, PROMPTS, 1, gen, "cpu")
    assert r.completion_ids == [f[:f.index(stop) + 1] if stop in f else f for f in free]
    assert r.truncated == [stop not in f for f in free]
    text = tok.decode(free[1])
    gen = GenerationConfig(max_completion_length=10, temperature=1e-4, stop_strings=[text[4:6]], ignore_eos=True)
    cut = generate_completions(model, tok, [PROMPTS[1]], 1, gen, "cpu").completion_ids[0]
    assert text[4:6] in tok.decode(cut) and text[4:6] not in tok.decode(cut[:-1])


def test_hf_backend_draws_as_the_sampler_by_global_sequence_id():
    """transformers' generate with longrl's keyed draw (penalty, temperature, top-p) samples the tokens longrl's
    sampler samples, and a completion depends on its global sequence id alone: a rank's share of the batch,
    generated one sequence at a time with its ids, is that share of the whole batch."""
    from dataclasses import replace

    from longrl.config.schema import GenerationConfig
    from longrl.rollout import generate_completions
    from longrl.rollout.completions import sampling_params

    model, tok = tiny_model(seed=1)
    gen = GenerationConfig(max_completion_length=9, temperature=1.3, top_p=0.95, repetition_penalty=1.2,
                           ignore_eos=True)
    params = sampling_params(gen, tok, seed=11)
    whole = generate_completions(model, tok, PROMPTS, 2, gen, "cpu", params=params)
    assert whole.completion_ids == Sampler(model, tok).generate(PROMPTS, 2, params).completion_ids
    share = generate_completions(model, tok, PROMPTS[1:3], 2, gen, "cpu", batch_size=1,
                                 params=replace(params, sequence_ids=(2, 3, 4, 5)))
    assert share.completion_ids == whole.completion_ids[2:6]
    other = generate_completions(model, tok, PROMPTS, 2, gen, "cpu", params=replace(params, seed=12))
    assert other.completion_ids != whole.completion_ids  # the seed keys the draw


def test_uniforms_are_uniform_and_keyed():
    from longrl.rollout.sampling import uniform_for

    seq = torch.arange(200_000)
    u = uniform_for(7, seq, torch.zeros_like(seq))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    counts = torch.histc(u.float(), bins=20, min=0.0, max=1.0)  # chi-square, 19 dof, p = 1e-4 bound 50.1
    assert float(((counts - 10_000) ** 2 / 10_000).sum()) < 50.1
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01  # neighbours independent
    again = uniform_for(7, seq[:5], torch.zeros(5, dtype=torch.long))
    assert torch.equal(again, u[:5])  # a pure function of (seed, sequence, position)
    assert not torch.equal(uniform_for(8, seq[:5], torch.zeros(5, dtype=torch.long)), again)
    assert not torch.equal(uniform_for(7, seq[:5], torch.ones(5, dtype=torch.long)), again)


def test_sampled_completions_do_not_depend_on_the_slot_layout():
    """Same seed: all 8 sequences at once, or 3 slots with queueing, refills and compaction, give the same
    completions (each random number is keyed by sequence and position, not by slot)."""
    model, tok = tiny_model(seed=5)
    per = KVCache.nbytes(layers=2, kv_heads=2, head_dim=16, tokens=1, dtype=torch.float32)
    params = SamplingParams(max_new_tokens=20, seed=4, top_p=0.9, stop_token_ids=(13,))
    wide = Sampler(model, tok, sync_every=5).generate(PROMPTS, 2, params)
    narrow_sampler = Sampler(model, tok, kv_cache_bytes=per * (3 * 20 + 3 * 9), sync_every=2)
    narrow = narrow_sampler.generate(PROMPTS, 2, params)
    assert narrow_sampler.last_stats["slots"] == 3
    assert narrow.completion_ids == wide.completion_ids
    assert len({len(c) for c in wide.completion_ids}) > 1  # lengths differ: the layouts really diverge


def test_a_decode_batch_floor_keeps_the_completions_and_compacts_less():
    """Sampler(min_decode_batch=m): the same seeded completions and log-probs as the default's (each random number
    is keyed by sequence and position, each row's step reads its own state; the log-probs up to the rounding of
    products over another row count), with no compaction below m rows;
    batch_buckets lists the buckets from the floor."""
    from longrl.rollout.sampler import batch_buckets

    assert batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(8, 4) == [4, 8] and batch_buckets(8, 16) == [8]
    assert batch_buckets(40, 16) == [16, 32, 40] and batch_buckets(1, 16) == [1]
    model, tok = tiny_model(seed=5)
    params = SamplingParams(max_new_tokens=20, seed=3, top_p=0.9, stop_token_ids=(13, 8))
    runs = {}
    for floor in (1, 8):
        sampler = Sampler(model, tok, sync_every=2, min_decode_batch=floor)
        runs[floor] = (sampler.generate(PROMPTS, 2, params), sampler.last_stats["compactions"])
    (base, compacted), (floored, none) = runs[1], runs[8]
    assert floored.completion_ids == base.completion_ids
    # the log-probs up to float32 rounding: a product over 8 rows may block its sums unlike one over fewer (seen on
    # some CPUs' kernels, 2.4e-7)
    torch.testing.assert_close(torch.tensor(sum(floored.logprobs, [])), torch.tensor(sum(base.logprobs, [])),
                               atol=1e-5, rtol=0)
    assert compacted > 0 and none == 0  # the default compacted into smaller buckets; 8 rows, one bucket, never
    assert len({len(c) for c in base.completion_ids}) > 1
    with pytest.raises(ValueError, match="min_decode_batch"):
        Sampler(model, tok, min_decode_batch=0)
    assert Sampler(model, tok).min_decode_batch == 1  # the default without CUDA graphs (16 with them)


def test_whole_step_graphs_need_cuda_graphs():
    """Sampler(step_graphs=True) without CUDA graphs (the CPU) is off, and the call the default's."""
    model, tok = tiny_model(seed=6)
    params = SamplingParams(max_new_tokens=10, seed=2, temperature=0.8)
    sampler = Sampler(model, tok, step_graphs=True)
    assert not sampler.cuda_graphs and sampler.step_graphs is False
    got, want = sampler.generate(PROMPTS, 2, params), Sampler(model, tok).generate(PROMPTS, 2, params)
    assert got.completion_ids == want.completion_ids and got.logprobs == want.logprobs


@pytest.mark.parametrize("floor", [1, 8])
def test_free_rows_in_the_decode_batch_read_one_position(monkeypatch, floor):
    """A finished sequence's slot (released, or left behind by a compaction) that stays inside the decode batch
    reads one suffix position, not the finished sequence's whole store: before every decode step each free row of
    the batch has write_index 0 and is inactive."""
    from longrl.rollout import sampler as sampler_module

    seen = {"free_rows": 0}
    step = sampler_module._Run._decode_step

    def checked(run, batch):
        free = [i for i in range(batch) if run.host.sequence[i] < 0]
        seen["free_rows"] += len(free)
        if free:
            rows = torch.tensor(free)
            assert not run.state.active[rows].any() and (run.state.write_index[rows] == 0).all(), free
        step(run, batch)

    monkeypatch.setattr(sampler_module._Run, "_decode_step", checked)
    model, tok = tiny_model(seed=5)
    params = SamplingParams(max_new_tokens=20, seed=3, top_p=0.9, stop_token_ids=(13, 8))
    Sampler(model, tok, sync_every=2, min_decode_batch=floor).generate(PROMPTS, 2, params)
    assert seen["free_rows"] > 0


def test_first_tokens_of_many_completions_follow_the_model():
    """One prompt, 6,000 completions of one token: the first-token frequencies pass a chi-square test against
    the model's softmax(z / T) (the sampler end to end: prefill, admission, keyed draws)."""
    model, tok = tiny_model(seed=9)
    T, draws = 1.5, 6000
    r = Sampler(model, tok).generate([PROMPTS[2]], draws, SamplingParams(max_new_tokens=1, temperature=T, seed=2))
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([PROMPTS[2]])).logits[0, -1].double() / T, -1)
    counts = torch.bincount(torch.tensor([c[0] for c in r.completion_ids]), minlength=probs.numel()).double()
    keep = probs * draws >= 5  # chi-square cells with enough expected counts; the rest pooled
    expected = torch.cat([probs[keep] * draws, (probs[~keep] * draws).sum()[None]])
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    dof = int(keep.sum())  # cells − 1, with the pooled cell
    chi2 = float(((observed - expected) ** 2 / expected.clamp(min=1e-9)).sum())
    bound = dof * (1 - 2 / (9 * dof) + 3.719 * math.sqrt(2 / (9 * dof))) ** 3  # p = 1e-4
    assert chi2 < bound, (chi2, bound)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_p=0.9, seed=4),
                                    SamplingParams(temperature=0, repetition_penalty=1.3),
                                    SamplingParams(temperature=1.2, top_k=7, min_p=0.05, repetition_penalty=0.8)])
def test_rows_drawn_in_chunks_equal_rows_drawn_together(params):
    """next_tokens bounds its temporaries by drawing rows in chunks (odd sizes here): the same tokens and log-probs."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(23, 50, generator=g) * 3
    seen = torch.rand(23, 50, generator=g) < 0.2
    seq, pos = torch.arange(100, 123), torch.randint(0, 40, (23,), generator=g)
    whole = next_tokens(logits, params, seq, pos, seen, rows=23)
    for rows in (1, 5, 22):
        tok, lp = next_tokens(logits, params, seq, pos, seen, rows=rows)
        assert torch.equal(tok, whole[0]) and torch.equal(lp, whole[1])



def test_first_with_mass_skips_entries_without_mass_on_a_non_monotonic_scan():
    """A GPU's parallel scan can round the prefix of a zero-mass entry above or below its neighbour's: the H200
    drew zero-probability tokens (and tokens past the vocabulary) when the search counted entries ≤ u · total."""
    from longrl.rollout.sampling import first_with_mass

    cdf = torch.tensor([[0.1, 0.3, 0.3 + 1e-12, 0.3 - 1e-12]] * 3 + [[0.0, 1e-15, 0.2, 0.5]], dtype=torch.float64)
    mass = torch.tensor([[1, 1, 0, 0]] * 3 + [[0, 0, 1, 1]], dtype=torch.bool)
    target = torch.tensor([[0.3 - 1e-13], [0.3 + 1e-12], [0.05], [0.0]], dtype=torch.float64)
    assert first_with_mass(cdf, mass, target)[:, 0].tolist() == [1, 1, 0, 2]
    counted = (cdf <= target).sum(-1)  # the old rule: lands on entries without mass here
    assert not bool(mass.gather(1, counted[:1, None].clamp(max=3)).all())


@pytest.mark.parametrize("V", [1000, 1025, 3001])
def test_rows_without_mass_draw_token_zero_on_both_paths(V):
    """All-zero and NaN rows (a diverged model's logits): token 0 on the two-level search, the whole-CDF twin and
    (tests/test_sampling_kernel.py) the fused kernel, never an index past the vocabulary."""
    from longrl.rollout.sampling import inverse_cdf, inverse_cdf_reference

    probs = torch.zeros(3, V)
    probs[1] = float("nan")
    probs[2, 5] = 1.0
    u = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [0, 0, 5]
    assert inverse_cdf_reference(probs, u).tolist() == [0, 0, 5]

@pytest.mark.parametrize("V", [1000, 1024, 1025, 3001, 50_257])  # within one block, one block exactly, across
def test_two_level_inverse_cdf_equals_the_whole_cdf(V):
    from longrl.rollout.sampling import inverse_cdf, inverse_cdf_reference

    g = torch.Generator().manual_seed(V)
    probs = torch.softmax(torch.randn(64, V, generator=g) * 3, dim=-1)
    probs[::3, V // 2:] = 0.0  # empty tail blocks (top-k/top-p filtered): never drawn
    probs[1::3, : V // 3] = 0.0  # empty head blocks
    probs[2, :] = 0.0
    probs[2, V - 1] = 0.7  # all mass on the last entry (the partial tail block)
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 1.0 - 2.0 ** -53, 0.5, 1.0], dtype=torch.float64)  # the ends; 1.0 stands for a
    # u · total that rounds up to the total: the search runs off the end and must come back to the last mass
    got, want = inverse_cdf(probs, u), inverse_cdf_reference(probs, u)
    assert torch.equal(got, want)
    assert bool((probs.gather(1, got[:, None]) > 0).all())  # only entries with mass
    assert int(got[2]) == V - 1


def test_token_logprobs_equal_log_softmax():
    from longrl.rollout.sampling import token_logprobs

    g = torch.Generator().manual_seed(3)
    z = torch.randn(37, 1001, generator=g) * 4
    z[0, 5] = 80.0  # a dominant entry: logsumexp must be stable
    tokens = torch.randint(0, 1001, (37,), generator=g)
    want = torch.log_softmax(z.double(), -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(token_logprobs(z, tokens).double(), want, atol=2e-6, rtol=1e-6)


def test_the_sampler_builder_steps_aside_for_transformers_generate(caplog):
    """build_sampler: None for generation.backend=hf, and None with the reason logged for a model the sampler
    cannot run exactly (a sliding window shorter than the sequences); else a Sampler with the config's settings."""
    from longrl.config.schema import GenerationConfig
    from longrl.rollout.completions import build_sampler

    model, tok = tiny_model()
    assert build_sampler(model, tok, GenerationConfig(backend="hf"), max_length=64) is None
    sampler = build_sampler(model, tok, GenerationConfig(kv_cache_dtype="fp8", sync_every=5), max_length=64)
    assert isinstance(sampler, Sampler) and sampler.kv_fp8 and sampler.sync_every == 5
    model.config.sliding_window = 32
    with caplog.at_level("WARNING"):
        assert build_sampler(model, tok, GenerationConfig(), max_length=64) is None
    assert "sliding-window attention (window 32 < 64 tokens)" in caplog.text


def test_compaction_moves_every_per_slot_field_and_frees_the_rest():
    """SlotTensors.compact and SlotBook.compact move every field of the occupied slots to the front (a field added
    to either dataclass moves without further edits); the slots after them are inactive / free."""
    from dataclasses import fields

    from longrl.rollout.slot_state import FREE_SLOT, SlotBook, SlotTensors

    state = SlotTensors.allocate(5, max_tokens=4, vocab=6, track_seen=True, device="cpu", draft_k_max=3)  # every field
    before = {}
    for f in fields(state):
        t = getattr(state, f.name)
        values = torch.arange(t.numel()).reshape(t.shape) % 7 + 1  # distinct rows, nonzero
        t.copy_(values.to(t.dtype))
        before[f.name] = t.clone()
    src = [1, 3, 4]
    state.compact(torch.tensor(src))
    for f in fields(state):
        t = getattr(state, f.name)
        if f.name == "active":
            assert t.tolist() == [True, True, True, False, False]
        else:
            assert torch.equal(t[:3], before[f.name][src]), f.name
    book = SlotBook.free(5)
    assert {f.name for f in fields(book)} == set(FREE_SLOT)
    for f in fields(book):
        getattr(book, f.name)[:] = [10 * i + len(f.name) for i in range(5)]
    book.compact(src)
    for f in fields(book):
        column = getattr(book, f.name)
        assert column[:3] == [10 * i + len(f.name) for i in src] and column[3:] == [FREE_SLOT[f.name]] * 2, f.name
    book.reset(0)
    assert book.sequence[0] == -1 and book.occupied() == [1, 2] and book.free_slots() == [0, 3, 4]
