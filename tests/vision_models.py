"""Tiny random vision-language models with their processors, built in code (no downloads), one per supported family.

``build(family, seed)`` → (model, processor): 2 decoder layers of hidden size 32, vision towers of 1 layer, images
of 28–64 px (Gemma 3: a sliding-window layer, then a full-attention one; each image 4 soft tokens). The tokenizer is character-level (every printable ASCII character one token) plus the family's special
tokens, its chat template renders ``{"type": "image"}`` parts where the family puts its image placeholder.
``images(n, seed)`` gives small RGB pictures of a few sizes.
"""

from __future__ import annotations

import string

import torch

from longrl.models.tiny_vision import pillow_image_processor

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next", "idefics3", "smolvlm", "gemma3")
FAST_DECODE = tuple(f for f in FAMILIES if f != "gemma3")  # whose language model takes rollout/fast_decode.py
QWEN_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                "<|video_pad|>", "<|endoftext|>"]
IDEFICS_SPECIAL = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
GEMMA_SPECIAL = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# what a family's chat template writes for an image part, and its turn markers
IMAGE_TEXT = {"qwen": "<|vision_start|><|image_pad|><|vision_end|>", "llava": "<image>", "idefics": "<image>",
              "gemma": "<start_of_image>"}
GEMMA_WINDOW = 512  # the tiny Gemma 3's sliding window: longer than the tests' sequences (the sampler's rule)
TEXT_LAYER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


def _template(image_text: str, user: str, assistant: str, end: str) -> str:
    """A chat template rendering string contents and content lists with text and image parts."""
    return ("{% for m in messages %}"
            "{% if m['role'] == 'user' %}" + user + "{% elif m['role'] == 'assistant' %}" + assistant +
            "{% else %}{{ m['role'] }}: {% endif %}"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}" + image_text + "{% else %}{{ p['text'] }}{% endif %}"
            "{% endfor %}{% endif %}" + end + "{% endfor %}"
            "{% if add_generation_prompt %}" + assistant + "{% endif %}")


def build_tokenizer(special: list[str], image_token: str | None = None, **named: str):
    """A character-level fast tokenizer: pad/bos/eos/unk, ``special`` tokens, then printable ASCII characters.
    ``image_token`` and ``named`` (e.g. boi_token=...): the tokenizer's named special tokens, which processors read."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(base + special + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    extra = {**({"image_token": image_token} if image_token else {}), **named}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", extra_special_tokens=extra)
    tok.add_special_tokens({"additional_special_tokens": special})
    return tok


def images(n: int, seed: int = 0, sizes=((56, 56), (56, 28), (28, 56))):
    """``n`` random RGB PIL images cycling through ``sizes`` (width, height)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
        out.append(Image.fromarray(pixels, "RGB"))
    return out


def _images_only(processor_cls):
    """``processor_cls`` without its video processor (which needs torchvision; these tests give images only)."""

    class ImagesOnly(processor_cls):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    ImagesOnly.__name__ = processor_cls.__name__
    return ImagesOnly


def _qwen(family: str, tok, rope: dict | None = None):
    import transformers as tf

    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    text = dict(TEXT_LAYER, vocab_size=len(tok), rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                  "mrope_section": [2, 1, 1], **(rope or {})},
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    common = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    patch = 16 if family == "qwen3_vl" else 14
    if family == "qwen2_vl":
        vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=patch)
        config, processor_cls = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **common), tf.Qwen2VLProcessor
    elif family == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                      patch_size=patch, window_size=56, fullatt_block_indexes=[1])
        config, processor_cls = (tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common),
                                 tf.Qwen2_5_VLProcessor)
    else:
        text.update(head_dim=8)
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                      patch_size=patch, num_position_embeddings=16, deepstack_visual_indexes=[0])
        config, processor_cls = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **common), tf.Qwen3VLProcessor
    image_processor = pillow_image_processor("Qwen2VLImageProcessor", patch_size=patch, merge_size=2, temporal_patch_size=2,
                                                  min_pixels=(2 * patch) ** 2, max_pixels=(4 * patch) ** 2)
    processor = _images_only(processor_cls)(image_processor=image_processor, tokenizer=tok,
                                            chat_template=_template(IMAGE_TEXT["qwen"], "<|im_start|>user\n",
                                                      "<|im_start|>assistant\n", "<|im_end|>\n"))
    return config, processor


def _llava(family: str, tok, rope: dict | None = None):
    import transformers as tf

    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    text = dict(TEXT_LAYER, model_type="llama", vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if rope:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, **rope}
    image_id = tok.convert_tokens_to_ids("<image>")
    template = _template(IMAGE_TEXT["llava"], "USER: ", "ASSISTANT: ", "\n")
    if family == "llava":
        config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                                image_seq_length=4, vision_feature_layer=-1)
        image_processor = pillow_image_processor("CLIPImageProcessor", size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        processor = tf.LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=14, num_additional_image_tokens=1,
                                      vision_feature_select_strategy="default", chat_template=template)
        return config, processor
    pinpoints = [[28, 28], [28, 56], [56, 28]]
    config = tf.LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                                image_grid_pinpoints=pinpoints, vision_feature_layer=-1)
    image_processor = pillow_image_processor("LlavaNextImageProcessor", size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                    image_grid_pinpoints=pinpoints)
    processor = tf.LlavaNextProcessor(image_processor=image_processor, tokenizer=tok, patch_size=14, num_additional_image_tokens=1,
                                      vision_feature_select_strategy="default", chat_template=template)
    return config, processor


def _idefics(family: str, tok):
    import transformers as tf

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                  patch_size=16)
    text = dict(TEXT_LAYER, model_type="llama", vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    image_id = tok.convert_tokens_to_ids("<image>")
    template = _template(IMAGE_TEXT["idefics"], "User:", "Assistant:", "<end_of_utterance>\n")
    size = dict(size={"longest_edge": 64}, max_image_size={"longest_edge": 64}, do_image_splitting=False)
    if family == "idefics3":
        config = tf.Idefics3Config(vision_config=vision, text_config=text, image_token_id=image_id, scale_factor=2)
        processor = tf.Idefics3Processor(image_processor=pillow_image_processor("Idefics3ImageProcessor", **size), tokenizer=tok,
                                         image_seq_len=4, chat_template=template)
    else:  # SmolVLMProcessor needs num2words (for videos): Idefics3's processor writes the same layout for
        #    one unsplit image a placeholder, <fake_token_around_image><global-img><image>×4<fake_token_around_image>
        config = tf.SmolVLMConfig(vision_config=vision, text_config=text, image_token_id=image_id, scale_factor=2)
        processor = tf.Idefics3Processor(image_processor=pillow_image_processor("SmolVLMImageProcessor", **size), tokenizer=tok,
                                         image_seq_len=4, chat_template=template)
    return config, processor


def _gemma3(tok, window: int):
    """Gemma 3: a SigLIP tower of 4×4 patches (28 px, patch 7) average-pooled to 2×2 = 4 soft tokens an image, which
    the processor writes as ``\n\n<start_of_image>`` + 4 × ``<image_soft_token>`` + ``<end_of_image>\n\n``; a
    sliding-window layer of ``window`` tokens, then a full-attention one. :func:`build` draws the projector and the
    (1 + w) norms at random (transformers starts them at 0)."""
    import transformers as tf

    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA_SPECIAL}
    text = dict(TEXT_LAYER, vocab_size=len(tok), head_dim=8, query_pre_attn_scalar=8, sliding_window=window,
                layer_types=["sliding_attention", "full_attention"], pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=7, vision_use_head=False)  # (as the checkpoints)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                             boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                             image_token_index=ids["<image_soft_token>"])
    image_processor = pillow_image_processor("Gemma3ImageProcessor", size={"height": 28, "width": 28})
    processor = tf.Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=4,
                                   chat_template=_template(IMAGE_TEXT["gemma"], "<start_of_turn>user\n",
                                                           "<start_of_turn>model\n", "<end_of_turn>\n"))
    return config, processor


def build(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, rope: dict | None = None,
          window: int = GEMMA_WINDOW):
    """(model, processor): a tiny random ``family`` model (eager attention) and its processor. ``rope``: entries
    over the text model's rope_parameters (Qwen and LLaVA families), e.g. a scaling type. ``window``: Gemma 3's
    sliding window."""
    import transformers as tf

    if family.startswith("qwen"):
        tok = build_tokenizer(QWEN_SPECIAL, "<|image_pad|>")
        config, processor = _qwen(family, tok, rope)
    elif family.startswith("llava"):
        tok = build_tokenizer(["<image>"], "<image>")
        config, processor = _llava(family, tok, rope)
    elif family in ("idefics3", "smolvlm"):
        tok = build_tokenizer(IDEFICS_SPECIAL, "<image>")
        try:
            config, processor = _idefics(family, tok)
        except ImportError as e:  # transformers < 5.2x: these image processors need torchvision
            import pytest

            pytest.skip(f"{family}: {e} (transformers {tf.__version__} without torchvision)")
    elif family == "gemma3":
        tok = build_tokenizer(GEMMA_SPECIAL, "<image_soft_token>", boi_token="<start_of_image>",
                              eoi_token="<end_of_image>")
        config, processor = _gemma3(tok, window)
    else:
        raise ValueError(f"no tiny {family!r}; families: {', '.join(FAMILIES)}")
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForImageTextToText.from_config(config, attn_implementation="eager").to(dtype)
        if family == "gemma3":  # its (1 + w) norms start at w = 0 and its projector matrix at 0 (image features 0)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if ("norm" in name and not name.startswith("model.vision_tower")) or "mm_input_projection" in name:
                        p.normal_(0.0, 0.5)
    model.eval()
    return model, processor


def chat_prompts(model, processor, shapes, seed: int = 0):
    """Per entry of ``shapes`` (image sizes, () for text only): a one-message prompt with those images before a
    short text, as (the processor's output for transformers' forward, its VisionPrompt or None)."""
    from longrl.models.vision import FAMILIES, encode_prompt

    nested = "pixel_attention_mask" in FAMILIES[model.config.model_type].image_inputs
    out = []
    for k, sizes in enumerate(shapes):
        messages = [{"role": "user", "content": [{"type": "image"}] * len(sizes) + [{"type": "text", "text": f"Q{k}?"}]}]
        pics = images(len(sizes), seed=seed + k, sizes=sizes or ((56, 56),))
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        enc = processor(text=[text], images=([pics] if nested else pics) if sizes else None,
                        add_special_tokens=False, return_tensors="pt")
        out.append((enc, encode_prompt(processor, model.config, messages, pics) if sizes else None))
    return out


def full_forward_inputs(enc, tokens: list[int], dtype: torch.dtype | None = None) -> dict:
    """transformers' forward inputs for the prompt ``enc`` followed by ``tokens`` (text), pixel values in ``dtype``."""
    inputs = {k: v for k, v in enc.items() if k != "attention_mask"}
    inputs["input_ids"] = torch.cat([enc["input_ids"], torch.tensor([tokens])], dim=1)
    for key in ("mm_token_type_ids", "token_type_ids"):  # (transformers ≥ 5.2x: its mRoPE index reads the token
        if key in inputs:  # types; Gemma 3's image-block masks are built from token_type_ids): completions are text
            inputs[key] = torch.cat([inputs[key], torch.zeros(1, len(tokens), dtype=torch.long)], dim=1)
    if dtype is not None and "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    return inputs


def vision_tower(model):
    """The vision encoder module of a (PEFT-wrapped) tiny model, for counting its calls."""
    from longrl.models import base_model
    from longrl.models.vision import FAMILIES
    from longrl.models.vision.families import module_names

    base = base_model(model)
    return dict(base.named_modules())[module_names(base, FAMILIES[base.config.model_type].tower)[0]]


def with_lora(model, vision_modules: str = "none", seed: int = 0, scale: float = 0.1):
    """``model`` with rank-2 LoRA adapters (longrl's apply_lora), their B matrices random (PEFT starts them at zero,
    where no gradient would reach A and the adapters would change nothing)."""
    from longrl.config.schema import LoraConfig
    from longrl.models import apply_lora

    model = apply_lora(model, LoraConfig(r=2, alpha=4.0, vision_modules=vision_modules))
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g, dtype=p.dtype) * scale
    return model
