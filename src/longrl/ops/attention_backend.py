"""Which of PyTorch's fused attention kernels (SDPA backends) training tries first, on CUDA.

PyTorch picks an SDPA backend by a fixed priority among those that support the call. On Hopper GPUs cuDNN's
kernels can beat the flash kernels PyTorch prefers; ``model.sdpa_backends`` puts the listed backends first, in
that order, with the others after them (so a call none of the listed ones supports still runs).
"""

from __future__ import annotations

import contextlib

from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
DEFAULT_ORDER = ("flash", "efficient", "math", "cudnn")  # PyTorch's own order, the tail after the listed ones


def backend_order(names: list[str]) -> list:
    """The listed backends first, in order, then the rest in PyTorch's default order."""
    unknown = [n for n in names if n not in SDPA_BACKENDS]
    if unknown:
        raise ValueError(f"unknown SDPA backend(s) {unknown}; known: {sorted(SDPA_BACKENDS)}")
    ordered = list(dict.fromkeys(names)) + [n for n in DEFAULT_ORDER if n not in names]
    return [SDPA_BACKENDS[n] for n in ordered]


def sdpa_priority(names: list[str], device_type: str):
    """Context in which SDPA tries ``names`` first (CUDA only; nothing changes for an empty list or on CPU)."""
    if not names or device_type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(backend_order(names), set_priority=True)
