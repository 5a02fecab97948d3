"""Sequence-tiled MLP: a long micro-batch's MLP intermediates exist one tile at a time.

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

Inside an offloaded layer's recompute (memory/offload.py, which marks it with :func:`layer_recompute`) that extra
forward is avoidable: the recompute only rebuilds the layer's graph, and in a Llama-family layer (out = residual +
mlp(x)) nothing reads the MLP's output value in backward. There (``output_unread``, no dropout in the MLP) the MLP
returns an unwritten output tied to a function whose backward recomputes each tile and backpropagates through it
at once, so the MLP runs twice per token in a step (forward, backward's recompute) as an untiled checkpointed MLP
does, not three times.

:class:`TiledMLP` is a :class:`~longrl.models.shared_wrapper.SharedWrapper`: parameter names, state dicts and PEFT
adapters are the wrapped MLP's. Putting it into a model is memory/tiling.py's.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .shared_wrapper import SharedWrapper

# set while a checkpointed layer recomputes in backward (layer_recompute): its outputs only feed autograd there
_RECOMPUTING = contextvars.ContextVar("longrl_layer_recompute", default=False)


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
        self.tile_tokens = check_tile_tokens(tile_tokens)
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


def check_tile_tokens(tile_tokens: int) -> int:
    """``tile_tokens`` if it is a valid tile size (an integer ≥ 1), else ValueError."""
    if not isinstance(tile_tokens, int) or isinstance(tile_tokens, bool) or tile_tokens < 1:
        raise ValueError(f"tile_tokens must be an integer >= 1, got {tile_tokens!r}")
    return tile_tokens
