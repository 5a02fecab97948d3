"""Sampling parameters and the logits → next-token step of the sampler, on the device, without host syncs.

The processing order is transformers' ``generate``: repetition penalty, then temperature, top-k, top-p, min-p.
The token is drawn by inverting the distribution's CDF at one uniform number per sequence and position,
u = hash(seed, sequence, position) (splitmix64, counter-based): token = min{v : Σ_{w ≤ v} p_w > u}, an exact
draw from p. Because u depends on nothing but those three integers, a completion is the same whatever slot,
batch or order it is decoded in, so runs (and resumed runs) are reproducible for a seed. The log-prob returned
per token is log softmax(z / T) at the sampled token — the same quantity the trainer computes (no penalty, no
filtering), so that exp(trainer − sampler) measures the numerical mismatch between the two and nothing else.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

from ..memory.planner import sampling_rows
from .splitmix import GOLDEN, MIX1, MIX2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()  # end a sequence (the stop token is kept, as EOS is)
    stop_strings: tuple[str, ...] = ()  # end a sequence at the token that completes the string
    seed: int = 0
    sequence_ids: tuple[int, ...] = ()  # global id of each sequence (a data-parallel rank's share); () : 0, 1, ...

    def __post_init__(self):
        checks = [(self.max_new_tokens >= 1, "max_new_tokens", ">= 1"),
                  (math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "finite and >= 0"),
                  (0 < self.top_p <= 1, "top_p", "in (0, 1]"), (self.top_k >= 0, "top_k", ">= 0"),
                  (0 <= self.min_p < 1, "min_p", "in [0, 1)"),
                  (self.repetition_penalty > 0, "repetition_penalty", "> 0")]
        for ok, name, allowed in checks:
            if not ok:
                raise ValueError(f"sampling parameter {name} must be {allowed}; got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sequence_id(self, index: int) -> int:
        """The global id (which keys the random numbers) of the batch's sequence ``index``."""
        return self.sequence_ids[index] if self.sequence_ids else index


def logprob_temperature(temperature: float) -> float:
    """The temperature T of the log-probs log softmax(z / T) that score a completion, as the sampler reports them:
    the sampling temperature, or 1 for greedy decoding (T = 0, tokens argmax z, which no scale changes)."""
    return temperature if temperature > 0 else 1.0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """z_v / θ where z_v > 0 and z_v · θ where z_v ≤ 0, for tokens v already in the sequence (seen [B, V] bool)."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def filter_logits(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [B, V] with the tokens outside top-k / top-p / min-p set to −inf."""
    out = scaled
    if params.top_k > 0 and params.top_k < out.shape[-1]:
        kth = torch.topk(out, params.top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if params.top_p < 1.0:
        # keep the smallest prefix (by descending probability) whose mass reaches top_p
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(out, dim=-1)
        out = out.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return out


def sampling_distribution(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probabilities [B, V] of the distribution the sampler draws from (reference for tests)."""
    z = logits.float()
    if seen is not None:
        z = apply_repetition_penalty(z, seen, params.repetition_penalty)
    return torch.log_softmax(filter_logits(z / max(params.temperature, 1e-6), params), dim=-1)


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed integers)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping arithmetic): a bijective, well-mixed hash."""
    z = x + GOLDEN
    z = (z ^ _shift_right(z, 30)) * MIX1
    z = (z ^ _shift_right(z, 27)) * MIX2
    return z ^ _shift_right(z, 31)


def uniform_reference(seed: int, sequence: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """u ∈ [0, 1) float64 [B] from (seed, sequence id [B], position [B]); 53 random bits each:
    u = (splitmix64(splitmix64(splitmix64(seed) ⊕ sequence) ⊕ position) >> 11) / 2⁵³ (the plain twin of
    sampling_kernel.uniform_triton)."""
    z = _splitmix64(_splitmix64(_splitmix64(torch.full_like(sequence, seed)) ^ sequence) ^ position)
    return _shift_right(z, 11).to(torch.float64) / float(2 ** 53)


def uniform_for(seed: int, sequence: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """:func:`uniform_reference`'s uniforms: on CUDA with Triton from one kernel launch (the same bits), else
    from its PyTorch ops."""
    if sequence.is_cuda and sequence.shape == position.shape and triton_available() and not _UNIFORM_FAILED:
        try:
            from .sampling_kernel import uniform_triton

            return uniform_triton(seed, sequence, position)
        except Exception as e:  # noqa: BLE001 - the kernel could not build here: the PyTorch ops, from now on
            _UNIFORM_FAILED.append(f"{type(e).__name__}: {str(e)[:300]}")
            log.warning("the uniform kernel failed (%s); drawing uniforms with PyTorch ops", _UNIFORM_FAILED[0])
    return uniform_reference(seed, sequence, position)


_UNIFORM_FAILED: list[str] = []  # why the uniform kernel could not run in this process (then it is not tried again)


def next_tokens(logits: torch.Tensor, params: SamplingParams, sequence: torch.Tensor, position: torch.Tensor,
                seen: torch.Tensor | None = None, rows: int | None = None,
                fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] long, log-probs [B] float32) for logits [B, V]; sequence, position [B] long key each row's
    random number (see the module docstring). Rows are drawn ``rows`` at a time (default: as many as keep the
    temporaries within the planner's sampling chunk); the result does not depend on it. Plain temperature
    sampling of float32 logits runs as one Triton kernel (``fused``; default: on CUDA with Triton), the same
    draw up to rounding at a CDF boundary (rollout/sampling_kernel.py)."""
    if draws_fused(logits, params, seen, fused):
        try:
            from .sampling_kernel import sample_with_temperature

            return sample_with_temperature(logits, uniform_for(params.seed, sequence, position), params.temperature)
        except Exception as e:  # noqa: BLE001 - the kernel could not build here: the PyTorch path, from now on
            if fused:
                raise
            _FUSED_FAILED.append(f"{type(e).__name__}: {str(e)[:300]}")
            log.warning("the fused sampling kernel failed (%s); sampling with PyTorch ops", _FUSED_FAILED[0])
    rows = rows or sampling_rows(logits.shape[-1])
    if logits.shape[0] <= rows:
        return _next_tokens(logits, params, sequence, position, seen)
    parts = [_next_tokens(logits[i:i + rows], params, sequence[i:i + rows], position[i:i + rows],
                          None if seen is None else seen[i:i + rows]) for i in range(0, logits.shape[0], rows)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


_FUSED_FAILED: list[str] = []  # why the fused kernel could not run in this process (then it is not tried again)


def fused_sampling_applies(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None,
                           fused: bool | None) -> bool:
    """Whether :func:`next_tokens` draws with the fused kernel: asked for (default: the logits are on CUDA and
    Triton imports), float32 rows, and nothing but a temperature between the logits and the draw."""
    if fused is None:
        fused = logits.is_cuda and triton_available()
    plain = (not params.greedy and params.top_p == 1.0 and params.min_p == 0.0
             and (params.top_k == 0 or params.top_k >= logits.shape[-1])
             and (seen is None or params.repetition_penalty == 1.0))
    return fused and plain and logits.dtype == torch.float32 and logits.stride(-1) == 1


def draws_fused(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None,
                fused: bool | None = None) -> bool:
    """Whether :func:`next_tokens` draws these rows with the fused kernel now: it applies (``fused`` as there) and
    has not failed in this process (no host reads then: a CUDA graph can hold the draw)."""
    return fused_sampling_applies(logits, params, seen, fused) and not _FUSED_FAILED


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports (installed is not enough: one built for another torch or CUDA raises ImportError)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


CDF_BLOCK = 1024  # vocabulary entries a block of the two-level inverse CDF


def first_with_mass(cdf: torch.Tensor, mass: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """min{i : mass_i and cdf_i > target} per row of cdf, mass [B, n] (target [B, 1]); the last entry with mass
    where none exceeds it (u · total rounded up to the total); 0 where nothing has mass (NaN or −inf rows, as
    the fused kernel). [B, 1] long. In exact arithmetic the first entry whose CDF exceeds the target always has
    mass; a GPU's parallel scan is not monotonic across entries without mass (each prefix sums in its own order),
    so a plain search could stop on one of them — a token of zero probability, or past the vocabulary where the
    row's padding follows."""
    n = cdf.shape[-1]
    hit = mass & (cdf > target)
    first = hit.to(torch.uint8).argmax(-1, keepdim=True)  # the first maximum
    any_mass = mass.any(-1, keepdim=True)
    last = torch.where(any_mass, n - 1 - mass.flip(-1).to(torch.uint8).argmax(-1, keepdim=True), 0)
    return torch.where(hit.any(-1, keepdim=True), first, last)


def inverse_cdf_reference(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`inverse_cdf`: the whole float64 CDF [B, V]; token = min{v : cdf_v > u · cdf_V}, never past
    the last token with mass."""
    cdf = probs.to(torch.float64).cumsum(-1)  # [B, V]
    return first_with_mass(cdf, probs > 0, u[:, None] * cdf.amax(-1, keepdim=True))[:, 0]


def off_boundary_rows(probs: torch.Tensor, u: torch.Tensor, got: torch.Tensor, want: torch.Tensor,
                      tol: float = 1e-6) -> list[int]:
    """Rows where a draw ``got`` [B] differs from the reference's ``want`` (:func:`inverse_cdf_reference` on probs
    [B, V] at u [B]) although u lies ≥ ``tol`` from both edges of the reference token's interval of the normalised
    CDF: differences rounding cannot explain (the fused kernel's twin checks)."""
    cdf = probs.double().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    bad = []
    for row in (got != want).nonzero()[:, 0].tolist():
        edges = cdf[row, [max(int(want[row]) - 1, 0), int(want[row])]]
        if float((edges - u[row]).abs().min()) >= tol:
            bad.append(row)
    return bad


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens [B] long drawn from probs [B, V] (float32, unnormalised, ≥ 0) at uniforms u [B] float64, in two
    levels: the CDF of the blocks' sums (float64, [B, V / CDF_BLOCK]) picks the block holding u · total, and the
    CDF inside that block alone picks the token. The same draw as the whole CDF's (up to float64 rounding at a
    boundary) without writing or scanning B × V float64 values."""
    B, V = probs.shape
    C = CDF_BLOCK
    full = V // C * C
    sums = probs[:, :full].unflatten(1, (-1, C)).sum(-1, dtype=torch.float64)  # [B, V // C]
    if full < V:
        sums = torch.cat([sums, probs[:, full:].sum(-1, dtype=torch.float64)[:, None]], dim=1)
    block_cdf = sums.cumsum(-1)  # [B, nb]
    target = u[:, None] * block_cdf.amax(-1, keepdim=True)  # [B, 1]: u · total
    block = first_with_mass(block_cdf, sums > 0, target)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)  # [B, 1]
    cols = block * C + torch.arange(C, device=probs.device)  # [B, C]
    inside = probs.gather(1, cols.clamp(max=V - 1)).masked_fill(cols >= V, 0.0).to(torch.float64)  # [B, C]
    # the block's sum and its own CDF's end may round differently: the search may run off the block's end too
    index = first_with_mass(inside.cumsum(-1), inside > 0, target - before)
    return (block * C + index)[:, 0]


def token_logprobs(z: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(z)[token] = z_token − logsumexp(z) per row of z [B, V] (float32): one reading pass over the
    vocabulary, no [B, V] result written."""
    return z.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(z, dim=-1)


def _next_tokens(logits, params, sequence, position, seen):
    z = logits.float()
    penalised = apply_repetition_penalty(z, seen, params.repetition_penalty) if seen is not None else z
    if params.greedy:  # argmax; the log-prob at temperature 1 (logprob_temperature)
        tokens = penalised.argmax(-1)
        logprobs = token_logprobs(z, tokens)
        return tokens, logprobs
    # temperature 1: x / 1 = x exactly, so the division (two full-vocabulary passes a step) is skipped
    scale = (lambda t: t) if params.temperature == 1.0 else (lambda t: t / params.temperature)
    filtered = filter_logits(scale(penalised), params)
    tokens = inverse_cdf(torch.softmax(filtered, dim=-1), uniform_for(params.seed, sequence, position))
    logprobs = token_logprobs(scale(z), tokens)
    return tokens, logprobs


def stop_token_ids(gen_cfg, tokenizer) -> list[int]:
    """The token ids that end a completion: the tokenizer's EOS (unless ``generation.ignore_eos``) and
    ``generation.stop_token_ids``, in that order without repeats (both rollout backends use these)."""
    eos = tokenizer.eos_token_id
    eos = [] if gen_cfg.ignore_eos or eos is None else (list(eos) if isinstance(eos, list) else [eos])
    return list(dict.fromkeys(eos + list(gen_cfg.stop_token_ids)))


def sampling_params(gen_cfg, tokenizer, seed: int, max_new_tokens: int | None = None,
                    temperature: float | None = None) -> SamplingParams:
    """The sampling parameters of generation config ``gen_cfg`` (stop tokens: :func:`stop_token_ids`; its stop
    strings); ``max_new_tokens`` / ``temperature`` override the config's."""
    return SamplingParams(max_new_tokens=max_new_tokens or gen_cfg.max_completion_length,
                          temperature=gen_cfg.temperature if temperature is None else temperature,
                          top_p=gen_cfg.top_p, top_k=gen_cfg.top_k, min_p=gen_cfg.min_p,
                          repetition_penalty=gen_cfg.repetition_penalty,
                          stop_token_ids=tuple(stop_token_ids(gen_cfg, tokenizer)),
                          stop_strings=tuple(gen_cfg.stop_strings), seed=seed)


def stop_index(tokens: list[int], stop_strings: tuple[str, ...], decode, start: int = 0) -> int | None:
    """Smallest j ≥ start such that decode(tokens[:j+1]) contains a stop string, else None."""
    if not stop_strings or not any(s in decode(tokens) for s in stop_strings):
        return None
    for j in range(start, len(tokens)):
        text = decode(tokens[:j + 1])
        if any(s in text for s in stop_strings):
            return j
    return None


__all__ = ["SamplingParams", "apply_repetition_penalty", "filter_logits", "logprob_temperature",
           "sampling_distribution", "next_tokens", "stop_index", "stop_token_ids"]
