// nf4_mma.cu's product (y = x · [W_0; W_1; W_2; D]ᵀ (+ bias), ≤ 8·NT8 rows of x, bitsandbytes NF4 codes in their
// own layout, mma.sync m16n8k16, the same shared table of value pairs and the same permuted k order) with the codes, their
// absmax and x staged in shared memory by cp.async, STAGES - 1 stages of UNR blocks of K ahead of the products.
//
// Why: nf4_mma.cu's warps each load a pass of codes into registers and wait for them before their products, so a
// warp has bytes in flight only part of the time (gate/up at 8 rows read 1.4 TB/s of an H100's 3.0). Here the loads
// of later stages are in flight while a stage's products run, and no register holds them meanwhile.
//
// Work: items of UNIT = 128 rows (32 a warp: two m16 tiles) and a range of K, taken by blocks in turn (a persistent
// grid that builds the table once a block). The warps share a stage's x and each reads its own rows' codes, so no
// sums cross warps. With several K splits the block's last item of a unit to arrive adds the float32 partials in
// split order (an arrival count a unit, left zero): the same result every call. The dense rows (16-bit, the LoRA A
// rows) come first in their own units, read straight from global memory as nf4_mma.cu does.
//
// A stage (shared memory, after the static table):
//   codes  [UNIT rows][128 B]: row r's UNR blocks of 32 code bytes; its 16-byte chunk c stored at c ^ ((r & 3) << 1)
//          (lane (g, q) reads chunk 2u + q / 2 of rows g, g + 8: the four rows of a half warp then meet no bank twice)
//   absmax [UNR][UNIT] float32
//   x      [UNR][8·NT8 rows][128 B]: row m's 64 elements of block u; its chunk c stored at c ^ (m & 1) (a quarter
//          warp's 16-byte loads, rows g and g + 1 of chunks 2q or 2q + 1, meet no bank twice)
// Blocks past the item's range and rows past the weights' or x's are zero-filled (cp.async with no source bytes):
// their products add exact zeros.

#ifndef NT8
#define NT8 1
#endif
#ifndef HALF
#define HALF 0
#endif
#ifndef STAGES
#define STAGES 3
#endif

#define WARPS 4
#define COPIES 32
#define UNR 4                    // blocks of K a stage
#define UNIT (32 * WARPS)        // rows of the group an item owns
#define XR (8 * NT8)             // rows of x
#define NV (8 * NT8)             // a lane's sums: [tile 2][n8 tile NT8][4]
#define ROUND (4 / NT8)          // splits' partials a round of the last item's loads
#define CODE_BYTES (UNIT * 128)
#define SCALE_BYTES (UNR * UNIT * 4)
#define X_BYTES (UNR * XR * 128)
#define STAGE_BYTES (CODE_BYTES + SCALE_BYTES + X_BYTES)
#define XCOPIES (X_BYTES / 16 / (WARPS * 32))  // x's 16-byte copies a thread a stage

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

__device__ __forceinline__ void mma0(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {  // d = a · b
#if HALF
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
#endif
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.f));
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

__device__ __forceinline__ u32 ld32(u32 address) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(address));
    return v;
}

__device__ __forceinline__ uint2 ld64(u32 address) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(address));
    return v;
}

__device__ __forceinline__ uint4 ld128(u32 address) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(address));
    return v;
}

// 16 bytes from global memory to shared (through L2 only), or zeros where !ok (no source bytes read)
__device__ __forceinline__ void cp16(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(ok ? 16 : 0));
}

// 16 bytes through L1 as well (x: every item of the same K range reads it again)
__device__ __forceinline__ void cp16_l1(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(ok ? 16 : 0));
}

__device__ __forceinline__ void cp4(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(ok ? 4 : 0));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void wait_stages() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

// One block of K of the dense rows (dp: the lane's rows [tile][half], at this lane's 16 elements of the block).
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

// The products of one stage (at shared address `stage`) into acc: lane (g, q) of warp `warp`, rows
// 32 warp + 16 t + 8 h + g of the unit.
__device__ __forceinline__ void stage_products(float (&acc)[2][NT8][4], u32 stage, u32 tab, u32 lane4, int warp,
                                               int g, int q) {
    const u32 codes = stage, scales = stage + CODE_BYTES, xs = stage + CODE_BYTES + SCALE_BYTES;
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
        uint4 xv[NT8][2];  // x[8j + g][64u + 16q ..+16): chunks 2q and 2q + 1 of the row
#pragma unroll
        for (int j = 0; j < NT8; ++j) {
            const u32 row = xs + (u * XR + 8 * j + g) * 128;  // (8j + g) & 1 = g & 1
            xv[j][0] = ld128(row + (((2 * q) ^ (g & 1)) << 4));
            xv[j][1] = ld128(row + (((2 * q + 1) ^ (g & 1)) << 4));
        }
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const int r0 = 32 * warp + 16 * t + g;  // rows r0 and r0 + 8 (r & 3 = g & 3 for both)
            const u32 at = ((((2 * u + (q >> 1)) ^ ((g & 3) << 1)) << 4) | ((q & 1) << 3));
            const uint2 c0 = ld64(codes + r0 * 128 + at), c8 = ld64(codes + (r0 + 8) * 128 + at);
            const float s0 = __uint_as_float(ld32(scales + (u * UNIT + r0) * 4));
            const float s8 = __uint_as_float(ld32(scales + (u * UNIT + r0 + 8) * 4));
            const u32 w0[2] = {c0.x, c0.y}, w8[2] = {c8.x, c8.y};
            float blk[NT8][4];
#pragma unroll
            for (int st = 0; st < 4; ++st) {
                // bytes 2st and 2st + 1 of the lane's eight (nf4_mma.cu's k order)
                const u32 a = w0[st >> 1] >> (16 * (st & 1)), c = w8[st >> 1] >> (16 * (st & 1));
                const u32 a0 = ld32(tab + (((a << 7) & 0x7F80u) | lane4));
                const u32 a2 = ld32(tab + (((a >> 1) & 0x7F80u) | lane4));
                const u32 a1 = ld32(tab + (((c << 7) & 0x7F80u) | lane4));
                const u32 a3 = ld32(tab + (((c >> 1) & 0x7F80u) | lane4));
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
                acc[t][j][0] = fmaf(s0, blk[j][0], acc[t][j][0]);  // (row g)
                acc[t][j][1] = fmaf(s0, blk[j][1], acc[t][j][1]);
                acc[t][j][2] = fmaf(s8, blk[j][2], acc[t][j][2]);  // (row g + 8)
                acc[t][j][3] = fmaf(s8, blk[j][3], acc[t][j][3]);
            }
        }
    }
}

__shared__ __align__(16) u32 nf4_pairs[256 * COPIES];  // the table (static: its address folds into the loads)
extern __shared__ __align__(128) unsigned char stages[];  // STAGES × STAGE_BYTES

extern "C" __global__ void __launch_bounds__(WARPS * 32) nf4_mma_staged(
    const u16* __restrict__ X, long long sx, int M,                 // x [M, K], row stride sx (elements)
    const unsigned char* __restrict__ P0, const unsigned char* __restrict__ P1,
    const unsigned char* __restrict__ P2, int N0, int N01, int NQ,  // the NF4 codes: rows [0,N0) [N0,N01) [N01,NQ)
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
    u32 tab;
    asm("mov.u32 %0, nf4_pairs;" : "=r"(tab));
    const u32 ring = (u32)__cvta_generic_to_shared(stages);
    __shared__ int last_flag;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const u32 lane4 = lane * 4;
    const int n_blocks = K / 64;

    // this thread's copies of x in a stage ([UNR][XR rows][8 chunks], 16 bytes each): the same every item
    const u16* xsrc[XCOPIES];  // at block 0
    u32 xdst[XCOPIES];         // its offset in a stage
    int xblk[XCOPIES];         // its block of the stage
    bool xok[XCOPIES];         // a row of x (else zeros)
#pragma unroll
    for (int i = 0; i < XCOPIES; ++i) {
        const u32 slot = (tid >> 3) + 16 * i, m = slot % XR, c = tid & 7;
        xblk[i] = slot / XR;
        xok[i] = (int)m < M;
        xsrc[i] = X + (long long)(xok[i] ? m : 0) * sx + xblk[i] * 64 + c * 8;
        xdst[i] = CODE_BYTES + SCALE_BYTES + (xblk[i] * XR + m) * 128 + ((c ^ (m & 1)) << 4);
    }
    const long long KB = K / 2;
    const int items = units * split;

    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int unit = item / split, s = item - unit * split;
        const int i_lo = s * per_split, i_hi = min(i_lo + per_split, n_blocks);  // the item's blocks of K
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
        bool rok[2][2];  // this lane's rows 32 warp + 16 t + 8 h + g inside the weights
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h) rok[t][h] = row0 + 32 * warp + 16 * t + 8 * h + g < rows;

        if (dense) {  // straight from global memory, a block a pass (few rows)
            const u16* dp[2][2];
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = row0 + 32 * warp + 16 * t + 8 * h + g;
                    dp[t][h] = D + (long long)(rok[t][h] ? r : 0) * K + (long long)i_lo * 64 + q * 16;
                }
            const u16* xp[NT8];
#pragma unroll
            for (int j = 0; j < NT8; ++j)
                xp[j] = X + (long long)(8 * j + g < M ? 8 * j + g : 0) * sx + (long long)i_lo * 64 + q * 16;
            if (row0 + 32 * warp < rows) {
                for (int b = i_lo; b < i_hi; ++b) {
                    dense_pass(acc, dp, xp);
#pragma unroll
                    for (int t = 0; t < 2; ++t)
#pragma unroll
                        for (int h = 0; h < 2; ++h) dp[t][h] += 64;
#pragma unroll
                    for (int j = 0; j < NT8; ++j) xp[j] += 64;
                }
            }
        } else {
            // this thread's copies: code rows 16 i + tid / 8 (tile i of the unit), chunk tid % 8
            const unsigned char* crow[8];
            bool cok[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int first = row0 + 16 * i;  // a tile lies inside one weight (nf4_matmul.groupable)
                const unsigned char* base = first >= N01 ? P2 : (first >= N0 ? P1 : P0);
                const int start = first >= N01 ? N01 : (first >= N0 ? N0 : 0);
                const int r = first + (tid >> 3);
                cok[i] = r < NQ;
                crow[i] = base + (long long)((cok[i] ? r : start) - start) * KB + (tid & 7) * 16;
            }
            const int n_stages = (i_hi - i_lo + UNR - 1) / UNR;

            // absmax: this thread's row (tid) of the unit, UNR blocks a stage
            const bool sok = row0 + tid < NQ;
            const float* srow = S + (sok ? row0 + tid : 0);

            auto load = [&](int st) {  // stage st of the item into its slot of the ring
                const u32 at = ring + (st % STAGES) * STAGE_BYTES;
                const int b0 = i_lo + st * UNR;
                const long long code_at = (long long)b0 * 32, scale_at = (long long)b0 * NQ;
                const bool kok = b0 + ((tid & 7) >> 1) < i_hi;  // (the chunk's block)
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const u32 r = 16 * i + (tid >> 3);
                    cp16(at + r * 128 + (((tid & 7) ^ ((r & 3) << 1)) << 4), crow[i] + code_at, kok && cok[i]);
                }
#pragma unroll
                for (int u = 0; u < UNR; ++u)  // absmax [UNR][UNIT]
                    cp4(at + CODE_BYTES + (u * UNIT + tid) * 4, srow + scale_at + (long long)u * NQ,
                        sok && b0 + u < i_hi);
#pragma unroll
                for (int i = 0; i < XCOPIES; ++i)
                    cp16_l1(at + xdst[i], xsrc[i] + (long long)b0 * 64, xok[i] && b0 + xblk[i] < i_hi);
            };

#pragma unroll
            for (int st = 0; st < STAGES - 1; ++st) {
                if (st < n_stages) load(st);
                commit();
            }
            for (int st = 0; st < n_stages; ++st) {
                wait_stages<STAGES - 2>();  // stage st has landed (this thread's copies) ...
                __syncthreads();            // ... and every thread's; the slot of stage st - 1 is free
                if (st + STAGES - 1 < n_stages) load(st + STAGES - 1);
                commit();
                stage_products(acc, ring + (st % STAGES) * STAGE_BYTES, tab, lane4, warp, g, q);
            }
            wait_stages<0>();
        }
        __syncthreads();  // (the ring is free for the next item)

        // the sums: the output, or (several splits) this split's float32 partials, and for the unit's last split
        // to arrive the partials of all splits added in split order, the bias, the output; its count reset
        const int colw = col0 + 32 * warp;
        if (split > 1) {
            const long long plane = (long long)M * NT;
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
                for (int j = 0; j < NT8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int m = 8 * j + 2 * q + (e & 1), col = colw + 16 * t + g + 8 * (e >> 1);
                        if (m < M && rok[t][e >> 1]) PART[s * plane + (long long)m * NT + col] = acc[t][j][e];
                    }
            __threadfence();
            __syncthreads();
            if (tid == 0) last_flag = atomicAdd(LOCK + unit, 1) == split - 1;
            __syncthreads();
            const bool last = last_flag;
            __syncthreads();  // (last_flag is free for the next item)
            if (!last) continue;
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
            if (tid == 0) LOCK[unit] = 0;
        }
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int j = 0; j < NT8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int m = 8 * j + 2 * q + (e & 1), col = colw + 16 * t + g + 8 * (e >> 1);
                    if (m < M && rok[t][e >> 1])
                        OUT[(long long)m * NT + col] = to16(acc[t][j][e] + (has_bias ? BIAS[col] : 0.f));
                }
    }
}
