// gemm.cu: tensor-core GEMM for prefill chunks (mma.sync m16n8k16 bf16, fp32 accumulate).
//
// C[m, n] (+)= sum_k A[m, k] * W[n, k] (+ bias[n])
//   A bf16 [M, K] row-major (activations), W bf16 [N, K] (torch Linear layout, i.e. the
//   "col" operand of mma.row.col), bias fp32 [N] or null, C fp32 [M, ldc];
//   accumulate != 0 adds into C (the fused residual add).
// Tiles: 128 x 128 x 32 per block of GEMM_THREADS = 256 threads (8 warps as 2 x 4, 64 x 32 each:
//   4 x 4 mma tiles). A 3-stage cp.async pipeline fills shared memory whose rows are
//   padded to 40 bf16 (80 bytes) so ldmatrix's 8 row addresses hit distinct banks.
//   Out-of-range rows / k are zero-filled (cp.async src-size 0), so any M, N work.
// Grid (ceil(M/128), ceil(N/128)): blockIdx.x walks M fastest, so the blocks resident at
//   once share one W tile and each weight byte comes from HBM about once.
// Dynamic shared memory: GEMM_SMEM bytes (the wrapper raises the limit past 48 KB).
// Preconditions (wrapper): K % 8 == 0, 16-byte aligned pointers, ldc even.

#define BM 128
#define BN 128
#define BK 32
#define LDS 40
#define STAGES 3
#ifndef GEMM_THREADS
#error "GEMM_THREADS is defined by engine/cu/kernels.py"
#endif
static_assert(GEMM_THREADS == 256, "gemm_bf16: 8 warps as 2 x 4");

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    gemm_bf16(const bf16* __restrict__ A, const bf16* __restrict__ W, const float* __restrict__ bias,
              float* __restrict__ C, int M, int N, int K, int ldc, int accumulate) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* sA = reinterpret_cast<bf16*>(smem_raw);
    bf16* sB = sA + STAGES * BM * LDS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp >> 2, wn = warp & 3;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    const int KT = (K + BK - 1) / BK;
    auto load_stage = [&](int stage, int k0) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int idx = tid + i * GEMM_THREADS, row = idx >> 2, ch = idx & 3;
            const int gk = k0 + ch * 8;
            const int gm = m0 + row, gn = n0 + row;
            const bool oka = gm < M && gk < K, okb = gn < N && gk < K;
            cp_async16(&sA[(stage * BM + row) * LDS + ch * 8], A + (size_t)(oka ? gm : 0) * K + (oka ? gk : 0),
                       oka ? 16 : 0);
            cp_async16(&sB[(stage * BN + row) * LDS + ch * 8], W + (size_t)(okb ? gn : 0) * K + (okb ? gk : 0),
                       okb ? 16 : 0);
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < KT) load_stage(s, s * BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int nk = kt + STAGES - 1;
        if (nk < KT) load_stage(nk % STAGES, nk * BK);
        cp_async_commit();
        const bf16* a_st = sA + (kt % STAGES) * BM * LDS;
        const bf16* b_st = sB + (kt % STAGES) * BN * LDS;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[4][4], bfr[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
                ldmatrix_x4(af[mi], a_st + (wm * 64 + mi * 16 + (lane & 15)) * LDS + kk + (lane >> 4) * 8);
#pragma unroll
            for (int nj = 0; nj < 2; nj++) {
                uint32_t r[4];
                ldmatrix_x4(r, b_st + (wn * 32 + nj * 16 + (lane & 7) + (lane >> 4) * 8) * LDS + kk +
                                   ((lane >> 3) & 1) * 8);
                bfr[2 * nj][0] = r[0];
                bfr[2 * nj][1] = r[1];
                bfr[2 * nj + 1][0] = r[2];
                bfr[2 * nj + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int ni = 0; ni < 4; ni++) mma_bf16(acc[mi][ni], af[mi], bfr[ni][0], bfr[ni][1]);
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++) {
            const int col = n0 + wn * 32 + ni * 8 + (lane & 3) * 2;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = m0 + wm * 64 + mi * 16 + (lane >> 2) + h * 8;
                if (row >= M) continue;
                float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
                float* c = C + (size_t)row * ldc + col;
                if (col + 1 < N) {
                    if (bias) { v0 += bias[col]; v1 += bias[col + 1]; }
                    if (accumulate) { const float2 o = *reinterpret_cast<float2*>(c); v0 += o.x; v1 += o.y; }
                    *reinterpret_cast<float2*>(c) = make_float2(v0, v1);
                } else if (col < N) {
                    if (bias) v0 += bias[col];
                    *c = accumulate ? *c + v0 : v0;
                }
            }
        }
}
