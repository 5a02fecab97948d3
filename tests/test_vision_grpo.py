"""GRPO with images through the recipe (CPU): the vision demo learns; the vision tower runs once per prompt in a
step's rollout and passes (once per step when it is frozen); grouped rows (train.shared_prompt) give the step the
repeated layout gives; Gemma 3 samples through transformers' generate where the sampler cannot; multi-turn
environments open each episode with its row's images; a text model and transformers' generate for other families are
refused before the model loads."""

import json

import pytest
from test_shared_prompt_training import assert_same_metrics

from longrl.agents.environment import Environment
from longrl.config import ConfigError, load_config
from longrl.config.demo import demo_config
from longrl.models import base_model
from longrl.recipes.grpo import GRPOTrainer
from longrl.training.reporting import read_metrics

pytestmark = pytest.mark.filterwarnings("ignore")
QUICK = ["train.max_steps=2", "train.prompts_per_step=3", "grpo.num_generations=4", "train.micro_batch_size=5",
         "output.progress_bar=false", "output.tensorboard=false", "output.save_steps=0", "data.num_examples=32"]


def _cfg(tmp_path, *overrides):
    return load_config(None, QUICK + [f"output.output_dir={tmp_path}", *overrides], base=demo_config("vision"))


def _count_tower_calls(trainer) -> list[int]:
    calls = []
    base_model(trainer.model).model.vision_tower.register_forward_hook(lambda *a: calls.append(1))
    return calls


@pytest.mark.slow
def test_vision_demo_learns(tmp_path):
    """The vision demo (a random-weight tiny LLaVA, the colour of one shape in a 28-pixel picture): the 10-step mean
    reward starts near the 0.2 a format-only answer gets and ends at >= 0.8 (0.03 → 0.92 over 150 steps on torch
    2.13's CPU; the demo runs 250)."""
    cfg = load_config(None, [f"output.output_dir={tmp_path}", "output.progress_bar=false", "train.max_steps=200",
                             "output.tensorboard=false"], base=demo_config("vision"))
    GRPOTrainer(cfg).train()
    rewards = [m["reward"] for m in read_metrics(tmp_path)]
    start, end = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert start <= 0.25 and end >= 0.8, (start, end)


@pytest.mark.parametrize("lora, calls_expected", [(False, 3 + 3 + 2 * 3), (True, 3)])
def test_tower_runs_once_per_prompt(tmp_path, lora, calls_expected):
    """3 prompts × 4 completions, one rollout for two optimizer steps (grpo.num_iterations=2), micro-batches of
    whole groups: full weights (the tower trains) run it once per prompt in the rollout, in the old-policy pass and
    in each step's update; LoRA on the language model (the tower frozen) once per prompt in all: the rollout's
    features are kept for the passes."""
    cfg = _cfg(tmp_path, f"lora.enabled={str(lora).lower()}", "grpo.num_iterations=2", "train.micro_batch_size=8")
    trainer = GRPOTrainer(cfg)
    calls = _count_tower_calls(trainer)
    trainer.train()
    assert len(calls) == calls_expected
    assert len(read_metrics(tmp_path)) == 2


def test_grpo_step_with_kl_reference_and_images(tmp_path):
    """β > 0 with LoRA: the reference (adapters off) scores the same image prompts; the KL starts at 0."""
    trainer = GRPOTrainer(_cfg(tmp_path, "lora.enabled=true", "grpo.beta=0.1", "train.max_steps=1"))
    trainer.train()
    (metrics,) = read_metrics(tmp_path)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("overrides", [
    [],  # the demo's: full weights (the tower trains), micro-batches of 5 sequences that cut groups
    ["lora.enabled=true", "lora.r=4", "lora.vision_modules=tower_and_projector", "grpo.beta=0.05",
     "grpo.loss_type=grpo", "grpo.num_iterations=2", "train.micro_batch_tokens=120", "train.padding_free=true"],
])
def test_grouped_rows_with_images_give_the_same_steps(tmp_path, overrides):
    """The vision demo's steps with train.shared_prompt=true and =false: the same rewards, losses, KL and gradient
    norms, to float32 rounding (the tiny model computes in float32; float64 equality is
    tests/test_vision_shared_prompt.py's). Every prompt of task:shapes has the same tokens (one 28-pixel picture
    and "colour?"): only their images tell the groups apart."""
    runs, tower_calls = {}, {}
    for shared in ("false", "true"):
        trainer = GRPOTrainer(_cfg(tmp_path / shared, f"train.shared_prompt={shared}", *overrides))
        assert trainer.shared_prompt == (shared == "true")
        calls = _count_tower_calls(trainer)
        runs[shared] = trainer.train()
        tower_calls[shared] = len(calls)
    assert len(runs["true"]) == 2 and tower_calls["true"] == tower_calls["false"]
    assert {"loss", "grad_norm", "reward", "kl"} <= runs["true"][0].keys()
    assert_same_metrics(runs["true"], runs["false"])


@pytest.mark.parametrize("window, backend", [(6, "longrl"), (512, "hf")])
def test_gemma3_steps_sample_through_generate_where_the_sampler_cannot(tmp_path, window, backend):
    """A tiny Gemma 3 passed in with its processor (LoRA on the language model): a sliding window shorter than the
    run makes longrl's sampler give way to transformers' generate, which takes the prompts' images (as
    generation.backend=hf does); the step samples, scores and updates, the tower once per prompt."""
    from vision_models import build

    model, processor = build("gemma3", window=window)
    cfg = _cfg(tmp_path, "lora.enabled=true", "train.max_steps=1", f"generation.backend={backend}",
               "model.dtype=float32", "data.max_prompt_length=32")  # (its prompt: 29 tokens)
    trainer = GRPOTrainer(cfg, model=model, tokenizer=processor)
    assert trainer.sampler is None
    calls = _count_tower_calls(trainer)
    trainer.train()
    (metrics,) = read_metrics(tmp_path)
    assert metrics["reward"] == metrics["reward"] and metrics["loss"] == metrics["loss"]  # numbers
    assert len(calls) == 3  # the step's 3 prompts, once each: the frozen tower's features serve every pass


def _no_model_load(monkeypatch):
    import longrl.training.model_setup as model_setup

    monkeypatch.setattr(model_setup, "load_model", lambda *a, **k: pytest.fail("the model loaded first"))


@pytest.mark.parametrize("overrides, message", [
    (["model.name_or_path=builtin:tiny-arith"], "holds prompts with images, but model.name_or_path"),
    (["generation.backend=hf"], "generation.backend"),
])
def test_image_runs_refuse_what_they_cannot_do_before_the_model_loads(tmp_path, monkeypatch, overrides, message):
    _no_model_load(monkeypatch)
    with pytest.raises(ConfigError, match=message):
        GRPOTrainer(_cfg(tmp_path, *overrides))


class AgainEnvironment(Environment):
    """Answers the model's first turn with a user message asking again; the second turn ends the episode."""

    def step(self, assistant_message):
        self.turns = getattr(self, "turns", 0) + 1
        return [{"role": "user", "content": "again?"}] if self.turns == 1 else [], None, self.turns > 1


class TRLAgainEnvironment:
    """TRL's kind: reset(**row) adds text to the row's last user message (here a list of image and text parts)."""

    def reset(self, **row):
        return " Look closely."

    def check(self, answer: str) -> str:
        """Says whether an answer looks like a colour.

        Args:
            answer: the colour named
        """
        return "ok"


@pytest.mark.parametrize("factory", [AgainEnvironment, TRLAgainEnvironment])
def test_multi_turn_episodes_open_with_the_rows_images(tmp_path, factory):
    """Environments over prompts with images (the vision demo's tiny LLaVA, LoRA): each episode opens with its row's
    image, the G episodes of a row share one VisionPrompt (the frozen tower once per prompt in all), the second turn
    continues on the kept cache, and the training passes, given the same features, score the sampled tokens as the
    sampler did (float32)."""
    cfg = _cfg(tmp_path, "lora.enabled=true", "train.max_steps=1", "environment.max_turns=2",
               "environment.max_tokens=48", "generation.max_completion_length=16")
    trainer = GRPOTrainer(cfg, environment_factory=factory)
    calls = _count_tower_calls(trainer)
    trainer.train()
    (metrics,) = read_metrics(tmp_path)
    assert len(calls) == 3  # the step's 3 prompts
    assert metrics["sampler/logp_abs_diff"] < 1e-4
    b = trainer.batch
    assert b.vision is not None and all(v is b.vision[i - i % 4] for i, v in enumerate(b.vision))
    opening = b.prompts[0]
    assert sum(p.get("type") == "image" for m in opening for p in m["content"] if isinstance(m["content"], list)) == 1
    if factory is TRLAgainEnvironment:
        assert opening[-1]["content"][-1] == {"type": "text", "text": " Look closely."}
    else:
        assert metrics["agent/turns"] > 1 and any(m["role"] == "user" for c in b.completions for m in c)


def test_an_opening_whose_image_parts_the_row_cannot_fill_skips_the_row(tmp_path):
    """An environment whose reset opens the episode with two image parts for a row of one image: the row is skipped
    as a failed reset, the reason named (every row here, with the failure share allowed to be all)."""
    class TwoImages(AgainEnvironment):
        def reset(self, row):
            prompt = row["prompt"]
            return [{**prompt[0], "content": [{"type": "image"}, *prompt[0]["content"]]}, *prompt[1:]]

    cfg = _cfg(tmp_path, "lora.enabled=true", "train.max_steps=1", "environment.max_turns=2",
               "environment.max_reset_failure_share=1.0")
    trainer = GRPOTrainer(cfg, environment_factory=TwoImages)
    b = trainer._rollout_batch()
    assert all(ep.truncated == "reset_error" for ep in b.episodes)
    assert "2 image part(s) in its messages, but the row holds 1 image(s)" in b.episodes[0].error


def test_image_file_dataset_trains(tmp_path):
    """A JSONL dataset with image paths relative to it, read by the processor: two steps run and score."""
    from longrl.tasks.shapes import make_shape_rows

    rows = make_shape_rows(6, seed=3)
    lines = []
    for i, row in enumerate(rows):
        row["image"].save(tmp_path / f"img{i}.png")
        lines.append(json.dumps({"prompt": row["prompt"], "image": f"img{i}.png", "answer": row["answer"]}))
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    cfg = _cfg(tmp_path / "out", f"data.source={tmp_path / 'data.jsonl'}", "data.num_examples=null")
    GRPOTrainer(cfg).train()
    assert len(read_metrics(tmp_path / "out")) == 2


def test_init_task_vision_config_trains(tmp_path, capsys):
    """`longrl init --model DIR --task vision`: a vision-language model's starting config (lora.vision_modules, a
    longer prompt for image tokens, the context read from the text config) that trains on rows with image files."""
    from longrl.cli.main import main
    from longrl.models.tiny_vision import build_tiny_vision_model
    from longrl.tasks.shapes import make_shape_rows

    model, processor = build_tiny_vision_model(seed=0)
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    assert main(["init", "--model", str(tmp_path / "vlm"), "--task", "vision"]) == 0
    (tmp_path / "run.yaml").write_text(capsys.readouterr().out)
    lines = []
    for i, row in enumerate(make_shape_rows(4, seed=1)):
        row["image"].save(tmp_path / f"p{i}.png")
        lines.append(json.dumps({"prompt": "colour?", "image": f"p{i}.png", "answer": "3"}))
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.lora.vision_modules == "none" and cfg.lora.enabled
    assert cfg.data.max_prompt_length + cfg.generation.max_completion_length <= 256  # the text config's context
    assert main(["train", str(tmp_path / "run.yaml"), "train.max_steps=1", "train.prompts_per_step=2",
                 "generation.max_completion_length=4", "grpo.num_generations=2", f"output.output_dir={tmp_path / 'o'}",
                 "output.progress_bar=false", "output.report_to=[none]"]) == 0
    assert len(read_metrics(tmp_path / "o")) == 1


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_a_dataset_mixing_rows_with_and_without_images_trains(tmp_path, shared_prompt):
    """Rows without an image in a vision dataset are text prompts of the same model: a step mixing both samples,
    scores and updates (grouped rows too), and the tower runs once per prompt that has an image."""
    from longrl.tasks.shapes import make_shape_rows

    rows = make_shape_rows(8, seed=5)
    lines = []
    for i, row in enumerate(rows):
        line = {"prompt": row["prompt"], "answer": row["answer"]}
        if i % 2 == 0:
            row["image"].save(tmp_path / f"img{i}.png")
            line["image"] = f"img{i}.png"
        lines.append(json.dumps(line))
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    cfg = _cfg(tmp_path / "out", f"data.source={tmp_path / 'data.jsonl'}", "data.num_examples=null",
               "lora.enabled=true", "train.prompts_per_step=4", "data.shuffle=false", "train.max_steps=1",
               f"train.shared_prompt={str(shared_prompt).lower()}")
    trainer = GRPOTrainer(cfg)
    calls = _count_tower_calls(trainer)
    trainer.train()
    (metrics,) = read_metrics(tmp_path / "out")
    assert metrics["reward"] == metrics["reward"]  # a number: every completion scored
    assert len(calls) == 2  # the step's 4 prompts: rows 0 and 2 hold images (the tower frozen: once each)
