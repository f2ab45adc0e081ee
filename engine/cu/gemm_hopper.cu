// gemm_hopper.cu: the Hopper prefill GEMM (wgmma m64nNk16 bf16, fp32 accumulate, TMA, mbarriers).
//
// C[m, n] (+)= sum_k A[m, k] * W[n, k] (+ bias[n])   -- gemm.cu's contract, sm_90a only (and act below)
//   A bf16 [M, K] row-major (activations), W bf16 [N, K] (torch Linear layout), bias fp32 [N] or
//   null, C fp32 [M, ldc]; accumulate != 0 adds into C (the fused residual add).
// Tiles: BM x BN x 64 per block, BM = 64 * HG_NC (HG_NC consumer warpgroups of 64 rows each),
//   BN = HG_BN (32, 64, 128 or 256; 32 and 64 for a few rows: more blocks stream W). Block = 128 * (HG_NC + 1) threads: warpgroup 0 is the producer
//   (one thread issues the TMA copies; with 2 consumers setmaxnreg moves registers to them),
//   warpgroups 1..HG_NC each own 64 rows x BN columns of the tile in registers (BN / 2 fp32
//   a thread) and issue 4 wgmma m64nBNk16 per 64-wide k step, both operands from shared memory.
// Pipeline: HG_STAGES shared-memory stages of (BM + BN) x 64 bf16, each row 128 bytes with the
//   128-byte swizzle (TMA writes it, the wgmma descriptors read it: SBO 1024 bytes between
//   8-row groups, a k step of 16 advances the start address by 32 bytes). Stage s has two
//   mbarriers: full[s] (1 arrival + the bytes the TMA copies complete) and empty[s] (one
//   arrival per consumer warpgroup, after the wgmma reading it retired; the consumers arrive
//   once up front so the producer's first pass finds every stage empty). Parities flip each
//   pass over the ring; the counters run on across tiles. One wgmma batch stays in flight: a
//   stage is released when the next one's batch is committed and the earlier batch waited.
// Persistent: grid = min(tiles, SMs) blocks walk tiles t = blockIdx.x + i * gridDim.x; tiles go
//   in groups of HG_GROUP_M row blocks (row block fastest), so the blocks resident at once share
//   W tiles and A rows in L2. The producer runs ahead into the next tile while the consumers
//   write this one's epilogue straight from registers (float2 stores, bias, accumulate).
// act >= 0 (the gate|up product, W interleaved in 8-row groups as weights.interleave_gate_up lays
//   it out): C is bf16 [M, ldc] and gets act(gate) * up, the 8 gates of each 16-column group times
//   the 8 ups after them (act 0 silu, 1 gelu_tanh; no bias, no accumulate, N % 16 == 0), so the
//   fp32 gate|up round trip and norm.cu's swiglu launch are gone.
// Out of range rows / columns / k are zero-filled by the TMA (so any M, N and K % 8 == 0 work);
//   stores are guarded by row < M, col < N.
// HG_FP8 (the fp8 build, kernel gemm_hopper_fp8): A and W are float8_e4m3fn bytes ([M, K] and [N, K],
//   K % 16 == 0), a 128-byte smem row holds 128 of them (BK 128), and each 32-wide k step is one
//   wgmma m64nNk32 e4m3 x e4m3 -> fp32 (the same descriptors: a k step still advances 32 bytes).
//   Two more parameters scale the fp32 product before bias / act / accumulate: sa fp32 [M] (A's
//   per-row scales, quant_act.cu's quant_act_fp8) and sw fp32 [N] (W's per-output-channel scales,
//   the FP8 format's tail): C[m, n] = (sum_k A[m, k] W[n, k]) * (sa[m] * sw[n]).
//   HG_FP8 == 2 (kernel gemm_hopper_fp8b, tile-scaled weights, BN 128 only): a scale per 128-wide k
//   block on both sides, sa fp32 [M, KB] (quant_act_fp8_g128) and sw fp32 [N, KB] (the FP8B tail: a
//   row's tile scales, KB = ceil(K / 128)); a stage is one k block, its 4 wgmma steps go into a
//   second accumulator p (waited at once: no batch stays in flight) that joins d times
//   sa[m, kb] * sw[n, kb] on the CUDA cores, so the fp8 MMA's short accumulation spans 128 values.
// Dynamic shared memory: HG_STAGES * (BM + BN) * 128 + 1024 (alignment) + 256 (barriers).
// Preconditions (engine/cu/hopper.py): K % 8 == 0, A and W 16-byte aligned (TMA), C 8-byte
//   aligned and ldc even, the tensor maps encoded for A [M, K] box (64, BM) and W [N, K] box
//   (64, BN), bf16, 128-byte swizzle; passed by value (__grid_constant__).

#ifndef HG_NC
#error "HG_NC, HG_BN, HG_STAGES are defined by engine/cu/hopper.py"
#endif
#define BM (64 * HG_NC)
#define BN HG_BN
#ifdef HG_FP8
typedef uint8_t elem_t;
#define BK 128    // elements a 128-byte smem row
#define KSTEP 32  // elements a wgmma k step (32 bytes)
#if HG_FP8 == 2
#define GEMM_NAME gemm_hopper_fp8b
static_assert(HG_BN == 128, "tile scales: a 128-column tile (p and d both in registers)");
#else
#define GEMM_NAME gemm_hopper_fp8
#endif
#else
typedef bf16 elem_t;
#define BK 64
#define KSTEP 16
#define GEMM_NAME gemm_hopper
#endif
#define HG_THREADS (128 * (HG_NC + 1))
#define STAGE_BYTES ((BM + BN) * 128)
#ifndef HG_GROUP_M
#define HG_GROUP_M 16
#endif
static_assert(HG_NC == 1 || HG_NC == 2, "one or two consumer warpgroups");
static_assert(BN == 32 || BN == 64 || BN == 128 || BN == 256, "wgmma n32, n64, n128 or n256");

#ifdef HG_FP8
// e4m3 x e4m3 -> fp32, K 32 a step (hopper.cuh's generators; fp8 wgmma takes no transpose immediates)
WGMMA_SS_N128(wgmma_e4m3_n128, "k32.f32.e4m3.e4m3", ", 1, 1")
WGMMA_SS_N256(wgmma_e4m3_n256, "k32.f32.e4m3.e4m3", ", 1, 1")
#if BN == 256
#define WGMMA wgmma_e4m3_n256
#else
#define WGMMA wgmma_e4m3_n128
#endif
#else
#if BN == 256
#define WGMMA wgmma_n256
#elif BN == 128
#define WGMMA wgmma_n128
#elif BN == 64
#define WGMMA wgmma_n64
#else
#define WGMMA wgmma_n32
#endif
#endif

// silu(g) (act 0) or gelu_tanh(g) (act 1), as norm.cu's swiglu computes them.
__device__ __forceinline__ float gate_act(float g, int act) {
    return act ? 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) : g / (1.f + expf(-g));
}

// Tile t -> (row block, column block): groups of HG_GROUP_M row blocks, the row block fastest.
__device__ __forceinline__ void tile_coords(int t, int mt, int nt, int& mb, int& nb) {
    const int per_group = HG_GROUP_M * nt, g = t / per_group, first = g * HG_GROUP_M;
    const int size = min(mt - first, HG_GROUP_M), r = t - g * per_group;
    mb = first + r % size;
    nb = r / size;
}

extern "C" __global__ void __launch_bounds__(HG_THREADS, 1)
    GEMM_NAME(const __grid_constant__ TmaMap tmA, const __grid_constant__ TmaMap tmW,
              const float* __restrict__ bias, float* __restrict__ C, int M, int N, int K, int ldc, int accumulate,
              int act
#ifdef HG_FP8
              , const float* __restrict__ sa, const float* __restrict__ sw
#endif
    ) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);  // 128B swizzle: 1 KB aligned
    elem_t* sA = reinterpret_cast<elem_t*>(smem);  // [HG_STAGES][BM][BK]
    elem_t* sB = sA + HG_STAGES * BM * BK;         // [HG_STAGES][BN][BK]
    uint64_t* full = reinterpret_cast<uint64_t*>(sB + HG_STAGES * BN * BK);
    uint64_t* empty = full + HG_STAGES;

    const int mt = (M + BM - 1) / BM, nt = (N + BN - 1) / BN, tiles = mt * nt, KT = (K + BK - 1) / BK;
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < HG_STAGES; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], HG_NC);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {  // producer
#if HG_NC == 2
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
#endif
        if (tid == 0) {
            int s = 0, ph = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                int mb, nb;
                tile_coords(t, mt, nt, mb, nb);
                for (int kt = 0; kt < KT; kt++) {
                    mbar_wait(&empty[s], ph);
                    mbar_expect_tx(&full[s], STAGE_BYTES);
                    tma_load(sA + s * BM * BK, &tmA, &full[s], kt * BK, mb * BM);
                    tma_load(sB + s * BN * BK, &tmW, &full[s], kt * BK, nb * BN);
                    if (++s == HG_STAGES) {
                        s = 0;
                        ph ^= 1;
                    }
                }
            }
        }
    } else {  // consumers: warpgroup wg owns rows (wg - 1) * 64 .. + 63 of the tile
#if HG_NC == 2
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
#endif
        if (tid == 0)
            for (int s = 0; s < HG_STAGES; s++) mbar_arrive(&empty[s]);
        const int warp = tid / 32, lane = tid % 32;
        float d[BN / 2];
        int s = 0, ph = 0;
        for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
            int mb, nb;
            tile_coords(t, mt, nt, mb, nb);
#if HG_FP8 == 2
            // Tile scales: each 128-wide k step's product goes into p, then into d times its scales on the
            // CUDA cores (the fp8 MMA's own accumulation keeps ~14 bits; one k block's 4 steps at most).
            // Rows and columns as the epilogue's row0 / col0 below (clamped: past M / N never stored).
            const int KB = (K + 127) >> 7, brow = mb * BM + (wg - 1) * 64 + warp * 16 + lane / 4;
            const int bcol = nb * BN + 2 * (lane % 4);
            const float* sa0 = sa + (size_t)min(brow, M - 1) * KB;
            const float* sa1 = sa + (size_t)min(brow + 8, M - 1) * KB;
#pragma unroll
            for (int i = 0; i < BN / 2; i++) d[i] = 0.f;
            for (int kt = 0; kt < KT; kt++) {
                mbar_wait(&full[s], ph);
                const elem_t* a = sA + s * BM * BK + (wg - 1) * 64 * BK;
                const elem_t* b = sB + s * BN * BK;
                float p[BN / 2];
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < BK / KSTEP; k++) WGMMA(p, sw128_desc(a + k * KSTEP), sw128_desc(b + k * KSTEP), k);
                wgmma_commit();
                wgmma_wait<0>();
#pragma unroll
                for (int i = 0; i < BN / 2; i++) reg_fence(p[i]);
                if (tid == 0) mbar_arrive(&empty[s]);
                const float a0 = sa0[kt], a1 = sa1[kt];
#pragma unroll
                for (int j = 0; j < BN / 8; j++) {  // each column its own scale (rows permuted across tiles)
                    const float w0 = sw[(size_t)min(bcol + 8 * j, N - 1) * KB + kt];
                    const float w1 = sw[(size_t)min(bcol + 8 * j + 1, N - 1) * KB + kt];
                    d[4 * j] += p[4 * j] * (a0 * w0);
                    d[4 * j + 1] += p[4 * j + 1] * (a0 * w1);
                    d[4 * j + 2] += p[4 * j + 2] * (a1 * w0);
                    d[4 * j + 3] += p[4 * j + 3] * (a1 * w1);
                }
                if (++s == HG_STAGES) {
                    s = 0;
                    ph ^= 1;
                }
            }
#else
            int prev = 0;
            for (int kt = 0; kt < KT; kt++) {
                mbar_wait(&full[s], ph);
                const elem_t* a = sA + s * BM * BK + (wg - 1) * 64 * BK;
                const elem_t* b = sB + s * BN * BK;
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < BK / KSTEP; k++)
                    WGMMA(d, sw128_desc(a + k * KSTEP), sw128_desc(b + k * KSTEP), kt | k);
                wgmma_commit();
                wgmma_wait<1>();  // the previous stage's batch has retired: hand that stage back
                if (kt > 0 && tid == 0) mbar_arrive(&empty[prev]);
                prev = s;
                if (++s == HG_STAGES) {
                    s = 0;
                    ph ^= 1;
                }
            }
            wgmma_wait<0>();
            if (tid == 0) mbar_arrive(&empty[prev]);
#pragma unroll
            for (int i = 0; i < BN / 2; i++) reg_fence(d[i]);
#endif

            // d[4j + 2h + e]: row 16 * warp + lane / 4 + 8h, column 8j + 2 * (lane % 4) + e of the 64 x BN part.
            const int row0 = mb * BM + (wg - 1) * 64 + warp * 16 + lane / 4, col0 = nb * BN + 2 * (lane % 4);
#if HG_FP8 == 1
            {  // the row's and the column's scales (rows / columns past M / N: 0, never stored)
                const float a0 = row0 < M ? sa[row0] : 0.f, a1 = row0 + 8 < M ? sa[row0 + 8] : 0.f;
#pragma unroll
                for (int j = 0; j < BN / 8; j++) {
                    const int col = col0 + 8 * j;
                    const float w0 = col < N ? sw[col] : 0.f, w1 = col + 1 < N ? sw[col + 1] : 0.f;
                    d[4 * j] *= a0 * w0;
                    d[4 * j + 1] *= a0 * w1;
                    d[4 * j + 2] *= a1 * w0;
                    d[4 * j + 3] *= a1 * w1;
                }
            }
#endif
            if (act >= 0) {  // fused SwiGLU / GeGLU: column groups of 16 = 8 gates, then their 8 ups
                bf16* out = reinterpret_cast<bf16*>(C);
#pragma unroll
                for (int t = 0; t < BN / 16; t++) {
                    if (nb * BN + 16 * t >= N) continue;
                    const int j = (nb * BN + 16 * t) / 2 + 2 * (lane % 4);  // output column of e = 0
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int row = row0 + 8 * h;
                        if (row >= M) continue;
                        const float a0 = gate_act(d[8 * t + 2 * h], act), a1 = gate_act(d[8 * t + 2 * h + 1], act);
                        *reinterpret_cast<uint32_t*>(out + (size_t)row * ldc + j) =
                            pack_bf162(a0 * d[8 * t + 4 + 2 * h], a1 * d[8 * t + 4 + 2 * h + 1]);
                    }
                }
                continue;
            }
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                const int col = col0 + 8 * j;
                if (col >= N) continue;
                float b0 = 0.f, b1 = 0.f;
                if (bias) {
                    b0 = bias[col];
                    if (col + 1 < N) b1 = bias[col + 1];
                }
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int row = row0 + 8 * h;
                    if (row >= M) continue;
                    float v0 = d[4 * j + 2 * h] + b0, v1 = d[4 * j + 2 * h + 1] + b1;
                    float* c = C + (size_t)row * ldc + col;
                    if (col + 1 < N) {
                        if (accumulate) {
                            const float2 o = *reinterpret_cast<const float2*>(c);
                            v0 += o.x;
                            v1 += o.y;
                        }
                        *reinterpret_cast<float2*>(c) = make_float2(v0, v1);
                    } else {
                        *c = accumulate ? *c + v0 : v0;
                    }
                }
            }
        }
    }
}
