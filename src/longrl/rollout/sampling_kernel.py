"""Temperature sampling in one Triton kernel (GPU fast path of :func:`longrl.rollout.sampling.next_tokens`).

Twin of the PyTorch path (softmax, then :func:`~longrl.rollout.sampling.inverse_cdf`, then
:func:`~longrl.rollout.sampling.token_logprobs`), for the common case of plain temperature sampling (no top-k,
top-p, min-p or repetition penalty). One program per row x = z / T [V], in vocabulary blocks of BLOCK:

    pass 1, each block b:  m_b = max x,  s_b = Σ e^(x − m_b)          (s_b in float64; both kept in registers)
    then:   M = max_b m_b,  w_b = s_b · e^(m_b − M),  W_b = Σ_{b' ≤ b} w_b'          (block CDF, float64)
            target = u · max_b W_b;  block β = min{b : w_b > 0, W_b > target}  (else the last block with mass)
    pass 2, block β only:  c_j = W_{β−1} + e^(m_β − M) · Σ_{i ≤ j} e^(x_i − m_β);
            token = β·BLOCK + min{j : e_j > 0, c_j > target}  (else the block's last entry with mass)
    log-prob = x_token − (M + log W_last)

Each search asks for mass explicitly (:func:`~longrl.rollout.sampling.first_with_mass`): a GPU's parallel scan is
not monotonic across entries without mass, and counting entries below the target drew zero-probability tokens
(and tokens past the vocabulary) on the GPU. The draw is the reference's, min{v : CDF_v > u · total}, up to
rounding where u · total falls within ~1e-7 of a boundary; it reads the logits about once (the PyTorch path:
about eight passes over [B, V] and ~25 launches).

The uniforms themselves, u = splitmix64(splitmix64(splitmix64(seed) ⊕ sequence) ⊕ position) >> 11 over 2⁵³
(:func:`~longrl.rollout.sampling.uniform_reference`), come from one launch of :func:`uniform_triton` (in uint64:
wrapping products, logical shifts), bit for bit the twin's; the twin's ~40 element-wise launches a decode step
were host time a small model's step waits for.
"""

from __future__ import annotations

import torch

from .splitmix import splitmix64_int

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton use the PyTorch path
    triton = None

SAMPLE_BLOCK = 8192  # vocabulary entries a block (a 128K vocabulary is 16 blocks)
SAMPLE_WARPS = 16  # 32 KB of logits in flight per program: one program a row must still stream at full bandwidth


if triton is not None:
    @triton.jit
    def _first_with_mass(cdf, mass, target, idx, N: tl.constexpr):
        """min{i : mass_i, cdf_i > target} over the vector cdf [N] at positions idx [N] (0..N−1); the last i with
        mass where none exceeds the target (0 where nothing has mass)."""
        first = tl.min(tl.where(mass & (cdf > target), idx, N), 0)
        last = tl.max(tl.where(mass, idx, -1), 0)
        return tl.where(first < N, first, tl.maximum(last, 0))

    @triton.jit
    def _sample_kernel(Z, U, TOKENS, LOGPROBS, V, stride_z, temperature, NB: tl.constexpr, NBP: tl.constexpr,
                       BLOCK: tl.constexpr):
        """One program per row: the token drawn at u and its log-prob (see the module docstring). The blocks'
        (m_b, s_b) stay in registers ([NBP] vectors): a store to memory read back by the program's other threads
        would need a barrier (without one, a one-block vocabulary reads stale values)."""
        row = tl.program_id(0).to(tl.int64)
        z_row = Z + row * stride_z
        cols = tl.arange(0, BLOCK)
        blocks = tl.arange(0, NBP)
        m_b = tl.full([NBP], float("-inf"), tl.float32)
        s_b = tl.zeros([NBP], tl.float64)
        for b in range(0, NB):  # pass 1: each block's max and Σ e^(x − m_b)
            idx = b * BLOCK + cols
            x = tl.math.div_rn(tl.load(z_row + idx, mask=idx < V, other=float("-inf")), temperature)
            m = tl.max(x, 0)
            e = tl.where(x > float("-inf"), tl.exp(x - tl.where(m > float("-inf"), m, 0.0)), 0.0)
            m_b = tl.where(blocks == b, m, m_b)
            s_b = tl.where(blocks == b, tl.sum(e.to(tl.float64), 0), s_b)
        top = tl.max(m_b, 0)
        has_mass = m_b > float("-inf")
        w = tl.where(has_mass, s_b * tl.exp(tl.where(has_mass, m_b - top, 0.0).to(tl.float64)), 0.0)
        cdf = tl.cumsum(w, 0)  # [NBP] float64 (not monotonic across blocks without mass on a GPU)
        total = tl.max(cdf, 0)
        target = tl.load(U + row) * total
        beta = _first_with_mass(cdf, w > 0, target, blocks, NBP)
        before = tl.sum(tl.where(blocks == beta - 1, cdf, 0.0), 0)
        m_beta = tl.max(tl.where(blocks == beta, m_b, float("-inf")), 0)
        idx = beta * BLOCK + cols  # pass 2: the chosen block alone
        x = tl.math.div_rn(tl.load(z_row + idx, mask=idx < V, other=float("-inf")), temperature)
        e = tl.where(x > float("-inf"), tl.exp(x - tl.where(m_beta > float("-inf"), m_beta, 0.0)), 0.0)
        inside = tl.cumsum(e.to(tl.float64), 0) * tl.exp((m_beta - top).to(tl.float64))  # [BLOCK]
        j = _first_with_mass(inside, e > 0, target - before, cols, BLOCK)
        x_token = tl.sum(tl.where(cols == j, x, 0.0), 0)
        tl.store(TOKENS + row, (beta * BLOCK + j).to(tl.int64))
        tl.store(LOGPROBS + row, x_token - (top + tl.log(total).to(tl.float32)))

    @triton.jit
    def _splitmix64(x):
        """splitmix64's finaliser on uint64 (products wrap, shifts are logical on unsigned integers)."""
        z = x + 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    @triton.jit(do_not_specialize=["seed_mix"])
    def _uniform_kernel(SEQ, POS, U, seed_mix, B, BLOCK: tl.constexpr):
        """U[i] = (splitmix64(splitmix64(seed_mix ⊕ SEQ[i]) ⊕ POS[i]) >> 11) / 2⁵³, seed_mix = splitmix64(seed)
        (the host's, as an integer in [0, 2⁶⁴))."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < B
        seq = tl.load(SEQ + i, mask=inside, other=0).to(tl.uint64, bitcast=True)
        pos = tl.load(POS + i, mask=inside, other=0).to(tl.uint64, bitcast=True)
        z = _splitmix64(_splitmix64(seed_mix.to(tl.uint64) ^ seq) ^ pos)
        tl.store(U + i, (z >> 11).to(tl.float64) / 9007199254740992.0, mask=inside)


UNIFORM_BLOCK = 256  # rows a program of _uniform_kernel


def uniform_triton(seed: int, sequence: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """u ∈ [0, 1) float64 [B] from (seed, sequence id [B] long, position [B] long) in one launch: bit for bit
    :func:`~longrl.rollout.sampling.uniform_reference`."""
    seq, pos = sequence.to(torch.long).contiguous(), position.to(torch.long).contiguous()
    u = torch.empty(seq.shape, dtype=torch.float64, device=seq.device)
    if seq.numel():
        _uniform_kernel[(triton.cdiv(seq.numel(), UNIFORM_BLOCK),)](seq, pos, u, splitmix64_int(seed), seq.numel(),
                                                                    BLOCK=UNIFORM_BLOCK)
    return u


def sample_with_temperature(logits: torch.Tensor, u: torch.Tensor, temperature: float,
                            block: int = SAMPLE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] long, log-probs [B] float32) drawn from softmax(logits / T) for logits [B, V] float32 at
    uniforms u [B] float64: the PyTorch path's result (see the module docstring). ``block`` (a power of two) only
    changes rounding; tests make it small so that short vocabularies span several blocks."""
    B, V = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, "float32 logits, contiguous rows"
    nb = -(-V // block)
    nbp = triton.next_power_of_2(nb)
    tokens = torch.empty(B, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B:
        _sample_kernel[(B,)](logits, u.to(torch.float64).contiguous(), tokens, logprobs, V, logits.stride(0),
                             float(temperature), nb, NBP=nbp, BLOCK=block,
                             num_warps=min(SAMPLE_WARPS, max(1, block // 256)))
    return tokens, logprobs


__all__ = ["sample_with_temperature", "uniform_triton", "SAMPLE_BLOCK"]
