// moe.cu: sparse mixture-of-experts layer (engine.models.ops.MoE): routing, grouping, combine.
//
// A layer's MoE, decode round (3 launches, graph-captured: nothing reads a host decision):
//   moe_router   logits fp32 [M, E] = x @ Wr^T (+ br), Wr bf16 [E, K]; decode rounds pass the
//                fused-RMSNorm partials (ss_in) as gemv.cu does. With `done`, its last block also
//                routes (route_body): softmax fp32 over E, top-k (ties: lower id), optional
//                renormalisation into ids int [M, k] / weights fp32 [M, k], then groups the M*k
//                (row, slot) "pairs" by expert id into the groups table below.
//   moe_gate_up, moe_down   moe_gemv.cu: grouped GEMVs streaming each chosen expert once; the
//                down kernel's last block per column tile does the combine.
// Prefill chunk: moe_router (no `done`), moe_route (route_body in one 1024-thread block), the
// grouped GEMMs of moe_gemm.cu, then moe_combine: x[m] += sum over slots s in order 0..k-1 of
// weights[m, s] * y[m*k + s].
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
#define ROUTE_THREADS 1024
#define MAX_E 256
#define MAX_K 16
#define ROUTER_CHUNKS 16

// ---- router -----------------------------------------------------------------------------------
// Grid (ceil(E / 8), M); warp w owns expert 8 * blockIdx.x + w of row blockIdx.y. A lane takes
// 16-byte chunks lane, lane + 32, ... of K (K <= 32 * 8 * ROUTER_CHUNKS), all loads in flight at
// once; the lanes are summed by the butterfly (fixed order).
// bias_ld: 0 = one bias vector (the model's), E = a bias row per row (tests and benchmarks script
// the routing with it).
__device__ __forceinline__ void router_body(const bf16* __restrict__ x, const float* __restrict__ ss_in,
                                            int ss_nparts, float eps, const bf16* __restrict__ W,
                                            const float* __restrict__ bias, int bias_ld, float* __restrict__ logits,
                                            int M, int E, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = blockIdx.x * 8 + warp, m = blockIdx.y;
    if (e >= E) return;
    const int K8 = K >> 3;
    const uint4* w4 = reinterpret_cast<const uint4*>(W) + (size_t)e * K8;
    const uint4* x4 = reinterpret_cast<const uint4*>(x) + (size_t)m * K8;
    uint4 wv[ROUTER_CHUNKS], xv[ROUTER_CHUNKS];
#pragma unroll
    for (int c = 0; c < ROUTER_CHUNKS; c++) {  // every load of the warp in flight at once
        const int ch = lane + 32 * c;
        wv[c] = ld_stream_if(w4 + ch, ch < K8);
        xv[c] = ldg_if(x4 + ch, ch < K8);
    }
    float a = 0.f;
#pragma unroll
    for (int c = 0; c < ROUTER_CHUNKS; c++) {
        a = fmaf(bf_lo(wv[c].x), bf_lo(xv[c].x), a); a = fmaf(bf_hi(wv[c].x), bf_hi(xv[c].x), a);
        a = fmaf(bf_lo(wv[c].y), bf_lo(xv[c].y), a); a = fmaf(bf_hi(wv[c].y), bf_hi(xv[c].y), a);
        a = fmaf(bf_lo(wv[c].z), bf_lo(xv[c].z), a); a = fmaf(bf_hi(wv[c].z), bf_hi(xv[c].z), a);
        a = fmaf(bf_lo(wv[c].w), bf_lo(xv[c].w), a); a = fmaf(bf_hi(wv[c].w), bf_hi(xv[c].w), a);
    }
    float v = warp_sum(a);
    if (ss_in != nullptr) {
        float ss = 0.f;
        for (int p = lane; p < ss_nparts; p += 32) ss += ss_in[(size_t)m * ss_nparts + p];
        v *= rsqrtf(warp_sum(ss) / K + eps);
    }
    if (lane == 0) logits[(size_t)m * E + e] = v + (bias ? bias[(size_t)m * bias_ld + e] : 0.f);
}

// ---- routing and grouping (one block) --------------------------------------------------------
// Any block size (a multiple of 32): a warp per row for softmax and top-k, then warp 0 lists
// the active experts and tiles (a warp scan), then every thread places pairs. logits are read through L2 (the
// fused router's last block reads what other blocks wrote).
__device__ void route_body(const float* logits, int M, int E, int k, int normalize, int* __restrict__ ids,
                           float* __restrict__ weights, int* __restrict__ grp, int tmax) {
    __shared__ int cnt[MAX_E], cursor[MAX_E];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int m = warp; m < M; m += nwarps) {  // a warp per row: lane holds experts lane + 32 i
        float p[MAX_E / 32];
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < MAX_E / 32; i++) {
            const int e = lane + 32 * i;
            p[i] = e < E ? __ldcg(logits + (size_t)m * E + e) : -INFINITY;
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
    if (warp == 0) {  // active experts in id order, their offsets, prefill tiles: lane l scans a run of experts
        int* active = grp + 2;
        int* off = active + E;
        int* tiles = off + E + 1;
        const int per = (E + 31) / 32, e0 = min(E, lane * per), e1 = min(E, e0 + per);
        int na = 0, np = 0, nt = 0;
        for (int e = e0; e < e1; e++) {
            na += cnt[e] > 0;
            np += cnt[e];
            nt += (cnt[e] + 127) / 128;
        }
        int sa = na, sp = np, st = nt;  // inclusive scans over lanes, then exclusive
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(FULL_MASK, sa, o), b = __shfl_up_sync(FULL_MASK, sp, o),
                      c = __shfl_up_sync(FULL_MASK, st, o);
            if (lane >= o) { sa += a; sp += b; st += c; }
        }
        sa -= na; sp -= np; st -= nt;
        for (int e = e0; e < e1; e++) {
            const int c = cnt[e];
            cursor[e] = sp;
            if (c == 0) continue;
            active[sa] = e;
            off[sa] = sp;
            for (int t = 0; t < c; t += 128) {
                tiles[3 * st] = e;
                tiles[3 * st + 1] = sp + t;
                tiles[3 * st + 2] = min(128, c - t);
                st++;
            }
            sp += c;
            sa++;
        }
        if (lane == 31) {
            off[sa] = sp;
            grp[0] = sa;
            grp[1] = st;
        }
    }
    __syncthreads();
    int* pairs = grp + 3 + 2 * E + 3 * tmax;
    for (int q = threadIdx.x; q < M * k; q += blockDim.x) pairs[atomicAdd(&cursor[ids[q]], 1)] = q;
}

// done != null (decode rounds): the last block to finish also routes and groups (route_body), so
// routing costs no launch of its own; done is a zeroed counter it resets.
extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2)
    moe_router(const bf16* __restrict__ x, const float* __restrict__ ss_in, int ss_nparts, float eps,
               const bf16* __restrict__ W, const float* __restrict__ bias, int bias_ld, float* __restrict__ logits,
               int M, int E, int K, int* __restrict__ done, int k, int normalize, int* __restrict__ ids,
               float* __restrict__ weights, int* __restrict__ grp, int tmax) {
    router_body(x, ss_in, ss_nparts, eps, W, bias, bias_ld, logits, M, E, K);
    if (done == nullptr) return;
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int n = gridDim.x * gridDim.y;
        last = atomicAdd(done, 1) == n - 1;
        if (last) *done = 0;  // self-resetting for the next layer
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    route_body(logits, M, E, k, normalize, ids, weights, grp, tmax);
}
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
    moe_route(const float* __restrict__ logits, int M, int E, int k, int normalize, int* __restrict__ ids,
              float* __restrict__ weights, int* __restrict__ grp, int tmax) {
    route_body(logits, M, E, k, normalize, ids, weights, grp, tmax);
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
