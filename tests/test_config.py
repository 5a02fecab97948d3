"""Config parsing, overrides and validation errors (before any model loads)."""

import subprocess
import sys

import pytest
import yaml

from longrl.config import Config, ConfigError, load_config
from longrl.config.demo import demo_config


def test_defaults_roundtrip_through_yaml(tmp_path):
    cfg = demo_config()
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def test_dotted_overrides_and_types():
    cfg = load_config(None, ["train.max_steps=7", "train.learning_rate=1e-3", "grpo.epsilon_high=0.28",
                             "grpo.delta=null", "lora.target_modules=[q_proj, v_proj]", "output.resume=true"],
                      base=demo_config())
    assert cfg.train.max_steps == 7 and cfg.train.learning_rate == 1e-3 and cfg.grpo.epsilon_high == 0.28
    assert cfg.grpo.delta is None and cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.output.resume is True


@pytest.mark.parametrize("override, message", [
    ("train.max_stepz=3", "unknown config key 'train.max_stepz'"),
    ("trian.max_steps=3", "unknown config key 'trian'"),
    ("grpo.loss_type=ppo", "config key 'grpo.loss_type': got 'ppo'; allowed: 'grpo', 'bnpo'"),
    ("train.max_steps=ten", "config key 'train.max_steps': got 'ten'"),
    ("train.max_steps=0", "config key 'train.max_steps': got 0; allowed: an integer >= 1"),
    ("grpo.num_generations=1", "grpo.num_generations"),
    ("generation.top_p=1.5", "generation.top_p"),
    ("grpo.scale_rewards=yes", "grpo.scale_rewards"),
    ("data.overlong_prompt=drop", "data.overlong_prompt"),
    ("rewards=[]", "rewards"),
    ("rewards=[{function: no_colon}]", "rewards[0].function"),
    ("output.save_steps=3", None),  # fine with num_iterations=1
    ("train.adam_beta1=1.5", "config key 'train.adam_beta1': got 1.5; allowed: 0 <= beta1 < 1"),
    ("train.weight_decay=-1", "train.weight_decay"),
    ("rewards=[{function: 'a:b', weight: .nan}]", "config key 'rewards[0].weight'"),
])
def test_bad_values_name_the_key(override, message):
    if message is None:
        load_config(None, [override], base=demo_config())
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, [override], base=demo_config())
    assert message in str(e.value)


def test_kl_to_a_reference_with_or_without_adapters():
    """With LoRA the reference is the base with the adapters disabled; without it, a frozen copy of the initial
    weights (tests/test_kl_reference.py), whose placement only full-weight runs may choose."""
    load_config(None, ["lora.enabled=false", "grpo.beta=0.04"], base=demo_config())
    load_config(None, ["lora.enabled=false", "grpo.beta=0"], base=demo_config())
    load_config(None, ["lora.enabled=true", "grpo.beta=0.04"], base=demo_config())
    with pytest.raises(ConfigError,
                       match="'grpo.reference_placement': got 'int8'; allowed: auto with lora.enabled=true"):
        load_config(None, ["lora.enabled=true", "grpo.reference_placement=int8"], base=demo_config())


def test_save_steps_must_align_with_num_iterations():
    with pytest.raises(ConfigError, match="multiple of grpo.num_iterations"):
        load_config(None, ["grpo.num_iterations=2", "output.save_steps=3"], base=demo_config())
    with pytest.raises(ConfigError, match="'train.max_steps': got 3; allowed: a multiple of grpo.num_iterations"):
        load_config(None, ["grpo.num_iterations=2", "train.max_steps=3"], base=demo_config())  # its final save


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"grpo": {"betta": 0.1}}))
    with pytest.raises(ConfigError, match="unknown config key 'grpo.betta'"):
        load_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_not_key_value():
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        load_config(None, ["train.max_steps"], base=demo_config())


def test_cli_print_config_is_accepted_by_train(tmp_path):
    out = subprocess.run([sys.executable, "-m", "longrl.cli.main", "demo", "--print-config"], capture_output=True,
                         text=True, check=True).stdout
    path = tmp_path / "demo.yaml"
    path.write_text(out)
    assert load_config(path) == demo_config()


def test_cli_config_error_exits_2_without_loading(tmp_path):
    r = subprocess.run([sys.executable, "-m", "longrl.cli.main", "demo", "grpo.loss_type=nope"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "grpo.loss_type" in r.stderr and "Traceback" not in r.stderr


def test_config_default_needs_rewards():
    with pytest.raises(ConfigError, match="rewards"):
        load_config(None, [], base=Config())


def test_grpo_checks_run_before_the_checks_that_divide_by_them():
    """train.max_steps and output.save_steps must be multiples of num_iterations × steps_per_generation: a zero
    there is refused by name, not met as a ZeroDivisionError."""
    for override in ("grpo.num_iterations=0", "grpo.steps_per_generation=0"):
        key = override.split("=")[0]
        with pytest.raises(ConfigError, match=f"config key '{key}': got 0; allowed: an integer >= 1"):
            load_config(None, [override], base=demo_config())


def test_host_memory_floor_raises_the_config_error():
    """limits.py raises the same ConfigError the package exports (it imports it from errors.py, not from the package)."""
    from longrl.config.limits import check_sizes

    with pytest.raises(ConfigError, match="config key 'data.num_examples': got 2000; generating 2,000 task rows needs"):
        check_sizes(demo_config(), host_bytes=1)
    check_sizes(demo_config(), host_bytes=2**40)
