from .microbatch import count_groups, token_budget_groups
from .offload import ActivationOffloader, enable_offloaded_checkpointing, offloaded_checkpoint

__all__ = ["ActivationOffloader", "count_groups", "enable_offloaded_checkpointing", "offloaded_checkpoint",
           "token_budget_groups"]
