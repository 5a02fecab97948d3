from .microbatch import count_groups, token_budget_groups
from .offload import ActivationOffloader, enable_offloaded_checkpointing, keep_last_layers_whole, offloaded_checkpoint
from .tiling import TiledMLP, disable_mlp_tiling, enable_mlp_tiling

__all__ = ["ActivationOffloader", "TiledMLP", "count_groups", "disable_mlp_tiling", "enable_mlp_tiling",
           "enable_offloaded_checkpointing", "keep_last_layers_whole", "offloaded_checkpoint", "token_budget_groups"]
