"""Triton decode attention over a shared prompt prefix and a per-sequence suffix (GPU fast path).

Twin of :func:`longrl.rollout.attention.decode_attention_reference` (tests compare them on the GPU). One
program per (sequence b, key head h) reads the prefix keys of b's prompt and b's own suffix keys in blocks,
with an online softmax over both (m: running max, l: running normaliser, acc: running Σ p·v):

    m' = max(m, max_t s_t),  l' = l·e^(m−m') + Σ_t e^(s_t−m'),  acc' = acc·e^(m−m') + Σ_t e^(s_t−m') v_t

The lengths are read on the device, so one launch serves any lengths (CUDA-graph safe, no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _attend_block(q, k_ptr, v_ptr, stride_t, length, m, l, acc, scale,
                  D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr):
    dims = tl.arange(0, DP)
    for start in range(0, length, BLOCK):
        t = start + tl.arange(0, BLOCK)
        in_range = t < length
        ok = in_range[:, None] & (dims[None, :] < D)
        k = tl.load(k_ptr + t[:, None] * stride_t + dims[None, :], mask=ok, other=0.0)
        v = tl.load(v_ptr + t[:, None] * stride_t + dims[None, :], mask=ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale  # [R, BLOCK] float32
        s = tl.where(in_range[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    return m, l, acc


@triton.jit
def _decode_kernel(Q, KP, VP, KS, VS, PIDX, PLEN, SLEN, OUT, scale,
                   stride_qb, stride_qh, stride_pp, stride_ph, stride_pt, stride_sb, stride_sh, stride_st,
                   stride_ob, stride_oh,
                   REP: tl.constexpr, R: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, R)  # query heads of this key head, padded to R ≥ 16 for tl.dot
    dims = tl.arange(0, DP)
    row_ok = rows[:, None] < REP
    io_mask = row_ok & (dims[None, :] < D)
    q = tl.load(Q + b * stride_qb + (h * REP + rows)[:, None] * stride_qh + dims[None, :], mask=io_mask, other=0.0)
    m = tl.full([R], float("-inf"), tl.float32)
    l = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, DP], tl.float32)
    p_idx = tl.load(PIDX + b).to(tl.int64)
    p_len = tl.load(PLEN + b).to(tl.int32)
    s_len = tl.load(SLEN + b).to(tl.int32)
    m, l, acc = _attend_block(q, KP + p_idx * stride_pp + h * stride_ph, VP + p_idx * stride_pp + h * stride_ph,
                              stride_pt, p_len, m, l, acc, scale, D, DP, BLOCK)
    m, l, acc = _attend_block(q, KS + b.to(tl.int64) * stride_sb + h * stride_sh,
                              VS + b.to(tl.int64) * stride_sb + h * stride_sh, stride_st, s_len, m, l, acc, scale,
                              D, DP, BLOCK)
    out = acc / l[:, None]
    tl.store(OUT + b * stride_ob + (h * REP + rows)[:, None] * stride_oh + dims[None, :],
             out.to(OUT.dtype.element_ty), mask=io_mask)


def decode_attention_triton(q, k_pre, v_pre, prefix_index, prefix_len, k_suf, v_suf, suffix_len, scale):
    """Same arguments and result as the reference: q [B, Hq, D] → [B, Hq, D]."""
    B, Hq, D = q.shape
    Hkv = k_pre.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    rep = Hq // Hkv
    _decode_kernel[(B, Hkv)](
        q, k_pre, v_pre, k_suf, v_suf, prefix_index, prefix_len, suffix_len, out, float(scale),
        q.stride(0), q.stride(1), k_pre.stride(0), k_pre.stride(1), k_pre.stride(2),
        k_suf.stride(0), k_suf.stride(1), k_suf.stride(2), out.stride(0), out.stride(1),
        REP=rep, R=max(16, triton.next_power_of_2(rep)), D=D, DP=max(16, triton.next_power_of_2(D)), BLOCK=64, num_warps=4, num_stages=2)
    return out
