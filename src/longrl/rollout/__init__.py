"""Rollouts on the training weights: longrl's batched sampler (default) and transformers' ``generate``."""

from .hf_generate import generate_completions
from .sampler import Rollout, Sampler, SamplerUnsupported
from .sampling import SamplingParams

__all__ = ["Rollout", "Sampler", "SamplerUnsupported", "SamplingParams", "generate_completions"]
