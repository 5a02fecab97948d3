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
(tests/test_logprobs.py, under Triton's interpreter). The twins are also chunked_logprobs' PyTorch path (CPU,
float64, a final-logit softcap).
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


def scale_logits(raw: torch.Tensor, multiplier: float, softcap: float | None, temperature: float):
    """(z, tanh or None): z = softcap(m · raw) / T for raw logits [n, V], in float32 (float64 stays float64);
    softcap(x) = c · tanh(x / c) when c is set."""
    z = raw.to(torch.float32) if raw.dtype in (torch.float16, torch.bfloat16) else raw
    if multiplier != 1.0:
        z = z * multiplier
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(z / softcap)
        z = tanh * softcap
    if temperature != 1.0:
        z = z / temperature
    return z, tanh


def row_stats_reference(raw, targets, multiplier: float, temperature: float, with_entropy: bool,
                        softcap: float | None = None):
    """Twin of :func:`row_stats` and the PyTorch path (with a softcap too): (lse [n], lp [n], H [n] or None) in
    z's dtype. The caller's logits may be a temporary: they are dropped once scaled."""
    z, _ = scale_logits(raw, multiplier, softcap, temperature)
    del raw
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(1, targets[:, None]).squeeze(1) - lse
    ent = lse - (torch.exp(z - lse[:, None]) * z).sum(-1) if with_entropy else None
    return lse, lp, ent


def row_grad_reference(raw, targets, lse, g, g_ent, ent, multiplier: float, temperature: float,
                       softcap: float | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Twin of :func:`row_grad_` and the PyTorch path (with a softcap too): dr [n, V] in ``out_dtype`` (default:
    raw's); g_ent, ent None: no entropy term. dL/dz = g (onehot − p) − g_H p (log p + H), then back through 1/T,
    tanh and m."""
    out_dtype = out_dtype or raw.dtype
    z, tanh = scale_logits(raw, multiplier, softcap, temperature)
    del raw
    logp = z - lse[:, None]
    p = torch.exp(logp)
    dz = p * (-g[:, None].to(z.dtype))
    dz.scatter_add_(1, targets[:, None], g[:, None].to(z.dtype))
    if g_ent is not None:
        dz -= g_ent[:, None].to(z.dtype) * p * (logp + ent[:, None])
    del logp, p, z
    if temperature != 1.0:
        dz = dz / temperature
    if softcap is not None:
        dz = dz * (1.0 - tanh * tanh)
    if multiplier != 1.0:
        dz = dz * multiplier
    return dz.to(out_dtype)


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
