"""Prompt datasets (formats, chat prompts, overlong policy, errors) and reward scoring with failures."""

import json
import math

import pytest

from longrl.config.schema import DataConfig, RewardSpec
from longrl.data.prompts import DataError, PromptSampler, load_prompts
from longrl.models import build_char_tokenizer
from longrl.rewards import RewardLoadError, RewardScorer, load_reward_function

TOK = build_char_tokenizer()
ROWS = [{"prompt": "1+2=", "answer": 3}, {"prompt": "4+4=", "answer": 8}, {"prompt": "12+3=", "answer": 15}]


def _write(tmp_path, fmt, rows=ROWS):
    import pandas as pd

    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    elif fmt == "parquet":
        pd.DataFrame(rows).to_parquet(path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_file_formats(tmp_path, fmt):
    ds = load_prompts(DataConfig(source=str(_write(tmp_path, fmt))), TOK)
    assert len(ds) == 3 and ds.rows[1]["answer"] == 8
    assert ds.prompt_ids[0] == TOK("1+2=", add_special_tokens=False)["input_ids"]


def test_chat_prompts_use_the_template(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "2+2="}]}]
    ds = load_prompts(DataConfig(source=str(_write(tmp_path, "jsonl", rows))), TOK)
    assert TOK.decode(ds.prompt_ids[0]) == "2+2="


def test_task_source():
    ds = load_prompts(DataConfig(source="task:arithmetic", num_examples=50), TOK)
    assert len(ds) == 50 and all(r["prompt"].endswith("=") for r in ds.rows)


@pytest.mark.parametrize("cfg, message", [
    (dict(prompt_column="question"), "no prompt column 'question'"),
    (dict(source="missing.jsonl"), "dataset file not found: missing.jsonl"),
    (dict(source="task:calculus"), "unknown task 'calculus'"),
    (dict(max_prompt_length=4), "row 3: prompt has 5 tokens, more than data.max_prompt_length=4"),
])
def test_errors_name_the_problem(tmp_path, cfg, message):
    base = dict(source=str(_write(tmp_path, "jsonl")))
    with pytest.raises(DataError, match=message):
        load_prompts(DataConfig(**{**base, **cfg}), TOK)


def test_empty_dataset(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(DataError, match="empty|could not be read"):
        load_prompts(DataConfig(source=str(path)), TOK)


def test_bad_prompt_value(tmp_path):
    with pytest.raises(DataError, match="row 2: prompt must be"):
        load_prompts(DataConfig(source=str(_write(tmp_path, "jsonl", [{"prompt": "1+1="}, {"prompt": ""}]))), TOK)


def test_overlong_policies(tmp_path):
    src = str(_write(tmp_path, "jsonl"))
    truncated = load_prompts(DataConfig(source=src, max_prompt_length=4, overlong_prompt="truncate_left"), TOK)
    assert TOK.decode(truncated.prompt_ids[2]) == "2+3="
    skipped = load_prompts(DataConfig(source=src, max_prompt_length=4, overlong_prompt="skip"), TOK)
    assert [r["answer"] for r in skipped.rows] == [3, 8]


def test_sampler_is_deterministic_and_resumable():
    a = PromptSampler(7, seed=3)
    first = a.next(5) + a.next(5) + a.next(5)
    b = PromptSampler(7, seed=3)
    b.next(5)
    resumed = PromptSampler(7, seed=3, position=b.position)
    assert first[5:] == resumed.next(5) + resumed.next(5)
    assert sorted(first[:7]) == list(range(7))  # each epoch is a permutation


# ------------------------------------------------------------------------------------------------ rewards

def good(prompts, completions, answer, **kw):
    return [float(len(c)) + a for c, a in zip(completions, answer)]


def test_load_reward_from_file_and_module(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text("def r(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    assert load_reward_function(f"{f}:r")(["p"], ["c"]) == [1.0]
    assert load_reward_function("longrl.tasks.arithmetic:format_reward") is not None


@pytest.mark.parametrize("ref, message", [
    ("nofile.py:r", "file not found"),
    ("longrl.tasks.arithmetic:nope", "has no attribute 'nope'"),
    ("no_such_module_xyz:r", "cannot import module"),
    ("no_colon", "expected"),
])
def test_reward_load_errors(ref, message):
    with pytest.raises(RewardLoadError, match=message):
        load_reward_function(ref)


def test_scoring_weights_none_and_failures(caplog):
    def raises_on_second(prompts, completions, **kw):
        if any(c == "bad" for c in completions):
            raise RuntimeError("boom")
        return [0.5] * len(completions)

    def wrong_length(prompts, completions, **kw):
        return [1.0]

    def not_applicable_first(prompts, completions, **kw):
        return [None] + [2.0] * (len(completions) - 1)

    def non_number(prompts, completions, **kw):
        return ["x" if c == "c" else 1.0 for c in completions]

    prompts, completions = ["p"] * 3, ["a", "bad", "c"]
    columns = {"answer": [1, 2, 3]}
    scorer = RewardScorer([("good", good, 1.0), ("raises", raises_on_second, 2.0), ("na", not_applicable_first, 1.0)])
    with caplog.at_level("DEBUG", logger="longrl.rewards"):  # each failure at debug; callers sum them per step
        per_fn, total, failures = scorer.score(prompts, completions, columns)
    assert per_fn[0].tolist()[:2] == [2.0, 0.5] and math.isnan(per_fn[0, 2])
    assert total[0] == pytest.approx(2.0 + 1.0) and math.isnan(total[1]) and total[2] == pytest.approx(4 + 1 + 2)
    assert [(f.function, f.sample) for f in failures] == [("raises", 1)]
    assert "reward function 'raises' failed on sample 1: RuntimeError: boom" in caplog.text

    # wrong length for the batch: retried one sample at a time, where it returns 1 value each: no sample lost, and
    # no failure counted beside the per-function mean it gives
    _, total, failures = RewardScorer([("wrong_length", wrong_length, 1.0)]).score(prompts, completions, columns)
    assert not any(math.isnan(x) for x in total.tolist()) and failures == []

    _, total, failures = RewardScorer([("non_number", non_number, 1.0)]).score(prompts, completions, columns)
    assert math.isnan(total[2]) and not math.isnan(total[0]) and failures[0].sample == 2
    assert "expected a finite number" in failures[0].reason


def test_scorer_from_specs_missing_function():
    with pytest.raises(RewardLoadError, match="has no attribute"):
        RewardScorer.from_specs([RewardSpec("longrl.tasks.arithmetic:missing", 1.0)])
