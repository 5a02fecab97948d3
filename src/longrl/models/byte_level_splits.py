"""Byte-level BPE tokenizers and llama.cpp's pre-tokenizers: which named split rule (GPT-2, Llama 3, Qwen 2) a
tokenizer's ``tokenizer.json`` applies. The GGUF exporter writes that name (export/gguf_vocab.py); the GGUF loader
checks that the tokenizer transformers built from a file applies the rule the file names (models/gguf.py)."""

from __future__ import annotations

import json

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp) in the form tokenizer.json spells them, with the
# ignore_merges rule llama.cpp applies for each name
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PRE_TOKENIZERS = {LLAMA3_SPLIT: ("llama-bpe", True), QWEN2_SPLIT: ("qwen2", False)}
GPT2_PRE = ("gpt-2", False)  # ByteLevel's own regex: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# llama.cpp pre-tokenizer name → (the name, its ignore_merges rule)
PRE_TOKENIZER_RULES = {GPT2_PRE[0]: GPT2_PRE, **{rule[0]: rule for rule in SPLIT_PRE_TOKENIZERS.values()}}


class UnsupportedTokenizer(ValueError):
    """llama.cpp cannot tokenize exactly as this tokenizer does; the message says why."""


def tokenizer_json(tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UnsupportedTokenizer(f"{type(tokenizer).__name__} is not a fast (tokenizers) tokenizer; GGUF export "
                                   "reads tokenizer.json")
    return json.loads(backend.to_str())


def tokenizer_steps(node: dict | None) -> list[dict]:
    """A normalizer / pre-tokenizer / decoder as a flat list of steps (``Sequence`` unrolled)."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        key = next((k for k in ("normalizers", "pretokenizers", "decoders") if k in node), None)
        return [s for sub in node.get(key, []) for s in tokenizer_steps(sub)]
    return [node]


def byte_level_pre(tj: dict) -> tuple[str, bool]:
    """llama.cpp's pre-tokenizer name (and its ignore_merges rule) for a byte-level BPE, or a refusal."""
    norms = [n.get("type") for n in tokenizer_steps(tj.get("normalizer"))]
    if norms not in ([], ["NFC"]):
        raise UnsupportedTokenizer(f"normalizer {norms} has no llama.cpp equivalent for byte-level BPE")
    steps = tokenizer_steps(tj.get("pre_tokenizer"))
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if len(byte_level) != 1 or steps[-1] is not byte_level[0]:
        raise UnsupportedTokenizer(f"pre-tokenizer {[s.get('type') for s in steps]} is not a byte-level one")
    if byte_level[0].get("add_prefix_space"):
        raise UnsupportedTokenizer("ByteLevel(add_prefix_space=true): llama.cpp adds no prefix space")
    splits = steps[:-1]
    if not splits and byte_level[0].get("use_regex", True):
        return GPT2_PRE
    if len(splits) == 1 and splits[0].get("type") == "Split" and not byte_level[0].get("use_regex", True):
        s = splits[0]
        regex = (s.get("pattern") or {}).get("Regex")
        if s.get("behavior") == "Isolated" and not s.get("invert") and regex in SPLIT_PRE_TOKENIZERS:
            return SPLIT_PRE_TOKENIZERS[regex]
        raise UnsupportedTokenizer(f"pre-tokenizer split {regex!r} ({s.get('behavior')}) is none of llama.cpp's "
                                   f"known ones (GPT-2, Llama 3, Qwen 2); refusing rather than guessing")
    raise UnsupportedTokenizer(f"pre-tokenizer {[s.get('type') for s in steps]} is none of llama.cpp's known ones "
                               "(GPT-2, Llama 3, Qwen 2); refusing rather than guessing")
