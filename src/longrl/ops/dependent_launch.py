"""Programmatic dependent launch (Hopper and later): the decode step's Triton kernels start while the kernel before
them drains.

A decode step at 8 rows is ~480 small kernels; between two dependent kernels the GPU drains the first, flushes its
memory and only then launches the second: ≈ 1.4 µs a boundary on an H100 even inside a CUDA graph, ≈ 12% of an 8B
NF4 decode step. A kernel launched with CUDA's programmatic-stream-serialization attribute (Triton's
``launch_pdl=True``) may instead be scheduled as soon as every program of the kernel before it has started (its
``griddepcontrol.launch_dependents``) or exited; its programs then wait (``griddepcontrol.wait``) until that kernel
has completed and its writes are visible, and only then read or write anything. So the launch, the scheduling and
the programs' start overlap the previous kernel, and the arithmetic is unchanged: the same kernels on the same
inputs give the same bits (tests/test_dependent_launch.py; on a GPU, whole rollouts with and without).

The rule each kernel here keeps: a kernel that takes ``PDL`` calls :func:`wait_for_inputs` before its first load
or store, in every program. Then a kernel's completion implies that of every kernel before it in the stream (it
waited for its predecessor, which waited for its own), so a kernel reading the output of one two launches back is
as safe as without the attribute. Kernels launched without it (PyTorch's, cuBLAS's) wait for the full completion of
the one before, as always.
"""

from __future__ import annotations

import contextlib
import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton
    triton = None

# dependent launches where the device and Triton support them; dependent_launches() switches. Off by default until
# their GPU tests (tests/test_dependent_launch.py) have run on a GPU and the rollout matrix has timed them
# (benchmarks/rollout_matrix.py --launches serial,dependent)
_ON = [False]


@contextlib.contextmanager
def dependent_launches(on: bool):
    """Within the context, kernels launch with (on) or without programmatic dependent launch, where supported. CUDA
    graphs keep how their kernels were captured."""
    before = _ON[0]
    _ON[0] = bool(on)
    try:
        yield
    finally:
        _ON[0] = before


@functools.lru_cache(maxsize=None)
def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch dependently: a CUDA device of compute capability 9.0 or later, and a
    Triton that compiles ``gdc_wait`` and launches with ``launch_pdl`` (not its interpreter)."""
    if triton is None or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as tl_cuda
    except ImportError:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return ("launch_pdl" in fields and hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")
            and not isinstance(wait_for_inputs, InterpretedFunction))


def options(t: torch.Tensor) -> dict:
    """A decode kernel's launch keywords for tensors on ``t``'s device: ``PDL`` (its constexpr: wait first) and,
    when on, Triton's ``launch_pdl``."""
    on = _ON[0] and t.is_cuda and supported(t.device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


if triton is not None:
    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """A dependently launched kernel's first step: wait until the kernel before it has completed and its memory
        is visible, then let the kernel after this one be scheduled (it waits for this one's completion in turn)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
else:
    wait_for_inputs = None
