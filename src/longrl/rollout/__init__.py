from .hf_generate import Rollout, generate_completions

__all__ = ["Rollout", "generate_completions"]
