"""The loss menu beyond the clipped surrogate (sapo, luspo, vespo, the bias-corrected KL, the entropy bonus and token
mask, the off-policy mask, GDPO advantages, steps_per_generation) against plain per-token formulas written here,
values and gradients, and the split into micro-batches changing nothing. When TRL is installed, also against TRL's
own ``GRPOTrainer._compute_loss`` on identical inputs (skipped otherwise: TRL is not a dependency)."""

import math
import statistics
import types
from collections import defaultdict

import pytest
import torch

from longrl.ops.advantages import decoupled_group_advantages
from longrl.ops.losses import (PolicyLossSettings, entropy_bonus_weights, high_entropy_mask, loss_token_weights,
                               per_token_policy_loss, weighted_loss)

LOG_1E8 = math.log(1e-8)


def _inputs(seed, B=7, T=5, holes=True):
    """Random float64 inputs; masks with holes (not only prefixes) and one empty row."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) < 0.8).double()
    if holes:
        mask[0] = 0.0  # a completion with no token in the loss (e.g. its reward failed)
    mask[1] = 1.0
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    ref = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    sampled = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[2] = 0.0  # no signal: its policy term is 0 (whichever sign branch sapo, vespo and the masks take)
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    sampler_w = torch.exp(torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2) * mask
    return dict(logps=logps, old=old, ref=ref, sampled=sampled, adv=adv, mask=mask, entropy=entropy,
                sampler_w=sampler_w)


def reference_token_loss(x, i, t, lp, s: PolicyLossSettings, keep=None, sampler_w=None):
    """ℓ_{i,t} as a torch scalar, straight from the formulas (lp: the differentiable log π [B, T])."""
    mask, old, a = x["mask"], x["old"], float(x["adv"][i])
    tokens = [u for u in range(mask.shape[1]) if mask[i, u] > 0]
    if s.importance_sampling_level == "sequence":
        lw = sum(lp[i, u] - old[i, u] for u in tokens) / max(len(tokens), 1)
    else:
        lw = lp[i, t] - old[i, t]
    w = torch.exp(lw)
    eps_hi = s.epsilon if s.epsilon_high is None else s.epsilon_high
    if s.loss_type == "sapo":
        tau = s.sapo_temperature_pos if a > 0 else s.sapo_temperature_neg
        ell = -(4.0 / tau) * torch.sigmoid(tau * (w - 1.0)) * a
    elif s.loss_type == "vespo":
        log_w_seq = sum(min(max(float(lp[i, u] - old[i, u]), -20.0), 20.0) for u in tokens)
        if sampler_w is not None:
            log_w_seq += sum(min(max(math.log(float(sampler_w[i, u])), LOG_1E8), 20.0) for u in tokens)
        log_w_seq = min(max(log_w_seq, LOG_1E8), 20.0)
        k, lam = (s.vespo_k_pos, s.vespo_lambda_pos) if a >= 0 else (s.vespo_k_neg, s.vespo_lambda_neg)
        phi = math.exp(lam + k * log_w_seq - lam * math.exp(log_w_seq))  # a constant: no gradient through φ
        ell = -phi * a * lp[i, t]
    elif s.loss_type == "cispo":
        ell = -min(float(w), eps_hi) * a * lp[i, t]
    else:
        w1 = torch.clamp(w, max=s.delta) if s.delta is not None else w
        w2 = torch.clamp(w, 1 - s.epsilon, 1 + eps_hi)
        ell = -torch.min(w1 * a, w2 * a)
    if s.off_policy_mask_threshold is not None:
        sampled = x["sampled"]
        mean_kl = sum(float(sampled[i, u] - lp[i, u]) for u in tokens) / max(len(tokens), 1)
        if not (a >= 0 or mean_kl <= s.off_policy_mask_threshold):
            ell = ell * 0.0
    if keep is not None:
        ell = ell * float(keep[i, t])
    if sampler_w is not None and s.loss_type != "vespo":
        ell = ell * float(sampler_w[i, t])
    if s.beta:
        d = x["ref"][i, t] - lp[i, t]
        k3 = torch.exp(d) - d - 1.0
        ell = ell + s.beta * k3 * (w if s.use_bias_correction_kl else 1.0)
    return ell


def reference_step_loss(x, lp, s, rows, max_len, num_steps=1, keep=None, sampler_w=None, ent=None, entropy_coef=0.0):
    """The loss of one optimizer step (its ``rows``) aggregated by loss type, plus the entropy bonus."""
    mask = x["mask"]
    sums, lens = [], []
    for i in rows:
        tokens = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        sums.append(sum((reference_token_loss(x, i, t, lp, s, keep, sampler_w) for t in tokens), torch.zeros((),
                        dtype=torch.float64)))
        lens.append(len(tokens))
    B = len(rows)
    if s.loss_type in ("grpo", "sapo"):
        loss = sum(v / max(n, 1) for v, n in zip(sums, lens)) / B
    elif s.loss_type == "luspo":
        loss = sum(sums) / B
    elif s.loss_type == "bnpo":
        loss = sum(sums) / max(sum(lens), 1)
    elif s.loss_type == "dr_grpo":
        loss = sum(sums) / (B * max_len)
    else:  # dapo, cispo, vespo: the rollout batch's tokens per step
        loss = sum(sums) / (float(mask.sum()) / num_steps)
    if entropy_coef:
        kept = [(i, t) for i in rows for t in range(mask.shape[1])
                if mask[i, t] > 0 and (keep is None or keep[i, t] > 0)]
        loss = loss - entropy_coef * sum(ent[i, t] for i, t in kept) / max(len(kept), 1)
    return loss


def _implementation(x, lp, s, rows, weights, keep=None, sampler_w=None, ent=None, bonus=None):
    sl = slice(rows[0], rows[-1] + 1)
    ptl, _ = per_token_policy_loss(lp[sl], x["old"][sl], x["ref"][sl], x["adv"][sl], x["mask"][sl], s,
                                   sampler_w[sl] if sampler_w is not None else None,
                                   keep[sl] if keep is not None else None, x["sampled"][sl])
    loss = weighted_loss(ptl, weights[sl])
    if bonus is not None:
        loss = loss - weighted_loss(ent[sl], bonus[sl])
    return loss


MENU = [
    PolicyLossSettings(loss_type="sapo"),
    PolicyLossSettings(loss_type="sapo", sapo_temperature_pos=0.7, sapo_temperature_neg=2.0, beta=0.05,
                       importance_sampling_level="sequence"),
    PolicyLossSettings(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.1, epsilon_high=0.15),
    PolicyLossSettings(loss_type="luspo", beta=0.1, use_bias_correction_kl=False),
    PolicyLossSettings(loss_type="vespo"),
    PolicyLossSettings(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=0.5,
                       vespo_lambda_neg=4.0, beta=0.04),
    PolicyLossSettings(loss_type="dapo", beta=0.1, use_bias_correction_kl=True, off_policy_mask_threshold=0.05),
    PolicyLossSettings(loss_type="grpo", beta=0.1, importance_sampling_level="sequence", off_policy_mask_threshold=0.1),
    PolicyLossSettings(loss_type="cispo", epsilon_high=1.1, beta=0.02, off_policy_mask_threshold=0.02),
    PolicyLossSettings(loss_type="bnpo", delta=1.3, beta=0.05),
    PolicyLossSettings(loss_type="dr_grpo", beta=0.05, importance_sampling_level="sequence"),
]


def _id(s):
    return (f"{s.loss_type}-{s.importance_sampling_level}-b{s.beta}-bc{int(s.use_bias_correction_kl)}"
            f"-opm{s.off_policy_mask_threshold}")


@pytest.mark.parametrize("extras", ["plain", "sampler+entropy"])
@pytest.mark.parametrize("s", MENU, ids=_id)
def test_loss_and_gradient_match_reference(s, extras):
    seed = torch.seed() % 2**31
    S, B = 2, 7  # a rollout batch of two optimizer steps; the second is checked
    x = _inputs(seed, B=S * B, T=5)
    rows = list(range(B, 2 * B))
    sampler_w = keep = bonus = None
    coef = 0.0
    if extras != "plain":
        sampler_w = x["sampler_w"]
        keep = torch.zeros_like(x["mask"])
        keep[rows] = high_entropy_mask(x["entropy"][rows], x["mask"][rows], 0.4).double()
        coef = 0.03
        bonus = torch.zeros_like(x["mask"])
        bonus[rows] = coef * entropy_bonus_weights(x["mask"][rows] * keep[rows])
    weights = loss_token_weights(x["mask"], s.loss_type, 9, steps_per_generation=S)

    lp = x["logps"].clone().requires_grad_(True)
    ent = x["entropy"].clone().requires_grad_(True)
    got = _implementation(x, lp, s, rows, weights, keep, sampler_w, ent, bonus)
    got.backward()
    lp_ref = x["logps"].clone().requires_grad_(True)
    ent_ref = x["entropy"].clone().requires_grad_(True)
    want = reference_step_loss(x, lp_ref, s, rows, 9, S, keep, sampler_w, ent_ref, coef)
    want.backward()
    assert float(got) == pytest.approx(float(want), rel=1e-10, abs=1e-12), f"seed {seed}"
    assert torch.allclose(lp.grad, lp_ref.grad, rtol=1e-9, atol=1e-12), f"seed {seed}"
    if coef:
        assert torch.allclose(ent.grad, ent_ref.grad, rtol=1e-12, atol=1e-15), f"seed {seed}"
    assert torch.all(lp.grad[:B] == 0)  # the other step's completions get nothing


@pytest.mark.parametrize("s", [m for m in MENU if m.loss_type in ("sapo", "luspo")] +
                         [PolicyLossSettings(loss_type="dapo", beta=0.2)], ids=_id)
def test_gradcheck_of_the_differentiable_losses(s):
    """sapo, luspo and the bias-corrected KL have no stop-gradient: autograd's gradient is the numerical one."""
    x = _inputs(torch.seed() % 2**31, B=5, T=4)
    weights = loss_token_weights(x["mask"], s.loss_type, 6)

    def f(lp):
        ptl, _ = per_token_policy_loss(lp, x["old"], x["ref"], x["adv"], x["mask"], s)
        return weighted_loss(ptl, weights)

    # away from the clip boundaries (where the surrogate has a kink) the numerical derivative is well defined
    x["old"] = x["logps"] + 0.01 * torch.randn_like(x["logps"])
    assert torch.autograd.gradcheck(f, (x["logps"].clone().requires_grad_(True),), eps=1e-7, atol=1e-6)


@pytest.mark.parametrize("s", MENU, ids=_id)
def test_split_invariance_with_whole_step_statistics(s):
    """The entropy mask and bonus weights from the whole step; then any micro-batch split gives the same loss and
    the same gradient (float64: equal to rounding; the per-token gradient exactly)."""
    seed = torch.seed() % 2**31
    x = _inputs(seed, B=7, T=6)
    keep = high_entropy_mask(x["entropy"], x["mask"], 0.3).double()
    bonus = 0.05 * entropy_bonus_weights(x["mask"] * keep)
    weights = loss_token_weights(x["mask"], s.loss_type, 6)

    def run(splits):
        lp = x["logps"].clone().requires_grad_(True)
        ent = x["entropy"].clone().requires_grad_(True)
        total = 0.0
        for a, b in splits:
            loss = _implementation(x, lp, s, list(range(a, b)), weights, keep, x["sampler_w"], ent, bonus)
            loss.backward()
            total += float(loss.detach())
        return total, lp.grad, ent.grad

    whole, g_whole, e_whole = run([(0, 7)])
    for splits in ([(0, 1), (1, 7)], [(0, 3), (3, 5), (5, 7)], [(i, i + 1) for i in range(7)]):
        part, g_part, e_part = run(splits)
        assert part == pytest.approx(whole, rel=1e-12, abs=1e-14), f"seed {seed}"
        assert torch.allclose(g_part, g_whole, rtol=1e-12, atol=1e-15), f"seed {seed}"
        assert torch.equal(e_part, e_whole)


def _quantile(values, q):
    """Linear-interpolation quantile of a list, written out."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5, 0.77, 1.0])
def test_high_entropy_mask_against_reference(rho):
    x = _inputs(torch.seed() % 2**31, B=9, T=7)
    got = high_entropy_mask(x["entropy"], x["mask"], rho)
    values = [float(x["entropy"][i, t]) for i in range(9) for t in range(7) if x["mask"][i, t] > 0]
    threshold = _quantile(values, 1 - rho)
    want = torch.tensor([[bool(x["mask"][i, t] > 0 and float(x["entropy"][i, t]) >= threshold) for t in range(7)]
                         for i in range(9)])
    assert torch.equal(got, want)
    if rho == 0.0:
        assert int(got.sum()) == 1  # only the highest-entropy token
    if rho == 1.0:
        assert torch.equal(got, x["mask"].bool())
    assert not high_entropy_mask(x["entropy"], torch.zeros_like(x["mask"]), rho).any()


def test_entropy_mask_is_a_statistic_of_the_whole_step():
    """Taken per micro-batch, the threshold would differ: the whole step's mask is what the trainer passes."""
    x = _inputs(3, B=8, T=6, holes=False)
    x["entropy"][:4] += 5.0  # the first half of the step has all the high-entropy tokens
    whole = high_entropy_mask(x["entropy"], x["mask"], 0.2)
    halves = torch.cat([high_entropy_mask(x["entropy"][:4], x["mask"][:4], 0.2),
                        high_entropy_mask(x["entropy"][4:], x["mask"][4:], 0.2)])
    assert not whole[4:].any() and halves[4:].any()


def reference_gdpo(per_function, weights, G, invalid):
    """GDPO written out: per group and function mean and (unbiased) std, weighted sum, batch normalisation."""
    n, f = len(per_function), len(weights)
    normalised = [[None] * f for _ in range(n)]
    for g0 in range(0, n, G):
        for k in range(f):
            vals = [per_function[i][k] for i in range(g0, g0 + G) if not math.isnan(per_function[i][k])]
            mean = sum(vals) / len(vals) if vals else 0.0
            std = statistics.stdev(vals) if len(vals) > 1 else 0.0
            for i in range(g0, g0 + G):
                if not math.isnan(per_function[i][k]):
                    normalised[i][k] = (per_function[i][k] - mean) / (std + 1e-4)
    total = [None if invalid[i] else sum(weights[k] * v for k, v in enumerate(normalised[i]) if v is not None)
             for i in range(n)]
    valid = [v for v in total if v is not None]
    mean, std = sum(valid) / len(valid), statistics.stdev(valid)
    return [0.0 if v is None else (v - mean) / (std + 1e-4) for v in total]


def test_gdpo_advantages_against_reference():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    G, P, F = 4, 5, 3
    per_function = torch.rand(P * G, F, generator=g) * torch.tensor([1.0, 10.0, 0.1])  # very different scales
    per_function[3, 1] = float("nan")  # a function that did not apply to a sample
    per_function[8:12, 2] = 0.5  # a function constant over a group
    per_function[13] = float("nan")  # no function applied
    invalid = torch.isnan(per_function).all(-1)
    invalid[6] = True  # a reward function failed on it
    weights = torch.tensor([1.0, 0.5, 2.0])
    got = decoupled_group_advantages(per_function, weights, G, invalid)
    want = reference_gdpo(per_function.tolist(), weights.tolist(), G, invalid.tolist())
    assert torch.allclose(got, torch.tensor(want), atol=2e-5)
    assert got[6] == 0 and got[13] == 0
    with pytest.raises(ValueError, match="groups of 3"):
        decoupled_group_advantages(per_function, weights, 3)


def test_steps_per_generation_weights():
    """Each step of a rollout batch gets its own weights; dapo's denominator is the batch's tokens per step."""
    x = _inputs(5, B=12, T=5)
    mask = x["mask"]
    for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"):
        w3 = loss_token_weights(mask, lt, 7, steps_per_generation=3)
        for s in range(3):
            part = mask[4 * s:4 * s + 4]
            want = loss_token_weights(part, lt, 7)
            if lt in ("dapo", "cispo", "vespo"):
                want = part / (float(mask.sum()) / 3)
            assert torch.allclose(w3[4 * s:4 * s + 4], want, rtol=1e-15), lt
    with pytest.raises(ValueError, match="into 5 steps"):
        loss_token_weights(mask, "dapo", 7, steps_per_generation=5)


# ----------------------------------------------------------------------------------- TRL's own code, when installed

def _trl_loss(x, lp, s: PolicyLossSettings, entropies, top_entropy_quantile, entropy_coef, sampler_w, max_len):
    """TRL 1.15's GRPOTrainer._compute_loss on these inputs: one process, the whole step one micro-batch."""
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    B, T = lp.shape
    acc = types.SimpleNamespace(pad_across_processes=lambda t, dim=0, pad_index=0: t, gather=lambda t: t,
                                reduce=lambda t, reduction="sum": t, num_processes=1, sync_gradients=True,
                                gather_for_metrics=lambda t: t)
    args = types.SimpleNamespace(use_bias_correction_kl=s.use_bias_correction_kl, delta=s.delta,
                                 sapo_temperature_pos=s.sapo_temperature_pos,
                                 sapo_temperature_neg=s.sapo_temperature_neg, vespo_k_pos=s.vespo_k_pos,
                                 vespo_lambda_pos=s.vespo_lambda_pos, vespo_k_neg=s.vespo_k_neg,
                                 vespo_lambda_neg=s.vespo_lambda_neg, steps_per_generation=1, entropy_target=0.2)
    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, entropies, None), aux_loss_enabled=False,
        top_entropy_quantile=top_entropy_quantile, off_policy_mask_threshold=s.off_policy_mask_threshold,
        get_off_policy_mask=grpo_trainer.GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=grpo_trainer.GRPOTrainer.get_gamma_weights, importance_sampling_level=s.importance_sampling_level,
        beta=s.beta, args=args, loss_type=s.loss_type, epsilon_low=s.epsilon,
        epsilon_high=s.epsilon if s.epsilon_high is None else s.epsilon_high, use_vllm=sampler_w is not None,
        vllm_importance_sampling_correction=sampler_w is not None, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=max_len, accelerator=acc,
        _entropy_bonus_enabled=entropy_coef != 0.0, entropy_coef=entropy_coef, use_adaptive_entropy=False,
        _metrics=defaultdict(lambda: defaultdict(list)))
    fake.get_high_entropy_mask = types.MethodType(grpo_trainer.GRPOTrainer.get_high_entropy_mask, fake)
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": x["mask"],
              "advantages": x["adv"], "old_per_token_logps": x["old"], "ref_per_token_logps": x["ref"],
              "sampling_per_token_logps": x["sampled"], "num_items_in_batch": x["mask"].sum()}
    if sampler_w is not None:  # TRL's ratios are 1 (not 0) outside the completion
        inputs["importance_sampling_ratio"] = torch.where(x["mask"] > 0, sampler_w, torch.ones_like(sampler_w))
    return grpo_trainer.GRPOTrainer._compute_loss(fake, None, inputs)


TRL_CASES = [
    (PolicyLossSettings(loss_type="sapo", beta=0.05), 1.0, 0.0, False),
    (PolicyLossSettings(loss_type="sapo", sapo_temperature_pos=0.5, importance_sampling_level="sequence"), 0.4, 0.02,
     True),
    (PolicyLossSettings(loss_type="luspo", importance_sampling_level="sequence", beta=0.1), 1.0, 0.0, False),
    (PolicyLossSettings(loss_type="luspo", beta=0.1, use_bias_correction_kl=False), 0.3, 0.05, True),
    (PolicyLossSettings(loss_type="vespo", beta=0.04), 1.0, 0.0, False),
    (PolicyLossSettings(loss_type="vespo", vespo_k_neg=1.0), 0.5, 0.01, True),
    (PolicyLossSettings(loss_type="dapo", beta=0.1, off_policy_mask_threshold=0.05), 0.2, 0.03, True),
    (PolicyLossSettings(loss_type="grpo", beta=0.1, importance_sampling_level="sequence",
                        off_policy_mask_threshold=0.1), 1.0, 0.1, False),
    (PolicyLossSettings(loss_type="cispo", epsilon_high=1.1, beta=0.02), 0.6, 0.0, True),
    (PolicyLossSettings(loss_type="bnpo", delta=1.3, beta=0.05, use_bias_correction_kl=False), 1.0, 0.0, False),
    (PolicyLossSettings(loss_type="dr_grpo", beta=0.05), 0.0, 0.02, False),
]


@pytest.mark.parametrize("s, rho, coef, with_sampler", TRL_CASES, ids=lambda c: _id(c) if isinstance(c, PolicyLossSettings) else str(c))
def test_equals_trl_compute_loss(s, rho, coef, with_sampler):
    """longrl's step loss and gradient equal TRL 1.15's _compute_loss (float32, as in training)."""
    x = {k: v.float() for k, v in _inputs(torch.seed() % 2**31, B=6, T=7).items()}
    sampler_w = x["sampler_w"] if with_sampler else None
    lp_trl = x["logps"].clone().requires_grad_(True)
    ent_trl = x["entropy"].clone().requires_grad_(True)
    trl_loss = _trl_loss(x, lp_trl, s, ent_trl, rho, coef, sampler_w, 9)
    trl_loss.backward()

    keep = high_entropy_mask(x["entropy"], x["mask"], rho).float() if rho < 1.0 else None
    bonus = coef * entropy_bonus_weights(x["mask"] if keep is None else x["mask"] * keep) if coef else None
    lp = x["logps"].clone().requires_grad_(True)
    ent = x["entropy"].clone().requires_grad_(True)
    loss = _implementation(x, lp, s, list(range(6)), loss_token_weights(x["mask"], s.loss_type, 9), keep, sampler_w,
                           ent, bonus)
    loss.backward()
    assert float(loss) == pytest.approx(float(trl_loss), rel=1e-5, abs=1e-7)
    assert torch.allclose(lp.grad, lp_trl.grad, rtol=1e-4, atol=1e-7)
    if coef:
        assert torch.allclose(ent.grad, ent_trl.grad, rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------------------------- in the trainer and the config

QUICK = ["train.max_steps=2", "train.prompts_per_step=4", "grpo.num_generations=4", "train.micro_batch_size=16",
         "output.progress_bar=false", "output.tensorboard=false", "output.save_steps=0", "output.log_completions=0"]


def _cfg(tmp_path, *overrides):
    from longrl.config import load_config
    from longrl.config.demo import demo_config

    return load_config(None, QUICK + [f"output.output_dir={tmp_path}", *overrides], base=demo_config())


def test_menu_trains_and_the_split_changes_nothing(tmp_path):
    """sapo with the entropy bonus, the high-entropy token mask, the off-policy mask and two steps per rollout:
    the run trains, and micro-batches of 5 give the metrics of one micro-batch (the token mask and the bonus
    weights are statistics of the whole step)."""
    from longrl.compat.trl import GRPOTrainer

    menu = ["grpo.loss_type=sapo", "grpo.entropy_coef=0.01", "grpo.top_entropy_quantile=0.5",
            "grpo.off_policy_mask_threshold=0.002", "grpo.steps_per_generation=2", "grpo.beta=0.05",
            "lora.enabled=true", "train.learning_rate=5e-3", "train.warmup_steps=0"]  # a step that moves the policy
    whole = GRPOTrainer(_cfg(tmp_path / "whole", *menu)).train()
    split = GRPOTrainer(_cfg(tmp_path / "split", *menu, "train.micro_batch_size=5")).train()
    assert [m["rollout_time_s"] > 0 for m in whole] == [True, False]  # one rollout for the two steps
    for a, b in zip(whole, split):
        assert a["high_entropy_ratio"] == pytest.approx(0.5, abs=0.1)
        for k in ("loss", "kl", "grad_norm", "entropy", "high_entropy_ratio", "off_policy_masked_ratio"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    # the first step is on-policy (sampler and trainer differ by rounding), the second is not: some of its
    # negative-advantage completions are masked
    assert whole[0]["off_policy_masked_ratio"] == 0 and whole[1]["off_policy_masked_ratio"] > 0


@pytest.mark.parametrize("overrides", [
    ["grpo.loss_type=vespo", "grpo.num_iterations=2", "grpo.beta=0.04", "lora.enabled=true",
     "grpo.rollout_correction=token_mask"],
    ["grpo.loss_type=luspo", "grpo.importance_sampling_level=sequence", "grpo.multi_objective_aggregation=normalize_then_sum",
     "grpo.use_bias_correction_kl=false", "grpo.beta=0.02", "lora.enabled=true"],
])
def test_menu_variants_train(tmp_path, overrides):
    from longrl.compat.trl import GRPOTrainer

    history = GRPOTrainer(_cfg(tmp_path, *overrides)).train()
    assert len(history) == 2
    for m in history:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["kl"] >= 0


@pytest.mark.parametrize("overrides, key", [
    (["grpo.top_entropy_quantile=1.5"], "grpo.top_entropy_quantile"),
    (["grpo.off_policy_mask_threshold=0"], "grpo.off_policy_mask_threshold"),
    (["grpo.sapo_temperature_neg=0"], "grpo.sapo_temperature_neg"),
    (["grpo.vespo_k_pos=-1"], "grpo.vespo_k_pos"),
    (["grpo.entropy_coef=.nan"], "grpo.entropy_coef"),
    (["grpo.steps_per_generation=0"], "grpo.steps_per_generation"),
    (["grpo.steps_per_generation=3"], "train.max_steps"),  # 2 steps are not whole rollout batches of 3
    (["grpo.steps_per_generation=2", "train.max_steps=6", "output.save_steps=3"], "output.save_steps"),
    (["grpo.loss_type=vespo", "grpo.rollout_correction=sequence_mask"], "grpo.rollout_correction"),
    (["grpo.multi_objective_aggregation=gdpo"], "grpo.multi_objective_aggregation"),
    (["grpo.loss_type=ppo"], "grpo.loss_type"),
])
def test_menu_config_errors(tmp_path, overrides, key):
    from longrl.config import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _cfg(tmp_path, *overrides)


def test_trainer_update_is_split_invariant_in_float64(tmp_path):
    """One update of the trainer on one rollout batch in float64, with every whole-step option on (the entropy
    token mask, the entropy bonus, the off-policy mask, two steps per rollout): micro-batches of 16 and of 3
    give the same loss and gradients to float64 rounding."""
    from longrl.config.schema import LoraConfig
    from longrl.models import apply_lora, build_tiny_model
    from longrl.compat.trl import GRPOTrainer

    model, tok = build_tiny_model(seed=1, dtype=torch.float64)
    model = apply_lora(model, LoraConfig(r=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    cfg = _cfg(tmp_path, "grpo.loss_type=sapo", "grpo.entropy_coef=0.02", "grpo.top_entropy_quantile=0.3",
               "grpo.off_policy_mask_threshold=0.01", "grpo.steps_per_generation=2", "grpo.beta=0.1",
               "lora.enabled=true", "generation.backend=hf", "generation.max_completion_length=6")
    trainer = GRPOTrainer(cfg, model=model, tokenizer=tok)
    batch = trainer._rollout_batch()
    batch.old_logps = batch.old_logps + 0.05 * torch.randn_like(batch.old_logps)  # off-policy: masks take effect
    batch.advantages = torch.randn(batch.advantages.shape, dtype=torch.float64)  # the untrained model scores 0
    trainer.optimizer.step = trainer.scheduler.step = lambda *a, **k: None  # the weights stay where they are
    rows = list(range(16, 32))  # the rollout's second step
    results = []
    for size in (16, 3):
        trainer.cfg.train.micro_batch_size = size
        stats = trainer._policy_update(batch, rows)
        results.append((stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (s16, g16) = results[0]
    assert 0 < s16["high_entropy_ratio"] < 0.5 and s16["off_policy_masked_ratio"] > 0
    for stats, grads in results[1:]:
        for k in ("loss", "kl", "entropy", "high_entropy_ratio", "off_policy_masked_ratio"):
            assert stats[k] == pytest.approx(s16[k], rel=1e-12, abs=1e-15), k
        assert grads.keys() == g16.keys() and grads
        for n in grads:
            assert torch.allclose(grads[n], g16[n], rtol=1e-10, atol=1e-13), n
