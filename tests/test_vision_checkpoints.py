"""Checkpoints of vision-language runs (issue 44): a vision GRPO run of N steps equals N/2 + resume + N/2 (LoRA and full
weights, builtin:tiny-vision, whose frozen base is saved beside its adapter); a vision checkpoint as
model.name_or_path loads as a VLM with its processor; adapter and merged exports carry the processor, so
transformers' AutoProcessor + AutoModelForImageTextToText give the trained model's logits; GGUF is refused."""

import json

import pytest
import torch
from safetensors.torch import load_file

from longrl.cli.main import main
from longrl.config import load_config
from longrl.config.demo import vision_demo_config
from longrl.export import ExportError, export_checkpoint
from longrl.export.source import load_trained, read_checkpoint
from longrl.models import load_model
from longrl.models.vision import encode_prompt, vision_family
from longrl.recipes.grpo import GRPOTrainer
from longrl.training.reporting import read_metrics
from longrl.training.vision_inputs import PromptImages

QUICK = ["train.prompts_per_step=2", "grpo.num_generations=4", "train.micro_batch_size=8", "data.num_examples=16",
         "output.progress_bar=false", "output.report_to=[none]", "output.log_completions=0"]
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]


def _cfg(out, *overrides):
    return load_config(None, QUICK + [f"output.output_dir={out}", *overrides], base=vision_demo_config())


def _strip_time(metrics):
    return [{k: v for k, v in m.items() if not k.endswith("time_s")} for m in metrics]


def _picture():
    from PIL import Image

    image = Image.new("RGB", (28, 28), (128, 128, 128))
    image.paste((255, 0, 0), (6, 6, 20, 20))
    return image


@pytest.mark.parametrize("lora", [True, False])
def test_a_vision_run_resumed_halfway_equals_the_uninterrupted_run(tmp_path, lora):
    extra = [f"lora.enabled={str(lora).lower()}", "train.max_steps=4", "output.save_steps=2",
             f"grpo.beta={0.05 if lora else 0}"]
    GRPOTrainer(_cfg(tmp_path / "whole", *extra)).train()
    GRPOTrainer(_cfg(tmp_path / "cut", *extra, "train.max_steps=2")).train()
    GRPOTrainer(_cfg(tmp_path / "cut", *extra, "output.resume=true")).train()
    assert _strip_time(read_metrics(tmp_path / "cut")) == _strip_time(read_metrics(tmp_path / "whole"))
    assert len(read_metrics(tmp_path / "whole")) == 4
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    whole, cut = (load_file(str(tmp_path / d / "checkpoint-4" / weights)) for d in ("whole", "cut"))
    assert whole.keys() == cut.keys() and all(torch.equal(whole[k], cut[k]) for k in whole)
    start = load_file(str(tmp_path / "whole" / "checkpoint-2" / weights))
    assert any(not torch.equal(start[k], whole[k]) for k in whole)  # the second half trained
    # the builtin base, which no disk holds, is saved beside an adapter (export and warm starts rebuild from it)
    assert (tmp_path / "whole" / "checkpoint-4" / "base_model.safetensors").is_file() == lora


def _run(tmp_path_factory, lora: bool):
    out = tmp_path_factory.mktemp("vision-ckpt") / "run"
    GRPOTrainer(_cfg(out, "train.max_steps=2", "output.save_steps=2", "train.learning_rate=0.05",
                     f"lora.enabled={str(lora).lower()}")).train()
    return out


@pytest.fixture(scope="module")
def vision_run(tmp_path_factory):
    """A LoRA run of builtin:tiny-vision."""
    return _run(tmp_path_factory, lora=True)


@pytest.fixture(scope="module")
def full_vision_run(tmp_path_factory):
    return _run(tmp_path_factory, lora=False)


def _image_inputs(processor, model):
    prompt = encode_prompt(processor, model.config, MESSAGES, [_picture()])
    return dict(input_ids=torch.tensor([prompt.input_ids]), **prompt.image_inputs)


def test_a_vision_checkpoint_warm_starts_as_a_vlm_with_its_processor(vision_run, tmp_path):
    model, tokenizer = load_model(str(vision_run), lora=None, dtype="float32", device="cpu")
    assert vision_family(model.config).name == "LLaVA-1.5"
    images = PromptImages.for_model(model, str(vision_run))  # the processor of the checkpoint's base
    trained = load_trained(read_checkpoint(vision_run)).eval()
    inputs = _image_inputs(images.processor, model)
    with torch.no_grad():
        assert torch.allclose(model(**inputs).logits, trained(**inputs).logits, atol=1e-5)
    # a GRPO run on the checkpoint: accepted as a vision model before it loads, and trains
    history = GRPOTrainer(_cfg(tmp_path / "warm", "train.max_steps=1", "output.save_steps=0",
                               f"model.name_or_path={vision_run}")).train()
    assert len(history) == 1 and history[0]["completion_length"] > 0


@pytest.mark.parametrize("fmt, run", [("adapter", "vision_run"), ("merged", "vision_run"),
                                      ("merged", "full_vision_run")])
def test_exports_load_with_automodel_and_autoprocessor_and_give_the_trained_logits(request, tmp_path, fmt, run):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    vision_run = request.getfixturevalue(run)

    out = tmp_path / fmt
    extra = ["--dtype", "float32"] if fmt == "merged" else []
    assert main(["export", str(out), "--from", str(vision_run), "--format", fmt, *extra]) == 0
    assert (out / "processor_config.json").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (out / "processor_config.json").read_text())
    processor = AutoProcessor.from_pretrained(out)
    if fmt == "adapter":
        from peft import PeftModel

        base = AutoModelForImageTextToText.from_pretrained(out / "base_model")
        exported = PeftModel.from_pretrained(base, str(out))
    else:
        exported = AutoModelForImageTextToText.from_pretrained(out)
    assert "AutoModelForImageTextToText" in (out / "README.md").read_text()
    trained = load_trained(read_checkpoint(vision_run)).eval()
    inputs = _image_inputs(processor, exported)
    with torch.no_grad():
        got, want = exported.eval()(**inputs).logits, trained(**inputs).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert not torch.allclose(want[0, -1], torch.zeros_like(want[0, -1]))


def test_gguf_of_a_vision_run_is_refused_before_anything_is_written(vision_run, tmp_path, capsys):
    with pytest.raises(ExportError, match="GGUF export of vision models is not supported.*mmproj"):
        export_checkpoint(vision_run, tmp_path / "gguf", fmt="gguf")
    assert main(["export", str(tmp_path / "gguf"), "--from", str(vision_run), "--format", "gguf"]) == 2
    assert "--format merged" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
