// attention_prefill_hopper.cu: causal flash attention of a prefill chunk over the paged KV cache on
// sm_90a, in the FlashAttention-3 manner (wgmma, TMA, mbarriers, a producer warpgroup).
//
// attention_prefill.cu's contract for head_dim 128 without soft-cap, window or sinks: q bf16
//   [n, H, D] (rotated) for positions start .. start + n - 1, the chunk's K/V already in the cache
//   (bf16 [num_blocks][L][2][block_size][KVH][D], this layer's part), block_table int32 of the
//   sequence; out bf16 [n, H * D]. Query position p sees keys 0 .. p (the retained prefix whole).
// Block: FA_BM = 128 rows of (position, head of the group) -- GROUP query heads share a KV head, so
//   one block holds FA_PB = 128 / GROUP positions x GROUP heads, row r = position * GROUP + head,
//   and reads each K/V tile once for all of them. Grid (KVH, ceil(n / FA_PB)), the last (heaviest)
//   position blocks first. 384 threads: warpgroup 0 is the producer (its warp 0: lane i reads the
//   block-table entry of the tile's page i, before waiting for the stage, and issues that page's
//   copies; setmaxnreg gives the warpgroup's registers to the consumers), warpgroups 1 and 2 each
//   own 64 rows.
// Shared memory (1 KB aligned, 128-byte swizzle throughout): Q [2][128][64] (the two 64-dim halves
//   of D), FA_STAGES (3) stages of K [2][FA_KT][64] and of V [2][FA_KT][64]; 224 KB. The Q box of the
//   3-D map (D, H, n) is (64, GROUP, FA_PB): it lands in row order position * GROUP + head. K and V
//   come through a 3-D map of the layer's cache (D, KVH, rows of KVH * D): one box (64, 1, R) per
//   page and half, R = min(block_size, FA_KT) rows, at row block_table[t / block_size] * block_rows
//   + (0 for K, block_size for V) + t % block_size. A page past the last key is read with KV head
//   KVH (out of range): the TMA writes zeros and still completes the full byte count.
// Barriers: qfull; kfull/vfull[s] (1 arrival + bytes), kempty/vempty[s] (one arrival per consumer
//   warpgroup). The producer waits empty with the opposite parity (a fresh barrier passes).
// Consumers, per key tile j (intra-warpgroup pipelining): issue S = Q K_j^T (8 wgmma m64n128k16,
//   both from shared memory), then O += P_{j-1} V_{j-1} (P from registers, V MN-major); wait for S
//   only, release K_j; mask (only tiles that reach past the block's first position), online
//   softmax in base 2 on S (the product of P V in flight meanwhile); wait for P V, release V_{j-1},
//   rescale O, pack S into P (bf16, the m16k16 A fragments). After the last tile, the last P V.
//   S, O: 64 fp32 a thread each, P: 32 registers. Row sums stay per thread until the end.
//   Ping-pong: the two consumer warpgroups issue their products in turns (named barriers 1 and
//   2), so one warpgroup's softmax runs while the tensor cores work through the other's products.
// Epilogue: O / l from registers into out (bf16 pairs), rows past n skipped.
// Preconditions (engine/cu/hopper.py, HopperAttention.covers): head_dim 128, GROUP in 1, 2, 4, 8,
//   block_size a multiple of 8 that divides FA_KT or a multiple of it, 16-byte aligned q and
//   cache, the two tensor maps encoded as above (passed by value, __grid_constant__).
// Compile-time: GROUP, FA_PVN (128: P V as one n128 wgmma per k16 step; 64: two n64), FA_STAGES (2
//   or 3), FA_PINGPONG (1: the turns above; 0: the warpgroups issue as they come).

#ifndef GROUP
#error "GROUP is defined by engine/cu/hopper.py"
#endif
#ifndef FA_PVN
#define FA_PVN 128
#endif
#define FA_D 128
#define FA_BM 128
#define FA_KT 128
#define FA_PB (FA_BM / GROUP)
#ifndef FA_STAGES
#define FA_STAGES 3
#endif
#ifndef FA_PINGPONG
#define FA_PINGPONG 1
#endif
#define FA_THREADS 384
#define FA_Q_BYTES (FA_BM * FA_D * 2)
#define FA_TILE_BYTES (FA_KT * FA_D * 2)
static_assert(FA_BM % GROUP == 0, "GROUP divides the block's 128 rows");

// Named barriers 1 and 2 (0 is __syncthreads): the two consumer warpgroups take turns issuing.
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// One block's work: query positions p0 .. p0 + FA_PB - 1 of a span of n rows (positions start ..),
// KV head blockIdx.x; its q rows at row q_row0 + p0 of the q map, its out rows from ``out`` (the span's).
__device__ __forceinline__ void attn_block(const TmaMap* tmQ_, const TmaMap* tmKV_, const int* __restrict__ block_table,
                                           int block_size, int block_rows, int KVH, int n, int start, int p0,
                                           int q_row0, float scale_log2, bf16* __restrict__ out) {
    const TmaMap &tmQ = *tmQ_, &tmKV = *tmKV_;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    bf16* sQ = reinterpret_cast<bf16*>(smem);         // [2][FA_BM][64]
    bf16* sK = sQ + FA_BM * FA_D;                     // [FA_STAGES][2][FA_KT][64]
    bf16* sV = sK + FA_STAGES * FA_KT * FA_D;         // [FA_STAGES][2][FA_KT][64]
    uint64_t* bars = reinterpret_cast<uint64_t*>(sV + FA_STAGES * FA_KT * FA_D);
    uint64_t *qfull = bars, *kfull = bars + 1, *kempty = kfull + FA_STAGES;
    uint64_t *vfull = kempty + FA_STAGES, *vempty = vfull + FA_STAGES;

    const int kh = blockIdx.x;
    const int nkeys = start + min(p0 + FA_PB, n), ntiles = (nkeys + FA_KT - 1) / FA_KT;
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        mbar_init(qfull, 1);
        for (int s = 0; s < FA_STAGES; s++) {
            mbar_init(&kfull[s], 1);
            mbar_init(&vfull[s], 1);
            mbar_init(&kempty[s], 2);
            mbar_init(&vempty[s], 2);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {  // producer: warp 0, lane i reads page i's block-table entry and issues its copies
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
        if (tid < 32) {
            const int lane = tid, R = min(block_size, FA_KT), pages = FA_KT / R;
            if (lane == 0) {
                mbar_expect_tx(qfull, FA_Q_BYTES);
                tma_load_3d(sQ, &tmQ, qfull, 0, kh * GROUP, q_row0 + p0);
                tma_load_3d(sQ + FA_BM * 64, &tmQ, qfull, 64, kh * GROUP, q_row0 + p0);
            }
            for (int j = 0; j < ntiles; j++) {
                const int s = j % FA_STAGES, ph = (j / FA_STAGES) & 1, t = j * FA_KT + lane * R;
                int row = 0, head = KVH;  // past the last key: KV head out of range, zero-filled
                if (lane < pages && t < nkeys) {
                    row = block_table[t / block_size] * block_rows + t % block_size;  // in flight over the wait
                    head = kh;
                }
                bf16* dk = sK + s * FA_KT * FA_D + lane * R * 64;
                bf16* dv = sV + s * FA_KT * FA_D + lane * R * 64;
                mbar_wait(&kempty[s], ph ^ 1);
                if (lane == 0) mbar_expect_tx(&kfull[s], FA_TILE_BYTES);
                __syncwarp();
                if (lane < pages) {
                    tma_load_3d(dk, &tmKV, &kfull[s], 0, head, row);
                    tma_load_3d(dk + FA_KT * 64, &tmKV, &kfull[s], 64, head, row);
                }
                mbar_wait(&vempty[s], ph ^ 1);
                if (lane == 0) mbar_expect_tx(&vfull[s], FA_TILE_BYTES);
                __syncwarp();
                if (lane < pages) {
                    tma_load_3d(dv, &tmKV, &vfull[s], 0, head, row + block_size);
                    tma_load_3d(dv + FA_KT * 64, &tmKV, &vfull[s], 64, head, row + block_size);
                }
            }
        }
    } else {  // consumers: warpgroup wg owns rows (wg - 1) * 64 .. + 63 of the block
        asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
        const int c = wg - 1, warp = tid / 32, lane = tid % 32;
        float s[64], o[64];
        uint32_t p[32];
#pragma unroll
        for (int i = 0; i < 64; i++) o[i] = 0.f;
#pragma unroll
        for (int i = 0; i < 32; i++) p[i] = 0u;
        float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
        const int r0 = c * 64 + warp * 16 + lane / 4;              // this thread's rows: r0, r0 + 8
        const int qp[2] = {start + p0 + r0 / GROUP, start + p0 + (r0 + 8) / GROUP};
        const int first_masked = start + p0;                        // tiles ending past it need the mask
        const bf16* qa = sQ + c * 64 * 64;
        mbar_wait(qfull, 0);
        if (FA_PINGPONG && c == 1) named_arrive(1, 256);  // warpgroup 1 issues first

        for (int j = 0; j < ntiles; j++) {
            const int st = j % FA_STAGES, ph = (j / FA_STAGES) & 1, pst = (j + FA_STAGES - 1) % FA_STAGES;
            const uint64_t dq = sw128_desc(qa), dk = sw128_desc(sK + st * FA_KT * FA_D);
            const uint64_t dv = sw128_mn_desc(sV + pst * FA_KT * FA_D, FA_PVN == 128 ? FA_KT * 128 : 1024);
            mbar_wait(&kfull[st], ph);
            if (j > 0) mbar_wait(&vfull[pst], ((j - 1) / FA_STAGES) & 1);
#pragma unroll
            for (int i = 0; i < 32; i++) reg_fence(p[i]);
            if (FA_PINGPONG) named_sync(1 + c, 256);  // my turn: the other warpgroup's products are queued before mine
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < FA_D / 16; kk++)  // + bytes >> 4: the descriptors' start address field
                wgmma_n128(s, dq + ((kk / 4) * FA_BM * 128 + (kk % 4) * 32) / 16,
                           dk + ((kk / 4) * FA_KT * 128 + (kk % 4) * 32) / 16, kk);
            wgmma_commit();
            if (j > 0) {
#pragma unroll
                for (int kk = 0; kk < FA_KT / 16; kk++) {
#if FA_PVN == 128
                    wgmma_rs_n128_t(o, &p[4 * kk], dv + kk * 2048 / 16);
#else
                    wgmma_rs_n64_t(o, &p[4 * kk], dv + kk * 2048 / 16);
                    wgmma_rs_n64_t(o + 32, &p[4 * kk], dv + (FA_KT * 128 + kk * 2048) / 16);
#endif
                }
            }
            wgmma_commit();  // (empty for j = 0) the waits below stay unconditional, as ptxas needs
            if (FA_PINGPONG) named_arrive(2 - c, 256);  // the other's turn
            wgmma_wait<1>();
#pragma unroll
            for (int i = 0; i < 64; i++) reg_fence(s[i]);
            if (tid == 0) mbar_arrive(&kempty[st]);

            // s[4jj + 2h + e]: row r0 + 8h, key j * FA_KT + 8jj + 2 * (lane % 4) + e
            const int k0 = j * FA_KT;
            if (k0 + FA_KT - 1 > first_masked) {
#pragma unroll
                for (int jj = 0; jj < FA_KT / 8; jj++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int key = k0 + 8 * jj + 2 * (lane % 4) + (e & 1);
                        if (key > qp[e >> 1]) s[4 * jj + e] = -INFINITY;
                    }
            }
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int jj = 0; jj < FA_KT / 8; jj++)
#pragma unroll
                for (int e = 0; e < 4; e++) mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * jj + e]);
            float corr[2], mneg[2], rs[2] = {0.f, 0.f};
#pragma unroll
            for (int i = 0; i < 2; i++) {
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 1));
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 2));
                const float mnew = fmaxf(mrow[i], mx[i] * scale_log2);
                const float msafe = mnew == -INFINITY ? 0.f : mnew;  // nothing seen yet: p = 0, no NaN
                corr[i] = ex2(mrow[i] - msafe);
                mrow[i] = mnew;
                mneg[i] = -msafe;
            }
#pragma unroll
            for (int jj = 0; jj < FA_KT / 8; jj++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float v = ex2(fmaf(s[4 * jj + e], scale_log2, mneg[e >> 1]));
                    s[4 * jj + e] = v;
                    rs[e >> 1] += v;
                }
            wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < 64; i++) reg_fence(o[i]);
            if (j > 0 && tid == 0) mbar_arrive(&vempty[pst]);
#pragma unroll
            for (int i = 0; i < 2; i++) lrow[i] = lrow[i] * corr[i] + rs[i];
#pragma unroll
            for (int jj = 0; jj < 16; jj++) {
                o[4 * jj] *= corr[0];
                o[4 * jj + 1] *= corr[0];
                o[4 * jj + 2] *= corr[1];
                o[4 * jj + 3] *= corr[1];
            }
            // P fragments of k16 step kk: keys 16kk..16kk+15 = accumulator groups jj = 2kk, 2kk + 1
#pragma unroll
            for (int kk = 0; kk < FA_KT / 16; kk++) {
                p[4 * kk] = pack_bf162(s[8 * kk], s[8 * kk + 1]);
                p[4 * kk + 1] = pack_bf162(s[8 * kk + 2], s[8 * kk + 3]);
                p[4 * kk + 2] = pack_bf162(s[8 * kk + 4], s[8 * kk + 5]);
                p[4 * kk + 3] = pack_bf162(s[8 * kk + 6], s[8 * kk + 7]);
            }
        }
        {  // the last tile's P V
            const int lst = (ntiles - 1) % FA_STAGES;
            mbar_wait(&vfull[lst], ((ntiles - 1) / FA_STAGES) & 1);
            const bf16* vb = sV + lst * FA_KT * FA_D;
#pragma unroll
            for (int i = 0; i < 32; i++) reg_fence(p[i]);
#pragma unroll
            for (int i = 0; i < 64; i++) reg_fence(o[i]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < FA_KT / 16; kk++) {
#if FA_PVN == 128
                wgmma_rs_n128_t(o, &p[4 * kk], sw128_mn_desc(vb + kk * 16 * 64, FA_KT * 128));
#else
                wgmma_rs_n64_t(o, &p[4 * kk], sw128_mn_desc(vb + kk * 16 * 64, 1024));
                wgmma_rs_n64_t(o + 32, &p[4 * kk], sw128_mn_desc(vb + FA_KT * 64 + kk * 16 * 64, 1024));
#endif
            }
            wgmma_commit();
            wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < 64; i++) reg_fence(o[i]);
            if (tid == 0) mbar_arrive(&vempty[lst]);
        }
        if (FA_PINGPONG && c == 0) named_sync(1, 256);  // takes warpgroup 1's last turn, so every arrival is waited for

        const int H = KVH * GROUP;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            lrow[i] += __shfl_xor_sync(FULL_MASK, lrow[i], 1);
            lrow[i] += __shfl_xor_sync(FULL_MASK, lrow[i], 2);
            const int r = r0 + 8 * i, pos = p0 + r / GROUP;
            if (pos >= n) continue;
            const float inv = 1.f / lrow[i];
            bf16* dst = out + ((size_t)pos * H + kh * GROUP + r % GROUP) * FA_D + 2 * (lane % 4);
#pragma unroll
            for (int jj = 0; jj < 16; jj++)
                *reinterpret_cast<uint32_t*>(dst + 8 * jj) = pack_bf162(o[4 * jj + 2 * i] * inv, o[4 * jj + 2 * i + 1] * inv);
        }
    }
}

extern "C" __global__ void __launch_bounds__(FA_THREADS, 1)
    prefill_attn_hopper(const __grid_constant__ TmaMap tmQ, const __grid_constant__ TmaMap tmKV,
                        const int* __restrict__ block_table, int block_size, int block_rows, int KVH, int n,
                        int start, float scale_log2, bf16* __restrict__ out) {
    const int p0 = (gridDim.y - 1 - blockIdx.y) * FA_PB;
    attn_block(&tmQ, &tmKV, block_table, block_size, block_rows, KVH, n, start, p0, 0, scale_log2, out);
}

// The spans of a prefill pass in one launch (each as prefill_attn_hopper alone computes it: the same
// bits). spans int32 [num_spans][4] = (first row among the pass's q / out rows, n, start, first entry
// of its block table in block_tables). Grid (KVH, the spans' position blocks summed): blockIdx.y walks
// span by span, each span's last (heaviest) block first. tmQ maps the pass's q rows whole; a span's
// last block may read the next span's rows past its own end, whose results are dropped as rows past
// n are (a row's attention reads only its own q row).
extern "C" __global__ void __launch_bounds__(FA_THREADS, 1)
    prefill_attn_hopper_spans(const __grid_constant__ TmaMap tmQ, const __grid_constant__ TmaMap tmKV,
                              const int* __restrict__ block_tables, const int4* __restrict__ spans, int num_spans,
                              int block_size, int block_rows, int KVH, float scale_log2, bf16* __restrict__ out) {
    int y = blockIdx.y, i = 0;
    int4 sp = spans[0];
    int nb = (sp.y + FA_PB - 1) / FA_PB;
    while (y >= nb && i + 1 < num_spans) {
        y -= nb;
        sp = spans[++i];
        nb = (sp.y + FA_PB - 1) / FA_PB;
    }
    if (y >= nb) return;  // a grid wider than the spans' blocks (never launched so)
    attn_block(&tmQ, &tmKV, block_tables + sp.w, block_size, block_rows, KVH, sp.y, sp.z, (nb - 1 - y) * FA_PB, sp.x,
               scale_log2, out + (size_t)sp.x * KVH * GROUP * FA_D);
}
