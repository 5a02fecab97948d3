"""Row-wise log-softmax statistics of a block of logits in one Triton kernel a direction, and their PyTorch twins.

For raw logits r [n, V] (the LM head's product in the compute dtype), z = r · m / T (m: the logit multiplier, T:
the temperature; both scalars), target y and incoming gradients g (of the log-prob) and g_H (of the entropy):

    forward:   lse = logsumexp(z),  lp = z_y − lse,  H = lse − Σ_j p_j z_j           (p = exp(z − lse))
    backward:  dr_j = (g (1[j = y] − p_j) − g_H p_j (z_j − lse + H)) · m / T          written over r, in r's dtype

ops/logprobs.py calls them per chunk of rows. In PyTorch the forward is a float32 copy of the block, a
multi-pass logsumexp and a gather, and the backward a float32 copy, a subtraction, an exponential, a product, a
scatter and a cast: ~6 passes over a [1,024, 128,256] float32 block each way. Here one program a row reads its
16-bit logits once (twice in backward: the running maximum and sum first), in blocks of ``BLOCK`` entries,
keeping a running maximum and rescaled sums; the backward overwrites the logits with their gradient, so no
[n, V] buffer besides the product's own is allocated. Results equal the twins' up to float32 summation order
(tests/test_logprobs.py, under Triton's interpreter).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 4096  # vocabulary entries a program handles at a time
# (the vocabulary size is a compile-time constant: one per model; it also bounds the loops, which Triton's
# interpreter cannot do with a run-time argument)


def _scaled(raw: torch.Tensor, multiplier: float, temperature: float) -> torch.Tensor:
    z = raw.to(torch.float32)
    if multiplier != 1.0:
        z = z * multiplier
    if temperature != 1.0:
        z = z / temperature
    return z


def row_stats_reference(raw, targets, multiplier: float, temperature: float, with_entropy: bool):
    """Twin of :func:`row_stats`: (lse [n], lp [n], H [n] or None) in float32."""
    z = _scaled(raw, multiplier, temperature)
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(1, targets[:, None]).squeeze(1) - lse
    ent = lse - (torch.exp(z - lse[:, None]) * z).sum(-1) if with_entropy else None
    return lse, lp, ent


def row_grad_reference(raw, targets, lse, g, g_ent, ent, multiplier: float, temperature: float) -> torch.Tensor:
    """Twin of :func:`row_grad_`: dr [n, V] in raw's dtype (g_ent, ent None: no entropy term)."""
    z = _scaled(raw, multiplier, temperature)
    logp = z - lse[:, None]
    p = torch.exp(logp)
    dz = p * (-g[:, None])
    dz.scatter_add_(1, targets[:, None], g[:, None].to(dz.dtype))
    if g_ent is not None:
        dz -= g_ent[:, None] * p * (logp + ent[:, None])
    if temperature != 1.0:
        dz = dz / temperature
    if multiplier != 1.0:
        dz = dz * multiplier
    return dz.to(raw.dtype)


if triton is not None:
    @triton.jit
    def _scale(r, mult, temp, SCALE_M: tl.constexpr, SCALE_T: tl.constexpr):
        z = r.to(tl.float32)
        if SCALE_M:
            z = z * mult
        if SCALE_T:
            z = z / temp
        return z

    @triton.jit
    def _row_stats_kernel(R, Y, LSE, LP, ENT, stride_r, mult, temp, V: tl.constexpr, SCALE_M: tl.constexpr,
                          SCALE_T: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = R + row * stride_r
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # running maximum of each lane
        s = tl.zeros([BLOCK], tl.float32)  # Σ exp(z − m) of each lane
        t = tl.zeros([BLOCK], tl.float32)  # Σ exp(z − m) · z of each lane (entropy)
        for start in range(0, V, BLOCK):
            ok = start + cols < V
            z = _scale(tl.load(base + start + cols, mask=ok, other=0.0), mult, temp, SCALE_M, SCALE_T)
            z = tl.where(ok, z, float("-inf"))
            m_new = tl.maximum(m, z)
            alive = m_new > float("-inf")
            shift = tl.where(alive, tl.exp(m - m_new), 0.0)
            e = tl.where(alive, tl.exp(z - m_new), 0.0)
            s = s * shift + e
            if WITH_ENTROPY:
                t = t * shift + tl.where(ok, e * z, 0.0)
            m = m_new
        m_row = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp(m - m_row), 0.0)
        total = tl.sum(s * w, 0)
        lse = m_row + tl.log(total)
        y = tl.load(Y + row)
        zy = _scale(tl.load(base + y), mult, temp, SCALE_M, SCALE_T)
        tl.store(LSE + row, lse)
        tl.store(LP + row, zy - lse)
        if WITH_ENTROPY:
            tl.store(ENT + row, lse - tl.sum(t * w, 0) / total)

    @triton.jit
    def _row_grad_kernel(R, Y, LSE, G, GENT, ENT, stride_r, mult, temp, V: tl.constexpr, SCALE_M: tl.constexpr,
                         SCALE_T: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = R + row * stride_r
        cols = tl.arange(0, BLOCK)
        lse = tl.load(LSE + row)
        g = tl.load(G + row)
        y = tl.load(Y + row)
        if WITH_ENTROPY:
            g_ent = tl.load(GENT + row)
            ent = tl.load(ENT + row)
        for start in range(0, V, BLOCK):
            idx = start + cols
            ok = idx < V
            z = _scale(tl.load(base + idx, mask=ok, other=0.0), mult, temp, SCALE_M, SCALE_T)
            logp = z - lse
            p = tl.exp(logp)
            dz = p * (-g)
            dz = tl.where(idx == y, dz + g, dz)
            if WITH_ENTROPY:
                dz -= g_ent * p * (logp + ent)
            if SCALE_T:
                dz = dz / temp
            if SCALE_M:
                dz = dz * mult
            tl.store(base + idx, dz.to(R.dtype.element_ty), mask=ok)


def _flags(multiplier: float, temperature: float) -> dict:
    return dict(SCALE_M=multiplier != 1.0, SCALE_T=temperature != 1.0, BLOCK=BLOCK, num_warps=8)


def row_stats(raw: torch.Tensor, targets: torch.Tensor, multiplier: float, temperature: float, with_entropy: bool):
    """(lse [n], lp [n], H [n] or None) float32 of the logits block ``raw`` [n, V] (unit stride along V)."""
    n, V = raw.shape
    lse = torch.empty(n, dtype=torch.float32, device=raw.device)
    lp = torch.empty_like(lse)
    ent = torch.empty_like(lse) if with_entropy else None
    if n:
        _row_stats_kernel[(n,)](raw, targets, lse, lp, ent if with_entropy else lse, raw.stride(0),
                                float(multiplier), float(temperature), V=V, WITH_ENTROPY=with_entropy,
                                **_flags(multiplier, temperature))
    return lse, lp, ent


def row_grad_(raw: torch.Tensor, targets, lse, g, g_ent, ent, multiplier: float, temperature: float) -> torch.Tensor:
    """Overwrite the logits block ``raw`` [n, V] with dr (the backward above; g_ent, ent None: no entropy
    term); returns raw. lse, g, g_ent, ent: float32 [n]."""
    n, V = raw.shape
    with_entropy = g_ent is not None
    if n:
        _row_grad_kernel[(n,)](raw, targets, lse, g, g_ent if with_entropy else g, ent if with_entropy else g,
                               raw.stride(0), float(multiplier), float(temperature), V=V, WITH_ENTROPY=with_entropy,
                               **_flags(multiplier, temperature))
    return raw
