"""Exported GGUFs in llama.cpp itself (llama-cpp-python, built from its source distribution; CI installs it with
the ``gguf-runtime`` extra): every architecture and tokenizer kind loads; token ids equal Hugging Face's on fixed
and random strings and on the Modelfile's rendering of chats; logits equal the merged float32 model within f16
rounding (q8_0 within its quantization), and the greedy continuation is the same."""

import numpy as np
import pytest
import torch

from export_tokenizers import FIXED_STRINGS, TOKENIZERS, random_strings
from longrl.export.gguf_vocab import vocab_plan
from longrl.export.gguf_writer import write_gguf
from longrl.export.go_template import render
from longrl.export.modelfile import PROBES, chat_parts, go_template, ollama_data
from longrl.models import build_char_tokenizer, build_tiny_model

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1)
# (architecture, tokenizer style): every architecture, every tokenizer kind
CASES = [("llama", "llama3"), ("llama", "gpt2"), ("mistral", "mistral"), ("qwen2", "qwen2"), ("qwen3", "qwen2"),
         ("llama", "builtin")]


ARITHMETIC_CHATS = [[{"role": "user", "content": "3+4="}],
                    [{"role": "user", "content": "12*3="}, {"role": "assistant", "content": "36"},
                     {"role": "user", "content": "7-9 = ?"}]]


def _model(arch: str, tok):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if arch == "llama" and len(tok) == 20:  # the builtin demo model
        return build_tiny_model(seed=5)[0].eval()
    cfg = {"llama": lambda: LlamaConfig(**SMALL),
           "mistral": lambda: MistralConfig(**SMALL, sliding_window=None),
           "qwen2": lambda: Qwen2Config(**SMALL, tie_word_embeddings=True),  # q/k/v biases, tied head
           "qwen3": lambda: Qwen3Config(**SMALL, head_dim=32)}[arch]()  # q/k norms, head size != hidden/heads
    cfg.vocab_size = len(tok) + 3  # padded embedding rows, as hub models have
    cfg.bos_token_id, cfg.eos_token_id = tok.bos_token_id, tok.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # biases are zero at init: make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    return model


def _q8_0_round_trip(model):
    """A copy of ``model`` whose matrices went through q8_0 and back (what the q8_0 GGUF holds; norms and other
    vectors stay float32, as the writer keeps them)."""
    import copy

    import gguf

    model = copy.deepcopy(model)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2 and p.shape[1] % 32 == 0:
                q = gguf.quants.quantize(p.numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)))
    return model


def _tokenizer(style):
    return build_char_tokenizer() if style == "builtin" else TOKENIZERS[style]()


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{t}" for a, t in CASES])
def exported(request, tmp_path_factory):
    arch, style = request.param
    tok = _tokenizer(style)
    model = _model(arch, tok)
    out = tmp_path_factory.mktemp(f"{arch}-{style}")
    files = {}
    for quant in ("f16", "q8_0"):
        files[quant] = out / f"model-{quant}.gguf"
        write_gguf(files[quant], model, tok, quant)
    return arch, style, tok, model, files


def _llama(path, **kwargs):
    return llama_cpp.Llama(model_path=str(path), verbose=False, n_threads=1, n_threads_batch=1, **kwargs)


def _chat_prompts(tok, plan, probes=PROBES):
    """(llama.cpp input text, HF ids): each probe chat rendered by the Modelfile's template and by the chat template."""
    if not isinstance(tok.chat_template, str):
        return []
    template = go_template(chat_parts(tok, plan.add_bos))
    out = []
    for messages in probes:
        try:
            want = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that refuses system turns
            continue
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        out.append((render(template, ollama_data(messages)), want))
    return out


def test_llama_cpp_tokenizes_exactly_as_hugging_face(exported):
    arch, style, tok, _, files = exported
    plan = vocab_plan(tok)
    vocab = _llama(files["f16"], vocab_only=True)
    strings = FIXED_STRINGS + random_strings(300, seed=len(style))
    if style == "builtin":  # its vocabulary: digits, + - * = ? and space (outside it llama.cpp drops characters)
        alphabet = "0123456789+-*= ?"
        rng = np.random.default_rng(0)
        strings = ["".join(rng.choice(list(alphabet), size=rng.integers(1, 40))) for _ in range(300)] + ["3+4=", " "]
    else:
        strings += [s + tok.eos_token + s for s in strings[:20]]  # special tokens inside text
    mismatches = []
    for text in strings:
        want = tok(text)["input_ids"]  # with the BOS/EOS the tokenizer adds
        got = vocab.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        if got != want:
            mismatches.append((text, want, got))
    assert not mismatches, f"{len(mismatches)}/{len(strings)} differ, e.g. {mismatches[:3]}"
    chats = _chat_prompts(tok, plan, ARITHMETIC_CHATS if style == "builtin" else PROBES)
    assert chats or not tok.chat_template
    for text, want in chats:  # the prompt Ollama builds from the Modelfile, tokenized by llama.cpp
        assert vocab.tokenize(text.encode("utf-8"), add_bos=True, special=True) == want, text
    # decoding back: llama.cpp's pieces spell the text Hugging Face decodes
    for text in strings[:50]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        got, want = vocab.detokenize(ids).decode("utf-8", errors="replace"), tok.decode(ids)
        # a whole ▁-escaped sequence decodes with its prefix space in llama.cpp; Hugging Face strips it
        assert got == want or (plan.add_space_prefix and got == " " + want), text


def test_out_of_vocabulary_characters_of_the_builtin_tokenizer_are_the_known_difference(tmp_path):
    """The one documented inexactness: HF maps a character outside the builtin alphabet to <unk>, llama.cpp drops it."""
    tok = build_char_tokenizer()
    path = tmp_path / "m.gguf"
    write_gguf(path, build_tiny_model(seed=1)[0], tok)
    vocab = _llama(path, vocab_only=True)
    assert tok("3x4")["input_ids"] == [tok.convert_tokens_to_ids(c) for c in ("3", "<unk>", "4")]
    assert vocab.tokenize(b"3x4", add_bos=True, special=True) == [tok.convert_tokens_to_ids(c) for c in "34"]


def _logits_hf(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].double().numpy()


def _logits_llama(path, ids, n_vocab):
    llm = _llama(path, n_ctx=128, n_batch=128, logits_all=True)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids), :n_vocab], dtype=np.float64), llm


def test_llama_cpp_logits_and_greedy_continuation_match_the_merged_model(exported):
    arch, style, tok, model, files = exported
    text = "What is 6 plus 7?" if style != "builtin" else "3+4=7 12*2="
    ids = tok(text)["input_ids"]
    want = _logits_hf(model, ids)
    scale = np.abs(want).max()
    got, llm = _logits_llama(files["f16"], ids, want.shape[1])
    err_f16 = np.abs(got - want).max()
    assert err_f16 < 2e-3 * max(scale, 1.0), (err_f16, scale)
    # q8_0: within a few times what rounding the weights to q8_0 alone does to the logits (llama.cpp also rounds
    # the activations to 8 bits in its q8_0 products)
    got_q8, _ = _logits_llama(files["q8_0"], ids, want.shape[1])
    err_q8 = np.abs(got_q8 - want).max()
    weight_rounding = np.abs(_logits_hf(_q8_0_round_trip(model), ids) - want).max()
    assert err_q8 < 4 * weight_rounding + 2e-3 * max(scale, 1.0), (err_q8, weight_rounding, scale)
    # greedy continuation: 8 tokens, llama.cpp argmax vs Hugging Face generate
    with torch.no_grad():
        prompt = torch.tensor([ids])
        hf = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    cont, n_vocab = [], want.shape[1]
    for _ in range(8):
        nxt = int(np.argmax(np.asarray(llm.scores[llm.n_tokens - 1, :n_vocab])))
        cont.append(nxt)
        llm.eval([nxt])
    assert cont == hf


def test_text_not_in_nfc_is_the_known_difference_of_nfc_tokenizers(tmp_path):
    """Documented: Qwen-style tokenizers NFC-normalize, llama.cpp does not; NFC text is identical."""
    tok = _tokenizer("qwen2")
    path = tmp_path / "m.gguf"
    write_gguf(path, _model("qwen2", tok), tok)
    vocab = _llama(path, vocab_only=True)
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    assert tok(decomposed)["input_ids"] == tok(composed)["input_ids"]
    assert vocab.tokenize(composed.encode(), add_bos=True, special=True) == tok(composed)["input_ids"]
    assert vocab.tokenize(decomposed.encode(), add_bos=True, special=True) != tok(decomposed)["input_ids"]
