// gemv.cu: bf16 weight GEMV / skinny GEMM for decode rounds of width M = 1..8.
//
// out[m, n] (+)= sum_k x[m, k] * W[n, k] (+ bias[n])
//   x bf16 [M, K] (contiguous), W bf16 [N, K] (torch Linear layout), bias fp32 [N] or null,
//   out fp32 [M, ldo]. accumulate != 0 adds into out (the fused residual add).
// Each weight byte is read exactly once per call, whatever M is: a block of 256
// threads owns R = 4 consecutive output rows; its threads stride over K in
// 16-byte chunks (8 bf16), each chunk of the R rows loaded with a streaming,
// L1-bypassing load (two chunks in flight per row per thread), and every one of
// the M activation rows (small, L1/L2-resident) is multiplied against it in
// registers. acc[R][M] fp32 is reduced by warp shuffles then across the 8 warps
// in shared memory; one thread writes each output element, so accumulate mode
// needs no atomics.
// Preconditions (wrapper): K % 8 == 0, pointers 16-byte aligned, 1 <= M <= 8.

#define GEMV_THREADS 256
#define GEMV_R 4
#define GEMV_U 2

template <int M>
__device__ __forceinline__ void gemv_body(const bf16* __restrict__ x, const bf16* __restrict__ W,
                                          const float* __restrict__ bias, float* __restrict__ out, int N, int K,
                                          int ldo, int accumulate) {
    constexpr int R = GEMV_R, U = GEMV_U;
    const int n0 = blockIdx.x * R;
    const int K8 = K >> 3;
    const uint4* W4 = reinterpret_cast<const uint4*>(W);
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.f;

    for (int c0 = threadIdx.x; c0 < K8; c0 += GEMV_THREADS * U) {
        uint4 w[U][R];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + u * GEMV_THREADS;
#pragma unroll
            for (int r = 0; r < R; r++)
                w[u][r] = (c < K8 && n0 + r < N) ? ld_stream(W4 + (size_t)(n0 + r) * K8 + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + u * GEMV_THREADS;
            if (c >= K8) break;
#pragma unroll
            for (int m = 0; m < M; m++) {
                const uint4 xv = __ldg(x4 + (size_t)m * K8 + c);
                const float xf[8] = {bf_lo(xv.x), bf_hi(xv.x), bf_lo(xv.y), bf_hi(xv.y),
                                     bf_lo(xv.z), bf_hi(xv.z), bf_lo(xv.w), bf_hi(xv.w)};
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const uint4 wv = w[u][r];
                    float a = acc[r][m];
                    a = fmaf(xf[0], bf_lo(wv.x), a);
                    a = fmaf(xf[1], bf_hi(wv.x), a);
                    a = fmaf(xf[2], bf_lo(wv.y), a);
                    a = fmaf(xf[3], bf_hi(wv.y), a);
                    a = fmaf(xf[4], bf_lo(wv.z), a);
                    a = fmaf(xf[5], bf_hi(wv.z), a);
                    a = fmaf(xf[6], bf_lo(wv.w), a);
                    a = fmaf(xf[7], bf_hi(wv.w), a);
                    acc[r][m] = a;
                }
            }
        }
    }

    __shared__ float red[GEMV_THREADS / 32][R * M];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int m = 0; m < M; m++) {
            const float v = warp_sum(acc[r][m]);
            if (lane == 0) red[warp][r * M + m] = v;
        }
    __syncthreads();
    if (threadIdx.x < R * M) {
        const int r = threadIdx.x / M, m = threadIdx.x % M, n = n0 + r;
        if (n < N) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < GEMV_THREADS / 32; w++) v += red[w][threadIdx.x];
            if (bias) v += bias[n];
            float* o = out + (size_t)m * ldo + n;
            *o = accumulate ? *o + v : v;
        }
    }
}

#define GEMV_ENTRY(M)                                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                              \
        gemv_m##M(const bf16* x, const bf16* W, const float* bias, float* out, int N, int K, int ldo, int acc) { \
        gemv_body<M>(x, W, bias, out, N, K, ldo, acc);                                                      \
    }
GEMV_ENTRY(1)
GEMV_ENTRY(2)
GEMV_ENTRY(3)
GEMV_ENTRY(4)
GEMV_ENTRY(5)
GEMV_ENTRY(6)
GEMV_ENTRY(7)
GEMV_ENTRY(8)

// gemv_tc: the same product on the tensor cores, for decode widths 1..8 (the FMA
// version above becomes issue-bound near M = 8: M FMAs per weight element). The
// backend runs every decode width on it, so a lane's arithmetic (and its tokens) do
// not depend on the width of its round.
// A block of 256 threads owns 16 output rows; its 8 warps split K in steps of 64.
// In a step, thread (g = lane / 4, t = lane % 4) loads chunks t and t + 4 (16 bytes =
// 8 k each) of W rows g and g + 8 and of activation row g (zero for g >= M): each load
// instruction covers 64 contiguous bytes of 8 rows (whole 32-byte sectors, so no sector
// is fetched twice). U steps are in flight per warp. Those registers feed four
// mma.m16n8k16 directly as A (W, 16 rows) and B (x^T, 8 columns): the k order inside a
// step is permuted, identically for W and x, so the fragments need no shuffles. The
// 16 x 8 accumulators are summed across warps in shared memory in a fixed order; one
// thread writes each output.
// mode 0: out fp32 = acc (+ bias); 1: out += acc (the fused residual add);
// 2 (SwiGLU epilogue): W is the gate|up matrix interleaved in 8-row groups (rows
//   16j..16j+7 = gate rows 8j..8j+7, rows 16j+8..16j+15 = up rows 8j..8j+7), out is
//   bf16 act [M, ldo] and act[m, 8j + r] = bf16(silu(gate) * up); no bias.
// 3 (rope + KV-write epilogue): W is the fused q|k|v matrix with each head's rows
//   interleaved in 8-row groups (rows 16j..16j+7 of a head = dims 8j..8j+7, rows
//   16j+8..16j+15 = dims D/2 + 8j..), so a block holds both members of 8 rotation pairs
//   of one head. q heads are rotated into out = q bf16 [M, H, D]; k heads rotated and v
//   heads copied into their KV-cache slots (layout and arithmetic as rope.cu's).
// Fused RMSNorm (decode rounds). The norm of the activation rows is a per-row scalar, so
//   it is applied to the accumulators: with ss_in, x holds bf16(h * w_norm) and the row
//   sum is scaled by rsqrt(sum(ss_in[m, 0:ss_nparts]) / K + eps) before bias and
//   epilogue (warp m sums row m's partials in a fixed order). With nw (modes 0 and 1), the
//   block also writes the next layer's input from the new h = out: xw[m, n] = bf16(h *
//   nw[n]) ([M, N]) and ss_out[m, blockIdx.x] = sum of h^2 over its 16 outputs, which the
//   next GEMV reads as ss_in with ss_nparts = gridDim.x. Every per-row quantity is summed
//   from that row's values only, in a fixed order: lanes stay width-invariant.
#define TC_ROWS 16

__device__ __forceinline__ void tc_step(float* c, const uint4& wa, const uint4& wb, const uint4& xv) {
    const uint32_t a0[4] = {wa.x, wb.x, wa.y, wb.y};
    const uint32_t a1[4] = {wa.z, wb.z, wa.w, wb.w};
    mma_bf16(c, a0, xv.x, xv.y);
    mma_bf16(c, a1, xv.z, xv.w);
}

struct TcRope {  // mode 3 only
    const int* positions;
    const int* slots;
    const float* inv_freq;
    bf16* cache;
    int H, KVH, D, block_size;
    long long block_stride;
};

template <int U>
__device__ __forceinline__ void gemv_tc_body(const bf16* __restrict__ x, const bf16* __restrict__ W,
                                             const float* __restrict__ bias, void* __restrict__ out, int M,
                                             int N, int K, int ldo, int mode, const float* __restrict__ ss_in,
                                             int ss_nparts, float eps, const bf16* __restrict__ nw,
                                             bf16* __restrict__ xw, float* __restrict__ ss_out, const TcRope& rp) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * TC_ROWS;
    const int K8 = K >> 3;
    const uint4* W4 = reinterpret_cast<const uint4*>(W);
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    const bool ra = n0 + g < N, rb = n0 + g + 8 < N, rx = g < M;
    const uint4* wa_p = W4 + (size_t)(ra ? n0 + g : 0) * K8;
    const uint4* wb_p = W4 + (size_t)(rb ? n0 + g + 8 : 0) * K8;
    const uint4* x_p = x4 + (size_t)(rx ? g : 0) * K8;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    // Step s covers chunks [8s, 8s + 8); this thread takes chunks 8s + t and 8s + t + 4.
    const int steps = (K8 + 7) / 8;
    for (int s0 = warp; s0 < steps; s0 += 8 * U) {
        uint4 wa[U][2], wb[U][2], xv[U][2];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int s = s0 + u * 8;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int ch = s * 8 + t + 4 * h;
                const bool ok = s < steps && ch < K8;
                wa[u][h] = ld_stream_if(wa_p + ch, ok && ra);
                wb[u][h] = ld_stream_if(wb_p + ch, ok && rb);
                xv[u][h] = ldg_if(x_p + ch, ok && rx);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int h = 0; h < 2; h++) tc_step(c, wa[u][h], wb[u][h], xv[u][h]);
    }
    __shared__ float red[8][TC_ROWS][8];
    __shared__ float rs[8];
    red[warp][g][2 * t] = c[0];
    red[warp][g][2 * t + 1] = c[1];
    red[warp][g + 8][2 * t] = c[2];
    red[warp][g + 8][2 * t + 1] = c[3];
    if (ss_in != nullptr && warp < M) {  // warp m: row m's RMSNorm scale
        float ss = 0.f;
        for (int p = lane; p < ss_nparts; p += 32) ss += ss_in[(size_t)warp * ss_nparts + p];
        ss = warp_sum(ss);
        if (lane == 0) rs[warp] = rsqrtf(ss / K + eps);
    }
    __syncthreads();
    if (mode == 2) {
        if (threadIdx.x < 8 * 8) {
            const int r = threadIdx.x >> 3, m = threadIdx.x & 7;
            if (m < M && n0 + r + 8 < N) {
                float gt = 0.f, up = 0.f;
#pragma unroll
                for (int w = 0; w < 8; w++) gt += red[w][r][m];
#pragma unroll
                for (int w = 0; w < 8; w++) up += red[w][r + 8][m];
                if (ss_in != nullptr) {
                    gt *= rs[m];
                    up *= rs[m];
                }
                static_cast<bf16*>(out)[(size_t)m * ldo + (n0 >> 1) + r] = __float2bfloat16(gt / (1.f + expf(-gt)) * up);
            }
        }
        return;
    }
    if (mode == 3) {
        if (threadIdx.x < 8 * 8) {
            const int r = threadIdx.x >> 3, m = threadIdx.x & 7;
            if (m < M) {
                float a = 0.f, b = 0.f;
#pragma unroll
                for (int w = 0; w < 8; w++) a += red[w][r][m];
#pragma unroll
                for (int w = 0; w < 8; w++) b += red[w][r + 8][m];
                if (ss_in != nullptr) {
                    a *= rs[m];
                    b *= rs[m];
                }
                if (bias) {
                    a += bias[n0 + r];
                    b += bias[n0 + r + 8];
                }
                const int D = rp.D, half = D >> 1, hh = n0 / D, i = ((n0 % D) >> 1) + r;
                float sn, cs;
                sincosf((float)rp.positions[m] * rp.inv_freq[i], &sn, &cs);
                if (hh < rp.H) {
                    bf16* o = static_cast<bf16*>(out) + ((size_t)m * rp.H + hh) * D;
                    o[i] = __float2bfloat16(a * cs - b * sn);
                    o[i + half] = __float2bfloat16(b * cs + a * sn);
                } else {
                    const bool is_v = hh >= rp.H + rp.KVH;
                    const int kh = hh - rp.H - (is_v ? rp.KVH : 0);
                    const int slot = rp.slots[m];
                    const int blk = slot / rp.block_size, off = slot % rp.block_size;
                    bf16* d = rp.cache + (size_t)blk * rp.block_stride + ((size_t)off * rp.KVH + kh) * D;
                    if (is_v) {
                        d += (size_t)rp.block_size * rp.KVH * D;
                        d[i] = __float2bfloat16(a);
                        d[i + half] = __float2bfloat16(b);
                    } else {
                        d[i] = __float2bfloat16(a * cs - b * sn);
                        d[i + half] = __float2bfloat16(b * cs + a * sn);
                    }
                }
            }
        }
        return;
    }
    float q = 0.f;  // h^2 of this thread's output (nw: the next norm's partial sum)
    if (threadIdx.x < TC_ROWS * 8) {
        const int r = threadIdx.x >> 3, m = threadIdx.x & 7, n = n0 + r;
        if (m < M && n < N) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < 8; w++) v += red[w][r][m];
            if (ss_in != nullptr) v *= rs[m];
            if (bias) v += bias[n];
            float* o = static_cast<float*>(out) + (size_t)m * ldo + n;
            const float h = mode == 1 ? *o + v : v;
            *o = h;
            if (nw != nullptr) {
                xw[(size_t)m * N + n] = __float2bfloat16(h * __bfloat162float(nw[n]));
                q = h * h;
            }
        }
    }
    if (nw != nullptr) {
        // Threads 0..127: lane = (r % 4) * 8 + m, warp = r / 4. Sum over r for each m: lanes, then warps 0..3.
        __shared__ float sp[4][8];
        q += __shfl_xor_sync(FULL_MASK, q, 8);
        q += __shfl_xor_sync(FULL_MASK, q, 16);
        if (warp < 4 && lane < 8) sp[warp][lane] = q;
        __syncthreads();
        if (threadIdx.x < M) {
            const int m = threadIdx.x;
            ss_out[(size_t)m * gridDim.x + blockIdx.x] = ((sp[0][m] + sp[1][m]) + sp[2][m]) + sp[3][m];
        }
    }
}

// MINB: blocks per SM the register allocation must allow. Without it ptxas sinks each load down
// to its mma (3 loads in flight per warp); with it every load of a batch issues first.
#define GEMV_TC_ENTRY(NAME, U, MINB)                                                                          \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                                 \
        NAME(const bf16* x, const bf16* W, const float* bias, void* out, int M, int N, int K, int ldo, int mode, \
             const float* ss_in, int ss_nparts, float eps, const bf16* nw, bf16* xw, float* ss_out,            \
             const int* positions, const int* slots, const float* inv_freq, bf16* cache, int H, int KVH, int D, \
             int block_size, long long block_stride) {                                                        \
        const TcRope rp{positions, slots, inv_freq, cache, H, KVH, D, block_size, block_stride};             \
        gemv_tc_body<U>(x, W, bias, out, M, N, K, ldo, mode, ss_in, ss_nparts, eps, nw, xw, ss_out, rp);      \
    }
GEMV_TC_ENTRY(gemv_tc, 4, 2)
GEMV_TC_ENTRY(gemv_tc_u2, 2, 4)
