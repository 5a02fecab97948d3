"""Rewards: a reward server on the loopback address (success, a 500 then a retry, a timeout, malformed answers, the
auth header from the environment, the concurrency limit), return values checked, "did you mean" for misspelt names,
and a reward file edited since the checkpoint refused on resume."""

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from longrl.cli.main import main
from longrl.config import ConfigError, load_config
from longrl.config.demo import demo_config
from longrl.config.schema import RewardSpec
from longrl.rewards import RewardLoadError, RewardScorer, load_reward_function
from longrl.rewards.server import ServerReward
from longrl.training.reporting import reward_failure_lines


class RewardServer:
    """A reward server in a thread on 127.0.0.1: ``behave(request_number, body) -> (status, payload or bytes, delay)``
    decides each answer; every request's body and headers are kept."""

    def __init__(self, behave):
        self.behave, self.requests, self.in_flight, self.most_in_flight = behave, [], 0, 0
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    number = len(owner.requests)
                    owner.requests.append((body, dict(self.headers)))
                    owner.in_flight += 1
                    owner.most_in_flight = max(owner.most_in_flight, owner.in_flight)
                try:
                    status, payload, delay = owner.behave(number, body)
                    time.sleep(delay)
                    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
                    pass
                finally:
                    with owner.lock:
                        owner.in_flight -= 1

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def length_rewards(number, body):
    """1 point per character of each completion; None where the row's answer is None."""
    answers = body["columns"].get("answer") or [0] * len(body["completions"])
    return 200, {"rewards": [None if a is None else float(len(c)) for c, a in zip(body["completions"], answers)]}, 0


PROMPTS, COMPLETIONS, COLUMNS = ["1+1=", "2+2=", "3+3="], ["2", "44", "666"], {"answer": ["2", None, "6"]}


def _score(url, **settings):
    scorer = RewardScorer.from_specs([RewardSpec(url=url, retry_backoff_s=0.01, **settings)])
    try:
        return scorer.score(PROMPTS, COMPLETIONS, COLUMNS)
    finally:
        scorer.close()


def test_server_scores_a_batch_with_columns_and_the_auth_header_from_the_environment(monkeypatch):
    monkeypatch.setenv("REWARD_TOKEN", "Bearer s3cret")
    with RewardServer(length_rewards) as server:
        per_fn, total, failures = _score(server.url, auth_env="REWARD_TOKEN")
    assert failures == [] and per_fn[0, 0] == 1.0 and math.isnan(per_fn[1, 0]) and per_fn[2, 0] == 3.0
    assert math.isnan(total[1])  # None: the reward does not apply, so no learning signal from it alone
    (body, headers), = server.requests
    assert body == {"prompts": PROMPTS, "completions": COMPLETIONS, "columns": COLUMNS}
    assert headers["Authorization"] == "Bearer s3cret" and headers["Content-Type"] == "application/json"


def test_server_500_is_retried_then_succeeds():
    def flaky(number, body):
        return (500, {"error": "busy"}, 0) if number == 0 else length_rewards(number, body)

    with RewardServer(flaky) as server:
        per_fn, _, failures = _score(server.url)
    assert failures == [] and len(server.requests) == 2 and per_fn[2, 0] == 3.0


def test_server_failures_after_retries_are_counted_per_sample_and_name_the_reason():
    with RewardServer(lambda number, body: (503, b"overloaded", 0)) as server:
        _, total, failures = _score(server.url, max_retries=2)
    assert len(server.requests) == 3  # the first try and two retries
    assert [f.sample for f in failures] == [0, 1, 2] and all(math.isnan(x) for x in total.tolist())
    assert "HTTP 503" in failures[0].reason and "after 3 attempts" in failures[0].reason
    line, = reward_failure_lines(4, failures, 3)
    assert line.startswith("step 4: reward function 'score' failed on 3 of 3 samples") and server.url in line


def test_server_timeout_fails_the_batch_and_says_so():
    with RewardServer(lambda number, body: (*length_rewards(number, body)[:2], 2.0)) as server:
        start = time.monotonic()
        _, total, failures = _score(server.url, timeout_s=0.3, max_retries=1)
    assert time.monotonic() - start < 1.9  # two tries of 0.3 s each, not the server's 2 s
    assert len(failures) == 3 and "no answer within 0.3 s" in failures[0].reason
    assert all(math.isnan(x) for x in total.tolist())


@pytest.mark.parametrize("payload, message", [
    (b"<html>not json</html>", "the response is not JSON"),
    ({"scores": [1, 2, 3]}, 'expected {"rewards"'),
    ({"rewards": [1.0, 2.0]}, "2 rewards for 3 completions"),
    ({"rewards": [1.0, "high", 2.0]}, "rewards[1] is 'high'"),
    ({"rewards": [1.0, True, 2.0]}, "rewards[1] is True"),
])
def test_malformed_responses_fail_without_retrying(payload, message):
    with RewardServer(lambda number, body: (200, payload, 0)) as server:
        _, total, failures = _score(server.url)
    assert len(server.requests) == 1 and len(failures) == 3 and message in failures[0].reason
    assert all(math.isnan(x) for x in total.tolist())


def test_a_client_error_is_not_retried():
    with RewardServer(lambda number, body: (400, {"detail": "bad column"}, 0)) as server:
        _, _, failures = _score(server.url)
    assert len(server.requests) == 1 and "HTTP 400" in failures[0].reason and "bad column" in failures[0].reason


def test_requests_split_by_batch_size_within_the_concurrency_limit():
    def slow(number, body):
        return 200, {"rewards": [float(len(c)) for c in body["completions"]]}, 0.2

    completions = [str(i) * (i % 4 + 1) for i in range(12)]
    with RewardServer(slow) as server:
        reward = ServerReward(server.url, batch_size=2, max_concurrency=3)
        values, failures = reward.score(["p"] * 12, completions, {"i": list(range(12))})
        reward.close()
    assert failures == [] and values == [float(len(c)) for c in completions]
    assert len(server.requests) == 6 and server.most_in_flight <= 3
    assert sorted(x for body, _ in server.requests for x in body["columns"]["i"]) == list(range(12))


def test_one_failed_request_fails_only_its_completions():
    def second_fails(number, body):
        if body["columns"]["i"][0] == 2:
            return 200, {"rewards": []}, 0
        return 200, {"rewards": [1.0] * len(body["completions"])}, 0

    with RewardServer(second_fails) as server:
        reward = ServerReward(server.url, batch_size=2, max_retries=0)
        values, failures = reward.score(["p"] * 5, ["a"] * 5, {"i": list(range(5))})
        reward.close()
    assert [i for i, _ in failures] == [2, 3] and values[:2] == [1.0, 1.0] and values[4] == 1.0


def test_server_entry_is_checked_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_TOKEN_VAR", raising=False)
    for entry, message in [
        ({"url": "ftp://host/x"}, "rewards[0].url"),
        ({"url": "http://user:pw@127.0.0.1:9/x"}, "without credentials"),
        ({"url": "http://127.0.0.1:9/x", "function": "r.py:f"}, "rewards[0].function"),
        ({"url": "http://127.0.0.1:9/x", "isolation": "process"}, "rewards[0].isolation"),
        ({"url": "http://127.0.0.1:9/x", "max_concurrency": 0}, "rewards[0].max_concurrency"),
        ({"url": "http://127.0.0.1:9/x", "auth_env": "Bearer abc"}, "rewards[0].auth_env"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_config(None, [f"rewards={json.dumps([entry])}"])
    with pytest.raises(RewardLoadError, match="NO_SUCH_TOKEN_VAR is not set"):
        RewardScorer.from_specs([RewardSpec(url="http://127.0.0.1:9/x", auth_env="NO_SUCH_TOKEN_VAR")])
    with RewardServer(length_rewards) as server:
        port = server.httpd.server_address[1]
    with pytest.raises(RewardLoadError, match=rf"rewards\[0\].url.*cannot connect to 127.0.0.1:{port}"):
        RewardScorer.from_specs([RewardSpec(url=f"http://127.0.0.1:{port}/score")])


def test_training_with_a_reward_server_counts_its_failures_per_step(tmp_path):
    """A GRPO run whose only reward is a server that fails every other request: the run goes on, each step's
    reward_failures counts the failed samples."""
    def every_other(number, body):
        if number % 2:
            return 500, b"down", 0
        return 200, {"rewards": [1.0 if c.strip() == str(a) else 0.0
                                 for c, a in zip(body["completions"], body["columns"]["answer"])]}, 0

    with RewardServer(every_other) as server:
        overrides = ["train.max_steps=2", "train.prompts_per_step=2", "grpo.num_generations=2",
                     "output.progress_bar=false", "output.report_to=[none]", "output.log_completions=0",
                     "data.num_examples=16", f"output.output_dir={tmp_path / 'out'}",
                     f"rewards={json.dumps([{'url': server.url, 'max_retries': 0}])}"]
        cfg = load_config(None, overrides, base=demo_config())
        from longrl.recipes.grpo import GRPOTrainer

        trainer = GRPOTrainer(cfg)
        history = trainer.train()
        trainer.scorer.close()
    assert [m["reward_failures"] for m in history] == [0, 4]
    assert "columns" in server.requests[0][0] and len(server.requests[0][0]["completions"]) == 4


# ------------------------------------------------------------------------------------------ return values

def _as_dict(prompts, completions, **kw):
    return {i: 1.0 for i in range(len(completions))}


def _as_str(prompts, completions, **kw):
    return "1" * len(completions)


def _as_number(prompts, completions, **kw):
    return 1.0


def _as_set(prompts, completions, **kw):
    return {1.0, 2.0}


def _as_tensor(prompts, completions, **kw):
    import torch

    return torch.ones(len(completions))


@pytest.mark.parametrize("fn, kind", [(_as_dict, "dict"), (_as_str, "str"), (_as_number, "float"), (_as_set, "set")])
def test_a_return_value_of_the_wrong_kind_fails_the_batch_naming_the_function(fn, kind):
    _, total, failures = RewardScorer([(fn.__name__, fn, 1.0)]).score(["p"] * 3, ["a", "b", "c"], {})
    assert all(math.isnan(x) for x in total.tolist()) and [f.sample for f in failures] == [0, 1, 2]
    assert failures[0].function == fn.__name__ and f"returned {kind}" in failures[0].reason


def test_sequences_arrays_tensors_and_iterators_are_rewards():
    import numpy as np

    def as_tuple(prompts, completions, **kw):
        return tuple(0.5 for _ in completions)

    def as_array(prompts, completions, **kw):
        return np.full(len(completions), 2.0)

    def as_generator(prompts, completions, **kw):  # read once, as TRL reads it
        return (0.25 for _ in completions)

    scorer = RewardScorer([("t", as_tuple, 1.0), ("a", as_array, 1.0), ("x", _as_tensor, 1.0),
                           ("g", as_generator, 1.0)])
    _, total, failures = scorer.score(["p"] * 2, ["a", "b"], {})
    assert failures == [] and total.tolist() == [3.75, 3.75]


def test_a_worker_reward_returning_a_dict_fails_naming_it(tmp_path):
    (tmp_path / "r.py").write_text("def as_dict(prompts, completions, **kw):\n"
                                   "    return {i: 1.0 for i in range(len(completions))}\n")
    scorer = RewardScorer.from_specs([RewardSpec(f"{tmp_path / 'r.py'}:as_dict", isolation="process")])
    try:
        _, total, failures = scorer.score(["p"] * 2, ["a", "b"], {})
    finally:
        scorer.close()
    assert all(math.isnan(x) for x in total.tolist()) and "returned dict" in failures[0].reason


# ------------------------------------------------------------------------------------------ names

def test_did_you_mean_for_a_misspelt_reward_function_or_file(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def exact_match(prompts, completions, **kw):\n    return [1.0]\n")
    with pytest.raises(RewardLoadError, match=r"has no attribute 'exact_mach'; did you mean 'exact_match'\?"):
        load_reward_function(f"{tmp_path / 'my_rewards.py'}:exact_mach")
    with pytest.raises(RewardLoadError, match=r"file not found: .*my_reward.py; did you mean 'my_rewards.py'\?"):
        load_reward_function(f"{tmp_path / 'my_reward.py'}:exact_match")
    with pytest.raises(RewardLoadError, match="has no attribute 'zzz'; its functions: exact_match"):
        load_reward_function(f"{tmp_path / 'my_rewards.py'}:zzz")
    with pytest.raises(RewardLoadError, match=r"did you mean 'exact_match'\?"):
        RewardScorer.from_specs([RewardSpec(f"{tmp_path / 'my_rewards.py'}:exact_mach", isolation="process")])


# ------------------------------------------------------------------------------------------ resume

REWARD_V1 = "def r(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n"


def test_a_reward_file_edited_since_the_checkpoint_is_refused_on_resume(tmp_path, capsys):
    (tmp_path / "rw.py").write_text(REWARD_V1)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(demo_config().to_yaml())
    base = ["train.max_steps=2", "train.prompts_per_step=2", "grpo.num_generations=2", "output.progress_bar=false",
            "output.report_to=[none]", "output.log_completions=0", "data.num_examples=16", "output.save_steps=1",
            f"output.output_dir={tmp_path / 'out'}",
            f"rewards={json.dumps([{'function': str(tmp_path / 'rw.py') + ':r'}])}"]
    assert main(["train", str(cfg_file), *base]) == 0
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    assert list(state["reward_files"]) == [str((tmp_path / "rw.py").resolve())]
    (tmp_path / "rw.py").write_text(REWARD_V1.replace("len(c)", "len(c) * 2"))
    capsys.readouterr()
    assert main(["train", str(cfg_file), *base, "output.resume=true", "train.max_steps=4"]) == 2
    err = capsys.readouterr().err
    assert "rw.py changed since" in err and "output.resume_changed_rewards=true" in err
    assert main(["train", str(cfg_file), *base, "output.resume=true", "train.max_steps=4",
                 "output.resume_changed_rewards=true"]) == 0
    assert (tmp_path / "out" / "checkpoint-4").is_dir()


def test_trl_api_takes_a_server_entry_of_the_config():
    from longrl import GRPOConfig
    from longrl.compat.trl import reward_scorer

    with RewardServer(length_rewards) as server:
        args = GRPOConfig(rewards=[{"url": server.url, "timeout_s": 5}], reward_weights=[0.5])
        assert (args.rewards[0].url, args.rewards[0].timeout_s, args.rewards[0].weight) == (server.url, 5.0, 0.5)
        scorer = reward_scorer(args, None, None)
        _, total, failures = scorer.score(PROMPTS, COMPLETIONS, COLUMNS)
        scorer.close()
    assert failures == [] and total.tolist()[0] == 0.5
