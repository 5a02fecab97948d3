"""The embedded demo runs, offline: a tiny Llama learns small-number arithmetic from scratch by GRPO (``arithmetic``),
or to call a lookup tool and use its answer over two turns (``tools``, tasks/tools.py)."""

from __future__ import annotations

from .config import Config, DataConfig, EnvironmentConfig, GenerationConfig, GRPOLossConfig, LoraConfig, \
    ModelConfig, OutputConfig, RewardSpec, TrainConfig



def demo_config(task: str = "arithmetic") -> Config:
    if task == "tools":
        return tools_demo_config()
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
    """Two turns of one token each: call the lookup ('?'), then answer with what it returned (tasks/tools.py)."""
    return Config(
        model=ModelConfig(name_or_path="builtin:tiny-arith", dtype="float32", device="cpu"),
        lora=LoraConfig(enabled=False),
        data=DataConfig(source="task:lookup", num_examples=2000, max_prompt_length=8),
        generation=GenerationConfig(max_completion_length=1, temperature=1.0),
        grpo=GRPOLossConfig(num_generations=16, loss_type="dapo", beta=0.0, scale_rewards="group"),
        train=TrainConfig(max_steps=150, prompts_per_step=16, micro_batch_size=256, learning_rate=1e-3,
                          warmup_steps=5, max_grad_norm=1.0, seed=0),
        rewards=[RewardSpec("longrl.tasks.tools:lookup_reward", 0.2),
                 RewardSpec("longrl.tasks.tools:answer_reward", 0.8)],
        environment=EnvironmentConfig(factory="longrl.tasks.tools:LookupEnvironment", max_turns=2, max_tokens=4),
        output=OutputConfig(output_dir="longrl-demo-tools", logging_steps=10, save_steps=50),
    )
