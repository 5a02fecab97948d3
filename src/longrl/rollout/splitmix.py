"""splitmix64's finaliser constants, and the finaliser on a Python integer (modulo 2⁶⁴): the host's side of the
sampler's counter-based uniforms (rollout/sampling.py's tensor twin and rollout/sampling_kernel.py's Triton kernel
use the same constants)."""

from __future__ import annotations

GOLDEN, MIX1, MIX2 = (0x9E3779B97F4A7C15 - 2 ** 64, 0xBF58476D1CE4E5B9 - 2 ** 64,
                      0x94D049BB133111EB - 2 ** 64)  # as signed int64 (torch's integer tensors)


def splitmix64_int(x: int) -> int:
    """splitmix64's finaliser on a Python integer, modulo 2⁶⁴ (the seed's hash, computed once on the host for
    sampling_kernel.uniform_triton)."""
    mask = (1 << 64) - 1
    z = (x + GOLDEN) & mask
    z = ((z ^ (z >> 30)) * MIX1) & mask
    z = ((z ^ (z >> 27)) * MIX2) & mask
    return z ^ (z >> 31)
