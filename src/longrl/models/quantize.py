"""4-bit NF4 bases (bitsandbytes, double quantization) with dynamic 16-bit exceptions.

Every ``nn.Linear`` of the model except the always-kept ones (LM head, MoE routers/gates) is a candidate for
NF4. For each candidate W (out × in) the load measures, on a 16-bit copy of the model:

    weight error  e_w = ||W − Ŵ||_F / ||W||_F                 Ŵ = dequantize(quantize_nf4(W)), blocks of 64
    output error  e_o = ||X (W − Ŵ)ᵀ||_F / ||X Wᵀ + b||_F     X: the module's inputs on a calibration batch
    score         s   = max(e_w, e_o)                          (e_o = e_w for a module the batch never reaches)

and keeps the highest-scoring candidates in 16-bit, worst first, while their extra bytes stay within the budget:

    Σ_kept (numel · b − nf4_bytes(numel)) ≤ budget · plain_4bit_bytes

where b is the bytes of the compute dtype and plain_4bit_bytes is the model with every candidate in NF4 and
everything else (embeddings, norms, LM head, routers, biases) in the compute dtype. Modules named in the
explicit keep-list are kept whatever their score and their bytes count first. Ties break by module name, the
calibration tokens come from a fixed seed: the choice is deterministic for a given model and device.
Embeddings and norms are not linear layers and are never quantized.

An FP8 base (models/fp8.py) chooses its exceptions the same way with its own round trip and bytes
(:data:`FP8`: e4m3 in 128 × 128 blocks, ops/fp8_blocks.py) in place of NF4's (:data:`NF4`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ..ops.fp8_blocks import fp8_bytes, fp8_roundtrip
from .structure import base_model
from .vision.adapters import vision_module_prefixes
from .vision.families import vision_family

log = logging.getLogger(__name__)

NF4_BLOCKSIZE = 64
DQ_GROUP = 256  # double quantization: one float32 scale per 256 block absmax values
NF4_BYTES_PER_PARAM = 0.5 + 1 / NF4_BLOCKSIZE + 4 / (NF4_BLOCKSIZE * DQ_GROUP)  # ≈ 0.5159
CALIBRATION_ROWS, CALIBRATION_LENGTH, CALIBRATION_SEED = 8, 64, 0


class QuantizationError(RuntimeError):
    """4-bit loading cannot proceed; the message names the config key."""


def require_bitsandbytes() -> None:
    """Fail before any weights load when bitsandbytes is missing."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise QuantizationError("config key 'model.load_in_4bit': 4-bit bases need bitsandbytes, which is not "
                                "installed; pip install 'longrl[quant]' (bitsandbytes>=0.45)")


def nf4_bytes(numel: int) -> int:
    """Bytes of a weight in NF4 with double quantization: numel/2 (two 4-bit codes per byte) + one 8-bit absmax
    per block of 64 + one float32 scale per 256 blocks."""
    blocks = math.ceil(numel / NF4_BLOCKSIZE)
    return math.ceil(numel / 2) + blocks + 4 * math.ceil(blocks / DQ_GROUP)


def nf4_roundtrip(weight: torch.Tensor) -> torch.Tensor:
    """Ŵ = dequantize(quantize_nf4(W)) through bitsandbytes (blocks of 64, double quantization), W's dtype."""
    import bitsandbytes.functional as bnbF

    q, state = bnbF.quantize_4bit(weight.detach().contiguous(), blocksize=NF4_BLOCKSIZE, compress_statistics=True,
                                  quant_type="nf4")
    return bnbF.dequantize_4bit(q, state).to(weight.dtype)


@dataclass(frozen=True)
class QuantFormat:
    """A quantized base's weight format, as the exception choice sees it."""

    label: str  # "4-bit NF4": names the base in the report
    plain: str  # "4-bit": names the all-quantized size
    roundtrip: Callable[[torch.Tensor], torch.Tensor]  # W → Ŵ in W's dtype
    bytes_of: Callable[[torch.Tensor], int]  # a weight's bytes in the format


NF4 = QuantFormat("4-bit NF4", "4-bit", nf4_roundtrip, lambda w: nf4_bytes(w.numel()))
FP8 = QuantFormat("FP8 e4m3", "FP8", fp8_roundtrip, lambda w: fp8_bytes(*w.shape))


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """||A − Â||_F / ||A||_F in float32 (0 for a zero reference)."""
    ref = reference.detach().float()
    denom = float(ref.norm())
    return float((ref - approx.detach().float()).norm()) / denom if denom > 0 else 0.0


def calibration_ids(tokenizer=None, text: str | None = None, *, vocab_size: int | None = None,
                    rows: int = CALIBRATION_ROWS, length: int = CALIBRATION_LENGTH,
                    seed: int = CALIBRATION_SEED) -> torch.Tensor:
    """[rows, length] token ids: ``text`` tokenized and repeated to fill the batch, else ids drawn uniformly (fixed
    ``seed``) from the tokenizer's vocabulary without its special tokens (or from range(vocab_size))."""
    if text is not None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise QuantizationError("config key 'model.quant_calibration_text': the text tokenizes to no tokens")
        reps = math.ceil(rows * length / len(ids))
        return torch.tensor((ids * reps)[:rows * length], dtype=torch.long).view(rows, length)
    n = vocab_size if vocab_size is not None else len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or []) if tokenizer is not None else set()
    pool = torch.tensor([i for i in range(n) if i not in special], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    return pool[torch.randint(len(pool), (rows, length), generator=gen)]


def always_keep_reason(name: str, head_name: str) -> str | None:
    """Why a linear module never goes to 4-bit: the LM head, or an MoE router/gate (tiny and sensitive)."""
    last = name.rsplit(".", 1)[-1]
    if name == head_name:
        return "always: LM head"
    if last in ("gate", "router") or last.endswith(("_gate", "_router")):
        return "always: MoE router/gate"
    return None


def matches_keep_list(name: str, patterns: list[str]) -> bool:
    """A keep-list entry names a module exactly or by a dotted suffix ("down_proj", "layers.3.mlp.down_proj")."""
    return any(name == p or name.endswith("." + p) for p in patterns)


def linear_modules(model) -> dict[str, torch.nn.Linear]:
    """Every ``nn.Linear`` of a transformers model by its module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _head_name(model) -> str:
    head = model.get_output_embeddings()
    return next((n for n, m in model.named_modules() if m is head), "lm_head")


@dataclass
class ModuleScore:
    name: str
    numel: int
    weight_error: float
    output_error: float | None  # None: the calibration batch never reached the module

    @property
    def score(self) -> float:
        return max(self.weight_error, self.output_error if self.output_error is not None else self.weight_error)


@dataclass
class QuantReport:
    """What a 4-bit load chose: the candidates' scores (worst first) and the linear modules kept in 16-bit."""

    scores: list[ModuleScore]
    kept: dict[str, str]  # module name → why it stays 16-bit
    plain_4bit_bytes: int
    exception_bytes: int  # extra bytes of the kept candidates over their NF4 size
    budget_bytes: int
    compute_dtype: torch.dtype = torch.bfloat16
    quantized: list[str] = field(default_factory=list)
    fmt: QuantFormat = NF4

    @property
    def total_bytes(self) -> int:
        return self.plain_4bit_bytes + self.exception_bytes

    def lines(self) -> list[str]:
        share = self.exception_bytes / self.plain_4bit_bytes if self.plain_4bit_bytes else 0.0
        out = [f"{self.fmt.label} base: {len(self.quantized)} linear modules in {self.fmt.plain}, {len(self.kept)} "
               f"kept in {str(self.compute_dtype).removeprefix('torch.')}; weights {_size(self.total_bytes)} = plain "
               f"{self.fmt.plain} "
               f"{_size(self.plain_4bit_bytes)} + exceptions {_size(self.exception_bytes)} ({share:.1%}; budget "
               f"{_size(self.budget_bytes)}); embeddings and norms stay in the compute dtype"]
        out += [f"  kept {n}: {why}" for n, why in sorted(self.kept.items())]
        return out

    def log(self) -> None:
        for line in self.lines():
            log.info(line)


def score_modules(model, input_ids: torch.Tensor, names: list[str], device: torch.device | None = None,
                  fmt: QuantFormat = NF4) -> list[ModuleScore]:
    """Scores of the linear modules ``names`` of a 16-bit model in format ``fmt``, from one no-grad forward of its backbone on
    ``input_ids`` [rows, length]; worst first, ties by name. A model on the CPU with a CUDA ``device`` runs
    one decoder layer at a time on the device (see :func:`layers_streamed_to`)."""
    modules = linear_modules(model)
    sq_err = {n: 0.0 for n in names}  # Σ ||X (W − Ŵ)ᵀ||²
    sq_out = {n: 0.0 for n in names}  # Σ ||X Wᵀ + b||²
    w_err: dict[str, float] = {}

    def hook(name):
        def fn(module, args, out):
            w = module.weight
            w_hat = fmt.roundtrip(w)
            if name not in w_err:
                w_err[name] = relative_error(w, w_hat)
            diff = F.linear(args[0], w - w_hat)  # [rows, length, out]: the bias cancels
            sq_err[name] += float(diff.float().pow(2).sum())
            sq_out[name] += float(out.float().pow(2).sum())
        return fn

    backbone = model.get_decoder()
    params_device = next(model.parameters()).device
    device = device or params_device
    handles = [modules[n].register_forward_hook(hook(n)) for n in names]
    stream = layers_streamed_to(backbone, device) if params_device != device else contextlib.nullcontext()
    try:
        with torch.no_grad(), stream:
            backbone(input_ids=input_ids.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    scores = []
    for n in names:
        if n not in w_err:  # never called on the batch (e.g. an unused expert)
            w_err[n] = relative_error(modules[n].weight, fmt.roundtrip(modules[n].weight))
        e_o = math.sqrt(sq_err[n] / sq_out[n]) if sq_out[n] > 0 else None
        scores.append(ModuleScore(n, modules[n].weight.numel(), w_err[n], e_o))
    return sorted(scores, key=lambda s: (-s.score, s.name))


@contextlib.contextmanager
def layers_streamed_to(backbone, device: torch.device):
    """Run a CPU-resident backbone with one decoder layer at a time on ``device``: everything but the layer
    stack moves there, each layer moves in before its forward and back out after it (forward hooks), so the
    device never holds more than one 16-bit layer. The layer stack is the backbone's largest ModuleList."""
    stacks = [m for m in backbone.children() if isinstance(m, torch.nn.ModuleList)]
    layers = max(stacks, key=len)
    others = [m for m in backbone.children() if m is not layers]
    home = next(backbone.parameters()).device
    for m in others:
        m.to(device)
    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(lambda m, args: m.to(device) and None))
        handles.append(layer.register_forward_hook(lambda m, args, out: m.to(home) and None))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m in others:
            m.to(home)


def module_costs(model, names: list[str], fmt: QuantFormat = NF4) -> dict[str, int]:
    """Extra bytes of keeping each module's weight in its current dtype instead of ``fmt``."""
    modules = linear_modules(model)
    return {n: modules[n].weight.numel() * modules[n].weight.element_size() - fmt.bytes_of(modules[n].weight)
            for n in names}


def plain_4bit_bytes(model, candidates: list[str], compute_dtype: torch.dtype, fmt: QuantFormat = NF4) -> int:
    """Bytes of the model with every candidate weight in ``fmt`` (NF4: 4-bit) and every other parameter in
    ``compute_dtype``."""
    modules = linear_modules(model)
    quantized = {id(modules[n].weight): modules[n].weight for n in candidates}
    b = torch.empty(0, dtype=compute_dtype).element_size()
    return sum(fmt.bytes_of(p) if id(p) in quantized else p.numel() * b for p in model.parameters())


def choose_exceptions(model, input_ids: torch.Tensor, *, keep_modules: list[str] = (),
                      exception_budget: float = 0.10, compute_dtype: torch.dtype = torch.bfloat16,
                      device: torch.device | None = None, keep_under: list[str] = (),
                      fmt: QuantFormat = NF4) -> QuantReport:
    """Score every candidate linear module of a 16-bit ``model`` in format ``fmt`` (none at a zero budget) and
    choose the ones kept in 16-bit. ``keep_under``: qualified module names whose linear layers all stay 16-bit,
    outside the budget; a vision-language model's tower and projector always do."""
    family = vision_family(base_model(model).config)
    keep_under = list(keep_under) + (vision_module_prefixes(model, family) if family is not None else [])
    head = _head_name(model)
    kept: dict[str, str] = {}
    candidates = []
    for name in linear_modules(model):
        reason = always_keep_reason(name, head)
        if any(name.startswith(p + ".") for p in keep_under):
            reason = "always: vision tower / projector"
        if reason:
            kept[name] = reason
        else:
            candidates.append(name)
    unmatched = [p for p in keep_modules if not any(matches_keep_list(n, [p]) for n in linear_modules(model))]
    if unmatched:
        raise QuantizationError(f"config key 'model.quant_keep_modules': {unmatched} match no linear module of the "
                                f"model (e.g. {candidates[:3]})")
    # with no budget the keep-list alone decides (e.g. an export rebuilding a checkpoint's recorded exceptions):
    # the calibration forward would only feed the log
    scores = score_modules(model, input_ids, candidates, device, fmt) if exception_budget > 0 else []
    score_of = {s.name: s for s in scores}
    costs = module_costs(model, candidates, fmt)
    plain = plain_4bit_bytes(model, candidates, compute_dtype, fmt)
    budget = int(exception_budget * plain)
    spent = 0
    for name in candidates:  # the explicit keep-list first: its bytes count against the budget
        if matches_keep_list(name, list(keep_modules)):
            s = score_of.get(name)
            kept[name] = "keep-list" + (f" (score {s.score:.4f}: weight {s.weight_error:.4f}, "
                                        f"output {_fmt(s.output_error)})" if s else "")
            spent += costs[name]
    if spent > budget:
        log.warning("model.quant_keep_modules: the kept modules take %s, over the %s budget "
                    "(model.quant_exception_budget=%g); keeping them anyway", _size(spent), _size(budget),
                    exception_budget)
    for rank, s in enumerate(scores):  # worst first; a module that does not fit is skipped, smaller ones may
        if s.name not in kept and spent + costs[s.name] <= budget:
            kept[s.name] = (f"rank {rank + 1}/{len(scores)}, score {s.score:.4f} (weight {s.weight_error:.4f}, "
                            f"output {_fmt(s.output_error)}), +{_size(costs[s.name])}")
            spent += costs[s.name]
    quantized = [n for n in candidates if n not in kept]
    return QuantReport(scores, kept, plain, spent, budget, compute_dtype, quantized, fmt)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def quantize_linears_(model, names: list[str], compute_dtype: torch.dtype) -> None:
    """Replace the linear modules ``names`` of an in-memory model by bitsandbytes NF4 ``Linear4bit`` (double
    quantization, blocks of 64) on the device their weight is on; the 16-bit weight is freed module by module."""
    import bitsandbytes as bnb

    for name in names:
        old = model.get_submodule(name)
        new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=old.bias is not None,
                                compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                device="meta")
        new.weight = bnb.nn.Params4bit(old.weight.data, requires_grad=False, quant_type="nf4",
                                       compress_statistics=True, blocksize=NF4_BLOCKSIZE).to(old.weight.device)
        if old.bias is not None:
            new.bias = torch.nn.Parameter(old.bias.data.to(compute_dtype), requires_grad=False)
        new.train(old.training)
        model.set_submodule(name, new)
        del old
    model.is_loaded_in_4bit = True  # the flag transformers' bnb quantizer sets; PEFT reads it to wrap Linear4bit


def disable_cpu_repacking(model) -> None:
    """bitsandbytes ≥ 0.48 repacks a ``Linear4bit`` weight for its AVX512-BF16 CPU kernel the first time the layer
    runs in eval mode without grad (e.g. during generate); afterwards the training forward has no input gradient
    (no autograd kernel for the packed path) and the dequantized weight is wrong. Turn that repacking off (an
    instance flag bitsandbytes sets in ``Linear4bit.__init__``); the GPU path is unaffected."""
    import bitsandbytes as bnb

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False


def quantize_model(model, input_ids: torch.Tensor, *, keep_modules: list[str] = (), exception_budget: float = 0.10,
                   compute_dtype: torch.dtype | None = None, keep_under: list[str] = ()) -> QuantReport:
    """Quantize an in-memory 16-bit model in place (scoring on its own weights, no copy); return the report.

    For models built in code (the demo model, the benchmark's random-weight models); a model on disk loads
    through ``load_model(..., load_in_4bit=True)`` and transformers' BitsAndBytesConfig instead.
    """
    require_bitsandbytes()
    compute_dtype = compute_dtype or model.get_output_embeddings().weight.dtype
    report = choose_exceptions(model, input_ids, keep_modules=keep_modules, exception_budget=exception_budget,
                               compute_dtype=compute_dtype, keep_under=keep_under)
    quantize_linears_(model, report.quantized, compute_dtype)
    disable_cpu_repacking(model)
    report.log()
    return report
