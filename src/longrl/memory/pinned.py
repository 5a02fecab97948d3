"""Page-locked host buffers of the size asked for.

torch's pinned allocator (``torch.empty(..., pin_memory=True)``, ATen's CachingHostAllocator) rounds every
allocation up to the next power of two before it locks it: a buffer of n bytes locks up to 2n (1.4n on average over
sizes), which the planner's host arithmetic does not count. :func:`exact_pinned` locks whole pages instead: pageable
memory from torch's CPU allocator, registered with CUDA (``cudaHostRegister``, through ``torch.cuda.cudart()``) from
its first page boundary for ⌈n / page⌉ pages, and unregistered when the buffer is collected (its storage is freed
after that, never before). Copies to and from it are asynchronous as from torch's pinned buffers
(``is_pinned()`` reads CUDA's own pointer attributes). Where registration fails, torch's pinned allocator serves
the buffer as before.
"""

from __future__ import annotations

import mmap
import weakref

import torch

PAGE = mmap.PAGESIZE


def exact_pinned(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` bytes, page-locked for CUDA: ⌈nbytes / PAGE⌉ pages registered (CUDA
    needed); torch's pinned allocator when the registration fails."""
    raw = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)  # room to start at a page boundary and end on one
    start = (-raw.data_ptr()) % PAGE
    locked = -(-nbytes // PAGE) * PAGE  # whole pages: [start, start + locked) lies inside raw
    cudart = torch.cuda.cudart()
    ptr = raw.data_ptr() + start
    if cudart.cudaHostRegister(ptr, locked, 0) != cudart.cudaError.success:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    buf = raw[start:start + nbytes]
    weakref.finalize(buf, cudart.cudaHostUnregister, ptr)  # (buf's views keep the storage; registration ends first)
    return buf
