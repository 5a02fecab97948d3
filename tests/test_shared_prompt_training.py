"""Grouped rows (train.shared_prompt) through training: micro-batches that keep a prompt's completions together,
the GRPO loss and gradient of every loss type equal to the repeated layout's (β > 0 and β = 0, micro-batch splits),
the trainer's passes and a whole tiny run giving the same metrics, and the planner's arithmetic."""

import pytest
import torch

from test_shared_prompt import _batch, _lora, _model

from longrl.memory.microbatch import count_groups, prompt_group_batches
from longrl.models.policy import reference_mode, sequence_logprobs
from longrl.ops.losses import PolicyLossSettings, loss_token_weights, per_token_policy_loss, weighted_loss


# --------------------------------------------------------------------------------------------- micro-batches

def test_micro_batches_keep_groups_whole_when_they_fit():
    prompts = [[1] * 10, [2] * 4, [1] * 10, [3] * 6, [2] * 4, [1] * 10]
    lengths = [5, 2, 7, 1, 3, 4]
    batches = prompt_group_batches(prompts, lengths, token_budget=40, size=0)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:  # every prompt's completions in one micro-batch, within the budget counted grouped
        cost = sum(len(prompts[i]) for i in {prompts[i][0]: i for i in b}.values()) + sum(lengths[i] for i in b)
        assert cost <= 40
    where = {i: k for k, b in enumerate(batches) for i in b}
    assert where[0] == where[2] == where[5] and where[1] == where[4]


def test_micro_batches_cut_a_group_that_exceeds_the_budget():
    """A group of P + ΣR over the budget is cut into runs of its completions that fit with the prompt; a completion
    that does not fit even alone is a run by itself."""
    prompts = [[7] * 10] * 5
    lengths = [6, 5, 4, 30, 3]
    batches = prompt_group_batches(prompts, lengths, token_budget=22, size=0)
    assert sorted(i for b in batches for i in b) == list(range(5))
    assert [3] in batches
    for b in batches:
        if b != [3]:
            assert 10 + sum(lengths[i] for i in b) <= 22


def test_micro_batches_keep_equal_prompts_with_other_images_apart():
    """Keys (a prompt's images): equal tokens with other keys are other units, each counting its prompt."""
    a, b = object(), object()
    prompts, keys = [[1] * 10] * 4, [a, b, a, b]
    assert prompt_group_batches(prompts, [5] * 4, token_budget=20, size=0, keys=keys) == [[0, 2], [1, 3]]
    assert prompt_group_batches(prompts, [5] * 4, token_budget=30, size=0) == [[0, 1, 2, 3]]
    assert prompt_group_batches(prompts, [1] * 4, token_budget=0, size=2, keys=keys) == [[0, 2], [1, 3]]


def test_micro_batches_by_count_follow_the_groups():
    prompts = [[1], [2], [1], [2], [1]]
    assert prompt_group_batches(prompts, [1] * 5, token_budget=0, size=2) == [[0, 2], [1, 4], [3]]
    assert count_groups(5, 2) == [[0, 1], [2, 3], [4]]  # the repeated layout's, for comparison


# ------------------------------------------------------------------------------------------------ the loss

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "sapo", "luspo", "vespo", "cispo"]


def _step_loss(model, prompt_ids, completion_ids, batches, s, ref, old, adv, mask, weights, shared):
    """Σ over micro-batches of the weighted per-token loss, backpropagated; (loss, gradients)."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for idx in batches:
        logps, _ = sequence_logprobs(model, [prompt_ids[i] for i in idx], [completion_ids[i] for i in idx],
                                     mask.shape[1], pad_id=0, shared_prompt=shared)
        per_token, _ = per_token_policy_loss(logps, old[idx], ref[idx] if ref is not None else None, adv[idx],
                                             mask[idx], s)
        loss = weighted_loss(per_token, weights[idx])
        loss.backward()
        total += float(loss.detach())
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    return total, grads


@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_and_gradient_equal_the_repeated_layout(loss_type, beta):
    """The step's loss and adapter gradients, float64, LoRA (the reference: adapters off), micro-batches of 3
    sequences against grouped micro-batches with a budget that cuts a group."""
    model = _lora(_model("qwen2"))
    prompt_ids, completion_ids = _batch(4, seed=11)
    n, width = len(prompt_ids), max(len(c) for c in completion_ids)
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(n, width, dtype=torch.float64)
    for i, c in enumerate(completion_ids):
        mask[i, :len(c)] = 1.0
    mask[3, :2] = 0.0  # a hole (environment tokens: attended, not trained)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    with torch.no_grad():
        now, _ = sequence_logprobs(model, prompt_ids, completion_ids, width, pad_id=0)
        ref = None
        if beta:
            with reference_mode(model):
                ref, ref_grouped = (sequence_logprobs(model, prompt_ids, completion_ids, width, pad_id=0,
                                                      shared_prompt=sp)[0] for sp in (False, True))
            torch.testing.assert_close(ref_grouped, ref, rtol=1e-10, atol=1e-10)
    old = (now + 0.2 * torch.randn(n, width, generator=g, dtype=torch.float64)) * mask
    s = PolicyLossSettings(loss_type=loss_type, beta=beta, epsilon_high=1.5 if loss_type == "cispo" else None,
                           importance_sampling_level="sequence" if loss_type == "luspo" else "token")
    weights = loss_token_weights(mask, loss_type, width)
    lengths = [len(c) for c in completion_ids]
    plain = _step_loss(model, prompt_ids, completion_ids, count_groups(n, 3), s, ref, old, adv, mask, weights, False)
    batches = prompt_group_batches(prompt_ids, lengths, token_budget=9 + 12, size=0)
    assert len(batches) > len({tuple(p) for p in prompt_ids})  # a group was cut
    grouped = _step_loss(model, prompt_ids, completion_ids, batches, s, ref, old, adv, mask, weights, True)
    assert grouped[0] == pytest.approx(plain[0], rel=1e-9, abs=1e-12)
    for a, b in zip(grouped[1], plain[1]):
        assert float((a - b).norm()) <= 1e-6 * float(b.norm()) + 1e-12


# ------------------------------------------------------------------------------------------------ the trainer

QUICK = ["train.max_steps=2", "train.prompts_per_step=3", "grpo.num_generations=4", "train.micro_batch_size=5",
         "output.progress_bar=false", "output.tensorboard=false", "output.save_steps=0"]


def _cfg(tmp_path, *overrides):
    from longrl.config import load_config
    from longrl.config.demo import demo_config

    return load_config(None, QUICK + [f"output.output_dir={tmp_path}", *overrides], base=demo_config())


def _metrics(history):
    return [{k: v for k, v in m.items() if not k.endswith(("time_s", "peak_gib"))} for m in history]


def assert_same_metrics(got, want):
    """Two runs' metrics (without timings and peaks) step after step: floats to float32 rounding, the rest equal."""
    got, want = _metrics(got), _metrics(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], float):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
            else:
                assert a[k] == b[k], k


@pytest.mark.parametrize("overrides", [
    [],  # the demo's: full weights, dapo, β = 0
    ["lora.enabled=true", "lora.r=4", "grpo.beta=0.05", "grpo.loss_type=grpo", "grpo.num_iterations=2",
     "train.micro_batch_tokens=24", "train.padding_free=true", "grpo.top_entropy_quantile=0.5",
     "grpo.entropy_coef=0.01"],
    # a 4-bit base (bitsandbytes' NF4 on the CPU, float32 compute) under LoRA, with the KL reference
    ["lora.enabled=true", "lora.r=4", "model.load_in_4bit=true", "grpo.beta=0.05", "grpo.loss_type=dr_grpo"],
])
def test_tiny_run_gives_the_same_metrics(tmp_path, overrides):
    """The demo's tiny GRPO run with train.shared_prompt=true and =false: the same rewards, losses, KL, entropies and
    gradient norms step after step, to float32 rounding (the reference, old-policy and entropy passes and the
    update; the second step samples from the weights the first one updated)."""
    from longrl.recipes.grpo import GRPOTrainer

    runs = {}
    for shared in ("false", "true"):
        trainer = GRPOTrainer(_cfg(tmp_path / shared, f"train.shared_prompt={shared}", *overrides))
        assert trainer.shared_prompt == (shared == "true") and trainer.layout.shared_prompt == trainer.shared_prompt
        if "model.load_in_4bit=true" in overrides:
            assert any(type(m).__name__ == "Linear4bit" for m in trainer.model.modules())
        runs[shared] = trainer.train()
    assert len(runs["true"]) == 2
    assert_same_metrics(runs["true"], runs["false"])


def test_trainer_refuses_a_pinned_shared_prompt_the_model_cannot_run_exactly(tmp_path, monkeypatch):
    from longrl.config import ConfigError
    from longrl.recipes.grpo import GRPOTrainer

    monkeypatch.setattr("longrl.models.shared_prompt.SUPPORTED_MODEL_TYPES", ("qwen2",))
    with pytest.raises(ConfigError, match="train.shared_prompt.*model_type 'llama'"):
        GRPOTrainer(_cfg(tmp_path, "train.shared_prompt=true"))


def test_null_is_off_on_the_cpu_and_bad_values_are_refused(tmp_path):
    from longrl.config import ConfigError, load_config
    from longrl.memory.layout import resolve_layout
    from longrl.memory.planner import StepShape

    cfg = _cfg(tmp_path, "data.max_prompt_length=64")
    step = StepShape.grpo(cfg, 4)  # a prompt-heavy step the planner would group on a GPU
    assert step.shared_prompt and not resolve_layout(cfg, None, torch.device("cpu"), step).shared_prompt
    pinned = _cfg(tmp_path, "train.shared_prompt=true")
    assert resolve_layout(pinned, None, torch.device("cpu"),
                          StepShape.grpo(pinned, 4)).to_dict()["train.shared_prompt"] is True
    with pytest.raises(ConfigError, match="train.shared_prompt"):
        load_config(None, ["train.shared_prompt=sometimes"])


# ------------------------------------------------------------------------------------------------ the planner

def _llama8b():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256)


def _plan_cfg(*overrides):
    from longrl.config import load_config

    return load_config(None, ["model.dtype=bfloat16", "lora.r=32", "train.prompts_per_step=2",
                              "grpo.num_generations=8", "rewards=[{function: 'tasks:reward'}]", *overrides])


def test_step_shape_takes_grouped_rows_when_pinned_and_knows_where_they_pay():
    """Null takes grouped rows where a group's P + G·R tokens are at most 0.35 of G·(P + R) (the measured wins:
    16K and 4K prompts with 1K answers); a pinned value wins either way."""
    from longrl.memory.planner import StepShape, shared_prompt_saves

    assert shared_prompt_saves(16384, 1024, 8) and shared_prompt_saves(4096, 1024, 8)
    assert not shared_prompt_saves(512, 256, 8) and not shared_prompt_saves(1024, 1024, 8)  # unmeasured shares
    assert not shared_prompt_saves(512, 20480, 8) and not shared_prompt_saves(16384, 1024, 1)
    long_prompts = _plan_cfg("data.max_prompt_length=16384", "generation.max_completion_length=1024")
    short_prompts = _plan_cfg("data.max_prompt_length=512", "generation.max_completion_length=20480")
    assert StepShape.grpo(long_prompts, 1024).shared_prompt
    assert not StepShape.grpo(short_prompts, 20480).shared_prompt
    pinned = _plan_cfg("data.max_prompt_length=512", "generation.max_completion_length=20480",
                       "train.shared_prompt=true")
    assert StepShape.grpo(pinned, 20480).shared_prompt
    unpinned = _plan_cfg("data.max_prompt_length=16384", "train.shared_prompt=false")
    assert not StepShape.grpo(unpinned, 1024).shared_prompt


def test_plan_counts_a_group_as_its_prompt_once():
    """16K prompts, 1K completions, G = 8, two prompts: 2 × (16,384 + 8 × 1,024) = 49,152 tokens a step grouped
    against 2 × 8 × 17,408 = 278,528; the micro-batch holds a whole group (24,576 tokens) on an H200."""
    from longrl.memory.planner import GIB, plan_for_config

    grouped = plan_for_config(_plan_cfg("data.max_prompt_length=16384", "generation.max_completion_length=1024",
                                        "train.shared_prompt=true"), _llama8b(), 139 * GIB, 500 * GIB)
    separate = plan_for_config(_plan_cfg("data.max_prompt_length=16384", "generation.max_completion_length=1024",
                                         "train.shared_prompt=false"), _llama8b(), 139 * GIB, 500 * GIB)
    unpinned = plan_for_config(_plan_cfg("data.max_prompt_length=16384", "generation.max_completion_length=1024"),
                               _llama8b(), 139 * GIB, 500 * GIB)
    assert grouped.shared_prompt and grouped.step_tokens == (49152, 278528, 8)
    assert not separate.shared_prompt and separate.step_tokens == (278528, 278528, 1)
    assert grouped.micro_batch_tokens >= 16384 + 8 * 1024
    assert "on: a prompt and up to 8 completions a row, 49,152 tokens a step instead of 278,528" in grouped.table()
    assert "off: 278,528 tokens a step" in separate.table()
    assert unpinned.shared_prompt and unpinned.step_tokens == grouped.step_tokens  # null: the planner takes them
    fp32 = plan_for_config(_plan_cfg("data.max_prompt_length=16384", "generation.max_completion_length=1024",
                                     "model.dtype=float32"), _llama8b(), 139 * GIB, 500 * GIB)
    assert not fp32.shared_prompt  # null with float32 compute: off (the flash kernels take 16-bit heads)


def test_planner_leaves_grouped_rows_off_for_float32_compute():
    """The flash kernels behind grouped rows take 16-bit heads: with float32 compute the planner's choice is off
    (a pin still holds)."""
    from longrl.memory.planner import GIB, plan_for_config

    long_prompts = ["data.max_prompt_length=16384", "generation.max_completion_length=1024", "model.dtype=float32"]
    assert not plan_for_config(_plan_cfg(*long_prompts), _llama8b(), 139 * GIB, 500 * GIB).shared_prompt
    assert plan_for_config(_plan_cfg(*long_prompts, "train.shared_prompt=true"), _llama8b(), 139 * GIB,
                           500 * GIB).shared_prompt


def test_plan_cuts_groups_where_a_whole_one_does_not_fit():
    """On a GPU too small for a whole group (P + 8R) the plan takes the most completions a row that fit."""
    from longrl.memory.planner import GIB, PlanError, plan_for_config

    cfg = _plan_cfg("data.max_prompt_length=16384", "generation.max_completion_length=8192", "model.load_in_4bit=true",
                    "train.shared_prompt=true")
    sizes = {}
    for gib in (10, 16, 20, 40):
        try:
            plan = plan_for_config(cfg, _llama8b(), gib * GIB, 500 * GIB)
        except PlanError:
            continue
        sizes[gib] = plan.step_tokens[2]
        assert plan.micro_batch_tokens >= 16384 + sizes[gib] * 8192
    assert 10 not in sizes  # not even one completion with its prompt fits
    assert list(sizes.values()) == sorted(sizes.values()) and 1 < sizes[16] < 8 == sizes[40]


def test_plan_refuses_a_pinned_shared_prompt_for_a_model_it_is_not_exact_for():
    from transformers import MistralConfig

    from longrl.config import ConfigError
    from longrl.memory.planner import GIB, plan_for_config

    mistral = MistralConfig(sliding_window=4096)
    cfg = _plan_cfg("data.max_prompt_length=16384", "generation.max_completion_length=1024")
    assert not plan_for_config(cfg, mistral, 139 * GIB, 500 * GIB).shared_prompt  # the planner's choice: off
    with pytest.raises(ConfigError, match="train.shared_prompt.*sliding window of 4096"):
        plan_for_config(_plan_cfg("data.max_prompt_length=16384", "generation.max_completion_length=1024",
                                  "train.shared_prompt=true"), mistral, 139 * GIB, 500 * GIB)


def test_cli_plan_shows_the_saving(tmp_path, capsys):
    """`longrl plan` on docs/memory.md's example (its config read from the doc): the grouped tokens of the step
    against the separate ones, and the saving gone with the key pinned off."""
    import re
    from pathlib import Path

    from longrl.cli.main import main

    doc = (Path(__file__).resolve().parents[1] / "docs" / "memory.md").read_text()
    yaml = re.search(r"```yaml\n(model: \{name_or_path: \./llama-3\.1-8b.*?)```", doc, re.S).group(1)
    _llama8b().save_pretrained(tmp_path / "llama-3.1-8b")
    (tmp_path / "long_prompts.yaml").write_text(yaml.replace("./llama-3.1-8b", str(tmp_path / "llama-3.1-8b")))
    assert main(["plan", str(tmp_path / "long_prompts.yaml"), "train.shared_prompt=true", "--gpu-memory-gib",
                 "139"]) == 0
    assert "on: a prompt and up to 8 completions a row, 49,152 tokens a step instead of 278,528" in \
        capsys.readouterr().out
    assert main(["plan", str(tmp_path / "long_prompts.yaml"), "train.shared_prompt=false", "--gpu-memory-gib",
                 "139"]) == 0
    assert "off: 278,528 tokens a step" in capsys.readouterr().out
