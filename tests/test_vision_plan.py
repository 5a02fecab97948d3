"""The memory planner counts a vision-language model's vision side (memory/vision.py): the tower and projector's
weights, the image features once per prompt (Gemma 3: its pooled soft tokens), the tower's activations; ``longrl plan``
prints the image row."""

import pytest
from vision_models import build

from longrl.cli.main import main
from longrl.config import load_config
from longrl.config.demo import vision_demo_config
from longrl.memory.planner import GIB, plan_for_config
from longrl.memory.vision import VisionMemory
from longrl.models.tiny_vision import build_tiny_vision_model

PINNED = ["model.device=cuda", "model.dtype=bfloat16", "model.offload_activations=false",
          "model.gradient_checkpointing=true", "model.no_recompute_layers=0", "train.micro_batch_tokens=512",
          "train.mlp_tile_tokens=0", "output.output_dir=unused"]


def _cfg(*overrides):
    return load_config(None, PINNED + list(overrides), base=vision_demo_config())


def test_the_tower_count_is_the_models_parameters_outside_the_language_model():
    model, _ = build_tiny_vision_model()
    language = {id(p) for p in model.model.language_model.parameters()} | {id(model.lm_head.weight)}
    outside = sum(p.numel() for p in model.parameters() if id(p) not in language)
    vision = VisionMemory.of(model.config, prompts=3, compute_bytes=2, tower_trains=False, full_weights=False)
    assert vision.tower_params == outside > 0
    assert (vision.patches, vision.image_tokens) == (4, 4)  # 28 px at 14 px patches, no merge
    assert vision.weight_bytes == outside * 2
    assert vision.feature_bytes == 3 * 4 * model.config.text_config.hidden_size * 2  # once per prompt, not per G


def test_gemma3_image_tokens_are_its_pooled_count():
    """Gemma 3 pools the tower's patches to mm_tokens_per_image soft tokens an image (the tiny one: 4×4 → 2×2)."""
    config = build("gemma3")[0].config
    vision = VisionMemory.of(config, prompts=3, compute_bytes=2, tower_trains=False, full_weights=False)
    assert (vision.patches, vision.image_tokens) == (16, 4)
    assert vision.feature_bytes == 3 * 4 * config.text_config.hidden_size * 2


@pytest.mark.parametrize("overrides, trains", [(["lora.enabled=true"], False),
                                              (["lora.enabled=true", "lora.vision_modules=projector"], True),
                                              (["lora.enabled=false"], True)])
def test_a_vlm_plan_is_its_language_models_plus_the_vision_side(overrides, trains):
    cfg = _cfg(*overrides)
    config = build_tiny_vision_model()[0].config
    vlm = plan_for_config(cfg, config, 4 * GIB)
    text = plan_for_config(cfg, config.text_config, 4 * GIB)
    vision = vlm.vision
    assert vision is not None and text.vision is None
    assert vlm.predicted_gpu_bytes - text.predicted_gpu_bytes == vision.total_bytes > vision.weight_bytes > 0
    assert vlm.rollout.predicted_gpu_bytes - text.rollout.predicted_gpu_bytes == vision.total_bytes
    assert vlm.parts_gpu_bytes["vision tower + projector weights"] == vision.weight_bytes
    full = not cfg.lora.enabled
    assert vision.weight_bytes == vision.tower_params * (2 * 2 + 8 if full else 2)
    per_layer = vision.activation_bytes if not trains else vision.activation_bytes // (
        cfg.train.prompts_per_step * config.vision_config.num_hidden_layers)
    assert per_layer == vision.patches * (6 * 32 + 2 * 64) * 2  # the tiny tower: h_v = 32, i_v = 64


def test_longrl_plan_prints_the_image_part(tmp_path, capsys):
    (tmp_path / "vision.yaml").write_text(vision_demo_config().to_yaml())
    assert main(["plan", str(tmp_path / "vision.yaml"), "--gpu-memory-gib", "2", "model.device=cuda",
                 "model.dtype=bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "one image a prompt of 4 patches → 4 image tokens" in out
    assert "GPU: vision tower + projector weights" in out and "GPU: image features (once per prompt)" in out
