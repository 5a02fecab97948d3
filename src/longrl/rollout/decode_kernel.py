"""Triton decode attention over a shared prompt prefix and a per-sequence suffix (GPU fast path).

Twin of :func:`longrl.rollout.attention.decode_attention_reference` (tests/test_decode_kernel.py compares them
on the CPU through Triton's interpreter; benchmarks/rollout_speed.py on the GPU). The keys of a
sequence are cut into chunks of CHUNK positions, each handled by its own program (split-K, so that few long
sequences still fill the GPU); a program keeps an online softmax over its chunk (m: running max, l: running
normaliser, acc: running Σ p·v):

    m' = max(m, max_t s_t),  l' = l·e^(m−m') + Σ_t e^(s_t−m'),  acc' = acc·e^(m−m') + Σ_t e^(s_t−m') v_t

and the partials (m_c, l_c, acc_c) of all chunks merge as o = Σ_c e^(m_c−M) acc_c / Σ_c e^(m_c−M) l_c,
M = max_c m_c: by default in the chunk launch itself, the last of a (sequence, key head)'s chunk programs to finish
merging its query heads' rows (a counter per (sequence, key head), taken with an acquire-release atomic), else in
one more launch, a program per output row. With a prefix-entry table (``members``), each prompt's keys are read
once for all the sequences sharing it (one program per prompt, key head and chunk of up to 1,024 prompt positions,
every sequence's query heads as rows), and those partials join the merge. Lengths are read on the device: one
launch serves any lengths (CUDA-graph safe, no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import EXP_LIMIT, round_e4m3, scale_exponent
from .merge_counters import COUNT0

Q_EXP_LIMIT = tl.constexpr(EXP_LIMIT)  # the query split's exponent bound, kv_quant's (a constexpr kernels can read)

BLOCK = 32
# keys per block, warps and pipeline stages of the attention programs, the programs a layer call aims at for the
# per-sequence keys and for the shared prompts: the fastest choices of benchmarks/decode_attention_speed.py --sweep
# (CUDA-graph timed; docs/performance.md has the figures)
# fp8_f16: an FP8 cache widened to float16 for float16 products (FP8 == 2 in the kernels) instead of to the query's
# bf16, whose widening goes through float32 (one F2F conversion a value)
# fp8_prefetch: an FP8 cache's scale exponents for the next block of keys loaded while the current one folds (plain
# global loads, 1 byte a position, that Triton's pipeliner does not stage); the same results bit for bit
# fp8_ss (e4m3 products): the codes through e4m3 pointers, so that the products read the pipeline's shared-memory
# tiles instead of bitcasting them in registers (fewer registers a thread, room for one more pipeline buffer);
# maxnreg: registers a thread at most (ptxas's .maxnreg; 168 lets 3 programs of 4 warps share an SM)
# counters: with a persistent counter buffer (decode_attention_triton's ``counters``, the sampler's KVCache.counters;
# rollout/merge_counters.py; on the filled path the counters sit at the tail of the partials' m, filled with it)
# the fused merge reads only the columns the lengths say were written, so the partials need no −inf fill: one launch
# a layer less (off: 0.982-1.005 × the seconds of whole 8B calls on an H100, within their noise; docs/rollouts.md)
# min_chunk: keys a per-sequence program reads at least (None: one block). Few short sequences otherwise split into
# many tiny chunks (8 rows × 8 key heads over 256 positions: 8 columns of 32), whose partials the merge then reads
# few: the choices over the rest of LAUNCH for a 16-bit cache where the call has at most ``pairs`` (row, key head)
# pairs (None: never): blocks of 64 keys, chunks of at least 128. Whole 8B rollout calls on an H100
# (benchmarks/attention_ab.py): 0.953-0.979 × the seconds in three of four cells at 8-32 sequences (16-32 decode
# rows × 8 key heads), 1.000 × in the fourth, equal at 16K-token prompts (chunks of 1,024 either way); forced at
# 128 rows (1,024 pairs) the same choices took 1.013-1.016 ×, hence the cap
LAUNCH = dict(block=BLOCK, warps=4, stages=2, programs=2048, prefix_programs=512, fp8_f16=False, fp8_prefetch=False,
              fp8_mma=False, fp8_ss=False, maxnreg=None, counters=False, min_chunk=None,
              few=dict(pairs=256, block=64, min_chunk=128))
# an FP8 cache's own choices over LAUNCH (``launch`` still overrides both) where it cannot take FP8_LAUNCH: with the
# values position-minor, float16 products with the exponents loaded ahead, 2 warps and 3 pipeline stages (the
# fastest of the FP8 sweep with these products; docs/performance.md)
FP8_F16_LAUNCH = dict(block=32, warps=2, stages=3, fp8_mma=False, fp8_f16=True, fp8_prefetch=True)
# fp8_mma (FP8 == 3, _fold_block_mma): both products on e4m3 tensor cores (wgmma), the codes as stored, the query
# and p 2^ev each split into two e4m3 terms (bf16's 8 significant bits; exact for the elements of a bf16 query
# within 2^10 of its row's largest), keys as the products' wide side (blocks of 64 or 128 over one warpgroup:
# warps=4). The FP8 cache's default, blocks of 128 and 3 stages: its fastest launch (docs/performance.md).
# Heads below 32 (an e4m3 product's k-dimension is a multiple of 32) take FP8_F16_LAUNCH.
FP8_LAUNCH = dict(block=128, warps=4, stages=3, fp8_mma=True, fp8_f16=True, fp8_prefetch=True)


@triton.jit
def _block_exponents(ke_ptr, ve_ptr, t, end, FP8: tl.constexpr):
    """(ek, ev) int32 [BLOCK]: the FP8 cache's scale exponents of positions t [BLOCK] (0 at t ≥ end); zeros (unread)
    for a 16-bit cache."""
    if FP8:
        in_range = t < end
        ek = tl.load(ke_ptr + t, mask=in_range, other=0).to(tl.int32)
        ev = tl.load(ve_ptr + t, mask=in_range, other=0).to(tl.int32)
    else:
        ek = tl.zeros(t.shape, tl.int32)
        ev = ek
    return ek, ev


@triton.jit
def _fold_block(q, k_ptr, v_ptr, ek, ev, stride_t, stride_v, first, end, m, l, acc, scale, D: tl.constexpr,
                DP: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr,
                V_WHOLE: tl.constexpr, DYNAMIC_STOP: tl.constexpr):
    """Fold keys [first, min(end, first + BLOCK)) into the online softmax (m, l, acc) of the query rows q [R, DP].
    Keys [T, D] (position stride stride_t); values [T, D] with position stride stride_v, or for an FP8 cache
    position-minor [D, T'] with dimension stride stride_v = T' (kv_quant.py).
    FP8: keys and values are e4m3 bits (uint8) with the int8 exponents ek, ev [BLOCK] of their positions
    (kv_quant.py; _block_exponents), widened to q's dtype exactly; s_t = (q · k8_t) 2^ek_t · scale, and p_t 2^ev_t
    weighs v8_t. FP8 == 2: widened to float16 instead (also exact; bf16 targets cost a float32 step per value on
    sm_90) and the products in float16: q clamped to ±65504, p_t 2^ev_t as p_t 2^(ev_t − E) · 2^E with E the
    block's largest ev − 15. V_WHOLE (FP8, T' a multiple of BLOCK): the value block is read whole, past end too
    (finite codes there, weighed by p = 0, add exactly 0), so its loads have no position mask and run 16 bytes wide;
    under the interpreter, whose loops run to CHUNK, masked at T'."""
    dims = tl.arange(0, DP)
    t = first + tl.arange(0, BLOCK)
    in_range = t < end
    ok = in_range[:, None] & (dims[None, :] < D)
    k = tl.load(k_ptr + t[:, None] * stride_t + dims[None, :], mask=ok, other=0)
    if not FP8:
        v = tl.load(v_ptr + t[:, None] * stride_v + dims[None, :], mask=ok, other=0)
    elif not V_WHOLE:
        v = tl.load(v_ptr + t[:, None] + dims[None, :] * stride_v, mask=ok, other=0)
    elif DYNAMIC_STOP:
        v = tl.load(v_ptr + t[:, None] + dims[None, :] * stride_v, mask=(dims < D)[None, :], other=0)
    else:
        v = tl.load(v_ptr + t[:, None] + dims[None, :] * stride_v, mask=(t < stride_v)[:, None] & (dims < D)[None, :],
                    other=0)
    if FP8 == 2:  # e4m3 → float16 (exact, one packed conversion per two values) and float16 products
        k = k.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        v = v.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        q16 = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        s = tl.dot(q16, tl.trans(k)) * ((ek + 127) << 23).to(tl.float32, bitcast=True)[None, :]
        s = s * scale  # [R, BLOCK] float32
    elif FP8:
        k = k.to(tl.float8e4nv, bitcast=True).to(q.dtype)
        v = v.to(tl.float8e4nv, bitcast=True).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * ((ek + 127) << 23).to(tl.float32, bitcast=True)[None, :]
        s = s * scale  # [R, BLOCK] float32
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # [R, BLOCK] float32
    s = tl.where(in_range[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
    p = tl.where(in_range[None, :], tl.exp(s - m_new[:, None]), 0.0)
    l = l * alpha + tl.sum(p, 1)
    if FP8 == 2:  # p 2^ev in float16 around the block's largest exponent E: p 2^(ev − E + 15) ≤ 2^15, × 2^E after
        big = tl.maximum(tl.max(tl.where(in_range, ev, -126), 0) - 15, -126)
        rel = tl.where(in_range, ev - big, 0)
        pv = p * ((rel + 127) << 23).to(tl.float32, bitcast=True)[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv.to(tl.float16), v) * ((big + 127) << 23).to(tl.float32, bitcast=True)
    else:
        if FP8:
            pv = p * ((ev + 127) << 23).to(tl.float32, bitcast=True)[None, :]
        else:
            pv = p
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=PREC)
    return m_new, l, acc


@triton.jit
def _pow2(e):
    """2^e as float32 for int32 e in [−126, 127] (built from its bits: exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(x, EXACT: tl.constexpr):
    """x (float32, |x| ≤ 448) as e4m3, rounded to nearest even: the GPU's saturating conversion, or under the
    interpreter (EXACT), whose conversion rounds a mantissa carry down an octave, rounded in float32 first."""
    if EXACT:
        x = round_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _split_e4m3(x, EXACT: tl.constexpr):
    """(hi, lo) e4m3 of x (float32, |x| ≤ 448): hi = e4m3(x), lo = e4m3(x − hi), so hi + lo carries 8 significant
    bits (bf16's) wherever |x| ≥ 2^−2 and an absolute error ≤ 2^−10 below it."""
    hi = _e4m3(x, EXACT)
    return hi, _e4m3(x - hi.to(tl.float32), EXACT)


@triton.jit
def _exp2(x, EXACT: tl.constexpr):
    """2^x; on the GPU ex2.approx.ftz (a result below 2^−126 is 0: no subnormal fix-up a value)."""
    if EXACT:
        return tl.math.exp2(x)
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _query_split(q, scale, EXACT: tl.constexpr):
    """(hi, lo, f) of the query rows q [R, DP] for e4m3 products: q_r · 2^−e_r = hi_r + lo_r (_split_e4m3) with
    e_r the smallest exponent putting max|q_r| within 448 (kv_quant's rule), and f [R] = 2^e_r · scale · log2 e
    (scores in base 2)."""
    qf = q.to(tl.float32)
    e = scale_exponent(tl.max(tl.abs(qf), 1), Q_EXP_LIMIT)  # (a zero row gets 2^−EXP_LIMIT)
    hi, lo = _split_e4m3(qf * _pow2(-e)[:, None], EXACT)
    return hi, lo, _pow2(e) * (scale * 1.4426950408889634)


@triton.jit
def _fold_block_mma(q_hi, q_lo, q_f, k_ptr, v_ptr, ek, ev, stride_t, stride_v, first, end, m, l_t, acc_t,
                    D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, V_WHOLE: tl.constexpr,
                    DYNAMIC_STOP: tl.constexpr):
    """_fold_block for an FP8 cache (FP8 == 3) with both products on e4m3 tensor cores, keys as the wide side:
    sᵀ [BLOCK, R] = k8 · (q_hi + q_lo)ᵀ · 2^ek · q_f (two products into one float32 sum), the softmax along the
    keys (axis 0), and accᵀ [DP, R] += v8ᵀ · (p_hi + p_lo) · 2^(E − 8), where p_hi + p_lo = 2^8 · p_t 2^(ev_t − E)
    (≤ 256, _split_e4m3) and E the block's largest ev. The codes are the products' operands as stored (keys
    [T, D], values position-minor [D, T']), with no widening. m [R]; l_t [BLOCK, R]: l by key lanes, l_t · α + p
    (summed over the keys once, after the loop: no reduction across warps a block); acc_t [DP, R]."""
    dims = tl.arange(0, DP)
    t = first + tl.arange(0, BLOCK)
    in_range = t < end
    k = tl.load(k_ptr + t[:, None] * stride_t + dims[None, :], mask=in_range[:, None] & (dims[None, :] < D),
                other=0.0)
    if not V_WHOLE:
        v_ok = in_range[None, :] & (dims[:, None] < D)
    elif DYNAMIC_STOP:
        v_ok = (dims < D)[:, None]
    else:
        v_ok = (t < stride_v)[None, :] & (dims < D)[:, None]
    v = tl.load(v_ptr + t[None, :] + dims[:, None] * stride_v, mask=v_ok, other=0.0)  # [DP, BLOCK]
    if k_ptr.dtype.element_ty != tl.float8e4nv:  # codes as bytes: e4m3 in registers (the products' left operands
        k = k.to(tl.float8e4nv, bitcast=True)  # from registers; e4m3 pointers: from the pipeline's shared tiles)
        v = v.to(tl.float8e4nv, bitcast=True)
    s = tl.dot(k, tl.trans(q_lo), tl.dot(k, tl.trans(q_hi)))  # [BLOCK, R] float32
    s = s * _pow2(ek)[:, None] * q_f[None, :]
    s = tl.where(in_range[:, None], s, float("-inf"))  # base-2 scores (q_f holds log2 e)
    m_new = tl.maximum(m, tl.max(s, 0))
    alpha = tl.where(m_new == float("-inf"), 1.0, _exp2(m - m_new, not DYNAMIC_STOP))
    p = tl.where(in_range[:, None], _exp2(s - m_new[None, :], not DYNAMIC_STOP), 0.0)
    l_t = l_t * alpha[None, :] + p
    big = tl.maximum(tl.max(tl.where(in_range, ev, -100), 0), -100)
    rel = tl.maximum(tl.where(in_range, ev - big, -126), -126) + 8  # p 2^(ev − E + 8) ≤ 2^8
    p_hi, p_lo = _split_e4m3(p * _pow2(rel)[:, None], not DYNAMIC_STOP)
    pv = tl.dot(v, p_lo, tl.dot(v, p_hi))  # [DP, R] float32
    acc_t = acc_t * alpha[None, :] + pv * _pow2(big - 8)
    return m_new, l_t, acc_t


# Under Triton's interpreter a loop bound computed in the kernel cannot be a range() limit (it calls int() on a
# 1-element numpy array, which numpy 2 refuses): there the loops run to CHUNK, with the same result (see _attend).
# Whether it interprets is what triton.jit made of a kernel (TRITON_INTERPRET=1, true, on, yes, ... all count).
DYNAMIC_STOP = type(_fold_block).__name__ != "InterpretedFunction"


@triton.jit
def _attend(q, k_ptr, v_ptr, ke_ptr, ve_ptr, stride_t, stride_v, start, end, m, l, acc, scale, D: tl.constexpr,
            DP: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, PREC: tl.constexpr, DYNAMIC_STOP: tl.constexpr,
            FP8: tl.constexpr, PREFETCH: tl.constexpr, V_WHOLE: tl.constexpr):
    """Fold keys [start, min(end, start + CHUNK)) into the online softmax of the query rows q [R, DP]. With
    DYNAMIC_STOP the loop ends at the last block with keys: a block past them leaves m, l and acc exactly as they
    are (s = −inf everywhere: m' = m, α = 1, p = 0), so a chunk costs its keys, not CHUNK positions. PREFETCH (an
    FP8 cache): each block's exponents are loaded one block ahead, carried through the loop (the same values)."""
    stop = tl.minimum(end - start, CHUNK) if DYNAMIC_STOP else CHUNK
    if FP8 == 3:  # e4m3 products (acc is accᵀ [DP, R]); the exponents always one block ahead
        q_hi, q_lo, q_f = _query_split(q, scale, not DYNAMIC_STOP)
        t = start + tl.arange(0, BLOCK)
        ek, ev = _block_exponents(ke_ptr, ve_ptr, t, end, FP8)
        l_t = tl.where((tl.arange(0, BLOCK) == 0)[:, None], l[None, :], tl.zeros([BLOCK, q.shape[0]], tl.float32))
        for off in range(0, stop, BLOCK):
            ek_next, ev_next = _block_exponents(ke_ptr, ve_ptr, t + BLOCK, end, FP8)
            m, l_t, acc = _fold_block_mma(q_hi, q_lo, q_f, k_ptr, v_ptr, ek, ev, stride_t, stride_v, start + off,
                                          end, m, l_t, acc, D, DP, BLOCK, V_WHOLE, DYNAMIC_STOP)
            ek, ev, t = ek_next, ev_next, t + BLOCK
        l = tl.sum(l_t, 0)
        m = m * 0.6931471805599453  # back to base e, the merge's
    elif PREFETCH:
        t = start + tl.arange(0, BLOCK)
        ek, ev = _block_exponents(ke_ptr, ve_ptr, t, end, FP8)
        for off in range(0, stop, BLOCK):
            ek_next, ev_next = _block_exponents(ke_ptr, ve_ptr, t + BLOCK, end, FP8)
            m, l, acc = _fold_block(q, k_ptr, v_ptr, ek, ev, stride_t, stride_v, start + off, end, m, l, acc, scale,
                                    D, DP, BLOCK, PREC, FP8, V_WHOLE, DYNAMIC_STOP)
            ek, ev, t = ek_next, ev_next, t + BLOCK
    else:
        for off in range(0, stop, BLOCK):
            ek, ev = _block_exponents(ke_ptr, ve_ptr, start + off + tl.arange(0, BLOCK), end, FP8)
            m, l, acc = _fold_block(q, k_ptr, v_ptr, ek, ev, stride_t, stride_v, start + off, end, m, l, acc, scale,
                                    D, DP, BLOCK, PREC, FP8, V_WHOLE, DYNAMIC_STOP)
    return m, l, acc


@triton.jit
def _store_partial(M_OUT, L_OUT, ACC_OUT, part, row_ok, m, l, acc, DP: tl.constexpr, FP8: tl.constexpr):
    """A program's partials of its rows: m, l [R] at part [R], acc [R, DP] (accᵀ [DP, R] when FP8 == 3) at row
    part of ACC_OUT [·, DP]."""
    dims = tl.arange(0, DP)
    tl.store(M_OUT + part, m, mask=row_ok)
    tl.store(L_OUT + part, l, mask=row_ok)
    if FP8 == 3:
        tl.store(ACC_OUT + part[None, :] * DP + dims[:, None], acc, mask=row_ok[None, :] & (dims[:, None] < DP))
    else:
        tl.store(ACC_OUT + part[:, None] * DP + dims[None, :], acc, mask=row_ok[:, None] & (dims[None, :] < DP))


@triton.jit
def _prefix_kernel(Q, KP, VP, KPE, VPE, MEMBERS, PLEN_P, M_OUT, L_OUT, ACC_OUT, scale,
                   stride_qb, stride_qh, stride_pp, stride_ph, stride_pt, stride_vpp, stride_vph, stride_vp,
                   stride_epp, stride_eph, stride_mem, NPART,
                   NSUB, REP: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
                   DP: tl.constexpr, BLOCK: tl.constexpr, PCHUNK: tl.constexpr, PREC: tl.constexpr,
                   DYNAMIC_STOP: tl.constexpr, FP8: tl.constexpr, PREFETCH: tl.constexpr, V_WHOLE: tl.constexpr):
    """One program per (prompt entry p, key head h, prompt chunk c × member subgroup g): the queries of up to GS
    sequences sharing prompt p (GS × REP ≤ 64 rows; NSUB subgroups cover its G) against p's keys
    [c·PCHUNK, (c+1)·PCHUNK), read once for them; writes each row's partial into column c of the partial buffers
    (nothing when the chunk is past the prompt: its m stays −inf)."""
    p = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2) // NSUB
    g = tl.program_id(2) % NSUB
    start = c * PCHUNK
    p_len = tl.load(PLEN_P + p).to(tl.int32)
    if start >= p_len:
        return
    rows = tl.arange(0, R)  # row = member (g · GS + jj) · REP + r
    jj = rows // REP
    j = g * GS + jj
    r = rows % REP
    slot = tl.load(MEMBERS + p * stride_mem + j, mask=(jj < GS) & (j < G), other=-1)
    row_ok = slot >= 0
    slot = tl.where(row_ok, slot, 0).to(tl.int64)
    dims = tl.arange(0, DP)
    io_mask = row_ok[:, None] & (dims[None, :] < D)
    q = tl.load(Q + (slot * stride_qb + (h * REP + r) * stride_qh)[:, None] + dims[None, :], mask=io_mask, other=0.0)
    m = tl.full([R], float("-inf"), tl.float32)
    l = tl.zeros([R], tl.float32)
    acc = tl.zeros([DP, R] if FP8 == 3 else [R, DP], tl.float32)
    base = p.to(tl.int64) * stride_pp + h * stride_ph
    vbase = p.to(tl.int64) * stride_vpp + h * stride_vph
    ebase = p.to(tl.int64) * stride_epp + h * stride_eph
    m, l, acc = _attend(q, KP + base, VP + vbase, KPE + ebase, VPE + ebase, stride_pt, stride_vp, start, p_len, m, l,
                        acc, scale, D, DP, BLOCK, PCHUNK, PREC, DYNAMIC_STOP, FP8, PREFETCH, V_WHOLE)
    part = (slot * (stride_qb // stride_qh) + h * REP + r) * NPART + c  # column c of row (slot, head)
    _store_partial(M_OUT, L_OUT, ACC_OUT, part, row_ok, m, l, acc, DP, FP8)


@triton.jit
def _chunk_kernel(Q, KP, VP, KS, VS, PIDX, PLEN, SLEN, M_OUT, L_OUT, ACC_OUT, COUNT, OUT, KPE, VPE, KSE, VSE, SLOTS,
                  MEMBERS, PLEN_P, stride_mem, G, PCHUNK, scale,
                  stride_qb, stride_qh, stride_pp, stride_ph, stride_pt, stride_sb, stride_sh, stride_st,
                  stride_vpp, stride_vph, stride_vp, stride_vsb, stride_vsh, stride_vs,
                  stride_epp, stride_eph, stride_esb, stride_esh, NPART,
                  FIRST, NPRE, REP: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, PREC: tl.constexpr,
                  DYNAMIC_STOP: tl.constexpr, FUSED: tl.constexpr, RB: tl.constexpr, NP: tl.constexpr,
                  CB: tl.constexpr, COUNT0: tl.constexpr, FP8: tl.constexpr, PREFETCH: tl.constexpr,
                  V_WHOLE: tl.constexpr, HAS_SLOTS: tl.constexpr, WRITTEN: tl.constexpr = False,
                  GP: tl.constexpr = 1):
    """One program per (sequence b, key head h, chunk c): chunks c < NPRE cover b's prompt prefix (per sequence,
    when there is no prefix table), the others b's own suffix. Writes partial column FIRST + c (nothing for a
    chunk past the keys: its m stays −inf and the merge skips it).

    FUSED: the live programs of (b, h) — n = min(⌈plen/CHUNK⌉, NPRE) + max(1, min(⌈slen/CHUNK⌉, NSUF)), the first
    suffix chunk taking part even without keys — each add 1 to COUNT[b·Hkv + h] (from COUNT0) after their stores;
    the one that sees COUNT0 + n − 1 merges the REP rows (b, h·REP + r), together (RB ≥ REP), over all NPART
    columns into OUT [B, Hq, D] (the prefix launch's columns are visible by stream order) and puts the counter back
    to COUNT0.

    HAS_SLOTS: row b's suffix is slot SLOTS[b]'s store (a verify step's virtual rows: several rows read one slot, each
    to its own length); else slot b's.

    WRITTEN (FUSED): the merge reads only the columns this call wrote for row b, from the lengths (the live counts,
    not every column with unwritten ones at m = −inf: the partial buffers need no fill. The grouped prefix columns
    [0, FIRST) are b's when MEMBERS[PIDX[b], :G] (GP ≥ G) lists b, the first ⌈PLEN_P[PIDX[b]] / PCHUNK⌉ of them."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    p_len = tl.maximum(tl.load(PLEN + b).to(tl.int32), 0)
    s_len = tl.maximum(tl.load(SLEN + b).to(tl.int32), 0)
    if c < NPRE:
        start = c * CHUNK
        end = p_len
    else:
        start = (c - NPRE) * CHUNK
        end = s_len
    empty = start >= end
    if FUSED:
        empty = empty & (c != NPRE)  # some program merges (b, h) even when it has no keys at all
    if empty:
        return
    rows = tl.arange(0, R)  # query heads of this key head, padded to R ≥ 16 for tl.dot
    dims = tl.arange(0, DP)
    row_ok = rows < REP
    io_mask = row_ok[:, None] & (dims[None, :] < D)
    q = tl.load(Q + b * stride_qb + (h * REP + rows)[:, None] * stride_qh + dims[None, :], mask=io_mask, other=0.0)
    m = tl.full([R], float("-inf"), tl.float32)
    l = tl.zeros([R], tl.float32)
    acc = tl.zeros([DP, R] if FP8 == 3 else [R, DP], tl.float32)
    if c < NPRE:
        entry = tl.load(PIDX + b).to(tl.int64)
        base = entry * stride_pp + h * stride_ph
        vbase = entry * stride_vpp + h * stride_vph
        ebase = entry * stride_epp + h * stride_eph
        m, l, acc = _attend(q, KP + base, VP + vbase, KPE + ebase, VPE + ebase, stride_pt, stride_vp, start, end, m,
                            l, acc, scale, D, DP, BLOCK, CHUNK, PREC, DYNAMIC_STOP, FP8, PREFETCH, V_WHOLE)
    else:
        if HAS_SLOTS:
            slot = tl.load(SLOTS + b).to(tl.int64)
        else:
            slot = b.to(tl.int64)
        base = slot * stride_sb + h * stride_sh
        vbase = slot * stride_vsb + h * stride_vsh
        ebase = slot * stride_esb + h * stride_esh
        m, l, acc = _attend(q, KS + base, VS + vbase, KSE + ebase, VSE + ebase, stride_st, stride_vs, start, end, m,
                            l, acc, scale, D, DP, BLOCK, CHUNK, PREC, DYNAMIC_STOP, FP8, PREFETCH, V_WHOLE)
    hq = stride_qb // stride_qh  # query heads (q is contiguous)
    part = (b.to(tl.int64) * hq + h * REP + rows) * NPART + FIRST + c
    _store_partial(M_OUT, L_OUT, ACC_OUT, part, row_ok, m, l, acc, DP, FP8)
    if FUSED:
        live = tl.minimum(tl.cdiv(p_len, CHUNK), NPRE) + tl.maximum(
            tl.minimum(tl.cdiv(s_len, CHUNK), tl.num_programs(2) - NPRE), 1)
        counter = COUNT + b * tl.num_programs(1) + h
        tl.debug_barrier()  # every thread's stores precede the release (bar.sync, then the atomic's release)
        seen = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if seen == COUNT0 + live - 1:  # the last live program of (b, h): all its columns are written
            tl.store(counter, COUNT0)
            heads = tl.arange(0, RB)
            out_rows = b.to(tl.int64) * hq + h * REP + heads
            if WRITTEN:
                n_gp = _grouped_columns(PIDX, MEMBERS, PLEN_P, stride_mem, G, b, FIRST, PCHUNK, GP)
                n_pp = tl.minimum(tl.cdiv(p_len, CHUNK), NPRE)
                n_sp = live - n_pp
            else:
                n_gp, n_pp, n_sp = FIRST, NPRE, NPART - FIRST - NPRE
            o = _merge_rows(M_OUT, L_OUT, ACC_OUT, out_rows, heads < REP, NPART, RB, DP, NP, CB,
                            ".cg",  # .cg: from L2, where the other programs' stores are (not a stale L1 line)
                            n_gp, FIRST, FIRST + n_pp, FIRST + NPRE, FIRST + NPRE + n_sp, WRITTEN)
            tl.store(OUT + out_rows[:, None] * D + dims[None, :], o.to(OUT.dtype.element_ty),
                     mask=(heads < REP)[:, None] & (dims[None, :] < D))


@triton.jit
def _grouped_columns(PIDX, MEMBERS, PLEN_P, stride_mem, G, b, FIRST, PCHUNK, GP: tl.constexpr):
    """How many of the grouped prefix columns [0, FIRST) the prefix launch wrote for row b: ⌈PLEN_P[e] / PCHUNK⌉
    (at most FIRST) where e = PIDX[b]'s member list MEMBERS[e, :G] holds b (GP ≥ G), else none."""
    entry = tl.load(PIDX + b).to(tl.int64)
    j = tl.arange(0, GP)
    slot = tl.load(MEMBERS + entry * stride_mem + j, mask=j < G, other=-1)
    listed = tl.sum((slot == b).to(tl.int32), axis=0) > 0
    n = tl.minimum(tl.cdiv(tl.maximum(tl.load(PLEN_P + entry).to(tl.int32), 0), PCHUNK), FIRST)
    return tl.where(listed, n, 0)


@triton.jit
def _merge_rows(M, L, ACC, rows, row_ok, NPART, RB: tl.constexpr, DP: tl.constexpr, NP: tl.constexpr,
                CB: tl.constexpr, CACHE: tl.constexpr, A_END=0, B_START=0, B_END=0, C_START=0, C_END=0,
                WRITTEN: tl.constexpr = False):
    """o [RB, DP]: o_r = Σ_c e^(m_c−M) acc_c / Σ_c e^(m_c−M) l_c over the NPART partial columns of each row
    rows [RB] (column c of row r at r · NPART + c; a column whose m is −inf is skipped; a row not row_ok: NaN), in
    one pass over blocks of CB columns (a long tail of small batches has hundreds): each block's m, l and acc are
    loaded together (cache modifier CACHE) and folded in with a running maximum (the sums rescaled by
    e^(M_old−M_new) when it grows; with one block, as usual, that is the plain formula). WRITTEN: only the columns
    [0, A_END) ∪ [B_START, B_END) ∪ [C_START, C_END) are read (the others count as m = −inf, unread)."""
    dims = tl.arange(0, DP)
    top = tl.full([RB], float("-inf"), tl.float32)
    denom = tl.zeros([RB], tl.float32)
    acc = tl.zeros([RB, DP], tl.float32)
    for c0 in range(0, NP, CB):
        cols = c0 + tl.arange(0, CB)
        col_ok = cols < NPART
        if WRITTEN:
            col_ok = col_ok & ((cols < A_END) | ((cols >= B_START) & (cols < B_END))
                               | ((cols >= C_START) & (cols < C_END)))
        inb = row_ok[:, None] & col_ok[None, :]  # [RB, CB]
        cell = rows[:, None] * NPART + cols[None, :]
        m = tl.load(M + cell, mask=inb, other=float("-inf"), cache_modifier=CACHE)
        l = tl.load(L + cell, mask=inb, other=0.0, cache_modifier=CACHE)
        part = tl.load(ACC + cell[:, :, None] * DP + dims[None, None, :], mask=inb[:, :, None], other=0.0,
                       cache_modifier=CACHE)  # [RB, CB, DP]
        live = m > float("-inf")  # chunks that saw a key (the others' l and acc are stale: never multiplied in)
        new_top = tl.maximum(top, tl.max(m, 1))
        ref = tl.where(new_top == float("-inf"), 0.0, new_top)
        alpha = tl.exp(top - ref)  # 0 while nothing was live (denom and acc are 0 then)
        w = tl.where(live, tl.exp(m - ref[:, None]), 0.0)
        denom = denom * alpha + tl.sum(tl.where(live, w * l, 0.0), 1)
        acc = acc * alpha[:, None] + tl.sum(tl.where(live[:, :, None], w[:, :, None] * part, 0.0), 1)
        top = new_top
    return acc / denom[:, None]


@triton.jit
def _merge_kernel(M, L, ACC, OUT, NPART, D: tl.constexpr, DP: tl.constexpr, NP: tl.constexpr, CB: tl.constexpr):
    """One program per output row (sequence, query head): OUT[row] = the merge of its NPART partial columns
    (_merge_rows)."""
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    dims = tl.arange(0, DP)
    o = _merge_rows(M, L, ACC, rows, rows >= 0, NPART, 1, DP, NP, CB, "")
    tl.store(OUT + rows[:, None] * D + dims[None, :], o.to(OUT.dtype.element_ty), mask=dims[None, :] < D)


def _launch_for(pairs: int, fp8: bool, launch: dict | None) -> dict:
    """A call's launch choices: LAUNCH, then its ``few`` choices where a 16-bit cache's call has at most
    few["pairs"] (row, key head) pairs, then FP8_LAUNCH for an FP8 cache, then the caller's ``launch``."""
    launch = launch or {}
    few = launch.get("few", LAUNCH["few"])
    small = {k: v for k, v in few.items() if k != "pairs"} if few and not fp8 and pairs <= few["pairs"] else {}
    return {**LAUNCH, **small, **(FP8_LAUNCH if fp8 else {}), **launch}


def _chunk_size(positions: int, programs: int, block: int = BLOCK, target: int = 2048, least: int | None = None) -> int:
    """Keys per program: enough chunks that ``programs`` × chunks ≳ ``target`` programs, each chunk
    max(block, least)–1024 positions (a power of two: few compiled variants)."""
    want = max(1, -(-target // max(programs, 1)))
    chunk = triton.next_power_of_2(max(1, -(-positions // want)))
    return min(1024, max(block, triton.next_power_of_2(least or 1), chunk))


def _scratch(shape, device) -> torch.Tensor:
    """A float32 buffer of ``shape`` whose contents the kernels write before they read (uninitialised)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def decode_attention_triton(q, k_pre, v_pre, prefix_index, prefix_len, k_suf, v_suf, suffix_len, scale,
                            members=None, prompt_len=None, launch: dict | None = None, fused_merge: bool = True,
                            kv_exp=None, slots=None, counters=None):
    """Same arguments and result as the reference: q [B, Hq, D] → [B, Hq, D]; slots [B] (optional): row b reads
    slot slots[b]'s suffix store instead of slot b's (a verify step's virtual rows).

    kv_exp (k_pre_e, v_pre_e, k_suf_e, v_suf_e): an FP8 cache (k_pre ... v_suf float8_e4m3fn, the values
    position-minor: v_pre [P, Hkv, D, Lp'], v_suf [S, Hkv, D, T'], Lp' ≥ Lp, T' ≥ T, kv_quant.quantize_values) and its
    int8 scale exponents [P, Hkv, Lp] / [S, Hkv, T] (kv_quant.py); q keeps its 16-bit (or float32) dtype. Its launch
    is LAUNCH with FP8_LAUNCH over it.

    members [P, G] (slot of each sequence of prompt entry p, −1 for none) and prompt_len [P]: read each prompt's
    keys once for all its sequences (every slot < B must be listed under its entry). ``launch`` overrides entries
    of LAUNCH, its ``few`` choices and FP8_LAUNCH (_launch_for; for tuning: the result does not depend on them beyond
    float32 summation order).
    ``fused_merge`` False: merge the partials in a launch of their own (merge_partials; for comparison).

    counters: int32 [≥ B · Hkv] at COUNT0, kept from call to call (each call leaves them at COUNT0): with the launch
    choice ``counters`` on and the fused merge, the merge's counters, and its partials are left unfilled (the merge
    reads the columns the lengths say were written); otherwise (or when too short) unused."""
    B, Hq, D = q.shape
    P, Hkv, Lp = k_pre.shape[0], k_pre.shape[1], k_pre.shape[2]
    launch = _launch_for(B * Hkv, kv_exp is not None, launch)
    block, warps, stages = launch["block"], launch["warps"], launch["stages"]
    T = k_suf.shape[2]
    q = q.contiguous()
    fp8 = (3 if launch["fp8_mma"] else 2 if launch["fp8_f16"] else 1) if kv_exp is not None else 0
    prefetch = bool(fp8 and launch["fp8_prefetch"])
    if fp8 == 3 and max(16, triton.next_power_of_2(D)) < 32:  # (FP8_LAUNCH's comment)
        fp8 = 2
        block, warps, stages = FP8_F16_LAUNCH["block"], FP8_F16_LAUNCH["warps"], FP8_F16_LAUNCH["stages"]
    if fp8 == 3:
        assert block in (64, 128) and warps in (4, 8), "e4m3 products (fp8_mma): key blocks of 64 or 128, 4 or 8 warps"
    # fp8_ss: e4m3 products on the codes through e4m3 pointers, so that they read the pipeline's shared-memory tiles
    # (on bytes, the bitcast to e4m3 happens in registers first); not under the interpreter, whose products of
    # tiles loaded through e4m3 pointers come out wrong (its tests compare the byte path)
    if fp8:
        if not (fp8 == 3 and launch.get("fp8_ss") and DYNAMIC_STOP):
            k_pre, v_pre, k_suf, v_suf = (t.view(torch.uint8) for t in (k_pre, v_pre, k_suf, v_suf))
        kpe, vpe, kse, vse = kv_exp
        assert kpe.stride(2) == 1 and kse.stride(2) == 1, "the scale exponents run contiguously along positions"
        assert v_pre.shape[2] == D and v_suf.shape[2] == D and v_pre.shape[3] >= Lp and v_suf.shape[3] >= T, \
            "values are position-minor"
        assert kpe.shape == k_pre.shape[:3] and kse.shape == k_suf.shape[:3], "one exponent a key position and head"
        assert v_pre.stride(3) == 1 and v_suf.stride(3) == 1, "value positions run contiguously"
        e_strides = (kpe.stride(0), kpe.stride(1), kse.stride(0), kse.stride(1))
    else:
        kpe = vpe = kse = vse = q  # not read
        e_strides = (0, 0, 0, 0)
    rep = Hq // Hkv
    DP = max(16, triton.next_power_of_2(D))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # float32 caches (float32 models) keep float32 products
    grouped = members is not None and rep <= 64
    G = members.shape[1] if grouped else 0
    gs = max(1, min(G, 64 // rep))  # members a prefix program serves: ≤ 64 query rows
    n_sub = -(-G // gs) if grouped else 0
    # grouped: each prompt's keys in chunks, one program each, enough of them to fill the GPU (16 prompts × 8 key
    # heads are 128 programs: one a multiprocessor, too few loads in flight to reach the memory's bandwidth)
    block_p = block_s = block
    if fp8 == 3 and block == 128:  # 128 where the value stores a kernel reads hold whole 128-position blocks (else
        block_p = 128 if v_pre.shape[3] % 128 == 0 else 64  # 64, the old planner.V_ALIGN: still read whole)
        block_s = 128 if v_suf.shape[3] % 128 == 0 and (grouped or block_p == 128) else 64
    pchunk = _chunk_size(Lp, P * Hkv * n_sub, block_p, launch["prefix_programs"]) if grouped else block_p
    first = -(-Lp // pchunk) if grouped else 0  # columns [0, first): the grouped prefix partials
    # per sequence: its prefix and suffix in chunks (at least one suffix chunk: the fused merge's taker of last resort)
    chunk = _chunk_size(T if grouped else Lp + T, B * Hkv, block_s, launch["programs"], launch["min_chunk"])
    n_suf = max(1, -(-T // chunk))
    n_pre = 0 if grouped else -(-Lp // chunk)
    npart = first + n_pre + n_suf
    cells = B * Hq * npart
    written = bool(fused_merge and launch.get("counters") and counters is not None and counters.numel() >= B * Hkv)
    if written:  # no fill: the merge reads only written columns, and the counters rest at COUNT0 between calls
        assert counters.dtype == torch.int32, "the merge's counters are int32"
        m_part, count = _scratch((cells,), q.device), counters[:B * Hkv]
    else:  # m of every column starts at −inf (a prefix column of a slot no entry lists is never written); l and acc
        # are read only where m was written. Fused: the counters [B · Hkv] are m's tail, the same fill (COUNT0)
        m_fill = torch.full((cells + (B * Hkv if fused_merge else 0),), float("-inf"), dtype=torch.float32,
                            device=q.device)
        m_part, count = m_fill[:cells], m_fill[cells:].view(torch.int32)
    # the written-columns rule's member lists: fixed placeholders where it is off, so that the filled path keeps
    # the kernel variants it had (Triton specialises integer arguments by value)
    member_args = ((members, prompt_len, members.stride(0), G, pchunk) if written and grouped
                   else (prefix_index, prefix_len, 0, 0, 1))
    l_part = _scratch((cells,), q.device)
    acc_part = _scratch((cells, DP), q.device)
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    strides = (q.stride(0), q.stride(1), k_pre.stride(0), k_pre.stride(1), k_pre.stride(2))
    # the values' (entry or slot, head, position or, position-minor, dimension) strides
    v_strides = (v_pre.stride(0), v_pre.stride(1), v_pre.stride(2), v_suf.stride(0), v_suf.stride(1), v_suf.stride(2))
    # whole value blocks: capacities of whole blocks, each store's positions its own (the interpreter's loops read to
    # the dimension stride), chunks starting at whole blocks (chunks are powers of two from block to 1,024)
    assert block & (block - 1) == 0 and block <= 1024, "the key block is a power of two of at most 1,024"

    def whole(stores, blk):
        return bool(fp8 and all(v.shape[3] % blk == 0 and v.stride(2) == v.shape[3] for v in stores))
    regs = {"maxnreg": launch["maxnreg"]} if launch.get("maxnreg") else {}  # registers a thread, at most
    if grouped and first:
        prefix_rows = max(16, triton.next_power_of_2(gs * rep))
        _prefix_kernel[(P, Hkv, first * n_sub)](
            q, k_pre, v_pre, kpe, vpe, members, prompt_len, m_part, l_part, acc_part, float(scale), *strides,
            *v_strides[:3], *e_strides[:2], members.stride(0), npart, n_sub, REP=rep, G=G, GS=gs,
            R=prefix_rows, D=D, DP=DP, BLOCK=block_p, PCHUNK=pchunk, PREC=prec,
            DYNAMIC_STOP=DYNAMIC_STOP, FP8=fp8, PREFETCH=prefetch, V_WHOLE=whole((v_pre,), block_p),
            num_warps=max(warps, prefix_rows // 16), num_stages=stages, **regs)  # a warp for each 16 rows at least
    rb = triton.next_power_of_2(rep)
    np_, cb = _merge_blocks(npart, rb)
    _chunk_kernel[(B, Hkv, n_pre + n_suf)](
        q, k_pre, v_pre, k_suf, v_suf, prefix_index, prefix_len, suffix_len, m_part, l_part, acc_part, count, out,
        kpe, vpe, kse, vse, slots if slots is not None else prefix_index, *member_args, float(scale), *strides,
        k_suf.stride(0), k_suf.stride(1), k_suf.stride(2), *v_strides,
        *e_strides, npart, FIRST=first, NPRE=n_pre, REP=rep, R=max(16, triton.next_power_of_2(rep)), D=D, DP=DP,
        BLOCK=block_s, CHUNK=chunk, PREC=prec, DYNAMIC_STOP=DYNAMIC_STOP, FUSED=fused_merge, RB=rb, NP=np_, CB=cb,
        COUNT0=COUNT0, FP8=fp8, PREFETCH=prefetch, V_WHOLE=whole((v_pre, v_suf), block_s),
        HAS_SLOTS=slots is not None, WRITTEN=written, GP=triton.next_power_of_2(max(member_args[3], 1)),
        num_warps=warps, num_stages=stages, **regs)
    if not fused_merge:
        merge_partials(m_part, l_part, acc_part, out.view(B * Hq, D), npart)
    return out


def _merge_blocks(npart: int, rows: int = 1) -> tuple[int, int]:
    """(NP, CB) of a merge of ``rows`` rows at once over ``npart`` columns: blocks of CB ≤ 16 columns, rows · CB ≤ 32
    where it can (the [rows, CB, DP] block sits in registers), up to NP ≥ npart."""
    cb = min(16, max(1, 32 // rows), triton.next_power_of_2(npart))
    return max(cb, triton.next_power_of_2(npart)), cb


def merge_partials(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, out: torch.Tensor, npart: int) -> None:
    """out [rows, D] ← the merge of each row's ``npart`` partial softmaxes: m, l [rows · npart] float32,
    acc [rows · npart, DP] float32 (column c of row r at r · npart + c; a column whose m is −inf is skipped)."""
    np_, cb = _merge_blocks(npart)
    _merge_kernel[(out.shape[0],)](m, l, acc, out, npart, D=out.shape[1], DP=acc.shape[1], NP=np_, CB=cb, num_warps=4)
