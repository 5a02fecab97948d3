"""Drafts on the device (rollout/device_drafts.py) against their plain twin, the sources each entry reads, and the
schedule that falls back to plain chunks (rollout/spec_schedule.py); the sampler's queued speculative steps keep
plain sampling's distribution and greedy tokens, falling back or not."""

from __future__ import annotations

import random

import pytest
import torch

import longrl.rollout.device_drafts as device_drafts
from longrl.rollout import Sampler, SamplingParams
from longrl.rollout.attention import KVCache
from longrl.rollout.device_drafts import NO_TOKEN, SEPARATOR, DeviceDrafts, match_drafts, match_drafts_reference
from longrl.rollout.spec_schedule import SpeculationSchedule, verify_cost_ratio
from test_sampler import PROMPTS, tiny_model
from test_speculative_acceptance import chi_square, chi_square_limit
from test_speculative_sampler import DRAWS, assert_same_rollout, peaked_model, three_token_law


def _random_case(rng: random.Random):
    """Sources of E entries over a 3-token vocabulary (frequent matches) with separators, R rows' queries (some
    starting before the context: NO_TOKEN), own ranges."""
    E, S, R, M = rng.randint(1, 3), rng.randint(1, 90), rng.randint(1, 7), rng.randint(1, 9)
    sources = [[SEPARATOR if rng.random() < 0.1 else rng.randrange(3) for _ in range(S)] for _ in range(E)]
    entry = [rng.randrange(E) for _ in range(R)]
    queries = []
    for _ in range(R):
        real = rng.randint(0, M)
        queries.append([NO_TOKEN] * (M - real) + [rng.randrange(3) for _ in range(real)])
    own = []
    for _ in range(R):
        a = rng.randint(0, S)
        own.append((a, rng.randint(a, S)))
    return sources, entry, queries, own


@pytest.mark.parametrize("elements", [device_drafts.MATCH_ELEMENTS, 1, 100])
def test_match_drafts_equals_its_twin(elements, monkeypatch):
    """Random sources, queries and own ranges, k 1-5, min_match 1-3; rows matched in chunks that cross rows
    (elements: positions compared at once; 1: a row a chunk)."""
    monkeypatch.setattr(device_drafts, "MATCH_ELEMENTS", elements)
    rng = random.Random(elements)
    matched = 0
    for _ in range(150):
        sources, entry, queries, own = _random_case(rng)
        k, min_match = rng.randint(1, 5), rng.randint(1, 3)
        want = match_drafts_reference(sources, entry, queries, own, k, min_match)
        drafts, found = match_drafts(torch.tensor(sources), torch.tensor(entry), torch.tensor(queries),
                                     torch.tensor([a for a, _ in own]), torch.tensor([b for _, b in own]), k,
                                     min_match)
        got = [row[:n] for row, n in zip(drafts.tolist(), found.tolist())]
        assert got == want
        assert all(t == SEPARATOR for row, n in zip(drafts.tolist(), found.tolist()) for t in row[n:])
        matched += sum(1 for w in want if w)
    assert matched > 100  # the cases do draft


def test_the_rule_prefers_the_longest_match_then_the_own_completion_then_the_latest():
    #         0  1  2  3  4   5  6  7  8  9  10 11 12
    source = [5, 6, 7, 1, -1, 5, 6, 8, 2, -1, 6, 9, 3]
    query = [4, 5, 6]
    run = lambda own: match_drafts_reference([source], [0], [query], [own], 2, 1)[0]  # noqa: E731
    assert run((0, 0)) == [8, 2]  # L = 2 at x = 2 and x = 7: the latest
    assert run((0, 4)) == [7, 1]  # … unless the other is in the row's own completion
    assert match_drafts_reference([source], [0], [[4, 9, 6]], [(0, 0)], 3, 1)[0] == [9, 3]  # L = 1: the latest
    assert match_drafts_reference([source], [0], [[4, 9, 6]], [(0, 0)], 3, 2)[0] == []  # below min_match


def test_open_entry_keeps_the_newest_earlier_completions_that_fit_oldest_first():
    drafts = DeviceDrafts(entries=2, max_prompt_len=3, history_tokens=8, device="cpu")
    drafts.open_entry(1, [7, 8], [[1, 2], [3, 4, 5], [6]])  # newest first: [1, 2] and [3, 4, 5] fit (3 + 4 = 7)
    assert drafts.fixed[1].tolist() == [3, 4, 5, -1, 1, 2, -1, -1, -1, 7, 8, -1, -1]
    assert drafts.filled == [0, 7]
    drafts.add_finished(1, torch.tensor([9]))  # a separator after it: 9 columns > 8, not kept
    assert drafts.filled == [0, 7]
    drafts.add_finished(0, torch.tensor([9, 9]))
    assert drafts.fixed[0, :4].tolist() == [9, 9, -1, -1] and drafts.filled == [3, 7]
    drafts.open_entry(0, [5], [])  # a new prompt in entry 0: its history goes
    assert drafts.fixed[0].tolist() == [-1] * 9 + [5, -1, -1, -1] and drafts.filled == [0, 7]


def test_propose_reads_the_entries_layout_and_the_slots_tokens():
    """propose against the twin on the layout written by hand: each entry's kept history and prompt, then its
    members' sections (the prompt's last max_match tokens, the member's first ``width`` tokens, a separator);
    queries from prompt ++ completion."""
    rng = random.Random(0)
    for trial in range(30):
        E, G, T, P, H, M = 2, 3, 12, 6, 10, rng.randint(2, 5)
        slots = E * G
        drafts = DeviceDrafts(E, P, H, "cpu", min_match=rng.randint(1, 2), max_match=M)
        prompts = [[rng.randrange(4) for _ in range(rng.randint(1, P))] for _ in range(E)]
        for e in range(E):
            drafts.open_entry(e, prompts[e], [[rng.randrange(4) for _ in range(rng.randint(1, 3))]
                                              for _ in range(rng.randint(0, 2))])
        tokens = torch.randint(0, 4, (slots, T))
        generated = torch.randint(0, T + 1, (slots,))
        order = torch.randperm(slots)  # slot of each (entry, member)
        members = order.view(E, G).clone()
        if trial % 2:
            members[1, 2] = -1  # a member without a slot
        entry = torch.zeros(slots, dtype=torch.long)
        for e in range(E):
            entry[members[e][members[e] >= 0]] = e
        prompt_len = torch.tensor([len(prompts[e]) for e in entry.tolist()])
        rows = torch.tensor([s for s in range(slots) if (members == s).any()])
        width, k = rng.randint(1, T), rng.randint(1, 4)
        got, found = drafts.propose(tokens, generated, prompt_len, entry, members, rows, width, k)
        used = max(drafts.filled)
        sources, own, queries = [], [], []
        for e in range(E):
            row = drafts.fixed[e, :used].tolist() + drafts.fixed[e, H:].tolist()
            tail = ([SEPARATOR] * M + prompts[e])[-M:]
            for m in members[e].tolist():
                section = tokens[m, :min(width, int(generated[m]))].tolist() if m >= 0 else []
                row += tail + section + [SEPARATOR] * (width + 1 - len(section))
            sources.append(row)
        fixed_width = used + drafts.fixed.shape[1] - H
        for s in rows.tolist():
            e = int(entry[s])
            j = members[e].tolist().index(s)
            start = fixed_width + j * (M + width + 1) + M
            own.append((start, start + min(width, int(generated[s]))))
            context = prompts[e] + tokens[s, :int(generated[s])].tolist()
            tail = context[-M:]
            queries.append([NO_TOKEN] * (M - len(tail)) + tail)
        want = match_drafts_reference(sources, entry[rows].tolist(), queries, own, k, drafts.min_match)
        assert [r[:n] for r, n in zip(got.tolist(), found.tolist())] == want


def test_a_wider_source_width_drafts_the_same():
    """The whole-step graphs' widths are rounded up (verify_steps.GRAPH_WIDTH_FLOOR, powers of two): any width at
    least every member's count, and every history column instead of those in use, give the same drafts."""
    rng = random.Random(1)
    for trial in range(20):
        E, G, T, P, H, M = 2, 3, 40, 6, 12, rng.randint(2, 5)
        slots = E * G
        drafts = DeviceDrafts(E, P, H, "cpu", min_match=rng.randint(1, 2), max_match=M)
        for e in range(E):
            drafts.open_entry(e, [rng.randrange(3) for _ in range(rng.randint(1, P))],
                              [[rng.randrange(3) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(0, 2))])
        tokens = torch.randint(0, 3, (slots, T))
        generated = torch.randint(0, 9, (slots,))
        members = torch.randperm(slots).view(E, G).clone()
        entry = torch.zeros(slots, dtype=torch.long)
        for e in range(E):
            entry[members[e]] = e
        prompt_len = drafts.prompt_len[entry]
        rows = torch.arange(slots)
        k = rng.randint(1, 4)
        need = int(generated.max())
        want = drafts.propose(tokens, generated, prompt_len, entry, members, rows, max(need, 1), k)
        for width, every in ((need + rng.randint(1, 7), False), (T, True), (rng.randint(max(need, 1), T), True)):
            got = drafts.propose(tokens, generated, prompt_len, entry, members, rows, width, k, every_column=every)
            assert [r[:n] for r, n in zip(*(x.tolist() for x in got))] == \
                [r[:n] for r, n in zip(*(x.tolist() for x in want))], (trial, width, every)


def test_the_schedule_backs_off_after_chunks_that_do_not_pay():
    s = SpeculationSchedule(max_backoff=4, measured=False)
    assert s.speculate_next()
    s.record(0.5, 1.2)  # 1.5 >= 1.1 · 1.2: pays
    assert s.speculate_next() and s.fallbacks == 0
    for wait in (1, 2, 4, 4):  # misses: 1, 2, 4, 4 plain chunks (the back-off doubles to its cap)
        s.record(0.1, 1.5)
        assert [s.speculate_next() for _ in range(wait + 1)] == [False] * wait + [True]
    s.record(1.0, 1.5)  # pays: the back-off is 1 again
    s.record(0.0, 1.5)
    assert [s.speculate_next() for _ in range(2)] == [False, True]
    off = SpeculationSchedule(enabled=False)
    off.record(0.0, 9.0)
    assert off.speculate_next() and off.fallbacks == 0


def test_the_measured_schedule_prices_a_verify_step_by_the_calls_own_step_times():
    """Until a plain chunk is timed, r is the byte model's and a plain chunk follows the first speculating one; then
    r = t_verify / t_plain; after refresh_every paying chunks in a row one plain chunk re-times plain steps."""
    s = SpeculationSchedule(max_backoff=4, refresh_every=3)
    assert s.cost_ratio(1.2, 0.5) == 1.2  # nothing timed yet: the byte model's ratio
    assert s.speculate_next()
    s.record(0.5, s.cost_ratio(1.2, 0.5))  # pays by bytes, but plain steps are still to be timed
    assert [s.speculate_next() for _ in range(2)] == [False, True]
    s.record_plain(0.02)
    assert s.cost_ratio(1.2, 0.05) == pytest.approx(2.5)
    s.record(0.5, s.cost_ratio(1.2, 0.05))  # 1.5 < 1.1 · 2.5: a miss, although the bytes say it pays
    assert s.fallbacks == 1 and s.last_ratio == pytest.approx(2.5)
    assert [s.speculate_next() for _ in range(2)] == [False, True]
    s.record_plain(0.02)
    for _ in range(2):  # 1 + 0.5 >= 1.1 · 1.25: pays, no plain chunk before the third in a row
        s.record(0.5, s.cost_ratio(1.2, 0.025))
        assert s.speculate_next()
    s.record(0.5, s.cost_ratio(1.2, 0.025))
    assert [s.speculate_next() for _ in range(2)] == [False, True] and s.fallbacks == 1
    for k, wait in ((1, 8), (2, 1)):  # 1 + 1 < 1.1 · 2: no acceptance could pay, the longest back-off at once;
        fresh = SpeculationSchedule(max_backoff=8, measured=False)  # 1 + 2 >= 1.1 · 2: the back-off starts at 1
        fresh.record(0.5, 2.0, max_drafts=k)
        assert [fresh.speculate_next() for _ in range(wait + 1)] == [False] * wait + [True]


def test_verify_cost_ratio_counts_the_own_keys_once_a_query():
    assert verify_cost_ratio(100.0, 20.0, 0.0, 4) == 1.0  # nothing of its own: k + 1 queries cost one weight read
    assert verify_cost_ratio(100.0, 20.0, 30.0, 1) == pytest.approx(180 / 150)
    assert verify_cost_ratio(100.0, 20.0, 30.0, 4) == pytest.approx(270 / 150)


class RandomClock:
    """Step timings drawn at random (its own generator, apart from the sampler's): the measured schedule's choices
    between plain and speculating chunks become random, as a real GPU's timings may make them."""

    def __init__(self, seed: int):
        self.now, self.rng = 0.0, random.Random(seed)

    def __call__(self) -> float:
        self.now += self.rng.expovariate(1.0)
        return self.now


@pytest.mark.parametrize("fast_verify, schedule", [(False, "always"), (True, "always"), (False, "random timings")])
def test_queued_speculation_keeps_plain_sampling_distribution(fast_verify, schedule):
    """20,000 completions of one prompt (2,500 groups of 8, each its own prefix entry) at temperature 0.7 with device
    drafts (from the prompt and each group's completions): every chunk speculating, or the measured schedule under
    random step timings (chunks speculating or plain at random); chi-square of the first three tokens against plain
    sampling's law (test_speculative_sampler's check)."""
    model, tok = peaked_model(seed=3)
    prompt = PROMPTS[0]
    params = SamplingParams(max_new_tokens=4, seed=11, temperature=0.7)
    law = three_token_law(model, prompt, params)
    # random timings: slots for 13 groups at a time, so that the call runs hundreds of chunks
    kv = (KVCache.nbytes(layers=2, kv_heads=2, head_dim=16, tokens=1, dtype=torch.float32) * 8 * (len(prompt) + 8 * 6)
          if schedule == "random timings" else None)
    sampler = Sampler(model, tok, speculative="ngram", max_draft_tokens=2, fast_verify=fast_verify,
                      speculative_fallback=schedule != "always", sync_every=2, kv_cache_bytes=kv)
    if schedule == "random timings":
        sampler.clock = RandomClock(seed=5)
    r = sampler.generate([prompt] * (DRAWS // 8), 8, params)
    stats = sampler.last_stats
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
    if schedule == "random timings":  # both kinds of chunk ran, many times
        assert stats["spec_fallbacks"] > 20 and stats["decode_steps"] - stats["spec_verify_steps"] > 100
    got = torch.tensor([c[:3] for c in r.completion_ids])  # [DRAWS, 3]
    V = law.shape[0]
    counts = torch.zeros(V, V, V).index_put_((got[:, 0], got[:, 1], got[:, 2]), torch.ones(DRAWS), accumulate=True)
    stat, df = chi_square(counts, law)
    assert stat < chi_square_limit(df), stat


class ChargedClock:
    """A clock that advances only by what the model's forwards are charged: ``plain`` for a forward of one token a
    row, ``verify`` for one of several (a verify step's forward; the extend forward on the CPU)."""

    def __init__(self, backbone, plain: float, verify: float):
        self.now, self.plain, self.verify = 0.0, plain, verify
        self.handle = backbone.register_forward_pre_hook(self._charge, with_kwargs=True)

    def _charge(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        width = (ids if ids is not None else embeds).shape[1]
        self.now += self.plain if width == 1 else self.verify

    def __call__(self) -> float:
        return self.now


def _charged_sampler(schedule: str, max_new_tokens: int):
    """(a speculating sampler of the peaked model, one draft, its clock charging a verify forward 8 plain ones; plain
    greedy decoding's rollout of PROMPTS × 2; the greedy params)."""
    from longrl.models.loading import model_parts

    model, tok = peaked_model(seed=3)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    plain = Sampler(model, tok, fast_decode=False, sync_every=4).generate(PROMPTS, 2, params)
    sampler = Sampler(model, tok, speculative="ngram", max_draft_tokens=1, fast_decode=False, fast_verify=False,
                      sync_every=4, speculative_schedule=schedule)
    sampler.clock = ChargedClock(model_parts(model)[0], plain=1.0, verify=8.0)
    return sampler, plain, params


@pytest.mark.parametrize("schedule", ["bytes", "measured"])
def test_speculation_falls_back_where_its_measured_steps_cost_more_than_they_gain(schedule):
    """The peaked model's greedy drafts of one token are mostly accepted (about 0.8 a verify row), above the byte
    model's break-even (r at most about 1.3 here), so the byte schedule speculates at every step. A clock charging a
    verify forward 8 plain ones (measured r = 8: no acceptance of one draft pays) sends the measured schedule to
    plain chunks after its first speculating one; greedy tokens equal plain decoding's either way."""
    sampler, plain, params = _charged_sampler(schedule, max_new_tokens=32)
    try:
        spec = sampler.generate(PROMPTS, 2, params)
    finally:
        sampler.clock.handle.remove()
    assert_same_rollout(spec, plain)
    stats = sampler.last_stats
    assert stats["spec_accepted_per_step"] > 0.5
    if schedule == "bytes":
        assert stats["spec_fallbacks"] == 0 and stats["spec_cost_ratio"] < 1.5
        assert stats["spec_verify_steps"] == stats["decode_steps"]  # every step a verify step
    else:
        assert stats["spec_fallbacks"] > 0 and stats["spec_cost_ratio"] == pytest.approx(8.0)
        assert stats["decode_steps"] - stats["spec_verify_steps"] >= 2 * 4  # plain chunks of 4 steps ran


def test_a_new_call_keeps_the_back_off_and_times_its_own_plain_steps():
    s = SpeculationSchedule(max_backoff=8)
    s.record_plain(0.01)
    s.record(0.5, s.cost_ratio(1.2, 0.05), max_drafts=2)  # r = 5: hopeless with 2 drafts, the longest back-off
    assert s.fallbacks == 1 and s.wait == 8 and s.last_ratio == pytest.approx(5.0)
    assert s.next_call() is s
    assert (s.wait, s.backoff) == (8, 8)  # carried over
    assert s.plain_step_s is None and s.last_ratio is None and s.fallbacks == 0 and s.streak == 0  # the call's own
    assert s.cost_ratio(1.2, 0.05) == 1.2  # no plain chunk of this call timed yet: the byte model's


@pytest.mark.parametrize("schedule", ["bytes", "measured"])
def test_the_measured_schedule_carries_its_back_off_to_the_next_call(schedule):
    """A verify forward charged 8 plain ones (one draft can never pay): the measured schedule's first call probes and
    backs off the longest; its next call of as many sequences starts in that back-off and runs plain chunks only.
    The byte schedule (every verify step paying by bytes) starts each call afresh. After forget_history a call
    repeats the first one's counts. Greedy tokens equal plain decoding's in every call; the sampler keeps at most
    MAX_CARRIED_SCHEDULES schedules."""
    from longrl.rollout.sampler import MAX_CARRIED_SCHEDULES

    sampler, plain, params = _charged_sampler(schedule, max_new_tokens=24)
    try:
        calls = []
        for _ in range(2):
            assert_same_rollout(sampler.generate(PROMPTS, 2, params), plain)
            calls.append(dict(sampler.last_stats))
        sampler.forget_history()  # no back-off, no earlier completions: the next call is a first call again
        assert_same_rollout(sampler.generate(PROMPTS, 2, params), plain)
        keys = ("spec_verify_steps", "spec_accepted_tokens", "spec_drafted_tokens", "decode_steps")
        assert {k: sampler.last_stats[k] for k in keys} == {k: calls[0][k] for k in keys}
        if schedule == "measured":
            assert calls[0]["spec_verify_steps"] > 0 and calls[0]["spec_fallbacks"] > 0
            assert calls[1]["spec_verify_steps"] == 0 and calls[1]["decode_steps"] > 0  # plain chunks only
            for n in range(9, MAX_CARRIED_SCHEDULES + 11):  # calls of other sizes: the least recent schedules go
                sampler.generate(PROMPTS[:1], n, SamplingParams(max_new_tokens=2, temperature=0))
            assert len(sampler._schedules) == MAX_CARRIED_SCHEDULES and 2 * len(PROMPTS) not in sampler._schedules
        else:
            assert all(c["spec_verify_steps"] == c["decode_steps"] > 0 for c in calls)  # every step verifies
            assert not sampler._schedules
    finally:
        sampler.clock.handle.remove()


@pytest.mark.parametrize("fallback", [True, False])
def test_queued_speculation_with_plain_chunks_gives_plain_greedy_tokens(fallback):
    """A model whose greedy text repeats less than the peaked one's (acceptance below the tiny model's
    break-even): with the fallback, chunks alternate between speculating and plain; greedy tokens and log-probs
    equal plain decoding's either way (the byte schedule: the measured one's choices follow the CPU's timings)."""
    model, tok = tiny_model(seed=5)
    params = SamplingParams(max_new_tokens=60, temperature=0, stop_token_ids=(3,))
    plain = Sampler(model, tok, sync_every=4).generate(PROMPTS, 3, params)
    sampler = Sampler(model, tok, speculative="ngram", sync_every=4, speculative_fallback=fallback,
                      speculative_schedule="bytes")
    spec = sampler.generate(PROMPTS, 3, params)
    assert_same_rollout(spec, plain)
    stats = sampler.last_stats
    assert stats["spec_verify_steps"] > 0
    assert (stats["spec_fallbacks"] > 0 and "spec_time_saved_s" in stats) == fallback  # plain chunks ran


def test_a_call_drafts_from_the_prompts_earlier_completions():
    """The device drafts' history persists across calls: after one call, each prompt's G completions are kept and
    the next call's entries open with them."""
    model, tok = peaked_model(seed=1)
    sampler = Sampler(model, tok, speculative="ngram")
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=2)
    first = sampler.generate(PROMPTS[:2], 4, params)
    for p, prompt in enumerate(PROMPTS[:2]):
        kept = sampler.draft_history.completions(prompt)
        assert sorted(map(tuple, kept)) == sorted(tuple(c) for c in first.completion_ids[4 * p:4 * p + 4] if c)


@pytest.mark.parametrize("base", ["nf4", "fp8"])
def test_queued_speculation_on_a_quantized_base_gives_plain_greedy_tokens(base):
    """A 4-bit (bitsandbytes NF4, where it runs on the CPU) or FP8 base with LoRA adapters that matter, sampled
    through the fused adapters: queued speculative steps give plain greedy's tokens and log-probs."""
    if base == "nf4":
        pytest.importorskip("bitsandbytes")
    from test_lora_fusion import randomise_adapters

    from longrl.config import LoraConfig
    from longrl.models import load_model

    quantized = {"nf4": dict(load_in_4bit=True), "fp8": dict(load_in_fp8=True)}[base]
    model, tok = load_model("builtin:tiny-arith", lora=LoraConfig(r=4), device="cpu", **quantized)
    randomise_adapters(model, 3)
    prompts = [tok(s, add_special_tokens=False)["input_ids"] for s in ("3+4=", "12+9=", "7+7=")]
    params = SamplingParams(max_new_tokens=24, temperature=0)
    plain = Sampler(model, tok).generate(prompts, 3, params)
    sampler = Sampler(model, tok, speculative="ngram", speculative_fallback=False)
    spec = sampler.generate(prompts, 3, params)
    assert_same_rollout(spec, plain, tol=1e-4)
    assert sampler.last_stats["spec_accepted_tokens"] > 0
