"""rollout/speculative.py: drafted tokens accepted by the exact rule leave the emitted tokens with plain sampling's
distribution (chi-square over 20,000 seeded draws of the first two tokens of a small Markov "model"), their
log-probs are those of the tokens kept, and greedy decoding is unchanged."""

import math

import pytest
import torch

from longrl.rollout.sampling import SamplingParams, next_tokens, sampling_distribution
from longrl.rollout.speculative import processed_logprobs, seen_with_drafts, speculative_step

V = 6
DRAWS = 20_000
PARAMS = {"t1": SamplingParams(temperature=1.0), "t07": SamplingParams(temperature=0.7),
          "topk": SamplingParams(temperature=1.0, top_k=3), "topp": SamplingParams(temperature=0.7, top_p=0.8),
          "minp": SamplingParams(temperature=1.0, min_p=0.15)}


def table(seed=0) -> torch.Tensor:
    """logits of the next token given the previous one: [V, V]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * 1.5


def probs(W, params) -> torch.Tensor:
    return sampling_distribution(W, params).exp().double()  # [V, V]: p(next | previous)


def chi_square_limit(df: int, z: float = 3.29) -> float:
    """The chi-square quantile at about 1 − 5e-4 (Wilson–Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) with cells of expected count < 5 pooled; asserts no draw where p = 0."""
    counts, expected = counts.flatten().double(), expected_p.flatten() * counts.sum()
    assert counts[expected_p.flatten() == 0].sum() == 0, "a token of probability 0 was emitted"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def drafts_for(P, kind: str, start: int, k: int) -> list[int] | None:
    """A chain of k drafts from ``start``: each the likeliest, the least likely possible, or an impossible next."""
    out, prev = [], start
    for _ in range(k):
        p = P[prev]
        if kind == "likely":
            d = int(p.argmax())
        elif kind == "unlikely":
            d = int(torch.where(p > 0, p, 2.0).argmin())
        else:
            zero = (p == 0).nonzero()
            if len(zero) == 0:
                return None
            d = int(zero[0])
        out.append(d)
        prev = d
    return out


def two_tokens(W, params, drafts: list[int], start: int, seed: int) -> torch.Tensor:
    """The first two emitted tokens [DRAWS, 2] of speculative decoding from ``start``: a verify step with
    ``drafts``, then for rows that kept no draft a second step drafting token 0."""
    params = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                            min_p=params.min_p, seed=seed)
    k = len(drafts)
    seq = torch.arange(DRAWS)
    d = torch.tensor(drafts).expand(DRAWS, k)
    logits = W[torch.tensor([start] + drafts)].expand(DRAWS, k + 1, V)  # position i sees token i before it
    first = speculative_step(logits, d, params, seq, torch.zeros(DRAWS, dtype=torch.long))
    t1 = first.tokens[:, 0]
    second = speculative_step(torch.stack([W[t1], W[torch.zeros_like(t1)]], dim=1), torch.zeros(DRAWS, 1).long(),
                              params, seq, torch.ones(DRAWS, dtype=torch.long))
    t2 = torch.where(first.accepted >= 1, first.tokens[:, 1], second.tokens[:, 0])
    return torch.stack([t1, t2], dim=1)


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("kind", ["likely", "unlikely", "impossible"])
def test_two_token_continuations_have_plain_sampling_distribution(name, k, kind):
    W, params, start = table(), PARAMS[name], 2
    P = probs(W, params)
    drafts = drafts_for(P, kind, start, k)
    if drafts is None:
        pytest.skip(f"{name}: every token is possible")
    got = two_tokens(W, params, drafts, start, seed=list(PARAMS).index(name) * 100 + k * 10 + len(kind))
    counts = torch.zeros(V, V).index_put_((got[:, 0], got[:, 1]), torch.ones(DRAWS), accumulate=True)
    want = P[start][:, None] * P  # P(t1, t2) = p(t1 | start) p(t2 | t1)
    stat, df = chi_square(counts, want)
    assert stat < chi_square_limit(df), (name, k, kind, drafts, stat, df)


def test_the_chi_square_check_sees_a_wrong_distribution():
    """The same draws against temperature 0.8's distribution instead of 0.7's fail: the test can fail."""
    W, start = table(), 2
    P = probs(W, PARAMS["t07"])
    got = two_tokens(W, PARAMS["t07"], drafts_for(P, "likely", start, 2), start, seed=5)
    counts = torch.zeros(V, V).index_put_((got[:, 0], got[:, 1]), torch.ones(DRAWS), accumulate=True)
    wrong = probs(W, SamplingParams(temperature=0.8))
    stat, df = chi_square(counts, wrong[start][:, None] * wrong)
    assert stat > chi_square_limit(df)


@pytest.mark.parametrize("name", list(PARAMS))
def test_logprobs_are_those_of_the_emitted_tokens(name):
    params = PARAMS[name]
    g = torch.Generator().manual_seed(1)
    B, k = 64, 3
    logits = torch.randn(B, k + 1, 50, generator=g) * 2
    drafts = logits[:, :k].argmax(-1)
    drafts[::3] = torch.randint(0, 50, (len(drafts[::3]), k), generator=g)  # a third with random drafts
    out = speculative_step(logits, drafts, params, torch.arange(B), torch.full((B,), 7))
    T = params.temperature
    for b in range(B):
        n = int(out.accepted[b])
        assert torch.equal(out.tokens[b, :n], drafts[b, :n]) and bool((out.tokens[b, n + 1:] == -1).all())
        for i in range(n + 1):
            t = int(out.tokens[b, i])
            want = torch.log_softmax(logits[b, i] / T, -1)[t]
            want_processed = sampling_distribution(logits[b, i:i + 1], params)[0, t]
            assert torch.allclose(out.logprobs[b, i], want, atol=1e-5)
            assert torch.allclose(out.processed_logprobs[b, i], want_processed, atol=1e-5)
            assert math.isfinite(float(want_processed))  # a token the processed distribution allows


def test_greedy_speculation_gives_plain_greedy_tokens_and_logprobs():
    W = table(3) * 2
    params = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(4)
    plain, plain_lp, prev = [], [], 1
    for pos in range(40):
        tok, lp = next_tokens(W[prev][None], params, torch.tensor([0]), torch.tensor([pos]))
        plain.append(int(tok)), plain_lp.append(float(lp))
        prev = int(tok)
    spec, spec_lp, ctx = [], [], [1]
    while len(spec) < 40:
        k = int(torch.randint(1, 4, (1,), generator=g))
        # drafts: the true continuation with a random token swapped in half of the time
        drafts = plain[len(spec):len(spec) + k] + [0] * k
        drafts = drafts[:k]
        if torch.rand(1, generator=g) < 0.5:
            drafts[int(torch.randint(0, k, (1,), generator=g))] = int(torch.randint(0, V, (1,), generator=g))
        logits = W[torch.tensor([ctx[-1]] + drafts)][None]
        out = speculative_step(logits, torch.tensor([drafts]), params, torch.tensor([0]), torch.tensor([len(spec)]))
        n = int(out.accepted)
        spec += out.tokens[0, :n + 1].tolist()
        spec_lp += out.logprobs[0, :n + 1].tolist()
        ctx += out.tokens[0, :n + 1].tolist()
    assert spec[:40] == plain
    assert torch.allclose(torch.tensor(spec_lp[:40]), torch.tensor(plain_lp), atol=1e-6)


def test_repetition_penalty_sees_the_drafts_before_each_position():
    g = torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=0.9, repetition_penalty=1.3)
    B, k, Vb = 4, 3, 20
    logits = torch.randn(B, k + 1, Vb, generator=g)
    drafts = torch.randint(0, Vb, (B, k), generator=g)
    seen = torch.rand(B, Vb, generator=g) < 0.2
    got = processed_logprobs(logits, params, seen_with_drafts(seen, drafts))
    for b in range(B):
        for i in range(k + 1):
            s = seen[b].clone()
            s[drafts[b, :i]] = True
            assert torch.allclose(got[b, i], sampling_distribution(logits[b, i:i + 1], params, s[None])[0])


@pytest.mark.parametrize("name", ["t07", "topk"])
def test_padded_rows_equal_calls_with_their_own_draft_count(name):
    """speculative_step with lengths: each row, its drafts padded to k, gives what a call with its own n drafts
    gives (same accepted count, tokens, log-probs): the padding is never accepted nor drawn around."""
    params = PARAMS[name]
    g = torch.Generator().manual_seed(3)
    B, k = 48, 3
    logits = torch.randn(B, k + 1, V, generator=g) * 2
    drafts = torch.where(torch.rand(B, k, generator=g) < 0.6, logits[:, :k].argmax(-1),
                         torch.randint(0, V, (B, k), generator=g))
    lengths = torch.arange(B) % (k + 1)  # 0 … k drafts
    seq, pos = torch.arange(B), torch.full((B,), 4)
    padded = speculative_step(logits, drafts, params, seq, pos, lengths=lengths)
    for n in range(k + 1):
        rows = lengths == n
        own = speculative_step(logits[rows, :n + 1], drafts[rows, :n], params, seq[rows], pos[rows])
        assert torch.equal(padded.accepted[rows], own.accepted)
        assert torch.equal(padded.tokens[rows, :n + 1], own.tokens) and bool((padded.tokens[rows, n + 1:] == -1).all())
        assert torch.equal(padded.logprobs[rows, :n + 1], own.logprobs)
