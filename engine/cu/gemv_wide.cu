// gemv_wide.cu: gemv_tc (gemv.cu) for the wide rounds, 9..64 activation rows, with x read once a
// block of 128 weight rows instead of once per 16.
//
// Why: gemv_tc's 16-row block reads all M rows of x over its K, so a round moves M / 16 times its
// weight bytes of x out of L2 (4x at 64 rows, ~60 GB a round on the Llama-3.1-8B shape), and past
// 16 rows the round grows with its rows (docs/CUDA.md). Here a block is 8 warps = 8 tiles of 16
// weight rows; warp w owns tile w and computes for its 16 rows exactly what gemv_tc's 8 warps
// compute between them: slice sl (0..7) is the K steps sl, sl + 8, sl + 16, .. in increasing order
// (gemv_tc's warp sl), each step's two W chunks against each group of 8 x rows through the same
// tc_step, in the same order; a slice's sums are added to the tile's total in slice order,
// starting from 0 (gemv_tc's epilogue sum over its warps). So every output has gemv_tc's bits, at
// any width (tests/kernels/test_cuda_gemv_wide.py compares them bitwise). The 8 warps walk the
// steps together, slice after slice, so one shared-memory stage holds a step's 8 tiles of W
// (128 rows x 128 bytes) and its x chunk (the round's rows x 128 bytes), copied by cp.async with
// TCW_NS stages in flight (zero-filled past N, M and K, as gemv_tc's predicated loads). Chunk c of
// stage row r sits at 16-byte slot c ^ 4 (r & 1) so a quarter warp's rows g, g + 1 hit other banks.
// The epilogue runs per warp from its registers with gemv_tc_epilogue's operations in its orders
// (the norm scale of a row by one warp's strided sum and warp_sum, the ss_out partial of a tile by
// the same pairing tree); rows' norm scales are computed once a block.
//
// Compiled after common.cuh and gemv.cu (GEMV_EPILOGUES_ONLY: tc_step, TcNorm, TcRope, the EPI codes).
// Compile-time: TC_THREADS (256), TCW_NS. Launch: grid ceil(N / 128), dynamic shared memory
// TCW_NS x (128 + 8 G) x 128 bytes (engine/cu/kernels.py WIDE_SMEM).

#ifndef TCW_NS
#define TCW_NS 4
#endif
#define TCW_TILES 8
#define TCW_ROWS (TCW_TILES * TC_ROWS)
static_assert(TC_THREADS == 32 * TCW_TILES, "gemv_tcw: a warp a tile");

__device__ __forceinline__ int tcw_slot(int r, int c) { return r * 8 + (c ^ ((r & 1) << 2)); }

// Stage: step s's chunks of the block's 128 W rows, then of x rows 0 .. 8 gm - 1 (gm groups in use).
__device__ __forceinline__ void tcw_issue(uint4* stage, const uint4* W4, const uint4* x4, int n_start, int M, int gm,
                                          int N, int K8, int s) {
    const int rows = TCW_ROWS + 8 * gm;
    for (int i = threadIdx.x; i < rows * 8; i += TC_THREADS) {
        const int r = i >> 3, c = i & 7, ch = s * 8 + c;
        bool ok;
        const uint4* src;
        if (r < TCW_ROWS) {
            ok = n_start + r < N && ch < K8;
            src = W4 + (ok ? (size_t)(n_start + r) * K8 + ch : 0);
        } else {
            const int m = r - TCW_ROWS;
            ok = m < M && ch < K8;
            src = x4 + (ok ? (size_t)m * K8 + ch : 0);
        }
        cp_async16(stage + tcw_slot(r, c), src, ok ? 16 : 0);
    }
}

template <int G>
__device__ __forceinline__ void tcw_compute(const uint4* stage, float (*c)[4], int M) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int ra = warp * TC_ROWS + g, rb = ra + 8;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const uint4 wa = stage[tcw_slot(ra, t + 4 * h)], wb = stage[tcw_slot(rb, t + 4 * h)];
#pragma unroll
        for (int j = 0; j < G; j++)
            if (j == 0 || 8 * j < M) tc_step(c[j], wa, wb, stage[tcw_slot(TCW_ROWS + 8 * j + g, t + 4 * h)]);
    }
}

// tot[j]: this warp's tile totals for x rows 8j .. 8j + 7 (mma accumulator layout).
template <int G>
__device__ __forceinline__ void gemv_tcw_main(const bf16* __restrict__ x, const bf16* __restrict__ W, int M, int N,
                                              int K, float (*tot)[4]) {
    extern __shared__ __align__(16) uint4 tcw_smem[];
    constexpr int STAGE = (TCW_ROWS + 8 * G) * 8;  // 16-byte slots a stage
    const int K8 = K >> 3, steps = (K8 + 7) / 8, n_start = blockIdx.x * TCW_ROWS, gm = (M + 7) >> 3;
    const uint4* W4 = reinterpret_cast<const uint4*>(W);
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    float c[G][4];
#pragma unroll
    for (int j = 0; j < G; j++) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
    // Steps slice-major: slice sl's steps sl, sl + 8, ..; then slice sl + 1 (an empty slice only at the end).
    // GEMV_KS 1 (gemv_tc's contiguous order): slice sl is steps [sl S8, (sl + 1) S8), so the stages walk
    // K in address order and a slice ends every S8 steps.
    const int spw = (steps + 7) / 8;
    int isl = 0, is = 0, csl = 0, cs = 0;
    for (int p = 0; p < TCW_NS - 1; p++) {
        if (p < steps) {
            tcw_issue(tcw_smem + p * STAGE, W4, x4, n_start, M, gm, N, K8, GEMV_KS ? p : is);
            is += 8;
            if (is >= steps) is = ++isl;
        }
        cp_async_commit();
    }
    for (int q = 0; q < steps; q++) {
        cp_async_wait<TCW_NS - 2>();
        __syncthreads();  // stage q landed for every thread; stage q - 1 is free to refill
        if (q + TCW_NS - 1 < steps) {
            tcw_issue(tcw_smem + ((q + TCW_NS - 1) % TCW_NS) * STAGE, W4, x4, n_start, M, gm, N, K8,
                      GEMV_KS ? q + TCW_NS - 1 : is);
            is += 8;
            if (is >= steps) is = ++isl;
        }
        cp_async_commit();
        tcw_compute<G>(tcw_smem + (q % TCW_NS) * STAGE, c, M);
        cs += 8;
        if (GEMV_KS ? (q + 1) % spw == 0 || q + 1 == steps : cs >= steps) {  // slice csl done: its sums join the total in slice order
#pragma unroll
            for (int j = 0; j < G; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    tot[j][e] += c[j][e];
                    c[j][e] = 0.f;
                }
            cs = ++csl;
        }
    }
    cp_async_wait<0>();
}

// The tile's ss partial for one x row from q (h^2 of rows g and g + 8 of lane (g, t)): gemv_tc's
// tree, ((s0 + s1) + s2) + s3 with s_w = (q_4w + q_4w+1) + (q_4w+2 + q_4w+3); lanes g = 0 hold it.
__device__ __forceinline__ float tcw_ss(float q_lo, float q_hi) {
    q_lo += __shfl_xor_sync(FULL_MASK, q_lo, 4);
    q_hi += __shfl_xor_sync(FULL_MASK, q_hi, 4);
    q_lo += __shfl_xor_sync(FULL_MASK, q_lo, 8);
    q_hi += __shfl_xor_sync(FULL_MASK, q_hi, 8);
    const float s1 = __shfl_xor_sync(FULL_MASK, q_lo, 16), s3 = __shfl_xor_sync(FULL_MASK, q_hi, 16);
    return ((q_lo + s1) + q_hi) + s3;
}

template <int G, int EPI>
__device__ __forceinline__ void gemv_tcw_epilogue(float (*tot)[4], const float* __restrict__ bias,
                                                  void* __restrict__ out, int M, int N, int K, int ldo,
                                                  const TcNorm& nm, const TcRope& rp) {
    __shared__ float rs[8 * G];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if (nm.ss_in != nullptr) {
        for (int m = warp; m < M; m += TCW_TILES) {  // row m's scale, as gemv_tc's warp m of its group
            float ss = 0.f;
            for (int p = lane; p < nm.ss_nparts; p += 32) ss += nm.ss_in[(size_t)m * nm.ss_nparts + p];
            ss = warp_sum(ss);
            if (lane == 0) rs[m] = rsqrtf(ss / K + nm.eps);
        }
    }
    __syncthreads();
    const int n0 = blockIdx.x * TCW_ROWS + warp * TC_ROWS;
    if (n0 >= N) return;  // a tile wholly past N (warp-uniform; no block barrier after this)
#pragma unroll
    for (int j = 0; j < G; j++) {
        if (8 * j >= M) break;
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int m = 8 * j + 2 * t + e;
            float a = tot[j][e], b = tot[j][2 + e];  // rows n0 + g, n0 + g + 8
            if constexpr (EPI == EPI_SWIGLU || EPI == EPI_GEGLU) {
                if (m < M && n0 + g + 8 < N) {
                    if (nm.ss_in != nullptr) {
                        a *= rs[m];
                        b *= rs[m];
                    }
                    const float act = EPI == EPI_SWIGLU ? a / (1.f + expf(-a)) : gelu_tanh(a);
                    static_cast<bf16*>(out)[(size_t)m * ldo + (n0 >> 1) + g] = __float2bfloat16(act * b);
                }
            } else if constexpr (EPI == EPI_ROPE_KV) {
                if (m < M) {
                    if (nm.ss_in != nullptr) {
                        a *= rs[m];
                        b *= rs[m];
                    }
                    if (bias) {
                        a += bias[n0 + g];
                        b += bias[n0 + g + 8];
                    }
                    rope_kv_store(a, b, m, g, n0, rp, out);
                }
            } else {  // store / acc, with nw the next norm's xw and ss partial
                float q[2] = {0.f, 0.f};
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int n = n0 + g + 8 * hf;
                    if (m < M && n < N) {
                        float v = hf ? b : a;
                        if (nm.ss_in != nullptr) v *= rs[m];
                        if (bias) v += bias[n];
                        float* o = static_cast<float*>(out) + (size_t)m * ldo + n;
                        const float h = EPI == EPI_ACC ? *o + v : v;
                        *o = h;
                        if (nm.nw != nullptr) {
                            nm.xw[(size_t)m * N + n] = __float2bfloat16(h * __bfloat162float(nm.nw[n]));
                            q[hf] = h * h;
                        }
                    }
                }
                if (nm.nw != nullptr) {
                    const float ss = tcw_ss(q[0], q[1]);
                    const int nparts = (N + TC_ROWS - 1) / TC_ROWS;
                    if (g == 0 && m < M) nm.ss_out[(size_t)m * nparts + n0 / TC_ROWS] = ss;
                }
            }
        }
    }
}

template <int G, int EPI>
__device__ __forceinline__ void gemv_tcw_body(const bf16* __restrict__ x, const bf16* __restrict__ W,
                                              const float* __restrict__ bias, void* __restrict__ out, int M, int N,
                                              int K, int ldo, const TcNorm& nm, const TcRope& rp) {
    float tot[G][4];
#pragma unroll
    for (int j = 0; j < G; j++) tot[j][0] = tot[j][1] = tot[j][2] = tot[j][3] = 0.f;
    gemv_tcw_main<G>(x, W, M, N, K, tot);
    gemv_tcw_epilogue<G, EPI>(tot, bias, out, M, N, K, ldo, nm, rp);
}

#define GEMV_TCW_LINEAR(NAME, G, EPI)                                                                         \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, 2)                                              \
        NAME(const bf16* x, const bf16* W, const float* bias, float* out, int M, int N, int K, int ldo,       \
             const float* ss_in, int ss_nparts, float eps, const bf16* nw, bf16* xw, float* ss_out) {         \
        const TcNorm nm{ss_in, ss_nparts, eps, nw, xw, ss_out};                                              \
        const TcRope rp{};                                                                                   \
        gemv_tcw_body<G, EPI>(x, W, bias, out, M, N, K, ldo, nm, rp);                                        \
    }
#define GEMV_TCW_SWIGLU(NAME, G, EPI)                                                                         \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, 2)                                              \
        NAME(const bf16* x, const bf16* W, bf16* out, int M, int N, int K, int ldo, const float* ss_in,       \
             int ss_nparts, float eps) {                                                                     \
        const TcNorm nm{ss_in, ss_nparts, eps, nullptr, nullptr, nullptr};                                   \
        const TcRope rp{};                                                                                   \
        gemv_tcw_body<G, EPI>(x, W, nullptr, out, M, N, K, ldo, nm, rp);                                     \
    }
#define GEMV_TCW_ROPE(NAME, G)                                                                                \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, 2)                                              \
        NAME(const bf16* x, const bf16* W, const float* bias, bf16* out, int M, int N, int K, int ldo,        \
             const float* ss_in, int ss_nparts, float eps, const int* positions, const int* slots,            \
             const float* inv_freq, bf16* cache, int H, int KVH, int D, int block_size, long long block_stride, \
             int rotary_dim, float rope_factor) {                                                             \
        const TcNorm nm{ss_in, ss_nparts, eps, nullptr, nullptr, nullptr};                                   \
        const TcRope rp{positions, slots, inv_freq, cache, H, KVH, D, block_size, block_stride, rotary_dim,  \
                        rope_factor};                                                                        \
        gemv_tcw_body<G, EPI_ROPE_KV>(x, W, bias, out, M, N, K, ldo, nm, rp);                                \
    }
#define GEMV_TCW_VARIANTS(G)                                  \
    GEMV_TCW_LINEAR(gemv_tcw_store_g##G, G, EPI_STORE)        \
    GEMV_TCW_LINEAR(gemv_tcw_acc_g##G, G, EPI_ACC)            \
    GEMV_TCW_SWIGLU(gemv_tcw_swiglu_g##G, G, EPI_SWIGLU)      \
    GEMV_TCW_SWIGLU(gemv_tcw_geglu_g##G, G, EPI_GEGLU)        \
    GEMV_TCW_ROPE(gemv_tcw_rope_g##G, G)
GEMV_TCW_VARIANTS(2)
GEMV_TCW_VARIANTS(4)
GEMV_TCW_VARIANTS(8)
