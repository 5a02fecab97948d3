"""FP8 bases: a 16-bit model's decoder linear layers quantized in place to e4m3 with 128 × 128 block scales
(:class:`longrl.models.fp8_linear.FP8Linear`), with the 16-bit exceptions a 4-bit base keeps (models/quantize.py:
the LM head, MoE routers/gates, the keep-list, and the most sensitive modules within the exception budget, scored
with FP8's round trip).

The model may sit in host memory while ``device`` is the accelerator: the sensitivity scores run one decoder layer
at a time on the device (``layers_streamed_to``), each chosen weight is moved there, quantized and its 16-bit copy
freed one matrix at a time, and only then does the rest (embeddings, norms, head, 16-bit exceptions) move. The device
never holds more than the FP8 model plus one 16-bit layer.
"""

from __future__ import annotations

import torch

from .fp8_linear import quantize_fp8_linears_
from .quantize import FP8, QuantReport, choose_exceptions


def quantize_model_fp8(model, input_ids: torch.Tensor, *, keep_modules: list[str] = (),
                       exception_budget: float = 0.10, compute_dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> QuantReport:
    """Quantize a 16-bit ``model`` in place to an FP8 base on ``device`` (default: where its weights are) and return
    the report (``report.fmt`` is :data:`longrl.models.quantize.FP8`)."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    compute_dtype = compute_dtype or model.get_output_embeddings().weight.dtype
    report = choose_exceptions(model, input_ids, keep_modules=keep_modules, exception_budget=exception_budget,
                               compute_dtype=compute_dtype, device=device, fmt=FP8)
    with torch.no_grad():
        quantize_fp8_linears_(model, report.quantized, compute_dtype, device)
    model.to(device)
    report.log()
    return report
