"""``longrl generate --image`` and ``longrl eval`` on prompts with images (issue 44): from a vision run, a plain VLM
directory and builtin:tiny-vision; a text model given images, and a missing or unreadable image, refused before any
weight loads, naming the model or the file."""

import json

import pytest

from longrl.cli.main import main
from longrl.config import load_config
from longrl.config.demo import vision_demo_config
from longrl.recipes.grpo import GRPOTrainer


@pytest.fixture(scope="module")
def vision_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-cli")
    cfg = load_config(None, ["train.max_steps=2", "train.prompts_per_step=2", "grpo.num_generations=2",
                             "data.num_examples=8", "lora.enabled=true", "output.progress_bar=false",
                             "output.report_to=[none]", "output.log_completions=0", f"output.output_dir={root / 'run'}"],
                      base=vision_demo_config())
    GRPOTrainer(cfg).train()
    return root / "run"


@pytest.fixture
def pictures(tmp_path):
    from PIL import Image

    for colour, rgb in {"red": (220, 20, 20), "blue": (20, 20, 220)}.items():
        Image.new("RGB", (28, 28), rgb).save(tmp_path / f"{colour}.png")
    (tmp_path / "junk.png").write_text("not a picture")
    return tmp_path


def _completions(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_generate_with_images_from_a_run_a_builtin_and_a_model_directory(vision_run, pictures, capsys, tmp_path):
    red, blue = str(pictures / "red.png"), str(pictures / "blue.png")
    greedy = ["--n", "2", "--temperature", "0", "--max-new-tokens", "3", "--jsonl"]
    assert main(["generate", "--from", str(vision_run), "--prompt", "colour?", "--image", red, *greedy]) == 0
    out = _completions(capsys)
    assert len(out) == 2 and out[0]["prompt"][0]["content"] == [{"type": "image"}, {"type": "text", "text": "colour?"}]
    assert out[0]["completion"] == out[1]["completion"] and out[0]["tokens"] >= 1  # greedy: the same twice
    # the run exported merged is a plain VLM directory that gives the same greedy answer (float32 weights)
    merged = tmp_path / "merged"
    assert main(["export", str(merged), "--from", str(vision_run), "--format", "merged", "--dtype", "float32"]) == 0
    capsys.readouterr()
    assert main(["generate", "--from", str(merged), "--prompt", "colour?", "--image", red, *greedy]) == 0
    assert [c["completion"] for c in _completions(capsys)] == [c["completion"] for c in out]
    # two images, in order, on the untrained builtin model; the text output shows where they stand
    assert main(["generate", "--from", "builtin:tiny-vision", "--prompt", "colour?", "--image", red, "--image", blue,
                 "--max-new-tokens", "2"]) == 0
    assert "=== prompt 1/1: <image><image>colour?" in capsys.readouterr().out


def test_images_for_a_text_model_or_unreadable_files_are_refused_naming_them(pictures, capsys, tmp_path):
    red = str(pictures / "red.png")
    assert main(["generate", "--from", "builtin:tiny-arith", "--prompt", "1+1=", "--image", red]) == 2
    assert "--image: --from builtin:tiny-arith is a text-only model" in capsys.readouterr().err
    missing = str(pictures / "missing.png")
    assert main(["generate", "--from", "builtin:tiny-vision", "--prompt", "x", "--image", red, "--image", missing]) == 2
    assert f"--image {missing} (file {missing}): file not found" in capsys.readouterr().err
    assert main(["generate", "--from", "builtin:tiny-vision", "--prompt", "x", "--image", str(pictures / "junk.png")]) == 2
    assert "junk.png): not an image Pillow can read" in capsys.readouterr().err
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "colour?"}) + "\n")
    assert main(["generate", "--from", "builtin:tiny-vision", "--data", str(tmp_path / "p.jsonl"), "--image", red]) == 2
    assert "--image goes with --prompt" in capsys.readouterr().err


def test_eval_and_generate_read_a_vision_dataset(vision_run, pictures, capsys, tmp_path):
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": "colour?", "image": f"{c}.png", "answer": c}) + "\n"
                            for c in ("red", "blue")))
    held = held.rename(pictures / "held.jsonl")  # image paths resolve against the dataset's folder
    config = tmp_path / "vision.yaml"
    assert main(["demo", "--task", "vision", "--print-config"]) == 0
    config.write_text(capsys.readouterr().out)
    metrics = tmp_path / "m.json"
    assert main(["eval", str(config), "--from", str(vision_run), "--data", str(held), "--n", "2",
                 "--output", str(metrics)]) == 0
    result = json.loads(metrics.read_text())
    assert result["eval/num_prompts"] == 2 and 0 <= result["eval/reward"] <= 1
    assert result["eval/completion_length"] > 0
    assert main(["eval", str(config), "--from", "builtin:tiny-arith", "--data", str(held)]) == 2
    assert "holds images: --from builtin:tiny-arith is a text-only model" in capsys.readouterr().err
    assert main(["generate", "--from", str(vision_run), "--data", str(held), "--jsonl", "--max-new-tokens", "2"]) == 0
    assert [c["prompt"][0]["content"][0] for c in _completions(capsys)] == [{"type": "image"}] * 2
