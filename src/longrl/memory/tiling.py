"""Sequence-tiled MLPs: a long micro-batch's MLP intermediates exist one tile at a time.

A decoder layer's MLP is position-wise, out[n] = down(act(gate(x[n])) · up(x[n])) depends on token n only,
and its intermediates (gate, up, act, product: about 4·N·I values for N tokens, MLP width I) are the largest
transient of a layer at long N. With tiles of t tokens (over the flattened [N, H] tokens of the micro-batch):

    no grad:  out[s:s+t] = mlp(x[s:s+t]) tile by tile, into one output       transient ~4·t·I, not 4·N·I
    grad:     each tile under a non-reentrant checkpoint, which saves only its input x[s:s+t] (a view of x);
              backward recomputes the tile with autograd, backpropagates through it and frees it

so the MLP needs O(t·I) memory instead of O(N·I), for one extra MLP forward per token in backward. The
checkpoint restores the RNG state, so LoRA dropout masks in the recompute are the forward's. (Under autocast the
per-tile checkpoints share autocast's cast cache, so an fp32 weight's gradient is summed over tiles in 16 bits
before its cast back: close to, not bit-identical with, the untiled result.) Results equal the untiled MLP's up
to floating-point summation order (GEMM kernels may block a row subset differently, and weight gradients are
summed tile by tile); with exactly representable values they are bit-identical (tested). N ≤ t runs the MLP
untouched.

Inside an offloaded layer's recompute (memory/offload.py) that extra forward is avoidable: the recompute only
rebuilds the layer's graph, and in a Llama-family layer (out = residual + mlp(x)) nothing reads the MLP's output
value in backward. There (``output_unread``, no dropout in the MLP) the MLP returns an unwritten output tied to
a function whose backward recomputes each tile and backpropagates through it at once, so the MLP runs twice per
token in a step (forward, backward's recompute) as an untiled checkpointed MLP does, not three times.

What else a layer holds grows as N·H, not N·I or N²: q/k/v/o and their LoRA inputs, norms, residuals, and
attention through SDPA/flash without a mask (one long sequence is plain causal; packed micro-batches, which need a
mask, are capped by the planner). Log-probs are chunked (ops/logprobs.py). So with tiles a layer's working set is
~(16 H + 2 K)·N elements plus one tile, and the layer inputs (L·N·H) live in host memory (memory/offload.py).

``enable_mlp_tiling`` puts a :class:`TiledMLP` in each ``mlp`` slot. The wrapper shares the wrapped module's
``_modules``/``_parameters``/``_buffers`` dicts, so parameter and state-dict names (``...layers.0.mlp.gate_proj
.weight``) and PEFT adapters are unchanged, and a child replaced through either module (PEFT injecting LoRA
after tiling, merging before un-tiling) is seen by both. No library class is modified.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)


class SharedWrapper(nn.Module):
    """A module standing in for ``inner`` in its parent's slot with the same children, parameters and buffers
    (shared dicts: names, state dicts and PEFT adapters unchanged; a child replaced through either is seen by
    both) and its other attributes read through (``variance_epsilon``, ``scaling``, ``config``, ...: code that
    inspects the model sees the wrapped module's). Subclasses define ``forward``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        object.__setattr__(self, "inner", inner)  # not a child: its children are ours
        self._modules = inner._modules
        self._parameters = inner._parameters
        self._buffers = inner._buffers
        self.training = inner.training

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("inner")  # (absent while copy or pickle rebuild the wrapper)
            if inner is None:
                raise
            return getattr(inner, name)

    def train(self, mode: bool = True):
        self.inner.training = mode
        return super().train(mode)


_RECOMPUTING = contextvars.ContextVar("longrl_layer_recompute", default=False)

# decoder layers that end in ``hidden_states = residual + self.mlp(hidden_states)`` (their MLP output's value is
# read by nothing in backward)
RESIDUAL_MLP_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")


@contextlib.contextmanager
def layer_recompute():
    """Marks a checkpointed layer's recompute in backward (memory/offload.py): outputs only feed autograd."""
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


class TiledMLP(SharedWrapper):
    """``mlp`` applied to tiles of ``tile_tokens`` tokens; same parameters, same names, same results."""

    def __init__(self, mlp: nn.Module, tile_tokens: int, output_unread: bool = False):
        super().__init__(mlp)
        self.tile_tokens = _check_tile(tile_tokens)
        self.checkpoint_tiles = True  # False keeps every tile's intermediates: the slow twin, for tests
        self.output_unread = output_unread  # the parent layer never reads the output's value in backward
        self.anchor = torch.empty(0, requires_grad=True)  # makes the backward-only output require grad

    def extra_repr(self) -> str:
        return f"tile_tokens={self.tile_tokens}, inner={type(self.inner).__name__}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., N, H]
        n = x.shape[:-1].numel()
        if n <= self.tile_tokens:
            return self.inner(x)
        flat = x.reshape(n, x.shape[-1])  # [N, H]
        tiles = flat.split(self.tile_tokens)  # views [t, H]
        if torch.is_grad_enabled():
            if self.checkpoint_tiles and self.output_unread and _RECOMPUTING.get() and not _has_dropout(self.inner):
                # the output a residual layer adds to its stream: [N, H], in the projections' compute dtype
                device = x.device.type
                dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
                out = _TilesInBackward.apply(flat, self.anchor, self.inner, self.tile_tokens, x.shape[-1], dtype)
                return out.view(*x.shape[:-1], -1)
            if self.checkpoint_tiles:
                outs = [checkpoint(self.inner, tile, use_reentrant=False) for tile in tiles]
            else:
                outs = [self.inner(tile) for tile in tiles]
            return torch.cat(outs).view(*x.shape[:-1], -1)  # cat's backward splits the grad into views
        out, start = None, 0
        for tile in tiles:
            y = self.inner(tile)  # [t, H_out]
            if out is None:
                out = y.new_empty(n, y.shape[-1])
            out[start:start + len(y)] = y
            start += len(y)
        return out.view(*x.shape[:-1], -1)


class _TilesInBackward(torch.autograd.Function):
    """Output left unwritten (only its graph is used); backward recomputes the MLP tile by tile, last tile first
    (the order autograd runs per-tile checkpoints in), backpropagating each tile's gradient through it at once:
    the parameters' gradients accumulate there, the input's is returned."""

    @staticmethod
    def forward(ctx, x2, anchor, mlp, tile, out_features, out_dtype):  # x2 [N, H] → [N, out_features]
        ctx.mlp, ctx.tile = mlp, tile
        ctx.autocast = (x2.device.type, torch.is_autocast_enabled(x2.device.type),
                        torch.get_autocast_dtype(x2.device.type))
        ctx.save_for_backward(x2)
        return x2.new_empty(x2.shape[0], out_features, dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad):
        (x2,) = ctx.saved_tensors
        grad_x = torch.empty_like(x2) if ctx.needs_input_grad[0] else None
        device_type, enabled, dtype = ctx.autocast
        starts = list(range(0, x2.shape[0], ctx.tile))
        for s in reversed(starts):
            xt = x2[s:s + ctx.tile].detach().requires_grad_(grad_x is not None)
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                yt = ctx.mlp(xt)
            if yt.requires_grad:  # else neither the input nor any MLP parameter wants a gradient
                torch.autograd.backward(yt, grad[s:s + ctx.tile])
            if grad_x is not None:
                grad_x[s:s + ctx.tile] = xt.grad
        return grad_x, None, None, None, None, None


def _has_dropout(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in module.modules())


def _check_tile(tile_tokens: int) -> int:
    if not isinstance(tile_tokens, int) or isinstance(tile_tokens, bool) or tile_tokens < 1:
        raise ValueError(f"tile_tokens must be an integer >= 1, got {tile_tokens!r}")
    return tile_tokens


def _mlp_slots(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(parent, module) for every child named ``mlp`` (one per decoder layer)."""
    return [(parent, child) for parent in model.modules() for name, child in parent.named_children() if name == "mlp"]


def enable_mlp_tiling(model: nn.Module, tile_tokens: int) -> int:
    """Tile every decoder layer's MLP of ``model`` (transformers or PEFT) in tiles of ``tile_tokens`` tokens.

    Idempotent: an already tiled MLP gets the new tile size. Mixture-of-experts blocks (an ``experts`` child)
    are left alone. Returns the number of tiled MLPs."""
    _check_tile(tile_tokens)
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
