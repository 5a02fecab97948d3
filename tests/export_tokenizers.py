"""Tiny tokenizers built in code in the styles longrl meets (GPT-2, Llama 3 and Qwen 2 byte-level BPE, Llama 2 /
Mistral byte-fallback BPE), with their families' chat templates, and the strings the export tests tokenize."""

from __future__ import annotations

import random

from longrl.export.gguf_vocab import BYTE_TOKENS, LLAMA3_SPLIT, QWEN2_SPLIT, SPACE

CORPUS = [
    "the quick brown fox jumps over the lazy dog; 12 + 30 = 42", "What is 6 plus 7? It is 13.",
    "I've been told he's there, 'RE you sure? I'll make it.", "def f(x):\n    return x * 2  # double\n",
    "Ünïcödé façade, naïve café — ok…", "数学 123 456 7890", "emoji 🚀🦙 test!!", "  spaced   out\t\ttabs\n\nnew",
    "<think>reason</think> answer: 1,000.50 (approx)", "a\tb\r\nc", "3.3 3..3 3...3 ------=======",
]

CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a "
          "helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
MISTRAL = ("{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
           "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
           "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
           "{%- if loop.first and system_message is defined %}{{- ' [INST] ' + system_message + '\n\n' + "
           "message['content'] + ' [/INST]' }}{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}"
           "{%- endif %}{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token}}"
           "{%- endif %}{%- endfor %}")


def _train_byte_level(split_regex: str | None, specials: list[str], vocab_size: int = 600, nfc: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    if split_regex is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if nfc:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 8, trainer)
    return backend


def gpt2_tokenizer():
    from transformers import PreTrainedTokenizerFast

    backend = _train_byte_level(None, ["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    tok.chat_template = CHATML.replace("<|im_start|>", "<|endoftext|>").replace("<|im_end|>", "\n")
    return tok


def llama3_tokenizer():
    import json

    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    backend = _train_byte_level(LLAMA3_SPLIT, specials)
    state = json.loads(backend.to_str())
    state["model"]["ignore_merges"] = True  # as Llama 3's tokenizer.json has it
    backend = Tokenizer.from_str(json.dumps(state))
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", backend.token_to_id("<|begin_of_text|>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tok.chat_template = LLAMA3
    return tok


def qwen2_tokenizer():
    from transformers import PreTrainedTokenizerFast

    backend = _train_byte_level(QWEN2_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], nfc=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def spm_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges as Hugging Face derives them from a SentencePiece model: every split of a token into two tokens,
    in the order of the token's id (its SentencePiece score order), then of the parts' ids."""
    merges = []
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        merges += sorted(local, key=lambda p: (vocab[p[0]], vocab[p[1]]))
    return merges


def mistral_tokenizer(vocab_size: int = 700):
    """A Mistral-7B-style tokenizer: ▁-escaped BPE with byte fallback, merges derived SentencePiece's way."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    trainer_backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trainer_backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials + BYTE_TOKENS, show_progress=False)
    trainer_backend.train_from_iterator(CORPUS * 8, trainer)
    vocab = trainer_backend.get_vocab()
    backend = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(vocab), unk_token="<unk>", byte_fallback=True,
                                   fuse_unk=True))
    backend.normalizer = trainer_backend.normalizer
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(specials)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = MISTRAL
    return tok


TOKENIZERS = {"gpt2": gpt2_tokenizer, "llama3": llama3_tokenizer, "qwen2": qwen2_tokenizer,
              "mistral": mistral_tokenizer}

FIXED_STRINGS = [
    "What is 6 plus 7?", "Hello world", " leading space", "trailing space ", "  two  spaces  ", "\n", "\n\n\n",
    "a\n\nb", "\t tab\tmix \t", "12345678901234567890", "3.14159 and 1,000,000 and -42", "x=y+z*(a/b)-c",
    "I've been 'told' he's there, 'RE you sure? 'M not I'll D'", "don't WON'T it's", "!!!???...;;;",
    "Ünïcödé façade — naïve café…", "数学 123 我想在apple工作", "нещо на Български", "🚀 (normal) 😶‍🌫️ 🦙🦙",
    "<think>\nreason\n</think>\n\nanswer", "   \n  \n", "ÿþ ascii\x7f", "mixed\r\nline\rendings",
]


def random_strings(n: int, seed: int = 0) -> list[str]:
    """Random strings over letters, digits, punctuation, white space runs and non-ASCII characters."""
    rng = random.Random(seed)
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") + list(" \t\n'.,;:!?-+*/=()[]{}\"") \
        + [" ", "  ", "   ", "\n\n", "é", "ü", "ß", "数", "学", "🚀", "🦙", "—", "…", "'s", "'ll", "the", "ing", "The"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(n)]
