// quant_act.cu: the activation quantizer of gemv_q.cu's int8 path (QACT8, cuda.quant_activations).
//
// x bf16 [M, K] (M 1..8, K % 32 == 0, rows contiguous) -> one buffer q:
//   q[0 .. M K): int8 qx [M, K], in x's own order (row m at q + m K);
//   then, at q + M K (16-byte aligned: M K is a multiple of 32), float2 sc[K / 32][8]: for row m and
//   group G of 32 values (elements 32G .. 32G + 31), sc[G][m] = (dx, dx * xsum), dx = absmax / 127,
//   xsum = the int sum of the group's qx. Rows M..7 of sc are not written (the GEMV reads them only
//   for the columns past M, which no epilogue stores).
// Per value: qx = rint(x * (1 / dx)) (round to nearest even, __float2int_rn), clamped to +-127; dx = 0
// (an all-zero group) gives qx = 0. Every step is one correctly rounded fp32 operation (__fdiv_rn,
// __fmul_rn), so numpy's float32 model (tests/kernels/test_cuda_quant_act.py) is bit-exact. Each row
// is quantized from its own values only: a row's result does not depend on M (width invariance).
// One thread a (row, group): 64 bytes in, 32 bytes and one float2 out.

extern "C" __global__ void quant_act_q8(const bf16* __restrict__ x, int8_t* __restrict__ q, int M, int K) {
    const int NG = K >> 5;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= M * NG) return;
    const int m = idx / NG, grp = idx - m * NG;
    const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)m * K + 32 * grp);
    float v[32];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint4 w = src[i];
        const uint32_t w4[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            v[8 * i + 2 * j] = __uint_as_float(w4[j] << 16);
            v[8 * i + 2 * j + 1] = __uint_as_float(w4[j] & 0xffff0000u);
        }
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
    const float d = __fdiv_rn(amax, 127.f);
    const float id = d != 0.f ? __fdiv_rn(1.f, d) : 0.f;
    uint32_t o[8];
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        uint32_t word = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int qi = max(-127, min(127, __float2int_rn(__fmul_rn(v[4 * i + j], id))));
            sum += qi;
            word |= (uint32_t)(qi & 0xff) << (8 * j);
        }
        o[i] = word;
    }
    uint4* dst = reinterpret_cast<uint4*>(q + (size_t)m * K + 32 * grp);
    dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
    dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
    float2* sc = reinterpret_cast<float2*>(q + (size_t)M * K);
    sc[(size_t)grp * 8 + m] = make_float2(d, __fmul_rn(d, (float)sum));
}

// quant_act_fp8: the fp8 prefill GEMM's activations (gemm_hopper.cu's HG_FP8 build).
// x bf16 [M, K] (K % 8 == 0) -> q float8_e4m3fn [M, K] and sa fp32 [M], one scale a row:
//   sa[m] = absmax(row m) / 448 (1 for a row of zeros), q = e4m3(x / sa[m]) rounded to nearest even and
//   saturated at +-448 (cvt.rn.satfinite), so q * sa[m] is x to within e4m3's 3 mantissa bits.
// Every step is one correctly rounded fp32 operation (__fdiv_rn), so engine/loaders/fp8.py's encode on
// numpy float32 is bit-exact (tests/kernels/test_cuda_fp8_gemm.py). One block (QF8_THREADS) a row.
#include <cuda_fp8.h>
#define QF8_THREADS 256

extern "C" __global__ void __launch_bounds__(QF8_THREADS)
    quant_act_fp8(const bf16* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ sa, int M, int K) {
    __shared__ float red[QF8_THREADS / 32];
    const int m = blockIdx.x, n8 = K >> 3;
    const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)m * K);
    float amax = 0.f;
    for (int i = threadIdx.x; i < n8; i += QF8_THREADS) {
        const uint4 w = src[i];
        const uint32_t w4[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; j++)
            amax = fmaxf(amax, fmaxf(fabsf(__uint_as_float(w4[j] << 16)), fabsf(__uint_as_float(w4[j] & 0xffff0000u))));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = red[0];
#pragma unroll
    for (int w = 1; w < QF8_THREADS / 32; w++) amax = fmaxf(amax, red[w]);
    const float s = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
    if (threadIdx.x == 0) sa[m] = s;
    uint2* dst = reinterpret_cast<uint2*>(q + (size_t)m * K);
    for (int i = threadIdx.x; i < n8; i += QF8_THREADS) {
        const uint4 w = src[i];
        const uint32_t w4[4] = {w.x, w.y, w.z, w.w};
        uint32_t o[2] = {0u, 0u};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float lo = __fdiv_rn(__uint_as_float(w4[j] << 16), s);
            const float hi = __fdiv_rn(__uint_as_float(w4[j] & 0xffff0000u), s);
            const uint32_t two = __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
            o[j >> 1] |= (two & 0xffffu) << (16 * (j & 1));
        }
        dst[i] = make_uint2(o[0], o[1]);
    }
}

// quant_act_fp8_g128: x for the tile-scaled fp8 GEMM (gemm_hopper_fp8b): a scale per row and 128-wide k
// block. x bf16 [M, K] (K % 16 == 0) -> q float8_e4m3fn [M, K], sa fp32 [M, KB] (KB = ceil(K / 128)),
// sa[m, b] = absmax(x[m, 128 b .. 128 b + 127]) / 448 (1 for zeros), q as quant_act_fp8 within the
// block. One warp a (row, block), 4 values a lane; QF8_THREADS / 32 of them a block of threads.
extern "C" __global__ void __launch_bounds__(QF8_THREADS)
    quant_act_fp8_g128(const bf16* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ sa, int M, int K) {
    const int KB = (K + 127) >> 7, lane = threadIdx.x & 31;
    const int idx = blockIdx.x * (QF8_THREADS / 32) + (threadIdx.x >> 5);
    if (idx >= M * KB) return;
    const int m = idx / KB, b = idx - m * KB, k0 = 128 * b + 4 * lane;
    const bool in = k0 < K;  // K % 16 == 0: a lane's 4 values are all in or all out
    uint2 w = make_uint2(0u, 0u);
    if (in) w = *reinterpret_cast<const uint2*>(x + (size_t)m * K + k0);
    const float v[4] = {__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u), __uint_as_float(w.y << 16),
                        __uint_as_float(w.y & 0xffff0000u)};
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
    if (lane == 0) sa[(size_t)m * KB + b] = s;
    if (!in) return;
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(v[0], s), __fdiv_rn(v[1], s)), __NV_SATFINITE,
                                                 __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(v[2], s), __fdiv_rn(v[3], s)), __NV_SATFINITE,
                                                 __NV_E4M3);
    *reinterpret_cast<uint32_t*>(q + (size_t)m * K + k0) = (lo & 0xffffu) | ((hi & 0xffffu) << 16);
}
