"""Every CPU command of README.md and of the docs' quickstarts, run as a user runs it: the ``longrl`` command in a
subprocess, in a fresh temporary directory holding a copy of examples/ (as a checkout does), with small overrides
appended so that each finishes in seconds. Each command is first found, as written, in the file that documents it
(a command changed there without this test fails here).

The GPU quickstart's model (a hub id) is replaced by a small Llama with a byte-level BPE tokenizer and a ChatML
chat template, built in code and saved as a model directory, which is what ``longrl init --model ./my-model-dir``
takes (docs/api.md)."""

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL_GRPO = ["generation.max_completion_length=8", "grpo.num_generations=2", "train.prompts_per_step=2",
              "train.micro_batch_size=4", "output.report_to=[none]", "output.progress_bar=false"]
DEMO = ["train.max_steps=20", "output.save_steps=10", "output.report_to=[none]", "output.progress_bar=false"]


def _longrl() -> list[str]:
    """The ``longrl`` console script beside this interpreter (as installed), else ``python -m longrl``."""
    script = Path(sys.executable).with_name("longrl")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "longrl"]


def documented(command: str, doc: str = "README.md") -> str:
    assert command in (ROOT / doc).read_text(), f"{doc} no longer shows {command!r}"
    return command


def run(command: str, cwd: Path, extra: list[str] = (), timeout: int = 300) -> str:
    """Run a documented ``longrl ...`` command line (a trailing ``> FILE`` writes its output there) with ``extra``
    arguments appended; fail with its output unless it exits 0. Returns its standard output."""
    words = shlex.split(command)
    target = None
    if ">" in words:
        words, target = words[:words.index(">")], words[words.index(">") + 1]
    assert words[0] == "longrl"
    done = subprocess.run(_longrl() + words[1:] + list(extra), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{command} {' '.join(extra)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    if target:
        (cwd / target).write_text(done.stdout)
    return done.stdout


@pytest.fixture
def fresh(tmp_path) -> Path:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    return tmp_path


def test_the_demos(fresh):
    out = run(documented("longrl demo"), fresh, DEMO)
    assert "mean reward: first" in out and (fresh / "longrl-demo" / "checkpoint-20").is_dir()
    out = run(documented("longrl demo --sft"), fresh, DEMO)
    assert "warm start: 60 supervised steps" in out and (fresh / "longrl-demo-sft").is_dir()
    assert (fresh / "longrl-demo" / "checkpoint-20").is_dir()  # the GRPO stage wrote the demo's directory again
    out = run(documented("longrl demo --task tools", "docs/agents.md"), fresh, ["train.max_steps=10"] + DEMO[1:])
    assert "mean reward: first" in out and (fresh / "longrl-demo-tools").is_dir()
    out = run(documented("longrl demo --task vision"), fresh, DEMO)
    assert "mean reward: first" in out and (fresh / "longrl-demo-vision" / "checkpoint-20").is_dir()
    documented("longrl demo --task vision", "docs/vision.md")


def _small_model_dir(path: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from export_tokenizers import TOKENIZERS

    tok = TOKENIZERS["qwen2"]()  # ChatML template, <|im_end|> as EOS
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, vocab_size=len(tok),
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_the_quickstart_from_init_to_export(fresh):
    run(documented("longrl init --model Qwen/Qwen2.5-1.5B-Instruct --task math > run.yaml"), fresh)
    assert "Qwen/Qwen2.5-1.5B-Instruct" in (fresh / "run.yaml").read_text()  # printed, nothing downloaded
    model = _small_model_dir(fresh / "my-model-dir")
    documented("longrl init --model Qwen/Qwen2.5-1.5B-Instruct --task math > run.yaml   # or --model ./my-model-dir",
               "docs/api.md")
    run("longrl init --model ./my-model-dir --task math > run.yaml", fresh)
    out = run(documented("longrl plan run.yaml --gpu-memory-gib 24", "docs/api.md"), fresh)
    assert "GiB" in out
    held_out = fresh / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a}+{a}?"}],
                                            "answer": str(2 * a)}) + "\n" for a in range(3)))
    base = run(documented("longrl eval run.yaml --from Qwen/Qwen2.5-1.5B-Instruct --data held_out.jsonl --n 8")
               .replace("Qwen/Qwen2.5-1.5B-Instruct", "./my-model-dir"), fresh, ["generation.max_completion_length=8"])
    assert "eval of ./my-model-dir on 3 prompts × 8 samples" in base
    run(documented("longrl train run.yaml data.source=examples/prompts.jsonl train.max_steps=200")
        .replace("train.max_steps=200", "train.max_steps=2"), fresh, SMALL_GRPO)
    run_dir = fresh / "runs" / f"{model.name}-grpo"
    assert (run_dir / "checkpoint-2").is_dir()
    documented("RUN=runs/Qwen2.5-1.5B-Instruct-grpo")
    env_run = str(run_dir.relative_to(fresh))
    out = run(documented('longrl generate --from $RUN --prompt "What is 17 * 23?" --n 4').replace("$RUN", env_run),
              fresh, ["--max-new-tokens", "6"])
    assert out.count("--- sample ") == 4
    out = run(documented("longrl eval run.yaml --from $RUN --data held_out.jsonl --n 8").replace("$RUN", env_run),
              fresh, ["generation.max_completion_length=8"])
    assert "eval/pass@8/answer_reward" in out
    run(documented("longrl export my_gguf --from $RUN --format gguf --quant q8_0").replace("$RUN", env_run), fresh)
    assert (fresh / "my_gguf" / "model.gguf").is_file() and (fresh / "my_gguf" / "Modelfile").is_file()
    out = run(documented("longrl generate --from longrl-output --prompt \"What is 6*7?\" --n 4", "docs/evaluation.md")
              .replace("longrl-output", env_run), fresh, ["--max-new-tokens", "4", "--temperature", "0"])
    assert out.count("--- sample ") == 4


def test_the_sft_quickstart(fresh):
    _small_model_dir(fresh / "my-model-dir")
    (fresh / "train.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {a}+1?"}, {"role": "assistant", "content": str(a + 1)}]}) + "\n"
        for a in range(6)))
    documented("longrl init --sft --model Qwen/Qwen2.5-1.5B-Instruct > sft.yaml", "docs/sft.md")
    run("longrl init --sft --model ./my-model-dir > sft.yaml", fresh)
    out = run(documented("longrl plan sft.yaml --sft --gpu-memory-gib 24", "docs/sft.md"), fresh)
    assert "GiB" in out
    out = run(documented("longrl sft sft.yaml", "docs/sft.md"), fresh,
              ["train.max_steps=2", "sft.examples_per_step=2", "sft.eval_examples=2", "sft.max_length=64",
               "output.report_to=[none]", "output.progress_bar=false"])
    assert out.splitlines()[-1].startswith("sft: 2 steps, last loss")
    sft_run = fresh / "runs" / "my-model-dir-sft"
    assert (sft_run / "checkpoint-2").is_dir()
    run("longrl init --model ./my-model-dir --task math > grpo.yaml", fresh)  # as the comment below says
    run(documented("longrl train grpo.yaml model.name_or_path=runs/sft", "docs/sft.md")
        .replace("runs/sft", "runs/my-model-dir-sft"), fresh,
        ["data.source=examples/prompts.jsonl", "train.max_steps=1", "output.output_dir=runs/after-sft"] + SMALL_GRPO)
    assert (fresh / "runs" / "after-sft" / "checkpoint-1").is_dir()


def test_the_vision_commands(fresh):
    """docs/vision.md, "Commands": the demo, generate --image, eval on a vision dataset, plan and export, and the
    exported model loaded as its snippet loads it; "APIs": the TRL + Unsloth script."""
    from PIL import Image

    doc = "docs/vision.md"
    run(documented("longrl init --model Qwen/Qwen2.5-VL-3B-Instruct --task vision > run.yaml", doc), fresh)
    from longrl.config import load_config

    started = load_config(fresh / "run.yaml")  # (no model is read: init writes the config only)
    assert started.lora.vision_modules == "none" and started.data.max_prompt_length == 2048
    out = run(documented("longrl demo --task vision", doc), fresh, ["train.max_steps=4", "output.save_steps=2",
                                                                     "output.report_to=[none]", "output.progress_bar=false"])
    assert "mean reward: first" in out and (fresh / "longrl-demo-vision" / "checkpoint-4").is_dir()
    (fresh / "pics").mkdir()
    for colour, rgb in {"red": (220, 20, 20), "blue": (20, 20, 220)}.items():
        Image.new("RGB", (28, 28), rgb).save(fresh / "pics" / f"{colour}.png")
    shutil.copy(fresh / "pics" / "red.png", fresh / "red.png")
    out = run(documented('longrl generate --from longrl-demo-vision --prompt "colour?" --image red.png --n 4', doc), fresh)
    assert out.startswith("=== prompt 1/1: <image>colour?") and out.count("--- sample") == 4
    run(documented("longrl demo --task vision --print-config > vision.yaml", doc), fresh)
    (fresh / "held_out.jsonl").write_text("".join(json.dumps({"prompt": "colour?", "image": f"pics/{c}.png",
                                                              "answer": c}) + "\n" for c in ("red", "blue")))
    out = run(documented("longrl eval vision.yaml --from longrl-demo-vision --data held_out.jsonl --n 4", doc), fresh)
    assert "on 2 prompts × 4 samples" in out and "eval/pass@4/answer_reward" in out
    out = run(documented("longrl plan vision.yaml --gpu-memory-gib 24", doc), fresh)
    assert "image tokens (counted in data.max_prompt_length)" in out
    run(documented("longrl export vision-merged --from longrl-demo-vision --format merged", doc), fresh)
    text = (ROOT / doc).read_text()
    loading = text.split("```python\n")[1].split("```")[0]
    assert "AutoProcessor" in loading
    script = text.split("```python\n")[2].split("```")[0]
    assert "FastVisionModel.get_peft_model" in script
    for code in (loading, script):
        done = subprocess.run([sys.executable, "-c", code], cwd=fresh, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    assert (fresh / "vision-run" / "checkpoint-10").is_dir()
