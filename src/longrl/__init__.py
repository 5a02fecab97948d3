"""longrl: GRPO-family reinforcement learning for long reasoning traces on a fraction of the GPU memory."""

from .config import Config, ConfigError, load_config
from .models import load_model
from .ops.logprobs import chunked_logprobs
from .trainer import GRPOTrainer

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "GRPOTrainer", "chunked_logprobs", "load_config", "load_model", "__version__"]
