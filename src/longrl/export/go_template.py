"""A renderer for the subset of Go's ``text/template`` that Ollama Modelfile templates use, with Go's semantics:
``{{- `` trims all trailing white space (space, tab, CR, LF) from the text before the action, `` -}}`` all leading
white space from the text after it; ``if`` / ``else if`` / ``else`` / ``end``; ``range $i, $v := pipeline``
(and ``range pipeline``); ``$x := pipeline`` scoped to the enclosing block; ``.Field``, ``$.Field``, ``$x.Field``;
string and integer literals; parenthesised pipelines; the functions ``eq``, ``ne``, ``not``, ``and``, ``or``,
``len``, ``slice``, ``index``. Truth is Go's: false, 0, "", nil and empty collections are false.

It exists so the exported Modelfile can be checked against the Hugging Face chat template where Go is not
installed (CI); the tests check it against Go's own ``text/template`` where Go is available. Anything outside
the subset raises :class:`GoTemplateError` rather than being guessed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_SPACE = " \t\r\n"
_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<raw>`[^`]*`)|(?P<num>-?\d+)|(?P<op>:=|[(),=|])'
                    r'|(?P<var>\$[A-Za-z0-9_]*)|(?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)'
                    r'|(?P<ident>[A-Za-z_][A-Za-z0-9_]*))')


class GoTemplateError(ValueError):
    """The template uses something outside the supported subset, or is malformed."""


@dataclass
class _Node:
    kind: str  # text | action | if | range
    text: str = ""
    pipe: list = field(default_factory=list)  # tokens of the pipeline
    body: list = field(default_factory=list)
    branches: list = field(default_factory=list)  # if: [(pipe, body)], else body in `body`
    names: tuple = ()  # range / declaration variable names


def _lex(src: str) -> list[tuple[str, str]]:
    """[(kind, value)]: ("text", literal) and ("action", inner text), trim markers applied to the literals."""
    out: list[list[str]] = []
    pos = 0
    while True:
        start = src.find("{{", pos)
        if start < 0:
            out.append(["text", src[pos:]])
            break
        text = src[pos:start]
        inner_start = start + 2
        if src.startswith("-", inner_start) and inner_start + 1 < len(src) and src[inner_start + 1] in _SPACE:
            text = text.rstrip(_SPACE)
            inner_start += 2
        end = _action_end(src, inner_start)
        inner, close = src[inner_start:end], end + 2
        trim_right = len(inner) >= 2 and inner.endswith("-") and inner[-2] in _SPACE
        if trim_right:
            inner = inner[:-1]
        out.append(["text", text])
        out.append(["action", inner.strip(_SPACE)])
        pos = close
        if trim_right:
            while pos < len(src) and src[pos] in _SPACE:
                pos += 1
    return [(k, v) for k, v in out if k == "action" or v]


def _action_end(src: str, pos: int) -> int:
    """Index of the ``}}`` closing the action that starts at ``pos`` (string literals may hold braces)."""
    i = pos
    while i < len(src):
        c = src[i]
        if c == '"':
            i += 1
            while i < len(src) and src[i] != '"':
                i += 2 if src[i] == "\\" else 1
        elif c == "`":
            i = src.index("`", i + 1)
        elif src.startswith("}}", i):
            return i
        i += 1
    raise GoTemplateError("unclosed action")


def _tokens(action: str) -> list[tuple[str, str]]:
    toks, pos = [], 0
    while pos < len(action):
        if action[pos:].strip(_SPACE) == "":
            break
        m = _TOKEN.match(action, pos)
        if not m or m.end() == pos:
            raise GoTemplateError(f"cannot read action {{{{{action}}}}} at {action[pos:]!r}")
        kind = m.lastgroup
        toks.append((kind, m.group(kind)))
        pos = m.end()
    return toks


def parse(src: str) -> list[_Node]:
    items = _lex(src)
    pos = 0

    def block(stop: tuple[str, ...]):
        nonlocal pos
        nodes = []
        while pos < len(items):
            kind, value = items[pos]
            pos += 1
            if kind == "text":
                nodes.append(_Node("text", text=value))
                continue
            if value.startswith("/*"):
                continue
            word = value.split(None, 1)[0] if value else ""
            if word in stop or (word == "else" and "else" in stop):
                return nodes, value
            toks = _tokens(value)
            if word == "if":
                node = _Node("if")
                cond = toks[1:]
                while True:
                    body, ended = block(("else", "end"))
                    node.branches.append((cond, body))
                    if ended == "end":
                        break
                    rest = ended[len("else"):].strip(_SPACE)
                    if rest.startswith("if "):
                        cond = _tokens(rest)[1:]
                        continue
                    if rest:
                        raise GoTemplateError(f"unsupported {{{{ {ended} }}}}")
                    node.body, ended = block(("end",))
                    break
                nodes.append(node)
            elif word == "range":
                rest = toks[1:]
                names: tuple = ()
                if any(t == ("op", ":=") for t in rest):
                    cut = rest.index(("op", ":="))
                    names = tuple(v for k, v in rest[:cut] if k == "var")
                    rest = rest[cut + 1:]
                body, ended = block(("else", "end"))
                if ended != "end":
                    raise GoTemplateError("range ... else is not supported")
                nodes.append(_Node("range", pipe=rest, body=body, names=names))
            elif word in ("with", "define", "template", "block", "break", "continue"):
                raise GoTemplateError(f"{{{{ {word} }}}} is not supported")
            elif len(toks) >= 2 and toks[0][0] == "var" and toks[1] == ("op", ":="):
                nodes.append(_Node("declare", pipe=toks[2:], names=(toks[0][1],)))
            elif len(toks) >= 2 and toks[0][0] == "var" and toks[1] == ("op", "="):
                nodes.append(_Node("assign", pipe=toks[2:], names=(toks[0][1],)))
            else:
                nodes.append(_Node("action", pipe=toks))
        if stop:
            raise GoTemplateError(f"missing {{{{ end }}}} (expected one of {stop})")
        return nodes, None

    nodes, _ = block(())
    return nodes


def _truth(v) -> bool:
    if v is None or v is False:
        return False
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v != 0
    if isinstance(v, (str, list, tuple, dict)):
        return len(v) > 0
    return True


def _field(value, name: str):
    if isinstance(value, dict):
        if name not in value:
            return None  # a missing map key is the zero value
        return value[name]
    if not hasattr(value, name):
        raise GoTemplateError(f"can't evaluate field {name}")
    return getattr(value, name)


def _fmt(v) -> str:
    if v is None:
        return "<no value>"
    if v is True or v is False:
        return "true" if v else "false"
    return str(v)


def _eq(a, *bs):
    return any(a == b for b in bs)


_FUNCS = {
    "eq": _eq,
    "ne": lambda a, b: a != b,
    "not": lambda a: not _truth(a),
    "len": len,
    "slice": lambda x, *ij: x[ij[0]:ij[1] if len(ij) > 1 else None] if ij else x,
    "index": lambda x, *keys: _index(x, keys),
    "and": None, "or": None,  # short-circuit, below
}


def _index(x, keys):
    for k in keys:
        x = x[k]
    return x


class _Scope:
    def __init__(self, root):
        self.frames = [{"$": root}]

    def get(self, name):
        for frame in reversed(self.frames):
            if name in frame:
                return frame[name]
        raise GoTemplateError(f"undefined variable {name}")

    def set(self, name, value):
        for frame in reversed(self.frames):
            if name in frame:
                frame[name] = value
                return
        raise GoTemplateError(f"undefined variable {name}")


def _eval_pipe(toks: list, dot, scope: _Scope):
    """A pipeline without ``|`` chaining: a function call or a single operand."""
    if any(t == ("op", "|") for t in toks):
        raise GoTemplateError("pipelines with | are not supported")
    args, pos = [], 0
    while pos < len(toks):
        arg, pos = _operand(toks, pos, dot, scope)
        args.append(arg)
    if not args:
        raise GoTemplateError("empty pipeline")
    head = args[0]
    if isinstance(head, _Func):
        if head.name in ("and", "or"):
            result = None
            for a in args[1:]:
                v = a(dot, scope) if isinstance(a, _Lazy) else a
                result = v
                if (head.name == "and") != _truth(v):
                    return v
            return result
        return _FUNCS[head.name](*[a(dot, scope) if isinstance(a, _Lazy) else a for a in args[1:]])
    if len(args) != 1:
        raise GoTemplateError(f"can't give arguments to a non-function ({toks})")
    return head(dot, scope) if isinstance(head, _Lazy) else head


@dataclass
class _Func:
    name: str


class _Lazy:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, dot, scope):
        return self.fn(dot, scope)


def _operand(toks, pos, dot, scope):
    kind, value = toks[pos]
    if kind == "op" and value == "(":
        depth, end = 1, pos + 1
        while depth:
            if end >= len(toks):
                raise GoTemplateError("unbalanced parentheses")
            depth += {"(": 1, ")": -1}.get(toks[end][1], 0) if toks[end][0] == "op" else 0
            end += 1
        inner = toks[pos + 1:end - 1]
        return _eval_pipe(inner, dot, scope), end
    if kind == "str":
        try:  # Go's interpreted string literal; its common escapes are JSON's
            return json.loads(value), pos + 1
        except ValueError as e:
            raise GoTemplateError(f"unsupported string literal {value}") from e
    if kind == "raw":
        return value[1:-1], pos + 1
    if kind == "num":
        return int(value), pos + 1
    if kind == "field":
        if value == ".":
            return dot, pos + 1
        v = dot
        for name in value[1:].split("."):
            v = _field(v, name)
        return v, pos + 1
    if kind == "var":
        v = scope.get(value)
        if pos + 1 < len(toks) and toks[pos + 1][0] == "field" and toks[pos + 1][1] != ".":
            # $x.Field / $.Field (the lexer splits "$" and ".Field")
            for fname in toks[pos + 1][1][1:].split("."):
                v = _field(v, fname)
            return v, pos + 2
        return v, pos + 1
    if kind == "ident":
        if value in ("true", "false"):
            return value == "true", pos + 1
        if value == "nil":
            return None, pos + 1
        if value not in _FUNCS:
            raise GoTemplateError(f"function {value!r} is not supported")
        return _Func(value), pos + 1
    raise GoTemplateError(f"unexpected {value!r}")


def _exec(nodes, dot, scope: _Scope, out: list[str]) -> None:
    for node in nodes:
        if node.kind == "text":
            out.append(node.text)
        elif node.kind == "action":
            out.append(_fmt(_eval_pipe(node.pipe, dot, scope)))
        elif node.kind == "declare":
            scope.frames[-1][node.names[0]] = _eval_pipe(node.pipe, dot, scope)
        elif node.kind == "assign":
            scope.set(node.names[0], _eval_pipe(node.pipe, dot, scope))
        elif node.kind == "if":
            for cond, body in node.branches:
                if _truth(_eval_pipe(cond, dot, scope)):
                    _run_block(body, dot, scope, out)
                    break
            else:
                _run_block(node.body, dot, scope, out)
        elif node.kind == "range":
            items = _eval_pipe(node.pipe, dot, scope)
            pairs = items.items() if isinstance(items, dict) else enumerate(items or [])
            for key, item in pairs:
                frame = {}
                if len(node.names) == 1:
                    frame[node.names[0]] = item
                elif len(node.names) == 2:
                    frame[node.names[0]], frame[node.names[1]] = key, item
                scope.frames.append(frame)
                try:
                    _exec(node.body, item, scope, out)
                finally:
                    scope.frames.pop()


def _run_block(body, dot, scope, out):
    scope.frames.append({})
    try:
        _exec(body, dot, scope, out)
    finally:
        scope.frames.pop()


def render(template: str, data: dict) -> str:
    """Execute ``template`` on ``data`` (dicts and lists) as Go's text/template would."""
    out: list[str] = []
    _exec(parse(template), data, _Scope(data), out)
    return "".join(out)
