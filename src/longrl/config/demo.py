"""The embedded demo runs, offline: a tiny Llama learns small-number arithmetic from scratch by GRPO (``arithmetic``),
or to call a lookup tool and use its answer over two turns (``tools``, tasks/tools.py)."""

from __future__ import annotations

import copy
from dataclasses import replace

from .schema import Config, DataConfig, EnvironmentConfig, GenerationConfig, GRPOLossConfig, LoraConfig, \
    ModelConfig, OutputConfig, RewardSpec, SFTSettings, TrainConfig


DEMO_TASKS = ("arithmetic", "tools", "vision")


def demo_config(task: str = "arithmetic") -> Config:
    if task == "tools":
        return tools_demo_config()
    if task == "vision":
        return vision_demo_config()
    return Config(
        model=ModelConfig(name_or_path="builtin:tiny-arith", dtype="float32", device="cpu"),
        lora=LoraConfig(enabled=False),
        data=DataConfig(source="task:arithmetic", num_examples=2000, max_prompt_length=16),
        generation=GenerationConfig(max_completion_length=4, temperature=1.0),
        grpo=GRPOLossConfig(num_generations=16, loss_type="dapo", beta=0.0, scale_rewards="group"),
        train=TrainConfig(max_steps=600, prompts_per_step=16, micro_batch_size=128, learning_rate=5e-4,
                          warmup_steps=5, max_grad_norm=1.0, seed=0),
        rewards=[RewardSpec("longrl.tasks.arithmetic:format_reward", 0.2),
                 RewardSpec("longrl.tasks.arithmetic:answer_reward", 0.8)],
        output=OutputConfig(output_dir="longrl-demo", logging_steps=10, save_steps=50),
    )


def tools_demo_config() -> Config:
    """The arithmetic demo's model, loss and schedule on two turns of one token each: call the lookup ('?'), then
    answer with what it returned (tasks/tools.py); shorter (150 steps), at a larger learning rate."""
    base = demo_config()
    return replace(
        base,
        data=replace(base.data, source="task:lookup", max_prompt_length=8),
        generation=replace(base.generation, max_completion_length=1),
        train=replace(base.train, max_steps=150, micro_batch_size=256, learning_rate=1e-3),
        rewards=[RewardSpec("longrl.tasks.tools:lookup_reward", 0.2),
                 RewardSpec("longrl.tasks.tools:answer_reward", 0.8)],
        environment=EnvironmentConfig(factory="longrl.tasks.tools:LookupEnvironment", max_turns=2, max_tokens=4),
        output=replace(base.output, output_dir="longrl-demo-tools"),
    )


def vision_demo_config() -> Config:
    """The arithmetic demo's loss and schedule for a tiny vision-language model (models/tiny_vision.py: a LLaVA
    from random weights) naming the colour of the one shape in a 28-pixel picture (task:shapes): the picture is the
    only way to the answer."""
    base = demo_config()
    return replace(
        base,
        model=replace(base.model, name_or_path="builtin:tiny-vision"),
        data=replace(base.data, source="task:shapes", max_prompt_length=16),
        generation=replace(base.generation, max_completion_length=3),
        train=replace(base.train, max_steps=250),
        rewards=[RewardSpec("longrl.tasks.shapes:format_reward", 0.2),
                 RewardSpec("longrl.tasks.shapes:answer_reward", 0.8)],
        output=replace(base.output, output_dir="longrl-demo-vision"),
    )


SFT_TASKS = {"task:shapes": "task:shapes_sft"}  # a demo's GRPO task → its warm start's (else arithmetic's)


def sft_warm_start_config(grpo: Config, steps: int = 60) -> Config:
    """The demo's supervised warm start (``longrl demo --sft``): the same model trained on correct answers
    (``task:arithmetic_sft``, or ``task:shapes_sft`` for the vision demo; drawn with another seed than the GRPO
    prompts) before GRPO starts from it."""
    cfg = copy.deepcopy(grpo)
    cfg.data = DataConfig(source=SFT_TASKS.get(grpo.data.source, "task:arithmetic_sft"), num_examples=2000,
                          max_prompt_length=16)
    cfg.sft = SFTSettings(max_length=16, examples_per_step=64, eval_examples=64)
    cfg.train = TrainConfig(max_steps=steps, micro_batch_size=128, learning_rate=2e-3, warmup_steps=5, seed=0)
    cfg.output = OutputConfig(output_dir=f"{grpo.output.output_dir}-sft", logging_steps=10, save_steps=0)
    return cfg
