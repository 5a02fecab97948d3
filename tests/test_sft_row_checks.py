"""SFT rows are checked before the model loads, naming the row (issue 41, item 7): roles, empty turns, the format;
message content given as a list of parts (the multimodal chat format) is trained as its text parts joined, as chat
templates render them, and an image part carrying its own image is refused (images come from the row's image
columns: test_vision_data.py); TRL's formatting_func errors name the row; TRL's
positional order given the wrong way round is refused with the right order."""

import json

import pytest
from test_sft import CHATML, _bpe_tokenizer

from longrl.config import ConfigError, SFTSettings, load_config
from longrl.data.prompts import DataError
from longrl.data.sft_rows import check_rows, checked_row, message_text, row_example

SETTINGS = SFTSettings()
CHAT = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "It is 5."}]


def test_text_parts_are_joined_as_templates_render_them():
    assert message_text("plain", "row 1") == "plain" and message_text(None, "row 1") is None
    parts = [{"type": "text", "text": "It is "}, {"type": "text", "text": "5."}]
    assert message_text(parts, "row 1") == "It is 5."


def test_a_list_of_text_parts_trains_exactly_as_the_same_string():
    """The issue's case: content [{"type": "text", "text": ...}] was trained as its Python repr."""
    tok = _bpe_tokenizer(CHATML)
    as_parts = [CHAT[0], {"role": "assistant", "content": [{"type": "text", "text": "It is "},
                                                          {"type": "text", "text": "5."}]}]
    pairs = (({"messages": as_parts}, {"messages": CHAT}),
             ({"prompt": [CHAT[0]], "completion": as_parts[1:]}, {"prompt": [CHAT[0]], "completion": CHAT[1:]}))
    for row, plain in pairs:
        got, want = row_example(tok, row, SETTINGS, "row 1"), row_example(tok, plain, SETTINGS, "row 1")
        assert got.input_ids == want.input_ids and got.loss_mask == want.loss_mask
        assert "'type'" not in tok.decode(got.input_ids)


BAD_ROWS = [  # (row, what the refusal says) — each needs no tokenizer
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"}]},
                   {"role": "assistant", "content": "a cat"}]}, "content part 1 is an image part holding image"),
    ({"messages": [{"role": "user", "content": 7}, CHAT[1]]}, "content must be a string or a list of parts"),
    ({"messages": [{"role": "assitant", "content": "hi"}]}, "message 1 has role 'assitant'; expected one of"),
    ({"messages": [CHAT[0], {"role": "assistant", "content": "  "}]}, r"message 2 \(assistant\) is empty"),
    ({"messages": [CHAT[0], {"role": "assistant", "content": []}]}, r"message 2 \(assistant\) is empty"),
    ({"messages": [{"role": "user"}]}, "message 1 is not a {'role', 'content'} message"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [CHAT[0]]}, "no assistant message to train on"),
    ({"prompt": "What is 2 plus 3?", "completion": ""}, "the completion is empty"),
    ({"prompt": "What is 2 plus 3?", "completion": CHAT[1:]}, "must both be strings or both chat messages"),
    ({"prompt": 3, "completion": "5"}, "must be strings or chat messages"),
    ({"question": "2+3"}, "expected a 'messages' column"),
]


@pytest.mark.parametrize("row,message", BAD_ROWS)
def test_bad_rows_are_refused_without_a_tokenizer_naming_the_row(row, message):
    rows = [{"messages": CHAT}, {"messages": CHAT}, row]
    with pytest.raises(DataError, match=rf"dataset 'd.jsonl' row 3: .*{message}"):
        check_rows(rows, SETTINGS, "d.jsonl")


def test_good_rows_pass_and_tool_call_turns_need_no_text():
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    tool_turn = [CHAT[0], {"role": "assistant", "content": None, "tool_calls": calls},
                 {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}]
    rows = [{"messages": tool_turn}, {"prompt": "2+3=", "completion": "5"}, {"text": "2+3=5"}]
    assert check_rows(rows, SETTINGS, "d.jsonl") is rows
    assert checked_row({"messages": tool_turn}, SETTINGS, "row 1")["messages"][1]["content"] is None


def _sft_config(tmp_path, rows):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(None, ["model.name_or_path=builtin:tiny-arith", "model.device=cpu", f"data.source={data}",
                              f"output.output_dir={tmp_path / 'out'}", "output.report_to=[none]",
                              "output.progress_bar=false"], recipe="sft")


@pytest.mark.parametrize("row,message", BAD_ROWS[:4] + BAD_ROWS[8:9])
def test_the_sft_recipe_refuses_bad_rows_before_the_model_loads(tmp_path, monkeypatch, row, message):
    from longrl.recipes import sft

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the rows were checked")

    monkeypatch.setattr(sft, "build_policy_model", no_model)
    cfg = _sft_config(tmp_path, [{"messages": CHAT}] * 3 + [row])
    with pytest.raises(DataError, match=rf"row 4: .*{message}"):
        sft.SFTTrainer(cfg)


def test_the_sft_command_exits_2_naming_the_row(tmp_path):
    import subprocess
    import sys

    cfg = _sft_config(tmp_path, [{"messages": CHAT}, BAD_ROWS[0][0]])
    path = tmp_path / "sft.yaml"
    path.write_text(cfg.to_yaml())
    out = subprocess.run([sys.executable, "-m", "longrl", "sft", str(path)], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 2 and "row 2: 'messages' message 1: content part 1" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_formatting_func_errors_name_the_row(tmp_path):
    """The issue's case: a formatting_func raising on row 4 gave a bare ValueError."""
    from longrl import SFTConfig, SFTTrainer

    def formatting(row):
        if row["q"] == "4":
            raise ValueError("no answer")
        return f"{row['q']}={row['a']}"

    rows = [{"q": str(i), "a": str(i)} for i in range(1, 6)]
    with pytest.raises(ConfigError, match=r"formatting_func on train_dataset row 4 raised ValueError: no answer"):
        SFTTrainer(model="builtin:tiny-arith", args=SFTConfig(output_dir=str(tmp_path / "x")), train_dataset=rows,
                   formatting_func=formatting)


def test_grpo_trainer_with_the_config_first_names_trls_order(tmp_path):
    """The issue's case: GRPOTrainer(GRPOConfig(...), "builtin:tiny-arith") raised an AttributeError."""
    from longrl import GRPOConfig, GRPOTrainer

    with pytest.raises(TypeError, match=r"TRL's positional order is the model first, "
                                        r"GRPOTrainer\('builtin:tiny-arith', reward_funcs, args, train_dataset\)"):
        GRPOTrainer(GRPOConfig(output_dir=str(tmp_path / "x")), "builtin:tiny-arith")


def test_trl_positional_order_is_named_for_sft_too(tmp_path):
    """SFTTrainer(SFTConfig(...), "builtin:tiny-arith"): TRL's order is the model first; the refusal says so."""
    from longrl import SFTConfig, SFTTrainer

    with pytest.raises(TypeError, match=r"TRL's positional order is the model first, "
                                        r"SFTTrainer\('builtin:tiny-arith', args, data_collator, train_dataset\)"):
        SFTTrainer(SFTConfig(output_dir=str(tmp_path / "x")), "builtin:tiny-arith")
    assert not (tmp_path / "x").exists()  # refused before anything is written
