"""task:shapes, the vision demo's data (issue 44, item 7): pictures drawn in memory from the seed, one shape whose
colour is the answer, and its rewards."""

from collections import Counter

import pytest

from longrl.config import SFTSettings
from longrl.config.schema import DataConfig
from longrl.data.in_memory import rows_fingerprint
from longrl.data.prompts import image_prompts, read_prompt_rows
from longrl.data.sft_rows import check_rows, image_rows
from longrl.tasks import TASKS
from longrl.tasks.shapes import BACKGROUND, COLOURS, answer_reward, format_reward, make_shape_rows


def test_the_same_seed_draws_the_same_pictures():
    a, b, other = make_shape_rows(20, seed=3), make_shape_rows(20, seed=3), make_shape_rows(20, seed=4)
    assert [r["image"].tobytes() for r in a] == [r["image"].tobytes() for r in b]
    assert [r["answer"] for r in a] == [r["answer"] for r in b]
    assert [r["image"].tobytes() for r in a] != [r["image"].tobytes() for r in other]
    assert rows_fingerprint(a) == rows_fingerprint(b) != rows_fingerprint(other)


def test_each_picture_holds_one_shape_of_the_answers_colour():
    rows = make_shape_rows(200, seed=0, image_size=28)
    assert Counter(r["answer"] for r in rows).keys() == COLOURS.keys()
    assert len({r["shape"] for r in rows}) == 3
    for r in rows:
        assert r["image"].size == (28, 28) and r["image"].mode == "RGB"
        colours = {colour: count for count, colour in r["image"].getcolors()}
        assert set(colours) <= {BACKGROUND, COLOURS[r["answer"]]}  # no edge blending: no other colour
        assert colours[COLOURS[r["answer"]]] >= 25  # even the smallest triangle is plain to see
    assert make_shape_rows(1, image_size=56)[0]["image"].size == (56, 56)
    with pytest.raises(ValueError, match="image_size must be at least 8"):
        make_shape_rows(1, image_size=4)
    assert len({len(c) for c in COLOURS}) > 1 and len({c[0] for c in COLOURS}) == len(COLOURS)  # first letters differ


def test_the_task_source_gives_vision_prompts_and_sft_rows():
    cfg = DataConfig(source="task:shapes", num_examples=4)
    prompts = image_prompts(cfg, read_prompt_rows(cfg))
    assert [p.messages for p in prompts] == [[{"role": "user", "content": [{"type": "image"},
                                                                           {"type": "text", "text": "colour?"}]}]] * 4
    sft = TASKS["shapes_sft"](6, seed=0)
    assert check_rows(sft, SFTSettings(), "task:shapes_sft") is sft and sft[0]["completion"] in COLOURS
    assert all(len(r["images"]) == 1 for r in image_rows(sft, SFTSettings(), "task:shapes_sft"))


def test_rewards():
    completions = ["red", " blue", "re", "green", [{"role": "assistant", "content": "yellow"}], "red"]
    answers = ["red", "blue", "red", "red", "yellow", "red"]
    assert answer_reward(None, completions, answers) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    truncated = [False, False, False, False, False, True]
    assert format_reward(None, completions, truncated=truncated) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
