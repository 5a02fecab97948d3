"""The Triton decode attention's merge counters (rollout/decode_kernel.py): one int32 a (row, key head), on which
the fused merge's chunk programs count their arrivals; the program that merges puts its counter back to rest, so a
buffer kept from call to call (KVCache.counters) needs no fill. No Triton here: the KV cache allocates them on any
device."""

from __future__ import annotations

import torch

# the resting value: float32 −inf's int32 bits, so that the filled path's one torch.full(−inf) of the partials' m
# initialises the counters at its tail too
COUNT0 = -8388608  # 0xFF800000


def merge_counters(n: int, device) -> torch.Tensor:
    """int32 [n] at rest (COUNT0)."""
    return torch.full((n,), COUNT0, dtype=torch.int32, device=device)
