// gemv.cu: bf16 weight GEMV / skinny GEMM on the tensor cores, for decode rounds of M = 1..64 rows
// (lanes, and a speculating lane's verify rows).
//
// out[m, n] (+)= sum_k x[m, k] * W[n, k] (+ bias[n]), then one of four epilogues.
//   x bf16 [M, K] (contiguous), W bf16 [N, K] (torch Linear layout), bias fp32 [N] or null.
// Each weight byte is read exactly once per call, whatever M is, and a row's arithmetic does
// not depend on the other rows: the backend runs every decode width here, so a lane's tokens
// do not depend on the width of its round.
// Preconditions (wrapper): K % 8 == 0, pointers 16-byte aligned, 1 <= M <= 8 G (the variant's groups).
// Compile-time: TC_THREADS (256: 8 warps, the layout below assumes it); R16_U, R16_MINB, R32_U,
// R32_MINB, R64_U, R64_MINB (the wide variants' steps in flight and blocks per SM); PDL (1:
// programmatic dependent launch, common.cuh: each warp issues its first batch of weight loads,
// then waits for the kernel before, then loads x; without it the loads interleave as they always did).

#ifndef TC_THREADS
#error "TC_THREADS is defined by engine/cu/kernels.py"
#endif
static_assert(TC_THREADS == 256, "gemv_tc: 8 warps split K and reduce in shared memory");
#ifndef GEMV_KS
#define GEMV_KS 0
#endif

// gemv_tc_<epilogue>[_u2, _r16, _r32, _r64]:
// A block of 256 threads owns 16 output rows; its 8 warps split K in steps of 64.
// In a step, thread (g = lane / 4, t = lane % 4) loads chunks t and t + 4 (16 bytes =
// 8 k each) of W rows g and g + 8 and of activation rows g, 8 + g, .. (one per group of 8
// rows; zero for rows >= M, a group wholly past M skipped): each load
// instruction covers 64 contiguous bytes of 8 rows (whole 32-byte sectors, so no sector
// is fetched twice). U steps are in flight per warp. Those registers feed four
// mma.m16n8k16 directly as A (W, 16 rows) and B (x^T, 8 columns): the k order inside a
// step is permuted, identically for W and x, so the fragments need no shuffles; a group's
// mma reuses the step's W fragments, so the weights are read once whatever M is. Each
// group's 16 x 8 accumulators are summed across warps in shared memory in a fixed order
// (group after group, through one shared tile); one thread writes each output.
// The epilogue is a compile-time template parameter, one entry point per variant:
// store (EPI_STORE): out fp32 = acc (+ bias); acc (EPI_ACC): out += acc (the fused residual add);
// swiglu (EPI_SWIGLU): W is the gate|up matrix interleaved in 8-row groups (rows
//   16j..16j+7 = gate rows 8j..8j+7, rows 16j+8..16j+15 = up rows 8j..8j+7), out is
//   bf16 act [M, ldo] and act[m, 8j + r] = bf16(silu(gate) * up); no bias.
// geglu (EPI_GEGLU): the same with gelu_tanh(gate) * up (gemma's GeGLU).
// rope (EPI_ROPE_KV, rope + KV write): W is the fused q|k|v matrix with each head's rows
//   interleaved in 8-row groups (rows 16j..16j+7 of a head = dims 8j..8j+7, rows
//   16j+8..16j+15 = dims D/2 + 8j..), so a block holds both members of 8 rotation pairs
//   of one head. q heads are rotated into out = q bf16 [M, H, D]; k heads rotated and v
//   heads copied into their KV-cache slots (layout and arithmetic as rope.cu's).
//   Partial rotary (rotary_dim R < D, R % 16 == 0): only a head's first R rows are
//   interleaved (pairs 8j + r, R/2 + 8j + r); rows R.. are in natural order and pass
//   through unrotated. cos and sin are multiplied by rope_factor (yarn / longrope).
// Fused RMSNorm (decode rounds). The norm of the activation rows is a per-row scalar, so
//   it is applied to the accumulators: with ss_in, x holds bf16(h * w_norm) and the row
//   sum is scaled by rsqrt(sum(ss_in[m, 0:ss_nparts]) / K + eps) before bias and
//   epilogue (warp m sums row m's partials in a fixed order). With nw (store and acc), the
//   block also writes the next layer's input from the new h = out: xw[m, n] = bf16(h *
//   nw[n]) ([M, N]) and ss_out[m, blockIdx.x] = sum of h^2 over its 16 outputs, which the
//   next GEMV reads as ss_in with ss_nparts = gridDim.x. Every per-row quantity is summed
//   from that row's values only, in a fixed order: lanes stay width-invariant.
#define TC_ROWS 16

enum { EPI_STORE = 0, EPI_ACC = 1, EPI_SWIGLU = 2, EPI_ROPE_KV = 3, EPI_GEGLU = 4 };

__device__ __forceinline__ float gelu_tanh(float g) {  // HF's gelu_pytorch_tanh
    return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

struct TcNorm {  // fused RMSNorm: ss_in for the input rows; nw, xw, ss_out (store / acc) for the next norm
    const float* ss_in;
    int ss_nparts;
    float eps;
    const bf16* nw;
    bf16* xw;
    float* ss_out;
};

struct TcRope {  // EPI_ROPE_KV only
    const int* positions;
    const int* slots;
    const float* inv_freq;
    bf16* cache;
    int H, KVH, D, block_size;
    long long block_stride;
    int rotary_dim;
    float factor;
};

// Rope + KV write of one rotation pair: rows r, r + 8 of the 16-row tile at row0 of the fused q|k|v
// matrix (head dims ia, ib: a pair inside the first rotary_dim dims, or two pass-through dims after
// them), values a, b of x row m; q into out [M, H, D], k rotated and v copied into their cache slots.
__device__ __forceinline__ void rope_kv_store(float a, float b, int m, int r, int row0, const TcRope& rp, void* out) {
    const int D = rp.D, hh = row0 / D, o = row0 % D, hr = rp.rotary_dim >> 1;
    const bool rot = o < rp.rotary_dim;
    const int ia = rot ? (o >> 1) + r : o + r, ib = rot ? ia + hr : ia + 8;
    float sn = 0.f, cs = 1.f;
    if (rot) {
        sincosf((float)rp.positions[m] * rp.inv_freq[ia], &sn, &cs);
        cs *= rp.factor;
        sn *= rp.factor;
    }
    const float ra = rot ? a * cs - b * sn : a, rb = rot ? b * cs + a * sn : b;
    if (hh < rp.H) {
        bf16* q = static_cast<bf16*>(out) + ((size_t)m * rp.H + hh) * D;
        q[ia] = __float2bfloat16(ra);
        q[ib] = __float2bfloat16(rb);
    } else {
        const bool is_v = hh >= rp.H + rp.KVH;
        const int kh = hh - rp.H - (is_v ? rp.KVH : 0);
        const int slot = rp.slots[m];
        const int blk = slot / rp.block_size, off = slot % rp.block_size;
        bf16* d = rp.cache + (size_t)blk * rp.block_stride + ((size_t)off * rp.KVH + kh) * D;
        if (is_v) {
            d += (size_t)rp.block_size * rp.KVH * D;
            d[ia] = __float2bfloat16(a);
            d[ib] = __float2bfloat16(b);
        } else {
            d[ia] = __float2bfloat16(ra);
            d[ib] = __float2bfloat16(rb);
        }
    }
}

// The bf16 main loop: this warp's share of the 16 x 8G tile, c[j] as mma_bf16's accumulator for
// activation rows 8j..8j+7 (G groups of 8 rows; a group at or past M is neither loaded nor multiplied).
// Every group meets the same W fragments in the same step order, so a row's sum does not depend
// on G, U or the other rows.
template <int U, int G>
__device__ __forceinline__ void gemv_tc_main(const bf16* __restrict__ x, const bf16* __restrict__ W, int M,
                                             int N, int K, float (*c)[4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * TC_ROWS;
    const int K8 = K >> 3;
    const uint4* W4 = reinterpret_cast<const uint4*>(W);
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    const bool ra = n0 + g < N, rb = n0 + g + 8 < N;
    const uint4* wa_p = W4 + (size_t)(ra ? n0 + g : 0) * K8;
    const uint4* wb_p = W4 + (size_t)(rb ? n0 + g + 8 : 0) * K8;
    const uint4* x_p = x4 + (size_t)g * K8;  // row 8j + g at x_p + 8j K8 (loaded only below M)
    // Step s covers chunks [8s, 8s + 8); this thread takes chunks 8s + t and 8s + t + 4. Warp w takes
    // steps w, w + 8, w + 16, ..; GEMV_KS 1 (an experiment, bench/gemv_probe.py): the contiguous steps
    // [w S8, (w + 1) S8) instead, S8 = ceil(steps / 8) (other bits, as width-invariant).
    const int steps = (K8 + 7) / 8;
    const int spw = (steps + 7) / 8;
    const int s_first = GEMV_KS ? warp * spw : warp, s_end = GEMV_KS ? min(steps, s_first + spw) : steps;
    constexpr int s_unit = GEMV_KS ? 1 : 8;
    for (int s0 = s_first; s0 < s_end; s0 += s_unit * U) {
        uint4 wa[U][2], wb[U][2], xv[U][2][G];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int s = s0 + u * s_unit;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int ch = s * 8 + t + 4 * h;
                const bool ok = s < s_end && ch < K8;
                wa[u][h] = ld_stream_if(wa_p + ch, ok && ra);
                wb[u][h] = ld_stream_if(wb_p + ch, ok && rb);
#if !(defined(PDL) && PDL)
#pragma unroll
                for (int j = 0; j < G; j++)
                    xv[u][h][j] = ldg_if(x_p + (size_t)8 * j * K8 + ch, ok && 8 * j + g < M);
#endif
            }
        }
#if defined(PDL) && PDL
        // The first batch's weights are in flight (they do not depend on the kernel before): now
        // wait for that kernel's x, then let the next kernel start.
        if (s0 == s_first) {
            pdl_wait();
            pdl_launch_dependents();
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int s = s0 + u * s_unit;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int ch = s * 8 + t + 4 * h;
                const bool ok = s < s_end && ch < K8;
#pragma unroll
                for (int j = 0; j < G; j++)
                    xv[u][h][j] = ldg_if(x_p + (size_t)8 * j * K8 + ch, ok && 8 * j + g < M);
            }
        }
#endif
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int j = 0; j < G; j++)
                    if (j == 0 || 8 * j < M) tc_step(c[j], wa[u][h], wb[u][h], xv[u][h][j]);
    }
    if (s_first >= s_end) {  // no step for this warp (K < 512): the epilogue still reads the kernel before's writes
        pdl_wait();
        pdl_launch_dependents();
    }
}

// Every epilogue, after a main loop (bf16 here, the quantized ones in gemv_q.cu) left this warp's
// accumulators in c (rows n0 + g, n0 + g + 8; columns = lanes 2t, 2t + 1). n_base: the row of
// the whole fused matrix this block's row 0 is (a q|k|v matrix launched in parts of one format
// each, gemv_q.cu); the rope epilogue's head arithmetic uses it. tile / ntiles: the 16-row tile
// these are and how many the matrix has (gemv_q.cu's blocks walk several); -1: this block's own.
// PAIR (gemv_tc_body<.., 2>): the block holds two 256-thread groups, each its own tile; thread
// threadIdx.x of group threadIdx.x / 256 acts as thread threadIdx.x % 256 of a block of its own,
// with its own shared sums (both groups reach every barrier below: the branches around them are
// uniform over the block).
template <int EPI, int PAIR = 1>
__device__ __forceinline__ void gemv_tc_epilogue(const float* c, const float* __restrict__ bias,
                                                 void* __restrict__ out, int M, int N, int K, int ldo,
                                                 const TcNorm& nm, const TcRope& rp, int n_base, int tile = -1,
                                                 int ntiles = 0) {
    const int tl = tile < 0 ? (int)blockIdx.x : tile, ntl = tile < 0 ? (int)gridDim.x : ntiles;
    const float* PDL_IN ss_in = nm.ss_in;
    const int ss_nparts = nm.ss_nparts;
    const float eps = nm.eps;
    const bf16* __restrict__ nw = nm.nw;
    bf16* __restrict__ xw = nm.xw;
    float* __restrict__ ss_out = nm.ss_out;
    const int grp = PAIR > 1 ? (int)(threadIdx.x >> 8) : 0;
    const unsigned tid = PAIR > 1 ? threadIdx.x & 255u : threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int n0 = tl * TC_ROWS;
    __shared__ float red_[PAIR][8][TC_ROWS][8];
    __shared__ float rs_[PAIR][8];
    float(*red)[TC_ROWS][8] = red_[grp];
    float* rs = rs_[grp];
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
    if constexpr (EPI == EPI_SWIGLU || EPI == EPI_GEGLU) {
        if (tid < 8 * 8) {
            const int r = tid >> 3, m = tid & 7;
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
                const float a = EPI == EPI_SWIGLU ? gt / (1.f + expf(-gt)) : gelu_tanh(gt);
                static_cast<bf16*>(out)[(size_t)m * ldo + (n0 >> 1) + r] = __float2bfloat16(a * up);
            }
        }
        return;
    }
    if constexpr (EPI == EPI_ROPE_KV) {
        if (tid < 8 * 8) {
            const int r = tid >> 3, m = tid & 7;
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
                rope_kv_store(a, b, m, r, n_base + n0, rp, out);
            }
        }
        return;
    }
    float q = 0.f;  // h^2 of this thread's output (nw: the next norm's partial sum)
    if (tid < TC_ROWS * 8) {
        const int r = tid >> 3, m = tid & 7, n = n0 + r;
        if (m < M && n < N) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < 8; w++) v += red[w][r][m];
            if (ss_in != nullptr) v *= rs[m];
            if (bias) v += bias[n];
            float* o = static_cast<float*>(out) + (size_t)m * ldo + n;
            const float h = EPI == EPI_ACC ? *o + v : v;
            *o = h;
            if (nw != nullptr) {
                xw[(size_t)m * N + n] = __float2bfloat16(h * __bfloat162float(nw[n]));
                q = h * h;
            }
        }
    }
    if (nw != nullptr) {
        // Threads 0..127: lane = (r % 4) * 8 + m, warp = r / 4. Sum over r for each m: lanes, then warps 0..3.
        __shared__ float sp_[PAIR][4][8];
        float(*sp)[8] = sp_[grp];
        q += __shfl_xor_sync(FULL_MASK, q, 8);
        q += __shfl_xor_sync(FULL_MASK, q, 16);
        if (warp < 4 && lane < 8) sp[warp][lane] = q;
        __syncthreads();
        if (tid < M) {
            const int m = tid;
            ss_out[(size_t)m * ntl + tl] = ((sp[0][m] + sp[1][m]) + sp[2][m]) + sp[3][m];
        }
    }
}

#if defined(GEMV_PAIR) && GEMV_PAIR
template <int U, int G>
__device__ __forceinline__ void gemv_tc_main_pair(const bf16* __restrict__ x, const bf16* __restrict__ W, int M,
                                                  int N, int K, float (*c)[4], uint4* xring);
#endif

// The main loop, then the epilogue once per group of 8 activation rows, on that group's rows of
// every per-row array (the epilogue itself sees at most 8 rows, as gemv_q.cu's callers give it).
// PAIR 2: gemv_tc_main_pair's blocks, each 256-thread group its own tile (ss_out's row stride: the
// tiles; a group past the last tile, of an odd tile count, reaches the barriers with no rows to write).
template <int U, int G, int EPI, int PAIR = 1>
__device__ __forceinline__ void gemv_tc_body(const bf16* __restrict__ x, const bf16* __restrict__ W,
                                             const float* __restrict__ bias, void* __restrict__ out, int M,
                                             int N, int K, int ldo, const TcNorm& nm, const TcRope& rp) {
    float c[G][4];
#pragma unroll
    for (int j = 0; j < G; j++) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
    int tile = -1, ntiles = 0;  // -1: the block's own (gemv_tc_epilogue)
#if defined(GEMV_PAIR) && GEMV_PAIR
    if constexpr (PAIR > 1) {
        extern __shared__ __align__(16) uint4 tc_xring[];
        gemv_tc_main_pair<U, G>(x, W, M, N, K, c, tc_xring);
        ntiles = (N + TC_ROWS - 1) / TC_ROWS, tile = 2 * (int)blockIdx.x + (int)(threadIdx.x >> 8);
    } else
#endif
        gemv_tc_main<U, G>(x, W, M, N, K, c);
#pragma unroll
    for (int j = 0; j < G; j++) {
        const int m0 = 8 * j;
        if (m0 >= M) break;  // uniform over the block
        if (j) __syncthreads();  // the previous group's epilogue has read the shared sums
        TcNorm nj = nm;
        if (nj.ss_in) nj.ss_in += (size_t)m0 * nj.ss_nparts;
        if (nj.xw) nj.xw += (size_t)m0 * N;
        if (nj.ss_out) nj.ss_out += (size_t)m0 * (PAIR > 1 ? (unsigned)ntiles : gridDim.x);
        TcRope rj = rp;
        void* oj;
        if constexpr (EPI == EPI_ROPE_KV) {
            rj.positions += m0;
            rj.slots += m0;
            oj = static_cast<bf16*>(out) + (size_t)m0 * rp.H * rp.D;
        } else if constexpr (EPI == EPI_SWIGLU || EPI == EPI_GEGLU) {
            oj = static_cast<bf16*>(out) + (size_t)m0 * ldo;
        } else {
            oj = static_cast<float*>(out) + (size_t)m0 * ldo;
        }
        if constexpr (PAIR > 1)
            gemv_tc_epilogue<EPI, PAIR>(c[j], bias, oj, tile < ntiles ? min(M - m0, 8) : 0, N, K, ldo, nj, rj, 0, tile,
                                        ntiles);
        else
            gemv_tc_epilogue<EPI>(c[j], bias, oj, min(M - m0, 8), N, K, ldo, nj, rj, 0);
    }
}

// Entry points: store / acc, swiglu / geglu, rope, by a variant's steps in flight U, groups G, blocks
// per SM MINB and PAIR (the ones below; gemv_pair.cu's). Instantiated unless GEMV_EPILOGUES_ONLY
// (gemv_q.cu and gemv_pair.cu compile the main loop and epilogues above, and entry points of their own).
// MINB: blocks per SM the register allocation must allow. Without it ptxas sinks each load down
// to its mma (3 loads in flight per warp); with it every load of a batch issues first.
// store / acc: out fp32 [M, ldo]; with nw, also the next norm's xw / ss_out.
#define GEMV_TC_LINEAR(NAME, U, G, MINB, EPI, PAIR)                                                              \
    extern "C" __global__ void __launch_bounds__(PAIR * TC_THREADS, MINB)                                   \
        NAME(const bf16* x, const bf16* W, const float* bias, float* out, int M, int N, int K, int ldo,       \
             const float* ss_in, int ss_nparts, float eps, const bf16* nw, bf16* xw, float* ss_out) {         \
        const TcNorm nm{ss_in, ss_nparts, eps, nw, xw, ss_out};                                              \
        const TcRope rp{};                                                                                   \
        gemv_tc_body<U, G, EPI, PAIR>(x, W, bias, out, M, N, K, ldo, nm, rp);                                    \
    }
// swiglu / geglu: out bf16 act [M, ldo]; no bias, no next norm.
#define GEMV_TC_SWIGLU(NAME, U, G, MINB, EPI, PAIR)                                                                 \
    extern "C" __global__ void __launch_bounds__(PAIR * TC_THREADS, MINB)                                   \
        NAME(const bf16* x, const bf16* W, bf16* out, int M, int N, int K, int ldo, const float* ss_in,       \
             int ss_nparts, float eps) {                                                                     \
        const TcNorm nm{ss_in, ss_nparts, eps, nullptr, nullptr, nullptr};                                   \
        const TcRope rp{};                                                                                   \
        gemv_tc_body<U, G, EPI, PAIR>(x, W, nullptr, out, M, N, K, ldo, nm, rp);                                \
    }
// rope: out bf16 q [M, H, D]; K and V into the cache.
#define GEMV_TC_ROPE(NAME, U, G, MINB, PAIR)                                                                     \
    extern "C" __global__ void __launch_bounds__(PAIR * TC_THREADS, MINB)                                   \
        NAME(const bf16* x, const bf16* W, const float* bias, bf16* out, int M, int N, int K, int ldo,        \
             const float* ss_in, int ss_nparts, float eps, const int* positions, const int* slots,            \
             const float* inv_freq, bf16* cache, int H, int KVH, int D, int block_size, long long block_stride, \
             int rotary_dim, float rope_factor) {                                                             \
        const TcNorm nm{ss_in, ss_nparts, eps, nullptr, nullptr, nullptr};                                   \
        const TcRope rp{positions, slots, inv_freq, cache, H, KVH, D, block_size, block_stride, rotary_dim,  \
                        rope_factor};                                                                        \
        gemv_tc_body<U, G, EPI_ROPE_KV, PAIR>(x, W, bias, out, M, N, K, ldo, nm, rp);                            \
    }

// Variants by rows: "" and "_u2" 1..8 rows (4 / 2 steps in flight, u2 for small matrices); "_r16",
// "_r32", "_r64": up to 16 / 32 / 64 rows (2 / 4 / 8 groups; fewer steps in flight, as the
// activation fragments take the registers).
// PAIR 2: a block of two tiles (gemv_pair.cu), 512 threads.
#define GEMV_TC_VARIANTS(SUFFIX, U, G, MINB, PAIR)                                  \
    GEMV_TC_LINEAR(gemv_tc_store##SUFFIX, U, G, MINB, EPI_STORE, PAIR)              \
    GEMV_TC_LINEAR(gemv_tc_acc##SUFFIX, U, G, MINB, EPI_ACC, PAIR)                  \
    GEMV_TC_SWIGLU(gemv_tc_swiglu##SUFFIX, U, G, MINB, EPI_SWIGLU, PAIR)            \
    GEMV_TC_SWIGLU(gemv_tc_geglu##SUFFIX, U, G, MINB, EPI_GEGLU, PAIR)              \
    GEMV_TC_ROPE(gemv_tc_rope##SUFFIX, U, G, MINB, PAIR)
#ifndef GEMV_EPILOGUES_ONLY
GEMV_TC_VARIANTS(, 4, 1, 2, 1)
GEMV_TC_VARIANTS(_u2, 2, 1, 4, 1)
GEMV_TC_VARIANTS(_r16, R16_U, 2, R16_MINB, 1)
GEMV_TC_VARIANTS(_r32, R32_U, 4, R32_MINB, 1)
GEMV_TC_VARIANTS(_r64, R64_U, 8, R64_MINB, 1)
#endif  // GEMV_EPILOGUES_ONLY
