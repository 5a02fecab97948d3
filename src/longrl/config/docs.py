"""``docs/config.md`` from the config dataclass tree: every key, its type, its default and its meaning.

The meaning of a field is its ``metadata["help"]`` when it has one, else the ``# ...`` comment after it in
``config/schema.py`` (with the comment lines below it that continue it: ``#`` followed by two or more spaces), else the
comment block just above it. Run ``python -m longrl.config.docs > docs/config.md`` after adding or changing a
field; ``tests/test_config_docs.py`` fails while docs/config.md is out of date.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import sys
import tokenize
import typing

from . import schema as config_module

REGENERATE = "python -m longrl.config.docs > docs/config.md"


def _comments_by_line(source: str) -> dict[int, tuple[str, bool]]:
    """line number → (comment text without '#', whether the line holds only the comment)."""
    out = {}
    code_lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string[1:]
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    return {line: (text, line not in code_lines) for line, text in out.items()}


def field_comments(source: str | None = None) -> dict[str, dict[str, str]]:
    """class name → field name → the comment that documents it in ``source`` (default: schema.py's)."""
    source = inspect.getsource(config_module) if source is None else source
    comments = _comments_by_line(source)
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
        docs = out.setdefault(node.name, {})
        for k, stmt in enumerate(fields):
            texts = [comments[n][0].strip() for n in range(stmt.lineno, stmt.end_lineno + 1)
                     if n in comments and not comments[n][1]]
            if texts:  # a trailing comment, and the comment-only lines that continue it
                line = stmt.end_lineno + 1
                while line in comments and comments[line][1] and comments[line][0].startswith("  "):
                    texts.append(comments[line][0].strip())
                    line += 1
            else:  # the comment block just above the field (not a continuation of the field before it)
                line, above = stmt.lineno - 1, []
                while line in comments and comments[line][1] and not comments[line][0].startswith("  "):
                    above.insert(0, comments[line][0].strip())
                    line -= 1
                texts = above
            docs[stmt.target.id] = " ".join(t for t in texts if t)
    return out


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        return " | ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(section)"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def sections(root=None):
    """(key prefix, dataclass, field meanings) of each section of the tree, in the order of ``Config``."""
    root = root or config_module.Config
    comments = field_comments()
    out = []
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        tp = hints[f.name]
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            cls, key = typing.get_args(tp)[0], f"{f.name}[]"
        elif dataclasses.is_dataclass(tp):
            cls, key = tp, f.name
        else:
            continue
        out.append((key, cls, comments.get(cls.__name__, {}), comments.get(root.__name__, {}).get(f.name, "")))
    return out


def undocumented() -> list[str]:
    """Keys with no meaning (no help metadata, no comment)."""
    missing = []
    for key, cls, docs, _ in sections():
        for f in dataclasses.fields(cls):
            if not (f.metadata.get("help") or docs.get(f.name)):
                missing.append(f"{key}.{f.name}")
    return missing


def render() -> str:
    """The whole of docs/config.md."""
    lines = ["# Configuration reference", "",
             f"<!-- generated from src/longrl/config/schema.py by `{REGENERATE}`; do not edit by hand -->", "",
             "A run is one YAML file of these sections (any key left out keeps its default); `KEY=VALUE` arguments "
             "after the file override single keys, e.g. `longrl train run.yaml train.max_steps=10`. "
             "`longrl demo --print-config` prints a complete config.", ""]
    for key, cls, docs, section_doc in sections():
        lines += [f"## `{key}`", ""]
        doc = section_doc or (inspect.getdoc(cls) if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(")
                              else "")
        if doc:
            lines += [doc, ""]
        lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        hints = typing.get_type_hints(cls)
        prefix = key
        for f in dataclasses.fields(cls):
            meaning = f.metadata.get("help") or docs.get(f.name, "")
            lines.append(f"| `{prefix}.{f.name}` | {_cell(_type_name(hints[f.name]))} | {_cell(_default(f))} | "
                         f"{_cell(meaning)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
