"""Text from outside the model (tool results, environment messages, the errors they raise) capped in characters
before anything tokenizes it: tokenizing a 10 MB message costs gigabytes before any token budget can apply.

A text longer than ``limit`` characters keeps its head and ends with a marker the model sees::

    "<first characters> ... [truncated N characters]"      len ≤ limit, N = characters cut

so that capping twice changes nothing.
"""

from __future__ import annotations

import re

from ..config.schema import EnvironmentConfig

DEFAULT_MAX_CHARS = EnvironmentConfig.max_message_chars  # the config's default
_MARKED = re.compile(r" \.\.\. \[truncated (\d+) characters\]\Z")


def _marker(cut: int) -> str:
    return f" ... [truncated {cut} characters]"


def cap_text(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its first ``limit - len(marker)`` characters and the
    marker (the marker's length is taken at its longest, so the result never exceeds ``limit``). A text capped
    before (a tool's result capped by its ToolSet, then by a smaller environment limit) counts both cuts."""
    if len(text) <= limit:
        return text
    marked = _MARKED.search(text)
    body, before = (text[:marked.start()], int(marked.group(1))) if marked else (text, 0)
    keep = max(0, limit - len(_marker(len(body) + before)))
    return body[:keep] + _marker(len(body) - keep + before)


def cap_content(content, limit: int):
    """A message's content capped: a string, or each text part of a list of parts ({"type": "text", "text": ...});
    other values are returned as they are."""
    if isinstance(content, str):
        return cap_text(content, limit)
    if isinstance(content, list):
        return [{**part, "text": cap_text(part["text"], limit)}
                if isinstance(part, dict) and isinstance(part.get("text"), str) else part for part in content]
    return content


def cap_messages(messages: list[dict], limit: int) -> list[dict]:
    """Copies of ``messages`` whose contents are capped (messages within the limit are returned as they are)."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        capped = cap_content(content, limit)
        out.append(m if capped is content else {**m, "content": capped})
    return out


def is_capped(content) -> bool:
    """Whether a message's content (or one of its text parts) ends with the truncation marker."""
    if isinstance(content, str):
        return _MARKED.search(content) is not None
    return isinstance(content, list) and any(isinstance(p, dict) and is_capped(p.get("text")) for p in content)
