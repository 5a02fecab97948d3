"""A run's settings. One module a job:

- ``schema``: the dataclass tree (each field's type, default and ``# meaning``), ``to_yaml``, ``trajectory_tokens``
- ``errors``: ``ConfigError``, raised naming the dotted key
- ``loading``: YAML file + ``KEY=VALUE`` overrides → typed values → ``load_config``
- ``validation``: ``validate``, one check function per section
- ``keys``: the dotted key list, "did you mean" suggestions, TRL's flat names, what a resumed run may change
- ``limits``: host-memory floors; ``trl_names``: TRL's flat names; ``docs``: docs/config.md; ``starter``, ``demo``:
  ready-made configs

``from longrl.config import Config, load_config`` is the public face. The package imports nothing of longrl outside
itself and nothing heavy (no torch)."""

from .errors import ConfigError
from .keys import RESUMABLE_CHANGES, config_keys, resume_conflicts, suggest_key
from .loading import load_config, parse_overrides
from .schema import (Config, DataConfig, DistributedConfig, EnvironmentConfig, GenerationConfig, GRPOLossConfig,
                     LoraConfig, ModelConfig, OutputConfig, RewardSpec, SFTSettings, TrainConfig, trajectory_tokens)
from .validation import validate

__all__ = ["RESUMABLE_CHANGES", "Config", "ConfigError", "DataConfig", "DistributedConfig", "EnvironmentConfig",
           "GenerationConfig", "GRPOLossConfig", "LoraConfig", "ModelConfig", "OutputConfig", "RewardSpec",
           "SFTSettings", "TrainConfig", "config_keys", "load_config", "parse_overrides", "resume_conflicts",
           "suggest_key", "trajectory_tokens", "validate"]
