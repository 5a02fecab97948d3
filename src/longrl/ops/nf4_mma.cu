// y = x · [W_0; W_1; W_2; D]ᵀ (+ bias) for a few rows of x (≤ 8·NT8) and bitsandbytes NF4 weights read in their
// own layout, on the tensor cores' mma.sync m16n8k16 (sm_80 and newer). Compiled at first use by NVRTC
// (ops/nf4_mma.py) with -DNT8=1|2|4 (n8 tiles of x rows) and -DHALF=0|1 (bfloat16 | float16 operands).
//
// The lookup: a shared table of 256 16-bit value pairs, T[byte] = (code[byte >> 4], code[byte & 15]) (the high
// nibble is the lower k, in the low half), so one load turns a code byte into the tensor cores' register of two
// values. Each lane reads its own copy (32 copies, entry e of copy c at word 32 e + c: lane c's bank is always c),
// so the loads never conflict; a byte's address is ((byte << 7) | lane · 4), one shift and one LOP3 from the word.
//
// The k order: a sum over k may take k in any order if x and W take the same one. In a 64-wide block (one absmax a
// row, 32 code bytes a row) lane (g, q) (g = lane / 4, q = lane % 4) reads the bytes 8q..8q+7 of rows g and g + 8
// (one 8-byte load each) and x[row g][16q .. 16q + 16) (two 16-byte loads); k-step s (0..3) feeds the mma's columns
// 2q, 2q+1 from byte 2s (k = 16q + 4s + {0, 1}) and 2q+8, 2q+9 from byte 2s + 1 (k = 16q + 4s + {2, 3}); x's
// fragment at step s is then the two words at 16q + 4s, as mma's B layout asks. A block's four k-steps go to a fresh
// float32 sum, then acc += absmax[row] · sum (float32): the weights are cast(code)·absmax, ops/nf4_matmul.py's lut 4
// (nf4_group_reference(scale_after=True) is the twin).
//
// Work: items (32 rows of the group: two m16 tiles, one range of K) taken by blocks in turn (a persistent grid that
// builds the table once a block); a block's four warps split the item's range of K and add their sums through shared
// memory in warp order. The dense rows D (16-bit, the LoRA A rows) come first, read as they are. With several K
// splits each item writes float32 partials, and the last of a row unit's items to finish (an arrival count a unit,
// left zero) adds them in split order, a round of splits' loads at a time: the same result every call.
// (A first version took items a warp at a time and added the partials one load after another: its time grew with
// the splits, 134 µs a layer at 8 rows on an H100 at best against Triton's 97; nf4_matmul_h100_mma.md.)

#ifndef NT8
#define NT8 1
#endif
#ifndef HALF
#define HALF 0
#endif

#define WARPS 4    // a block's warps
#define COPIES 32  // the table's copies: one a lane
#ifndef UNR
#define UNR (4 / NT8)  // blocks of K a pass loads before its products (registers: x's fragments grow with NT8)
#endif
#define UNIT 32    // rows of the group an item owns
#define NV (8 * NT8)  // a lane's sums: [tile 2][n8 tile NT8][4]
#define ROUND (4 / NT8)  // splits' partials a round of the last item's loads (32 registers)

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if HALF
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#endif
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u16 to16(float f) {  // round to nearest even
    u16 h;
#if HALF
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}

__device__ __forceinline__ u32 pair(u32 table, u32 offset) {  // table: its shared address; offset (byte << 7) | lane · 4
    u32 v;
    asm("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(table + offset));
    return v;
}

__device__ __forceinline__ void mma0(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {  // d = a · b
#if HALF
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
#endif
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.f));
}

// NB blocks of K from the lane's pointers (at the pass's first block): cp the code bytes of rows [tile][half], sp
// their absmax (blocks sstride apart), xp x's rows; the looked-up products scaled into acc.
template <int NB>
__device__ __forceinline__ void nf4_pass(float (&acc)[2][NT8][4], const unsigned char* const (&cp)[2][2],
                                         const float* const (&sp)[2][2], long long sstride,
                                         const u16* const (&xp)[NT8], u32 tab, u32 lane4) {
    uint4 xv[NB][NT8][2];  // x[8j + g][64 blk + 16q ..+16)
    uint2 cv[NB][2][2];    // [blk][tile][half] the lane's 8 code bytes of the row's block
    float sv[NB][2][2];    // the row's absmax of the block
#pragma unroll
    for (int u = 0; u < NB; ++u) {
#pragma unroll
        for (int j = 0; j < NT8; ++j) {
            xv[u][j][0] = __ldg((const uint4*)(xp[j] + u * 64));
            xv[u][j][1] = __ldg((const uint4*)(xp[j] + u * 64) + 1);
        }
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                cv[u][t][h] = __ldg((const uint2*)(cp[t][h] + u * 32));
                sv[u][t][h] = __ldg(sp[t][h] + u * sstride);
            }
    }
#pragma unroll
    for (int u = 0; u < NB; ++u)
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            float blk[NT8][4];
            const u32 w0[2] = {cv[u][t][0].x, cv[u][t][0].y};  // row g: bytes 0-3, 4-7
            const u32 w8[2] = {cv[u][t][1].x, cv[u][t][1].y};  // row g + 8
#pragma unroll
            for (int st = 0; st < 4; ++st) {
                // bytes 2st and 2st + 1 of the lane's eight: word st / 2, bits 16 (st % 2) ..
                const u32 a = w0[st >> 1] >> (16 * (st & 1)), c = w8[st >> 1] >> (16 * (st & 1));
                const u32 a0 = pair(tab, ((a << 7) & 0x7F80u) | lane4);
                const u32 a2 = pair(tab, ((a >> 1) & 0x7F80u) | lane4);
                const u32 a1 = pair(tab, ((c << 7) & 0x7F80u) | lane4);
                const u32 a3 = pair(tab, ((c >> 1) & 0x7F80u) | lane4);
#pragma unroll
                for (int j = 0; j < NT8; ++j) {
                    const u32* xw = (const u32*)&xv[u][j][0];
                    if (st == 0)
                        mma0(blk[j], a0, a1, a2, a3, xw[0], xw[1]);
                    else
                        mma(blk[j], a0, a1, a2, a3, xw[2 * st], xw[2 * st + 1]);
                }
            }
#pragma unroll
            for (int j = 0; j < NT8; ++j) {
                acc[t][j][0] = fmaf(sv[u][t][0], blk[j][0], acc[t][j][0]);  // (row g)
                acc[t][j][1] = fmaf(sv[u][t][0], blk[j][1], acc[t][j][1]);
                acc[t][j][2] = fmaf(sv[u][t][1], blk[j][2], acc[t][j][2]);  // (row g + 8)
                acc[t][j][3] = fmaf(sv[u][t][1], blk[j][3], acc[t][j][3]);
            }
        }
}

// One block of K of the dense rows (dp: the lane's rows [tile][half]).
__device__ __forceinline__ void dense_pass(float (&acc)[2][NT8][4], const u16* const (&dp)[2][2],
                                           const u16* const (&xp)[NT8]) {
    uint4 xv[NT8][2], dv[2][2][2];
#pragma unroll
    for (int j = 0; j < NT8; ++j) {
        xv[j][0] = __ldg((const uint4*)xp[j]);
        xv[j][1] = __ldg((const uint4*)xp[j] + 1);
    }
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            dv[t][h][0] = __ldg((const uint4*)dp[t][h]);
            dv[t][h][1] = __ldg((const uint4*)dp[t][h] + 1);
        }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const u32* r0 = (const u32*)&dv[t][0][0];  // 8 words: elements 2i, 2i + 1 of the lane's 16
        const u32* r8 = (const u32*)&dv[t][1][0];
#pragma unroll
        for (int st = 0; st < 4; ++st)
#pragma unroll
            for (int j = 0; j < NT8; ++j) {
                const u32* xw = (const u32*)&xv[j][0];
                mma(acc[t][j], r0[2 * st], r8[2 * st], r0[2 * st + 1], r8[2 * st + 1], xw[2 * st], xw[2 * st + 1]);
            }
    }
}

// Warp 0's sums of an item (acc[t][j][e]: output column col0 + 16t + g + 8 (e / 2), x row 8j + 2q + (e % 2)): the
// output, or (several splits) the split's float32 partials, and for the unit's last split to arrive the partials of
// all splits added in split order (loads a round of ROUND splits at a time), the bias, the output; its count reset.
__device__ __forceinline__ void finish(float (&acc)[2][NT8][4], const bool (&rok)[2][2], int lane, int q, int g,
                                       int unit, int s, int M, int NT, int col0, int split, int has_bias,
                                       const float* __restrict__ BIAS, float* __restrict__ PART,
                                       u16* __restrict__ OUT, int* __restrict__ LOCK) {
    if (split > 1) {
        const long long plane = (long long)M * NT;
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int j = 0; j < NT8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int m = 8 * j + 2 * q + (e & 1), col = col0 + 16 * t + g + 8 * (e >> 1);
                    if (m < M && rok[t][e >> 1]) PART[s * plane + (long long)m * NT + col] = acc[t][j][e];
                }
        __threadfence();
        __syncwarp();
        int last = 0;
        if (lane == 0) last = atomicAdd(LOCK + unit, 1) == split - 1;
        last = __shfl_sync(0xffffffffu, last, 0);
        if (!last) return;
        __threadfence();
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int j = 0; j < NT8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[t][j][e] = 0.f;
        for (int p0 = 0; p0 < split; p0 += ROUND) {
            float got[ROUND][2][NT8][4];
#pragma unroll
            for (int p = 0; p < ROUND; ++p)
#pragma unroll
                for (int t = 0; t < 2; ++t)
#pragma unroll
                    for (int j = 0; j < NT8; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int m = 8 * j + 2 * q + (e & 1), col = col0 + 16 * t + g + 8 * (e >> 1);
                            got[p][t][j][e] = p0 + p < split && m < M && rok[t][e >> 1]
                                ? __ldcg(PART + (p0 + p) * plane + (long long)m * NT + col) : 0.f;
                        }
#pragma unroll
            for (int p = 0; p < ROUND; ++p)
#pragma unroll
                for (int t = 0; t < 2; ++t)
#pragma unroll
                    for (int j = 0; j < NT8; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[t][j][e] += got[p][t][j][e];
        }
        if (lane == 0) LOCK[unit] = 0;
    }
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int j = 0; j < NT8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = 8 * j + 2 * q + (e & 1), col = col0 + 16 * t + g + 8 * (e >> 1);
                if (m < M && rok[t][e >> 1])
                    OUT[(long long)m * NT + col] = to16(acc[t][j][e] + (has_bias ? BIAS[col] : 0.f));
            }
}

__shared__ __align__(16) u32 nf4_pairs[256 * COPIES];  // the table (at file scope: PTX names it plainly)

extern "C" __global__ void __launch_bounds__(WARPS * 32) nf4_mma(
    const u16* __restrict__ X, long long sx, int M,                 // x [M, K], row stride sx (elements)
    const unsigned char* __restrict__ P0, const unsigned char* __restrict__ P1,
    const unsigned char* __restrict__ P2, int N0, int N01, int NQ,  // the NF4 weights' codes, rows [0,N0) [N0,N01) [N01,NQ)
    const float* __restrict__ S,                                    // absmax [K/64, NQ]
    const u16* __restrict__ D, int R,                               // dense rows [R, K]
    const float* __restrict__ BIAS, int has_bias,                   // [NQ + R] float32
    const u32* __restrict__ CODE16,                                 // [16] the code values' 16-bit patterns
    float* __restrict__ PART, u16* __restrict__ OUT, int* __restrict__ LOCK,  // [split, M, NT], [M, NT], [units]
    int K, int NT, int dense_units, int units, int split, int per_split) {
    for (int e = threadIdx.x; e < 256; e += blockDim.x) {
        const u32 v = CODE16[e >> 4] | (CODE16[e & 15] << 16);
        uint4* row = (uint4*)(nf4_pairs + e * COPIES);
#pragma unroll
        for (int c = 0; c < COPIES / 4; ++c) row[c] = make_uint4(v, v, v, v);
    }
    __syncthreads();
    u32 tab;  // the table's shared address: a constant that folds into the loads' offsets
    asm("mov.u32 %0, nf4_pairs;" : "=r"(tab));

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const u32 lane4 = lane * 4;
    const int n_blocks = K / 64;
    const long long KB = K / 2;
    const int items = units * split;
    __shared__ float others[WARPS - 1][NV][32];  // warps 1.. hand their sums to warp 0 (a lane's column: no conflicts)

    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int unit = item / split, s = item - unit * split;
        const int i_lo = s * per_split, i_hi = min(i_lo + per_split, n_blocks);  // the item's blocks of K
        const int per_warp = (i_hi - i_lo + WARPS - 1) / WARPS;                  // this warp's share of them
        const int b_lo = min(i_lo + warp * per_warp, i_hi), b_hi = min(b_lo + per_warp, i_hi);
        const bool dense = unit < dense_units;
        const int row0 = dense ? unit * UNIT : (unit - dense_units) * UNIT;  // first row among D's or the NF4 rows
        const int col0 = dense ? NQ + row0 : row0;                           // its output column
        const int rows = dense ? R : NQ;

        float acc[2][NT8][4];
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int j = 0; j < NT8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[t][j][e] = 0.f;

        // this lane's rows: tile t, half h → row0 + 16t + 8h + g; rows past the end read row `start` instead
        // (finite values whose outputs are not stored), so that no load needs a mask
        bool rok[2][2];
        const unsigned char* cp[2][2];  // NF4: the row's code bytes, at this lane's 8 of block b_lo
        const float* sp[2][2];          // its absmax of block b_lo
        const u16* dp[2][2];            // dense: the row's elements, at this lane's 16 of block b_lo
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const int first = row0 + 16 * t;  // a tile lies inside one weight (nf4_matmul.groupable)
            const unsigned char* base = first >= N01 ? P2 : (first >= N0 ? P1 : P0);
            const int start = dense ? 0 : (first >= N01 ? N01 : (first >= N0 ? N0 : 0));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = first + 8 * h + g;
                rok[t][h] = r < rows;
                const int rr = rok[t][h] ? r : start;
                cp[t][h] = base + (long long)(rr - start) * KB + (long long)b_lo * 32 + q * 8;
                sp[t][h] = S + (long long)b_lo * NQ + rr;
                dp[t][h] = D + (long long)rr * K + (long long)b_lo * 64 + q * 16;
            }
        }
        const u16* xp[NT8];
#pragma unroll
        for (int j = 0; j < NT8; ++j)
            xp[j] = X + (long long)(8 * j + g < M ? 8 * j + g : 0) * sx + (long long)b_lo * 64 + q * 16;

        if (dense) {  // (few rows: a block a pass)
            for (int b = b_lo; b < b_hi; ++b) {
                dense_pass(acc, dp, xp);
#pragma unroll
                for (int t = 0; t < 2; ++t)
#pragma unroll
                    for (int h = 0; h < 2; ++h) dp[t][h] += 64;
#pragma unroll
                for (int j = 0; j < NT8; ++j) xp[j] += 64;
            }
        } else {
            int b = b_lo;
            for (; b + UNR <= b_hi; b += UNR) {
                nf4_pass<UNR>(acc, cp, sp, NQ, xp, tab, lane4);
#pragma unroll
                for (int t = 0; t < 2; ++t)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        cp[t][h] += UNR * 32;
                        sp[t][h] += (long long)UNR * NQ;
                    }
#pragma unroll
                for (int j = 0; j < NT8; ++j) xp[j] += UNR * 64;
            }
            for (; b < b_hi; ++b) {  // the warp's last blocks, fewer than a pass
                nf4_pass<1>(acc, cp, sp, NQ, xp, tab, lane4);
#pragma unroll
                for (int t = 0; t < 2; ++t)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        cp[t][h] += 32;
                        sp[t][h] += NQ;
                    }
#pragma unroll
                for (int j = 0; j < NT8; ++j) xp[j] += 64;
            }
        }

        // the warps' sums into warp 0's, added in warp order (the same result every call)
        float* mine = &acc[0][0][0];
        if (warp > 0) {
#pragma unroll
            for (int v = 0; v < NV; ++v) others[warp - 1][v][lane] = mine[v];
        }
        __syncthreads();
        if (warp == 0) {
#pragma unroll
            for (int w = 0; w < WARPS - 1; ++w)
#pragma unroll
                for (int v = 0; v < NV; ++v) mine[v] += others[w][v][lane];
            finish(acc, rok, lane, q, g, unit, s, M, NT, col0, split, has_bias, BIAS, PART, OUT, LOCK);
        }
        __syncthreads();  // (others is free for the next item)
    }
}
