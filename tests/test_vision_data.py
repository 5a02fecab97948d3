"""Prompt rows with images (issue 44, item 2): TRL's image/images columns (paths resolved against the dataset file,
datasets.Image values, bytes, Pillow images), the {"type": "image"} parts placed by TRL's convention, every bad image
refused naming the row, column and file before the model loads, and fingerprints over the images' content. Images are
drawn in code and written to tmp files: no network."""

import hashlib
import io
import json

import pytest
from PIL import Image

from longrl.config.schema import DataConfig
from longrl.data.errors import DataError
from longrl.data.images import ImageSource, open_images, row_image_sources
from longrl.data.in_memory import rows_fingerprint
from longrl.data.prompts import data_fingerprint, image_prompts, load_prompts, read_prompt_rows
from longrl.models import build_char_tokenizer
from longrl.models.files import file_sha256

RED, BLUE = (200, 30, 30), (30, 30, 200)


def _png(path, colour=RED, size=(8, 8)):
    Image.new("RGB", size, colour).save(path)
    return path


def _png_bytes(colour=RED, size=(8, 8), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, colour if mode == "RGB" else 128).save(buf, "PNG")
    return buf.getvalue()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(source, **kw):
    return DataConfig(source=str(source), **kw)


def _encode(messages, images):
    """A stand-in for a processor: one id per text character, four per image."""
    ids = []
    for m in messages:
        for part in m["content"]:
            ids += [1] * 4 if part["type"] == "image" else [2] * len(part["text"])
    assert sum(p["type"] == "image" for m in messages for p in m["content"]) == len(images)
    assert all(isinstance(im, Image.Image) and im.mode == "RGB" for im in images)
    return ids


# ----------------------------------------------------------------------------- formats


def test_relative_paths_resolve_against_the_dataset_files_folder(tmp_path, monkeypatch):
    (tmp_path / "data" / "pics").mkdir(parents=True)
    _png(tmp_path / "data" / "pics" / "a.png", RED)
    _png(tmp_path / "data" / "pics" / "b.png", BLUE, (6, 4))
    source = _jsonl(tmp_path / "data" / "d.jsonl", [{"prompt": "colour?", "image": "pics/a.png"},
                                                    {"prompt": "colours?", "images": ["pics/a.png", "pics/b.png"]}])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the dataset's folder
    cfg = _cfg(source)
    ds = load_prompts(cfg, None, rows=read_prompt_rows(cfg), encode_images=_encode)
    assert [len(i) for i in ds.images] == [1, 2]
    opened = open_images(ds.images[1])
    assert opened[0].getpixel((0, 0)) == RED and opened[1].size == (6, 4) and opened[1].getpixel((0, 0)) == BLUE
    assert ds.images[1][1].path == tmp_path / "data" / "pics" / "b.png"
    assert ds.prompt_ids[0] == [1] * 4 + [2] * len("colour?")


def test_absolute_paths_and_a_text_prompt_become_one_user_message(tmp_path):
    a, b = _png(tmp_path / "a.png"), _png(tmp_path / "b.png", BLUE)
    rows = [{"prompt": "which?", "images": [str(a), str(b)]}]
    [prepared] = image_prompts(_cfg("memory:x"), read_prompt_rows(_cfg("memory:x"), rows=rows))
    assert prepared.messages == [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                              {"type": "text", "text": "which?"}]}]
    assert [s.path for s in prepared.images] == [a, b]


def test_image_parts_go_to_the_first_user_message_and_given_parts_stay(tmp_path):
    rows = [
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What colour?"}],
         "image": _png_bytes()},
        {"prompt": [{"role": "user", "content": [{"type": "text", "text": "Left:", "image": None},
                                                 {"type": "image", "text": None},
                                                 {"type": "text", "text": "right:"}, {"type": "image"}]}],
         "images": [_png_bytes(), _png_bytes(BLUE)]},
    ]
    first, second = image_prompts(_cfg("memory:x"), read_prompt_rows(_cfg("memory:x"), rows=rows))
    question = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    assert first.messages == [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                              {"role": "user", "content": question}]
    assert second.messages[0]["content"] == [{"type": "text", "text": "Left:"}, {"type": "image"},
                                             {"type": "text", "text": "right:"}, {"type": "image"}]
    assert open_images(second.images)[1].getpixel((3, 3)) == BLUE


def test_datasets_image_features_from_parquet_and_in_memory(tmp_path):
    import datasets

    from longrl.data.in_memory import dataset_rows

    a = _png(tmp_path / "a.png", BLUE)
    ds = datasets.Dataset.from_dict({"prompt": ["p1", "p2"], "image": [str(a), str(a)]})
    ds = ds.cast_column("image", datasets.Image())
    ds.to_parquet(str(tmp_path / "d.parquet"))
    cfg = _cfg(tmp_path / "d.parquet")
    prompts = image_prompts(cfg, read_prompt_rows(cfg))
    assert open_images(prompts[1].images)[0].getpixel((0, 0)) == BLUE
    undecoded = dataset_rows(ds.cast_column("image", datasets.Image(decode=False)), "train_dataset")
    assert isinstance(undecoded[0]["image"], dict)
    for rows in (dataset_rows(ds, "train_dataset"), undecoded):
        prompts = image_prompts(_cfg("memory:x"), read_prompt_rows(_cfg("memory:x"), rows=rows))
        assert open_images(prompts[0].images)[0].getpixel((0, 0)) == BLUE
    as_bytes = {"bytes": _png_bytes(RED), "path": "lost/original.png"}  # bytes win over a path that is gone
    [source] = row_image_sources({"image": as_bytes}, "row 1", None)[1]
    assert source.open().getpixel((0, 0)) == RED and "original.png" in source.describe()


def test_modes_and_exif_orientation_are_normalised():
    grey = ImageSource("row 1", 100, data=_png_bytes(mode="L"))
    assert grey.open().mode == "RGB"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90°: transformers' load_image turns it upright
    buf = io.BytesIO()
    Image.new("RGB", (4, 2), RED).save(buf, "PNG", exif=exif)
    assert ImageSource("row 1", 100, data=buf.getvalue()).open().size == (2, 4)


# ----------------------------------------------------------------------------- errors


def _noise_png(path, size=64):
    import random

    rng = random.Random(0)
    image = Image.new("RGB", (size, size))
    image.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(size * size)])
    image.save(path)
    return path


def _bad_cases(tmp_path):
    """(row, the error's text after the row's name) for the third row of a dataset in tmp_path."""
    truncated = tmp_path / "truncated.png"
    data = _noise_png(tmp_path / "noise.png").read_bytes()
    truncated.write_bytes(data[:len(data) * 2 // 3])
    (tmp_path / "text.png").write_text("not an image at all")
    _png(tmp_path / "big.png", size=(80, 70))
    one = "pics/missing.png"
    return [
        ({"prompt": "q", "image": one}, rf", column 'image' \(file {tmp_path}/pics/missing.png\): file not found"),
        ({"prompt": "q", "images": ["noise.png", "truncated.png"]},
         r", column 'images' image 2 \(file .*truncated.png\): truncated or corrupt image"),
        ({"prompt": "q", "image": "text.png"}, r", column 'image' \(file .*text.png\): not an image Pillow can read"),
        ({"prompt": "q", "image": "https://example.com/cat.png"}, r", column 'image': 'https://example.com/cat.png' "
                                                                  "is a URL; runs read images offline"),
        ({"prompt": "q", "image": "big.png"}, r", column 'image' \(file .*big.png\): 80×70 = 5,600 pixels, more than "
                                              "data.max_image_pixels=5,000"),
        ({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], "image": "noise.png"},
         r": 'prompt' holds 2 \{'type': 'image'\} part\(s\) but the row has 1 image\(s\) in its 'image' column"),
        ({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}],
          "images": ["noise.png", "noise.png", "noise.png"]},
         r": 'prompt' holds 1 \{'type': 'image'\} part\(s\) but the row has 3 image\(s\) in its 'images' column"),
        ({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}]},
         r": 'prompt' holds 1 \{'type': 'image'\} part\(s\) but the row has no images"),
        ({"prompt": [{"role": "user", "content": [{"type": "image", "image": "noise.png"}]}]},
         r": 'prompt' message 1: content part 1 is an image part holding image; give \{'type': 'image'\} placeholders"),
        ({"prompt": [{"role": "user", "content": [{"type": "video"}]}], "image": "noise.png"},
         r": 'prompt' message 1: content part 1 is \{'type': 'video'\}; expected a text part"),
        ({"prompt": "q", "image": "noise.png", "images": ["noise.png"]}, r": both the 'image' and the 'images' column"),
        ({"prompt": "q", "image": ["noise.png"]}, r", column 'image': holds a list of 1; the 'image' column holds one"),
        ({"prompt": "q", "images": "noise.png"}, r", column 'images': must be a list of images; got str"),
        ({"prompt": "q", "image": 7}, r", column 'image': expected an image \(a file path, bytes"),
        ({"prompt": [{"role": "system", "content": "s"}], "image": "noise.png"},
         r": 'prompt' holds no user message to put the row's 1 image\(s\) in"),
    ]


def test_each_bad_image_or_part_is_refused_naming_the_row_column_and_file(tmp_path):
    _png(tmp_path / "ok.png")
    for row, message in _bad_cases(tmp_path):
        source = _jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "image": "ok.png"}, {"prompt": "q"}, row])
        with pytest.raises(DataError, match=rf"^dataset '{source}' row 3{message}"):
            read_prompt_rows(_cfg(source, max_image_pixels=5000))


def test_raw_bytes_that_are_no_image_name_the_row(tmp_path):
    rows = [{"prompt": "q", "image": _png_bytes()}, {"prompt": "q", "images": [_png_bytes(), b"\x00junk" * 10]}]
    with pytest.raises(DataError, match=r"^dataset 'memory:x' row 2, column 'images' image 2 \(50 bytes\): not an "
                                        "image Pillow can read"):
        read_prompt_rows(_cfg("memory:x"), rows=rows)


@pytest.mark.parametrize("side,message", [
    (8_000, r"8000×8000 = 64,000,000 pixels, more than data.max_image_pixels=50,000,000"),
    (14_000, r"more pixels than data.max_image_pixels=50,000,000 \(Pillow: Image size \(196000000 pixels\)")])
def test_the_size_limit_reads_only_the_header(side, message):
    """A few kB of PNG that would decode to tens of millions of pixels (a decompression bomb): refused from the
    header, by longrl's limit or, past twice its own, by Pillow's."""
    bomb = io.BytesIO()
    Image.new("1", (side, side)).save(bomb, "PNG")
    with pytest.raises(DataError, match=message):
        ImageSource("row 1", 50_000_000, data=bomb.getvalue()).open()


def test_without_pillow_the_error_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(DataError, match=r"need Pillow: pip install 'longrl\[vision\]'"):
        ImageSource("row 1", 100, data=b"x").open()


def test_the_config_key_is_checked():
    from longrl.config import ConfigError, load_config

    assert load_config(None, [], recipe="sft").data.max_image_pixels == 50_000_000
    with pytest.raises(ConfigError, match="data.max_image_pixels"):
        load_config(None, ["data.max_image_pixels=0"], recipe="sft")


# ----------------------------------------------------------------------------- load_prompts


def test_a_vision_dataset_needs_an_encoder_and_is_never_cut(tmp_path):
    rows = [{"prompt": "short", "image": _png_bytes()}, {"prompt": "a much longer prompt", "image": _png_bytes()},
            {"prompt": "text only"}]
    cfg = _cfg("memory:x", max_prompt_length=12)
    with pytest.raises(DataError, match="row 1 holds images, but the model reads text only"):
        load_prompts(cfg, build_char_tokenizer(), rows=rows)
    with pytest.raises(DataError, match=r"row 2: prompt has 24 tokens, .*; a prompt with images is never cut; raise "
                                        "it, or set data.overlong_prompt to skip"):
        load_prompts(_cfg("memory:x", max_prompt_length=12, overlong_prompt="truncate_left"), None, rows=rows,
                     encode_images=_encode)
    ds = load_prompts(_cfg("memory:x", max_prompt_length=12, overlong_prompt="skip"), None, rows=rows,
                      encode_images=_encode)
    assert [r["prompt"] for r in ds.rows] == ["short", "text only"]  # images and messages stay aligned with rows
    assert [len(i) for i in ds.images] == [1, 0]
    assert ds.messages[1] == [{"role": "user", "content": [{"type": "text", "text": "text only"}]}]


def test_a_text_dataset_is_read_and_fingerprinted_as_before(tmp_path):
    rows = [{"prompt": "1+2=", "answer": 3}, {"prompt": [{"role": "user", "content": "2+2="}], "answer": 4}]
    source = _jsonl(tmp_path / "d.jsonl", rows)
    tok = build_char_tokenizer()
    ds = load_prompts(_cfg(source), tok)
    assert ds.images is None and ds.messages is None and image_prompts(_cfg(source), rows) is None
    assert ds.prompt_ids[0] == tok("1+2=", add_special_tokens=False)["input_ids"]
    assert data_fingerprint(str(source)) == data_fingerprint(str(source), rows) == file_sha256(source)
    before = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert rows_fingerprint(rows) == f"2-rows-{before}"


# ----------------------------------------------------------------------------- fingerprints


def test_fingerprints_follow_the_images_content_not_the_objects(tmp_path):
    def rows(colour):
        return [{"prompt": "q", "image": Image.new("RGB", (4, 4), RED)},
                {"prompt": "q", "images": [_png_bytes(colour)]}]

    assert rows_fingerprint(rows(BLUE)) == rows_fingerprint(rows(BLUE))  # other objects, same pixels
    assert rows_fingerprint(rows(BLUE)) != rows_fingerprint(rows(RED))
    changed = rows(BLUE)
    changed[0]["image"].putpixel((1, 1), BLUE)
    assert rows_fingerprint(changed) != rows_fingerprint(rows(BLUE))

    picture = _png(tmp_path / "a.png")
    by_path = [{"prompt": "q", "image": str(picture)}]
    source = _jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "image": "a.png"}])
    memory_before = rows_fingerprint(by_path)
    file_before = data_fingerprint(str(source), read_prompt_rows(_cfg(source)))
    assert file_before != file_sha256(source)
    refused = [{"prompt": "q", "image": "https://example.com/a.png"}]  # the checks refuse it, naming the dataset
    assert rows_fingerprint(refused) != rows_fingerprint([{"prompt": "q", "image": "https://example.com/b.png"}])
    _png(picture, BLUE)  # the same path, another picture
    assert rows_fingerprint(by_path) != memory_before
    assert data_fingerprint(str(source), read_prompt_rows(_cfg(source))) != file_before


# ----------------------------------------------------------------------------- before the model loads


def test_grpo_refuses_a_bad_image_in_rows_given_in_memory_before_the_model_loads(tmp_path, monkeypatch):
    from longrl import GRPOConfig, GRPOTrainer
    from longrl.recipes import grpo

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the images were read")

    monkeypatch.setattr(grpo, "build_policy_model", no_model)
    rows = [{"prompt": "colour?", "image": Image.new("RGB", (4, 4), RED), "answer": "red"},
            {"prompt": "colour?", "image": _png_bytes()[:40], "answer": "red"}]
    with pytest.raises(DataError, match=r"row 2, column 'image' \(40 bytes\): (not an image|truncated)"):
        GRPOTrainer(model="builtin:tiny-arith", reward_funcs="longrl.tasks.shapes:answer_reward",
                    args=GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none"), train_dataset=rows)
