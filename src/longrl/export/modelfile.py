"""An Ollama ``Modelfile`` for an exported GGUF: ``FROM``, a Go ``TEMPLATE`` derived from the tokenizer's Jinja
chat template, and ``PARAMETER stop`` lines.

Ollama templates are Go templates, so the Jinja template cannot be copied: it is rendered with marker
contents for a system turn, a user turn, an assistant turn and the generation prompt, and the text around the
markers becomes the literal parts of the Go template.
"""

from __future__ import annotations

_SYS, _USER, _USER2, _ASSISTANT = "\x01SYSTEM\x01", "\x01USER\x01", "\x01USER2\x01", "\x01ASSISTANT\x01"


def _render(tokenizer, messages, generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def chat_parts(tokenizer) -> dict | None:
    """Literal pieces of the chat format (head, system, user, assistant prefixes/suffixes, generation prompt),
    or None when the tokenizer has no chat template or it does not render plain turns."""
    if not getattr(tokenizer, "chat_template", None):
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
    head = head[:len(head) - len(user_pre)]
    bos = getattr(tokenizer, "bos_token", None)
    if bos and head.startswith(bos):  # the runtime adds BOS itself
        head = head[len(bos):]
    if not two[len(one):].count(_ASSISTANT) == 1:
        return None
    assistant_pre, assistant_post = two[len(one):].split(_ASSISTANT)
    parts = dict(head=head, user_pre=user_pre, user_post=one.split(_USER)[1], generation=gen[len(one):],
                 assistant_pre=assistant_pre, assistant_post=assistant_post, system_pre=None, system_post="")
    try:
        with_system = _render(tokenizer, [{"role": "system", "content": _SYS}, u], False)
    except Exception:  # noqa: BLE001 - the template refuses system turns
        return parts
    if _SYS in with_system and with_system.endswith(user_pre + _USER + parts["user_post"]):
        system_text = with_system[:len(with_system) - len(user_pre + _USER + parts["user_post"])]
        if bos and system_text.startswith(bos):
            system_text = system_text[len(bos):]
        parts["system_pre"], parts["system_post"] = system_text.split(_SYS)
    return parts


def _go_literal(text: str) -> str:
    return text.replace("{{", '{{ "{{" }}')


def go_template(parts: dict | None) -> str:
    """An Ollama (Go) template over ``.Messages`` for the pieces from :func:`chat_parts`."""
    if parts is None:
        return "{{ .Prompt }}"
    lit = {k: _go_literal(v) if isinstance(v, str) else v for k, v in parts.items()}
    system = (f'{{{{- if .System }}}}{lit["system_pre"]}{{{{ .System }}}}{lit["system_post"]}'
              f'{{{{- else }}}}{lit["head"]}{{{{- end }}}}' if parts["system_pre"] is not None else lit["head"])
    return (
        system
        + "{{- range $i, $_ := .Messages }}"
        + "{{- $last := eq (len (slice $.Messages $i)) 1 }}"
        + f'{{{{- if eq .Role "user" }}}}{lit["user_pre"]}{{{{ .Content }}}}{lit["user_post"]}'
        + f'{{{{- if $last }}}}{lit["generation"]}{{{{- end }}}}'
        + f'{{{{- else if eq .Role "assistant" }}}}{lit["assistant_pre"]}{{{{ .Content }}}}'
        + f'{{{{- if not $last }}}}{lit["assistant_post"]}{{{{- end }}}}'
        + "{{- end }}{{- end }}"
    )


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


def modelfile_text(tokenizer, gguf_name: str = "model.gguf", eos_ids=()) -> str:
    parts = chat_parts(tokenizer)
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{go_template(parts)}"""']
    lines += [f"PARAMETER stop {_quote(s)}" for s in stop_strings(tokenizer, parts, eos_ids)]
    return "\n".join(lines) + "\n"


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
