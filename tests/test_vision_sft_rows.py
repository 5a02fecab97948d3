"""SFT rows with images (issue 44, item 5's data): image-and-text conversations and prompt / completion rows with an
image or images column, checked as prompt rows are (counts, files, sizes) before the model loads, and handed to a
vision-language model's processor as messages holding {"type": "image"} parts (data.sft_rows.image_rows)."""

import io
import json

import pytest
from PIL import Image

from longrl.config import SFTSettings, load_config
from longrl.config.schema import DataConfig
from longrl.data.errors import DataError
from longrl.data.images import open_images
from longrl.data.sft_rows import check_rows, image_rows, read_sft_rows, row_example

SETTINGS = SFTSettings()
GREEN = (30, 180, 30)
TEXT = {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]}


def _png_bytes(colour=GREEN) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (6, 6), colour).save(buf, "PNG")
    return buf.getvalue()


def _conversation(*user_parts):
    return [{"role": "user", "content": list(user_parts) or "What colour?"},
            {"role": "assistant", "content": [{"type": "text", "text": "green"}]}]


def test_conversations_and_prompt_completion_rows_with_images():
    rows = [
        {"messages": _conversation(), "image": _png_bytes()},
        {"messages": _conversation({"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}),
         "images": [_png_bytes(), _png_bytes((1, 2, 3))]},
        {"prompt": "What colour?", "completion": "green", "image": Image.new("RGB", (3, 3), GREEN)},
        {"prompt": [{"role": "user", "content": [{"type": "image"}]}],  # an image alone is a turn
         "completion": [{"role": "assistant", "content": "green"}], "images": [_png_bytes()]},
        TEXT,  # a row without images in a dataset with images: messages, no images
    ]
    assert check_rows(rows, SETTINGS, "d.jsonl") is rows
    first, second, plain, alone, text = image_rows(rows, SETTINGS, "d.jsonl")
    assert first["messages"][0]["content"] == [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    assert [len(r["images"]) for r in (first, second, plain, alone, text)] == [1, 2, 1, 1, 0]
    assert second["messages"][0]["content"][0] == {"type": "text", "text": "Compare"}  # given parts stay in place
    assert open_images(second["images"])[1].getpixel((0, 0)) == (1, 2, 3)
    question = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    assert plain["prompt"] == [{"role": "user", "content": question}]
    assert plain["completion"] == [{"role": "assistant", "content": [{"type": "text", "text": "green"}]}]
    assert alone["prompt"][0]["content"] == [{"type": "image"}]
    assert text["messages"][1]["content"] == [{"type": "text", "text": "5"}]
    assert image_rows([TEXT, TEXT], SETTINGS, "d.jsonl") is None  # a text dataset: build_examples, as before


BAD = [
    ({"messages": _conversation({"type": "image"}, {"type": "image"}), "image": _png_bytes()},
     r"'messages' holds 2 \{'type': 'image'\} part\(s\) but the row has 1 image\(s\) in its 'image' column"),
    ({"messages": _conversation({"type": "image"})}, r"'messages' holds 1 \{'type': 'image'\} part\(s\) but the row "
                                                     "has no images"),
    ({"prompt": [{"role": "user", "content": [{"type": "image"}]}], "completion": [{"role": "assistant",
                                                                                    "content": "x"}],
      "images": [_png_bytes(), _png_bytes()]}, r"'prompt' and 'completion' holds 1 .* has 2 image\(s\)"),
    ({"text": "green", "image": _png_bytes()}, "a dataset with images needs a 'messages' column or 'prompt' and "
                                               "'completion' columns"),
    ({"messages": [{"role": "user", "content": "What?"}], "image": _png_bytes()}, "no assistant message to train on"),
    ({"prompt": "What?", "completion": ["green"], "image": _png_bytes()},
     "prompt and completion must both be strings or both chat messages"),
    ({"messages": _conversation(), "image": _png_bytes()[:30]}, r", column 'image' \(30 bytes\): "),
]


@pytest.mark.parametrize("row,message", BAD)
def test_bad_image_rows_are_refused_naming_the_row(row, message):
    with pytest.raises(DataError, match=rf"^dataset 'd.jsonl' row 2.*{message}"):
        check_rows([{"messages": _conversation(), "image": _png_bytes()}, row], SETTINGS, "d.jsonl")


def test_files_resolve_against_the_dataset_and_the_size_limit_is_datas(tmp_path, monkeypatch):
    (tmp_path / "pics").mkdir()
    Image.new("RGB", (10, 10), GREEN).save(tmp_path / "pics" / "a.png")
    rows = [{"messages": _conversation(), "image": "pics/a.png"}, {"messages": _conversation(), "image": "pics/b.png"}]
    source = tmp_path / "d.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path / "pics")
    with pytest.raises(DataError, match=rf"row 2, column 'image' \(file {tmp_path}/pics/b.png\): file not found"):
        read_sft_rows(DataConfig(source=str(source)), SETTINGS)
    source.write_text(json.dumps(rows[0]) + "\n")
    assert len(read_sft_rows(DataConfig(source=str(source)), SETTINGS)) == 1
    with pytest.raises(DataError, match=r"10×10 = 100 pixels, more than data.max_image_pixels=99"):
        read_sft_rows(DataConfig(source=str(source), max_image_pixels=99), SETTINGS)


def test_the_tokenizer_path_refuses_image_rows():
    from test_sft import CHATML, _bpe_tokenizer

    with pytest.raises(DataError, match="row 1 holds images, but the model reads text only"):
        row_example(_bpe_tokenizer(CHATML), {"messages": _conversation(), "image": _png_bytes()}, SETTINGS, "row 1")


def test_the_sft_recipe_refuses_a_missing_image_before_the_model_loads(tmp_path, monkeypatch):
    from longrl.recipes import sft

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the images were read")

    monkeypatch.setattr(sft, "build_policy_model", no_model)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "colour?", "completion": "green", "image": "gone.png"}) + "\n")
    cfg = load_config(None, ["model.name_or_path=builtin:tiny-arith", "model.device=cpu", f"data.source={data}",
                             f"output.output_dir={tmp_path / 'out'}", "output.report_to=[none]"], recipe="sft")
    with pytest.raises(DataError, match=r"row 1, column 'image' \(file .*gone.png\): file not found"):
        sft.SFTTrainer(cfg)
