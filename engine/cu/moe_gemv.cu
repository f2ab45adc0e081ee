// moe_gemv.cu: a decode round's expert products (1..64 rows), grouped by expert (moe.cu routes
// and groups; its header describes the groups table, the slot table and the weight layouts).
//
// Grid (ceil(N / 16) for gate|up, max active experts = min(E, M * k)); block (bx, j) owns 16 weight rows of
// active expert j and every pair of its group, 8 at a time as the mma's 8 columns; blocks past
// n_active return. The load pattern and k order are gemv.cu's (gemv_tc), so each chosen expert is
// streamed from HBM once per round (a group of more than 8 pairs reads it again, from L2) and a
// pair's result does not depend on the other rows of the round.
//   moe_gate_up: act bf16 [M*k, N/2] per pair = act(gate, up) of x[m] @ Wgu^T (+ bias); ss_in: the
//                fused RMSNorm (gemv.cu).
//   moe_down:    grid (ceil(N / 128), ...): y fp32 [M*k, N] per pair = act[pair] @ Wd^T (+ bias); then
//                the last block of each 128-column tile to finish (a per-tile counter it resets)
//                combines those columns: x[m] += sum over slots s = 0..k-1 of weights[m, s] *
//                y[m*k + s] (fixed order), and with nw the next norm's xw = bf16(h * nw) and
//                ss_out[m, bx] = sum of h^2 over the tile (ss_nparts = ceil(N / 128)).
// Preconditions (wrapper): N % 8 == 0 (float4 / 4-column combine), M <= 64.
// Compile-time: MOE_THREADS (256); MOE_MX (0 or 1; with 1, MX_U and MX_DOWN_SPLIT): the pools hold MXFP4 blobs (engine/cu/mxfp4.py's
// layout; stride in bytes) instead of bf16, and moe_mx_dequant is built for prefill. A quad's 4 lanes
// read one 32-value block of a row at a time, so each mma's k values share the row's scale: the mma
// sums the unscaled e2m1 values (bf16, exact), the scale multiplies its fp32 result.

#ifndef MOE_THREADS
#error "MOE_THREADS is defined by engine/backends/cuda/moe.py"
#endif
static_assert(MOE_THREADS == 256, "moe_gemv: 8 warps");
#define EX_ROWS 16
#define EX_U 4
#define DOWN_ROWS 128
#define DOWN_MAX_K 16
#ifndef MOE_MX
#define MOE_MX 0
#endif
#if MOE_MX
typedef unsigned char wt_t;  // a pool's unit: MXFP4 blobs are addressed in bytes
#define MX_GROUP 128         // values a row group: 4 blocks, 64 bytes, 16 a lane
#if !defined(MX_U) || !defined(MX_DOWN_SPLIT)
#error "MX_U and MX_DOWN_SPLIT are defined by engine/backends/cuda/moe.py (MX_DEFINES)"
#endif
#else
typedef bf16 wt_t;
#endif

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

#if MOE_MX
// mx_decode, mx_scale, mx_scale_of: common.cuh (moe_gemm.cu reads MXFP4 tiles too).
__device__ __forceinline__ uint32_t ld_u32_if(const uint32_t* p, bool pred) { return pred ? __ldg(p) : 0u; }

// c += rows g, g + 8 of an MXFP4 blob (wa_p / wb_p: the rows' nibbles at this lane's 16 bytes of
// group 0; sa_p / sb_p: their scales) times column g's activations x_p (bf16 [K]), over row groups
// G0, G0 + step, .. < nG (MX_U of them in flight).
__device__ __forceinline__ void mx_rows(float* c, const uint4* wa_p, const uint4* wb_p, const uint32_t* sa_p,
                                        const uint32_t* sb_p, bool ra, bool rb, const uint4* x_p, bool rx, int K8,
                                        int G0, int step, int nG) {
    const int t = threadIdx.x & 3;
    for (; G0 < nG; G0 += step * MX_U) {
        uint4 wa[MX_U], wb[MX_U], xv[MX_U][4];
        uint32_t sa[MX_U], sb[MX_U];
#pragma unroll
        for (int u = 0; u < MX_U; u++) {
            const int G = G0 + u * step;
            const bool ok = G < nG;
            wa[u] = ld_stream_if(wa_p + 4 * G, ok && ra);
            wb[u] = ld_stream_if(wb_p + 4 * G, ok && rb);
            sa[u] = ld_u32_if(sa_p + G, ok && ra);
            sb[u] = ld_u32_if(sb_p + G, ok && rb);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int ch = (4 * G + j) * 4 + t;  // 8 values of block 4G + j
                xv[u][j] = ldg_if(x_p + ch, ok && rx && ch < K8);
            }
        }
#pragma unroll
        for (int u = 0; u < MX_U; u++) {
            const uint32_t qa[4] = {wa[u].x, wa[u].y, wa[u].z, wa[u].w}, qb[4] = {wb[u].x, wb[u].y, wb[u].z, wb[u].w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float d[4] = {0.f, 0.f, 0.f, 0.f};
                tc_step(d, mx_decode(qa[j]), mx_decode(qb[j]), xv[u][j]);
                const float fa = mx_scale_of(sa[u], j), fb = mx_scale_of(sb[u], j);
                c[0] += d[0] * fa;
                c[1] += d[1] * fa;
                c[2] += d[2] * fb;
                c[3] += d[3] * fb;
            }
        }
    }
}

// c += rows nr, nr + 8 (ra / rb: they exist) of the N x K blob W times x_p, over groups G0, G0 + step, ..
__device__ __forceinline__ void mx_accumulate(float* c, const unsigned char* W, int nr, bool ra, bool rb, int N,
                                              int K, const uint4* x_p, bool rx, int G0, int step) {
    const int t = threadIdx.x & 3, Kp = (K + MX_GROUP - 1) / MX_GROUP * MX_GROUP;
    const size_t row_a = ra ? nr : 0, row_b = rb ? nr + 8 : 0;
    const unsigned char* S = W + (size_t)N * (Kp / 2);
    mx_rows(c, reinterpret_cast<const uint4*>(W + row_a * (Kp / 2)) + t,
            reinterpret_cast<const uint4*>(W + row_b * (Kp / 2)) + t,
            reinterpret_cast<const uint32_t*>(S + row_a * (Kp / 32)),
            reinterpret_cast<const uint32_t*>(S + row_b * (Kp / 32)), ra, rb, x_p, rx, K >> 3, G0, step,
            Kp / MX_GROUP);
}
#endif

// This warp's partial of W rows n0 + g, n0 + g + 8 times column g's activation row, into red.
__device__ __forceinline__ void ex_accumulate(const wt_t* W, const bf16* xrow, bool rx, int n0, int N, int K,
                                              float (*red)[EX_ROWS][8]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool ra = n0 + g < N, rb = n0 + g + 8 < N;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#if MOE_MX
    mx_accumulate(c, W, n0 + g, ra, rb, N, K, reinterpret_cast<const uint4*>(xrow), rx, warp, 8);
#else
    const int K8 = K >> 3;
    const uint4* wa_p = reinterpret_cast<const uint4*>(W) + (size_t)(ra ? n0 + g : 0) * K8;
    const uint4* wb_p = reinterpret_cast<const uint4*>(W) + (size_t)(rb ? n0 + g + 8 : 0) * K8;
    const uint4* x_p = reinterpret_cast<const uint4*>(xrow);
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
            for (int h = 0; h < 2; h++) tc_step(c, wa[u][h], wb[u][h], xv[u][h]);
    }
#endif
    red[warp][g][2 * t] = c[0];
    red[warp][g][2 * t + 1] = c[1];
    red[warp][g + 8][2 * t] = c[2];
    red[warp][g + 8][2 * t + 1] = c[3];
}

// act bf16 [M*k, N/2] per pair = act(gate, up) of x[m] @ Wgu^T (+ bias); ss_in: fused RMSNorm.
extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2)
    moe_gate_up(const bf16* __restrict__ x, const float* __restrict__ ss_in, int ss_nparts, float eps,
                const wt_t* __restrict__ pool, long long stride, const int* __restrict__ slot_of,
                const float* __restrict__ bias, const int* __restrict__ grp, int E, int tmax, int k, int N,
                int K, bf16* __restrict__ act, int oai, float limit) {
    const Groups G = groups(grp, E, tmax);
    const int j = blockIdx.y;
    if (j >= G.n_active) return;
    const int e = G.active[j], p0 = G.off[j], cnt = G.off[j + 1] - p0;
    const wt_t* W = pool + (size_t)slot_of[e] * stride;
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

// moe_down: a warp owns 16 weight rows over all of K (K is short: I), so a block covers DOWN_ROWS
// = 128 output columns and needs no cross-warp reduction; the pair's result goes straight to y.
// MOE_MX with MX_DOWN_SPLIT: grid (ceil(N / 16), ...), a block of 16 rows with K split over its warps.
extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2)
    moe_down(const bf16* __restrict__ act, const wt_t* __restrict__ pool, long long stride,
             const int* __restrict__ slot_of, const float* __restrict__ bias, const int* __restrict__ grp, int E,
             int tmax, int N, int K, float* __restrict__ y, int* __restrict__ done, const float* __restrict__ weights,
             int k, int M, float* __restrict__ x, const bf16* __restrict__ nw, bf16* __restrict__ xw,
             float* __restrict__ ss_out) {
    const Groups G = groups(grp, E, tmax);
    const int j = blockIdx.y;
    if (j >= G.n_active) return;
    const int e = G.active[j], p0 = G.off[j], cnt = G.off[j + 1] - p0;
    const wt_t* W = pool + (size_t)slot_of[e] * stride;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if MOE_MX && MX_DOWN_SPLIT
    // 16 rows a block (EX_ROWS), K split over the 8 warps as in moe_gate_up: 8 x the bf16 build's
    // blocks, so a round of a few experts still fills the card (its K rows are 4x shorter in bytes).
    // A column tile (DOWN_ROWS) is per_tile blocks; its last one to finish combines it.
    const int tile = blockIdx.x / (DOWN_ROWS / EX_ROWS), ntiles = (N + DOWN_ROWS - 1) / DOWN_ROWS;
    const int per_tile = min(DOWN_ROWS / EX_ROWS, (N - tile * DOWN_ROWS + EX_ROWS - 1) / EX_ROWS);
    const int n0 = tile * DOWN_ROWS, r0 = blockIdx.x * EX_ROWS;
#define DOWN_TILE tile
#define DOWN_NTILES ntiles
#define DOWN_BLOCKS (G.n_active * per_tile)
    (void)t;
    __shared__ float red[8][EX_ROWS][8];
    for (int c0 = 0; c0 < cnt; c0 += 8) {
        const bool rx = c0 + g < cnt;
        __syncthreads();  // the previous column group's epilogue is done with red
        ex_accumulate(W, act + (size_t)(rx ? G.pairs[p0 + c0 + g] : 0) * K, rx, r0, N, K, red);
        __syncthreads();
        if (threadIdx.x < 8 * EX_ROWS) {
            const int r = threadIdx.x >> 3, cc = threadIdx.x & 7;
            if (c0 + cc < cnt && r0 + r < N) {
                float v = 0.f;
#pragma unroll
                for (int w = 0; w < 8; w++) v += red[w][r][cc];
                y[(size_t)G.pairs[p0 + c0 + cc] * N + r0 + r] = v + (bias ? bias[(size_t)e * N + r0 + r] : 0.f);
            }
        }
    }
#else
#define DOWN_TILE blockIdx.x
#define DOWN_NTILES gridDim.x
#define DOWN_BLOCKS G.n_active
    const int n0 = blockIdx.x * DOWN_ROWS, nb = n0 + warp * 16;
    const bool ra = nb + g < N, rb = nb + g + 8 < N;
#if !MOE_MX
    const int K8 = K >> 3, steps = (K8 + 7) / 8;
    const uint4* wa_p = reinterpret_cast<const uint4*>(W) + (size_t)(ra ? nb + g : 0) * K8;
    const uint4* wb_p = reinterpret_cast<const uint4*>(W) + (size_t)(rb ? nb + g + 8 : 0) * K8;
#endif
    for (int c0 = 0; c0 < cnt; c0 += 8) {
        const bool rx = c0 + g < cnt;
        const uint4* x_p = reinterpret_cast<const uint4*>(act + (size_t)(rx ? G.pairs[p0 + c0 + g] : 0) * K);
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#if MOE_MX
        mx_accumulate(c, W, nb + g, ra, rb, N, K, x_p, rx, 0, 1);
#else
        for (int s0 = 0; s0 < steps; s0 += EX_U) {
            uint4 wa[EX_U][2], wb[EX_U][2], xv[EX_U][2];
#pragma unroll
            for (int u = 0; u < EX_U; u++) {
                const int s = s0 + u;
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
                for (int h = 0; h < 2; h++) tc_step(c, wa[u][h], wb[u][h], xv[u][h]);
        }
#endif
#pragma unroll
        for (int h = 0; h < 2; h++) {  // c[h]: row nb + g, column 2t + h; c[2 + h]: row nb + g + 8
            const int col = c0 + 2 * t + h;
            if (col >= cnt) continue;
            float* yp = y + (size_t)G.pairs[p0 + col] * N;
            if (ra) yp[nb + g] = c[h] + (bias ? bias[(size_t)e * N + nb + g] : 0.f);
            if (rb) yp[nb + g + 8] = c[2 + h] + (bias ? bias[(size_t)e * N + nb + g + 8] : 0.f);
        }
    }
#endif
    // The last expert block of this column tile combines it: warp per row, 4 columns a lane.
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(done + DOWN_TILE, 1) == DOWN_BLOCKS - 1;
        if (last) done[DOWN_TILE] = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int n = n0 + lane * 4;
    for (int m = warp; m < M; m += 8) {
        float q = 0.f;
        if (n < N) {
            float4 yv[DOWN_MAX_K];
            float wv[DOWN_MAX_K];
#pragma unroll
            for (int s = 0; s < DOWN_MAX_K; s++) {  // every slot's load in flight, then a fixed-order sum
                if (s < k) {
                    yv[s] = __ldcg(reinterpret_cast<const float4*>(y + ((size_t)m * k + s) * N + n));
                    wv[s] = __ldcg(weights + (size_t)m * k + s);
                }
            }
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int s = 0; s < DOWN_MAX_K; s++) {
                if (s < k) {
                    acc.x += wv[s] * yv[s].x;
                    acc.y += wv[s] * yv[s].y;
                    acc.z += wv[s] * yv[s].z;
                    acc.w += wv[s] * yv[s].w;
                }
            }
            float4* xp = reinterpret_cast<float4*>(x + (size_t)m * N + n);
            float4 h = *xp;
            h.x += acc.x; h.y += acc.y; h.z += acc.z; h.w += acc.w;
            *xp = h;
            if (nw != nullptr) {
                const uint2 wn = *reinterpret_cast<const uint2*>(nw + n);
                *reinterpret_cast<uint2*>(xw + (size_t)m * N + n) =
                    make_uint2(pack_bf162(h.x * bf_lo(wn.x), h.y * bf_hi(wn.x)), pack_bf162(h.z * bf_lo(wn.y), h.w * bf_hi(wn.y)));
                q = h.x * h.x + h.y * h.y + h.z * h.z + h.w * h.w;
            }
        }
        q = warp_sum(q);
        if (nw != nullptr && lane == 0) ss_out[(size_t)m * DOWN_NTILES + DOWN_TILE] = q;
    }
}
#undef DOWN_TILE
#undef DOWN_NTILES
#undef DOWN_BLOCKS

#if MOE_MX
// moe_mx_dequant: out bf16 [E, N, K] = each expert's N x K blob (pool + slot_of[e] * stride) as bf16
// (exact: a prefill chunk's moe_gemm reads it). Grid (x, E); a thread a u32 (8 values) at a time.
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_mx_dequant(const unsigned char* __restrict__ pool, long long stride, const int* __restrict__ slot_of, int N,
                   int K, bf16* __restrict__ out) {
    const int e = blockIdx.y, Kp = (K + MX_GROUP - 1) / MX_GROUP * MX_GROUP;
    const unsigned char* W = pool + (size_t)slot_of[e] * stride;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(W);
    const unsigned char* S = W + (size_t)N * (Kp / 2);
    bf16* o = out + (size_t)e * N * K;
    const long long total = (long long)N * (Kp / 8);
    for (long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x; w < total; w += (long long)gridDim.x * blockDim.x) {
        const int row = (int)(w / (Kp / 8)), r = (int)(w % (Kp / 8));  // r: group r / 16, lane (r / 4) % 4, block r % 4
        const int blk = 4 * (r >> 4) + (r & 3), k0 = blk * 32 + 8 * ((r >> 2) & 3);
        if (k0 >= K) continue;
        const float f = mx_scale(S[(size_t)row * (Kp / 32) + blk]);
        const uint4 v = mx_decode(__ldg(words + w));
        *reinterpret_cast<uint4*>(o + (size_t)row * K + k0) =
            make_uint4(pack_bf162(bf_lo(v.x) * f, bf_hi(v.x) * f), pack_bf162(bf_lo(v.y) * f, bf_hi(v.y) * f),
                       pack_bf162(bf_lo(v.z) * f, bf_hi(v.z) * f), pack_bf162(bf_lo(v.w) * f, bf_hi(v.w) * f));
    }
}
#endif

#if MOE_MX
// moe_mx_pack: E experts' checkpoint MXFP4 (blocks [N, G, 16] in HF's nibble order, scales [N, G];
// expert e at e * N * G of each) -> their blobs (engine/cu/mxfp4.py's layout) at dst + e * stride.
// gu: the N rows are gate's N / 2 then up's, and blob row r is interleave_gate_up's (8-row groups of
// gate, then of up). Grid (x, E); a thread a u32 of nibbles, then a scale byte, at a time.
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_mx_pack(const uint32_t* __restrict__ blocks, const unsigned char* __restrict__ scales, int N, int G, int gu,
                unsigned char* __restrict__ dst, long long stride) {
    const int e = blockIdx.y, Kp = (G * 32 + MX_GROUP - 1) / MX_GROUP * MX_GROUP, nb = Kp / 32;
    const uint32_t* src = blocks + (size_t)e * N * G * 4;
    const unsigned char* ssrc = scales + (size_t)e * N * G;
    unsigned char* W = dst + (size_t)e * stride;
    uint32_t* words = reinterpret_cast<uint32_t*>(W);
    unsigned char* S = W + (size_t)N * (Kp / 2);
    const long long step = (long long)gridDim.x * blockDim.x, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    auto src_row = [&](int r) {
        if (!gu) return r;
        const int q = r >> 4, w = r & 15;
        return w < 8 ? 8 * q + w : N / 2 + 8 * q + w - 8;
    };
    for (long long w = first; w < (long long)N * (Kp / 8); w += step) {
        const int row = (int)(w / (Kp / 8)), r = (int)(w % (Kp / 8));  // r: group r / 16, lane (r / 4) % 4, block r % 4
        const int blk = 4 * (r >> 4) + (r & 3), t = (r >> 2) & 3;
        uint32_t x = blk < G ? __ldg(src + ((size_t)src_row(row) * G + blk) * 4 + t) : 0u;
        uint32_t d = (x ^ (x >> 4)) & 0x00f000f0u;  // nibbles v0..v7 -> v0 v2 v4 v6 v1 v3 v5 v7
        x ^= d ^ (d << 4);
        d = (x ^ (x >> 8)) & 0x0000ff00u;
        words[w] = x ^ d ^ (d << 8);
    }
    for (long long i = first; i < (long long)N * nb; i += step) {
        const int row = (int)(i / nb), blk = (int)(i % nb);
        S[i] = blk < G ? ssrc[(size_t)src_row(row) * G + blk] : 0;
    }
}
#endif
