"""The tokenizer as GGUF metadata (``tokenizer.ggml.*`` and ``tokenizer.chat_template``), following llama.cpp's
converter: tokens in id order, padded to the model's vocabulary with ``[PADn]`` (unused) tokens, added special
tokens as control tokens, merges, special ids and the chat template through ``gguf.SpecialVocab``."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def tokenizer_kind(tokenizer_json: dict) -> str:
    """GGUF tokenizer model for a ``tokenizer.json``: ``gpt2`` (byte-level BPE), ``llama`` (BPE with byte
    fallback, SentencePiece style) or ``chars`` (a word-level vocabulary of single characters, written as a
    byte-level BPE without merges); raises ValueError otherwise."""
    model = tokenizer_json.get("model", {})
    decoder = (tokenizer_json.get("decoder") or {}).get("type")
    if model.get("type") == "BPE" and not model.get("byte_fallback", False) and decoder == "ByteLevel":
        return "gpt2"
    if model.get("type") == "BPE" and model.get("byte_fallback", False):
        return "llama"
    if model.get("type") == "WordLevel":
        specials = {t["content"] for t in tokenizer_json.get("added_tokens", [])}
        if all(len(t) == 1 or t in specials for t in model.get("vocab", {})):
            return "chars"
    raise ValueError(f"tokenizer model {model.get('type')!r} (decoder {decoder!r}) has no GGUF equivalent here; "
                     "supported: byte-level BPE, BPE with byte fallback, single-character word level")


def _pre_tokenizer(tokenizer_json: dict, model_type: str) -> str:
    """llama.cpp's pre-tokenizer name; llama.cpp identifies it by hashing a test tokenization, here it is
    inferred from the model family and the split pattern (``default`` when unknown)."""
    if model_type in ("qwen2", "qwen3"):
        return "qwen2"
    if r"\p{N}{1,3}" in json.dumps(tokenizer_json.get("pre_tokenizer")).replace("\\\\", "\\"):
        return "llama-bpe"
    return "default"


def add_tokenizer(writer, tokenizer, n_vocab: int, model_type: str) -> None:
    """Write ``tokenizer`` (a transformers fast tokenizer) into ``writer`` for a model of ``n_vocab`` rows."""
    import gguf

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        tj = json.loads((Path(tmp) / "tokenizer.json").read_text())
        kind = tokenizer_kind(tj)
        if kind == "llama":
            vocab = gguf.vocab.LlamaHfVocab(Path(tmp))
            tokens, scores, types = zip(*vocab.all_tokens())
            tokens = [t.decode("utf-8") for t in tokens]
        else:
            tokens, types = _bpe_tokens(tokenizer, kind)
            scores = None
        special = gguf.SpecialVocab(tmp, load_merges=kind == "gpt2", n_vocab=n_vocab)
        tokens, types = list(tokens), list(types)
        if len(tokens) > n_vocab:
            raise ValueError(f"the tokenizer has {len(tokens)} tokens but the model only {n_vocab} embedding rows")
        for i in range(len(tokens), n_vocab):
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        writer.add_tokenizer_model("llama" if kind == "llama" else "gpt2")
        writer.add_tokenizer_pre(_pre_tokenizer(tj, model_type) if kind == "gpt2" else "default")
        writer.add_token_list(tokens)
        writer.add_token_types([int(t) for t in types])
        if scores is not None:
            writer.add_token_scores(list(scores) + [-1000.0] * (n_vocab - len(scores)))
        if special.chat_template is None and tokenizer.chat_template:
            special.chat_template = tokenizer.chat_template
        special.add_to_gguf(writer, quiet=True)


def _bpe_tokens(tokenizer, kind: str):
    """(texts, types) in id order: byte-level strings for BPE, byte-level-encoded characters for ``chars``."""
    import gguf
    from gguf.vocab import bytes_to_unicode

    vocab = tokenizer.get_vocab()
    by_id = {i: t for t, i in vocab.items()}
    added = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
    encode = bytes_to_unicode()
    texts, types = [], []
    for i in range(max(by_id) + 1):
        text = by_id.get(i)
        if text is None:
            texts.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif text in added:
            texts.append(text)
            types.append(gguf.TokenType.CONTROL if added[text] else gguf.TokenType.USER_DEFINED)
        else:
            texts.append("".join(encode[b] for b in text.encode("utf-8")) if kind == "chars" else text)
            types.append(gguf.TokenType.NORMAL)
    return texts, types
