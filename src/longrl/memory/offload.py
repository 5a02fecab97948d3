"""Offloaded activation checkpointing of decoder layers.

Plain checkpointing keeps each layer's input x_l on the GPU and recomputes the layer in backward. Here x_l
goes to host memory instead:

    forward  (layer l):  y = f_l(x_l) without autograd; copy x_l → a reused host buffer on a side stream
    backward (layer l):  wait (event) for x_l's copy back; start copying x_{l-1} back (prefetch); recompute
                         y = f_l(x_l) with autograd, backpropagate the incoming gradient through it

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

import torch


class PinnedPool:
    """Host buffers reused across layers and steps: a buffer is lent for one saved tensor and returned when
    backward has copied it back. Pinned (page-locked) when CUDA is present, so copies are asynchronous."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: dict[int, list[torch.Tensor]] = {}  # bytes → uint8 buffers
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        bucket = self.free.get(nbytes)
        if bucket:
            return bucket.pop()
        self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        self.free.setdefault(buf.numel(), []).append(buf)


class _Saved:
    """One layer input: on the GPU (resident) or in a host buffer, with the events that order its copies."""

    __slots__ = ("gpu", "host", "shape", "dtype", "device", "offload_done", "fetch_done", "requires_grad", "pending")

    def __init__(self):
        self.gpu = self.host = self.offload_done = self.fetch_done = self.pending = None


class ActivationOffloader:
    """The checkpoint function: ``offloader(function, hidden_states)`` → function(hidden_states)."""

    def __init__(self, device: torch.device | str, gpu_resident: int = 0, num_layers: int | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.pool = PinnedPool(pin=self.cuda)
        self.gpu_resident = gpu_resident
        self.num_layers = num_layers
        self.stack: list[_Saved] = []  # saved inputs in forward order, popped by backward
        self.in_flight: list[_Saved] = []  # offloads whose GPU source is still referenced
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
        for s in self.in_flight:
            torch.cuda.current_stream(self.device).wait_event(s.offload_done)
            s.pending = None
        self.in_flight.clear()

    def save(self, x: torch.Tensor) -> _Saved:
        """Start saving layer input ``x`` (called before the layer computes, so the copy overlaps it)."""
        if self.cuda:
            self._retire_offloads()
        s = _Saved()
        s.shape, s.dtype, s.device, s.requires_grad = x.shape, x.dtype, x.device, x.requires_grad
        if self._keep_on_gpu() or x.device.type != self.device.type:
            s.gpu = x.detach()
        else:
            nbytes = x.numel() * x.element_size()
            s.host = self.pool.take(nbytes)
            host_view = s.host.view(x.dtype).view(x.shape)
            if self.cuda:
                self.side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.side):
                    host_view.copy_(x.detach(), non_blocking=True)
                    s.offload_done = torch.cuda.Event()
                    s.offload_done.record(self.side)
                s.pending = x.detach()  # kept until the compute stream is ordered after the copy
                self.in_flight.append(s)
            else:
                host_view.copy_(x.detach())
        self.stack.append(s)
        if s.host is not None:
            self.host_bytes_in_use += s.host.numel()
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes_in_use)
        return s

    # -------------------------------------------------------------------------------- backward side
    def _start_fetch(self, s: _Saved) -> None:
        if s.gpu is not None or s.fetch_done is not None:
            return
        if s.pending is not None:  # its offload is still in flight: the GPU copy is right here
            s.gpu = s.pending
            return
        host_view = s.host.view(s.dtype).view(s.shape)
        if self.cuda:
            # allocated on the compute stream (stream-ordered reuse), written by the side stream after the
            # compute work enqueued so far, read by compute only after the fetch event
            s.gpu = torch.empty(s.shape, dtype=s.dtype, device=s.device)
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                s.gpu.copy_(host_view, non_blocking=True)
                s.fetch_done = torch.cuda.Event()
                s.fetch_done.record(self.side)
        else:
            s.gpu = host_view.clone()

    def load(self, s: _Saved) -> torch.Tensor:
        """The saved input back on its device, and a prefetch of the one backward needs next."""
        idx = self.stack.index(s)
        self._start_fetch(s)
        if idx > 0:
            self._start_fetch(self.stack[idx - 1])
        x = s.gpu
        if s.fetch_done is not None:
            torch.cuda.current_stream(self.device).wait_event(s.fetch_done)
        if self.cuda:
            self._retire_offloads()  # host buffers are reused only after their offload copy is done
        s.gpu = s.pending = None
        self.stack.pop(idx)
        if s.host is not None:  # reusable now: its next writer is an offload on the same (ordered) side stream
            self.host_bytes_in_use -= s.host.numel()
            self.pool.give(s.host)
        return x


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
        with torch.no_grad():
            out = function(x)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"offloaded checkpointing needs layers that return a tensor; got {type(out).__name__}")
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x = ctx.offloader.load(ctx.saved).detach().requires_grad_(ctx.saved.requires_grad)
        cuda_devices = [x.device] if x.is_cuda else []
        with torch.random.fork_rng(devices=cuda_devices):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, x.device)
            device_type, enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                out = ctx.function(x)
        torch.autograd.backward(out, grad_out)
        return None, None, (x.grad if ctx.saved.requires_grad else None), None


def offloaded_checkpoint(offloader: ActivationOffloader):
    """A gradient-checkpointing function for transformers' decoder layers that offloads layer inputs."""

    def checkpoint_fn(function, hidden_states, *args, **kwargs):
        if not torch.is_grad_enabled():  # no backward will come (e.g. the reference pass): nothing to save
            return function(hidden_states, *args, **kwargs)
        if args or kwargs:
            raise TypeError("offloaded checkpointing expects the layer input as the only positional argument")
        return _OffloadedCheckpoint.apply(offloader, function, hidden_states, offloader.grad_anchor)

    return checkpoint_fn


def enable_offloaded_checkpointing(model, gpu_resident: int = 0) -> ActivationOffloader:
    """Checkpoint every decoder layer of ``model`` (a transformers or PEFT model), its inputs offloaded."""
    from ..models import base_model

    base = base_model(model)
    device = next(base.parameters()).device
    num_layers = getattr(base.config.get_text_config(), "num_hidden_layers", None)
    offloader = ActivationOffloader(device, gpu_resident=gpu_resident, num_layers=num_layers)
    base._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=offloaded_checkpoint(offloader))
    base.config.use_cache = False
    return offloader
