"""longrl: GRPO-family reinforcement learning for long reasoning traces on a fraction of the GPU memory.

Names load on first use (module ``__getattr__``), so ``import longrl`` and ``longrl --help`` do not import torch.
"""

from __future__ import annotations

import importlib

from .allocator import default_allocator_settings

__version__ = "0.1.0"

default_allocator_settings()  # expandable segments unless the user configured the allocator (allocator.py)

# public name → the module that defines it
_LAZY = {
    "Config": "config", "ConfigError": "config", "load_config": "config",
    "GRPOConfig": "compat.trl_config", "GRPOTrainer": "compat.trl", "SFTConfig": "compat.trl_config", "SFTTrainer": "compat.trl",
    "Callback": "training.callbacks",
    "FastLanguageModel": "compat.unsloth", "FastVisionModel": "compat.unsloth", "load_model": "models", "chunked_logprobs": "ops.logprobs",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'longrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
