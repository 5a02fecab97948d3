"""Each loss type, clipping case and the KL term against plain per-sample formulas; split invariance."""

import math

import pytest
import torch

from longrl.ops.advantages import group_advantages, reference_group_advantages
from longrl.ops.losses import PolicyLossSettings, loss_token_weights, per_token_policy_loss, weighted_loss


def _batch(seed, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3  # ratios well outside [0.8, 1.2]
    ref = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logps, old, ref, adv, mask, lengths


def reference_loss(logps, old, ref, adv, mask, s: PolicyLossSettings, max_len):
    """Loop over sequences and tokens, written straight from the formulas in TRL's documentation."""
    B, T = logps.shape
    eps_hi = s.epsilon if s.epsilon_high is None else s.epsilon_high
    per_seq_sum, per_seq_len, total = [], [], 0.0
    for i in range(B):
        n = int(mask[i].sum())
        seq_logw = sum(float(logps[i, t] - old[i, t]) for t in range(n)) / max(n, 1)
        acc = 0.0
        for t in range(n):
            lw = seq_logw if s.importance_sampling_level == "sequence" else float(logps[i, t] - old[i, t])
            w = math.exp(lw)
            a = float(adv[i])
            if s.loss_type == "cispo":
                ell = -min(w, eps_hi) * a * float(logps[i, t])
            else:
                w1 = min(w, s.delta) if s.delta is not None else w
                w2 = min(max(w, 1 - s.epsilon), 1 + eps_hi)
                ell = -min(w1 * a, w2 * a)
            if s.beta:
                d = float(ref[i, t] - logps[i, t])
                ell += s.beta * (math.exp(d) - d - 1) * (w if s.use_bias_correction_kl else 1.0)
            acc += ell
        per_seq_sum.append(acc)
        per_seq_len.append(n)
        total += acc
    if s.loss_type == "grpo":
        return sum(x / max(n, 1) for x, n in zip(per_seq_sum, per_seq_len)) / B
    if s.loss_type == "dr_grpo":
        return total / (B * max_len)
    return total / max(sum(per_seq_len), 1)


SETTINGS = [
    PolicyLossSettings(loss_type=lt, beta=beta, epsilon=0.2, epsilon_high=eh, delta=d, importance_sampling_level=lvl,
                       use_bias_correction_kl=bc)
    for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")  # the others: tests/test_loss_menu.py
    for (beta, eh, d, lvl, bc) in [(0.0, None, None, "token", True), (0.04, 0.28, None, "token", False),
                                   (0.1, None, 1.5, "token", True), (0.0, 0.3, None, "sequence", True),
                                   (0.05, 0.3, None, "sequence", True)]
]
SETTINGS = [s if s.loss_type != "cispo" else PolicyLossSettings(**{**s.__dict__, "epsilon_high": 1.1}) for s in SETTINGS]


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: f"{s.loss_type}-b{s.beta}-eh{s.epsilon_high}-d{s.delta}-{s.importance_sampling_level}")
def test_loss_matches_reference_formula(s):
    seed = torch.seed() % 2**31
    logps, old, ref, adv, mask, _ = _batch(seed)
    max_len = 9
    ptl, _ = per_token_policy_loss(logps, old, ref, adv, mask, s)
    got = float(weighted_loss(ptl, loss_token_weights(mask, s.loss_type, max_len)))
    want = reference_loss(logps, old, ref, adv, mask, s, max_len)
    assert got == pytest.approx(want, rel=1e-10, abs=1e-12), f"seed {seed}"


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: f"{s.loss_type}-{s.importance_sampling_level}-b{s.beta}")
def test_split_invariance_of_loss_and_gradient(s):
    seed = torch.seed() % 2**31
    logps, old, ref, adv, mask, _ = _batch(seed, B=7, T=5)
    weights = loss_token_weights(mask, s.loss_type, 6)

    def run(splits):
        lp = logps.clone().requires_grad_(True)
        total = 0.0
        for a, b in splits:
            ptl, _ = per_token_policy_loss(lp[a:b], old[a:b], ref[a:b], adv[a:b], mask[a:b], s)
            loss = weighted_loss(ptl, weights[a:b])
            loss.backward()
            total += float(loss.detach())
        return total, lp.grad

    whole, g_whole = run([(0, 7)])
    for splits in ([(0, 1), (1, 7)], [(0, 3), (3, 5), (5, 7)], [(i, i + 1) for i in range(7)]):
        part, g_part = run(splits)
        assert part == pytest.approx(whole, rel=1e-12, abs=1e-14)
        assert torch.allclose(g_part, g_whole, rtol=1e-12, atol=1e-14)


def test_clipping_cases():
    s = PolicyLossSettings(loss_type="bnpo", epsilon=0.2, epsilon_high=0.3)
    old = torch.zeros(4, 1, dtype=torch.float64)
    ratios = torch.tensor([[1.5], [1.5], [0.5], [0.5]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    ptl, diag = per_token_policy_loss(ratios.log(), old, None, adv, torch.ones(4, 1), s)
    # ratio 1.5, A>0: clipped at 1.3; ratio 1.5, A<0: unclipped 1.5; ratio 0.5, A>0: unclipped; A<0: clipped at 0.8
    assert torch.allclose(ptl[:, 0], torch.tensor([-1.3, 1.5, -0.5, 0.8], dtype=torch.float64))
    assert diag["clipped"][:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    s_delta = PolicyLossSettings(loss_type="bnpo", epsilon=0.2, delta=1.4)
    ptl, _ = per_token_policy_loss(ratios.log(), old, None, adv, torch.ones(4, 1), s_delta)
    assert float(ptl[1, 0]) == pytest.approx(1.4)  # two-sided clipping caps the negative-advantage ratio at delta


def test_k3_kl_is_zero_at_reference_and_positive_elsewhere():
    from longrl.ops.losses import k3_kl

    lp = torch.randn(5, 3, dtype=torch.float64)
    assert torch.all(k3_kl(lp, lp) == 0)
    assert torch.all(k3_kl(lp, lp + torch.randn(5, 3, dtype=torch.float64)) >= 0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_against_reference(scale):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    rewards = torch.rand(24, generator=g)
    rewards[8:12] = 0.5  # a zero-std group
    rewards[3] = float("nan")  # a failed reward
    got = group_advantages(rewards, 4, scale)
    want = reference_group_advantages(rewards, 4, scale)
    assert torch.allclose(got, want.float(), atol=1e-5)
    assert torch.all(got[8:12] == 0) and got[3] == 0


def test_advantages_bad_group_size():
    with pytest.raises(ValueError, match="groups of 5"):
        group_advantages(torch.rand(12), 5)
