"""Speculative rollouts inside the sampler (generation.speculative): drafted tokens verified in one extend forward
per step leave the rollout's distribution, log-probs, greedy tokens, stop rules and KV cache as plain decoding's.

The model is test_sampler's tiny Llama with its head scaled up, so that its next-token distributions are peaked
enough for drafts to be accepted as well as rejected."""

from __future__ import annotations

import random

import pytest
import torch

from longrl.config import Config, ConfigError, load_config
from longrl.config.demo import demo_config
from longrl.config.validation import validate
from longrl.rollout import Sampler, SamplingParams
from longrl.rollout.draft_book import kept_counts, stop_table
from longrl.rollout.sampler import MultiTurn, _Run
from longrl.rollout.sampling import sampling_distribution
from test_agents_multiturn import STOP, ScriptedHandler
from test_sampler import PROMPTS, tiny_model
from test_speculative_acceptance import chi_square, chi_square_limit

DRAWS = 20_000


def peaked_model(seed=0, scale=16.0, lora=False):
    """test_sampler's tiny model (vocabulary of 20) with its head × scale: next-token perplexity about 5."""
    model, tok = tiny_model(seed=seed, lora=lora)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model, tok


class FixedDrafts:
    """Test double of a group's proposer: drafts ``rule(i, trajectory so far)`` for sequence i of the group."""

    def __init__(self, rule):
        self.rule, self.trajectory, self.records = rule, {}, []

    def append(self, i, tokens):
        self.trajectory.setdefault(i, []).extend(tokens)

    def propose(self, i):
        return list(self.rule(i, self.trajectory.get(i, [])))

    def record(self, i, drafted, accepted):
        self.records.append((i, drafted, accepted))

    def finish(self):
        pass


def fixed(rule):
    return lambda prompt, G: FixedDrafts(lambda i, done: rule(prompt, i, done))


def oracle(targets: dict, k: int = 4, wrong: float = 0.0, seed: int = 0):
    """Drafts: the next k tokens of ``targets[tuple(prompt)]`` after the trajectory so far; with probability
    ``wrong`` one of them replaced by a different token (a rejection under greedy decoding)."""
    rng = random.Random(seed)

    def rule(prompt, i, done):
        out = list(targets[tuple(prompt)][len(done):len(done) + k])
        if out and rng.random() < wrong:
            j = rng.randrange(len(out))
            out[j] = (out[j] + 1 + rng.randrange(5)) % 20
        return out
    return fixed(rule)


def greedy_targets(model, tok, prompts, n, **kw):
    r = Sampler(model, tok).generate(prompts, 1, SamplingParams(max_new_tokens=n, temperature=0, **kw))
    return {tuple(p): c for p, c in zip(prompts, r.completion_ids)}


def assert_same_rollout(spec, plain, tol: float = 1e-5) -> None:
    """``spec`` has ``plain``'s tokens, truncation flags and environment masks, and its log-probs within ``tol``."""
    assert spec.completion_ids == plain.completion_ids and spec.truncated == plain.truncated
    assert spec.env_mask == plain.env_mask
    torch.testing.assert_close(torch.tensor(sum(spec.logprobs, [])), torch.tensor(sum(plain.logprobs, [])),
                               atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------------------- (a) distribution
PARAMS = {"t1": dict(temperature=1.0), "t07": dict(temperature=0.7), "topk": dict(temperature=1.0, top_k=4),
          "topp": dict(temperature=0.7, top_p=0.8)}


@torch.no_grad()
def three_token_law(model, prompt, params) -> torch.Tensor:
    """P(t0, t1, t2) [V, V, V] of plain sampling's first three tokens (the processed distribution at each)."""
    V = model.config.vocab_size
    p0 = sampling_distribution(model(input_ids=torch.tensor([prompt])).logits[:, -1], params).exp()[0]  # [V]
    ids1 = torch.tensor([prompt + [a] for a in range(V)])
    p1 = sampling_distribution(model(input_ids=ids1).logits[:, -1], params).exp()  # [V, V]
    ids2 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
    p2 = sampling_distribution(model(input_ids=ids2).logits[:, -1], params).exp().view(V, V, V)
    return (p0[:, None, None] * p1[:, :, None] * p2).double()


@pytest.mark.parametrize("fast_verify", [False, True])
@pytest.mark.parametrize("name", list(PARAMS))
def test_speculative_tokens_have_plain_sampling_distribution(name, fast_verify):
    """20,000 completions of one prompt under a fixed proposer: even sequences draft the likeliest chain after the
    likeliest first token (often accepted), odd ones a chain of unlikely tokens (mostly rejected: the residual
    draw). The completion's first token is drawn from the prompt's logits; its second and third come from verify
    steps (2 drafts a step). Chi-square of (t0, t1, t2) against plain sampling's law. fast_verify: the verify
    steps as decode steps over virtual rows (the PyTorch twins of its kernels), else the extend forward."""
    model, tok = peaked_model(seed=3)
    prompt = PROMPTS[0]
    params = SamplingParams(max_new_tokens=4, seed=11, **PARAMS[name])
    law = three_token_law(model, prompt, params)
    first = int(law.sum((1, 2)).argmax())
    likely = [int(law[first].sum(1).argmax())]
    likely.append(int(law[first, likely[0]].argmax()))
    unlikely = [int(law[first].sum(1).argmin()), int(law[first, likely[0]].argmin())]
    sampler = Sampler(model, tok, speculative=fixed(lambda p, i, done: likely if i % 2 == 0 else unlikely),
                      fast_verify=fast_verify)
    r = sampler.generate([prompt], DRAWS, params)
    stats = sampler.last_stats
    assert stats["spec_verify_steps"] >= 1 and 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
    assert stats["spec_fast_verify_steps"] == (stats["spec_verify_steps"] if fast_verify else 0)
    got = torch.tensor([c[:3] for c in r.completion_ids])  # [DRAWS, 3]
    V = law.shape[0]
    counts = torch.zeros(V, V, V).index_put_((got[:, 0], got[:, 1], got[:, 2]), torch.ones(DRAWS), accumulate=True)
    stat, df = chi_square(counts, law)
    assert stat < chi_square_limit(df), (name, stat, df)
    if name == "t07":  # the check can fail: the same draws against temperature 0.75's law
        wrong = three_token_law(model, prompt, SamplingParams(temperature=0.75))
        stat, df = chi_square(counts, wrong)
        assert stat > chi_square_limit(df)


# ----------------------------------------------------------------------------------------------- (b) log-probs
@pytest.mark.parametrize("fast_verify", [False, True])
@pytest.mark.parametrize("fuse_lora", [True, False])
def test_reported_logprobs_equal_a_full_forward(fuse_lora, fast_verify):
    model, tok = peaked_model(seed=1, lora=True)
    T = 0.7
    targets = greedy_targets(model, tok, PROMPTS, 12)
    sampler = Sampler(model, tok, fuse_lora=fuse_lora, speculative=oracle(targets, k=3, wrong=0.3),
                      fast_verify=fast_verify)
    r = sampler.generate(PROMPTS, 3, SamplingParams(max_new_tokens=12, temperature=T, top_p=0.9, seed=5))
    assert sampler.last_stats["spec_accepted_tokens"] > 0
    for prompt, comp, lps in zip(r.prompt_ids, r.completion_ids, r.logprobs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + comp])).logits[0, len(prompt) - 1:-1].float()
        want = torch.log_softmax(logits / T, -1).gather(-1, torch.tensor(comp)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lps), want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- (c) greedy
@pytest.mark.parametrize("fast_verify", [False, True])
@pytest.mark.parametrize("case", ["shared", "queued", "lora", "peft", "penalty", "fp8"])
def test_greedy_speculation_gives_plain_greedy_tokens(case, fast_verify):
    """The n-gram proposer on repetitive prompts: the same tokens and log-probs as plain greedy decoding, with
    continuous batching (3 slots for 8 sequences), LoRA (fused or PEFT's forward), a repetition penalty or the FP8
    KV cache."""
    model, tok = peaked_model(seed=2, lora=case in ("lora", "peft"))
    prompts = [[1, 5, 6, 7, 5, 6, 7, 5], [1, 8, 9, 8, 9], [1, 4, 4, 4, 4, 4, 5, 11, 12], [1, 13, 14, 13]]
    kw = dict(fuse_lora=case != "peft", kv_cache_dtype="fp8" if case == "fp8" else "bf16", sync_every=4)
    if case == "queued":
        from longrl.rollout.attention import KVCache
        kw["kv_cache_bytes"] = KVCache.nbytes(layers=2, kv_heads=2, head_dim=16, tokens=1,
                                              dtype=torch.float32) * (3 * 24 + 3 * 9)
    params = SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=(3,),
                            repetition_penalty=1.3 if case == "penalty" else 1.0)
    plain = Sampler(model, tok, **kw).generate(prompts, 2, params)
    sampler = Sampler(model, tok, speculative="ngram", max_draft_tokens=4, fast_verify=fast_verify, **kw)
    spec = sampler.generate(prompts, 2, params)
    if case == "queued":
        assert sampler.last_stats["slots"] == 3
    assert_same_rollout(spec, plain)
    assert sampler.last_stats["spec_accepted_tokens"] > 0
    assert sampler.last_stats["decode_steps"] < sum(map(len, plain.completion_ids)) / 2  # fewer steps than tokens


def test_greedy_drafts_of_top_k_1_are_accepted_exactly_when_right():
    """top_k = 1 at temperature 1 is greedy too: oracle drafts with wrong tokens mixed in give plain greedy's
    tokens, every right draft accepted."""
    model, tok = peaked_model(seed=4)
    targets = greedy_targets(model, tok, PROMPTS, 16)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=1, seed=2)
    plain = Sampler(model, tok).generate(PROMPTS, 2, params)
    sampler = Sampler(model, tok, speculative=oracle(targets, k=4, wrong=0.5))
    spec = sampler.generate(PROMPTS, 2, params)
    assert spec.completion_ids == plain.completion_ids == [targets[tuple(p)] for p in PROMPTS for _ in range(2)]
    assert 0 < sampler.last_stats["spec_hit_rate"] < 1


# ----------------------------------------------------------------------------------------------- (d) KV rollback
@torch.no_grad()
@pytest.mark.parametrize("fast_verify", [False, True])
def test_cache_after_rejections_equals_a_cache_built_without_them(fast_verify):
    """Greedy verify steps with wrong drafts mixed in, run step by step: each slot's prompt prefix ++ slot store
    below its write index equals the prefix store of the prompt + its kept tokens prefilled from scratch (the
    rejected drafts' keys/values left past the write index only)."""
    model, tok = peaked_model(seed=5)
    params = SamplingParams(max_new_tokens=30, temperature=0)
    targets = greedy_targets(model, tok, PROMPTS, 30)
    sampler = Sampler(model, tok, speculative=oracle(targets, k=4, wrong=0.6, seed=1), fast_verify=fast_verify)
    with sampler.prepared():
        run = _Run(sampler, PROMPTS, 2, params)
        run._admit()
        run._refresh_members()
        for _ in range(5):
            run._speculative_step(len(PROMPTS) * 2)
        counts = run.drafts.counts
        assert counts.verify_steps == 5 and counts.accepted < counts.drafted  # rejections happened
        state, cache = run.state, run.cache
        stale = 0
        for slot in range(len(PROMPTS) * 2):
            prompt = PROMPTS[run.host.sequence[slot] // 2]
            w, n = int(state.write_index[slot]), int(state.generated[slot])
            kept = state.tokens[slot, :n].tolist()
            assert kept == targets[tuple(prompt)][:n] and w == n - 1
            ref = _Run(sampler, [prompt + kept[:w]], 1, params)
            ref._admit()
            entry, P = int(state.prefix_entry[slot]), len(prompt)
            for store_pre, store_suf, ref_pre in ((cache.k_pre, cache.k_suf, ref.cache.k_pre),
                                                  (cache.v_pre, cache.v_suf, ref.cache.v_pre)):
                got = torch.cat([store_pre[:, entry, :, :P], store_suf[:, slot, :, :w]], dim=2)
                torch.testing.assert_close(got, ref_pre[:, 0, :, :P + w], atol=1e-5, rtol=1e-5)
            stale += int(cache.k_suf[:, slot, :, w:].abs().sum() > 0)
        assert stale > 0  # rejected drafts' keys do lie past some write index


# ----------------------------------------------------------------------------------------------- (e) multi-turn, FP8
@pytest.mark.parametrize("fast_verify", [False, True])
@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
def test_multi_turn_greedy_speculation_equals_plain(kv_cache_dtype, fast_verify):
    """Episodes of 3 turns (environment tokens prefilled onto the slot's cache between them): the n-gram proposer
    (which also reads the environment's tokens) gives plain greedy's trajectories, masks and log-probs."""
    model, tok = peaked_model(seed=6)
    params = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=STOP)
    runs = []
    for speculative in ("off", "ngram"):
        sampler = Sampler(model, tok, kv_cache_dtype=kv_cache_dtype, speculative=speculative, fast_verify=fast_verify)
        runs.append(sampler.generate([[1, 5, 6, 7, 5, 6, 7], [1, 9, 4, 9, 4]], 2, params,
                                     MultiTurn(ScriptedHandler(turns=3), max_tokens=48)))
    plain, spec = runs
    assert_same_rollout(spec, plain)
    assert 0 in sum(spec.env_mask, [])  # environment tokens were added
    assert sampler.last_stats["spec_verify_steps"] > 0


# ----------------------------------------------------------------------------------------------- (f) stop rules
@pytest.mark.parametrize("fast_verify", [False, True])
def test_a_stop_token_inside_an_accepted_run_ends_the_sequence_there(fast_verify):
    """Oracle drafts of 4 tokens, all accepted: a stop token at any place of the run ends the completion with it
    (the accepted drafts after it dropped), as plain decoding does; max_new_tokens cuts a run too."""
    model, tok = peaked_model(seed=7)
    targets = greedy_targets(model, tok, PROMPTS, 20)
    full = [targets[tuple(p)] for p in PROMPTS]
    stop = full[0][5]
    params = SamplingParams(max_new_tokens=13, temperature=0, stop_token_ids=(stop,))
    sampler = Sampler(model, tok, speculative=oracle(targets, k=4), fast_verify=fast_verify)
    r = sampler.generate(PROMPTS, 1, params)
    for comp, whole, truncated in zip(r.completion_ids, full, r.truncated):
        cut = whole[:13]
        want = cut[:cut.index(stop) + 1] if stop in cut else cut
        assert comp == want and truncated == (stop not in cut)
    assert sampler.last_stats["spec_hit_rate"] == 1.0


def test_kept_counts_end_after_the_first_stop_among_the_emitted():
    tokens = torch.tensor([[5, 7, 3, 7], [7, 5, 5, -1], [5, 5, 5, 5], [9, 7, -1, -1]])
    emitted = torch.tensor([4, 3, 4, 2])
    assert kept_counts(tokens, emitted, stop_table([7, 10 ** 6], 16, "cpu")).tolist() == [2, 1, 4, 2]


def test_stop_table_marks_the_stop_ids_inside_the_vocabulary():
    table = stop_table([3, 3, 0, 15, 16, -2], 16, "cpu")
    assert table.dtype == torch.bool and table.nonzero().flatten().tolist() == [0, 3, 15]
    assert not stop_table([], 4, "cpu").any()


# ----------------------------------------------------------------------------------------------- config
def test_config_refuses_speculation_without_longrls_sampler():
    cfg = Config()
    cfg.generation.speculative, cfg.generation.backend = "ngram", "hf"
    with pytest.raises(ConfigError, match="generation.speculative"):
        validate(cfg, require_rewards=False)
    cfg.generation.backend, cfg.generation.max_draft_tokens = "longrl", 0
    with pytest.raises(ConfigError, match="generation.max_draft_tokens"):
        validate(cfg, require_rewards=False)
    cfg.generation.max_draft_tokens = 4
    validate(cfg, require_rewards=False)


def test_a_grpo_step_reports_the_speculative_counts(tmp_path):
    from longrl.recipes.grpo import GRPOTrainer

    cfg = load_config(None, ["generation.speculative=ngram", "generation.max_draft_tokens=3", "train.max_steps=1",
                             "train.prompts_per_step=2", "grpo.num_generations=2", "output.progress_bar=false",
                             "output.report_to=[none]", f"output.output_dir={tmp_path / 'out'}"], base=demo_config())
    history = GRPOTrainer(cfg).train()
    step = history[0]
    assert step["speculative/verify_steps"] >= 0 and 0 <= step["speculative/hit_rate"] <= 1
    assert {"speculative/drafted_tokens", "speculative/accepted_tokens", "speculative/accepted_per_step"} <= set(step)


def test_time_saved_estimate_from_the_calls_own_plain_steps():
    """V verify steps emitting 1 + a tokens a sequence would have taken about V·(1 + a) plain steps: 10 verify steps
    of 4 rows accepting 20 drafts (a = 0.5) in 3 s, beside plain steps of 0.25 s, saved 10 · 1.5 · 0.25 − 3 = 0.75 s;
    a call without a plain step reports no estimate; the sampler times both kinds of step."""
    from longrl.rollout.draft_book import SpeculativeCounts

    counts = SpeculativeCounts(verify_steps=10, verify_rows=40, drafted=60, accepted=20, verify_s=3.0, plain_steps=4,
                               plain_s=1.0)
    assert counts.summary()["spec_time_saved_s"] == pytest.approx(0.75)
    assert "spec_time_saved_s" not in SpeculativeCounts(verify_steps=1, verify_rows=1, verify_s=0.1).summary()
    model, tok = peaked_model(seed=3)
    sampler = Sampler(model, tok, speculative="ngram", max_draft_tokens=3)
    sampler.generate(PROMPTS, 4, SamplingParams(max_new_tokens=12, seed=2))
    stats = sampler.last_stats
    assert stats["spec_verify_s"] > 0 and (stats["spec_verify_steps"] > 0)
