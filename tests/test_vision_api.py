"""The Python APIs on vision-language models (issue 44): Unsloth's ``FastVisionModel.from_pretrained`` /
``get_peft_model`` mapped onto longrl's loading and ``lora.vision_modules``, and TRL's ``GRPOTrainer(model=VLM or its
name, processing_class=processor, train_dataset=rows with an image column, reward_funcs=...)`` training on the CPU."""

import pytest
import torch

from longrl import FastVisionModel, GRPOConfig, GRPOTrainer
from longrl.models import ModelLoadError, base_model
from longrl.models.tiny_vision import build_tiny_vision_model
from longrl.models.vision import VisionModelError
from longrl.tasks.shapes import answer_reward, make_shape_rows


def _adapted(model) -> set[str]:
    """Names of the modules holding LoRA adapters."""
    return {n for n, m in model.named_modules() if hasattr(m, "lora_A")}


def test_fast_vision_model_loads_a_vlm_with_its_processor_and_maps_the_layer_choices():
    model, processor = FastVisionModel.from_pretrained("builtin:tiny-vision", load_in_4bit=False, device="cpu")
    assert type(model).__name__ == "LlavaForConditionalGeneration" and hasattr(processor, "image_processor")
    language_only = FastVisionModel.get_peft_model(model, r=4, finetune_vision_layers=False)
    names = _adapted(language_only)
    assert names and all(".language_model." in n for n in names)
    model, _ = FastVisionModel.from_pretrained("builtin:tiny-vision", load_in_4bit=False, device="cpu")
    everything = _adapted(FastVisionModel.get_peft_model(model, r=4, finetune_vision_layers=True))
    assert any(".vision_tower." in n for n in everything) and any(".multi_modal_projector." in n for n in everything)
    model, _ = FastVisionModel.from_pretrained("builtin:tiny-vision", load_in_4bit=False, device="cpu")
    attention = _adapted(FastVisionModel.get_peft_model(model, r=4, finetune_vision_layers=False,
                                                        finetune_mlp_modules=False))
    assert attention and all(n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj") for n in attention)


def test_fast_vision_model_refusals():
    with pytest.raises(VisionModelError, match="text-only model .* use FastLanguageModel"):
        FastVisionModel.from_pretrained("builtin:tiny-arith", load_in_4bit=False)
    with pytest.raises(ValueError, match=r"FastVisionModel.from_pretrained\(load_in_8bit=True\) is not supported"):
        FastVisionModel.from_pretrained("builtin:tiny-vision", load_in_8bit=True)
    model, _ = FastVisionModel.from_pretrained("builtin:tiny-vision", load_in_4bit=False, device="cpu")
    with pytest.raises(ValueError, match="finetune_language_layers=False"):
        FastVisionModel.get_peft_model(model, finetune_language_layers=False)
    with pytest.raises(ValueError, match="both False"):
        FastVisionModel.get_peft_model(model, finetune_attention_modules=False, finetune_mlp_modules=False)
    with pytest.raises(TypeError, match="FastVisionModel.get_peft_model.. got an argument longrl does not have"):
        FastVisionModel.get_peft_model(model, layers_to_transform=[0])


def _reward(prompts, completions, answer, **kwargs):
    """The colour, plus the completion's length: a random policy's completions differ, so every step learns."""
    return [a + len(c) / 10 for a, c in zip(answer_reward(prompts, completions, answer), completions)]


def _args(out, **extra):
    return GRPOConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=3, learning_rate=0.05, report_to="none", use_cpu=True,
                      disable_tqdm=True, **extra)


def test_trl_grpo_trains_a_vlm_given_as_a_model_or_a_saved_name(tmp_path):
    rows = make_shape_rows(8, seed=1)  # {"prompt", "image": a Pillow image, "answer", "shape"}
    model, processor = FastVisionModel.from_pretrained("builtin:tiny-vision", load_in_4bit=False, device="cpu")
    model = FastVisionModel.get_peft_model(model, r=4, finetune_vision_layers=True)
    tower = [p for n, p in model.named_parameters() if "vision_tower" in n and "lora_B" in n]
    before = [p.detach().clone() for p in tower]
    trainer = GRPOTrainer(model=model, processing_class=processor, train_dataset=rows, reward_funcs=_reward,
                          args=_args(tmp_path / "object"))
    history = trainer.train()
    assert len(history) == 2 and all(m["completion_length"] > 0 for m in history)
    assert any(not torch.equal(a, p) for a, p in zip(before, tower))  # the tower's adapters trained
    # a saved VLM directory named as the model: its processor is loaded with it
    saved, saved_processor = build_tiny_vision_model(seed=3)
    saved.save_pretrained(tmp_path / "vlm")
    saved_processor.save_pretrained(tmp_path / "vlm")
    from peft import LoraConfig

    trainer = GRPOTrainer(model=str(tmp_path / "vlm"), train_dataset=rows, reward_funcs=_reward,
                          args=_args(tmp_path / "named"), peft_config=LoraConfig(r=4, lora_alpha=8))
    assert len(trainer.train()) == 2
    assert type(base_model(trainer.model)).__name__ == "LlavaForConditionalGeneration"
    assert hasattr(trainer.images.processor, "image_processor")
    # a VLM object without its processor cannot encode the images: said before any step
    bare, _ = build_tiny_vision_model()
    with pytest.raises((ValueError, ModelLoadError), match="processing_class"):
        GRPOTrainer(model=bare, processing_class=saved_processor.tokenizer, train_dataset=rows, reward_funcs=_reward,
                    args=_args(tmp_path / "bare"))
