"""The embedded vision demo model: a tiny LLaVA (a CLIP vision tower, a two-layer projector, a two-layer Llama)
with a word-level tokenizer and a processor built in code, so that ``longrl demo --task vision`` needs no download.

A 28 × 28 image is cut into 2 × 2 patches of 14 px; the tower's CLS output is dropped (LLaVA's ``default``
feature strategy), so each image becomes 4 tokens of the language model. The vocabulary is the demo task's words
(tasks/shapes.py: the question and the four colours) and a few signs, 16 ids in all: a random policy then names
a colour and stops often enough for GRPO to find the reward (other words read as ``<unk>``).
"""

from __future__ import annotations

import torch

TINY_VISION_NAME = "builtin:tiny-vision"
IMAGE_TOKEN = "<image>"
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>", IMAGE_TOKEN]
WORDS = ["red", "green", "blue", "yellow", "colour", "shape", "what", "?", "=", ".", ","]
IMAGE_SIZE, PATCH_SIZE = 28, 14
# messages → text: image parts become the image token (the processor expands it to the image's 4 tokens), text
# parts their text; an assistant turn is "=", its text and "<eos>", so the generation prompt is "=" (the answer
# follows it) and a supervised example of an answer reads as a sampled one
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}={% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}" + IMAGE_TOKEN + "{% elif p['type'] == 'text' %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{% if m['role'] == 'assistant' %}<eos>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


def build_vision_tokenizer():
    """A word-level fast tokenizer over :data:`WORDS` (words split at spaces, signs apart), with ``<image>`` as
    one special token; decoded words are joined by spaces."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                     pre_tokenizers.Split(Regex(r"[^\w]"), behavior="isolated")])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>", extra_special_tokens={"image_token": IMAGE_TOKEN})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def pillow_image_processor(name: str, **kwargs):
    """transformers' image processor ``name`` on its Pillow backend (no torchvision needed): ``{name}Pil`` where
    transformers has it (≥ 5.2x, whose plain name then wants torchvision), else ``name`` (the Pillow one before)."""
    import transformers

    for cls_name in (name + "Pil", name):
        cls = getattr(transformers, cls_name, None)
        if cls is None:
            continue
        try:
            return cls(**kwargs)
        except ImportError:  # a placeholder class of a backend this install lacks
            continue
    raise ImportError(f"transformers has no Pillow image processor {name!r}")


def build_vision_processor():
    """LLaVA's processor over a PIL CLIP image processor (resize and centre-crop to 28 px, CLIP's normalisation)
    and :func:`build_vision_tokenizer`."""
    from transformers import LlavaProcessor

    image_processor = pillow_image_processor("CLIPImageProcessor", size={"shortest_edge": IMAGE_SIZE},
                                             crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return LlavaProcessor(image_processor=image_processor, tokenizer=build_vision_tokenizer(), patch_size=PATCH_SIZE,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          image_token=IMAGE_TOKEN, chat_template=CHAT_TEMPLATE)


def tiny_vision_config(tokenizer):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    return LlavaConfig(vision_config=vision, text_config=text,
                       image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), projector_hidden_act="gelu",
                       vision_feature_select_strategy="default", vision_feature_layer=-1,
                       pad_token_id=tokenizer.pad_token_id)


def build_tiny_vision_model(seed: int = 0, dtype: torch.dtype = torch.float32):
    """(model, processor): the tiny LLaVA with weights drawn from ``seed``."""
    from transformers import LlavaForConditionalGeneration

    processor = build_vision_processor()
    cfg = tiny_vision_config(processor.tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(cfg).to(dtype)
    return model, processor
