"""The embedded default run: a tiny Llama learns small-number arithmetic from scratch by GRPO, offline."""

from __future__ import annotations

from .config import Config, DataConfig, GenerationConfig, GRPOLossConfig, LoraConfig, ModelConfig, OutputConfig, \
    RewardSpec, TrainConfig


def demo_config() -> Config:
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
