"""The CUDA caching allocator's settings longrl runs with, set before PyTorch first touches the GPU.

A long sequence's step allocates and frees [T, H]-sized tensors of many sizes; in the allocator's fixed segments
the freed blocks fragment, and a step whose peak allocation is well under the budget fails (docs/performance.md has the
case that showed it). PyTorch's expandable segments grow one mapping
instead (the setting Unsloth also defaults to). :func:`default_allocator_settings` sets it when the user has set
no allocator configuration; a user's setting always wins. It only takes effect if PyTorch's CUDA allocator has not
started yet, which holds for the ``longrl`` command and for ``import longrl`` before any CUDA work.
"""

from __future__ import annotations

import os

EXPANDABLE = "expandable_segments:True"
# torch >= 2.10 reads PYTORCH_ALLOC_CONF (and still PYTORCH_CUDA_ALLOC_CONF); older releases only the latter
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def default_allocator_settings(environ=os.environ) -> str | None:
    """Set expandable segments unless an allocator variable is already set; the variable set, or None."""
    if any(name in environ for name in ALLOCATOR_VARIABLES) or environ.get("LONGRL_DEFAULT_ALLOCATOR") == "0":
        return None
    name = "PYTORCH_CUDA_ALLOC_CONF" if _torch_before_2_10() else "PYTORCH_ALLOC_CONF"
    environ[name] = EXPANDABLE
    return name


def _torch_before_2_10() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(p) for p in version("torch").split("+")[0].split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) < (2, 10)
