"""Environments, tools, tool-call parsing and the token-exact appending of environment messages."""

from __future__ import annotations

import asyncio
import time

import pytest

from longrl.agents.environment import (Environment, EnvironmentSetupError, StepResult, ToolEnvironment,
                                       TRLEnvironment, as_step_result, build_environment)
from longrl.agents.tool_calls import ToolCall, detect_format, parse_tool_calls
from longrl.agents.tools import ToolError, ToolSet
from longrl.agents.trajectory import Episode, EpisodeRunner, EpisodeSettings, continuation_ids

# A Qwen2.5-style template (system block with the tools, <tool_call> in assistant turns, tool results in user
# blocks as <tool_response>), over a character-level tokenizer built in code.
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}\n{{ t | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{%- endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen_like_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(specials + chars + ["<unk>"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                  unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = QWEN_LIKE_TEMPLATE
    return tok


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def explode(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ValueError(f"cannot handle {x}")


def snooze(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def _interrupt():
    raise KeyboardInterrupt


async def async_echo(text: str) -> str:
    """Echo text asynchronously.

    Args:
        text: What to echo.
    """
    await asyncio.sleep(0)
    return text.upper()


# ------------------------------------------------------------------------------------------ parsing
def test_qwen_calls_parse_with_content_and_several_calls():
    text = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' \
           '<tool_call>{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call>'
    parsed = parse_tool_calls(text, "qwen")
    assert parsed.content == "Let me add."
    assert parsed.calls == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("echo", {"text": "hi"})]
    assert parsed.errors == []
    assert not parse_tool_calls("The answer is 5.", "qwen").has_calls


@pytest.mark.parametrize("text, needle", [
    ('<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>', "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "without </tool_call>"),
    ('<tool_call>[1, 2]</tool_call>', "expected a JSON object"),
])
def test_malformed_qwen_calls_become_error_lines(text, needle):
    parsed = parse_tool_calls(text, "qwen")
    assert parsed.calls == [] and len(parsed.errors) == 1 and needle in parsed.errors[0] and parsed.has_calls


def test_llama3_calls_parse():
    one = parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}', "llama3")
    assert one.calls == [ToolCall("add", {"a": 1, "b": 2})] and one.content == ""
    two = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                           '{"name": "echo", "parameters": {"text": "a;b}"}}', "llama3")
    assert two.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("echo", {"text": "a;b}"})]
    assert not parse_tool_calls("The sum is 3.", "llama3").has_calls
    bad = parse_tool_calls('{"name": "add", "parameters": {"a": 1,}}', "llama3")
    assert bad.calls == [] and "not valid JSON" in bad.errors[0]
    with pytest.raises(ValueError, match="not supported"):
        parse_tool_calls("x", "mistral")


def test_format_is_detected_from_the_template():
    tok = qwen_like_tokenizer()
    assert detect_format(tok) == "qwen"
    tok.chat_template = "{{ '<|python_tag|>' }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert detect_format(tok) == "llama3"


# ------------------------------------------------------------------------------------------ tools
def test_tool_schemas_come_from_type_hints_and_docstrings():
    tools = ToolSet([add, async_echo])
    schema = tools.schemas[0]["function"]
    assert schema["name"] == "add" and schema["description"] == "Add two integers."
    assert schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first integer."}
    assert schema["parameters"]["required"] == ["a", "b"]

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ToolError, match="undocumented"):
        ToolSet([undocumented])


def test_tool_calls_never_raise():
    tools = ToolSet([add, explode, snooze, async_echo], timeout_s=0.3)
    assert tools.call(ToolCall("add", {"a": 2, "b": 5})) == ("7", False)
    assert tools.call(ToolCall("async_echo", {"text": "hi"})) == ("HI", False)
    text, err = tools.call(ToolCall("explode", {"x": "it"}))
    assert err and "ValueError: cannot handle it" in text
    text, err = tools.call(ToolCall("snooze", {"seconds": 5}))
    assert err and "timed out after 0.3 s" in text
    text, err = tools.call(ToolCall("subtract", {}))
    assert err and "unknown tool 'subtract'" in text and "add" in text
    text, err = tools.call(ToolCall("add", {"a": 1, "c": 2}))
    assert err and "bad arguments for add" in text


def test_timed_calls_reuse_their_threads_and_abandon_the_ones_past_the_timeout():
    """call_with_timeout runs calls on reused daemon threads (one started per call cost more than an instant
    environment step); a thread whose call ran past its timeout takes no other call and ends once it returns; an
    error is returned and keeps the thread, SystemExit and KeyboardInterrupt included."""
    import sys
    import threading

    from longrl.agents.tools import call_with_timeout

    ident = threading.current_thread  # the Thread object: an OS thread id can come back for a new thread
    first = call_with_timeout(ident, 5.0)[1]
    assert first is not ident() and [call_with_timeout(ident, 5.0)[1] for _ in range(3)] == [first] * 3
    finished, value, error = call_with_timeout(lambda: 1 / 0, 5.0)
    assert finished and value is None and isinstance(error, ZeroDivisionError)
    assert call_with_timeout(ident, 5.0) == (True, first, None)  # kept after the error
    release = threading.Event()
    assert call_with_timeout(release.wait, 0.05, 30) == (False, None, None)  # on `first`, abandoned there
    other = call_with_timeout(ident, 5.0)[1]
    assert other not in (first, ident())
    release.set()
    first.join(5.0)
    assert not first.is_alive()  # it returned, saw it was abandoned, and ended
    for stop in (sys.exit, _interrupt):  # returned as errors: the thread goes on, the run too
        finished, value, error = call_with_timeout(stop, 5.0)
        assert finished and value is None and isinstance(error, (SystemExit, KeyboardInterrupt))
        assert call_with_timeout(ident, 5.0)[1] is other
    assert call_with_timeout(lambda x: x + 1, 5.0, 1) == (True, 2, None)


def test_tool_environment_answers_each_call_and_ends_without_one():
    env = ToolEnvironment(ToolSet([add, explode]), "qwen")
    msg = {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
                                           '<tool_call>{"name": "explode", "arguments": {"x": "y"}}</tool_call>'
                                           '<tool_call>{"name": oops}</tool_call>'}
    messages, reward, done = env.step(msg)
    assert not done and reward is None
    assert [m["content"] for m in messages if m["name"] == "add"] == ["2"]
    assert sum("Error" in m["content"] for m in messages) == 2
    assert env.stats == {"tool_calls": 2, "tool_errors": 2}
    assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1, "b": 1}}
    assert env.step({"role": "assistant", "content": "2"}) == ([], None, True)


class IncrementEnv:
    """A TRL environment_factory class, as TRL's documentation writes them."""

    def __init__(self):
        self._counter = 0

    def reset(self, **kwargs) -> str:
        self._counter = kwargs.get("start", 0)
        return f" (start at {self._counter})"

    def increment(self, a: int) -> int:
        """
        Increment the counter by a value.

        Args:
            a: The value to increment by.

        Returns:
            The incremented counter.
        """
        self._counter += a
        return self._counter

    def get_reward(self) -> float:
        return float(self._counter == 3)


def test_trl_environment_classes_work_unchanged():
    env = build_environment(IncrementEnv, [add], "qwen", prompt_column="prompt")
    assert isinstance(env, TRLEnvironment)
    assert {s["function"]["name"] for s in env.tool_schemas()} == {"add", "increment"}
    row = {"prompt": [{"role": "user", "content": "Count to three."}], "start": 1}
    assert env.reset(row) == [{"role": "user", "content": "Count to three. (start at 1)"}]
    call = {"role": "assistant", "content": '<tool_call>{"name": "increment", "arguments": {"a": 2}}</tool_call>'}
    assert env.step(call) == ([{"role": "tool", "name": "increment", "content": "3"}], None, False)
    assert env.final_reward() == 1.0
    with pytest.raises(EnvironmentSetupError, match="neither"):
        build_environment(lambda: object(), [], "qwen")


# ------------------------------------------------------------------------------------------ token-exact appending
def test_environment_messages_append_exactly_what_the_template_renders():
    tok = qwen_like_tokenizer()
    tools = ToolSet([add]).schemas
    prompt = [{"role": "user", "content": "What is 2+3?"}]
    prompt_ids = tok.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=True)
    prompt_ids = prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    sampled = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # as the model would sample
    replies = [{"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "add", "content": "5!"}]
    env_ids = continuation_ids(tok, replies, tools, tok.eos_token)
    conversation = prompt + [{"role": "assistant", "content": call}] + replies
    want = tok.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=False)
    assert tok.decode(prompt_ids + sampled + env_ids) == want
    assert tok.decode(env_ids).startswith("\n<|im_start|>user") and "5!" in tok.decode(env_ids)  # the "\n" after
    #                                                                  <|im_end|> is the template's, not sampled
    assert tok.decode(env_ids).endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------------------------------ the episode runner
class Countdown(Environment):
    """Answers every turn with 'ok'; done after `done_after` steps; optionally slow or failing."""

    def __init__(self, done_after=2, sleep_s=0.0, fail=False):
        super().__init__()
        self.done_after, self.sleep_s, self.fail, self.steps = done_after, sleep_s, fail, 0

    async def step(self, assistant_message):
        self.steps += 1
        await asyncio.sleep(self.sleep_s)
        if self.fail:
            raise RuntimeError("boom")
        return StepResult([{"role": "user", "content": "1"}], 0.5 * self.steps, self.steps >= self.done_after)


def _runner(env, **settings):
    from longrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    ep = Episode(env, [{"role": "user", "content": "1+1="}])
    return EpisodeRunner([ep], tok, EpisodeSettings(**settings), None, (tok.eos_token_id,)), ep


def test_runner_steps_until_done_with_per_turn_rewards():
    runner, ep = _runner(Countdown(done_after=2))
    assert runner.step(0, [5, 6], room=10) == [5]  # "1" in the tiny tokenizer
    assert runner.step(0, [7], room=10) is None
    assert ep.turn_rewards == [0.5, 1.0] and ep.truncated is None and ep.turns == 2
    assert [m["role"] for m in ep.messages] == ["assistant", "user", "assistant"]


class ImageReply(Environment):
    """Answers with a message holding an image part without its image."""

    def step(self, assistant_message):
        return [{"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "a chart"}]}], 0.0, False


def test_a_step_that_returns_an_image_part_ends_the_episode_naming_it():
    runner, ep = _runner(ImageReply())
    assert runner.step(0, [5], room=10) is None
    assert ep.truncated == "env_error"
    assert "ImageReply.step returned a tool message with a 'image' part without its image" in ep.error
    text_parts = StepResult([{"role": "user", "content": [{"type": "text", "text": "1"}]}], None, False)
    assert as_step_result(text_parts, "E").messages == text_parts.messages  # text parts stay as they are


@pytest.mark.parametrize("env, settings, room, reason", [
    (Countdown(done_after=9), dict(max_turns=1), 10, "max_turns"),
    (Countdown(done_after=9), dict(), 1, "max_tokens"),
    (Countdown(sleep_s=2.0), dict(turn_timeout_s=0.2), 10, "turn_timeout"),
    (Countdown(sleep_s=2.0), dict(turn_timeout_s=None, episode_timeout_s=0.2), 10, "episode_timeout"),
    (Countdown(fail=True), dict(), 10, "env_error"),
])
def test_runner_records_why_an_episode_stopped(env, settings, room, reason):
    runner, ep = _runner(env, **settings)
    assert runner.step(0, [5], room=room) is None
    assert ep.truncated == reason
    if reason == "env_error":
        assert "RuntimeError: boom" in ep.error
