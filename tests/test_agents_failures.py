"""Agents fail as documented and stay bounded (issue 41): text from tools and environments is capped in characters
before tokenization, with the cut marked; SystemExit / KeyboardInterrupt raised by a tool become "Error: ..." tool
messages; a raising Environment.reset skips its row (counted) until more than environment.max_reset_failure_share
of a batch's rows fail; a missing or non-callable environment factory is a ConfigError before the model loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from longrl.agents.bounded_text import cap_content, cap_messages, cap_text
from longrl.agents.environment import Environment, ToolEnvironment, build_environment
from longrl.agents.rollout import AgentSpec, EnvironmentResetError
from longrl.agents.tool_calls import ToolCall
from longrl.agents.tools import ToolSet, call_with_timeout
from longrl.agents.trajectory import Episode, EpisodeRunner, EpisodeSettings
from longrl.config import ConfigError, load_config
from longrl.config.demo import demo_config
from longrl.tasks.tools import LookupEnvironment
from longrl.training.reporting import read_metrics

BIG = 10 * 2**20  # 10 MB of text
QUICK = ["train.max_steps=2", "train.prompts_per_step=4", "grpo.num_generations=2", "output.progress_bar=false",
         "output.tensorboard=false", "output.save_steps=0"]
SRC = Path(__file__).parents[1] / "src"


def huge(n: int) -> str:
    """Return n characters.

    Args:
        n: How many.
    """
    return "7" * n


def quits(code: int) -> str:
    """Call sys.exit.

    Args:
        code: The exit code.
    """
    sys.exit(code)


def interrupts() -> str:
    """Raise KeyboardInterrupt."""
    raise KeyboardInterrupt("pressed")


def rambles() -> str:
    """Raise with a 10 MB message."""
    raise ValueError("x" * BIG)


# ------------------------------------------------------------------------------------------ the cap itself
def test_cap_keeps_short_text_and_marks_the_cut_of_long_text():
    assert cap_text("hello", 64) == "hello"
    text = "".join(str(i % 10) for i in range(1000))
    capped = cap_text(text, 100)
    assert len(capped) <= 100 and text.startswith(capped.split(" ... [truncated")[0])
    kept = len(capped.split(" ... [truncated")[0])
    assert capped.endswith(f" ... [truncated {1000 - kept} characters]")
    assert cap_text(capped, 100) == capped  # capping twice changes nothing
    again = cap_text(capped, 64)  # a smaller second cap counts every character cut
    assert len(again) <= 64 and again.endswith(f" ... [truncated {1000 - len(again.split(' ... ')[0])} characters]")
    parts = [{"type": "text", "text": text}, {"type": "image", "url": "u"}]
    assert cap_content(parts, 100) == [{"type": "text", "text": capped}, parts[1]]
    messages = [{"role": "user", "content": text}]
    assert cap_messages(messages, 100) == [{"role": "user", "content": capped}] and messages[0]["content"] == text


# ------------------------------------------------------------------------------------------ tools
def test_a_10_mb_tool_result_or_error_reaches_the_model_capped():
    tools = ToolSet([huge, rambles], max_chars=200)
    text, failed = tools.call(ToolCall("huge", {"n": BIG}))
    kept = text.index(" ... [truncated")
    assert not failed and len(text) <= 200 and text[:kept] == "7" * kept
    assert text.endswith(f" ... [truncated {BIG - kept} characters]")
    text, failed = tools.call(ToolCall("rambles", {}))
    assert failed and len(text) <= 200 and text.startswith("Error: rambles raised ValueError: xxx")
    assert "[truncated" in text


@pytest.mark.parametrize("timeout_s", [5.0, None])  # on a worker thread, and in the calling thread
def test_system_exit_and_keyboard_interrupt_in_a_tool_are_tool_errors(timeout_s):
    env = ToolEnvironment(ToolSet([quits, interrupts, huge], timeout_s=timeout_s), "qwen")
    msg = {"role": "assistant", "content": '<tool_call>{"name": "quits", "arguments": {"code": 3}}</tool_call>'
                                           '<tool_call>{"name": "interrupts", "arguments": {}}</tool_call>'
                                           '<tool_call>{"name": "huge", "arguments": {"n": 2}}</tool_call>'}
    replies = []
    worker = threading.Thread(target=lambda: replies.append(env.step(msg)))  # not the main thread: no Ctrl-C here
    worker.start()
    worker.join(30)
    messages, reward, done = replies[0]
    assert [m["content"] for m in messages] == ["Error: quits raised SystemExit: 3",
                                                "Error: interrupts raised KeyboardInterrupt: pressed", "77"]
    assert not done and env.stats == {"tool_calls": 3, "tool_errors": 2}


def test_keyboard_interrupt_in_the_main_thread_without_a_timeout_is_the_users():
    """Untimed calls run in the calling thread; in the main thread a KeyboardInterrupt may be Ctrl-C: it propagates
    (during training, stop signals never raise it: training/signals.py)."""
    assert isinstance(call_with_timeout(quits, None, 3)[2], SystemExit)
    with pytest.raises(KeyboardInterrupt):
        call_with_timeout(interrupts, None)


class BigObservation:
    """A TRL environment whose reset observation is 10 MB."""

    def reset(self, **row):
        return "!" * BIG


def test_a_trl_reset_observation_is_capped():
    env = build_environment(BigObservation, [], "qwen", max_chars=100)
    messages = env.reset({"prompt": "2+2="})
    assert messages[0]["content"].startswith("2+2=!!!") and len(messages[0]["content"]) <= len("2+2=") + 100


class Flood(Environment):
    """Answers every turn with a 10 MB tool message and a 10 MB user message."""

    def step(self, assistant_message):
        parts = [{"type": "text", "text": "8" * BIG}]
        return [{"role": "tool", "content": "7" * BIG}, {"role": "user", "content": parts}], 0.0, False


def test_environment_step_messages_are_capped_before_tokenization():
    from longrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    ep = Episode(Flood(), [{"role": "user", "content": "1+1="}])
    runner = EpisodeRunner([ep], tok, EpisodeSettings(max_message_chars=100), None, (tok.eos_token_id,))
    ids = runner.step(0, [5], room=1000)
    assert ids is not None and len(ids) <= 400  # two capped messages (the tiny template writes a list as its repr)
    tool, user = ep.messages[1:]
    assert len(tool["content"]) <= 100 and tool["content"].endswith("characters]")
    assert len(user["content"][0]["text"]) <= 100


# ------------------------------------------------------------------------------------------ factories, before the model
def _tools_cfg(tmp_path, *overrides):
    return load_config(None, QUICK + [f"output.output_dir={tmp_path / 'out'}", *overrides], base=demo_config("tools"))


@pytest.mark.parametrize("source, message", [
    ("nowhere.py:Env", "'environment.factory': .*file not found"),
    ("env.py:Missing", "'environment.factory': .*has no attribute 'Missing'"),
    ("env.py:NOT_CALLABLE", "'environment.factory': .*'NOT_CALLABLE' is not callable"),
    ("env.py:Broken", "'environment.factory': environment factory Broken: constructing it failed: RuntimeError: no "
                      "docker here"),
    ("env.py:NotAnEnvironment", "'environment.factory': .*neither a longrl.agents.Environment nor a TRL"),
])
def test_a_bad_environment_factory_is_a_config_error_before_the_model_loads(tmp_path, monkeypatch, capsys, source,
                                                                            message):
    import longrl.training.model_setup as model_setup
    from longrl.cli.main import main

    (tmp_path / "env.py").write_text(textwrap.dedent("""
        NOT_CALLABLE = 3
        class NotAnEnvironment:
            pass
        class Broken:
            def __init__(self):
                raise RuntimeError('no docker here')
    """))
    loaded = []
    monkeypatch.setattr(model_setup, "load_model", lambda *a, **k: loaded.append(1))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(demo_config("tools").to_yaml())
    code = main(["train", str(cfg), *QUICK, f"output.output_dir={tmp_path / 'out'}",
                 f"environment.factory={tmp_path / source}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and not loaded, err
    assert re.search(message, err), err


def test_a_non_callable_factory_or_tool_given_in_python_is_refused_before_the_model(tmp_path, monkeypatch):
    import longrl.training.model_setup as model_setup
    from longrl.compat.trl import GRPOTrainer

    monkeypatch.setattr(model_setup, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    cfg = _tools_cfg(tmp_path, "environment.factory=null")
    with pytest.raises(ConfigError, match="environment_factory: .*LookupEnvironment.* is not callable; pass the "
                                          "environment class"):
        GRPOTrainer(cfg, environment_factory=LookupEnvironment())
    with pytest.raises(ConfigError, match=r"tools\[1\]: 'add' \(str\) is not callable; pass a function"):
        GRPOTrainer(_tools_cfg(tmp_path, "environment.factory=null"), tools=[huge, "add"])
    assert AgentSpec.resolve(_tools_cfg(tmp_path, "environment.factory=null")) is None


@pytest.mark.parametrize("key, value", [("max_message_chars", 10), ("max_reset_failure_share", 1.5),
                                        ("max_reset_failure_share", -0.1), ("max_reset_failure_share", "nan")])
def test_the_new_keys_are_checked(tmp_path, key, value):
    with pytest.raises(ConfigError, match=f"environment.{key}"):
        _tools_cfg(tmp_path, f"environment.{key}={value}")


# ------------------------------------------------------------------------------------------ reset failures
class ResetFailsOnKeyZero(LookupEnvironment):
    def reset(self, row):
        if row["key"] == 0:
            raise RuntimeError(f"no episode for key {row['key']}")
        return super().reset(row)


def _reward_file(tmp_path) -> str:
    path = tmp_path / "strict.py"
    path.write_text("def strict(prompts, completions, key, **kwargs):\n"
                    "    assert 0 not in key, 'shown a skipped row'\n"
                    "    return [1.0] * len(key)\n")
    return (f"rewards=[{{function: 'longrl.tasks.tools:lookup_reward', weight: 0.5}}, "
            f"{{function: '{path}:strict', weight: 0.5}}]")


def test_a_raising_reset_skips_its_row_and_is_counted(tmp_path, caplog):
    from longrl.recipes.grpo import GRPOTrainer

    rows = [{"prompt": f"{k}=", "key": k, "secret": (k * 7) % 10} for k in (0, 1, 2, 3)]  # key 0: reset raises
    cfg = _tools_cfg(tmp_path, "environment.factory=null", "output.log_completions=8", _reward_file(tmp_path))
    trainer = GRPOTrainer(cfg, environment_factory=ResetFailsOnKeyZero, rows=rows)
    trainer.train()  # 1 of 4 rows a batch fails: within the default share (0.5)
    metrics = read_metrics(tmp_path / "out")
    assert [m["agent/reset_errors"] for m in metrics] == [1, 1]
    assert all(m["reward_failures"] == 0 for m in metrics)  # the strict reward never saw key 0
    assert "environment reset failed on 1 of 4 rows" in caplog.text and "RuntimeError: no episode for key 0" in \
        caplog.text and "skipped" in caplog.text
    b = trainer.batch
    skipped = [i for i, ep in enumerate(b.episodes) if ep.truncated == "reset_error"]
    assert len(skipped) == 2 and all(b.prompts[i] == "0=" for i in skipped)  # the row's G places
    assert all(b.completions[i] == [] and b.mask[i].sum() == 0 for i in skipped)
    assert all(bool(b.rewards[i].isnan()) and bool(b.rewards_per_function[i].isnan().all()) for i in skipped)
    ran = [i for i in range(len(b.episodes)) if i not in skipped]
    assert all(not b.rewards[i].isnan() for i in ran) and b.mask[ran].sum() > 0
    logged = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert any(r["stop_reason"] == "reset_error" and r["reward"] is None for r in logged)


def test_a_factory_failing_during_the_run_skips_its_row(tmp_path, caplog):
    """Checked before the model loads, a factory may still fail later (a pool exhausted): that row is skipped."""
    from longrl.recipes.grpo import GRPOTrainer

    calls = []

    def factory():
        calls.append(1)
        if len(calls) == 2:  # the first build of the first batch (the first call is the check)
            raise RuntimeError("pool exhausted")
        return LookupEnvironment()

    rows = [{"prompt": f"{k}=", "key": k, "secret": k} for k in range(4)]
    trainer = GRPOTrainer(_tools_cfg(tmp_path, "environment.factory=null"), environment_factory=factory, rows=rows)
    trainer.train()
    assert [m["agent/reset_errors"] for m in read_metrics(tmp_path / "out")] == [1, 0]
    assert "got no environment: environment factory test_a_factory_failing_during_the_run_skips_its_row.<locals>" \
           ".factory: constructing it failed: RuntimeError: pool exhausted" in caplog.text


def test_more_than_the_share_of_failed_resets_ends_the_run_with_a_clear_error(tmp_path, capsys, monkeypatch):
    from longrl.cli.main import main

    env = tmp_path / "envs.py"
    env.write_text(textwrap.dedent("""
        import sys
        from longrl.tasks.tools import LookupEnvironment

        class ResetExits(LookupEnvironment):
            def reset(self, row):
                if row["key"] != 5:
                    sys.exit(f"reset of {row['key']} gave up")  # SystemExit: a failure like any other
                return super().reset(row)
    """))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(demo_config("tools").to_yaml())
    code = main(["train", str(cfg), *QUICK, f"output.output_dir={tmp_path / 'out'}",
                 f"environment.factory={env}:ResetExits", "environment.max_reset_failure_share=0.25"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "environment reset failed on" in err and "raised SystemExit: reset of" in err, err
    assert "more than environment.max_reset_failure_share=0.25 of the rows: the run stops" in err, err


def test_the_share_is_counted_over_every_rank(monkeypatch):
    """Every rank decides from the job's totals (World.sum_floats), so all stop or none does."""
    from longrl.agents.rollout import AgentRollouts
    from longrl.models.tiny import build_char_tokenizer

    spec = AgentSpec(ResetFailsOnKeyZero, ())
    other_ranks = {"failed": 0.0, "rows": 12.0}  # three more ranks of 4 rows, none failing
    agents = AgentRollouts(build_char_tokenizer(), EpisodeSettings(), spec, "qwen", max_reset_failure_share=0.2,
                           sum_floats=lambda d: {k: v + other_ranks[k] for k, v in d.items()})
    rows = [{"key": k} for k in range(4)]
    assert agents._reset_failures(rows, {0: "raised"}) == 1  # 1 of 16 rows
    assert agents._reset_failures(rows, {}) == 0
    other_ranks["failed"] = 3.0  # 4 of 16 > 0.2: this rank stops although its own share is 1 of 4
    with pytest.raises(EnvironmentResetError, match="failed on 4 of 16 rows"):
        agents._reset_failures(rows, {0: "raised"})
    other_ranks["failed"] = 4.0  # none here, 4 of 16 elsewhere: this rank stops too
    with pytest.raises(EnvironmentResetError, match="failed on 4 of 16 rows.*see the warnings of the other ranks"):
        agents._reset_failures(rows, {})


# ------------------------------------------------------------------------------------------ memory, end to end
FLOOD_ENV = '''
import sys
from longrl.agents.environment import Environment
from longrl.agents.tool_calls import ToolCall
from longrl.agents.tools import ToolSet

BIG = 10 * 2**20


def huge() -> str:
    """Return 10 MB of text."""
    return "7" * BIG


def quits() -> str:
    """Call sys.exit."""
    sys.exit(3)


class Flood(Environment):
    """Each first turn is answered by two tool results (10 MB, and a tool calling sys.exit) and a 10 MB user
    message; the second turn ends the episode."""

    def __init__(self):
        super().__init__()
        self.toolset, self.steps = ToolSet([huge, quits]), 0

    def step(self, assistant_message):
        self.steps += 1
        if self.steps > 1:
            return [], 1.0, True
        replies = []
        for name in ("huge", "quits"):
            text, failed = self.toolset.call(ToolCall(name, {}))
            self.stats["tool_calls"] += 1
            self.stats["tool_errors"] += int(failed)
            replies.append({"role": "tool", "name": name, "content": text})
        return replies + [{"role": "user", "content": "8" * BIG}], None, False
'''

DRIVER = '''
import os, resource, sys, threading, time
LIMIT_KIB = int(sys.argv[1])

def watch():  # stop at once past the bound rather than take the host's memory
    while True:
        if resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > LIMIT_KIB:
            print("PEAK_RSS_KIB over", LIMIT_KIB, flush=True)
            os._exit(99)
        time.sleep(0.05)

threading.Thread(target=watch, daemon=True).start()
from longrl.cli.main import main
code = main(sys.argv[2:])
print("PEAK_RSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
sys.exit(code)
'''


def test_10_mb_tool_results_and_environment_messages_keep_the_run_small(tmp_path):
    """A run whose every episode gets a 10 MB tool result and a 10 MB Environment.step message (without the cap:
    past 5 GiB within a minute on a CPU, still rising): the trajectories stay within their token budget, every
    message the model sees within environment.max_message_chars and marked, a tool's SystemExit is a counted tool
    error, and the process's peak RSS stays under 2 GiB (with the cap such a run peaks under 1 GiB)."""
    (tmp_path / "flood.py").write_text(FLOOD_ENV)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(demo_config("tools").to_yaml())
    out = tmp_path / "out"
    limit_kib = 2 * 2**20
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(limit_kib), "train", str(cfg), *QUICK,
                           f"output.output_dir={out}", f"environment.factory={tmp_path / 'flood.py'}:Flood",
                           "environment.max_message_chars=200", "environment.max_tokens=1024",
                           "output.log_completions=8", "rewards=[]"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    peak_kib = int(proc.stdout.split("PEAK_RSS_KIB")[-1].split()[0])
    assert peak_kib < limit_kib
    episodes = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    seen = [m for e in episodes for m in e["completion"] if m["role"] != "assistant"]
    assert seen and all(len(m["content"]) <= 200 for m in seen)
    for m in seen:  # the whole cut counted, also where the environment's ToolSet capped the result first
        if m.get("name") != "quits":
            assert m["content"].endswith(f" ... [truncated {BIG - m['content'].index(' ... ')} characters]")
    assert {m["content"] for m in seen if m.get("name") == "quits"} == {"Error: quits raised SystemExit: 3"}
    metrics = read_metrics(out)
    assert all(m["agent/tool_errors"] == 1 and m["agent/tool_calls"] == 2 for m in metrics)
    assert all(m["agent/messages_truncated"] == 2 for m in metrics)  # the tool's result and the user message
    assert all(m["completion_length"] <= 1024 for m in metrics)


RANK_ZERO_RESETS_FAIL = '''
import os
from longrl.tasks.tools import LookupEnvironment


class Env(LookupEnvironment):
    def reset(self, row):
        if os.environ.get("RANK") == "0":
            raise RuntimeError("rank 0 has no sandbox")
        return super().reset(row)
'''


@pytest.mark.parametrize("share, survives", [(0.5, True), (0.25, False)])
def test_two_ranks_skip_rows_and_stop_alike(tmp_path, share, survives):
    """`longrl train --nproc-per-node 2` (gloo, full weights sharded by FSDP2): every reset of rank 0 fails, none
    of rank 1. Counted over both ranks (2 of 4 rows), the batch goes on at share 0.5 on both (placeholders keep the
    ranks' collectives in step although rank 0 has nothing to sample), and at 0.25 both stop with the error, rank 1
    included although its own rows were fine."""
    (tmp_path / "env.py").write_text(RANK_ZERO_RESETS_FAIL)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(demo_config("tools").to_yaml())
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "longrl", "train", str(cfg), "--nproc-per-node", "2", *QUICK,
                           f"output.output_dir={out}", f"environment.factory={tmp_path / 'env.py'}:Env",
                           f"environment.max_reset_failure_share={share}", "distributed.timeout_s=120"],
                          capture_output=True, text=True, timeout=500, env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = proc.stdout + proc.stderr
    if survives:
        assert proc.returncode == 0, log[-3000:]
        assert [m["agent/reset_errors"] for m in read_metrics(out)] == [2, 2]
    else:
        assert proc.returncode != 0, log[-3000:]
        assert "failed on 2 of 4 rows of this rollout batch; first: dataset row" in log, log[-3000:]
        assert "failed on 2 of 4 rows of this rollout batch; see the warnings of the other ranks" in log, log[-3000:]
