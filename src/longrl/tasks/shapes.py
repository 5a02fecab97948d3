"""Coloured shapes: a small picture of one shape, and the question of its colour (``task:shapes``, the vision demo).

Each row is ``{"prompt": "colour?", "image": <PIL image>, "answer": "red", "shape": "circle"}``: a square picture
(28 × 28 pixels by default: the tiny demo model's 2 × 2 patches of 14 px, read without resizing) on a grey
background holding one circle, square or triangle of random size and place, filled with one of four colours. The
prompt is the same for every row, so the picture is the only way to the answer.
The answers (red, green, blue, yellow) begin with four different letters: a character-level tokenizer decides the
answer at its first token. Everything is drawn from ``seed`` (same seed, same pixels); the images stay in memory.

Two rewards, both in [0, 1], weighted 0.2 / 0.8 as the arithmetic demo's:
  format_reward:   1 if the completion is one of the colour words and ends with EOS
  answer_reward:   1 for the row's colour, else 0
"""

from __future__ import annotations

import random

from ..rewards.answers import completion_text

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
SHAPES = ("circle", "square", "triangle")
BACKGROUND = (128, 128, 128)
QUESTION = "colour?"


def draw_shape(shape: str, colour: str, size: int, rng: random.Random):
    """A ``size`` × ``size`` RGB picture of one ``shape`` in ``colour``, between a third and three quarters of the
    picture wide, placed by ``rng``."""
    from ..data.images import pillow

    image_module = pillow()
    from PIL import ImageDraw

    image = image_module.new("RGB", (size, size), BACKGROUND)
    side = rng.randint(max(3, size // 3), max(3, size * 3 // 4))
    left, top = rng.randint(0, size - side), rng.randint(0, size - side)
    box = (left, top, left + side - 1, top + side - 1)
    draw = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(left + (side - 1) / 2, top), (left, top + side - 1), (left + side - 1, top + side - 1)],
                     fill=fill)
    return image


def make_shape_rows(num_examples: int, seed: int = 0, image_size: int = 28) -> list[dict]:
    """Rows ``{"prompt", "image", "answer", "shape"}`` drawn from ``seed`` (see the module's docstring)."""
    if image_size < 8:
        raise ValueError(f"image_size must be at least 8 pixels; got {image_size}")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        rows.append({"prompt": QUESTION, "image": draw_shape(shape, colour, image_size, rng), "answer": colour,
                     "shape": shape})
    return rows


def make_shape_sft_rows(num_examples: int, seed: int = 0, image_size: int = 28) -> list[dict]:
    """Supervised rows ``{"prompt", "completion", "image"}`` (the answer as the completion), another seed's pictures:
    a warm start for the vision demo."""
    return [{"prompt": r["prompt"], "completion": r["answer"], "image": r["image"]}
            for r in make_shape_rows(num_examples, seed + 7_919, image_size)]


def format_reward(prompts, completions, truncated=None, **kwargs) -> list[float]:
    """1 for a colour word that ends the completion (EOS came before the length limit)."""
    ended = truncated if truncated is not None else [False] * len(completions)
    return [1.0 if completion_text(c).strip() in COLOURS and not t else 0.0 for c, t in zip(completions, ended)]


def answer_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1 for the row's colour word (surrounding spaces ignored), else 0."""
    return [1.0 if completion_text(c).strip() == a else 0.0 for c, a in zip(completions, answer)]
