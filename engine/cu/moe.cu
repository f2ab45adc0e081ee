// moe.cu: sparse mixture-of-experts layer (engine.models.ops.MoE) on the device.
//
// A MoE layer is 5 launches, the same in a decode round (graph-captured: nothing here reads
// a host decision) and in a prefill chunk, except for the expert products:
//   moe_router   logits fp32 [M, E] = x @ Wr^T (+ br), Wr bf16 [E, K]; decode rounds pass the
//                fused-RMSNorm partials (ss_in) as gemv.cu does.
//   moe_route    softmax fp32 over E, top-k (ties: lower id), optional renormalisation, into
//                ids int [M, k] / weights fp32 [M, k]; then groups the M*k (row, slot) "pairs"
//                by expert id: the groups table below. One block, so it runs entirely on the
//                device and the next kernels read the grouping from memory.
//   experts      decode: moe_gate_up + moe_down, grouped GEMVs that stream each expert chosen
//                by any row of the round once. Prefill: moe_gemm_gu + moe_gemm_down, tensor-core
//                GEMMs over 128-pair tiles of one expert each (rows gathered through the group).
//   moe_combine  x[m] += sum over slots s in order 0..k-1 of weights[m, s] * y[m*k + s]; in a
//                decode round also the next RMSNorm's inputs (xn, ss partials), as gemv.cu's acc.
//
// Groups (int32, written by moe_route): [0] n_active, [1] n_tiles, active[E] (the experts chosen
// by some row, ascending id), off[E + 1] (their first pair in `pairs`), tiles[3 * tmax] (prefill:
// expert, first pair, count <= 128), pairs[M * k] (pair index m*k + s, grouped by expert; order
// inside a group is arbitrary: every output element of an mma is its own dot product in a fixed
// k order, so a pair's result does not depend on its neighbours or on the other rows).
//
// Expert weights are read through a slot table: expert e of a layer is at pool + slot_of[e] *
// stride (fully resident: the layer's own [E, ...] arrays and slot_of = identity; with the expert
// cache: a shared pool of slots, engine/backends/cuda/expert_cache.py). gate|up bf16 [2I, K] per
// expert is interleaved in 8-row groups (rows 16j..16j+7 gate 8j.., 16j+8.. up 8j..), as gemv.cu's
// swiglu; its bias fp32 [E, 2I] the same way. down bf16 [H, I], bias fp32 [E, H].
// Activations: oai == 0: silu(g) * u; oai == 1: gpt-oss's (clamp(u) + 1) * g * sigmoid(1.702 g),
// g = min(gate, limit) (limit = +inf for none).
// Preconditions (wrapper, engine/backends/cuda/moe.py): K % 8 == 0, I % 8 == 0, E <= 256, k <= 16.
// Compile-time: MOE_THREADS (256).

#ifndef MOE_THREADS
#error "MOE_THREADS is defined by engine/backends/cuda/moe.py"
#endif
static_assert(MOE_THREADS == 256, "moe: 8 warps");
#define EX_ROWS 16
#define EX_U 4
#define ROUTE_THREADS 1024
#define MAX_E 256
#define MAX_K 16

struct Groups {
    int n_active, n_tiles;
    const int *active, *off, *tiles, *pairs;
};

__device__ __forceinline__ Groups groups(const int* g, int E, int tmax) {
    return Groups{g[0], g[1], g + 2, g + 2 + E, g + 3 + 2 * E, g + 3 + 2 * E + 3 * tmax};
}

__device__ __forceinline__ float act_fn(float g, float u, int oai, float limit) {
    if (oai) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
        return (u + 1.f) * (g / (1.f + expf(-1.702f * g)));
    }
    return g / (1.f + expf(-g)) * u;
}

// ---- router -----------------------------------------------------------------------------------
// Grid (ceil(E / 8), ceil(M / 8)); warp w owns expert 8 * blockIdx.x + w and 8 rows. A lane
// takes 16-byte chunks lane, lane + 32, ... of K; rows are summed by the butterfly (fixed order).
// bias_ld: 0 = one bias vector (the model's), E = a bias row per row (tests and benchmarks script
// the routing with it).
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_router(const bf16* __restrict__ x, const float* __restrict__ ss_in, int ss_nparts, float eps,
               const bf16* __restrict__ W, const float* __restrict__ bias, int bias_ld, float* __restrict__ logits,
               int M, int E, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = blockIdx.x * 8 + warp, m0 = blockIdx.y * 8;
    if (e >= E) return;
    const int K8 = K >> 3, rows = min(8, M - m0);
    const uint4* w4 = reinterpret_cast<const uint4*>(W) + (size_t)e * K8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int ch = lane; ch < K8; ch += 32) {
        const uint4 wv = ld_stream(w4 + ch);
#pragma unroll
        for (int r = 0; r < 8; r++) {
            if (r < rows) {
                const uint4 xv = reinterpret_cast<const uint4*>(x)[(size_t)(m0 + r) * K8 + ch];
                float a = acc[r];
                a = fmaf(bf_lo(wv.x), bf_lo(xv.x), a); a = fmaf(bf_hi(wv.x), bf_hi(xv.x), a);
                a = fmaf(bf_lo(wv.y), bf_lo(xv.y), a); a = fmaf(bf_hi(wv.y), bf_hi(xv.y), a);
                a = fmaf(bf_lo(wv.z), bf_lo(xv.z), a); a = fmaf(bf_hi(wv.z), bf_hi(xv.z), a);
                a = fmaf(bf_lo(wv.w), bf_lo(xv.w), a); a = fmaf(bf_hi(wv.w), bf_hi(xv.w), a);
                acc[r] = a;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 8; r++) {
        if (r >= rows) break;
        float v = warp_sum(acc[r]);
        if (ss_in != nullptr) {
            float ss = 0.f;
            for (int p = lane; p < ss_nparts; p += 32) ss += ss_in[(size_t)(m0 + r) * ss_nparts + p];
            v *= rsqrtf(warp_sum(ss) / K + eps);
        }
        if (lane == 0) logits[(size_t)(m0 + r) * E + e] = v + (bias ? bias[(size_t)(m0 + r) * bias_ld + e] : 0.f);
    }
}

// ---- routing and grouping (one block of ROUTE_THREADS) ----------------------------------------
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
    moe_route(const float* __restrict__ logits, int M, int E, int k, int normalize, int* __restrict__ ids,
              float* __restrict__ weights, int* __restrict__ grp, int tmax) {
    __shared__ int cnt[MAX_E], cursor[MAX_E];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = ROUTE_THREADS / 32;
    for (int e = threadIdx.x; e < E; e += ROUTE_THREADS) cnt[e] = 0;
    __syncthreads();
    for (int m = warp; m < M; m += nwarps) {  // a warp per row: lane holds experts lane + 32 i
        float p[MAX_E / 32];
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < MAX_E / 32; i++) {
            const int e = lane + 32 * i;
            p[i] = e < E ? logits[(size_t)m * E + e] : -INFINITY;
            mx = fmaxf(mx, p[i]);
        }
        mx = warp_max(mx);
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < MAX_E / 32; i++) {
            p[i] = lane + 32 * i < E ? expf(p[i] - mx) : -4.f;
            s += fmaxf(p[i], 0.f);
        }
        s = warp_sum(s);
#pragma unroll
        for (int i = 0; i < MAX_E / 32; i++) {  // past E: -4; NaN logits: -1 (chosen last); taken: -2
            if (p[i] >= 0.f) p[i] /= s;
            else if (p[i] != -4.f) p[i] = -1.f;
        }
        float sel[MAX_K];
        int sid[MAX_K];
        float tot = 0.f;
        for (int j = 0; j < k; j++) {  // the largest p left; ties: the lower id
            float bv = -3.f;
            int bi = 0x7fffffff;
#pragma unroll
            for (int i = 0; i < MAX_E / 32; i++)
                if (p[i] > bv) { bv = p[i]; bi = lane + 32 * i; }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
                const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
                if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
            }
#pragma unroll
            for (int i = 0; i < MAX_E / 32; i++)
                if (lane + 32 * i == bi) p[i] = -2.f;
            sel[j] = bv;
            sid[j] = bi;
            tot += bv;
        }
        if (lane == 0) {
            for (int j = 0; j < k; j++) {
                ids[(size_t)m * k + j] = sid[j];
                weights[(size_t)m * k + j] = normalize ? sel[j] / tot : sel[j];
                atomicAdd(&cnt[sid[j]], 1);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // active experts in id order, their offsets, prefill tiles
        int* active = grp + 2;
        int* off = active + E;
        int* tiles = off + E + 1;
        int na = 0, nt = 0, o = 0;
        for (int e = 0; e < E; e++) {
            cursor[e] = o;
            if (cnt[e] == 0) continue;
            active[na] = e;
            off[na] = o;
            for (int t = 0; t < cnt[e]; t += 128) {
                tiles[3 * nt] = e;
                tiles[3 * nt + 1] = o + t;
                tiles[3 * nt + 2] = min(128, cnt[e] - t);
                nt++;
            }
            o += cnt[e];
            na++;
        }
        off[na] = o;
        grp[0] = na;
        grp[1] = nt;
    }
    __syncthreads();
    int* pairs = grp + 3 + 2 * E + 3 * tmax;
    for (int q = threadIdx.x; q < M * k; q += ROUTE_THREADS) pairs[atomicAdd(&cursor[ids[q]], 1)] = q;
}

// ---- decode: grouped expert GEMVs -------------------------------------------------------------
// Grid (ceil(N / 16), max active experts); block (bx, j) owns 16 weight rows of active expert j
// and every pair of its group, 8 at a time as the mma's 8 columns. The load pattern and k order
// are gemv.cu's (gemv_tc): a weight byte is read from HBM once per round (a group of more than
// 8 pairs reads it again, from L2).
__device__ __forceinline__ void ex_step(float* c, const uint4& wa, const uint4& wb, const uint4& xv) {
    const uint32_t a0[4] = {wa.x, wb.x, wa.y, wb.y};
    const uint32_t a1[4] = {wa.z, wb.z, wa.w, wb.w};
    mma_bf16(c, a0, xv.x, xv.y);
    mma_bf16(c, a1, xv.z, xv.w);
}

// This warp's partial of W rows n0 + g, n0 + g + 8 times column g's activation row, into red.
__device__ __forceinline__ void ex_accumulate(const bf16* W, const bf16* xrow, bool rx, int n0, int N, int K,
                                              float (*red)[EX_ROWS][8]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int K8 = K >> 3;
    const bool ra = n0 + g < N, rb = n0 + g + 8 < N;
    const uint4* wa_p = reinterpret_cast<const uint4*>(W) + (size_t)(ra ? n0 + g : 0) * K8;
    const uint4* wb_p = reinterpret_cast<const uint4*>(W) + (size_t)(rb ? n0 + g + 8 : 0) * K8;
    const uint4* x_p = reinterpret_cast<const uint4*>(xrow);
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    const int steps = (K8 + 7) / 8;
    for (int s0 = warp; s0 < steps; s0 += 8 * EX_U) {
        uint4 wa[EX_U][2], wb[EX_U][2], xv[EX_U][2];
#pragma unroll
        for (int u = 0; u < EX_U; u++) {
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
        for (int u = 0; u < EX_U; u++)
#pragma unroll
            for (int h = 0; h < 2; h++) ex_step(c, wa[u][h], wb[u][h], xv[u][h]);
    }
    red[warp][g][2 * t] = c[0];
    red[warp][g][2 * t + 1] = c[1];
    red[warp][g + 8][2 * t] = c[2];
    red[warp][g + 8][2 * t + 1] = c[3];
}

// act bf16 [M*k, N/2] per pair = act(gate, up) of x[m] @ Wgu^T (+ bias); ss_in: fused RMSNorm.
extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2)
    moe_gate_up(const bf16* __restrict__ x, const float* __restrict__ ss_in, int ss_nparts, float eps,
                const bf16* __restrict__ pool, long long stride, const int* __restrict__ slot_of,
                const float* __restrict__ bias, const int* __restrict__ grp, int E, int tmax, int k, int N,
                int K, bf16* __restrict__ act, int oai, float limit) {
    const Groups G = groups(grp, E, tmax);
    const int j = blockIdx.y;
    if (j >= G.n_active) return;
    const int e = G.active[j], p0 = G.off[j], cnt = G.off[j + 1] - p0;
    const bf16* W = pool + (size_t)slot_of[e] * stride;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, n0 = blockIdx.x * EX_ROWS;
    __shared__ float red[8][EX_ROWS][8];
    __shared__ float rs[8];
    for (int c0 = 0; c0 < cnt; c0 += 8) {
        const bool rx = c0 + g < cnt;
        const int m = rx ? G.pairs[p0 + c0 + g] / k : 0;
        __syncthreads();  // the previous column group's epilogue is done with red / rs
        ex_accumulate(W, x + (size_t)m * K, rx, n0, N, K, red);
        if (ss_in != nullptr && c0 + warp < cnt) {  // warp w: column w's row scale
            const int mw = G.pairs[p0 + c0 + warp] / k;
            float ss = 0.f;
            for (int q = lane; q < ss_nparts; q += 32) ss += ss_in[(size_t)mw * ss_nparts + q];
            ss = warp_sum(ss);
            if (lane == 0) rs[warp] = rsqrtf(ss / K + eps);
        }
        __syncthreads();
        if (threadIdx.x < 64) {
            const int r = threadIdx.x >> 3, cc = threadIdx.x & 7;
            if (c0 + cc < cnt && n0 + r + 8 < N) {
                float gt = 0.f, up = 0.f;
#pragma unroll
                for (int w = 0; w < 8; w++) gt += red[w][r][cc];
#pragma unroll
                for (int w = 0; w < 8; w++) up += red[w][r + 8][cc];
                if (ss_in != nullptr) {
                    gt *= rs[cc];
                    up *= rs[cc];
                }
                if (bias != nullptr) {
                    gt += bias[(size_t)e * N + n0 + r];
                    up += bias[(size_t)e * N + n0 + r + 8];
                }
                const int p = G.pairs[p0 + c0 + cc];
                act[(size_t)p * (N >> 1) + (n0 >> 1) + r] = __float2bfloat16(act_fn(gt, up, oai, limit));
            }
        }
    }
}

// y fp32 [M*k, N] per pair = act[pair] @ Wd^T (+ bias).
extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2)
    moe_down(const bf16* __restrict__ act, const bf16* __restrict__ pool, long long stride,
             const int* __restrict__ slot_of, const float* __restrict__ bias, const int* __restrict__ grp, int E,
             int tmax, int N, int K, float* __restrict__ y) {
    const Groups G = groups(grp, E, tmax);
    const int j = blockIdx.y;
    if (j >= G.n_active) return;
    const int e = G.active[j], p0 = G.off[j], cnt = G.off[j + 1] - p0;
    const bf16* W = pool + (size_t)slot_of[e] * stride;
    const int lane = threadIdx.x & 31, g = lane >> 2, n0 = blockIdx.x * EX_ROWS;
    __shared__ float red[8][EX_ROWS][8];
    for (int c0 = 0; c0 < cnt; c0 += 8) {
        const bool rx = c0 + g < cnt;
        const int p = rx ? G.pairs[p0 + c0 + g] : 0;
        __syncthreads();
        ex_accumulate(W, act + (size_t)p * K, rx, n0, N, K, red);
        __syncthreads();
        if (threadIdx.x < EX_ROWS * 8) {
            const int r = threadIdx.x >> 3, cc = threadIdx.x & 7, n = n0 + r;
            if (c0 + cc < cnt && n < N) {
                float v = 0.f;
#pragma unroll
                for (int w = 0; w < 8; w++) v += red[w][r][cc];
                if (bias != nullptr) v += bias[(size_t)e * N + n];
                y[(size_t)G.pairs[p0 + c0 + cc] * N + n] = v;
            }
        }
    }
}

// ---- combine ----------------------------------------------------------------------------------
// Grid (ceil(H / 256), M). With nw: xw = bf16(h * nw), ss_out[m, blockIdx.x] = sum of h^2 over the
// block's 256 columns (the next GEMV's ss_in, ss_nparts = gridDim.x).
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_combine(const float* __restrict__ y, const float* __restrict__ weights, int k, float* __restrict__ x, int H,
                const bf16* __restrict__ nw, bf16* __restrict__ xw, float* __restrict__ ss_out) {
    __shared__ float scratch[32];
    const int m = blockIdx.y, n = blockIdx.x * MOE_THREADS + threadIdx.x;
    float q = 0.f;
    if (n < H) {
        float acc = 0.f;
        for (int s = 0; s < k; s++) acc += weights[(size_t)m * k + s] * y[((size_t)m * k + s) * H + n];
        const float h = x[(size_t)m * H + n] + acc;
        x[(size_t)m * H + n] = h;
        if (nw != nullptr) {
            xw[(size_t)m * H + n] = __float2bfloat16(h * __bfloat162float(nw[n]));
            q = h * h;
        }
    }
    if (nw != nullptr) {
        q = block_sum(q, scratch);
        if (threadIdx.x == 0) ss_out[(size_t)m * gridDim.x + blockIdx.x] = q;
    }
}
