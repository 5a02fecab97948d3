"""TRL's Python API and names, Unsloth's names, `longrl init`, and config ergonomics (did-you-mean, relative paths,
num_examples null, a fast `longrl --help`), on the CPU with the tiny builtin model."""

import json
import subprocess
import sys

import pytest
import yaml

from longrl.config import ConfigError, config_keys, load_config
from longrl.config.keys import trl_key
from longrl.training.reporting import read_metrics
from longrl.tasks.arithmetic import make_arithmetic_rows
from longrl.config.trl_names import TRL_NAMES, Accepts

REWARD_FILE = '''
def correct(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]


def digits(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / 4 for c in completions]
'''

# one run in three dialects: TRL names (Python), longrl's dotted keys (YAML)
TRL_ARGS = dict(max_steps=3, learning_rate=5e-4, num_generations=4, per_device_train_batch_size=6,
                gradient_accumulation_steps=2, max_prompt_length=16, max_completion_length=4, beta=0.0,
                loss_type="dapo", logging_steps=1, save_steps=1, report_to="none", disable_tqdm=True, seed=3,
                lr_scheduler_type="constant_with_warmup", warmup_steps=1, lora_dropout=0.0)
YAML_KEYS = {"train": {"max_steps": 3, "learning_rate": 5e-4, "micro_batch_size": 6, "prompts_per_step": 3,
                       "lr_scheduler_type": "constant", "warmup_steps": 1, "seed": 3},
             "grpo": {"num_generations": 4, "beta": 0.0, "loss_type": "dapo"},
             "data": {"max_prompt_length": 16, "source": "train.jsonl"},
             "generation": {"max_completion_length": 4},
             "output": {"logging_steps": 1, "save_steps": 1, "report_to": ["none"], "progress_bar": False},
             "rewards": [{"function": "rewards.py:correct", "weight": 1.0},
                         {"function": "rewards.py:digits", "weight": 0.5}]}


def _strip_time(metrics):
    return [{k: v for k, v in m.items() if not k.endswith("time_s")} for m in metrics]


def _reward_module(tmp_path):
    import importlib.util

    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    spec = importlib.util.spec_from_file_location("api17_rewards", tmp_path / "rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Recorder:
    def __init__(self):
        self.events = []

    def on_train_begin(self, trainer):
        self.events.append(("begin", trainer.step_idx))

    def on_step_end(self, step, metrics):
        self.events.append(("step", step, metrics["reward"]))

    def on_save(self, path):
        self.events.append(("save", path.name))

    def on_train_end(self, history):
        self.events.append(("end", len(history)))


def test_trl_script_trains_saves_resumes_and_matches_the_yaml_cli(tmp_path):
    """A TRL-style script (GRPOTrainer with reward_funcs, TRL-named GRPOConfig, a datasets.Dataset) trains 3 steps,
    saves, resumes exactly; the same run through `longrl train run.yaml` gives the same metrics."""
    import datasets

    from longrl import GRPOConfig, GRPOTrainer
    from longrl.cli.main import main

    rewards = _reward_module(tmp_path)
    rows = make_arithmetic_rows(40, seed=5)
    dataset = datasets.Dataset.from_list(rows)
    recorder = Recorder()
    args = GRPOConfig(output_dir=str(tmp_path / "py"), **TRL_ARGS)
    assert (args.train.prompts_per_step, args.train.micro_batch_size) == (3, 6)  # 6 × 2 completions / 4
    trainer = GRPOTrainer(model="builtin:tiny-arith", reward_funcs=[rewards.correct, rewards.digits], args=args,
                          train_dataset=dataset, reward_weights=[1.0, 0.5], callbacks=[recorder])
    assert hasattr(trainer.model, "peft_config")  # LoRA on (longrl's default) unless args turn it off
    history = trainer.train()
    assert [e for e in recorder.events if e[0] == "step"] == [("step", i + 1, m["reward"])
                                                            for i, m in enumerate(history)]
    assert recorder.events[0] == ("begin", 0) and recorder.events[-1] == ("end", 3)
    assert ("save", "checkpoint-3") in recorder.events
    out = trainer.save_model(tmp_path / "final")
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert trainer.save_model(args.output_dir) == tmp_path / "py"  # TRL's habit: beside the checkpoints
    saved = (tmp_path / "py" / "adapter_model.safetensors").read_bytes()
    assert saved == (out / "adapter_model.safetensors").read_bytes()
    assert (tmp_path / "py" / "checkpoint-3").is_dir() and not list((tmp_path / "py").glob(".save_model-*"))

    # the same run from a YAML file and the CLI, on the same rows in a JSONL file
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**YAML_KEYS, "output": {
        **YAML_KEYS["output"], "output_dir": str(tmp_path / "cli")}}))
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    assert _strip_time(read_metrics(tmp_path / "cli")) == _strip_time(history)
    assert history[-1]["step"] == 3 and len({round(m["loss"], 9) for m in history}) > 1

    # cut after step 2, resumed by TRL's train(resume_from_checkpoint=True): the same 3 steps
    cut = dict(TRL_ARGS, max_steps=2)
    GRPOTrainer("builtin:tiny-arith", [rewards.correct, rewards.digits],
                GRPOConfig(output_dir=str(tmp_path / "cut"), reward_weights=[1.0, 0.5], **cut), dataset).train()
    again = GRPOTrainer(model="builtin:tiny-arith", reward_funcs=[rewards.correct, rewards.digits],
                        args=GRPOConfig(output_dir=str(tmp_path / "cut"), reward_weights=[1.0, 0.5], **TRL_ARGS),
                        train_dataset=dataset)
    again.train(resume_from_checkpoint=True)
    assert _strip_time(read_metrics(tmp_path / "cut")) == _strip_time(history)

    # a new run into that directory without resuming is refused; so is a resume with other rows
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        GRPOTrainer(model="builtin:tiny-arith", reward_funcs=rewards.correct, train_dataset=dataset,
                    args=GRPOConfig(output_dir=str(tmp_path / "cut"), **TRL_ARGS)).train()
    other = GRPOTrainer(model="builtin:tiny-arith", reward_funcs=[rewards.correct, rewards.digits],
                        train_dataset=rows[:20], args=GRPOConfig(output_dir=str(tmp_path / "cut"),
                                                                 reward_weights=[1.0, 0.5], **TRL_ARGS))
    with pytest.raises(ConfigError, match="data.source"):
        other.train(resume_from_checkpoint=True)


def test_given_model_gets_adapters_and_peft_config_and_unsloth_names(tmp_path):
    """A model passed in while LoRA is on gets adapters; peft.LoraConfig and FastLanguageModel map onto lora.*; a
    PEFT model with lora.enabled=false is refused."""
    import peft

    from longrl import FastLanguageModel, GRPOConfig, GRPOTrainer
    from longrl.models import ModelLoadError, build_tiny_model

    rewards = _reward_module(tmp_path)
    rows = make_arithmetic_rows(8, seed=1)
    common = dict(max_steps=1, num_generations=2, per_device_train_batch_size=4, max_prompt_length=16,
                  max_completion_length=3, report_to="none", disable_tqdm=True, save_steps=0)
    model, tok = build_tiny_model(seed=0)
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs="%s:correct" % (tmp_path / "rewards.py"),
                          train_dataset=rows, peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]),
                          eval_dataset=make_arithmetic_rows(3, seed=9), args=GRPOConfig(
                              output_dir=str(tmp_path / "a"), num_generations_eval=2, **common))
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "q_proj" in n for n in trainable)
    assert (trainer.cfg.lora.r, trainer.cfg.lora.alpha, trainer.cfg.lora.target_modules) == (4, 8.0, ["q_proj"])
    trainer.train()
    held_out = trainer.evaluate()  # TRL's eval_dataset
    assert held_out.metrics["eval/num_prompts"] == 3 and "eval/pass@2/correct" in held_out.metrics
    assert trainer.evaluate(make_arithmetic_rows(2, seed=4)).metrics["eval/num_prompts"] == 2

    # the Config API too: a plain model given while lora.enabled=true gets adapters, never full-weight training
    from longrl.config import load_config as load
    from longrl.config.demo import demo_config
    from longrl.compat.trl import GRPOTrainer as Trainer

    plain, tok = build_tiny_model(seed=0)
    cfg = load(None, ["lora.enabled=true", "lora.r=2", f"output.output_dir={tmp_path / 'e'}"], base=demo_config())
    wrapped = Trainer(cfg, model=plain, tokenizer=tok).model
    with pytest.raises(TypeError, match="reward_funcs use TRL's form"):
        Trainer(cfg, reward_funcs=rewards.correct)
    assert hasattr(wrapped, "peft_config") and not any(p.requires_grad for n, p in wrapped.named_parameters()
                                                       if "lora_" not in n)

    model, tok = FastLanguageModel.from_pretrained("builtin:tiny-arith", max_seq_length=32, load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=2, lora_alpha=4, target_modules=["v_proj", "o_proj"])
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=rewards.correct, train_dataset=rows,
                          args=GRPOConfig(output_dir=str(tmp_path / "b"), **common))
    assert trainer.model is model and trainer.cfg.lora.target_modules == ["o_proj", "v_proj"]
    assert trainer.cfg.lora.r == 2
    with pytest.raises(ConfigError, match="max_seq_length=32"):
        GRPOTrainer(model=model, processing_class=tok, reward_funcs=rewards.correct, train_dataset=rows,
                    args=GRPOConfig(output_dir=str(tmp_path / "c"), **dict(common, max_completion_length=30)))
    with pytest.raises(ModelLoadError, match="lora.enabled=false"):
        GRPOTrainer(model=model, processing_class=tok, reward_funcs=rewards.correct, train_dataset=rows,
                    args=GRPOConfig(output_dir=str(tmp_path / "d"), lora={"enabled": False}, **common))
    with pytest.raises(ConfigError, match="use_dora"):
        GRPOTrainer(model="builtin:tiny-arith", reward_funcs=rewards.correct, train_dataset=rows,
                    peft_config=peft.LoraConfig(r=4, use_dora=True), args=GRPOConfig(**common))
    with pytest.raises(TypeError, match="TrainerCallback"):
        from transformers import TrainerCallback

        GRPOTrainer(model="builtin:tiny-arith", reward_funcs=rewards.correct, train_dataset=rows,
                    callbacks=[TrainerCallback()], args=GRPOConfig(**common))


# values for GRPOConfig(name=value) of each TRL name this tree has, and the longrl value they give
SAMPLES = {"lr_scheduler_type": ("constant_with_warmup", "constant"), "scale_rewards": (False, "none"),
           "bf16": (True, "bfloat16"), "fp16": (True, "float16"), "min_p": (None, 0.0), "top_k": (None, 0),
           "disable_tqdm": (True, False), "vllm_importance_sampling_correction": (False, "none"),
           "vllm_importance_sampling_mode": ("sequence_mask", "sequence_mask"), "loss_type": ("cispo", "cispo"),
           "importance_sampling_level": ("sequence", "sequence"), "output_dir": ("somewhere", "somewhere"),
           "save_total_limit": (None, 0), "log_completions": (False, 0), "resume_from_checkpoint": (True, True),
           "epsilon_high": (0.28, 0.28), "delta": (2.0, 2.0), "report_to": ("none", ["none"]),
           "warmup_ratio": (0.1, 10), "max_steps": (100, 100), "num_completions_to_print": (2, 2),
           "shuffle_dataset": (False, False), "gradient_checkpointing": (True, True),
           "mask_truncated_completions": (True, True), "trust_remote_code": (True, True),
           "train_sampling_strategy": ("sequential", False), "use_cpu": (True, "cpu"),
           "max_tool_calling_iterations": (2, 3), "ddp_timeout": (60, 60.0), "activation_checkpointing": (True, True),
           "warmup_steps": (0.1, 10), "eval_strategy": ("no", 0)}
BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
         "steps_per_generation", "reward_weights", "num_train_epochs")


def _other_value(default):
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default * 0.5 if default else 0.5
    return default  # a string or None: the default itself


@pytest.mark.parametrize("name", sorted(TRL_NAMES))
def test_each_trl_name_is_mapped_in_python_and_named_in_yaml(tmp_path, name):
    """GRPOConfig(name=value) sets the dotted key TRL_NAMES names; the same name in a YAML file or a KEY=VALUE
    override is refused with 'did you mean <that key>?' (or, without an equivalent, what to use)."""
    from longrl import GRPOConfig

    key = trl_key(name)
    for source in ("yaml", "override"):
        with pytest.raises(ConfigError) as e:
            if source == "yaml":
                (tmp_path / "c.yaml").write_text(yaml.safe_dump({name: 1}))
                load_config(tmp_path / "c.yaml")
            else:
                load_config(None, [f"{name}=1"])
        text = str(e.value)
        assert f"unknown config key '{name}'" in text
        if key is not None:
            assert f"did you mean {'rewards[i].weight' if key == 'rewards' else key}?" in text, text
        else:
            assert "has no longrl key" in text and TRL_NAMES[name].note.split(" ")[0] in text, text
    if key is None or name in BATCH:  # the batch names: test_trl_batch_arithmetic_and_refusals
        entry = TRL_NAMES[name]
        if name == "model_init_kwargs":
            with pytest.raises(ConfigError, match="longrl loads models itself"):
                GRPOConfig(model_init_kwargs={"device_map": "auto"})
        elif key is None and isinstance(entry.convert, Accepts):  # its values accepted, setting nothing; others not
            assert GRPOConfig(**{name: entry.convert.values[0]}) == GRPOConfig()
            other = next(v for v in (True, False, 1, 0.5, "x", None) if v not in entry.convert.values)
            with pytest.raises(ConfigError, match=rf"GRPOConfig\({name}={other!r}\): "):
                GRPOConfig(**{name: other})
        elif key is None and entry.convert is not None:  # any value: it changes no result
            assert GRPOConfig(**{name: 7}) == GRPOConfig()
        elif key is None:
            with pytest.raises(ConfigError, match=f"TRL's {name} has no longrl key"):
                GRPOConfig(**{name: 1})
        return
    if name in SAMPLES:
        given, expected = SAMPLES[name]
    else:  # a value of the key's own type other than its default
        default = GRPOConfig()
        for part in key.split("."):
            default = getattr(default, part)
        given = expected = _other_value(default)
    cfg = GRPOConfig(**{name: given})
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    assert node == expected, (name, key, node, expected)


def test_did_you_mean_for_keys_of_other_sections_and_near_misses():
    with pytest.raises(ConfigError, match=r"did you mean data.max_prompt_length\?"):
        load_config(None, ["train.max_prompt_length=64"])
    with pytest.raises(ConfigError, match=r"did you mean train.learning_rate\?"):
        load_config(None, ["train.learnin_rate=1e-5"])
    with pytest.raises(ConfigError, match=r"did you mean lora.alpha\?"):
        load_config(None, ["lora.lora_alpha=8"])


def test_trl_batch_arithmetic_and_refusals():
    from longrl import GRPOConfig

    cfg = GRPOConfig(num_generations=8, per_device_train_batch_size=4, gradient_accumulation_steps=4,
                     generation_batch_size=16)  # one rollout an optimizer step
    assert (cfg.train.micro_batch_size, cfg.train.prompts_per_step) == (4, 2)
    assert GRPOConfig(num_generations=4, gradient_accumulation_steps=2).train.prompts_per_step == 4  # 8 × 2 / 4
    if "grpo.steps_per_generation" in config_keys():  # TRL counts micro-batches, longrl optimizer steps
        assert GRPOConfig(gradient_accumulation_steps=2, steps_per_generation=4).grpo.steps_per_generation == 2
        assert GRPOConfig(per_device_train_batch_size=4, generation_batch_size=16,
                          num_generations=4).grpo.steps_per_generation == 4
    else:
        with pytest.raises(ConfigError, match="one rollout an optimizer step"):
            GRPOConfig(generation_batch_size=32)
    for bad, match in [(dict(per_device_train_batch_size=6, num_generations=4), "not a multiple of num_generations"),
                       (dict(generation_batch_size=12), "a multiple of per_device_train_batch_size"),
                       (dict(gradient_accumulation_steps=4, steps_per_generation=6), "whole optimizer steps"),
                       (dict(generation_batch_size=16, steps_per_generation=2), "cannot both"),
                       (dict(per_device_train_batch_size=8, prompts_per_step=2), "not both"),
                       (dict(max_steps=0), "or -1 to let num_train_epochs decide"),
                       (dict(num_train_epochs=2, warmup_ratio=0.1), "give warmup_steps"),
                       (dict(logging_steps=0.1), "fraction"), (dict(use_vllm=True), "generation.backend"),
                       (dict(learnig_rate=1e-5), "did you mean train.learning_rate"),
                       (dict(temperature=-1.0), "generation.temperature")]:
        with pytest.raises(ConfigError, match=match):
            GRPOConfig(**bad)
    cfg = GRPOConfig(prompts_per_step=3, **{"model.offload_activations": True}, lora={"r": 4})
    assert (cfg.prompts_per_step, cfg.train.prompts_per_step, cfg.model.offload_activations, cfg.lora.r) == (3, 3,
                                                                                                      True, 4)
    cfg.learning_rate = 2e-5
    assert cfg.train.learning_rate == 2e-5
    with pytest.raises(ConfigError):
        cfg.learning_rate = -1.0


def test_relative_paths_resolve_against_the_config_folder(tmp_path, monkeypatch):
    folder = tmp_path / "runs" / "a"
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    (folder / "rewards.py").write_text(REWARD_FILE)
    rewards = [{"function": "rewards.py:digits"}, {"function": "longrl.tasks.arithmetic:format_reward"}]
    (folder / "run.yaml").write_text(yaml.safe_dump({"data": {"source": "train.jsonl"}, "rewards": rewards}))
    monkeypatch.chdir(tmp_path)
    cfg = load_config("runs/a/run.yaml")
    assert cfg.data.source == str(folder / "train.jsonl")
    assert cfg.rewards[0].function == f"{folder / 'rewards.py'}:digits"
    assert cfg.rewards[1].function == "longrl.tasks.arithmetic:format_reward"  # a module, not a path
    assert load_config("runs/a/run.yaml", ["data.source=other.jsonl"]).data.source == "other.jsonl"  # CLI: cwd
    # only the working directory has it: refused, naming where it looked
    (folder / "train.jsonl").rename(tmp_path / "train.jsonl")
    with pytest.raises(ConfigError, match=f"as {folder / 'train.jsonl'}, which does not exist; ./train.jsonl"):
        load_config("runs/a/run.yaml")
    # nowhere: the data layer names the path it looked at
    from longrl.data.prompts import DataError, read_prompt_rows

    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(DataError, match=str(folder / "train.jsonl")):
        read_prompt_rows(load_config("runs/a/run.yaml").data)


def test_num_examples_null_means_all_rows(tmp_path):
    from longrl.config.schema import DataConfig
    from longrl.data.prompts import read_prompt_rows

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(30)))
    assert len(read_prompt_rows(DataConfig(source=str(data), num_examples=None))) == 30
    assert len(read_prompt_rows(DataConfig(source=str(data), num_examples=7))) == 7
    assert len(read_prompt_rows(DataConfig(source="task:arithmetic", num_examples=None))) == 2000
    from longrl.config.demo import demo_config

    assert load_config(None, ["data.num_examples=null"], base=demo_config()).data.num_examples is None
    with pytest.raises(ConfigError, match="null \\(all rows\\)"):
        load_config(None, ["data.num_examples=0"], base=demo_config())


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "longrl.cli.main", *args], capture_output=True, text=True, cwd=cwd)


def test_init_output_is_accepted_by_train_and_plan(tmp_path, capsys):
    """`longrl init --model DIR` for a tiny model directory written here: `plan` and `train` take it as written
    (train with overrides that only make it short)."""
    from longrl.cli.main import main
    from longrl.models import build_tiny_model

    model, tok = build_tiny_model(seed=0)
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    init = _cli("init", "--model", str(tmp_path / "tiny"), "--task", "math")
    assert init.returncode == 0, init.stderr
    (tmp_path / "run.yaml").write_text(init.stdout)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "answer": str(r["answer"])})
                                                  + "\n" for r in make_arithmetic_rows(16, seed=2)))
    cfg = load_config(tmp_path / "run.yaml")
    assert (cfg.lora.enabled, cfg.grpo.loss_type, cfg.grpo.beta, cfg.grpo.num_generations, cfg.model.device) == \
        (True, "dapo", 0.0, 8, "auto")
    assert cfg.data.max_prompt_length + cfg.generation.max_completion_length <= 128  # the tiny model's context
    assert main(["plan", str(tmp_path / "run.yaml"), "--gpu-memory-gib", "24"]) == 0
    assert "plan for" in capsys.readouterr().out
    assert main(["train", str(tmp_path / "run.yaml"), "train.max_steps=1", "train.prompts_per_step=2",
                 "generation.max_completion_length=4", f"output.output_dir={tmp_path / 'out'}",
                 "output.progress_bar=false", "output.report_to=[none]"]) == 0
    assert len(read_metrics(tmp_path / "out")) == 1
    for task in ("code", "custom"):
        text = _cli("init", "--task", task).stdout
        (tmp_path / "rewards.py").write_text("def reward(prompts, completions, **kw):\n"
                                             "    return [0.0] * len(completions)\n")
        (tmp_path / f"{task}.yaml").write_text(text)
        assert load_config(tmp_path / f"{task}.yaml").rewards[0].function == f"{tmp_path / 'rewards.py'}:reward"


def test_version_and_help_do_not_import_torch():
    """`longrl --version` prints the version; `import longrl.cli.main` (what --help needs) leaves torch unloaded."""
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip().startswith("longrl 0.")
    probe = subprocess.run([sys.executable, "-c", "import sys, longrl, longrl.cli.main; longrl.cli.main._parser(); "
                            "print('torch' in sys.modules, 'transformers' in sys.modules)"],
                           capture_output=True, text=True)
    assert probe.stdout.split() == ["False", "False"], probe.stderr


def test_math_answer_reward():
    from longrl.rewards.answers import answer_reward

    completions = ["so \\boxed{1,000}", "the answer is 41", "\\boxed{\\frac{1}{2}} then 7", "no number", "12"]
    answers = ["1000", "42", "\\frac{1}{2}", "3", None]
    assert answer_reward(None, completions, answers) == [1.0, 0.0, 1.0, 0.0, None]
    assert answer_reward(None, [[{"role": "assistant", "content": "= 5.0"}]], ["5"]) == [1.0]


def test_docs_api_holds_the_flat_name_table():
    from pathlib import Path

    from longrl.compat.trl_config import TABLE_BEGIN, TABLE_END, flat_name_table

    doc = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    block = doc.partition(TABLE_BEGIN)[2].partition(TABLE_END)[0]
    assert block == flat_name_table(), "docs/api.md's table is out of date: run python -m longrl.compat.trl_config"
