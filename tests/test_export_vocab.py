"""The GGUF tokenizer writer: each tokenizer kind gets llama.cpp's matching tokenizer model and pre-tokenizer,
identified from the tokenizer itself; what llama.cpp cannot reproduce is refused, naming why, before any output;
and on llama.cpp's own full-size vocabularies (GPT-2, Llama 3, Qwen, Llama 2; the vocabulary-only GGUFs and
reference tokenizations that ship in llama-cpp-python's source distribution) the written GGUF tokenizes in
llama.cpp exactly as the Hugging Face tokenizer does."""

import json
import os
from pathlib import Path

import pytest

from export_tokenizers import FIXED_STRINGS, TOKENIZERS, mistral_tokenizer, random_strings, spm_merges
from longrl.export.gguf_vocab import (BYTE_TOKENS, LLAMA3_SPLIT, QWEN2_SPLIT, SPACE, UnsupportedTokenizer,
                                      vocab_plan)
from longrl.models import build_char_tokenizer

gguf = pytest.importorskip("gguf")


def _edited(tok, edit):
    """``tok`` with its tokenizer.json changed by ``edit(state)``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    state = json.loads(tok.backend_tokenizer.to_str())
    edit(state)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)), bos_token=tok.bos_token,
                                   eos_token=tok.eos_token, unk_token=tok.unk_token)


def test_each_tokenizer_kind_gets_its_llama_cpp_tokenizer():
    plans = {name: vocab_plan(make()) for name, make in TOKENIZERS.items()}
    assert (plans["gpt2"].model, plans["gpt2"].pre, plans["gpt2"].add_bos) == ("gpt2", "gpt-2", False)
    assert (plans["llama3"].model, plans["llama3"].pre, plans["llama3"].add_bos) == ("gpt2", "llama-bpe", True)
    assert (plans["qwen2"].model, plans["qwen2"].pre, plans["qwen2"].add_bos) == ("gpt2", "qwen2", False)
    assert "NFC" in plans["qwen2"].notes[0]
    mistral = plans["mistral"]
    assert (mistral.model, mistral.pre, mistral.add_bos, mistral.add_space_prefix) == ("llama", None, True, True)
    chars = vocab_plan(build_char_tokenizer())
    assert (chars.model, chars.pre, chars.add_bos, chars.kind) == ("gpt2", "default", False, "chars")


def _split_regex(state, regex):
    state["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = regex


@pytest.mark.parametrize("edit, match", [
    (lambda s: _split_regex(s, LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}{1,2}")), "none of llama.cpp's known"),
    (lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True), "add_prefix_space"),
    (lambda s: s["model"].update(ignore_merges=False), "ignore_merges=False with the llama-bpe split"),
    (lambda s: s.update(normalizer={"type": "Lowercase"}), "normalizer"),
    (lambda s: s["added_tokens"][2].update(lstrip=True), "lstrip"),
    (lambda s: s["model"].update(dropout=0.1), "dropout"),
])
def test_byte_level_bpe_that_llama_cpp_cannot_reproduce_is_refused(edit, match):
    with pytest.raises(UnsupportedTokenizer, match=match):
        vocab_plan(_edited(TOKENIZERS["llama3"](), edit))


def test_qwen2_split_and_gpt2_byte_level_are_told_apart():
    qwen_as_llama = _edited(TOKENIZERS["qwen2"](), lambda s: _split_regex(s, LLAMA3_SPLIT))
    with pytest.raises(UnsupportedTokenizer, match="ignore_merges=False with the llama-bpe"):
        vocab_plan(qwen_as_llama)  # the Llama 3 split, but merges applied as Qwen does: no llama.cpp equivalent
    assert vocab_plan(_edited(TOKENIZERS["llama3"](), lambda s: (_split_regex(s, QWEN2_SPLIT),
                                                                 s["model"].update(ignore_merges=False)))).pre == "qwen2"


def _as_read_by_transformers_5_17(state):
    """A byte-level BPE as transformers 5.17 builds it from a GGUF's gpt2 vocabulary (SmolLM2's): byte fallback
    on, an empty normalizer Sequence, ByteFallback/Fuse/▁ decoders before the byte-level one."""
    state["model"]["byte_fallback"] = True
    state["normalizer"] = {"type": "Sequence", "normalizers": []}
    state["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}


def test_a_byte_level_bpe_with_inert_byte_fallback_is_written_as_byte_level():
    """Its fallback cannot act (no <0xNN> token in the vocabulary: an unknown character becomes the unknown token
    either way), so it tokenizes as the byte-level BPE and gets the same llama.cpp plan; with byte tokens in the
    vocabulary it is a byte-fallback BPE and is judged as one."""
    original = TOKENIZERS["gpt2"]()
    read = _edited(original, _as_read_by_transformers_5_17)
    for text in FIXED_STRINGS + random_strings(40, seed=5) + ["\x04\x06 control bytes \U00050000"]:
        assert read(text)["input_ids"] == original(text)["input_ids"], text
    want, got = vocab_plan(original), vocab_plan(read)
    assert (got.kind, got.model, got.pre, got.add_bos) == (want.kind, want.model, want.pre, want.add_bos)
    assert got.kind == "byte_level_bpe"

    def with_a_byte_token(state):
        _as_read_by_transformers_5_17(state)
        state["model"]["vocab"]["<0x41>"] = len(state["model"]["vocab"])
    with pytest.raises(UnsupportedTokenizer, match="byte fallback without all 256 byte tokens"):
        vocab_plan(_edited(original, with_a_byte_token))


def test_byte_fallback_bpe_that_llama_cpp_cannot_reproduce_is_refused():
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    from export_tokenizers import CORPUS

    # merges as a BPE trainer makes them (not derived from a SentencePiece model): llama.cpp would merge pairs
    # whose concatenation is a token even where Hugging Face has no such merge
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    backend.train_from_iterator(CORPUS * 8, trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                                special_tokens=["<unk>", "<s>", "</s>"] + BYTE_TOKENS))
    trained = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    with pytest.raises(UnsupportedTokenizer, match="is not a merge"):
        vocab_plan(trained)
    tok = mistral_tokenizer()
    with pytest.raises(UnsupportedTokenizer, match="all 256 byte tokens"):
        vocab_plan(_edited(tok, lambda s: s["model"]["vocab"].pop("<0x7F>")))

    def metaspace_first(state):
        state["normalizer"] = None
        state["pre_tokenizer"] = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "first", "split": False}
    with pytest.raises(UnsupportedTokenizer, match="prepends ▁ to every text segment"):
        vocab_plan(_edited(tok, metaspace_first))


def test_other_tokenizer_models_are_refused():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    word_piece = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1},
                                                                                     unk_token="[UNK]")))
    with pytest.raises(UnsupportedTokenizer, match="WordPiece"):
        vocab_plan(word_piece)
    unigram = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0)))
    with pytest.raises(UnsupportedTokenizer, match="Unigram"):
        vocab_plan(unigram)


def test_export_refuses_an_inexact_tokenizer_before_writing_anything(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from longrl.training.checkpoint import save_checkpoint
    from longrl.config.schema import Config
    from longrl.export import ExportError, export_checkpoint

    tok = _edited(TOKENIZERS["llama3"](), lambda s: _split_regex(s, r"\w+|\s+|."))
    tok.chat_template = TOKENIZERS["llama3"]().chat_template
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      vocab_size=len(tok), max_position_embeddings=32)
    model = AutoModelForCausalLM.from_config(cfg)
    base = tmp_path / "base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    run_cfg = Config()
    run_cfg.model.name_or_path, run_cfg.model.dtype, run_cfg.lora.enabled = str(base), "float32", False
    opt = __import__("torch").optim.SGD(model.parameters(), lr=0.1)
    sched = __import__("torch").optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    ckpt = save_checkpoint(tmp_path / "run", 1, model, opt, sched,
                           {"data_position": 0, "config": run_cfg.to_dict(), "model_dtype": "float32"})
    with pytest.raises(ExportError, match=r"cannot tokenize exactly.*refusing rather than guessing"):
        export_checkpoint(ckpt, tmp_path / "out", fmt="gguf")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


# --- llama.cpp's own vocabularies --------------------------------------------------------------------------------

VOCABS = ("gpt-2", "llama-bpe", "qwen2", "llama-spm")


def vocab_dir() -> Path | None:
    """Where llama.cpp's ``ggml-vocab-*.gguf`` (+ ``.inp``/``.out``) are: $LONGRL_LLAMA_CPP_VOCABS (``.ci/run``
    extracts them from llama-cpp-python's source distribution), else none."""
    path = os.environ.get("LONGRL_LLAMA_CPP_VOCABS")
    return Path(path) if path and (Path(path) / "ggml-vocab-gpt-2.gguf").is_file() else None


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_metadata(path) -> dict:
    """The key-value metadata of a GGUF file (v2/v3 little-endian), read directly: ``gguf.GGUFReader`` builds an
    object per array element and takes ~15 s of CPU on a 128K-token vocabulary."""
    import struct

    import numpy as np

    data = Path(path).read_bytes()
    assert data[:4] == b"GGUF" and struct.unpack_from("<I", data, 4)[0] in (2, 3)
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    pos = 24

    def string():
        nonlocal pos
        n = struct.unpack_from("<Q", data, pos)[0]
        pos += 8 + n
        return data[pos - n:pos].decode("utf-8")

    def value(vtype):
        nonlocal pos
        if vtype == 8:
            return string()
        if vtype == 9:
            etype, n = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype])
                out = np.frombuffer(data, dtype, n, pos).tolist()
                pos += n * dtype.itemsize
                return out
            return [value(etype) for _ in range(n)]
        (out,) = struct.unpack_from(_SCALARS[vtype], data, pos)
        pos += struct.calcsize(_SCALARS[vtype])
        return out

    fields = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        fields[key] = value(vtype)
    return fields


def _reference(name):
    d = vocab_dir()
    fields = read_gguf_metadata(d / f"ggml-vocab-{name}.gguf")
    inputs = (d / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    outputs = [[int(t) for t in line.split()] for line in
               (d / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")[:len(inputs)]]
    return d / f"ggml-vocab-{name}.gguf", fields, inputs, outputs


def _hf_tokenizer(name, fields):
    """The Hugging Face tokenizer of that vocabulary, rebuilt from the GGUF in the model's own tokenizer.json form
    (checked against the reference tokenizations below)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    specials = [t for t, ty in zip(tokens, types) if ty == gguf.TokenType.CONTROL]
    if name == "llama-spm":
        scores = fields["tokenizer.ggml.scores"]
        by_score = {t: rank for rank, t in enumerate(sorted(vocab, key=lambda t: (-scores[vocab[t]], vocab[t])))}
        merges = spm_merges(by_score)
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                       fuse_unk=True))
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
    else:
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=name == "llama-bpe"))
        if name == "gpt-2":
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT if name == "llama-bpe" else QWEN2_SPLIT), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if name == "qwen2":
            backend.normalizer = normalizers.NFC()
        backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    ids = {k: fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown")}
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=tokens[ids["bos"]] if ids["bos"] is not None
                                   else None, eos_token=tokens[ids["eos"]] if ids["eos"] is not None else None,
                                   unk_token=tokens[ids["unknown"]] if ids["unknown"] is not None else None)


def _write_vocab_only(path, fields, tokenizer):
    """A vocabulary-only GGUF: the reference file's model keys, the tokenizer as longrl writes it."""
    from longrl.export.gguf_vocab import add_tokenizer

    arch = fields["general.architecture"]
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        if key.startswith(f"{arch}.") and not isinstance(value, list):
            vtype = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
            writer.add_key_value(key, value, vtype)
    plan = add_tokenizer(writer, tokenizer, len(fields["tokenizer.ggml.tokens"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return plan


def test_fast_metadata_reader_agrees_with_gguf_reader(tmp_path):
    from longrl.export.gguf_vocab import add_tokenizer

    path = tmp_path / "v.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_rope_freq_base(10000.0)
    add_tokenizer(writer, mistral_tokenizer(), 620)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    ours = read_gguf_metadata(path)
    theirs = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    assert ours.keys() == theirs.keys() and all(ours[k] == theirs[k] for k in ours)
    assert len(ours["tokenizer.ggml.tokens"]) == 620 and ours["tokenizer.ggml.add_space_prefix"] is True


@pytest.mark.parametrize("name", VOCABS)
def test_full_size_vocabulary_tokenizes_in_llama_cpp_as_hugging_face(name, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    if vocab_dir() is None:
        pytest.skip("llama.cpp's vocabulary files: set LONGRL_LLAMA_CPP_VOCABS (.ci/run does)")
    ref_path, fields, inputs, outputs = _reference(name)
    hf = _hf_tokenizer(name, fields)
    # the rebuilt tokenizer is the model's: it reproduces the reference tokenizations Hugging Face made
    rebuilt = [hf(text, add_special_tokens=False)["input_ids"] for text in inputs]
    assert rebuilt == outputs
    path = tmp_path / "vocab.gguf"
    plan = _write_vocab_only(path, fields, hf)
    assert plan.pre == {"gpt-2": "gpt-2", "llama-bpe": "llama-bpe", "qwen2": "qwen2", "llama-spm": None}[name]
    ours = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    theirs = llama_cpp.Llama(model_path=str(ref_path), vocab_only=True, verbose=False)
    strings = inputs + FIXED_STRINGS + random_strings(400, seed=7)
    differ, llama_cpp_own = [], 0
    for text in strings:
        want = hf(text, add_special_tokens=False)["input_ids"]
        got = ours.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if got != want:
            differ.append((text, want, got))
        # llama.cpp's own converted file, for comparison (it fails some strings llama.cpp cannot split alike)
        llama_cpp_own += theirs.tokenize(text.encode("utf-8"), add_bos=False, special=True) != want
    assert not differ, f"{len(differ)}/{len(strings)} differ (llama.cpp's own GGUF: {llama_cpp_own}): {differ[:3]}"
