// gemv_pair.cu: gemv.cu's wide variants (9..64 activation rows) in blocks of two 16-row tiles that
// share x through shared memory (CudaTuning.gemv_pair, engine/cu/kernels.py PAIR_TUNING).
//
// A block of 512 threads is two gemv_tc blocks side by side: group p (threads 256 p ..) owns tile
// 2 blockIdx.x + p and runs gemv_tc_main's warps, K split and tc_step order, so every output has
// gemv_tc's bits (tests/kernels/test_cuda_gemv_wide.py compares them bitwise). What changes is
// where x comes from. gemv_tc's block reads all M rows of x over its K from L2, so a 16-row tile
// moves M / 16 times its weight bytes of x out of L2 (2.5x at 40 rows); past 16 rows the wide
// GEMVs all ran at about the same ~7 TB/s of weights plus x out of L2 (docs/CUDA.md), the L2's
// bandwidth, not DRAM's. Here warp w of both groups (they take the same K steps) share one copy of
// each batch's x chunks in shared memory: the pair's 64 threads copy it with cp.async (zero-filled
// past M and K, as gemv_tc's predicated loads) into one of two buffers, meet at a named barrier
// (bar.sync 1 + w, 64 threads), issue the next batch's copy into the other buffer and multiply
// from this one; the weights still stream straight into registers. So x leaves L2 once per 32
// weight rows instead of per 16. A buffer holds a batch's U steps x 2 halves x G groups x 32
// chunks of 16 bytes, in the order the warp reads them (a read is 512 contiguous bytes). Dynamic
// shared memory: 8 pairs x 2 buffers x that (kernels.py pair_smem). Launch: 512 threads, grid
// ceil(ceil(N / 16) / 2); an odd last tile's group runs with no rows (its loads off, no writes).
//
// Compiled after common.cuh and gemv.cu (GEMV_EPILOGUES_ONLY, GEMV_PAIR: gemv_tc_body's PAIR 2 path,
// gemv_tc_epilogue, the entry macros). Compile-time: TC_THREADS (256), P16_U, P32_U, P64_U (steps
// in flight; x takes no registers here, the buffers take U G 16 KB).

__device__ __forceinline__ void bar_pair(int id) { asm volatile("bar.sync %0, 64;" ::"r"(id) : "memory"); }

template <int U, int G>
__device__ __forceinline__ void gemv_tc_main_pair(const bf16* __restrict__ x, const bf16* __restrict__ W, int M,
                                                  int N, int K, float (*c)[4], uint4* xring) {
    const int grp = threadIdx.x >> 8, warp = (threadIdx.x >> 5) & 7, lane = threadIdx.x & 31, g = lane >> 2,
              t = lane & 3;
    const int n0 = (2 * blockIdx.x + grp) * TC_ROWS;
    const int K8 = K >> 3;
    const uint4* W4 = reinterpret_cast<const uint4*>(W);
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    const bool ra = n0 + g < N, rb = n0 + g + 8 < N;
    const uint4* wa_p = W4 + (size_t)(ra ? n0 + g : 0) * K8;
    const uint4* wb_p = W4 + (size_t)(rb ? n0 + g + 8 : 0) * K8;
    const int steps = (K8 + 7) / 8;
    const int spw = (steps + 7) / 8;
    const int s_first = GEMV_KS ? warp * spw : warp, s_end = GEMV_KS ? min(steps, s_first + spw) : steps;
    constexpr int s_unit = GEMV_KS ? 1 : 8;
    constexpr int BATCH = U * 2 * G * 32;  // chunks of one batch's x
    uint4* ring = xring + warp * 2 * BATCH;
    const int gm = min(G, (M + 7) >> 3);  // groups in use
    // The pair's thread p = 32 grp + lane copies chunks p, p + 64, ..: chunk e is read by lane e % 32
    // (row 8 j + its g, chunk t + 4 h of step u) at ((u * 2 + h) G + j) = e / 32.
    auto fill = [&](uint4* buf, int s0) {
#pragma unroll
        for (int q = 0; q < U * G; q++) {
            const int slot = grp + 2 * q, j = slot % G, uh = slot / G, u = uh >> 1, h = uh & 1;
            if (j < gm) {
                const int s = s0 + u * s_unit, r = 8 * j + g, ch = s * 8 + t + 4 * h;
                const bool ok = s < s_end && ch < K8 && r < M;
                cp_async16(buf + slot * 32 + lane, x4 + (ok ? (size_t)r * K8 + ch : 0), ok ? 16 : 0);
            }
        }
        cp_async_commit();
    };
    int it = 0;
    for (int s0 = s_first; s0 < s_end; s0 += s_unit * U, it++) {
        uint4 wa[U][2], wb[U][2];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int s = s0 + u * s_unit;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int ch = s * 8 + t + 4 * h;
                const bool ok = s < s_end && ch < K8;
                wa[u][h] = ld_stream_if(wa_p + ch, ok && ra);
                wb[u][h] = ld_stream_if(wb_p + ch, ok && rb);
            }
        }
        if (it == 0) {  // the first weights are in flight; x is the kernel before's (PDL: wait for it)
            pdl_wait();
            pdl_launch_dependents();
            fill(ring, s0);
        }
        cp_async_wait<0>();  // this thread's copies of the batch
        bar_pair(1 + warp);  // the partner's too; and both are done with the other buffer's batch
        if (s0 + s_unit * U < s_end) fill(ring + ((it + 1) & 1) * BATCH, s0 + s_unit * U);
        const uint4* xb = ring + (it & 1) * BATCH;
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int j = 0; j < G; j++)
                    if (j == 0 || 8 * j < M) tc_step(c[j], wa[u][h], wb[u][h], xb[((u * 2 + h) * G + j) * 32 + lane]);
    }
    if (s_first >= s_end) {
        pdl_wait();
        pdl_launch_dependents();
    }
}

GEMV_TC_VARIANTS(_r16p, P16_U, 2, 1, 2)
GEMV_TC_VARIANTS(_r32p, P32_U, 4, 1, 2)
GEMV_TC_VARIANTS(_r64p, P64_U, 8, 1, 2)
