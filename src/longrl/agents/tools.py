"""Python functions as tools: JSON schemas from their type hints and docstrings, and calls that never crash a run.

``ToolSet([fn, ...])`` reads each function's schema with transformers' ``get_json_schema`` (the form
``apply_chat_template(tools=...)`` renders for the model's template). ``ToolSet.call`` runs a parsed call and always
returns the text of a tool message: the function's result (``str``, or JSON for other values), or an error line
(unknown tool, bad arguments, the exception it raised, ``SystemExit`` and ``KeyboardInterrupt`` included, a
timeout), capped at ``max_chars`` characters (:mod:`.bounded_text`). Coroutine functions are awaited. A call past
its timeout is abandoned (its thread cannot be killed: code that must be stopped belongs in :mod:`.sandbox`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import queue
import threading
from typing import Callable

from .bounded_text import DEFAULT_MAX_CHARS, cap_text
from .tool_calls import ToolCall


class ToolError(ValueError):
    """A tool cannot be described (no docstring, untyped argument); the message names the function."""


def tool_schema(fn: Callable) -> dict:
    """The JSON schema transformers renders for ``fn`` ({"type": "function", "function": {...}})."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        name = getattr(fn, "__qualname__", repr(fn))
        raise ToolError(f"tool {name}: cannot build its JSON schema ({type(e).__name__}: {e}); a tool needs a "
                        "docstring with an Args: section describing every argument, and type hints") from None


def run_maybe_async(fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs), awaited in a private event loop when fn is a coroutine function or returns one."""
    out = fn(*args, **kwargs)
    return asyncio.run(out) if inspect.isawaitable(out) else out


class _Job:
    """One call handed to a worker thread: its result, and whether the caller stopped waiting for it."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.value = self.error = None
        self.done, self.lock = threading.Event(), threading.Lock()
        self.abandoned = False


class _CallThreads:
    """Daemon threads reused for timed calls (a thread started per call cost more than an instant environment's
    step): a call goes to an idle thread and the caller waits for it up to its timeout. A thread whose call ran past
    the timeout is abandoned: it finishes that call, then ends; it never takes another."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []

    def call(self, fn: Callable, timeout_s: float, args: tuple, kwargs: dict):
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), daemon=True, name="longrl-tool").start()
        job = _Job(fn, args, kwargs)
        inbox.put(job)
        job.done.wait(timeout_s)
        with job.lock:
            if not job.done.is_set():
                job.abandoned = True
                return False, None, None
        with self._lock:
            self._idle.append(inbox)
        return True, job.value, job.error

    @staticmethod
    def _serve(inbox: queue.SimpleQueue) -> None:
        while True:
            job = inbox.get()
            threading.current_thread().name = f"longrl-tool-{getattr(job.fn, '__name__', 'fn')}"
            try:
                job.value = run_maybe_async(job.fn, *job.args, **job.kwargs)
            except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too: reported, not raised
                job.error = e  # (signals reach only the main thread: none of these is the user's Ctrl-C)
            with job.lock:
                job.done.set()
                if job.abandoned:  # the caller stopped waiting: this thread takes no other call
                    return


_CALL_THREADS = _CallThreads()


def call_with_timeout(fn: Callable, timeout_s: float | None, *args, **kwargs):
    """(finished, value, exception): fn run in a daemon thread, abandoned after ``timeout_s`` (None: no limit, in
    the calling thread). Whatever fn raises is returned, SystemExit and KeyboardInterrupt included, except a
    KeyboardInterrupt in the main thread (where it may be the user's Ctrl-C)."""
    if timeout_s is None:
        try:
            return True, run_maybe_async(fn, *args, **kwargs), None
        except KeyboardInterrupt as e:
            if threading.current_thread() is threading.main_thread():
                raise
            return True, None, e
        except (Exception, SystemExit) as e:  # noqa: BLE001 - reported, not raised
            return True, None, e
    return _CALL_THREADS.call(fn, timeout_s, args, kwargs)


def result_text(value) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


class ToolSet:
    """Named tools with their schemas; ``call`` returns (content, is_error): the result's text, at most
    ``max_chars`` characters, or for a tool that returns a Pillow image one image part ``[{"type": "image",
    "image": ...}]`` (a vision-language model sees it: agents/tool_images.py)."""

    def __init__(self, functions: list[Callable], timeout_s: float | None = 30.0, max_chars: int = DEFAULT_MAX_CHARS):
        self.functions: dict[str, Callable] = {}
        self.schemas: list[dict] = []
        for fn in functions:
            if not callable(fn):
                raise ToolError(f"tool {fn!r} is not callable")
            schema = tool_schema(fn)
            name = schema["function"]["name"]
            if name in self.functions:
                raise ToolError(f"two tools are named {name!r}")
            self.functions[name] = fn
            self.schemas.append(schema)
        self.timeout_s, self.max_chars = timeout_s, max_chars

    def __bool__(self) -> bool:
        return bool(self.functions)

    def call(self, call: ToolCall) -> tuple[str | list[dict], bool]:
        content, failed = self._call(call)
        return (cap_text(content, self.max_chars) if isinstance(content, str) else content), failed

    def _call(self, call: ToolCall) -> tuple[str | list[dict], bool]:
        fn = self.functions.get(call.name)
        if fn is None:
            known = ", ".join(self.functions) or "none"
            return f"Error: unknown tool {call.name!r} (available: {known})", True
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return f"Error: bad arguments for {call.name}: {e}", True
        finished, value, error = call_with_timeout(fn, self.timeout_s, **call.arguments)
        if not finished:
            return f"Error: tool {call.name} timed out after {self.timeout_s:g} s", True
        if error is not None:
            return f"Error: {call.name} raised {type(error).__name__}{f': {error}' if str(error) else ''}", True
        from ..data.images import is_pil_image  # (here: longrl.data imports the tasks, which import agents)

        if is_pil_image(value):
            return [{"type": "image", "image": value}], False
        return result_text(value), False
