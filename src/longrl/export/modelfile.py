"""An Ollama ``Modelfile`` for an exported GGUF: ``FROM``, a Go ``TEMPLATE`` derived from the tokenizer's Jinja
chat template, ``PARAMETER stop`` lines and the sampling defaults of the model's generation config.

Ollama templates are Go templates, so the Jinja template cannot be copied: it is rendered with marker contents
for a system turn, a user turn, an assistant turn and the generation prompt, and the text around the markers
becomes the literal parts of the Go template. The template uses no ``{{-``/``-}}`` trim markers, so the
literal parts reach the prompt exactly. :func:`check_template` renders it with Go semantics (``go_template``)
the way Ollama feeds a chat (``.System`` = the system messages joined by a blank line, ``.Messages`` = the
turns) and compares it with ``apply_chat_template`` on probe conversations; an export whose template would
differ is refused.
"""

from __future__ import annotations

from .go_template import render

_SYS, _USER, _USER2, _ASSISTANT = "\x01SYSTEM\x01", "\x01USER\x01", "\x01USER2\x01", "\x01ASSISTANT\x01"


class TemplateMismatch(ValueError):
    """The chat template cannot be expressed as the Modelfile's Go template; the message names the conversation."""


def _render(tokenizer, messages, generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def _strip_bos(text: str, bos: str | None, add_bos: bool) -> str:
    return text[len(bos):] if add_bos and bos and text.startswith(bos) else text


def chat_parts(tokenizer, add_bos: bool = False) -> dict | None:
    """Literal pieces of the chat format (head, system, user, assistant prefixes/suffixes, generation prompt),
    or None when the tokenizer has no chat template or it does not render plain turns. ``add_bos``: the runtime
    adds the BOS token itself, so a leading BOS of the rendering is not part of the template."""
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        return None
    u, a, u2 = ({"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT},
                {"role": "user", "content": _USER2})
    try:
        one = _render(tokenizer, [u], False)
        gen = _render(tokenizer, [u], True)
        two = _render(tokenizer, [u, a], False)
        three = _render(tokenizer, [u, a, u2], False)
    except Exception:  # noqa: BLE001 - any template error means: no derived template
        return None
    if not (gen.startswith(one) and two.startswith(one) and three.startswith(two) and _USER2 in three):
        return None
    user_pre, user_post = three[len(two):].split(_USER2)
    head = one.split(_USER)[0]
    if not head.endswith(user_pre):
        return None
    bos = getattr(tokenizer, "bos_token", None)
    head = _strip_bos(head[:len(head) - len(user_pre)], bos, add_bos)
    if not two[len(one):].count(_ASSISTANT) == 1:
        return None
    assistant_pre, assistant_post = two[len(one):].split(_ASSISTANT)
    parts = dict(head=head, user_pre=user_pre, user_post=one.split(_USER)[1], generation=gen[len(one):],
                 assistant_pre=assistant_pre, assistant_post=assistant_post, system_pre=None, system_post="",
                 system_fold=None, fold_pre="", fold_sep="")
    try:
        with_system = _strip_bos(_render(tokenizer, [{"role": "system", "content": _SYS}, u], False), bos, add_bos)
        four = _strip_bos(_render(tokenizer, [{"role": "system", "content": _SYS}, u, a, u2], False), bos, add_bos)
    except Exception:  # noqa: BLE001 - the template refuses system turns
        return parts
    user_turn = user_pre + _USER + parts["user_post"]
    if _SYS in with_system and with_system.endswith(user_turn):  # a turn of its own
        parts["system_pre"], parts["system_post"] = with_system[:len(with_system) - len(user_turn)].split(_SYS)
    elif with_system.startswith(head) and with_system.endswith(_USER + parts["user_post"]) and _SYS in with_system:
        # folded into a user turn (Mistral): head, then the user prefix, system text, separator, user text
        fold_pre, fold_sep = with_system[len(head):len(with_system) - len(_USER + parts["user_post"])].split(_SYS)
        folded = fold_pre + _SYS + fold_sep
        middle = assistant_pre + _ASSISTANT + assistant_post
        if four == head + folded + _USER + parts["user_post"] + middle + user_pre + _USER2 + parts["user_post"]:
            parts.update(system_fold="first", fold_pre=fold_pre, fold_sep=fold_sep)
        elif four == head + user_turn + middle + folded + _USER2 + parts["user_post"]:
            parts.update(system_fold="last", fold_pre=fold_pre, fold_sep=fold_sep)
    return parts


def _go_literal(text: str) -> str:
    return text.replace("{{", '{{ "{{" }}')


def go_template(parts: dict | None) -> str:
    """An Ollama (Go) template over ``.Messages`` for the pieces from :func:`chat_parts` (no trim markers:
    every literal reaches the prompt as written)."""
    if parts is None:
        return "{{ .Prompt }}"
    lit = {k: _go_literal(v) if isinstance(v, str) else v for k, v in parts.items()}
    if parts["system_pre"] is not None:
        start = (f'{{{{ if .System }}}}{lit["system_pre"]}{{{{ .System }}}}{lit["system_post"]}'
                 f'{{{{ else }}}}{lit["head"]}{{{{ end }}}}')
    else:
        start = lit["head"] + ("{{ $sys := .System }}" if parts["system_fold"] == "first" else "")
    fold = {  # the user prefix: with the system text folded in (once), or plain
        "first": f'{{{{ if $sys }}}}{lit["fold_pre"]}{{{{ $sys }}}}{lit["fold_sep"]}{{{{ $sys = "" }}}}'
                 f'{{{{ else }}}}{lit["user_pre"]}{{{{ end }}}}',
        "last": f'{{{{ if and $.System $last }}}}{lit["fold_pre"]}{{{{ $.System }}}}{lit["fold_sep"]}'
                f'{{{{ else }}}}{lit["user_pre"]}{{{{ end }}}}',
    }.get(parts["system_fold"], lit["user_pre"])
    return (
        start
        + "{{ range $i, $_ := .Messages }}"
        + "{{ $last := eq (len (slice $.Messages $i)) 1 }}"
        + f'{{{{ if eq .Role "user" }}}}{fold}{{{{ .Content }}}}{lit["user_post"]}'
        + f'{{{{ if $last }}}}{lit["generation"]}{{{{ end }}}}'
        + f'{{{{ else if eq .Role "assistant" }}}}{lit["assistant_pre"]}{{{{ .Content }}}}'
        + f'{{{{ if not $last }}}}{lit["assistant_post"]}{{{{ end }}}}'
        + "{{ end }}{{ end }}"
    )


def ollama_data(messages: list[dict]) -> dict:
    """What Ollama's template sees for a chat: ``.System`` (system messages joined by a blank line) and
    ``.Messages`` (consecutive messages of one role joined by a blank line, system messages included)."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    collated: list[dict] = []
    for m in messages:
        if collated and collated[-1]["Role"] == m["role"]:
            collated[-1]["Content"] += "\n\n" + m["content"]
        else:
            collated.append({"Role": m["role"], "Content": m["content"]})
    return {"System": system, "Messages": collated, "Tools": None, "Response": "", "Think": False,
            "IsThinkSet": False}


PROBES = [  # conversations ending in a user turn, as a chat request to Ollama has them
    [{"role": "user", "content": "What is 6 plus 7?"}],
    [{"role": "user", "content": "What is 6 plus 7?"}, {"role": "assistant", "content": "13"},
     {"role": "user", "content": "And 2*3?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!\nHow can I help?"},
     {"role": "user", "content": "Count: 1 2 3"}, {"role": "assistant", "content": "4 5 6"},
     {"role": "user", "content": "Thanks."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 6 plus 7?"}],
    [{"role": "system", "content": "Answer in digits.\nNo words."}, {"role": "user", "content": "6+7="},
     {"role": "assistant", "content": "13"}, {"role": "user", "content": "2*3="}],
]


def check_template(tokenizer, template: str, add_bos: bool, probes=PROBES) -> None:
    """Raise TemplateMismatch unless ``template`` rendered as Ollama does equals ``apply_chat_template`` (with
    the generation prompt; a leading BOS there is the one llama.cpp adds when ``add_bos``) on every probe."""
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        return
    bos = getattr(tokenizer, "bos_token", None)
    for messages in probes:
        try:
            want = _render(tokenizer, messages, True)
        except Exception:  # noqa: BLE001 - a template that refuses this conversation (e.g. system turns)
            continue
        if add_bos and bos and not want.startswith(bos):
            raise TemplateMismatch(f"the tokenizer adds {bos} to every prompt but the chat template does not "
                                   "start with it; llama.cpp would feed the model an extra BOS")
        want = _strip_bos(want, bos, add_bos)
        got = render(template, ollama_data(messages))
        if got != want:
            at = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            raise TemplateMismatch(
                f"the chat template cannot be written as an Ollama template: for {[m['role'] for m in messages]} "
                f"the derived template renders {got[max(0, at - 20):at + 20]!r} where the chat template renders "
                f"{want[max(0, at - 20):at + 20]!r} (character {at})")


def stop_strings(tokenizer, parts: dict | None, eos_ids=()) -> list[str]:
    """Stop sequences: the EOS token(s) and the text that ends an assistant turn."""
    stops = []
    for tid in [tokenizer.eos_token_id, *eos_ids]:
        if tid is not None:
            text = tokenizer.convert_ids_to_tokens(int(tid))
            if text and text not in stops:
                stops.append(text)
    end = (parts or {}).get("assistant_post", "").strip()
    if end and end not in stops:
        stops.append(end)
    return stops


def sampling_parameters(generation_config) -> list[tuple[str, float]]:
    """Ollama PARAMETERs from a transformers GenerationConfig: temperature, top_p, top_k and repeat_penalty as
    the model's authors set them; temperature 0 (greedy) when it does not sample."""
    if generation_config is None:
        return []
    if not getattr(generation_config, "do_sample", False):
        return [("temperature", 0)]
    params = []
    for hf_name, name, default in (("temperature", "temperature", 1.0), ("top_p", "top_p", 1.0),
                                   ("top_k", "top_k", 50), ("repetition_penalty", "repeat_penalty", 1.0)):
        value = getattr(generation_config, hf_name, None)
        if value is not None:
            params.append((name, value))
    return params


def modelfile_text(tokenizer, gguf_name: str = "model.gguf", eos_ids=(), add_bos: bool = False,
                   generation_config=None) -> str:
    """The Modelfile; raises TemplateMismatch when the chat template cannot be rendered exactly."""
    parts = chat_parts(tokenizer, add_bos)
    if parts is None and isinstance(getattr(tokenizer, "chat_template", None), str):
        raise TemplateMismatch("the chat template does not render plain user/assistant turns as fixed text around "
                               "the messages, so it has no Ollama (Go) equivalent here")
    template = go_template(parts)
    check_template(tokenizer, template, add_bos)
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""']
    lines += [f"PARAMETER stop {_quote(s)}" for s in stop_strings(tokenizer, parts, eos_ids)]
    lines += [f"PARAMETER {name} {value}" for name, value in sampling_parameters(generation_config)]
    return "\n".join(lines) + "\n"


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
