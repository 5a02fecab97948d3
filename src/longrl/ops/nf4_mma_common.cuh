// What nf4_mma.cu and nf4_mma_staged.cu share (ops/nf4_mma.py puts this file before each): the mma.sync calls, the
// shared table of the code bytes' value pairs, one 64-wide block of K of a 16-row tile through the table, the dense
// rows' block, and the sums' epilogue. Built with -DNT8=1|2|4 (n8 tiles of x rows) and -DHALF=0|1 (bfloat16 |
// float16 operands).
//
// The lookup: a shared table of 256 16-bit value pairs, T[byte] = (code[byte >> 4], code[byte & 15]) (the high
// nibble is the lower k, in the low half), so one load turns a code byte into the tensor cores' register of two
// values. Each lane reads its own copy (32 copies, entry e of copy c at word 32 e + c: lane c's bank is always c),
// so the loads never conflict; a byte's address is ((byte << 7) | lane · 4), one shift and one LOP3 from the word.
//
// The k order: a sum over k may take k in any order if x and W take the same one. In a 64-wide block (one absmax a
// row, 32 code bytes a row) lane (g, q) (g = lane / 4, q = lane % 4) takes the bytes 8q..8q+7 of rows g and g + 8
// and x[row g][16q .. 16q + 16); k-step s (0..3) feeds the mma's columns 2q, 2q+1 from byte 2s (k = 16q + 4s +
// {0, 1}) and 2q+8, 2q+9 from byte 2s + 1 (k = 16q + 4s + {2, 3}); x's fragment at step s is then the two words at
// 16q + 4s, as mma's B layout asks. A block's four k-steps go to a fresh float32 sum, then acc += absmax[row] · sum
// (float32): the weights are cast(code)·absmax, ops/nf4_matmul.py's lut 4 (nf4_group_reference(scale_after=True)
// is the twin).
//
// A lane's sums acc[t][j][e] (two m16 tiles t of a warp's 32 rows, NT8 n8 tiles j of x's rows) are output column
// colw + 16t + g + 8 (e / 2) and x row 8j + 2q + (e % 2).

#ifndef NT8
#define NT8 1
#endif
#ifndef HALF
#define HALF 0
#endif

#define WARPS 4          // a block's warps
#define COPIES 32        // the table's copies: one a lane
#define NV (8 * NT8)     // a lane's sums: [tile 2][n8 tile NT8][4]
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

// A table entry: table its shared address, offset (byte << 7) | lane · 4.
__device__ __forceinline__ u32 pair(u32 table, u32 offset) {
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

// Both kernels' arguments (ops/nf4_mma.py launches either with the same list):
//   X [M, K] (row stride sx elements); the NF4 codes P0, P1, P2 of rows [0, N0) [N0, N01) [N01, NQ); S the absmax
//   [K/64, NQ]; D the dense rows [R, K]; BIAS [NQ + R] float32 (has_bias); CODE16 [16] the code values' 16-bit
//   patterns; PART [split, M, NT] float32 partials, OUT [M, NT], LOCK [units] arrival counts; the items: dense_units
//   units of D's rows first, units in all, split K ranges of per_split blocks each.
#define NF4_MMA_PARAMS                                                                                              \
    const u16 *__restrict__ X, long long sx, int M, const unsigned char *__restrict__ P0,                           \
        const unsigned char *__restrict__ P1, const unsigned char *__restrict__ P2, int N0, int N01, int NQ,        \
        const float *__restrict__ S, const u16 *__restrict__ D, int R, const float *__restrict__ BIAS, int has_bias, \
        const u32 *__restrict__ CODE16, float *__restrict__ PART, u16 *__restrict__ OUT, int *__restrict__ LOCK,    \
        int K, int NT, int dense_units, int units, int split, int per_split

__shared__ __align__(16) u32 nf4_pairs[256 * COPIES];  // the table (at file scope: PTX names it plainly)

// The table from the 16 code values' 16-bit patterns, by a block's threads; returns its shared address (a constant
// that folds into the loads' offsets).
__device__ __forceinline__ u32 build_table(const u32* __restrict__ CODE16) {
    for (int e = threadIdx.x; e < 256; e += blockDim.x) {
        const u32 v = CODE16[e >> 4] | (CODE16[e & 15] << 16);
        uint4* row = (uint4*)(nf4_pairs + e * COPIES);
#pragma unroll
        for (int c = 0; c < COPIES / 4; ++c) row[c] = make_uint4(v, v, v, v);
    }
    __syncthreads();
    u32 tab;
    asm("mov.u32 %0, nf4_pairs;" : "=r"(tab));
    return tab;
}

// One 64-wide block of K of a 16-row tile: w0, w8 the lane's 8 code bytes of rows g and g + 8 (two words each), s0,
// s8 their absmax, xv x's fragments (x[8j + g][16q ..+16)); acc[j] += absmax · Σ_k cast(code) · x.
__device__ __forceinline__ void tile_block(float (&acc)[NT8][4], const u32 (&w0)[2], const u32 (&w8)[2], float s0,
                                           float s8, const uint4 (&xv)[NT8][2], u32 tab, u32 lane4) {
    float blk[NT8][4];
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
            const u32* xw = (const u32*)&xv[j][0];
            if (st == 0)
                mma0(blk[j], a0, a1, a2, a3, xw[0], xw[1]);
            else
                mma(blk[j], a0, a1, a2, a3, xw[2 * st], xw[2 * st + 1]);
        }
    }
#pragma unroll
    for (int j = 0; j < NT8; ++j) {
        acc[j][0] = fmaf(s0, blk[j][0], acc[j][0]);  // (row g)
        acc[j][1] = fmaf(s0, blk[j][1], acc[j][1]);
        acc[j][2] = fmaf(s8, blk[j][2], acc[j][2]);  // (row g + 8)
        acc[j][3] = fmaf(s8, blk[j][3], acc[j][3]);
    }
}

// One block of K of the dense rows (dp: the lane's rows [tile][half], at its 16 elements of the block).
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

__device__ __forceinline__ void zero(float (&acc)[2][NT8][4]) {
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int j = 0; j < NT8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[t][j][e] = 0.f;
}

// A work item: `unit_rows` rows of the group (dense rows' units first, then the NF4 rows') and a K split's range of
// 64-wide blocks.
struct Item {
    int unit, s, i_lo, i_hi;  // its row unit, its split, its blocks [i_lo, i_hi)
    bool dense;               // a unit of the dense rows D
    int row0, col0, rows;     // its first row among D's or the NF4 rows, that row's output column, rows of its kind
};

__device__ __forceinline__ Item item_at(int item, int split, int per_split, int n_blocks, int dense_units,
                                        int unit_rows, int NQ, int R) {
    Item it;
    it.unit = item / split;
    it.s = item - it.unit * split;
    it.i_lo = it.s * per_split;
    it.i_hi = min(it.i_lo + per_split, n_blocks);
    it.dense = it.unit < dense_units;
    it.row0 = it.dense ? it.unit * unit_rows : (it.unit - dense_units) * unit_rows;
    it.col0 = it.dense ? NQ + it.row0 : it.row0;
    it.rows = it.dense ? R : NQ;
    return it;
}

// Blocks [b_lo, b_hi) of K of the dense rows from the lane's pointers dp, xp (at b_lo; advanced past b_hi).
__device__ __forceinline__ void dense_blocks(float (&acc)[2][NT8][4], const u16* (&dp)[2][2], const u16* (&xp)[NT8],
                                             int b_lo, int b_hi) {
    for (int b = b_lo; b < b_hi; ++b) {
        dense_pass(acc, dp, xp);
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h) dp[t][h] += 64;
#pragma unroll
        for (int j = 0; j < NT8; ++j) xp[j] += 64;
    }
}

// The epilogue's three parts (rok[t][h]: the lane's row 16t + 8h + g of the warp's 32 inside the weights).
// f(t, j, e, m, col) for each of the lane's sums whose row m of x and output column col exist.
template <class F>
__device__ __forceinline__ void each_sum(const bool (&rok)[2][2], int q, int g, int M, int colw, F f) {
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int j = 0; j < NT8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = 8 * j + 2 * q + (e & 1), col = colw + 16 * t + g + 8 * (e >> 1);
                if (m < M && rok[t][e >> 1]) f(t, j, e, m, col);
            }
}

// A split's float32 partials into its plane of PART [split, M, NT].
__device__ __forceinline__ void store_partials(const float (&acc)[2][NT8][4], const bool (&rok)[2][2], int q, int g,
                                               int s, int M, int NT, int colw, float* __restrict__ PART) {
    const long long plane = (long long)M * NT;
    each_sum(rok, q, g, M, colw, [&](int t, int j, int e, int m, int col) {
        PART[s * plane + (long long)m * NT + col] = acc[t][j][e];
    });
}

// acc = the partials of all splits added in split order (a round of ROUND splits' loads at a time).
__device__ __forceinline__ void add_partials(float (&acc)[2][NT8][4], const bool (&rok)[2][2], int q, int g,
                                             int split, int M, int NT, int colw, const float* __restrict__ PART) {
    const long long plane = (long long)M * NT;
    zero(acc);
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
                        const int m = 8 * j + 2 * q + (e & 1), col = colw + 16 * t + g + 8 * (e >> 1);
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
}

// The sums (+ bias) rounded to 16 bits into OUT [M, NT].
__device__ __forceinline__ void store_output(const float (&acc)[2][NT8][4], const bool (&rok)[2][2], int q, int g,
                                             int M, int NT, int colw, int has_bias, const float* __restrict__ BIAS,
                                             u16* __restrict__ OUT) {
    each_sum(rok, q, g, M, colw, [&](int t, int j, int e, int m, int col) {
        OUT[(long long)m * NT + col] = to16(acc[t][j][e] + (has_bias ? BIAS[col] : 0.f));
    });
}
