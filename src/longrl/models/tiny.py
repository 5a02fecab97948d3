"""The embedded demo model: a tiny Llama built from a config shipped in the package and a character-level
tokenizer built in code, so that ``longrl demo`` needs no download."""

from __future__ import annotations

import json
from importlib import resources

import torch

TINY_NAME = "builtin:tiny-arith"
CHARACTERS = list("0123456789+-*= ?")
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


def build_char_tokenizer():
    """A character-level fast tokenizer over digits, arithmetic signs and a space (20 ids)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config_dict() -> dict:
    return json.loads(resources.files("longrl.models").joinpath("tiny_arith.json").read_text())


def build_tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32):
    """(model, tokenizer): the tiny Llama with weights drawn from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_char_tokenizer()
    cfg = LlamaConfig(**tiny_config_dict(), vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(dtype)
    return model, tok
