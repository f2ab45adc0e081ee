// gemv_fp8.cu: fp8 (e4m3) weight GEMV / skinny GEMM on the tensor cores, for decode rounds of
// width M = 1..8.
//
// y[m, n] = bf16( scale[n] * sum_k x[m, k] * W[n, k] )
//   x bf16 [M, K] (contiguous), W uint8 [N, K] float8_e4m3fn bit patterns (torch Linear layout),
//   scale fp32 [N] (one per output channel: engine/loaders/fp8.py's Fp8Tensor with block None),
//   y bf16 [M, N] (contiguous). fp32 accumulation; the scale is applied once, after the sum.
// Each weight byte is read exactly once per call, whatever M is, and a row's arithmetic does not
// depend on the other rows (rows >= M are zeros in the product), so a lane's result does not
// depend on the width of its round.
// Preconditions (wrapper): K % 16 == 0, pointers 16-byte aligned, 1 <= M <= 8.
// Compile-time: FP8_THREADS (256: 8 warps, the layout below assumes it), FP8_UNROLL (steps a
// warp keeps in flight), FP8_CHUNKS (16-byte chunks of a row a thread reads per step: 1 or 2),
// FP8_MINB (blocks an SM must hold: the register budget; without it ptxas kept 40 registers and
// sank the loads next to their use, so few bytes were in flight).
//
// gemv_fp8: a block of 256 threads owns 16 output rows; its 8 warps split K in steps of
// 64 * FP8_CHUNKS (warp w takes steps w, w + 8, ...). In a step, thread (g = lane / 4,
// t = lane % 4) loads chunks t, t + 4, ... (16 bytes = 16 k each) of W rows g and g + 8 and
// the same k of activation row g (zero for g >= M): a load instruction covers 64 contiguous
// bytes of 16 rows. e4m3 converts exactly to bf16 (cvt e4m3x2 -> f16x2, then
// f16 -> bf16: 3 mantissa bits, exponents 2^-9 .. 2^8), so the registers feed four
// mma.m16n8k16 bf16 (W as A, 16 rows; x^T as B, 8 columns). The k order inside a step is
// permuted identically for W and x (mma j takes bytes 4j .. 4j + 3 of each thread's 16), so
// no fragment needs a shuffle. The 16 x 8 accumulators are summed across warps in shared
// memory in a fixed order; one thread scales and writes each output.

#include <cuda_fp8.h>

#ifndef FP8_THREADS
#error "FP8_THREADS is defined by the wrapper"
#endif
#ifndef FP8_UNROLL
#define FP8_UNROLL 4
#endif
#ifndef FP8_CHUNKS
#define FP8_CHUNKS 1
#endif
#ifndef FP8_MINB
#define FP8_MINB 2
#endif
static_assert(FP8_THREADS == 256, "gemv_fp8: 8 warps split K and reduce in shared memory");
static_assert(FP8_CHUNKS == 1 || FP8_CHUNKS == 2, "gemv_fp8: 1 or 2 chunks a step");

// Two e4m3 bytes (the low byte first) -> a bf16 pair packed as mma operands are (low element low).
__device__ __forceinline__ uint32_t fp8x2_to_bf162(uint32_t two) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
    float2 f = __half22float2(*reinterpret_cast<__half2*>(&h));
    return pack_bf162(f.x, f.y);
}

extern "C" __global__ void __launch_bounds__(FP8_THREADS, FP8_MINB) gemv_fp8(const bf16* __restrict__ x,
                                                                   const uint8_t* __restrict__ W,
                                                                   const float* __restrict__ scale,
                                                                   bf16* __restrict__ y, int M, int N, int K) {
    __shared__ float part[FP8_THREADS / 32][32][4];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16;
    const bool row_a = n0 + g < N, row_b = n0 + g + 8 < N, has_x = g < M;
    const uint8_t* wa_p = W + (size_t)(row_a ? n0 + g : 0) * K + 16 * t;
    const uint8_t* wb_p = W + (size_t)(row_b ? n0 + g + 8 : 0) * K + 16 * t;
    const bf16* x_p = x + (size_t)(has_x ? g : 0) * K + 16 * t;

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    constexpr int STEP = 64 * FP8_CHUNKS, LOADS = FP8_UNROLL * FP8_CHUNKS;
    for (int s0 = warp; s0 * STEP < K; s0 += 8 * FP8_UNROLL) {
        uint4 wa[LOADS], wb[LOADS], xa[LOADS], xb[LOADS];
#pragma unroll
        for (int l = 0; l < LOADS; ++l) {
            // load l: step s0 + 8 * (l / CHUNKS), chunk t + 4 * (l % CHUNKS) of it.
            const int k = (s0 + 8 * (l / FP8_CHUNKS)) * STEP + 64 * (l % FP8_CHUNKS);
            const bool in = k + 16 * t < K;
            wa[l] = ld_stream_if(wa_p + k, in && row_a);
            wb[l] = ld_stream_if(wb_p + k, in && row_b);
            xa[l] = ldg_if(x_p + k, in && has_x);
            xb[l] = ldg_if(x_p + k + 8, in && has_x);
        }
#pragma unroll
        for (int l = 0; l < LOADS; ++l) {
            const uint32_t wa4[4] = {wa[l].x, wa[l].y, wa[l].z, wa[l].w};
            const uint32_t wb4[4] = {wb[l].x, wb[l].y, wb[l].z, wb[l].w};
            const uint32_t xs[8] = {xa[l].x, xa[l].y, xa[l].z, xa[l].w, xb[l].x, xb[l].y, xb[l].z, xb[l].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                // mma j: k-slots 2t, 2t+1 <- bytes 4j, 4j+1; slots 2t+8, 2t+9 <- bytes 4j+2, 4j+3.
                const uint32_t a[4] = {fp8x2_to_bf162(wa4[j]), fp8x2_to_bf162(wb4[j]), fp8x2_to_bf162(wa4[j] >> 16),
                                       fp8x2_to_bf162(wb4[j] >> 16)};
                mma_bf16(acc, a, xs[2 * j], xs[2 * j + 1]);
            }
        }
    }
    // acc: [0], [1] = rows g, columns (x rows) 2t, 2t+1; [2], [3] = row g + 8, the same columns.
#pragma unroll
    for (int i = 0; i < 4; ++i) part[warp][lane][i] = acc[i];
    __syncthreads();
    if (threadIdx.x < 128) {
        const int r = threadIdx.x >> 3, m = threadIdx.x & 7;  // output row n0 + r, x row m
        const int src_lane = (r & 7) * 4 + (m >> 1), slot = (r >> 3) * 2 + (m & 1);
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < FP8_THREADS / 32; ++w) s += part[w][src_lane][slot];
        if (m < M && n0 + r < N) y[(size_t)m * N + n0 + r] = __float2bfloat16(s * scale[n0 + r]);
    }
}
