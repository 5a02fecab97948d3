"""Vision-language models: family detection and refusals from the config, loading, LoRA targets, 4-bit exceptions,
and each family's prompt inputs (embeddings with the image features, positions) against transformers' forward."""

import inspect

import pytest
import torch
from vision_models import FAMILIES, build, images

from longrl.config.schema import LoraConfig
from longrl.models import LogitSpec, apply_lora, load_model, model_parts
from longrl.models.loading import load_processor
from longrl.models.quantize import choose_exceptions
from longrl.models.structure import decoder_layers
from longrl.models.vision import (
    FeatureCache,
    Placement,
    VisionModelError,
    encode_prompt,
    language_model_inputs,
    layer_masks,
    mrope_positions,
    vision_family,
)
from longrl.models.vision.adapters import lora_targets, vision_module_prefixes

pytestmark = pytest.mark.filterwarnings("ignore")


def _messages(n_images: int, text: str = "Which?"):
    parts = [{"type": "image"}] * n_images
    return [{"role": "user", "content": parts[:1] + [{"type": "text", "text": text}] + parts[1:]}]


@pytest.fixture(scope="module")
def tiny():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = build(family)
        return cache[family]
    return get


def test_family_detection_and_refusals():
    from transformers import AutoConfig, Gemma3Config, Gemma3nConfig, LlamaConfig, PaliGemmaConfig

    assert vision_family(LlamaConfig()) is None
    for model_type in FAMILIES:
        assert vision_family(AutoConfig.for_model(model_type)).name
    assert vision_family(Gemma3Config()).image_blocks
    with pytest.raises(VisionModelError, match="'gemma3n' is not supported: Gemma 3n.*Qwen2-VL \\(qwen2_vl\\)"):
        vision_family(Gemma3nConfig())
    with pytest.raises(VisionModelError, match="use_bidirectional_attention"):
        vision_family(Gemma3Config(text_config={"use_bidirectional_attention": True}))
    with pytest.raises(VisionModelError, match="'paligemma' is not supported.*LLaVA-1.5"):
        vision_family(PaliGemmaConfig())


def test_unsupported_model_refused_before_weights_load(tmp_path):
    from transformers import PaliGemmaConfig

    PaliGemmaConfig().save_pretrained(tmp_path)  # a config and no weights: the refusal comes first
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(VisionModelError, match="model.name_or_path.*paligemma.*Supported families"):
        load_model(str(tmp_path), device="cpu")


def test_load_directory_processor_lora_and_parts(tmp_path, tiny):
    model, processor = tiny("llava")
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded, tokenizer = load_model(str(tmp_path), device="cpu", dtype="float32",
                                   lora=LoraConfig(r=4, vision_modules="projector"))
    assert type(loaded.get_base_model()).__name__ == "LlavaForConditionalGeneration"
    assert type(load_processor(str(tmp_path))).__name__ == "LlavaProcessor"
    assert tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_id
    trained = {n for n, p in loaded.named_parameters() if p.requires_grad}
    assert any("multi_modal_projector" in n for n in trained)
    assert not any("vision_tower" in n for n in trained)
    assert any("language_model" in n and "q_proj" in n for n in trained)
    backbone, head, _ = model_parts(loaded)
    assert type(backbone).__name__ == "LlamaModel" and head is loaded.get_base_model().lm_head
    assert decoder_layers(loaded) == list(backbone.layers)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava", "idefics3"])
def test_lora_targets_by_vision_modules(family, tiny):
    model, _ = tiny(family)
    fam = vision_family(model.config)
    tower, projector = vision_module_prefixes(model, fam), vision_module_prefixes(model, fam, "projector")
    under = lambda names, prefixes: [n for n in names if any(n.startswith(p + ".") for p in prefixes)]
    none = lora_targets(model, fam, ["all-linear"], "none")
    assert none and not under(none, tower) and "lm_head" not in none
    only_proj = lora_targets(model, fam, ["all-linear"], "projector")
    assert under(only_proj, projector) and len(under(only_proj, tower)) == len(under(only_proj, projector))
    both = lora_targets(model, fam, ["q_proj"], "tower_and_projector")
    assert all(n.endswith("q_proj") for n in both if not under([n], tower)) and len(under(both, tower)) > \
        len(under(both, projector))
    wrapped = apply_lora(build(family)[0], LoraConfig(r=2, vision_modules="tower_and_projector"))
    adapted = {n.rsplit(".lora_", 1)[0].removeprefix("base_model.model.") for n, p in wrapped.named_parameters()
               if p.requires_grad}
    assert adapted == set(lora_targets(model, fam, ["all-linear"], "tower_and_projector"))


def test_text_model_refuses_vision_lora():
    from longrl.models import build_tiny_model

    with pytest.raises(VisionModelError, match="text-only"):
        apply_lora(build_tiny_model()[0], LoraConfig(vision_modules="projector"))


def test_4bit_keeps_vision_modules_16bit(tiny):
    model, _ = tiny("qwen2_vl")
    fam = vision_family(model.config)
    ids = torch.randint(0, 90, (1, 8))
    report = choose_exceptions(model, ids, exception_budget=0.0, keep_under=vision_module_prefixes(model, fam))
    vision_linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.visual.")]
    assert vision_linears and all(report.kept[n].startswith("always: vision") for n in vision_linears)
    assert any(n.startswith("model.language_model.") for n in report.quantized)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_fp8_base_keeps_vision_modules_16bit_and_runs_with_images(family):
    """An FP8 base of a vision-language model: every linear layer of the tower and projector stays 16-bit ("always:
    vision tower / projector"), the language model's become FP8 layers, and the full forward with the pixel
    values stays close to the 16-bit model's (the FP8 round trip's error only)."""
    from vision_models import chat_prompts, full_forward_inputs

    from longrl.models.fp8 import quantize_model_fp8
    from longrl.models.fp8_linear import FP8Linear

    model, processor = build(family, seed=3)
    (enc, _), = chat_prompts(model, processor, [((56, 56),)], seed=1)
    inputs = full_forward_inputs(enc, [5, 6, 7])
    with torch.no_grad():
        want = model(**inputs).logits
    prefixes = vision_module_prefixes(model, vision_family(model.config))
    report = quantize_model_fp8(model, torch.randint(0, 90, (1, 8)), exception_budget=0.0)
    vision = {n: m for n, m in model.named_modules() if any(n.startswith(p) for p in prefixes)}
    vision_linears = [n for n, m in vision.items() if isinstance(m, torch.nn.Linear)]
    assert vision_linears and all(report.kept[n].startswith("always: vision") for n in vision_linears)
    assert not any(isinstance(m, FP8Linear) for m in vision.values())
    assert report.quantized and all(isinstance(model.get_submodule(n), FP8Linear) for n in report.quantized)
    with torch.no_grad():
        got = model(**inputs).logits
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=0.1 * float(want.abs().max()), rtol=0)
    assert not torch.equal(got, want)  # the language model's products did change


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_index_equals_get_rope_index(family, tiny):
    model, processor = tiny(family)
    for n, sizes in ((1, ((56, 56),)), (3, ((56, 28), (28, 56), (56, 56)))):
        prompt = encode_prompt(processor, model.config, _messages(n), images(n, sizes=sizes))
        ids = torch.tensor([prompt.input_ids])
        kwargs = dict(image_grid_thw=prompt.image_inputs["image_grid_thw"])
        if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
            kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).long()
        expected, delta = model.model.get_rope_index(ids, **kwargs)
        assert torch.equal(prompt.mrope, expected[:, 0])
        assert prompt.rope_delta == int(delta)
    with pytest.raises(ValueError, match="placeholder"):
        one_less = list(prompt.input_ids)
        one_less.remove(model.config.image_token_id)
        mrope_positions(one_less, model.config.image_token_id, prompt.image_inputs["image_grid_thw"], 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_inputs_equal_transformers_forward(family, tiny):
    """The language model on the prompt's embeddings and positions (features scattered at the placeholders) gives
    transformers' full forward(input_ids, pixel_values, ...) logits, for 2 images of different sizes."""
    model, processor = tiny(family)
    prompt = encode_prompt(processor, model.config, _messages(2), images(2))
    nested = family in ("idefics3", "smolvlm")
    text = processor.apply_chat_template(_messages(2), add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[images(2)] if nested else images(2), add_special_tokens=False,
                    return_tensors="pt")
    assert enc["input_ids"][0].tolist() == prompt.input_ids
    features = FeatureCache(model, prompt.family)
    with torch.no_grad():
        expected = model(**enc).logits[0]  # [L, V] (Gemma 3: with token_type_ids, its image-block masks)
        ids = torch.tensor([prompt.input_ids])
        placements = [Placement(0, 0, len(prompt), prompt)]
        inputs = language_model_inputs(model, ids, torch.arange(len(prompt))[None], placements, features)
        backbone, head, spec = model_parts(model)
        if prompt.family.image_blocks:
            inputs["attention_mask"] = layer_masks(backbone.config, placements, 1, len(prompt), "cpu", "eager",
                                                   torch.float32)
        got = head(backbone(**inputs, use_cache=False).last_hidden_state[0])
    assert spec == LogitSpec()  # a vision-language model's head neither scales nor caps its logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert features.tower_calls == 1


def test_image_count_mismatch_and_text_model_errors(tiny):
    from longrl.models import build_tiny_model

    model, processor = tiny("llava")
    with pytest.raises(ValueError, match="2 image part.*1 image"):
        encode_prompt(processor, model.config, _messages(2), images(1))
    with pytest.raises(VisionModelError, match="text-only"):
        encode_prompt(processor, build_tiny_model()[0].config, _messages(1), images(1))


def test_gemma3_adapters_and_logits(tiny):
    """Gemma 3: LoRA on the projector is refused with the reason (a bare weight matrix), the tower takes adapters;
    the logits are lm_head(h) whatever final_logit_softcapping says, as Gemma3ForConditionalGeneration computes."""
    model, processor = tiny("gemma3")
    fam = vision_family(model.config)
    with pytest.raises(ValueError, match="lora.vision_modules.*projector.*bare weight matrix.*lora.enabled: false"):
        lora_targets(model, fam, ["all-linear"], "projector")
    tower = lora_targets(model, fam, ["all-linear"], "tower_and_projector")
    assert tower and all(n.startswith("model.vision_tower.") or n.startswith("model.language_model.") for n in tower)
    prompt = encode_prompt(processor, model.config, _messages(1), images(1))
    enc = processor(text=[processor.apply_chat_template(_messages(1), add_generation_prompt=True, tokenize=False)],
                    images=images(1), add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        plain = model(**enc).logits
        model.config.text_config.final_logit_softcapping = 0.1  # (real checkpoints: null)
        try:
            capped = model(**enc).logits
            assert model_parts(model)[2] == LogitSpec()
        finally:
            model.config.text_config.final_logit_softcapping = None
    assert torch.equal(plain, capped) and plain.abs().max() > 0.2  # a cap of 0.1 would have shown
    assert enc["input_ids"][0].tolist() == prompt.input_ids
