"""``longrl init``: a commented starting config for a real model on a GPU, in current GRPO practice
(``longrl init --sft``: one for supervised fine-tuning, :func:`render_sft`).

LoRA on (r 16, every linear layer), the model's own dtype on CUDA (bf16), the memory layout left to the planner,
DAPO's token-level loss without a KL term (beta 0, so no reference forward), 8 completions a prompt, clip-higher,
lr 1e-5 for LoRA. Keys that this version's tree lacks are left out, so ``longrl train`` and ``longrl plan``
accept the file as written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .keys import config_keys

TASKS = ("math", "code", "custom", "vision")
DEFAULT_MODEL = "Qwen/Qwen2.5-1.5B-Instruct"
DEFAULT_VISION_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"  # --task vision without --model

_TASK_DATA = {
    "math": ('one JSON object a line: {"prompt": "...", "answer": "42"} (chat prompts: a list of '
             '{"role", "content"} messages)'),
    "code": 'one JSON object a line: {"prompt": "...", "tests": "..."}: every column reaches the reward function',
    "custom": 'one JSON object a line with a "prompt" column; every other column reaches the reward functions',
    "vision": ('one JSON object a line: {"prompt": "How many cars?", "image": "pics/1.png", "answer": "3"} '
               '("images": [...] for several; paths relative to the data file: docs/vision.md)'),
}

_TASK_REWARDS = {
    "math": """\
  - function: longrl.rewards.answers:answer_reward   # 1 when the final answer (last \\boxed{} or number) is `answer`
    weight: 1.0""",
    "code": """\
  # your reward file, beside this config: def reward(prompts, completions, tests, **columns) -> list[float | None]
  # (run the model's code only in a sandbox: a separate process with limits, never in the training process)
  - function: rewards.py:reward
    weight: 1.0""",
    "custom": """\
  # your reward file, beside this config: def reward(prompts, completions, **columns) -> list[float | None]
  - function: rewards.py:reward
    weight: 1.0""",
    "vision": """\
  - function: longrl.rewards.answers:answer_reward   # 1 when the final answer (last \\boxed{} or number) is `answer`
    weight: 1.0""",
}

_COMPLETION = {"math": 1024, "code": 2048, "custom": 1024, "vision": 1024}
# prompt tokens: an image is a few hundred to a few thousand tokens (Qwen2.5-VL: a 1,024-pixel square, ~1,400)
_PROMPT = {"math": 512, "code": 512, "custom": 512, "vision": 2048}


def _model_entry(model: str) -> tuple[str, int | None]:
    """The model as written in the config (an existing directory as an absolute path) and its context length."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return model, None
    context = None
    config = path / "config.json"
    if config.is_file():
        try:
            settings = json.loads(config.read_text())
            # (a vision-language model's language model keeps it in its text_config)
            context = settings.get("max_position_embeddings") or \
                (settings.get("text_config") or {}).get("max_position_embeddings")
        except (OSError, ValueError):
            context = None
    return os.path.abspath(path), context


_GRPO_LAYOUT = """\
  # The memory layout (checkpointing, offloading, MLP tiles, token budgets) is left to the planner: `longrl plan`
  # prints what it chooses. Set model.offload_activations, model.gpu_resident_layers, train.micro_batch_tokens or
  # train.mlp_tile_tokens here only to pin a choice.
"""
_SFT_LAYOUT = """\
  # The memory layout (checkpointing, offloading, MLP tiles, packed token budgets) is left to the planner:
  # `longrl plan run.yaml --sft` prints what it chooses.
"""


def _model_and_lora(name: str, layout_note: str, lora_note: str, vision: bool = False) -> str:
    """The model and lora sections both starting configs share (LoRA r 16 on every linear layer); ``lora_note``
    ends the comment on lora.enabled; ``vision``: a vision-language model's lora.vision_modules line."""
    vision_line = ("  vision_modules: none            # the language model's layers only (projector, "
                   "tower_and_projector: more)\n") if vision else ""
    return f"""\
model:
  name_or_path: {json.dumps(name)}
  device: auto                    # cuda when there is one
  dtype: auto                     # bfloat16 on CUDA (float32 on the CPU)
  load_in_4bit: false             # true: NF4 base (QLoRA), a quarter of the weight memory
{layout_note}
lora:
  enabled: true                   # adapters on a frozen base{lora_note}
  r: 16
  alpha: 32
  dropout: 0.0
  target_modules: [all-linear]    # every linear layer but the LM head
{vision_line}"""


def _budget_line(keys: set) -> str:
    """train.gpu_memory_gib, when this version's config tree has it."""
    return ("  gpu_memory_gib: 0               # GPU memory this run may use (0: all that is free); e.g. 22 on a "
            "24 GB card\n") if "train.gpu_memory_gib" in keys else ""


def render(model: str | None = None, task: str = "math") -> str:
    """The YAML text of a starting config."""
    if task not in TASKS:
        raise ValueError(f"--task: one of {', '.join(TASKS)}; got {task!r}")
    model = model or (DEFAULT_VISION_MODEL if task == "vision" else DEFAULT_MODEL)
    name, context = _model_entry(model)
    prompt_len, completion_len = _PROMPT[task], _COMPLETION[task]
    if context and prompt_len + completion_len > context:  # a small model: split its context 1 : 2
        prompt_len, completion_len = max(1, context // 3), context - max(1, context // 3)
    keys = set(config_keys())
    run_name = Path(name).name or "model"
    budget = _budget_line(keys)
    report = "  report_to: tensorboard          # tensorboard, wandb or none\n" if "output.report_to" in keys else ""
    return f"""\
# longrl run config: `longrl init --model {model} --task {task}`
#   longrl plan run.yaml       the memory layout and predicted peaks (--gpu-memory-gib N for another GPU)
#   longrl train run.yaml      train; KEY=VALUE after the file overrides, e.g. train.max_steps=10
# Relative paths are read from this file's folder. Every key: docs/config.md.

{_model_and_lora(name, _GRPO_LAYOUT, "; the KL reference is the base with them disabled",
                 vision=task == "vision" and "lora.vision_modules" in keys)}
data:
  source: train.jsonl             # {_TASK_DATA[task]}
  prompt_column: prompt
  max_prompt_length: {prompt_len}         # longer prompts stop the run (data.overlong_prompt: truncate_left or skip)
  num_examples: null              # all rows
  shuffle: true

generation:
  max_completion_length: {completion_len}
  temperature: 1.0
  top_p: 1.0

grpo:
  num_generations: 8              # completions a prompt; advantages compare them
  loss_type: dapo                 # token-level, normalised by the step's completion tokens (no length bias)
  beta: 0.0                       # no KL term (no reference forward)
  epsilon: 0.2
  epsilon_high: 0.28              # DAPO's clip-higher: more room for rising probabilities
  scale_rewards: group
  num_iterations: 1               # updates a rollout batch

train:
  max_steps: 500
  prompts_per_step: 8             # 8 prompts × 8 completions an optimizer step
  learning_rate: 1.0e-5           # LoRA (full weights: ~1e-6)
  lr_scheduler_type: constant
  warmup_steps: 10
  weight_decay: 0.0
  max_grad_norm: 1.0
  seed: 0
{budget}
rewards:                          # TRL's signature: f(prompts, completions, **columns) -> list[float | None]
{_TASK_REWARDS[task]}

output:
  output_dir: runs/{run_name}-grpo
  logging_steps: 1
  save_steps: 50
  save_total_limit: 3             # the newest checkpoints kept
{report}"""


_SFT_LENGTH = 4096  # tokens an example may have, unless the model's context is shorter


def render_sft(model: str | None = None) -> str:
    """The YAML text of a starting config for ``longrl sft``: LoRA r 16 on every linear layer, the assistant's
    (or the completion's) tokens trained, one epoch at lr 1e-4 with a cosine schedule, the memory layout left to
    the planner. Keys that this version's tree lacks are left out."""
    name, context = _model_entry(model or DEFAULT_MODEL)
    max_length = min(_SFT_LENGTH, context) if context else _SFT_LENGTH
    keys = set(config_keys())
    run_name = Path(name).name or "model"
    epochs = ("  num_train_epochs: 1             # passes over the data; the run's steps follow from the number of "
              "examples\n                                  # (train.max_steps=N on the command line wins over it)\n"
              if "sft.num_train_epochs" in keys else "")
    steps = ("  # max_steps: 1000               # optimizer steps instead of sft.num_train_epochs (set that to null)"
             if epochs else "  max_steps: 1000                 # optimizer steps")
    budget = _budget_line(keys)
    return f"""\
# longrl supervised fine-tuning config: `longrl init --sft --model {model or DEFAULT_MODEL}`
#   longrl plan run.yaml --sft  the memory layout and predicted peaks (--gpu-memory-gib N for another GPU)
#   longrl sft run.yaml         train; KEY=VALUE after the file overrides, e.g. train.max_steps=10
#   longrl export out --from runs/{run_name}-sft --format gguf   then serve it (adapter and merged too)
# Then GRPO from the result, with a GRPO config (`longrl init --task math > grpo.yaml`):
#   longrl train grpo.yaml model.name_or_path=runs/{run_name}-sft   (its newest checkpoint, merged at load)
# Relative paths are read from this file's folder. Every key: docs/config.md; the formats: docs/sft.md.

{_model_and_lora(name, _SFT_LAYOUT, " (false: every weight, lr ~1e-5)")}
data:
  # one JSON object a line, any of: {{"messages": [{{"role": "user", "content": "..."}}, {{"role": "assistant", ...}}]}}
  # (rendered by the chat template), {{"prompt": "...", "completion": "..."}}, or {{"text": "..."}}
  source: train.jsonl
  num_examples: null              # all rows
  shuffle: true
  eval_source: null               # held-out rows for eval/loss; null: the last sft.eval_examples rows are held out

sft:
  max_length: {max_length}                # tokens an example may have
  overlong: truncate              # longer rows: keep the first max_length tokens (skip: drop them; error: stop)
  assistant_only_loss: true       # messages: train only the assistant's turns (located via the chat template)
  completion_only_loss: true      # prompt/completion: train only the completion
  text_column: text               # text rows: every token trained
  examples_per_step: 8            # examples an optimizer step (the loss: the mean over their trained tokens)
  label_smoothing: 0.0
  eval_examples: 64
{epochs}
train:
{steps}
  learning_rate: 1.0e-4           # LoRA (full weights: ~1e-5)
  lr_scheduler_type: cosine
  warmup_steps: 10
  weight_decay: 0.0
  max_grad_norm: 1.0
  seed: 0
{budget}
output:
  output_dir: runs/{run_name}-sft
  logging_steps: 1
  save_steps: 100
  eval_steps: 100                 # eval/loss and eval/perplexity on the held-out rows
  save_total_limit: 3             # the newest checkpoints kept
"""
