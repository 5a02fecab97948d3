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
def _prefix_kernel(Q, KP, VP, MEMBERS, PLEN_P, M_OUT, L_OUT, ACC_OUT, scale,
                   stride_qb, stride_qh, stride_pp, stride_ph, stride_pt, stride_mem,
                   REP: tl.constexpr, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                   BLOCK: tl.constexpr):
    """One program per (prompt entry p, key head h): the queries of every sequence sharing prompt p (G × REP
    rows) against p's keys, read once; writes each row's partial (m, l, acc)."""
    p = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, R)  # row = member j · REP + r
    j = rows // REP
    r = rows % REP
    slot = tl.load(MEMBERS + p * stride_mem + j, mask=j < G, other=-1)
    row_ok = slot >= 0
    slot = tl.where(row_ok, slot, 0).to(tl.int64)
    dims = tl.arange(0, DP)
    io_mask = row_ok[:, None] & (dims[None, :] < D)
    q_rows = slot * stride_qb + (h * REP + r) * stride_qh
    q = tl.load(Q + q_rows[:, None] + dims[None, :], mask=io_mask, other=0.0)
    m = tl.full([R], float("-inf"), tl.float32)
    l = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, DP], tl.float32)
    p_len = tl.load(PLEN_P + p).to(tl.int32)
    base = p.to(tl.int64) * stride_pp + h * stride_ph
    m, l, acc = _attend_block(q, KP + base, VP + base, stride_pt, p_len, m, l, acc, scale, D, DP, BLOCK)
    out_rows = slot * (stride_qb // stride_qh) + h * REP + r  # index into [S·Hq] partial buffers
    tl.store(M_OUT + out_rows, m, mask=row_ok)
    tl.store(L_OUT + out_rows, l, mask=row_ok)
    tl.store(ACC_OUT + out_rows[:, None] * DP + dims[None, :], acc, mask=row_ok[:, None] & (dims[None, :] < DP))


@triton.jit
def _decode_kernel(Q, KP, VP, KS, VS, PIDX, PLEN, SLEN, OUT, M_IN, L_IN, ACC_IN, scale,
                   stride_qb, stride_qh, stride_pp, stride_ph, stride_pt, stride_sb, stride_sh, stride_st,
                   stride_ob, stride_oh,
                   REP: tl.constexpr, R: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                   GROUPED: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, R)  # query heads of this key head, padded to R ≥ 16 for tl.dot
    dims = tl.arange(0, DP)
    row_ok = rows[:, None] < REP
    io_mask = row_ok & (dims[None, :] < D)
    q = tl.load(Q + b * stride_qb + (h * REP + rows)[:, None] * stride_qh + dims[None, :], mask=io_mask, other=0.0)
    s_len = tl.load(SLEN + b).to(tl.int32)
    if GROUPED:  # the prefix part came from _prefix_kernel
        part = b.to(tl.int64) * (stride_qb // stride_qh) + h * REP + rows
        m = tl.load(M_IN + part, mask=rows < REP, other=float("-inf"))
        l = tl.load(L_IN + part, mask=rows < REP, other=0.0)
        acc = tl.load(ACC_IN + part[:, None] * DP + dims[None, :], mask=row_ok, other=0.0)
    else:
        m = tl.full([R], float("-inf"), tl.float32)
        l = tl.zeros([R], tl.float32)
        acc = tl.zeros([R, DP], tl.float32)
        p_idx = tl.load(PIDX + b).to(tl.int64)
        p_len = tl.load(PLEN + b).to(tl.int32)
        m, l, acc = _attend_block(q, KP + p_idx * stride_pp + h * stride_ph, VP + p_idx * stride_pp + h * stride_ph,
                                  stride_pt, p_len, m, l, acc, scale, D, DP, BLOCK)
    m, l, acc = _attend_block(q, KS + b.to(tl.int64) * stride_sb + h * stride_sh,
                              VS + b.to(tl.int64) * stride_sb + h * stride_sh, stride_st, s_len, m, l, acc, scale,
                              D, DP, BLOCK)
    out = acc / l[:, None]
    tl.store(OUT + b * stride_ob + (h * REP + rows)[:, None] * stride_oh + dims[None, :],
             out.to(OUT.dtype.element_ty), mask=io_mask)


def decode_attention_triton(q, k_pre, v_pre, prefix_index, prefix_len, k_suf, v_suf, suffix_len, scale,
                            members=None, prompt_len=None):
    """Same arguments and result as the reference: q [B, Hq, D] → [B, Hq, D].

    members [P, G] (slot of each sequence of prompt entry p, −1 for none) and prompt_len [P]: read each prompt's
    keys once for all its sequences (every slot < B must be listed under its entry)."""
    B, Hq, D = q.shape
    P, Hkv = k_pre.shape[0], k_pre.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    rep = Hq // Hkv
    DP = max(16, triton.next_power_of_2(D))
    grouped = members is not None and members.shape[1] * rep <= 64
    if grouped:
        G = members.shape[1]
        # rows of slots listed under no entry (free slots below B) keep an empty prefix part
        m_part = torch.full((B * Hq,), float("-inf"), dtype=torch.float32, device=q.device)
        l_part = torch.zeros_like(m_part)
        acc_part = torch.zeros(B * Hq, DP, dtype=torch.float32, device=q.device)
        _prefix_kernel[(P, Hkv)](
            q, k_pre, v_pre, members, prompt_len, m_part, l_part, acc_part, float(scale),
            q.stride(0), q.stride(1), k_pre.stride(0), k_pre.stride(1), k_pre.stride(2), members.stride(0),
            REP=rep, G=G, R=max(16, triton.next_power_of_2(G * rep)), D=D, DP=DP, BLOCK=64, num_warps=4,
            num_stages=2)
    else:
        m_part = l_part = acc_part = out  # unused
    _decode_kernel[(B, Hkv)](
        q, k_pre, v_pre, k_suf, v_suf, prefix_index, prefix_len, suffix_len, out, m_part, l_part, acc_part,
        float(scale), q.stride(0), q.stride(1), k_pre.stride(0), k_pre.stride(1), k_pre.stride(2),
        k_suf.stride(0), k_suf.stride(1), k_suf.stride(2), out.stride(0), out.stride(1),
        REP=rep, R=max(16, triton.next_power_of_2(rep)), D=D, DP=DP, BLOCK=64, GROUPED=grouped, num_warps=4,
        num_stages=2)
    return out
