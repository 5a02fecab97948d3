"""The Ollama Modelfile renders a chat exactly as the Hugging Face chat template does: its Go template, executed
with Go's text/template semantics (longrl's renderer, itself checked against Go's own text/template when a Go
toolchain is installed) the way Ollama feeds a chat, equals ``apply_chat_template`` with the generation prompt,
for ChatML (Qwen), Llama 3, Mistral (system folded into the first or last user turn) and the builtin template."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from export_tokenizers import MISTRAL, TOKENIZERS
from longrl.export.go_template import GoTemplateError, render
from longrl.export.gguf_vocab import vocab_plan
from longrl.export.modelfile import (PROBES, TemplateMismatch, check_template, chat_parts, go_template, modelfile_text,
                                     ollama_data, sampling_parameters, stop_strings)
from longrl.models import build_char_tokenizer

GO_RENDER = Path(__file__).parent / "go_render"
# beyond the export's own probes: longer, unusual characters (not: two system messages in a row, which Ollama
# joins with a blank line before any template sees them)
CONVERSATIONS = PROBES + [
    [{"role": "user", "content": "{{ .System }} is literal"}, {"role": "assistant", "content": "\"quoted\" {{"},
     {"role": "user", "content": "émoji 🚀\n\nend"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 3 + [{"role": "user", "content": "c"}],
]


def _tokenizer(name):
    if name == "builtin":
        return build_char_tokenizer()
    if name == "mistral-last":  # Mistral v0.3 style: the system text goes into the last user turn
        tok = TOKENIZERS["mistral"]()
        tok.chat_template = MISTRAL.replace("loop.first and system", "loop.last and system")
        return tok
    return TOKENIZERS[name]()


def _hf_prompt(tok, messages, add_bos):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text[len(tok.bos_token):] if add_bos and tok.bos_token and text.startswith(tok.bos_token) else text


def _system_in_template(tok) -> bool:
    try:
        tok.apply_chat_template([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}], tokenize=False)
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.parametrize("name", ["qwen2", "llama3", "mistral", "mistral-last", "gpt2", "builtin"])
def test_modelfile_template_renders_like_the_chat_template(name):
    tok = _tokenizer(name)
    add_bos = vocab_plan(tok).add_bos
    text = modelfile_text(tok, add_bos=add_bos)
    template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    assert "{{-" not in template and "-}}" not in template
    checked = 0
    for messages in CONVERSATIONS:
        if any(m["role"] == "system" for m in messages) and not _system_in_template(tok):
            continue
        assert render(template, ollama_data(messages)) == _hf_prompt(tok, messages, add_bos), messages
        checked += 1
    assert checked >= 6


def test_system_turns_and_generation_prompt_are_in_the_rendering():
    """The pieces the old template lost to ``{{-``: ChatML's newlines between turns and after the assistant
    header, Llama 3's blank line after its headers, Mistral's blank line after the system text."""
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    qwen = render(go_template(chat_parts(TOKENIZERS["qwen2"]())), ollama_data(chat))
    assert qwen == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    llama = render(go_template(chat_parts(TOKENIZERS["llama3"](), add_bos=True)), ollama_data(chat))
    assert llama == ("<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user"
                     "<|end_header_id|>\n\nU<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    mistral = render(go_template(chat_parts(TOKENIZERS["mistral"](), add_bos=True)), ollama_data(chat))
    assert mistral == " [INST] S\n\nU [/INST]"


def test_go_trim_markers_remove_the_white_space_around_actions():
    data = {"X": "x", "Messages": [{"Role": "user", "Content": "c"}]}
    assert render("a \n\t{{- .X }}", data) == "ax"
    assert render("{{ .X -}} \n b", data) == "xb"
    old = '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{- end }}'
    assert render(old, data) == "<|im_start|>user\nc<|im_end|>"  # the newline the old Modelfile lost


def test_template_that_cannot_be_a_go_template_is_refused():
    tok = TOKENIZERS["qwen2"]()
    # the assistant turn's rendering depends on its position (as Qwen 3's thinking blocks do)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and "
                         "loop.index0 == 1 %}<think></think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateMismatch, match="cannot be written as an Ollama template"):
        check_template(tok, go_template(chat_parts(tok)), add_bos=False)
    tok.chat_template = "{{ messages | length }}"
    with pytest.raises(TemplateMismatch, match="fixed text"):
        modelfile_text(tok)


def test_template_without_the_bos_the_runtime_adds_is_refused():
    tok = TOKENIZERS["llama3"]()
    tok.chat_template = tok.chat_template.replace("bos_token + ", "")
    with pytest.raises(TemplateMismatch, match="extra BOS"):
        modelfile_text(tok, add_bos=True)


def test_stops_and_sampling_parameters():
    from transformers import GenerationConfig

    tok = TOKENIZERS["llama3"]()
    parts = chat_parts(tok, add_bos=True)
    assert stop_strings(tok, parts, [tok.convert_tokens_to_ids("<|end_of_text|>")]) == ["<|eot_id|>", "<|end_of_text|>"]
    assert stop_strings(TOKENIZERS["qwen2"](), chat_parts(TOKENIZERS["qwen2"]())) == ["<|im_end|>"]
    assert sampling_parameters(GenerationConfig()) == [("temperature", 0)]
    sampled = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    assert sampling_parameters(sampled) == [("temperature", 0.7), ("top_p", 0.8), ("top_k", 20),
                                            ("repeat_penalty", 1.05)]
    text = modelfile_text(tok, add_bos=True, generation_config=sampled)
    assert "PARAMETER temperature 0.7\n" in text and 'PARAMETER stop "<|eot_id|>"\n' in text


def test_unsupported_go_constructs_are_refused_not_guessed():
    for template in ("{{ with .X }}{{ end }}", "{{ .X | printf }}", "{{ range .M }}{{ else }}{{ end }}",
                     "{{ if .X }}", "{{ template \"x\" }}", "{{ upper .X }}"):
        with pytest.raises(GoTemplateError):
            render(template, {"X": "x", "M": []})


GO_CASES = [  # templates beyond the derived ones: trim markers, else-if chains, variables, functions
    '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{- end }}',
    "a \n {{- .System -}} \n b{{ if .System }}[{{ .System }}]{{ else if .Messages }}m{{ else }}-{{ end }}",
    '{{ $n := 0 }}{{ range $i, $m := .Messages }}{{ $n = $i }}{{ if or (eq $m.Role "system") (eq .Role "x") }}S'
    '{{ else if and (ne .Role "user") (not (eq $i 0)) }}A{{ $i }}{{ else }}U{{ end }}{{ end }}={{ $n }}',
    '{{ range .Messages }}{{ $c := .Content }}{{ range $.Messages }}{{ if eq .Content $c }}*{{ end }}{{ end }}'
    '{{ end }}{{ len .Messages }}{{ index .Messages 0 "Role" }}{{ slice "abcdef" 1 3 }}',
    '{{ "{{" }} {{ "tab\\there" }} {{ `raw\\n` }} {{ .Missing }} {{ true }} {{ 12 }}',
    "x\r\n\t {{- /* comment */ -}} \r\n y",
]


@pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain: the renderer is checked against Go where one is")
def test_renderer_matches_go_text_template(tmp_path):
    """Python renderer == Go's text/template on the derived templates and the cases above, on every conversation."""
    templates = list(GO_CASES)
    for name in ["qwen2", "llama3", "mistral", "mistral-last", "gpt2", "builtin"]:
        tok = _tokenizer(name)
        templates.append(go_template(chat_parts(tok, vocab_plan(tok).add_bos)))
    cases = [{"template": t, "data": ollama_data(m)} for t in templates for m in CONVERSATIONS]
    env = {"GOFLAGS": "-mod=mod", "GOCACHE": str(tmp_path / "gocache"), "HOME": str(tmp_path),
           "PATH": "/usr/bin:/bin:/usr/local/bin:/usr/local/go/bin", "GOPATH": str(tmp_path / "gopath")}
    done = subprocess.run(["go", "run", "."], cwd=GO_RENDER, input=json.dumps(cases), capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert len(results) == len(cases)
    for case, result in zip(cases, results):
        assert not result.get("error"), (case["template"], result["error"])
        assert render(case["template"], case["data"]) == result["out"], case["template"]
