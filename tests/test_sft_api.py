"""TRL's SFT API over `longrl sft`: SFTConfig's flat names onto the one config tree (did-you-mean, refusals),
SFTTrainer's TRL signature against the YAML CLI on the tiny builtin model, `longrl init --sft`, and export of an SFT
checkpoint in the three formats."""

import json

import pytest
import yaml

from longrl.config import ConfigError, load_config
from longrl.config.keys import trl_key
from longrl.training.reporting import read_metrics
from longrl.tasks.arithmetic import make_arithmetic_sft_rows
from longrl.config.trl_names import GRPO_ONLY, SFT_NAMES, TRL_SFT_NAMES, Accepts

# one run in two dialects: TRL's SFTConfig names (Python) and longrl's keys (YAML)
TRL_ARGS = dict(max_length=16, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-3,
                lr_scheduler_type="constant_with_warmup", warmup_steps=1, seed=3, logging_steps=1, save_steps=1,
                report_to="none", disable_tqdm=True, completion_only_loss=None, dataset_text_field="text",
                loss_type="nll", packing=False, padding_free=False, dataset_num_proc=2, lora_alpha=16.0,
                **{"model.device": "cpu", "model.dtype": "float32"})
YAML_KEYS = {"model": {"device": "cpu", "dtype": "float32"}, "lora": {"alpha": 16.0},
             "data": {"source": "train.jsonl"},
             "sft": {"max_length": 16, "examples_per_step": 8, "completion_only_loss": True, "text_column": "text"},
             "train": {"max_steps": 3, "micro_batch_size": 4, "learning_rate": 3e-3, "lr_scheduler_type": "constant",
                       "warmup_steps": 1, "seed": 3, "padding_free": False},
             "output": {"logging_steps": 1, "save_steps": 1, "report_to": ["none"], "progress_bar": False}}


def _untimed(metrics):
    return [{k: v for k, v in m.items() if not k.endswith(("time_s", "per_s"))} for m in metrics]


class Recorder:
    def __init__(self):
        self.events = []

    def on_step_end(self, step, metrics):
        self.events.append(("step", step))

    def on_save(self, path):
        self.events.append(("save", path.name))


def test_trl_sft_script_matches_the_yaml_cli_and_resumes(tmp_path, capsys):
    """SFTTrainer(model=str, args=SFTConfig(TRL names), train_dataset=Dataset) trains with the same metrics as
    `longrl sft run.yaml` on the same rows; num_train_epochs gives ceil(epochs × examples / examples_per_step) steps;
    resumed from its step-1 checkpoint by train(resume_from_checkpoint=True) it gives the same steps; resumes on
    other rows or a changed data file are refused."""
    import datasets

    from longrl import SFTConfig, SFTTrainer
    from longrl.cli.main import main

    rows = make_arithmetic_sft_rows(60, seed=5)  # 54 trained, the last 6 held out (a tenth)
    args = SFTConfig(output_dir=str(tmp_path / "py"), num_train_epochs=0.4, **TRL_ARGS)
    assert (args.sft.examples_per_step, args.train.micro_batch_size, args.sft.num_train_epochs) == (8, 4, 0.4)
    recorder = Recorder()
    trainer = SFTTrainer(model="builtin:tiny-arith", args=args, train_dataset=datasets.Dataset.from_list(rows),
                         callbacks=[recorder])
    assert trainer.max_steps == 3 and trainer.cfg.train.max_steps == 100  # ceil(0.4 × 54 / 8); the config as given
    history = trainer.train()
    assert [e for e in recorder.events if e[0] == "step"] == [("step", i + 1) for i in range(len(history))]
    assert ("save", f"checkpoint-{len(history)}") in recorder.events
    assert len({round(m["loss"], 9) for m in history}) == len(history) and "eval/loss" in history[-1]
    final = trainer.save_model()  # TRL's save_model: a PEFT adapter (LoRA is on), in output_dir/final
    assert final == tmp_path / "py" / "final" and (final / "adapter_model.safetensors").is_file()

    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**YAML_KEYS, "output": {
        **YAML_KEYS["output"], "output_dir": str(tmp_path / "cli")}}))
    assert main(["sft", str(tmp_path / "run.yaml")]) == 0
    assert _untimed(read_metrics(tmp_path / "cli")) == _untimed(history)
    with open(tmp_path / "train.jsonl", "a") as f:  # the data file changed: its resume is refused before loading
        f.write(json.dumps(rows[0]) + "\n")
    assert main(["sft", str(tmp_path / "run.yaml"), "output.resume=true", "train.max_steps=4"]) == 2
    assert "changed since" in capsys.readouterr().err

    import shutil

    for late in ("checkpoint-2", "checkpoint-3"):  # as if the run had stopped after its step 1
        shutil.rmtree(tmp_path / "py" / late)
    again = SFTTrainer("builtin:tiny-arith", SFTConfig(output_dir=str(tmp_path / "py"), max_steps=3, **TRL_ARGS),
                       None, rows)  # TRL's positional order: model, args, data_collator, train_dataset
    assert _untimed(again.train(resume_from_checkpoint=True)) == _untimed(history[1:])
    with pytest.raises(ConfigError, match="data.source"):  # a resume on other rows is refused
        SFTTrainer(model="builtin:tiny-arith", train_dataset=rows[:30],
                   args=SFTConfig(output_dir=str(tmp_path / "py"), max_steps=3, **TRL_ARGS)).train(True)


def test_sft_config_names_map_refuse_and_suggest():
    """Each SFTConfig name sets its key, is accepted as changing nothing, or is refused saying what to use; GRPO's
    own names are refused; misspellings and TRL names in YAML get 'did you mean'."""
    from longrl import SFTConfig

    keyed = {"max_length": (64, 64), "max_seq_length": (32, 32), "truncation_mode": ("keep_start", "truncate"),
             "padding_free": (True, True), "completion_only_loss": (False, False),
             "assistant_only_loss": (False, False), "dataset_text_field": ("body", "body"),
             "label_smoothing_factor": (0.1, 0.1), "activation_offloading": (True, True),
             "learning_rate": (2e-5, 2e-5), "train_sampling_strategy": ("sequential", False),
             "bf16": (True, "bfloat16")}
    for name, (given, expected) in keyed.items():
        node = SFTConfig(**{name: given})
        for part in trl_key(name, TRL_SFT_NAMES).split("."):
            node = getattr(node, part)
        assert node == expected, name
    # TRL's SFT shuffle_dataset shuffles once before its sampler shuffles each epoch anyway: no longrl setting
    assert SFTConfig(shuffle_dataset=False) == SFTConfig() and SFTConfig().data.shuffle
    for name, entry in SFT_NAMES.items():  # no key: its accepted values set nothing, others are refused
        if isinstance(entry.convert, Accepts):
            assert SFTConfig(**{name: entry.convert.values[0]}) == SFTConfig()
            with pytest.raises(ConfigError, match=rf"SFTConfig\({name}='x'\): "):
                SFTConfig(**{name: "x"})
    assert SFTConfig(packing_strategy="bfd", eval_packing=True, per_device_eval_batch_size=4).sft == \
        SFTConfig().sft
    packed = SFTConfig(packing=True, max_length=128, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    assert (packed.train.micro_batch_tokens, packed.train.padding_free, packed.sft.examples_per_step) == (256, True, 8)
    assert SFTConfig(max_steps=-1).sft.num_train_epochs == 3.0  # TRL's default epochs
    assert SFTConfig(max_steps=7, num_train_epochs=2).sft.num_train_epochs is None  # max_steps > 0 wins, as in TRL
    for bad, match in [(dict(beta=0.1), "beta is GRPO's"), (dict(num_generations=4), "num_generations is GRPO's"),
                       (dict(loss_type="dft"), "dft is not implemented"),
                       (dict(packing_strategy="wrapped"), "never cuts"), (dict(max_length=None), "give a number"),
                       (dict(truncation_mode="keep_end"), "keep_start"),
                       (dict(max_lenght=64), "did you mean sft.max_length"),
                       (dict(num_train_epochs=2, warmup_ratio=0.1), "give warmup_steps"),
                       (dict(per_device_train_batch_size=4, examples_per_step=8), "not both"),
                       (dict(optim="adamw_8bit"), "AdamW"), (dict(label_smoothing_factor=1.5), "sft.label_smoothing")]:
        with pytest.raises(ConfigError, match=match):
            SFTConfig(**bad)
    assert "num_generations" in GRPO_ONLY and "loss_type" in TRL_SFT_NAMES
    cfg = SFTConfig(max_length=64)
    assert cfg.max_length == 64 and cfg.dataset_text_field == "text"
    cfg.max_length = 128
    assert cfg.sft.max_length == 128
    with pytest.raises(ConfigError, match="pass it to SFTConfig"):
        cfg.packing = True
    for key, hint in [("packing", "did you mean train.micro_batch_tokens?"),
                      ("dataset_text_field", "did you mean sft.text_column?"),
                      ("sft.max_lenght", "did you mean sft.max_length?")]:
        with pytest.raises(ConfigError, match=hint.replace("?", r"\?")):
            load_config(None, [f"{key}=1"], recipe="sft")


def test_sft_trainer_arguments_are_checked_before_the_model_loads(tmp_path):
    from longrl import SFTConfig, SFTTrainer
    from longrl.config.schema import Config
    from longrl.compat.trl import sft_trainer_inputs

    args = SFTConfig(output_dir=str(tmp_path / "x"))
    with pytest.raises(TypeError, match="data_collator"):
        SFTTrainer("builtin:tiny-arith", args, object())
    with pytest.raises(TypeError, match="use TRL's form"):
        SFTTrainer(Config(), train_dataset=[{"text": "1"}])
    with pytest.raises(TypeError, match="longrl.SFTConfig"):
        SFTTrainer(model="builtin:tiny-arith", args={"max_length": 3})
    with pytest.raises(ConfigError, match="train_dataset row 2"):
        SFTTrainer(model="builtin:tiny-arith", args=args, train_dataset=[{"text": "a"}, "b"])
    inputs = sft_trainer_inputs((None, "builtin:tiny-arith", None, [{"q": "1+1=", "a": "2"}], [{"q": "2+2=", "a": "4"}]),
                                args=args, formatting_func=lambda row: f"{row['q']}{row['a']}")
    assert inputs.rows == [{"text": "1+1=2"}] and inputs.eval_rows == [{"text": "2+2=4"}]
    assert inputs.cfg.data.source.startswith("memory:1-rows-") and inputs.cfg.model.name_or_path == "builtin:tiny-arith"
    with pytest.raises(ConfigError, match="formatting_func on train_dataset row 1"):
        sft_trainer_inputs((None, "builtin:tiny-arith", None, [{"q": 1}], None), args=args,
                           formatting_func=lambda row: None)


def test_docs_api_holds_the_sft_name_table():
    from pathlib import Path

    from longrl.compat.trl_config import SFT_TABLE_BEGIN, SFT_TABLE_END, flat_name_table

    doc = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    block = doc.partition(SFT_TABLE_BEGIN)[2].partition(SFT_TABLE_END)[0]
    assert block == flat_name_table(SFT_NAMES), "docs/api.md's SFT table is out of date: run python -m longrl.compat.trl_config"


def test_init_sft_output_is_accepted_by_sft_and_plan(tmp_path, capsys):
    """`longrl init --sft --model DIR` for a tiny model directory written here: `plan --sft` and `sft` take it as
    written (sft with overrides that only make it short)."""
    from longrl.cli.main import main
    from longrl.models import build_tiny_model

    model, tok = build_tiny_model(seed=0)
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    assert main(["init", "--sft", "--model", str(tmp_path / "tiny")]) == 0
    (tmp_path / "run.yaml").write_text(capsys.readouterr().out)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_arithmetic_sft_rows(24, seed=2)))
    cfg = load_config(tmp_path / "run.yaml", recipe="sft")
    assert (cfg.lora.enabled, cfg.sft.assistant_only_loss, cfg.sft.num_train_epochs, cfg.model.device) == \
        (True, True, 1.0, "auto")
    assert cfg.sft.max_length == 128  # fitted to the tiny model's context
    assert main(["plan", str(tmp_path / "run.yaml"), "--sft", "--gpu-memory-gib", "24"]) == 0
    assert "(sft): 8 examples × 128 tokens" in capsys.readouterr().out
    assert main(["plan", str(tmp_path / "run.yaml"), "--sft", "--gpu-memory-gib", "0.0001"]) == 1
    assert "shorten sft.max_length" in capsys.readouterr().err  # the key an SFT user sets, not GRPO's
    assert main(["sft", str(tmp_path / "run.yaml"), "sft.num_train_epochs=null", "train.max_steps=1",
                 f"output.output_dir={tmp_path / 'out'}", "output.report_to=[none]", "output.progress_bar=false"]) == 0
    assert len(read_metrics(tmp_path / "out")) == 1
    assert main(["plan", str(tmp_path / "run.yaml"), "--gpu-memory-gib", "24"]) == 2  # as GRPO: no reward functions
    assert "rewards" in capsys.readouterr().err


def test_sft_checkpoint_exports_as_adapter_merged_and_gguf(tmp_path, capsys):
    """`longrl export` of a `longrl sft` checkpoint (builtin model, LoRA): the PEFT adapter over the shipped base and
    the float32 merged model give the trained logits, and the GGUF holds the merged weights (f16 rounding)."""
    import numpy as np
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from longrl import SFTConfig, SFTTrainer
    from longrl.cli.main import main
    from longrl.export.gguf_writer import unpermute_qk
    from test_export import _logits, _read_gguf, gguf

    args = SFTConfig(output_dir=str(tmp_path / "run"), max_steps=2, learning_rate=0.05, lora={"r": 4}, max_length=16,
                     per_device_train_batch_size=8, report_to="none", disable_tqdm=True,
                     **{"model.device": "cpu", "model.dtype": "float32", "sft.eval_examples": 0})
    trainer = SFTTrainer(model="builtin:tiny-arith", args=args, train_dataset=make_arithmetic_sft_rows(16, seed=1))
    trainer.train()
    trained = trainer.model.eval()
    want = _logits(trained)
    with trained.disable_adapter():
        assert (_logits(trained) - want).abs().max() > 1e-2  # the adapter is not a no-op
    ckpt = tmp_path / "run" / "checkpoint-2"
    for fmt, extra in (("adapter", []), ("merged", ["--dtype", "float32"]), ("gguf", [])):
        assert main(["export", str(tmp_path / fmt), "--from", str(ckpt), "--format", fmt, *extra]) == 0, \
            capsys.readouterr().err
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "adapter" / "base_model"),
                                        tmp_path / "adapter").eval()
    assert torch.allclose(_logits(adapter), want, atol=1e-5, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(_logits(merged), want, atol=1e-4, rtol=0)  # float32: merge rounding only
    _, tensors = _read_gguf(tmp_path / "gguf" / "model.gguf")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, merged.config.num_hidden_layers)
    state = merged.state_dict()
    assert len(tensors) == len(state)
    for hf_name, weight in state.items():
        got = torch.from_numpy(np.ascontiguousarray(tensors[names.get_name(hf_name, try_suffixes=(".weight",))][0]))
        if "q_proj" in hf_name or "k_proj" in hf_name:  # llama.cpp's rotary row order
            heads = merged.config.num_attention_heads if "q_proj" in hf_name else merged.config.num_key_value_heads
            got = unpermute_qk(got.float(), heads)
        assert torch.equal(got.float(), weight if weight.dim() == 1 else weight.half().float()), hf_name
