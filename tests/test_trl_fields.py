"""Every argument of TRL 1.15's GRPOConfig and SFTConfig (tests/trl_1_15_fields.json, with the TrainingArguments
fields they inherit) maps to longrl, is accepted when its value describes what longrl does, or is refused with the
longrl equivalent or the reason; a script that spells out TRL's defaults runs; all refusals of one call come in one
error; num_train_epochs becomes optimizer steps as TRL counts them."""

import json
import math
from pathlib import Path

import pytest

from longrl import GRPOConfig, SFTConfig
from longrl.compat.trl_config import steps_for_epochs
from longrl.config import ConfigError
from longrl.config.trl_names import GRPO_ONLY, TRL_NAMES, TRL_SFT_NAMES, Accepts

FIELDS = json.loads((Path(__file__).with_name("trl_1_15_fields.json")).read_text())
GRPO_FIELDS, SFT_FIELDS = FIELDS["GRPOConfig"], FIELDS["SFTConfig"]


def test_the_field_list_is_trl_1_15s():
    assert FIELDS["trl"] == "1.15.0" and len(GRPO_FIELDS) == 191 and len(SFT_FIELDS) == 135
    assert {"use_vllm", "vllm_importance_sampling_mode", "learning_rate", "optim"} <= set(GRPO_FIELDS)
    assert {"packing", "assistant_only_loss", "max_length"} <= set(SFT_FIELDS)


@pytest.mark.parametrize("cls, fields, table", [(GRPOConfig, GRPO_FIELDS, TRL_NAMES),
                                                (SFTConfig, SFT_FIELDS, TRL_SFT_NAMES)])
def test_every_field_is_in_the_table(cls, fields, table):
    missing = sorted(set(fields) - set(table))
    assert not missing, f"TRL 1.15 {cls.__name__} fields with no entry in longrl.config.trl_names: {missing}"
    if cls is SFTConfig:
        assert not set(fields) & (GRPO_ONLY - set(TRL_SFT_NAMES)), "an SFTConfig field refused as GRPO's"


@pytest.mark.parametrize("cls, fields", [(GRPOConfig, GRPO_FIELDS), (SFTConfig, SFT_FIELDS)])
def test_each_default_alone_and_all_defaults_together_are_accepted(cls, fields):
    """A script that spells out TRL's defaults (one at a time, and all at once) gets a config, never a refusal."""
    for name, default in fields.items():
        try:
            cls(**{name: default})
        except ConfigError as e:
            pytest.fail(f"{cls.__name__}({name}={default!r}) refused: {e}")
    cfg = cls(**fields)
    assert cfg.num_train_epochs == 3.0  # TRL's max_steps=-1 with num_train_epochs=3: three epochs
    assert (cfg.train.learning_rate, cfg.train.lr_scheduler_type, cfg.train.seed) == (
        fields["learning_rate"], "linear", 42)
    assert cfg.model.dtype == "auto" and cfg.output.report_to == ["none"] and cfg.output.eval_steps == 0
    if cls is GRPOConfig:
        assert (cfg.grpo.loss_type, cfg.grpo.rollout_correction, cfg.grpo.rollout_correction_cap) == (
            "dapo", "sequence_mask", 3.0)
        assert (cfg.train.micro_batch_size, cfg.train.prompts_per_step, cfg.grpo.num_generations) == (8, 1, 8)
    else:
        assert (cfg.sft.max_length, cfg.sft.assistant_only_loss, cfg.sft.completion_only_loss) == (1024, False, True)


def _outside(values):
    """A value an Accepts entry refuses."""
    return next(v for v in (True, False, 3, 0.5, "something-else", {"k": 1}, None) if v not in values)


@pytest.mark.parametrize("cls, fields, table", [(GRPOConfig, GRPO_FIELDS, TRL_NAMES),
                                                (SFTConfig, SFT_FIELDS, TRL_SFT_NAMES)])
def test_all_refusals_of_one_call_are_listed_together(cls, fields, table):
    """Every field that accepts only some values, given another one in a single call: one error listing each of them
    with its reason."""
    bad = {name: _outside(table[name].convert.values) for name in fields
           if isinstance(table[name].convert, Accepts)}
    assert len(bad) >= 40
    with pytest.raises(ConfigError) as e:
        cls(**bad)
    text = str(e.value)
    assert text.startswith(f"{cls.__name__}: {len(bad)} arguments cannot be used:")
    for name, value in bad.items():
        assert f"\n  - {name}={value!r}: {table[name].convert.why}" in text, name
    # mapped names with a value of the wrong type and unknown names join the same list
    with pytest.raises(ConfigError) as e:
        cls(use_vllm=True, optim="sgd", learning_rate="fast", lerning_rate=1e-5) if cls is GRPOConfig else \
            cls(packing_strategy="wrapped", optim="sgd", learning_rate="fast", lerning_rate=1e-5)
    lines = str(e.value).splitlines()
    assert lines[0].endswith("4 arguments cannot be used:") and "expected float" in lines[3]
    assert "did you mean train.learning_rate?" in lines[4]


def test_accepted_values_change_nothing_and_mapped_values_set_their_keys():
    spelled = GRPOConfig(use_vllm=False, optim="adamw_torch", save_strategy="steps", remove_unused_columns=False,
                         gradient_checkpointing=True, push_to_hub=False, dataloader_num_workers=4,
                         vllm_mode="server", report_to="none")
    assert spelled == GRPOConfig(gradient_checkpointing=True, report_to="none")
    cfg = GRPOConfig(use_cpu=True, ddp_timeout=60, train_sampling_strategy="sequential", eval_strategy="no",
                     eval_steps=50, max_tool_calling_iterations=3, warmup_steps=0.1, max_steps=200)
    assert (cfg.model.device, cfg.distributed.timeout_s, cfg.data.shuffle, cfg.output.eval_steps) == (
        "cpu", 60.0, False, 0)  # eval_strategy="no": no evaluation, whatever eval_steps says (as TRL)
    assert (cfg.environment.max_turns, cfg.train.warmup_steps) == (4, 20)  # 3 tool turns + the answer; 10% of 200
    assert GRPOConfig(bf16=True, fp16=False).model.dtype == "bfloat16"  # fp16=False leaves bf16's choice
    assert GRPOConfig(max_steps=50, num_train_epochs=2).num_train_epochs is None  # max_steps > 0 wins, as in TRL


def _trl_steps(num_rows, epochs, num_generations, per_device, accumulation, trl_steps_per_generation, iterations):
    """TRL 1.15 + transformers 5.25 on one process, transcribed: GRPOTrainer's RepeatSampler length and its
    dataloader (batch size per_device × steps_per_generation), then Trainer.set_initial_training_values."""
    generation_batch = per_device * trl_steps_per_generation
    unique = generation_batch // num_generations  # RepeatSampler batch_size
    sampler_len = (num_rows // unique) * unique * num_generations * (iterations * trl_steps_per_generation)
    dataloader_len = math.ceil(sampler_len / (per_device * trl_steps_per_generation))
    per_epoch = max(dataloader_len // accumulation + int(dataloader_len % accumulation > 0), 1)
    return math.ceil(epochs * per_epoch)


@pytest.mark.parametrize("rows, epochs, g, per_device, accumulation, spg, iterations", [
    (100, 1, 4, 8, 1, 1, 1), (100, 3, 4, 8, 2, 2, 1), (64, 0.5, 8, 8, 4, 4, 2), (50, 2, 2, 4, 1, 3, 1),
    (1000, 1.5, 8, 16, 2, 4, 3)])
def test_num_train_epochs_become_steps_as_trl_counts_them(rows, epochs, g, per_device, accumulation, spg, iterations):
    cfg = GRPOConfig(num_train_epochs=epochs, num_generations=g, per_device_train_batch_size=per_device,
                     gradient_accumulation_steps=accumulation, steps_per_generation=spg * accumulation,
                     num_iterations=iterations)
    trl = _trl_steps(rows, epochs, g, per_device, accumulation, spg * accumulation, iterations)
    per_rollout = iterations * spg
    steps = steps_for_epochs(cfg, cfg.num_train_epochs, rows)
    assert steps % per_rollout == 0 and trl <= steps < trl + per_rollout  # whole rollouts (longrl saves between)


def test_trainer_turns_epochs_into_steps_before_the_model_loads(tmp_path):
    from longrl.compat.trl import trainer_inputs
    from longrl.tasks.arithmetic import make_arithmetic_rows

    rows = make_arithmetic_rows(40, seed=1)
    args = GRPOConfig(output_dir=str(tmp_path), num_train_epochs=2, num_generations=4, per_device_train_batch_size=4,
                      gradient_accumulation_steps=2)  # 2 prompts a step: 20 steps an epoch
    inputs = trainer_inputs(("builtin:tiny-arith", "longrl.tasks.arithmetic:format_reward", args, rows))
    assert inputs.cfg.train.max_steps == 40 and inputs.cfg.num_train_epochs is None
    assert args.num_train_epochs == 2.0 and args.train.max_steps == 100  # the caller's args are left as given
    with pytest.raises(ConfigError, match="fewer than one rollout batch"):
        trainer_inputs(("builtin:tiny-arith", "longrl.tasks.arithmetic:format_reward",
                        GRPOConfig(num_train_epochs=1, per_device_train_batch_size=8, num_generations=2), rows[:3]))
