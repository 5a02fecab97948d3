"""Warm starts: a longrl checkpoint (adapter or full weights, or a run directory: its newest) as model.name_or_path,
merged at load and equal to `longrl export --format merged`'s model; SFT → GRPO in two commands; broken checkpoints
refused before any weights load; train.max_steps and sft.num_train_epochs settled by where they are given."""

import json
import shutil

import pytest
import torch
import yaml

from longrl.cli.main import main
from longrl.config import ConfigError, load_config
from longrl.models import ModelLoadError, check_model_files, load_model
from longrl.models import from_checkpoint
from longrl.tasks.arithmetic import make_arithmetic_sft_rows
from longrl.training import checkpoint as training_checkpoint
from longrl.training.reporting import read_metrics

SFT = {"model": {"device": "cpu", "dtype": "float32"}, "lora": {"r": 4},
       "data": {"source": "train.jsonl"},
       "sft": {"max_length": 16, "examples_per_step": 8, "eval_examples": 0},
       "train": {"max_steps": 2, "learning_rate": 0.05, "micro_batch_size": 8},
       "output": {"save_steps": 1, "report_to": ["none"], "progress_bar": False}}
GRPO = ["train.max_steps=2", "train.prompts_per_step=2", "grpo.num_generations=2", "output.progress_bar=false",
        "output.report_to=[none]", "output.log_completions=0", "data.num_examples=16", "model.device=cpu",
        "model.dtype=float32"]
IDS = torch.tensor([[5, 9, 11, 6, 12, 8, 7, 10]])


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _sft_run(tmp_path, name="sft", **sections):
    cfg = {k: {**v, **sections.get(k, {})} for k, v in SFT.items()}
    cfg["output"]["output_dir"] = str(tmp_path / name)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_arithmetic_sft_rows(32, seed=1)))
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["sft", str(tmp_path / f"{name}.yaml")]) == 0
    return tmp_path / name


def test_file_names_are_the_checkpoint_writers():
    assert (from_checkpoint.STATE_FILE, from_checkpoint.MANIFEST_FILE, from_checkpoint.BASE_WEIGHTS_FILE) == (
        training_checkpoint.STATE_FILE, training_checkpoint.MANIFEST_FILE, training_checkpoint.BASE_WEIGHTS_FILE)


@pytest.mark.parametrize("lora", [True, False])
def test_a_checkpoint_loads_as_its_merged_model(tmp_path, lora):
    """The reference: export's merged model of the same checkpoint (float32), and the trained model itself."""
    from longrl.export.source import merged_model, read_checkpoint

    run = _sft_run(tmp_path, lora={"enabled": lora}, train={"learning_rate": 0.05 if lora else 0.01})
    newest = run / "checkpoint-2"
    assert from_checkpoint.checkpoint_path(str(run)) == newest  # a run directory: its newest checkpoint
    check_model_files(str(run))  # accepted before anything loads
    model, tokenizer = load_model(str(run), lora=None, dtype="float32", device="cpu")
    reference = merged_model(read_checkpoint(newest))
    assert not hasattr(model, "peft_config")
    assert torch.allclose(_logits(model), _logits(reference), atol=1e-5, rtol=0)
    base, _ = load_model("builtin:tiny-arith", lora=None, dtype="float32", device="cpu")
    assert (_logits(model) - _logits(base)).abs().max() > 1e-3  # the training is in it
    earlier, _ = load_model(str(run / "checkpoint-1"), lora=None, dtype="float32", device="cpu")
    assert not torch.allclose(_logits(earlier), _logits(model))
    assert tokenizer("1+1=")["input_ids"] == base_tokenizer_ids("1+1=")


def base_tokenizer_ids(text):
    from longrl.models import build_char_tokenizer

    return build_char_tokenizer()(text)["input_ids"]


@pytest.mark.parametrize("grpo_lora", [True, False])
def test_sft_then_grpo_in_two_commands(tmp_path, grpo_lora):
    """`longrl sft sft.yaml`, then `longrl train grpo.yaml model.name_or_path=<the SFT run>`: the GRPO run starts from
    the SFT model (its new adapters, or all its weights, on the merged SFT weights); its own checkpoint loads through
    the same merge, as export's merged model of it."""
    from longrl.config.demo import demo_config
    from longrl.export.source import merged_model, read_checkpoint

    sft = _sft_run(tmp_path)
    (tmp_path / "grpo.yaml").write_text(demo_config().to_yaml())
    assert main(["train", str(tmp_path / "grpo.yaml"), *GRPO, f"model.name_or_path={sft}", f"lora.enabled={grpo_lora}",
                 f"output.output_dir={tmp_path / 'grpo'}"]) == 0
    assert len(read_metrics(tmp_path / "grpo")) == 2
    ckpt = read_checkpoint(tmp_path / "grpo")
    assert ckpt.base_name == str(sft) and ckpt.is_adapter == grpo_lora
    loaded, _ = load_model(str(tmp_path / "grpo"), lora=None, dtype="float32", device="cpu")  # nested: SFT → GRPO
    assert torch.allclose(_logits(loaded), _logits(merged_model(ckpt)), atol=1e-5, rtol=0)
    assert from_checkpoint.tokenizer_source(str(tmp_path / "grpo")) == ("builtin:tiny-arith", None)
    # and the warm-started run exports (its tokenizer is its base's base's: checkpoints hold no tokenizer files)
    assert main(["export", str(tmp_path / "merged"), "--from", str(tmp_path / "grpo"), "--format", "merged"]) == 0
    assert (tmp_path / "merged" / "config.json").is_file()


def test_the_planner_reads_a_checkpoints_config(tmp_path):
    from longrl.memory.planner import model_config_of

    run = _sft_run(tmp_path)
    assert from_checkpoint.config_source(str(run)) == "builtin:tiny-arith"  # an adapter: its base's config
    assert model_config_of(str(run)).num_hidden_layers == model_config_of("builtin:tiny-arith").num_hidden_layers
    full = _sft_run(tmp_path, "full", lora={"enabled": False}, train={"learning_rate": 0.01})
    assert from_checkpoint.config_source(str(full)) == str(full / "checkpoint-2")  # it holds config.json


def _rewrite_state(ckpt, **model_keys):
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["config"]["model"].update(model_keys)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    training_checkpoint.write_manifest(ckpt)


def test_broken_checkpoints_are_refused_before_any_weights_load(tmp_path):
    run = _sft_run(tmp_path)
    ckpt = run / "checkpoint-2"

    def refused(path, match):
        with pytest.raises(ModelLoadError, match=match):
            check_model_files(str(path))

    bad = tmp_path / "missing"
    shutil.copytree(ckpt, bad)
    (bad / "adapter_model.safetensors").unlink()
    refused(bad, "incomplete: missing adapter_model.safetensors")
    cut = tmp_path / "cut"
    shutil.copytree(ckpt, cut)
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[:-10])
    refused(cut, "adapter_model.safetensors is missing or cut short")
    flipped = tmp_path / "flipped"  # same size, one byte changed: found by the checksum at load
    shutil.copytree(ckpt, flipped)
    (flipped / "adapter_model.safetensors").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    check_model_files(str(flipped))
    with pytest.raises(ModelLoadError, match="checksum differs"):
        load_model(str(flipped), lora=None, dtype="float32", device="cpu")
    qlora = tmp_path / "qlora"
    shutil.copytree(ckpt, qlora)
    _rewrite_state(qlora, load_in_4bit=True)
    refused(qlora, "4-bit base.*longrl export DIR --from .*qlora --format merged")
    nobase = tmp_path / "nobase"
    shutil.copytree(ckpt, nobase)
    _rewrite_state(nobase, name_or_path=str(tmp_path / "gone"))
    refused(nobase, "model directory not found")
    loop = tmp_path / "loop"
    shutil.copytree(ckpt, loop)
    _rewrite_state(loop, name_or_path=str(loop))
    refused(loop, "nested 8 deep")
    (run / "checkpoint-2" / "trainer_state.json").write_text("{}")
    refused(run / "checkpoint-2", "holds no run config")
    assert main(["train", str(tmp_path / "sft.yaml"), f"model.name_or_path={cut}",
                 f"output.output_dir={tmp_path / 'x'}", "rewards=[{function: 'longrl.tasks.arithmetic:format_reward'}]"
                 ]) == 2


# ------------------------------------------------------------------------------------------ max_steps vs epochs

def _sft_file(tmp_path, **sections):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(sections))
    return tmp_path / "run.yaml"


def test_the_command_line_decides_between_max_steps_and_epochs(tmp_path):
    f = _sft_file(tmp_path, sft={"num_train_epochs": 1})
    cfg = load_config(f, ["train.max_steps=3"], recipe="sft")  # the case: init --sft, then max_steps=3
    assert (cfg.train.max_steps, cfg.sft.num_train_epochs) == (3, None)
    assert load_config(f, [], recipe="sft").sft.num_train_epochs == 1.0
    f = _sft_file(tmp_path, train={"max_steps": 50})
    cfg = load_config(f, ["sft.num_train_epochs=2"], recipe="sft")
    assert cfg.sft.num_train_epochs == 2.0  # epochs given last: they decide
    with pytest.raises(ConfigError, match="'train.max_steps' and 'sft.num_train_epochs' are both given on the "
                                          "command line"):
        load_config(f, ["sft.num_train_epochs=2", "train.max_steps=3"], recipe="sft")
    f = _sft_file(tmp_path, train={"max_steps": 50}, sft={"num_train_epochs": 2})  # a run's saved config.yaml
    assert load_config(f, [], recipe="sft").sft.num_train_epochs == 2.0
    from longrl.config.demo import demo_config

    base = demo_config()
    base.sft.num_train_epochs = 1.0
    cfg = load_config(_sft_file(tmp_path, train={"max_steps": 7}), [], base=base, recipe="sft")
    assert cfg.sft.num_train_epochs is None  # the file over the base


def test_init_sft_then_max_steps_runs_that_many_steps(tmp_path, capsys):
    assert main(["init", "--sft", "--model", "builtin:tiny-arith"]) == 0
    text = capsys.readouterr().out
    out_dir = yaml.safe_load(text)["output"]["output_dir"]  # the GRPO command in the header starts from it
    assert f"longrl train grpo.yaml model.name_or_path={out_dir} " in text
    (tmp_path / "run.yaml").write_text(text)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_arithmetic_sft_rows(40, seed=2)))
    assert main(["sft", str(tmp_path / "run.yaml"), "train.max_steps=2", "sft.max_length=16", "model.device=cpu",
                 f"output.output_dir={tmp_path / 'out'}", "output.report_to=[none]", "output.progress_bar=false",
                 "sft.eval_examples=0"]) == 0
    assert len(read_metrics(tmp_path / "out")) == 2


def test_a_checkpoint_loads_in_4bit_for_qlora(tmp_path):
    """load_in_4bit with a checkpoint: the merged model quantized in place (as the builtin model is), then adapters."""
    pytest.importorskip("bitsandbytes")
    from longrl.config.schema import LoraConfig

    run = _sft_run(tmp_path)
    model, _ = load_model(str(run), lora=LoraConfig(r=4), dtype="float32", device="cpu", load_in_4bit=True)
    merged, _ = load_model(str(run), lora=None, dtype="float32", device="cpu")
    assert model.get_base_model().longrl_quant_report.quantized  # some linears went to NF4
    error = (_logits(model) - _logits(merged)).abs().max() / _logits(merged).abs().max()
    assert 0 < error < 0.2  # the merged weights, through NF4 rounding
