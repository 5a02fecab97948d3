// y = x · [W_0; W_1; W_2; D]ᵀ (+ bias) for a few rows of x (≤ 8·NT8) and bitsandbytes NF4 weights read in their
// own layout, on the tensor cores' mma.sync m16n8k16 (sm_80 and newer), after nf4_mma_common.cuh (the table lookup,
// the k order, the arithmetic and the epilogue). Compiled at first use by NVRTC (ops/nf4_mma.py).
//
// Work: items (32 rows of the group: two m16 tiles, one range of K) taken by blocks in turn (a persistent grid that
// builds the table once a block); a block's four warps split the item's range of K, each loading a pass of UNR
// blocks into registers before its products, and add their sums through shared memory in warp order. The dense
// rows D (16-bit, the LoRA A rows) come first, read as they are. With several K splits each item writes float32
// partials, and the last of a row unit's items to finish (an arrival count a unit, left zero) adds them in split
// order: the same result every call.
// (A first version took items a warp at a time and added the partials one load after another: its time grew with
// the splits, 134 µs a layer at 8 rows on an H100 at best against Triton's 97; nf4_matmul_h100_mma.md.)

#ifndef UNR
#define UNR (4 / NT8)  // blocks of K a pass loads before its products (registers: x's fragments grow with NT8)
#endif
#define UNIT 32  // rows of the group an item owns

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
            const u32 w0[2] = {cv[u][t][0].x, cv[u][t][0].y};  // row g: bytes 0-3, 4-7
            const u32 w8[2] = {cv[u][t][1].x, cv[u][t][1].y};  // row g + 8
            tile_block(acc[t], w0, w8, sv[u][t][0], sv[u][t][1], xv[u], tab, lane4);
        }
}

// Warp 0's sums of an item: the output, or (several splits) the split's float32 partials, and for the unit's last
// split to arrive the partials of all splits added in split order, the bias, the output; its count reset.
__device__ __forceinline__ void finish(float (&acc)[2][NT8][4], const bool (&rok)[2][2], int lane, int q, int g,
                                       int unit, int s, int M, int NT, int col0, int split, int has_bias,
                                       const float* __restrict__ BIAS, float* __restrict__ PART,
                                       u16* __restrict__ OUT, int* __restrict__ LOCK) {
    if (split > 1) {
        store_partials(acc, rok, q, g, s, M, NT, col0, PART);
        __threadfence();
        __syncwarp();
        int last = 0;
        if (lane == 0) last = atomicAdd(LOCK + unit, 1) == split - 1;
        last = __shfl_sync(0xffffffffu, last, 0);
        if (!last) return;
        __threadfence();
        add_partials(acc, rok, q, g, split, M, NT, col0, PART);
        if (lane == 0) LOCK[unit] = 0;
    }
    store_output(acc, rok, q, g, M, NT, col0, has_bias, BIAS, OUT);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) nf4_mma(NF4_MMA_PARAMS) {
    const u32 tab = build_table(CODE16);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const u32 lane4 = lane * 4;
    const int n_blocks = K / 64;
    const long long KB = K / 2;
    const int items = units * split;
    __shared__ float others[WARPS - 1][NV][32];  // warps 1.. hand their sums to warp 0 (a lane's column: no conflicts)

    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const Item it = item_at(item, split, per_split, n_blocks, dense_units, UNIT, NQ, R);
        const int unit = it.unit, s = it.s, i_lo = it.i_lo, i_hi = it.i_hi, row0 = it.row0, col0 = it.col0;
        const int rows = it.rows;
        const bool dense = it.dense;
        const int per_warp = (i_hi - i_lo + WARPS - 1) / WARPS;  // this warp's share of the item's blocks
        const int b_lo = min(i_lo + warp * per_warp, i_hi), b_hi = min(b_lo + per_warp, i_hi);

        float acc[2][NT8][4];
        zero(acc);

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
            dense_blocks(acc, dp, xp, b_lo, b_hi);
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
