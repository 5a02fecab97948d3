"""Sequence-tiled MLPs in a model: each decoder layer's MLP intermediates exist one tile at a time.

``enable_mlp_tiling`` puts a :class:`~longrl.models.tiled_mlp.TiledMLP` (the tiling itself, its arithmetic and its
backward) in each ``mlp`` slot; ``disable_mlp_tiling`` puts the MLPs back. The wrapper shares the wrapped module's
children and parameters (models/shared_wrapper.py), so parameter and state-dict names (``...layers.0.mlp.gate_proj
.weight``) and PEFT adapters are unchanged, and a child replaced through either module (PEFT injecting LoRA after
tiling, merging before un-tiling) is seen by both. No library class is modified.

With tiles of t tokens the MLP's intermediates take O(t·I) memory instead of O(N·I) (MLP width I). What else a
layer holds grows as N·H, not N·I or N²: q/k/v/o and their LoRA inputs, norms, residuals, and attention through
SDPA/flash without a mask (one long sequence is plain causal; packed micro-batches, which need a mask, are capped
by the planner). Log-probs are chunked (ops/logprobs.py). So with tiles a layer's working set is ~(16 H + 2 K)·N
elements plus one tile, and the layer inputs (L·N·H) live in host memory (memory/offload.py).
"""

from __future__ import annotations

import logging

from torch import nn

from ..models.tiled_mlp import TiledMLP, check_tile_tokens

log = logging.getLogger(__name__)

# decoder layers that end in ``hidden_states = residual + self.mlp(hidden_states)`` (their MLP output's value is
# read by nothing in backward)
RESIDUAL_MLP_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")


def _mlp_slots(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(parent, module) for every child named ``mlp`` (one per decoder layer)."""
    return [(parent, child) for parent in model.modules() for name, child in parent.named_children() if name == "mlp"]


def enable_mlp_tiling(model: nn.Module, tile_tokens: int) -> int:
    """Tile every decoder layer's MLP of ``model`` (transformers or PEFT) in tiles of ``tile_tokens`` tokens.

    Idempotent: an already tiled MLP gets the new tile size. Mixture-of-experts blocks (an ``experts`` child)
    are left alone. Returns the number of tiled MLPs."""
    check_tile_tokens(tile_tokens)
    count = 0
    for parent, mlp in _mlp_slots(model):
        if isinstance(mlp, TiledMLP):
            mlp.tile_tokens = tile_tokens
        elif hasattr(mlp, "experts"):
            log.warning("MLP tiling skips the mixture-of-experts block %s", type(mlp).__name__)
            continue
        else:
            setattr(parent, "mlp", TiledMLP(mlp, tile_tokens, type(parent).__name__ in RESIDUAL_MLP_LAYERS))
        count += 1
    return count


def disable_mlp_tiling(model: nn.Module) -> int:
    """Put the original MLP modules back (with any children replaced meanwhile). Returns how many."""
    slots = [(parent, mlp) for parent, mlp in _mlp_slots(model) if isinstance(mlp, TiledMLP)]
    for parent, mlp in slots:
        mlp.inner.training = mlp.training
        setattr(parent, "mlp", mlp.inner)
    return len(slots)


def mlp_tile_tokens(model: nn.Module) -> int | None:
    """The tile size of ``model``'s tiled MLPs, or None when none is tiled."""
    return next((m.tile_tokens for _, m in _mlp_slots(model) if isinstance(m, TiledMLP)), None)
