"""A run's settings: the dataclass tree and its YAML loading (schema.py), size limits (limits.py), TRL's flat names
(trl_names.py), the generated key reference (docs.py), starter configs (starter.py) and the demo's (demo.py).

``from longrl.config import Config, load_config`` is the public face; the modules below it import nothing heavy."""

from .schema import (RESUMABLE_CHANGES, Config, ConfigError, DataConfig, DistributedConfig, EnvironmentConfig,
                     GenerationConfig, GRPOLossConfig, LoraConfig, ModelConfig, OutputConfig, RewardSpec, SFTSettings,
                     TrainConfig, config_keys, load_config, parse_overrides, resume_conflicts, suggest_key,
                     trajectory_tokens, validate)

__all__ = ["RESUMABLE_CHANGES", "Config", "ConfigError", "DataConfig", "DistributedConfig", "EnvironmentConfig",
           "GenerationConfig", "GRPOLossConfig", "LoraConfig", "ModelConfig", "OutputConfig", "RewardSpec",
           "SFTSettings", "TrainConfig", "config_keys", "load_config", "parse_overrides", "resume_conflicts",
           "suggest_key", "trajectory_tokens", "validate"]
