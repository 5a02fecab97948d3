"""SFT on image-and-text conversations (issue 44, item 5): the processor's token ids and the loss mask (assistant
turns or the completion; image tokens never trained), the loss against transformers' forward with pixel values and
labels (float64, LLaVA, Qwen2-VL with mRoPE and Gemma 3 with its image blocks, packed and padded), `longrl sft` on a JSONL with image files and its
resume, the refusals, TRL's SFTTrainer with a processor, and `longrl demo --task vision --sft`."""

import json
import random
import shutil

import pytest
import torch
from vision_models import build, images, with_lora

from longrl.config import ConfigError, SFTSettings, load_config
from longrl.data.errors import DataError
from longrl.data.images import open_images
from longrl.data.sft_rows import check_rows, image_rows, row_example
from longrl.models.vision import image_token_id
from longrl.recipes.sft import step_loss
from longrl.tasks.shapes import COLOURS, QUESTION, draw_shape
from longrl.training.reporting import read_metrics
from longrl.training.vision_examples import conversation_example, example_prompts, vision_examples
from longrl.training.vision_inputs import PromptImages

pytestmark = pytest.mark.filterwarnings("ignore")
END = {"qwen2_vl": "<|im_end|>\n", "llava": "", "gemma3": "<end_of_turn>\n"}  # what each tiny template closes a
#                                                                                  turn with (jinja trims LLaVA's)
GRAD_TOL = 1e-6  # relative, as tests/test_vision_training.py (float32 RMSNorm inside the float64 models)


def _say(text):
    return [{"type": "text", "text": text}]


def _rows():
    """A vision dataset: a two-turn conversation with one image, a prompt/completion row with two, an image in an
    assistant turn, and a conversation without images."""
    pics = images(4, seed=5)
    return [
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "image"}, *_say("What?")]},
                      {"role": "assistant", "content": "A cat"},
                      {"role": "user", "content": "How many?"},
                      {"role": "assistant", "content": _say("Two")}], "image": pics[0]},
        {"prompt": "Same colour?", "completion": "no", "images": pics[1:3]},
        {"messages": [{"role": "user", "content": "Draw."},
                      {"role": "assistant", "content": [*_say("See "), {"type": "image"}]}], "image": pics[3]},
        {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]},
    ]


def _examples(family, settings=None, dtype=torch.float32, rows=None):
    settings = settings or SFTSettings()
    model, processor = build(family, seed=1, dtype=dtype, window=5)  # Gemma 3: a window shorter than the rows
    encoder = PromptImages(processor, model.config)
    rows = check_rows(rows or _rows(), settings, "d.jsonl")
    return model, encoder, vision_examples(encoder, image_rows(rows, settings, "d.jsonl"), settings, "d.jsonl")


def _trained_text(tokenizer, ex):
    return tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "gemma3"])
def test_loss_masks_train_assistant_tokens_and_never_image_tokens(family):
    model, encoder, examples = _examples(family)
    tok, end, image = encoder.processor.tokenizer, END[family], image_token_id(model.config)
    texts = [_trained_text(tok, e) for e in examples]
    assert texts[0] == f"A cat{end}Two{end}"  # both assistant turns and what closes them; system/user never
    assert texts[1] == f"no{end}"  # the completion only
    markers = {"qwen2_vl": "<|vision_start|><|vision_end|>",  # (Gemma 3's processor writes "\n\n" around an
               "gemma3": "<unk><start_of_image><end_of_image><unk>"}.get(family, "")  # image: <unk> to this tokenizer)
    assert texts[2] == f"See {markers}{end}"  # an image in the assistant's turn: its placeholders never train
    for e in examples:
        assert not any(m for t, m in zip(e.input_ids, e.loss_mask) if t == image)
    assert [len(e.images.sources) if e.images else 0 for e in examples] == [1, 2, 1, 0]
    assert examples[1].input_ids.count(image) > 2  # each image's placeholder expanded by the processor
    # the row without images trains as text does: the tokenizer path's ids and mask under the same template
    tok.chat_template = encoder.processor.chat_template
    text = row_example(tok, _rows()[3], SFTSettings(), "row 4")
    assert (examples[3].input_ids, examples[3].loss_mask[1:]) == (text.input_ids, text.loss_mask[1:])
    # every token but the images' placeholders (and the first) with the assistant-only settings off
    _, _, everything = _examples(family, SFTSettings(assistant_only_loss=False, completion_only_loss=False))
    for e in everything:
        assert e.loss_mask == [t > 0 and x != image for t, x in enumerate(e.input_ids)]


def _hf_cross_entropy(model, processor, ex, family):
    """(Σ CE of the trained tokens, transformers' own mean loss) from the model's forward on the example's ids (its
    pixel values from the processor) with labels."""
    if ex.images is None:
        inputs = {"input_ids": torch.tensor([ex.input_ids])}
    else:
        pics = open_images(ex.images.sources)
        enc = processor(text=[ex.images.text], images=pics, add_special_tokens=False, return_tensors="pt")
        cut = ("input_ids", "mm_token_type_ids", "token_type_ids")  # (the cut row)
        inputs = {k: v[:, :len(ex.input_ids)] if k in cut else v for k, v in enc.items() if k != "attention_mask"}
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.float64)
        assert inputs["input_ids"][0].tolist() == ex.input_ids
    labels = torch.tensor([[t if m else -100 for t, m in zip(ex.input_ids, ex.loss_mask)]])
    out = model(**inputs, labels=labels)
    logp = torch.log_softmax(out.logits[0, :-1].to(torch.float64), -1)  # [L-1, V]
    trained = labels[0, 1:] != -100
    ce = -logp[trained].gather(1, labels[0, 1:][trained][:, None])[:, 0]
    return ce.sum(), out.loss


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])
def test_sft_loss_equals_transformers_forward_with_pixel_values_float64(family):
    settings = SFTSettings(max_length=60, overlong="truncate")  # the two-turn row is cut after its image
    model, encoder, examples = _examples(family, settings, torch.float64)
    assert len(examples[0].input_ids) == 60 and examples[0].images.end < 60
    vision_modules = "tower_and_projector" if family == "gemma3" else "projector"  # (Gemma 3's: no nn.Linear)
    model = with_lora(model, vision_modules, seed=2)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    n_tokens = sum(sum(e.loss_mask) for e in examples)
    results = []
    for packed in (True, False):
        model.zero_grad()
        vision = example_prompts(encoder, examples)
        loss, n = step_loss(model, examples, [[0, 2], [1, 3]], pad_id=0, label_smoothing=0.0, chunk_size=7,
                            packed=packed, backward=True, vision=vision)
        results.append((loss, {k: p.grad.clone() for k, p in model.named_parameters() if k in trained}))
    assert n == n_tokens
    model.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    for e in examples:
        ce, hf_loss = _hf_cross_entropy(model, encoder.processor, e, family)
        torch.testing.assert_close(hf_loss.to(torch.float64), ce / sum(e.loss_mask[1:]), rtol=1e-5, atol=0)
        total = total + ce
    (total / n_tokens).backward()
    for loss, grads in results:
        assert abs(loss - float(total / n_tokens)) < 1e-10
        for k in trained:
            ref = model.get_parameter(k).grad
            assert float(ref.norm()) > 0 and float((grads[k] - ref).norm() / ref.norm()) < GRAD_TOL, k


def _vision_jsonl(folder, n=48):
    """A JSONL of shape pictures (PNG files beside it, relative paths): prompt/completion rows and conversations."""
    (folder / "pics").mkdir(parents=True)
    rng = random.Random(0)
    with open(folder / "train.jsonl", "w") as f:
        for i in range(n):
            colour = rng.choice(list(COLOURS))
            draw_shape(rng.choice(("circle", "square")), colour, 28, rng).save(folder / "pics" / f"{i}.png")
            if i % 2:
                row = {"prompt": QUESTION, "completion": colour, "image": f"pics/{i}.png"}
            else:
                row = {"messages": [{"role": "user", "content": [{"type": "image"}, *_say(QUESTION)]},
                                    {"role": "assistant", "content": colour}], "images": [f"pics/{i}.png"]}
            f.write(json.dumps(row) + "\n")
    return folder / "train.jsonl"


def _overrides(data, out, **over):
    keys = {"model.name_or_path": "builtin:tiny-vision", "model.device": "cpu", "model.dtype": "float32",
            "lora.enabled": "false", "data.source": str(data), "sft.max_length": 16, "sft.examples_per_step": 8,
            "sft.eval_examples": 0, "train.max_steps": 6, "train.learning_rate": 3e-3, "train.micro_batch_size": 4,
            "output.output_dir": str(out), "output.save_steps": 3, "output.report_to": "[none]",
            "output.progress_bar": "false", **over}
    return [f"{k}={v}" for k, v in keys.items()]


def test_longrl_sft_on_a_vision_jsonl_learns_and_resumes_exactly(tmp_path):
    from longrl.cli.main import main
    from longrl.recipes.sft import SFTTrainer

    data = _vision_jsonl(tmp_path / "data")
    (tmp_path / "sft.yaml").write_text("{}\n")
    overrides = _overrides(data, tmp_path / "cli", **{"train.max_steps": 12})
    assert main(["sft", str(tmp_path / "sft.yaml"), *overrides]) == 0
    losses = [m["loss"] for m in read_metrics(tmp_path / "cli")]
    assert len(losses) == 12 and sum(losses[-3:]) < 0.7 * sum(losses[:3])

    full = SFTTrainer(load_config(None, _overrides(data, tmp_path / "run"), recipe="sft"))
    assert full.images is not None and all(e.images is not None for e in full.examples)
    history = full.train()
    shutil.rmtree(tmp_path / "run" / "checkpoint-6")
    resumed = SFTTrainer(load_config(None, _overrides(data, tmp_path / "run", **{"output.resume": "true"}),
                                     recipe="sft"))
    again = resumed.train()
    assert [m["loss"] for m in again] == [m["loss"] for m in history[3:]]
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    # an image file changed on disk under the same name is another dataset: the resume is refused
    shutil.rmtree(tmp_path / "run" / "checkpoint-6")
    draw_shape("circle", "red", 28, random.Random(9)).save(tmp_path / "data" / "pics" / "0.png")
    with pytest.raises(ConfigError, match="data"):
        SFTTrainer(load_config(None, _overrides(data, tmp_path / "run", **{"output.resume": "true"}), recipe="sft"))


def test_refusals_name_the_key_or_the_row(tmp_path):
    from longrl import SFTConfig, SFTTrainer
    from longrl.compat.trl import sft_trainer_inputs
    from longrl.models.tiny import build_tiny_model

    data = _vision_jsonl(tmp_path / "data", n=4)
    with pytest.raises(ConfigError, match=r"config key 'data.source': .* holds examples with images, but "
                                          r"model.name_or_path='builtin:tiny-arith' reads text only"):
        SFTTrainer(load_config(None, _overrides(data, tmp_path / "a", **{"model.name_or_path": "builtin:tiny-arith"}),
                               recipe="sft"))
    text_model, tok = build_tiny_model()
    with pytest.raises(ConfigError, match="but the model passed in reads text only"):
        SFTTrainer(load_config(None, _overrides(data, tmp_path / "b"), recipe="sft"), model=text_model, tokenizer=tok)
    with pytest.raises(DataError, match=r"row 1: 9 tokens, more than sft.max_length=3, and its image tokens run to "
                                        r"token 4: sft.overlong=truncate would cut them"):
        SFTTrainer(load_config(None, _overrides(data, tmp_path / "c", **{"sft.max_length": 3}), recipe="sft"))
    with pytest.raises(ConfigError, match="formatting_func: train_dataset row 1 holds images"):
        sft_trainer_inputs((None, "builtin:tiny-vision", None, _rows(), None), args=SFTConfig(output_dir=str(tmp_path)),
                           formatting_func=lambda row: "text")
    # a template under which a turn's rendering is not a prefix of the whole conversation's tokens
    model, processor = build("llava", seed=1)
    processor.chat_template = processor.chat_template.replace("{% endfor %}{% if add_generation_prompt %}",
                                                              "{% if loop.last %}.{% endif %}{% endfor %}"
                                                              "{% if add_generation_prompt %}")
    row = image_rows(_rows()[:1], SFTSettings(), "d.jsonl")[0]
    with pytest.raises(DataError, match="row 1: the chat template's rendering of messages 1-2 is not a prefix"):
        conversation_example(PromptImages(processor, model.config), row, SFTSettings(), "row 1")


def test_trl_sft_trainer_with_a_processor_and_rows_with_images(tmp_path):
    from longrl import SFTConfig, SFTTrainer

    model, processor = build("qwen2_vl", seed=1)
    rows = _rows()
    args = SFTConfig(output_dir=str(tmp_path / "run"), max_steps=8, per_device_train_batch_size=4, learning_rate=1e-2,
                     report_to="none", save_steps=0, disable_tqdm=True, **{"model.device": "cpu"})
    trainer = SFTTrainer(model=model, processing_class=processor, train_dataset=rows, args=args)
    assert trainer.tokenizer is processor.tokenizer and trainer.images.processor is processor
    before = trainer.evaluate(eval_dataset=rows)["eval/loss"]
    history = trainer.train()
    assert history[-1]["loss"] < history[0]["loss"]
    assert trainer.evaluate(eval_dataset=rows)["eval/loss"] < before


def test_demo_task_vision_with_the_supervised_warm_start(tmp_path, capsys):
    from longrl.cli.main import main

    out = tmp_path / "demo"
    assert main(["demo", "--task", "vision", "--sft", "train.max_steps=3", f"output.output_dir={out}",
                 "output.save_steps=3", "output.report_to=[none]", "output.progress_bar=false"]) == 0
    printed = capsys.readouterr().out
    assert "warm start: 60 supervised steps" in printed
    saved = load_config(str(tmp_path / "demo-sft" / "config.yaml"), [], recipe="sft")
    assert (saved.model.name_or_path, saved.data.source) == ("builtin:tiny-vision", "task:shapes_sft")
    rewards = [m["reward"] for m in read_metrics(out)]
    assert len(rewards) == 3 and min(rewards) > 0.8  # GRPO starts from the warm start: the colours are known
