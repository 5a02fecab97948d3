"""Offloaded activation checkpointing of decoder layers.

Plain checkpointing keeps each layer's input x_l on the GPU and recomputes the layer in backward. Here x_l
goes to host memory instead:

    forward  (layer l):  y = f_l(x_l) without autograd; copy x_l → a reused host buffer on a side stream
    backward (layer l):  wait (event) for x_l's copy back; start copying x_{l-1} back (prefetch); recompute
                         y = f_l(x_l) with autograd, free y's values (no backward reads them:
                         release_unread_output), backpropagate the incoming gradient through it

so the GPU holds about one layer's working set plus the prefetched input, and the host holds the inputs.
The copies use one side CUDA stream ordered against the compute stream by events only (no host sync).
The last ``gpu_resident`` layer inputs of each forward stay on the GPU when memory allows (they are the
first ones backward needs). Gradients are exactly those of plain checkpointing: the same recompute, with
the RNG state (dropout) and autocast state restored. On the CPU the "host copy" is a copy into the pool buffer, so the same
path runs and is tested.

It plugs into transformers through the model's gradient-checkpointing function (the layer calls
``func(partial(forward, **kwargs), hidden_states)``); no transformers class is modified.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_map

from ..models.structure import base_model, decoder_layers
from ..models.tiled_mlp import layer_recompute
from .attention_reuse import Record, RecordAttention, ReplayAttention
from .pinned import exact_pinned


class PinnedPool:
    """Host buffers reused across layers and steps: a buffer is lent for one saved tensor and returned when
    backward has copied it back. Pinned (page-locked) when CUDA is present, so copies are asynchronous.

    Buffers come in size classes, 32 a power of two (a class holds n bytes rounded up to a multiple of
    2^(⌊log2 n⌋ − 5): at most 3.1% unused, against the planner's exact host bytes), and a request takes the smallest
    free buffer of its class or a larger one up to twice its size. GRPO's sequences change length every step: exact
    sizes would miss every step, pin fresh memory each time (page-locking runs at a few GB/s, on the host's critical
    path) and keep every buffer of every earlier step.

    :data:`EXACT_PINNED` (with ``pin``): buffers page-locked by whole pages (memory/pinned.py) instead of by torch's
    pinned allocator, which locks each one rounded up to a power of two (up to twice the bytes the planner counts).
    Off until measured on a GPU."""

    CLASS_BITS = 5  # 2⁵ classes a doubling
    EXACT_PINNED = False

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: dict[int, list[torch.Tensor]] = {}  # class bytes → uint8 buffers of that many bytes
        self.allocated_bytes = 0

    @classmethod
    def class_bytes(cls, nbytes: int) -> int:
        """nbytes rounded up to its size class."""
        step = 1 << max(0, nbytes.bit_length() - 1 - cls.CLASS_BITS)  # 2^(⌊log2 n⌋ − 5)
        return -(-nbytes // step) * step

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` (its first nbytes are the caller's)."""
        want = self.class_bytes(nbytes)
        fits = [size for size, bucket in self.free.items() if bucket and want <= size <= 2 * want]
        if fits:
            return self.free[min(fits)].pop()
        self.allocated_bytes += want
        if self.pin and self.EXACT_PINNED:
            return exact_pinned(want)
        return torch.empty(want, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        self.free.setdefault(buf.numel(), []).append(buf)


class _Copy:
    """One tensor kept for backward: on the GPU, or in a pool buffer with the events that order its copies. The
    host copy and the tensor fetched back keep the memory layout (strides) of the original: the fused attention
    kernels' backward reads their output by the strides their forward wrote it with (attention reuse)."""

    __slots__ = ("gpu", "host", "shape", "stride", "dtype", "device", "offload_done", "fetch_done", "pending")

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.stride = dense_strides(t)
        self.gpu = self.host = self.offload_done = self.fetch_done = self.pending = None

    def copy_pair(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``t``, the host buffer) as two tensors for one ``copy_`` either way: flat in memory order when ``t`` has
        the kept strides (one contiguous transfer, as for a contiguous tensor), else elementwise into the host
        buffer viewed with the kept strides."""
        host = self.host[:t.numel() * t.element_size()].view(self.dtype)  # the pool's buffer may be larger
        if t.stride() == self.stride:
            return t.as_strided((t.numel(),), (1,)), host
        return t, host.as_strided(self.shape, self.stride)


def dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides where its elements fill their memory without gaps or overlaps, in any dimension order (an
    attention output [B, H, T, D] laid out as [B, T, H, D]); else those of a dense tensor in the same order."""
    return torch.empty_like(t, device="meta").stride()


class _Saved:
    """What one layer keeps for its backward: its input, and (attention reuse) the outputs of its attention ops,
    whose large tensors live in ``extras`` wherever the input lives."""

    __slots__ = ("input", "requires_grad", "records", "extras")

    def __init__(self, x: torch.Tensor):
        self.input, self.requires_grad = _Copy(x), x.requires_grad
        self.records, self.extras = None, []

    @property
    def host(self):
        return self.input.host

    def copies(self) -> list[_Copy]:
        return [self.input] + self.extras


class ActivationOffloader:
    """The checkpoint function: ``offloader(function, hidden_states)`` → function(hidden_states).

    reuse_attention: record each layer's fused attention outputs in forward and replay them in the recompute
    (memory/attention_reuse.py), kept with the layer input (offloaded or resident)."""

    EXTRA_MIN_BYTES = 1 << 20  # attention outputs below this stay on the GPU (seeds, offsets, small lse)

    def __init__(self, device: torch.device | str, gpu_resident: int = 0, num_layers: int | None = None,
                 reuse_attention: bool = False):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.pool = PinnedPool(pin=self.cuda)
        self.gpu_resident = gpu_resident
        self.num_layers = num_layers
        self.reuse_attention = reuse_attention
        self.stack: list[_Saved] = []  # saved layers in forward order, popped by backward
        self.in_flight: list[_Copy] = []  # offloads whose GPU source is still referenced
        self.peak_host_bytes = 0
        self.host_bytes_in_use = 0
        self.grad_anchor = torch.empty(0, requires_grad=True)

    # -------------------------------------------------------------------------------- forward side
    def _keep_on_gpu(self) -> bool:
        if not self.num_layers or self.gpu_resident <= 0:
            return False
        return len(self.stack) % self.num_layers >= self.num_layers - self.gpu_resident

    def _retire_offloads(self) -> None:
        """Order the compute stream after the pending offload copies, then drop their GPU sources. The sources
        are compute-stream blocks, so their reuse is stream-ordered: no record_stream, whose deferred frees
        would let memory grow while the host runs ahead of the GPU."""
        for c in self.in_flight:
            torch.cuda.current_stream(self.device).wait_event(c.offload_done)
            c.pending = None
        self.in_flight.clear()

    def _put(self, t: torch.Tensor, offload: bool) -> _Copy:
        """Keep ``t`` on its device, or start copying it into a pool buffer (side stream, event-ordered)."""
        c = _Copy(t)
        if not offload:
            c.gpu = t.detach()
            return c
        c.host = self.pool.take(t.numel() * t.element_size())
        src, host = c.copy_pair(t.detach())
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                host.copy_(src, non_blocking=True)
                c.offload_done = torch.cuda.Event()
                c.offload_done.record(self.side)
            c.pending = t.detach()  # kept until the compute stream is ordered after the copy
            self.in_flight.append(c)
        else:
            host.copy_(src)
        self.host_bytes_in_use += c.host.numel()
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes_in_use)
        return c

    def save(self, x: torch.Tensor) -> _Saved:
        """Start saving layer input ``x`` (called before the layer computes, so the copy overlaps it)."""
        if self.cuda:
            self._retire_offloads()
        s = _Saved(x)
        offload = not self._keep_on_gpu() and x.device.type == self.device.type
        s.input = self._put(x, offload)
        self.stack.append(s)
        return s

    def attach(self, s: _Saved, records: list[Record]) -> None:
        """Keep the attention records of layer ``s`` with its input: large tensors offloaded when it is."""
        offload = s.input.host is not None

        def keep(t):
            if not isinstance(t, torch.Tensor) or t.numel() * t.element_size() < self.EXTRA_MIN_BYTES:
                return t
            s.extras.append(self._put(t, offload))
            return _ExtraRef(len(s.extras) - 1)

        s.records = [r._replace(out=tree_map(keep, r.out)) for r in records]

    def discard(self, s: _Saved) -> None:
        """Forget layer ``s`` (its forward failed): off the stack, its host buffers back to the pool (their next
        writer is an offload on the same ordered side stream, as in ``_take``)."""
        if s in self.stack:
            self.stack.remove(s)
        for c in s.copies():
            c.gpu = None
            if c.host is not None:
                self.host_bytes_in_use -= c.host.numel()
                self.pool.give(c.host)
                c.host = None

    # -------------------------------------------------------------------------------- backward side
    def _start_fetch(self, c: _Copy) -> None:
        if c.gpu is not None or c.fetch_done is not None:
            return
        if c.pending is not None:  # its offload is still in flight: the GPU copy is right here
            c.gpu = c.pending
            return
        # on CUDA allocated on the compute stream (stream-ordered reuse), written by the side stream after the
        # compute work enqueued so far, read by compute only after the fetch event
        c.gpu = torch.empty_strided(c.shape, c.stride, dtype=c.dtype, device=c.device)
        dst, host = c.copy_pair(c.gpu)
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                dst.copy_(host, non_blocking=True)
                c.fetch_done = torch.cuda.Event()
                c.fetch_done.record(self.side)
        else:
            dst.copy_(host)

    def _take(self, c: _Copy) -> torch.Tensor:
        """The copy's tensor on its device (after its fetch); its host buffer back to the pool."""
        self._start_fetch(c)
        t = c.gpu
        if c.fetch_done is not None:
            torch.cuda.current_stream(self.device).wait_event(c.fetch_done)
        c.gpu = c.pending = None
        if c.host is not None:  # reusable now: its next writer is an offload on the same (ordered) side stream
            self.host_bytes_in_use -= c.host.numel()
            self.pool.give(c.host)
        return t

    def load(self, s: _Saved) -> tuple[torch.Tensor, list[Record] | None]:
        """The saved input (and attention records) back on the device, and a prefetch of what backward needs
        next (the previous layer's)."""
        idx = self.stack.index(s)
        for c in s.copies():
            self._start_fetch(c)
        if idx > 0:
            for c in self.stack[idx - 1].copies():
                self._start_fetch(c)
        if self.cuda:
            self._retire_offloads()  # host buffers are reused only after their offload copy is done
        x = self._take(s.input)
        extras = [self._take(c) for c in s.extras]
        self.stack.pop(idx)
        records = None
        if s.records is not None:
            records = [r._replace(out=tree_map(lambda t: extras[t.index] if isinstance(t, _ExtraRef) else t, r.out))
                       for r in s.records]
        return x, records


class _ExtraRef:
    """Stands for an attention output kept in ``_Saved.extras``."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, offloader, function, x, grad_anchor):
        # grad_anchor: an empty tensor that requires grad, so that the output requires grad (and backward runs)
        # even when x does not (the first layer under LoRA); parameter gradients accumulate in backward.
        ctx.offloader, ctx.function = offloader, function
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        ctx.autocast = (x.device.type, torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        ctx.saved = offloader.save(x)
        try:
            with torch.no_grad():
                if offloader.reuse_attention:
                    recorder = RecordAttention()
                    with recorder:
                        out = function(x)
                    offloader.attach(ctx.saved, recorder.records)
                else:
                    out = function(x)
        except BaseException:  # e.g. out of memory: leave no stale entry (it would shift which layers stay resident)
            offloader.discard(ctx.saved)
            raise
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"offloaded checkpointing needs layers that return a tensor; got {type(out).__name__}")
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, records = ctx.offloader.load(ctx.saved)
        x = x.detach().requires_grad_(ctx.saved.requires_grad)
        replay = ReplayAttention(records) if records is not None else contextlib.nullcontext()
        cuda_devices = [x.device] if x.is_cuda else []
        with torch.random.fork_rng(devices=cuda_devices):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, x.device)
            device_type, enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled), replay, \
                    layer_recompute():
                out = ctx.function(x)
        if records is not None:
            replay.check_done()
        if out.requires_grad:  # else nothing in the layer wants a gradient (frozen, its input too)
            release_unread_output(out)
            torch.autograd.backward(out, grad_out)
        return None, None, (x.grad if ctx.saved.requires_grad else None), None


# ops whose backward keeps nothing of their result: the recomputed layer output made by one of them (a decoder
# layer's last residual add) is read by nobody once its graph exists
OUTPUT_UNREAD_OPS = ("AddBackward0",)


def release_unread_output(out: torch.Tensor) -> bool:
    """Free the recomputed layer output's memory before backpropagating through it, [T, H] × b a layer: backward
    from ``out`` reads its shape and graph, never its values, when the op that made it keeps nothing of its result
    (OUTPUT_UNREAD_OPS) and ``out`` owns its whole storage (not a view into a tensor others may have saved).
    Whether it was released."""
    grad_fn = out.grad_fn
    owns_storage = (out.is_contiguous() and out.storage_offset() == 0
                    and out.untyped_storage().nbytes() == out.numel() * out.element_size())
    if grad_fn is None or grad_fn.name() not in OUTPUT_UNREAD_OPS or not owns_storage:
        return False
    out.untyped_storage().resize_(0)
    return True


def offloaded_checkpoint(offloader: ActivationOffloader):
    """A gradient-checkpointing function for transformers' decoder layers that offloads layer inputs."""

    def checkpoint_fn(function, hidden_states, *args, **kwargs):
        if not torch.is_grad_enabled():  # no backward will come (e.g. the reference pass): nothing to save
            return function(hidden_states, *args, **kwargs)
        if args or kwargs:
            raise TypeError("offloaded checkpointing expects the layer input as the only positional argument")
        return _OffloadedCheckpoint.apply(offloader, function, hidden_states, offloader.grad_anchor)

    return checkpoint_fn


def keep_last_layers_whole(model, n: int) -> int:
    """Checkpoint every decoder layer but the last ``n`` (all when ``n`` exceeds them): those keep every activation
    from forward to backward and are not recomputed. Through transformers' own per-layer switch (the
    ``gradient_checkpointing`` flag its checkpointing sets on each layer); ``n`` = 0 checkpoints them all again.
    Returns how many layers stay checkpointed."""
    layers = decoder_layers(model)
    n = min(max(n, 0), len(layers))
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < len(layers) - n
    return len(layers) - n


def enable_offloaded_checkpointing(model, gpu_resident: int = 0, reuse_attention: bool = False,
                                   no_recompute: int = 0) -> ActivationOffloader:
    """Checkpoint every decoder layer of ``model`` (a transformers or PEFT model), its inputs offloaded;
    ``reuse_attention``: its attention outputs kept with them instead of recomputed; ``no_recompute``: the last
    that many layers not checkpointed at all (keep_last_layers_whole). Only the language model's layers: a vision
    tower's keep what they had (its layers take more than their input positionally, e.g. SigLIP's and CLIP's)."""
    base = base_model(model)
    device = next(base.parameters()).device
    num_layers = getattr(base.config.get_text_config(), "num_hidden_layers", None)
    offloader = ActivationOffloader(device, gpu_resident=gpu_resident, num_layers=num_layers,
                                    reuse_attention=reuse_attention)
    base.get_decoder()._set_gradient_checkpointing(enable=True,
                                                   gradient_checkpointing_func=offloaded_checkpoint(offloader))
    base.config.use_cache = False
    if no_recompute:  # the layers checkpointed per forward: the resident inputs are the last of these
        offloader.num_layers = keep_last_layers_whole(model, no_recompute)
    return offloader
