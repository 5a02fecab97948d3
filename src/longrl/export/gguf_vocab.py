"""The tokenizer as GGUF metadata (``tokenizer.ggml.*``, ``tokenizer.chat_template``) that llama.cpp tokenizes
exactly as the Hugging Face tokenizer does, or a refusal naming why it cannot.

:func:`vocab_plan` reads the tokenizer's ``tokenizer.json`` and decides, before anything is written, how llama.cpp
can reproduce it:

- byte-level BPE (GPT-2, Llama 3, Qwen 2 splits) -> ``tokenizer.ggml.model = gpt2`` with the merges, and the
  pre-tokenizer identified from the tokenizer's own split rule: llama.cpp hard-codes one regex per pre-tokenizer
  name, so the name is the one whose regex (and ``ignore_merges`` rule) equals the tokenizer's. An unknown rule
  is refused. (llama.cpp's converter identifies real models by hashing a reference tokenization, which depends
  on the vocabulary and cannot name a newly trained one; the rule itself can.)
- BPE with byte fallback over ``▁``-escaped text (Llama 2 / Mistral-7B) -> ``llama`` (llama.cpp's SentencePiece
  tokenizer), which merges the adjacent pair whose concatenation has the highest score. It equals HF's
  rank-ordered BPE when every two-token split of a token is a merge (as in merges derived from a SentencePiece
  model); the score of a token is minus the rank of its first merge.
- the builtin single-character vocabulary -> ``gpt2`` whose merges never apply, each character as its byte-level
  token.

BOS/EOS addition is read off the tokenizer itself (what ``tokenizer(text)`` adds around
``tokenizer(text, add_special_tokens=False)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# the split rules live with the models (the GGUF loader checks them too); LLAMA3_SPLIT, QWEN2_SPLIT re-exported
from ..models.byte_level_splits import (  # noqa: F401
    LLAMA3_SPLIT,
    QWEN2_SPLIT,
    UnsupportedTokenizer,
    byte_level_pre,
    tokenizer_json,
    tokenizer_steps,
)

SPACE = "\u2581"  # ▁, SentencePiece's escaped space
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


@dataclass
class VocabPlan:
    """How the tokenizer is written: GGUF tokenizer model and pre-tokenizer, and the flags llama.cpp reads."""

    kind: str  # "byte_level_bpe" | "byte_fallback_bpe" | "chars"
    model: str  # tokenizer.ggml.model
    pre: str | None  # tokenizer.ggml.pre (gpt2 model only)
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool | None = None  # llama model only
    notes: list[str] = field(default_factory=list)  # exactness caveats worth logging
    tokenizer_json: dict = field(default_factory=dict, repr=False)  # the tokenizer.json the plan was made from


def _added_tokens_check(tj: dict) -> None:
    for t in tj.get("added_tokens", []):
        flags = [f for f in ("lstrip", "rstrip", "single_word") if t.get(f)]
        if flags:
            raise UnsupportedTokenizer(f"added token {t['content']!r} has {', '.join(flags)}: llama.cpp matches "
                                       "added tokens literally, without stripping or word boundaries")


def _special_additions(tokenizer) -> tuple[bool, bool]:
    """(add_bos, add_eos): what ``tokenizer(text)`` puts around the plain tokenization."""
    probe = "a 1"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain]
    if not starts:
        raise UnsupportedTokenizer("the tokenizer's post-processor changes the tokens of the text itself")
    prefix, suffix = full[:starts[0]], full[starts[0] + len(plain):]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if prefix not in ([], [bos]) or suffix not in ([], [eos]) or (prefix and bos is None) or (suffix and eos is None):
        names = tokenizer.convert_ids_to_tokens(prefix + suffix)
        raise UnsupportedTokenizer(f"the tokenizer adds special tokens {names} around a text; llama.cpp can only "
                                   "add the BOS token before and the EOS token after")
    return bool(prefix), bool(suffix)


def _space_prefix(tj: dict) -> bool:
    """Whether a ▁-escaping byte-fallback BPE prepends ▁ (llama.cpp's add_space_prefix), or a refusal."""
    norms, pres = tokenizer_steps(tj.get("normalizer")), tokenizer_steps(tj.get("pre_tokenizer"))
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    kinds = [n.get("type") for n in norms]
    if not pres and kinds == ["Prepend", "Replace"] and norms[0].get("prepend") == SPACE \
            and {k: norms[1].get(k) for k in replace} == replace:
        return True
    if not pres and kinds == ["Replace"] and {k: norms[0].get(k) for k in replace} == replace:
        return False
    if not norms and len(pres) == 1 and pres[0].get("type") == "Metaspace" and pres[0].get("replacement") == SPACE \
            and not pres[0].get("split", True) and pres[0].get("prepend_scheme") in ("always", "never"):
        return pres[0]["prepend_scheme"] == "always"
    raise UnsupportedTokenizer(
        f"normalizer {kinds} / pre-tokenizer {[p.get('type') for p in pres]} of a byte-fallback BPE: llama.cpp's "
        "SentencePiece tokenizer escapes spaces as ▁ and prepends ▁ to every text segment (after each special "
        "token too); only Prepend(▁)+Replace(' ', ▁), Replace(' ', ▁) or Metaspace(prepend_scheme always/never, "
        "split=false) say the same")


def _merge_pairs(model: dict) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]


def _check_bpe_model(model: dict, byte_fallback: bool) -> None:
    if model.get("type") != "BPE":
        raise UnsupportedTokenizer(f"tokenizer model {model.get('type')!r}")
    if model.get("dropout"):
        raise UnsupportedTokenizer("BPE dropout is random; llama.cpp tokenizes deterministically")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise UnsupportedTokenizer("BPE with a continuing-subword prefix or end-of-word suffix")
    if bool(model.get("byte_fallback")) != byte_fallback:
        raise UnsupportedTokenizer("byte fallback without ▁-escaping (or byte-level BPE with byte fallback)")


def vocab_plan(tokenizer) -> VocabPlan:
    """Decide how ``tokenizer`` (a transformers fast tokenizer) is written, or raise UnsupportedTokenizer."""
    tj = tokenizer_json(tokenizer)
    plan = _decide(tokenizer, tj)
    plan.tokenizer_json = tj
    return plan


def _decide(tokenizer, tj: dict) -> VocabPlan:
    model = tj.get("model", {})
    decoder = [d.get("type") for d in tokenizer_steps(tj.get("decoder"))]
    _added_tokens_check(tj)
    if model.get("type") == "WordLevel":
        specials = {t["content"] for t in tj.get("added_tokens", [])}
        pres = tokenizer_steps(tj.get("pre_tokenizer"))
        one_char = [p.get("type") for p in pres] == ["Split"] and (pres[0].get("pattern") or {}).get("Regex") == "."
        if one_char and not tj.get("normalizer") and all(len(t) == 1 or t in specials for t in model.get("vocab", {})):
            add_bos, add_eos = _special_additions(tokenizer)
            return VocabPlan("chars", "gpt2", "default", add_bos, add_eos, notes=[
                "characters outside the vocabulary: Hugging Face gives <unk> for each, llama.cpp drops them"])
        raise UnsupportedTokenizer("a word-level vocabulary other than single characters split one by one")
    if model.get("type") == "BPE" and model.get("byte_fallback") and _inert_byte_fallback(tj):
        model = {**model, "byte_fallback": False}  # decided as the byte-level BPE it is
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        _check_bpe_model(model, True)
        if model.get("ignore_merges"):
            raise UnsupportedTokenizer("ignore_merges on a byte-fallback BPE: llama.cpp's SentencePiece tokenizer "
                                       "always merges")
        vocab = model.get("vocab", {})
        missing = [b for b in BYTE_TOKENS if b not in vocab]
        if missing:
            raise UnsupportedTokenizer(f"byte fallback without all 256 byte tokens (no {missing[0]}): llama.cpp "
                                       "cannot tokenize a character that is neither a token nor bytes")
        add_space_prefix = _space_prefix(tj)
        _check_merges_complete(tokenizer, model)
        add_bos, add_eos = _special_additions(tokenizer)
        return VocabPlan("byte_fallback_bpe", "llama", None, add_bos, add_eos, add_space_prefix)
    if model.get("type") == "BPE":
        _check_bpe_model(model, False)
        if "ByteLevel" not in decoder:
            raise UnsupportedTokenizer(f"BPE with decoder {decoder}: neither byte-level nor byte fallback")
        pre, ignore_merges = byte_level_pre(tj)
        if bool(model.get("ignore_merges")) != ignore_merges:
            raise UnsupportedTokenizer(f"ignore_merges={bool(model.get('ignore_merges'))} with the {pre} split; "
                                       f"llama.cpp's {pre} pre-tokenizer uses ignore_merges={ignore_merges}")
        add_bos, add_eos = _special_additions(tokenizer)
        notes = ["NFC normalization: llama.cpp does not normalize, so text that is not in NFC tokenizes differently"] \
            if [n.get("type") for n in tokenizer_steps(tj.get("normalizer"))] == ["NFC"] else []
        return VocabPlan("byte_level_bpe", "gpt2", pre, add_bos, add_eos, notes=notes)
    raise UnsupportedTokenizer(f"tokenizer model {model.get('type')!r} (decoder {decoder}) has no exact llama.cpp "
                               "equivalent here; supported: byte-level BPE, BPE with byte fallback, the builtin "
                               "character vocabulary")


def _inert_byte_fallback(tj: dict) -> bool:
    """A byte-level BPE whose byte fallback can never act: a character missing from the vocabulary falls back to
    its <0xNN> tokens only when they are all tokens, else to the unknown token as without fallback, and this
    vocabulary has none of them. transformers 5.17 reads byte-level GGUF vocabularies (SmolLM2's) that way:
    byte_fallback on, ByteFallback and ▁ decoders that never match."""
    vocab = tj.get("model", {}).get("vocab", {})
    byte_level = any(p.get("type") == "ByteLevel" for p in tokenizer_steps(tj.get("pre_tokenizer")))
    return byte_level and not any(t in vocab for t in BYTE_TOKENS)


def _all_tokens(tokenizer) -> dict[str, int]:
    return dict(tokenizer.get_vocab())


def _check_merges_complete(tokenizer, model: dict) -> None:
    """llama.cpp merges any adjacent pair whose concatenation is a token; HF only listed merges: every split of a
    token into two tokens must be a merge."""
    vocab = _all_tokens(tokenizer)
    merges = set(_merge_pairs(model))
    for token in vocab:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab and (left, right) not in merges:
                raise UnsupportedTokenizer(
                    f"token {token!r} splits into tokens {left!r} + {right!r}, which is not a merge: llama.cpp's "
                    "SentencePiece tokenizer would merge them, Hugging Face's BPE does not (the merges were not "
                    "derived from a SentencePiece model)")


def _token_scores(tokens: list[str], model: dict) -> list[float]:
    """Minus the rank of the first merge that makes each token (0 for tokens no merge makes)."""
    first_rank: dict[str, int] = {}
    for rank, (left, right) in enumerate(_merge_pairs(model)):
        first_rank.setdefault(left + right, rank)
    return [-float(first_rank[t]) if t in first_rank else 0.0 for t in tokens]


def token_table(tokenizer, plan: VocabPlan, n_vocab: int):
    """(texts, types) in id order, padded to ``n_vocab`` with unused ``[PADi]`` tokens."""
    import gguf
    from gguf.vocab import bytes_to_unicode

    by_id = {i: t for t, i in _all_tokens(tokenizer).items()}
    if max(by_id) >= n_vocab:
        raise UnsupportedTokenizer(f"the tokenizer has ids up to {max(by_id)} but the model only {n_vocab} "
                                   "embedding rows")
    added = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
    encode = bytes_to_unicode()
    texts, types = [], []
    for i in range(n_vocab):
        text = by_id.get(i)
        if text is None:
            texts.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif text in added:
            texts.append(text)
            types.append(gguf.TokenType.CONTROL if added[text] else gguf.TokenType.USER_DEFINED)
        elif plan.kind == "chars":
            texts.append("".join(encode[b] for b in text.encode("utf-8")))
            types.append(gguf.TokenType.NORMAL)
        else:
            texts.append(text)
            types.append(gguf.TokenType.BYTE if plan.kind == "byte_fallback_bpe" and text in BYTE_TOKENS
                         else gguf.TokenType.UNKNOWN if text == tokenizer.unk_token else gguf.TokenType.NORMAL)
    return texts, types


def add_tokenizer(writer, tokenizer, n_vocab: int, plan: VocabPlan | None = None) -> VocabPlan:
    """Write ``tokenizer`` into ``writer`` (a ``gguf.GGUFWriter``) for a model of ``n_vocab`` embedding rows."""
    plan = plan or vocab_plan(tokenizer)
    tj = plan.tokenizer_json
    texts, types = token_table(tokenizer, plan, n_vocab)
    writer.add_tokenizer_model(plan.model)
    if plan.pre is not None:
        writer.add_tokenizer_pre(plan.pre)
    writer.add_token_list(texts)
    writer.add_token_types([int(t) for t in types])
    if plan.kind == "byte_level_bpe":
        writer.add_token_merges([f"{a} {b}" for a, b in _merge_pairs(tj["model"])])
    elif plan.kind == "chars":
        # llama.cpp needs a merges list for a gpt2 vocabulary; this one joins two multi-character tokens, which
        # never occur as symbols (symbols start as single characters and only merges grow them)
        multi = [t for t in texts if len(t) > 1 and " " not in t]
        writer.add_token_merges([f"{multi[0]} {multi[0]}"])
    else:
        writer.add_token_scores(_token_scores(texts, tj["model"]))
        writer.add_add_space_prefix(bool(plan.add_space_prefix))
    for name, tid in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                      ("unk", tokenizer.unk_token_id), ("pad", tokenizer.pad_token_id)):
        if tid is not None:
            getattr(writer, f"add_{name}_token_id")(int(tid))
    writer.add_add_bos_token(plan.add_bos)
    writer.add_add_eos_token(plan.add_eos)
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        writer.add_chat_template(tokenizer.chat_template)
    return plan
