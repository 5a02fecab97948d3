"""Training data: prompt rows for GRPO (prompts.py) and supervised examples (sft_rows.py)."""

from .prompts import DataError, PromptDataset, PromptSampler, load_prompts, read_prompt_rows, read_rows

__all__ = ["DataError", "PromptDataset", "PromptSampler", "load_prompts", "read_prompt_rows", "read_rows"]
