"""Tool calls in an assistant message, in the formats of the supported model families.

    qwen    (Qwen2.5/Qwen3, Hermes-style templates):  <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any
            number of them; the text outside the tags is the message's content.
    llama3  (Llama 3.1/3.2/3.3 JSON tool calling):   the whole message is one JSON object
            {"name": ..., "parameters": {...}} (optionally after <|python_tag|>), or several separated by ";".

A malformed call is not an exception: it comes back as an error string, which the environment reports to the model
as a tool message, so that the model learns from it and the run goes on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

FORMATS = ("qwen", "llama3")
_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)

    def as_message_entry(self) -> dict:
        """The OpenAI/transformers form of the call: {"type": "function", "function": {"name", "arguments"}}."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    content: str  # the text outside the calls
    calls: list[ToolCall]
    errors: list[str]  # one line per malformed call

    @property
    def has_calls(self) -> bool:
        return bool(self.calls or self.errors)


def _call_from_json(text: str, argument_keys: tuple[str, ...]) -> ToolCall | str:
    """A ToolCall from the JSON text of one call, or an error line."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return f"malformed tool call (not valid JSON: {e.msg} at character {e.pos}): {text[:200]!r}"
    if not isinstance(obj, dict):
        return f"malformed tool call (expected a JSON object with a name): {text[:200]!r}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"malformed tool call (no \"name\" string): {text[:200]!r}"
    args = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return f"malformed tool call to {name} (arguments are not a JSON object): {args[:200]!r}"
    if not isinstance(args, dict):
        return f"malformed tool call to {name} (arguments must be a JSON object, got {type(args).__name__})"
    return ToolCall(name, args)


def parse_qwen(text: str) -> ParsedMessage:
    calls, errors = [], []
    for m in _QWEN_CALL.finditer(text):
        got = _call_from_json(m.group(1).strip(), ("arguments", "parameters"))
        (errors if isinstance(got, str) else calls).append(got)
    content = _QWEN_CALL.sub("", text)
    if "<tool_call>" in content:
        errors.append("malformed tool call (<tool_call> without </tool_call>)")
        content = content[:content.index("<tool_call>")]
    return ParsedMessage(content.strip(), calls, errors)


def parse_llama3(text: str) -> ParsedMessage:
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        if tagged:
            return ParsedMessage("", [], [f"malformed tool call (expected JSON after <|python_tag|>): {body[:200]!r}"])
        return ParsedMessage(text.strip(), [], [])
    calls, errors = [], []
    for part in _split_top_level(body):
        got = _call_from_json(part, ("parameters", "arguments"))
        (errors if isinstance(got, str) else calls).append(got)
    return ParsedMessage("", calls, errors)


def _split_top_level(body: str) -> list[str]:
    """Split ``{..}; {..}`` at the semicolons outside JSON strings and braces."""
    parts, depth, start, in_str, escaped = [], 0, 0, False, False
    for i, ch in enumerate(body):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    parts.append(body[start:].strip())
    return [p for p in parts if p]


PARSERS = {"qwen": parse_qwen, "llama3": parse_llama3}


def parse_tool_calls(text: str, fmt: str) -> ParsedMessage:
    if fmt not in PARSERS:
        raise ValueError(f"tool-call format {fmt!r} is not supported; choose one of {', '.join(FORMATS)}")
    return PARSERS[fmt](text)


def detect_format(tokenizer) -> str:
    """The tool-call format of a tokenizer's chat template: llama3 for Llama 3.1-style templates (<|python_tag|>,
    "parameters"), else qwen (Hermes-style <tool_call> tags, also the default for templates that name no format)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    if "<tool_call>" in template:
        return "qwen"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3"
    return "qwen"
