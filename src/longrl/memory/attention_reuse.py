"""Reuse a checkpointed layer's attention result in its backward instead of recomputing it.

Checkpointing recomputes a layer's forward before its backward. At long context the attention kernel is the
costliest part of that forward (O(T²) against O(T) for the rest), and its backward needs only its output and
log-sum-exp besides q, k and v, which the recompute produces cheaply. So the first forward records the outputs
of the fused attention op (flash, memory-efficient or cuDNN SDPA, or the CPU flash kernel) and the recompute
returns those instead of running the kernel:

    forward (no autograd):  o, lse, … = sdpa_op(q, k, v)     → recorded (offloaded with the layer input), with
                                                                the random-number generator's state after it
    recompute (autograd):   sdpa_op(q, k, v) ↦ the recorded o, lse, …   (autograd saves them for its backward),
                                                                and the generator set to that recorded state

This runs below autograd, as PyTorch's selective activation checkpointing does (a TorchDispatchMode), so
transformers' attention code is untouched and autograd's own SDPA backward consumes the replayed tensors. The
forward is deterministic, so the replayed tensors equal the recomputed ones bit for bit and the gradients are
exactly those of plain checkpointing (tests/test_memory.py). Bit for bit includes the memory layout: the kernels
write their output [B, H, T, D] laid out as [B, T, H, D], and their backward reads it by those strides (the
memory-efficient kernel takes only the output's batch and head strides and assumes H·D between tokens; cuDNN
reuses a backward plan built for the first output layout it saw), so a replayed output with other strides gives
wrong gradients with no error. The offloader's host copies keep the strides (memory/offload.py), and the replay
refuses an output whose layout is not the one recorded. With attention dropout the CUDA kernels draw from
the generator (their seed and offset are among the recorded outputs); setting the generator to its state after
the recorded call keeps every later draw of the layer (e.g. LoRA dropout) where the forward had it. Attention
that is not one fused op (e.g. eager attention) is simply recomputed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map


def _attention_ops() -> frozenset:
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable")
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


ATTENTION_OPS = _attention_ops()


def _detached(out):
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


def _with_log_sumexp(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with ``compute_log_sumexp=True`` where the op has that flag (efficient, cuDNN): without autograd
    PyTorch asks those kernels for no log-sum-exp, but their backward needs it."""
    names = [a.name for a in func._schema.arguments]
    if "compute_log_sumexp" not in names:
        return args, kwargs
    i = names.index("compute_log_sumexp")
    if i < len(args):
        return args[:i] + (True,) + args[i + 1:], kwargs
    return args, {**kwargs, "compute_log_sumexp": True}


def _device_of(out) -> torch.device:
    return next(t.device for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor))


def _rng_state(device: torch.device) -> torch.Tensor:
    """The generator state of ``device`` (a small host tensor; reading it does not wait for the GPU)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _signature(func, args: tuple, kwargs: dict) -> tuple:
    """What identifies an attention call: the op, every tensor argument's shape and dtype, every other argument
    (the log-sum-exp flag aside, which the record forces)."""
    args, kwargs = _with_log_sumexp(func, args, kwargs)
    describe = lambda v: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return (func, tuple(describe(a) for a in args), tuple(sorted((k, describe(v)) for k, v in kwargs.items())))


def _layout(out) -> tuple:
    """Shape and strides of each tensor among ``out`` (None for the other outputs)."""
    return tuple((tuple(t.shape), t.stride()) if isinstance(t, torch.Tensor) else None for t in tree_leaves(out))


class Record(NamedTuple):
    """One fused attention call of the forward: its signature, its outputs, the generator state after it, and the
    memory layout of its outputs (the replay hands back exactly that layout)."""

    signature: tuple
    out: object
    rng_after: torch.Tensor
    layout: tuple


class RecordAttention(TorchDispatchMode):
    """Runs everything; keeps ``records``: a Record of each fused attention op, in call order."""

    def __init__(self):
        super().__init__()
        self.records: list[Record] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in ATTENTION_OPS:
            return func(*args, **kwargs)
        call_args, call_kwargs = _with_log_sumexp(func, args, kwargs)
        out = func(*call_args, **call_kwargs)
        self.records.append(Record(_signature(func, args, kwargs), _detached(out), _rng_state(_device_of(out)),
                                   _layout(out)))
        return out


class ReplayAttention(TorchDispatchMode):
    """Runs everything but the fused attention ops, which return the recorded outputs (the same call, in the same
    order, in the recorded memory layout, or it raises); ``check_done`` raises unless every record was used."""

    def __init__(self, records: list[Record]):
        super().__init__()
        self.records, self.served = records, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in ATTENTION_OPS:
            return func(*args, **kwargs)
        if self.served >= len(self.records):
            raise RuntimeError("attention reuse: the recompute ran more attention ops than the forward recorded")
        record = self.records[self.served]
        if record.signature != _signature(func, args, kwargs):
            raise RuntimeError(f"attention reuse: recorded {record.signature}, the recompute asks "
                               f"{_signature(func, args, kwargs)}")
        if _layout(record.out) != record.layout:  # the kernel's backward would read the output by other strides
            raise RuntimeError(f"attention reuse: {func} recorded outputs laid out as {record.layout}, kept ones "
                               f"came back as {_layout(record.out)}")
        self.served += 1
        _set_rng_state(_device_of(record.out), record.rng_after)  # as if the kernel had run (and drawn what it drew)
        return _detached(record.out)

    def check_done(self) -> None:
        if self.served != len(self.records):
            raise RuntimeError(f"attention reuse: the recompute used {self.served} of {len(self.records)} records")
