"""A frozen linear layer whose weight is stored in FP8 e4m3 with 128 × 128 block scales (ops/fp8_blocks.py).

:class:`FP8Linear` subclasses ``nn.Linear``, so PEFT wraps it with its LoRA ``Linear`` as it wraps any linear layer
(``compute_dtype`` tells PEFT the adapters' dtype, as bitsandbytes' layers do). Its forward is

    y = x Ŵᵀ + b            Ŵ = dequantize(q, s) in the compute dtype, a transient matrix of this call

through :class:`_FP8LinearFunction`, which keeps only the codes and scales for backward (references, no copy) and
dequantizes again there: dx = dy Ŵ. The base is frozen: no gradient reaches q, s or b. :func:`fp8_linear_reference`
is the plain twin (autograd through ``F.linear`` of the whole dequantized matrix).

Merging an adapter *into* an FP8 weight is refused: PEFT's ``merge`` adds to ``weight`` in place, which torch
refuses for float8 (no silent rounding of the sum into e4m3); exports dequantize the base first
(:func:`dequantize_fp8_linears`) and merge into 16-bit weights.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..ops.fp8_blocks import FP8_DTYPE, dequantize_fp8, dequantize_fp8_reference, quantize_fp8_blocks
from .structure import put_frozen_linear

log = logging.getLogger(__name__)


class _FP8LinearFunction(torch.autograd.Function):
    """y = x Ŵᵀ + b for x [N, in], codes q [out, in], scales s; backward dx = dy Ŵ (Ŵ dequantized again)."""

    @staticmethod
    def forward(ctx, x, codes, scales, bias, dtype):
        w = dequantize_fp8(codes, scales, dtype)  # [out, in], freed when this returns
        y = torch.nn.functional.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(codes, scales)
        ctx.dtype, ctx.x_dtype, ctx.bias_grad = dtype, x.dtype, bias is not None and bias.requires_grad
        return y

    @staticmethod
    def backward(ctx, dy):
        codes, scales = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (dy.to(ctx.dtype) @ dequantize_fp8(codes, scales, ctx.dtype)).to(ctx.x_dtype)  # [N, in]
        db = dy.sum(0) if ctx.bias_grad else None
        return dx, None, None, db, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Autocast's dtype when it is on for x's device, else x's own."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class FP8Linear(nn.Linear):
    """``nn.Linear`` with ``weight`` float8_e4m3fn [out, in] (frozen) and ``weight_scale`` float32 [⌈out/128⌉,
    ⌈in/128⌉]; the bias, if any, in ``compute_dtype``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, compute_dtype=torch.bfloat16,
                 device=None):
        super().__init__(in_features, out_features, bias=bias, device="meta")
        self.compute_dtype = compute_dtype  # PEFT's adapters take this dtype (then float32), as over bitsandbytes
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        blocks = (-(-out_features // 128), -(-in_features // 128))
        self.register_buffer("weight_scale", torch.ones(blocks, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device),
                                     requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype, device=None) -> "FP8Linear":
        """The FP8 layer of ``linear``'s weight, quantized on ``device`` (default: where the weight is)."""
        device = torch.device(device) if device is not None else linear.weight.device
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype, device="meta")
        codes, scales = quantize_fp8_blocks(linear.weight.detach().to(device))
        new.weight = nn.Parameter(codes, requires_grad=False)
        new.weight_scale = scales
        if linear.bias is not None:
            new.bias = nn.Parameter(linear.bias.detach().to(device, compute_dtype), requires_grad=False)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _FP8LinearFunction.apply(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.bias,
                                     _compute_dtype(x))
        return y.view(*lead, self.out_features)

    def _apply(self, fn, recurse=True):
        """Device moves reach the codes and scales; a dtype cast (``model.to(torch.bfloat16)``, ``.half()``)
        reaches only the bias: cast codes would lose their scales, cast scales their precision."""
        codes, scales = self.weight.data, self.weight_scale
        super()._apply(fn, recurse)
        if self.weight.dtype != FP8_DTYPE or self.weight_scale.dtype != torch.float32:
            self.weight.data = codes.to(self.weight.device)
            self.weight_scale = scales.to(self.weight_scale.device)
            self.compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype)).dtype  # the cast's target
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"float8_e4m3fn with 128x128 block scales, compute_dtype={self.compute_dtype}")


def fp8_linear_reference(x: torch.Tensor, layer: FP8Linear) -> torch.Tensor:
    """The twin of ``layer(x)``: the whole dequantized matrix (the plain PyTorch dequantization), then ``F.linear``
    with autograd's own backward."""
    dtype = _compute_dtype(x)
    bias = None if layer.bias is None else layer.bias.to(dtype)
    return torch.nn.functional.linear(x.to(dtype), dequantize_fp8_reference(layer.weight, layer.weight_scale, dtype),
                                      bias)


def fp8_layers(model) -> dict[str, FP8Linear]:
    """Every :class:`FP8Linear` of ``model`` by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}


def is_fp8_model(model) -> bool:
    return any(isinstance(m, FP8Linear) for m in model.modules())


def quantize_fp8_linears_(model, names: list[str], compute_dtype: torch.dtype, device=None) -> None:
    """Replace the linear modules ``names`` of an in-memory model by :class:`FP8Linear`, one at a time: each
    16-bit weight goes to ``device`` (default: where it is), is quantized there and freed, so the device never
    holds more than one 16-bit matrix beyond what is already on it."""
    for name in names:
        old = model.get_submodule(name)
        model.set_submodule(name, FP8Linear.from_linear(old, compute_dtype, device))
        old.weight = None  # the 16-bit weight's last reference (the caller may hold the module)
        del old


def dequantize_fp8_linears(model, dtype: torch.dtype | None = None) -> int:
    """Replace every :class:`FP8Linear` in ``model`` by an ``nn.Linear`` holding its dequantized weight (in
    ``dtype``, default its compute dtype), frozen; return how many were replaced. For merges: an adapter is then
    added to exactly the weights training saw."""
    targets = list(fp8_layers(model).items())
    for name, module in targets:
        out_dtype = dtype or module.compute_dtype
        put_frozen_linear(model, name, dequantize_fp8_reference(module.weight, module.weight_scale, out_dtype),
                          module.bias, out_dtype)
    if targets:
        log.info("dequantized %d FP8 linear layers", len(targets))
    return len(targets)
