"""rollout/drafts.py: the indexed proposer drafts what its brute-force twin drafts (fresh random streams, odd
lengths, repeats, a history), its history is bounded, and k adapts within [1, k_max]."""

import random

import pytest

from longrl.rollout.drafts import AdaptiveK, DraftHistory, GroupProposer, propose_reference


def stream(rng, n, vocab):
    """n tokens: random, with stretches copied from earlier in the stream (as completions repeat themselves)."""
    out = []
    while len(out) < n:
        if out and rng.random() < 0.4:
            a = rng.randrange(len(out))
            out += out[a:a + rng.randint(1, 9)]
        else:
            out.append(rng.randrange(vocab))
    return out[:n]


@pytest.mark.parametrize("seed", range(12))
def test_indexed_proposer_matches_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 7, 50])  # 3: many repeats and ties
    G, min_match, max_match = rng.randint(1, 5), rng.randint(1, 3), rng.choice([3, 5, 16])
    prompt = stream(rng, rng.randint(0, 31), vocab)
    history = DraftHistory(max_tokens=rng.choice([20, 200]))
    for _ in range(rng.randint(0, 2)):  # earlier steps of the same prompt
        history.add(prompt, [stream(rng, rng.randint(0, 23), vocab) for _ in range(G)])
    past = history.completions(prompt)
    prop = GroupProposer(prompt, G, k_max=6, min_match=min_match, max_match=max_match, history=history)
    targets = [stream(rng, rng.randint(1, 41), vocab) for _ in range(G)]
    for i, t in enumerate(targets):
        t[:0] = prompt[-rng.randint(0, 4):] if prompt and rng.random() < 0.5 else []  # quoting the prompt
    done = [0] * G
    proposals = 0
    while any(d < len(t) for d, t in zip(done, targets)):
        i = rng.randrange(G)
        if done[i] >= len(targets[i]):
            continue
        step = rng.randint(1, 3)  # grow unevenly
        prop.append(i, targets[i][done[i]:done[i] + step])
        done[i] = min(len(targets[i]), done[i] + step)
        completions = [prop.completion(j) for j in range(G)]
        for j in range(G):
            k = rng.randint(1, 6)
            want = propose_reference(prompt, completions, past, j, k, min_match, max_match)
            assert prop.propose(j, k) == want, (seed, j, k)
            proposals += bool(want)
    assert proposals > 0  # the streams did produce matches


def test_drafts_come_from_the_group_the_prompt_and_history():
    prompt = [1, 2, 3, 4, 5, 6]
    history = DraftHistory()
    history.add(prompt, [[20, 21, 22, 23, 24]])
    prop = GroupProposer(prompt, 2, k_max=3, min_match=2, history=history)
    prop.append(0, [9, 3, 4])
    assert prop.propose(0) == [5, 6]  # the prompt continues "3 4" (and ends there)
    prop.append(1, [30, 31, 32, 33])
    prop.append(0, [30, 31])
    assert prop.propose(0) == [32, 33]  # the other completion
    prop.append(0, [21, 22])
    assert prop.propose(0) == [23, 24]  # the earlier step's completion
    assert prop.propose(0, k=1) == [23]
    prop.append(0, [77, 78])
    assert prop.propose(0) == []  # nothing matches
    prop.finish()
    assert history.completions(prompt)[0] == [30, 31, 32, 33]  # newest first


def test_history_memory_is_bounded():
    h = DraftHistory(max_tokens=10, max_prompts=2)
    h.add([1], [[1] * 4, [2] * 4])
    h.add([1], [[3] * 4])
    assert h.completions([1]) == [[3] * 4, [2] * 4]  # the oldest dropped
    h.add([1], [[4] * 25])
    assert h.completions([1]) == [[4] * 10]  # one longer than the cap: its first max_tokens
    h.add([2], [[5]])
    h.completions([1])  # [1] used: [2] is now the least recently used
    h.add([3], [[6]])
    assert h.completions([2]) == [] and h.completions([1]) and h.completions([3])
    for p in range(100):
        h.add([p], [[p] * 7, [p] * 9])
    assert h.stored_tokens() <= 2 * 10


def test_k_adapts_within_bounds():
    a = AdaptiveK(4, start=2)
    a.update(2, 2)
    assert a.k == 3
    a.update(3, 3), a.update(4, 4), a.update(4, 4)
    assert a.k == 4  # k_max
    a.update(4, 1)
    assert a.k == 3
    a.update(3, 2)
    assert a.k == 3  # half or more accepted: unchanged
    for _ in range(5):
        a.update(a.k, 0)
    assert a.k == 1
    a.update(0, 0)
    assert a.k == 1
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveK(0)


def test_device_draft_counts_adapt_as_adaptive_k():
    """adapted_draft_counts (the queued steps' tensor form) against AdaptiveK.update on every (k, drafted, accepted)
    with k_max 1-5, drafted 0-k and accepted 0-drafted."""
    import torch

    from longrl.rollout.drafts import adapted_draft_counts

    for k_max in range(1, 6):
        cases = [(k, d, a) for k in range(1, k_max + 1) for d in range(k + 1) for a in range(d + 1)]
        want = []
        for k, d, a in cases:
            adaptive = AdaptiveK(k_max, start=k)
            adaptive.update(d, a)
            want.append(adaptive.k)
        k, d, a = (torch.tensor(c) for c in zip(*cases))
        assert adapted_draft_counts(k, d, a, k_max).tolist() == want
