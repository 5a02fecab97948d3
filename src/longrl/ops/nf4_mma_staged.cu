// nf4_mma.cu's product (y = x · [W_0; W_1; W_2; D]ᵀ (+ bias), ≤ 8·NT8 rows of x, bitsandbytes NF4 codes in their
// own layout, after nf4_mma_common.cuh: the same table lookup, k order, arithmetic and epilogue) with the codes,
// their absmax and x staged in shared memory by cp.async, STAGES - 1 stages of UNR blocks of K ahead of the products.
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

#ifndef STAGES
#define STAGES 3
#endif

#define UNR 4                    // blocks of K a stage
#define UNIT (32 * WARPS)        // rows of the group an item owns
#define XR (8 * NT8)             // rows of x
#define CODE_BYTES (UNIT * 128)
#define SCALE_BYTES (UNR * UNIT * 4)
#define X_BYTES (UNR * XR * 128)
#define STAGE_BYTES (CODE_BYTES + SCALE_BYTES + X_BYTES)
#define XCOPIES (X_BYTES / 16 / (WARPS * 32))  // x's 16-byte copies a thread a stage

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
            tile_block(acc[t], w0, w8, s0, s8, xv, tab, lane4);
        }
    }
}

extern __shared__ __align__(128) unsigned char stages[];  // STAGES × STAGE_BYTES

extern "C" __global__ void __launch_bounds__(WARPS * 32) nf4_mma_staged(NF4_MMA_PARAMS) {
    const u32 tab = build_table(CODE16);
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
        const Item it = item_at(item, split, per_split, n_blocks, dense_units, UNIT, NQ, R);
        const int unit = it.unit, s = it.s, i_lo = it.i_lo, i_hi = it.i_hi, row0 = it.row0, col0 = it.col0;
        const int rows = it.rows;
        const bool dense = it.dense;

        float acc[2][NT8][4];
        zero(acc);
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
            if (row0 + 32 * warp < rows) dense_blocks(acc, dp, xp, i_lo, i_hi);
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
            store_partials(acc, rok, q, g, s, M, NT, colw, PART);
            __threadfence();
            __syncthreads();
            if (tid == 0) last_flag = atomicAdd(LOCK + unit, 1) == split - 1;
            __syncthreads();
            const bool last = last_flag;
            __syncthreads();  // (last_flag is free for the next item)
            if (!last) continue;
            __threadfence();
            add_partials(acc, rok, q, g, split, M, NT, colw, PART);
            if (tid == 0) LOCK[unit] = 0;
        }
        store_output(acc, rok, q, g, M, NT, colw, has_bias, BIAS, OUT);
    }
}
