"""Multi-turn rollouts inside the sampler: KV-cache continuation across turns, env masks, slow environments."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from longrl.ops.losses import PolicyLossSettings, loss_token_weights, per_token_policy_loss, weighted_loss
from longrl.ops.rollout_correction import rollout_correction_weights
from longrl.models.policy import completion_mask, pad_right, sequence_logprobs
from longrl.rollout import Sampler, SamplingParams
from longrl.rollout.sampler import MultiTurn
from test_sampler import tiny_model

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 4]]

STOP = (2, 6)


class ScriptedHandler:
    """Appends 2–5 environment tokens after each turn (depending on sequence and turn); ends after ``turns``."""

    def __init__(self, turns=3, sleep_s=None):
        self.turns, self.sleep_s = turns, sleep_s or {}
        self.count, self.finished = {}, {}

    def env_tokens(self, seq, k):
        return [4 + (seq * 3 + k + j) % 12 for j in range(2 + (seq + k) % 4)]

    def step(self, seq, tokens, room):
        k = self.count.get(seq, 0) + 1
        self.count[seq] = k
        if seq in self.sleep_s:
            self.sleep_s[seq]()
        if k >= self.turns:
            self.finished[seq] = "done"
            return None
        ids = self.env_tokens(seq, k)
        if len(ids) + 1 > room:  # as EpisodeRunner: no room for them and one more sampled token
            self.finished[seq] = "max_tokens"
            return None
        return ids


def _padded(rows, width, dtype=torch.float32):
    return pad_right(rows, 0, width, dtype=dtype)


@pytest.mark.parametrize("budget_slots", [None, 3])  # 3 slots for 4 sequences: queueing, refills, compaction
def test_kv_continuation_equals_prefilling_the_whole_trajectory(budget_slots):
    model, tok = tiny_model(seed=1)
    sampler = Sampler(model, tok)
    if budget_slots:  # room for 3 sequences of prompt + 40 tokens
        from longrl.rollout.attention import KVCache
        per = KVCache.nbytes(layers=2, kv_heads=2, head_dim=16, tokens=max(map(len, PROMPTS)) + 40, dtype=torch.float32)
        sampler.kv_cache_bytes = budget_slots * per + per // 2
    params = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=STOP, seed=7)
    handler = ScriptedHandler(turns=3)
    r = sampler.generate(PROMPTS, 2, params, MultiTurn(handler, max_tokens=40))
    assert sampler.last_stats["resumes"] > 0 and (budget_slots is None or sampler.last_stats["slots"] == budget_slots)
    width = max(map(len, r.completion_ids))
    mask = _padded(r.env_mask, width)
    assert (mask == 0).any() and (mask.sum(1) < torch.tensor([len(c) for c in r.completion_ids])).all()
    for seq, (c, m) in enumerate(zip(r.completion_ids, r.env_mask)):
        k, i = 1, 0  # the environment tokens sit where the handler put them, unchanged
        while 0 in m[i:]:
            a = m.index(0, i)
            b = next((j for j in range(a, len(m)) if m[j]), len(m))
            assert c[a:b] == handler.env_tokens(seq, k)
            k, i = k + 1, b
    want, _ = sequence_logprobs(model, r.prompt_ids, r.completion_ids, width, pad_id=0)
    got = _padded(r.logprobs, width)
    torch.testing.assert_close(got * mask, want * mask, atol=1e-5, rtol=1e-5)  # float32: rounding only
    assert (got * (1 - mask)).abs().sum() == 0  # environment tokens carry no sampler log-prob


def test_greedy_continuation_equals_re_prefilling_every_turn():
    """The same multi-turn episodes, once on the kept caches and once with the whole history prefilled again as a new
    prompt each turn (single-turn calls): identical tokens, log-probs equal to float32 rounding."""
    model, tok = tiny_model(seed=2)
    sampler = Sampler(model, tok)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=STOP)
    handler = ScriptedHandler(turns=3)
    r = sampler.generate(PROMPTS, 1, params, MultiTurn(handler, max_tokens=30))
    for seq, prompt in enumerate(PROMPTS):
        history, lps = list(prompt), []
        for k in range(1, 4):
            turn = sampler.generate([history], 1, params)
            history += turn.completion_ids[0]
            lps += turn.logprobs[0]
            if k == 3:
                break
            env = handler.env_tokens(seq, k)
            history += env
            lps += [0.0] * len(env)
        assert history[len(prompt):] == r.completion_ids[seq]
        torch.testing.assert_close(torch.tensor(r.logprobs[seq]), torch.tensor(lps), atol=1e-5, rtol=1e-5)


def test_environment_tokens_get_zero_gradient_and_model_logprobs_match_the_sampler():
    model, tok = tiny_model(seed=3, lora=True)
    model.train()
    sampler = Sampler(model, tok)
    params = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=STOP, seed=11)
    r = sampler.generate(PROMPTS, 2, params, MultiTurn(ScriptedHandler(turns=4), max_tokens=48))
    width = max(map(len, r.completion_ids))
    mask = completion_mask(r.completion_ids, width) * _padded(r.env_mask, width)  # what the trainer builds
    logps, _ = sequence_logprobs(model, r.prompt_ids, r.completion_ids, width, pad_id=0)
    logps.retain_grad()
    old = logps.detach()
    w, stats = rollout_correction_weights(old, _padded(r.logprobs, width), mask, "token_truncate", 2.0)
    assert stats["sampler/logp_abs_diff"] < 1e-5 and stats["sampler/is_weight_changed"] == 0.0
    adv = torch.randn(len(r.completion_ids))
    per_token, _ = per_token_policy_loss(logps, old, None, adv, mask, PolicyLossSettings("dapo", 0.2, None, None, 0.0,
                                                                                        "token"), w)
    loss = weighted_loss(per_token, loss_token_weights(mask, "dapo", 5))
    loss.backward()
    env = completion_mask(r.completion_ids, width) * (1 - _padded(r.env_mask, width))
    assert env.sum() > 0
    assert (logps.grad * env).abs().sum() == 0  # environment tokens: attended, not trained
    assert (logps.grad.abs() * mask > 0).sum() == mask.sum()  # every model token has a gradient
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert all(g is not None and g.abs().sum() > 0 for g in lora_grads)


def test_a_slow_environment_does_not_stall_the_others():
    """Sequence 0's environment blocks until every other sequence has finished all its turns: if the sampler waited
    for it before decoding the others, this would time out."""
    model, tok = tiny_model(seed=4)
    others_done = threading.Event()
    handler = ScriptedHandler(turns=3)
    waited = {}

    def slow():
        if handler.count[0] == 1:  # its first environment step
            start = time.perf_counter()
            waited["ok"] = others_done.wait(timeout=60)
            waited["s"] = time.perf_counter() - start

    handler.sleep_s = {0: slow}
    original_step = handler.step

    def step(seq, tokens, room):
        out = original_step(seq, tokens, room)
        if len(handler.finished) == len(PROMPTS) * 2 - 1 and 0 not in handler.finished:
            others_done.set()
        return out

    handler.step = step
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=STOP, seed=5)
    r = Sampler(model, tok).generate(PROMPTS, 2, params, MultiTurn(handler, max_tokens=40, workers=4))
    assert waited["ok"], "the other sequences were stalled by the slow environment"
    assert len(handler.finished) == 4 and all(handler.count[q] == 3 for q in range(4))
    assert 0 in [i for i, m in enumerate(r.env_mask) if 0 in m]


def test_budgets_end_episodes_and_a_failing_handler_ends_only_its_own():
    model, tok = tiny_model(seed=5)
    handler = ScriptedHandler(turns=50)
    original = handler.step

    def step(seq, tokens, room):
        if seq == 3:
            raise RuntimeError("environment crashed")
        return original(seq, tokens, room)

    handler.step = step
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=STOP, seed=9)
    r = Sampler(model, tok).generate(PROMPTS, 2, params, MultiTurn(handler, max_tokens=20))
    assert all(len(c) <= 20 for c in r.completion_ids)
    assert len(r.completion_ids[3]) <= 4 and 0 not in r.env_mask[3]  # ended after its first turn
    budget_ended = [q for q, why in handler.finished.items() if why == "max_tokens"]
    assert budget_ended and all(len(r.completion_ids[q]) > 20 - 7 for q in budget_ended)  # 7: env tokens + 1


def test_fp8_cache_continues_across_turns_within_its_tolerance():
    """Environment tokens prefilled onto an FP8 cache (codes and scale exponents written by the extend step): the
    model tokens' log-probs stay within the FP8 cache's tolerance of the model's own, as single-turn ones do."""
    from test_kv_fp8 import LOGP_MAX, LOGP_MEAN

    model, tok = tiny_model(seed=6)
    params = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=STOP, seed=13)
    r = Sampler(model, tok, kv_cache_dtype="fp8").generate(PROMPTS, 2, params,
                                                           MultiTurn(ScriptedHandler(turns=3), max_tokens=40))
    width = max(map(len, r.completion_ids))
    mask = _padded(r.env_mask, width)
    assert (mask == 0).any()
    with torch.no_grad():
        want, _ = sequence_logprobs(model, r.prompt_ids, r.completion_ids, width, pad_id=0)
    d = ((_padded(r.logprobs, width) - want).abs() * mask)
    assert 0 < float(d.sum() / mask.sum()) <= LOGP_MEAN and float(d.max()) <= LOGP_MAX


def test_extend_forwards_split_by_their_workspace_cap_give_the_same_rollout(monkeypatch):
    """Returning sequences prefilled one row per forward (a tiny workspace cap) or all together: the same tokens
    and log-probs (float32 rounding of other batch shapes only)."""
    import longrl.rollout.sampler as sampler_module

    model, tok = tiny_model(seed=7)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=STOP)
    together_sampler = Sampler(model, tok)
    together = together_sampler.generate(PROMPTS, 2, params, MultiTurn(ScriptedHandler(turns=3), max_tokens=30))
    monkeypatch.setattr(sampler_module, "EXTEND_WORKSPACE_BYTES", 1)
    split_sampler = Sampler(model, tok)
    split = split_sampler.generate(PROMPTS, 2, params, MultiTurn(ScriptedHandler(turns=3), max_tokens=30))
    assert split_sampler.last_stats["resume_forwards"] == split_sampler.last_stats["resumes"]
    assert together_sampler.last_stats["resume_forwards"] < together_sampler.last_stats["resumes"]
    assert split.completion_ids == together.completion_ids and split.env_mask == together.env_mask
    torch.testing.assert_close(torch.tensor(sum(split.logprobs, [])), torch.tensor(sum(together.logprobs, [])),
                               atol=1e-5, rtol=1e-5)
