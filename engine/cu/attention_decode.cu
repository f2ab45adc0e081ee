// attention_decode.cu: grouped-query decode attention over the paged KV cache,
// split along the sequence (flash-decoding), the splits merged in the same kernel.
//
// decode_attn: grid (KVH, M, NUM_SPLITS), block DECODE_THREADS = 128 (4 warps).
//   q bf16 [M, H, D] (rotated); positions int32 [M] (context = position + 1: the
//   round's own token is already in the cache); block_tables int32 [M, bt_stride];
//   cache bf16 [num_blocks][L][2][block_size][KVH][D], passed offset to the layer.
//   A block handles one lane, one KV head with its G = H / KVH query heads, and one
//   contiguous range of chunk = max(SUB, roundup(ceil(n / NUM_SPLITS), SUB)) of the lane's
//   n visible keys [lo, ctx): lo = 0, or ctx - window with a sliding window (window > 0);
//   keys (and block-table entries) before lo are never read, so their pages may be gone;
//   blocks past the context return at once, so one fixed grid serves every round
//   (CUDA-graph friendly) and short contexts use few blocks. The range is walked in
//   sub-chunks of SUB keys with an online softmax (base 2):
//   scores: warps take keys round-robin, UNROLL (16; 8 at HEAD_DIM 256) keys' loads in flight at once, lanes hold
//   D/32 dims (a coalesced K row per warp), warp-sum per head into shared memory; one warp per head updates the
//   running max / sum; P.V: warps take keys, lanes hold D/32 dims in registers.
//   Writes unnormalised o_part fp32 [M, H, NUM_SPLITS, D] and ml fp32 [M, H, NUM_SPLITS, 2].
//   The combine is fused: a context of one split (<= SUB keys) writes out directly; otherwise
//   each split block bumps counters[m * KVH + kh] after a __threadfence, and the last of the
//   lane's splits to arrive merges all of them (in split order, so the result does not depend
//   on which block is last) and resets the counter to 0 for the next call. counters int32
//   [M * KVH] must start zeroed.
// Scores: q . k * scale_log2 (the layer's scale times log2(e)); with cap_log2 > 0 (gemma2's
//   soft-cap) q . k * scale_log2 is scale / cap and the score is cap_log2 * tanh(that), cap_log2
//   = cap * log2(e). sinks fp32 [H] or null: head h's sinks[h] joins its softmax denominator
//   (gpt-oss), added once, after the splits are merged.
// Compile-time: HEAD_DIM (64, 128 or 256), GROUP (G <= 8), NUM_SPLITS, DECODE_THREADS (from the wrapper); SUB.

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 4
#endif
#ifndef NUM_SPLITS
#define NUM_SPLITS 32
#endif
#ifndef DECODE_THREADS
#error "DECODE_THREADS is defined by engine/cu/kernels.py"
#endif
static_assert(DECODE_THREADS == 128, "decode_attn: 4 warps walk the keys and reduce in shared memory");
#define SUB 64
// DECODE_MMA 1 (the default): the scores on the tensor cores. Q is the A operand of mma.m16n8k16 (row r =
// the KV head's query head r, rows >= GROUP zero) and 8 keys at a time the B operand, the head
// dimension walked in steps of 64 with gemv.cu's permuted k order (a thread loads 16-byte chunks t and
// t + 4 of its row g of Q and of key g; the same permutation on both sides, so no shuffles), fp32
// accumulation, times scale_log2 after the sum. A warp takes 16 keys of a sub-chunk (4 warps: SUB).
// 0: the FMA scores of before (lanes hold D / 32 dims, a warp sum per key and head).
#ifndef DECODE_MMA
#define DECODE_MMA 1
#endif
// DECODE_VPRE 1 (the default at HEAD_DIM 64 / 128, where a sub-chunk is one pass of UNROLL keys a
// warp): a warp's V rows of a sub-chunk are loaded together with its K rows, before the scores and the
// softmax they do not depend on, so a sub-chunk costs one memory round trip instead of two (the same
// arithmetic; 0: the V loads after the softmax, as before; bench/attn_probe.py times both).
#ifndef DECODE_VPRE
#define DECODE_VPRE (HEAD_DIM <= 128)
#endif
#if DECODE_VPRE && HEAD_DIM > 128
#error "DECODE_VPRE: HEAD_DIM 64 or 128"
#endif
// DECODE_PIPE 1 (an experiment for bench/attn_probe.py; 0 in the backend's build, not yet run on a
// card): a block of several sub-chunks (contexts past 64 x NUM_SPLITS keys) loads sub-chunk i + 1's K
// and V rows before sub-chunk i's scores, softmax and P.V, so only the first sub-chunk waits for memory.
// HEAD_DIM 128 with DECODE_MMA and DECODE_VPRE; the same arithmetic.
#ifndef DECODE_PIPE
#define DECODE_PIPE 0
#endif
#if DECODE_PIPE && !(HEAD_DIM == 128 && DECODE_MMA && DECODE_VPRE)
#error "DECODE_PIPE: HEAD_DIM 128, DECODE_MMA, DECODE_VPRE"
#endif
#define DSTEPS (HEAD_DIM / 64)
#if HEAD_DIM == 256
#define UNROLL 8  // 8 values a lane per key: 8 keys in flight per warp (16 would spill registers)
#else
#define UNROLL 16  // keys in flight per warp: 4 warps x 16 = a whole SUB of 64 keys in one pass
#endif
#define E (HEAD_DIM / 32)

__device__ __forceinline__ int split_chunk(int ctx) {
    const int c = (ctx + NUM_SPLITS - 1) / NUM_SPLITS;
    return max(SUB, (c + SUB - 1) / SUB * SUB);
}

__device__ __forceinline__ void load_row(const bf16* p, float* f) {
#if E == 8
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    f[0] = bf_lo(v.x); f[1] = bf_hi(v.x); f[2] = bf_lo(v.y); f[3] = bf_hi(v.y);
    f[4] = bf_lo(v.z); f[5] = bf_hi(v.z); f[6] = bf_lo(v.w); f[7] = bf_hi(v.w);
#elif E == 4
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    f[0] = bf_lo(v.x); f[1] = bf_hi(v.x); f[2] = bf_lo(v.y); f[3] = bf_hi(v.y);
#else
    const uint32_t v = *reinterpret_cast<const uint32_t*>(p);
    f[0] = bf_lo(v); f[1] = bf_hi(v);
#endif
}

extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
    decode_attn(const bf16* __restrict__ q, const int* __restrict__ positions, const int* __restrict__ block_tables,
                int bt_stride, const bf16* __restrict__ cache, long long block_stride, int block_size, int KVH,
                float scale_log2, float* __restrict__ o_part, float* __restrict__ ml, int* __restrict__ counters,
                bf16* __restrict__ out, int window, float cap_log2, const float* __restrict__ sinks) {
    pdl_wait();  // PDL: the kernel before has written what this one reads (common.cuh)
    pdl_launch_dependents();
    const int kh = blockIdx.x, m = blockIdx.y, sp = blockIdx.z;
    const int ctx = positions[m] + 1;
    const int lo = window > 0 ? max(0, ctx - window) : 0;
    const int chunk = split_chunk(ctx - lo);
    const int tb = lo + sp * chunk;
    if (tb >= ctx) return;
    const int te = min(ctx, tb + chunk);
    const int H = KVH * GROUP;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __shared__ float sp_[GROUP][SUB];
    __shared__ float sacc[4][GROUP][HEAD_DIM];
    __shared__ float smax[GROUP], ssum[GROUP], scorr[GROUP];

#if DECODE_MMA
    const int g8 = lane >> 2, t4 = lane & 3;
    uint4 qa[DSTEPS][2];  // row g8 of the A operand: chunks t4 and t4 + 4 of each 64-dim step
#pragma unroll
    for (int st = 0; st < DSTEPS; st++)
#pragma unroll
        for (int c = 0; c < 2; c++)
            qa[st][c] = g8 < GROUP ? *reinterpret_cast<const uint4*>(q + ((size_t)m * H + kh * GROUP + g8) * HEAD_DIM +
                                                                   st * 64 + (t4 + 4 * c) * 8)
                                   : make_uint4(0u, 0u, 0u, 0u);
#else
    float qr[GROUP][E];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        float f[E];
        load_row(q + ((size_t)m * H + kh * GROUP + g) * HEAD_DIM + lane * E, f);
#pragma unroll
        for (int e = 0; e < E; e++) qr[g][e] = f[e] * scale_log2;
    }
#endif
    if (threadIdx.x < GROUP) { smax[threadIdx.x] = -INFINITY; ssum[threadIdx.x] = 0.f; }
    const int* bt = block_tables + (size_t)m * bt_stride;
    const size_t kv_half = (size_t)block_size * KVH * HEAD_DIM;
    float acc[GROUP][E];
#pragma unroll
    for (int g = 0; g < GROUP; g++)
#pragma unroll
        for (int e = 0; e < E; e++) acc[g][e] = 0.f;

#if DECODE_MMA
    // The warp's K tiles of sub-chunk [s0, s1): keys s0 + 16 warp + 8 h + g8, the scores' B operands;
    // past the sub-chunk a real key, its score unused.
    auto load_k = [&](int s0, int s1, uint4 (&kr)[2][DSTEPS][2]) {
        const int sb = s0 + 16 * warp;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int t = min(sb + 8 * h + g8, s1 - 1);
            const bf16* kp = cache + (size_t)bt[t / block_size] * block_stride +
                             ((size_t)(t % block_size) * KVH + kh) * HEAD_DIM;
#pragma unroll
            for (int st = 0; st < DSTEPS; st++)
#pragma unroll
                for (int c = 0; c < 2; c++)
                    kr[h][st][c] = *reinterpret_cast<const uint4*>(kp + st * 64 + (t4 + 4 * c) * 8);
        }
    };
#endif
#if DECODE_PIPE
    // A sub-chunk's K rows (the scores' B tiles) and V rows (4 bf16 a lane a key) as loaded.
    auto load_sub = [&](int s0, uint4 (&kr)[2][DSTEPS][2], uint2 (&vr)[UNROLL]) {
        const int s1 = min(te, s0 + SUB);
        if (s0 + 16 * warp < s1) load_k(s0, s1, kr);
#pragma unroll
        for (int j = 0; j < UNROLL; j++) {
            const int t = min(s0 + warp + 4 * j, s1 - 1);
            vr[j] = *reinterpret_cast<const uint2*>(cache + (size_t)bt[t / block_size] * block_stride + kv_half +
                                                    ((size_t)(t % block_size) * KVH + kh) * HEAD_DIM + lane * E);
        }
    };
    uint4 kcur[2][DSTEPS][2];
    uint2 vcur[UNROLL];
    load_sub(tb, kcur, vcur);
#endif
    for (int t0 = tb; t0 < te; t0 += SUB) {
        const int t1 = min(te, t0 + SUB), len = t1 - t0;
#if DECODE_PIPE
        const bool more = t0 + SUB < te;  // block-uniform
        uint4 knext[2][DSTEPS][2];
        uint2 vnext[UNROLL];
        if (more) load_sub(t0 + SUB, knext, vnext);  // in flight during this sub-chunk's math
        float vpre[UNROLL][E];
#pragma unroll
        for (int j = 0; j < UNROLL; j++) {
            vpre[j][0] = bf_lo(vcur[j].x), vpre[j][1] = bf_hi(vcur[j].x);
            vpre[j][2] = bf_lo(vcur[j].y), vpre[j][3] = bf_hi(vcur[j].y);
        }
#elif DECODE_VPRE
        float vpre[UNROLL][E];  // keys t0 + warp + 4 j: the P.V loop's, issued now
#pragma unroll
        for (int j = 0; j < UNROLL; j++) {
            const int t = min(t0 + warp + 4 * j, t1 - 1);
            load_row(cache + (size_t)bt[t / block_size] * block_stride + kv_half +
                         ((size_t)(t % block_size) * KVH + kh) * HEAD_DIM + lane * E, vpre[j]);
        }
#endif
#if DECODE_MMA
        const int kb = t0 + 16 * warp;  // this warp's keys: n-tile h holds keys kb + 8h .. kb + 8h + 7
        if (kb < t1) {
#if DECODE_PIPE
            uint4 (&kv)[2][DSTEPS][2] = kcur;
#else
            uint4 kv[2][DSTEPS][2];
            load_k(t0, t1, kv);
#endif
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float sc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int st = 0; st < DSTEPS; st++)
#pragma unroll
                    for (int c = 0; c < 2; c++) tc_step(sc, qa[st][c], make_uint4(0u, 0u, 0u, 0u), kv[h][st][c]);
                // sc[0], sc[1]: head g8's scores of keys kb + 8h + 2 t4 and the next (sc[2], sc[3]: zero rows)
                const int t = kb + 8 * h + 2 * t4;
                if (g8 < GROUP) {
                    if (t < t1) sp_[g8][t - t0] = sc[0] * scale_log2;
                    if (t + 1 < t1) sp_[g8][t + 1 - t0] = sc[1] * scale_log2;
                }
            }
        }
#else
        // Each warp keeps UNROLL keys' loads in flight before reducing any of them.
        for (int tw = t0 + warp; tw < t1; tw += 4 * UNROLL) {
            float kf[UNROLL][E];
#pragma unroll
            for (int j = 0; j < UNROLL; j++) {
                const int t = min(tw + 4 * j, t1 - 1);
                load_row(cache + (size_t)bt[t / block_size] * block_stride +
                             ((size_t)(t % block_size) * KVH + kh) * HEAD_DIM + lane * E, kf[j]);
            }
#pragma unroll
            for (int j = 0; j < UNROLL; j++)
#pragma unroll
                for (int g = 0; g < GROUP; g++) {
                    float s = 0.f;
#pragma unroll
                    for (int e = 0; e < E; e++) s = fmaf(qr[g][e], kf[j][e], s);
                    s = warp_sum(s);
                    if (lane == 0 && tw + 4 * j < t1) sp_[g][tw + 4 * j - t0] = s;
                }
        }
#endif
        __syncthreads();
        for (int g = warp; g < GROUP; g += 4) {
            // The soft-cap here, outside the unrolled score loop (inside, ptxas keeps fewer loads in flight).
            if (cap_log2 > 0.f)
                for (int i = lane; i < len; i += 32) sp_[g][i] = cap_log2 * tanhf(sp_[g][i]);
            float mx = smax[g];
            for (int i = lane; i < len; i += 32) mx = fmaxf(mx, sp_[g][i]);
            mx = warp_max(mx);
            float sum = 0.f;
            for (int i = lane; i < len; i += 32) {
                const float p = exp2f(sp_[g][i] - mx);
                sp_[g][i] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float c = exp2f(smax[g] - mx);
                scorr[g] = c;
                ssum[g] = ssum[g] * c + sum;
                smax[g] = mx;
            }
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < GROUP; g++) {
            const float c = scorr[g];
#pragma unroll
            for (int e = 0; e < E; e++) acc[g][e] *= c;
        }
        for (int tw = t0 + warp; tw < t1; tw += 4 * UNROLL) {
#if DECODE_VPRE
            float (&vf)[UNROLL][E] = vpre;  // one pass: tw == t0 + warp
#else
            float vf[UNROLL][E];
#pragma unroll
            for (int j = 0; j < UNROLL; j++) {
                const int t = min(tw + 4 * j, t1 - 1);
                load_row(cache + (size_t)bt[t / block_size] * block_stride + kv_half +
                             ((size_t)(t % block_size) * KVH + kh) * HEAD_DIM + lane * E, vf[j]);
            }
#endif
#pragma unroll
            for (int j = 0; j < UNROLL; j++) {
                if (tw + 4 * j >= t1) break;
#pragma unroll
                for (int g = 0; g < GROUP; g++) {
                    const float p = sp_[g][tw + 4 * j - t0];
#pragma unroll
                    for (int e = 0; e < E; e++) acc[g][e] = fmaf(p, vf[j][e], acc[g][e]);
                }
            }
        }
#if DECODE_PIPE
        if (more) {
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int st = 0; st < DSTEPS; st++)
#pragma unroll
                    for (int c = 0; c < 2; c++) kcur[h][st][c] = knext[h][st][c];
#pragma unroll
            for (int j = 0; j < UNROLL; j++) vcur[j] = vnext[j];
        }
#endif
        __syncthreads();
    }
#pragma unroll
    for (int g = 0; g < GROUP; g++)
#pragma unroll
        for (int e = 0; e < E; e++) sacc[warp][g][lane * E + e] = acc[g][e];
    __syncthreads();
    const int ns = (ctx - lo + chunk - 1) / chunk;
    if (ns == 1) {  // one split: normalise and write the output here
        for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += DECODE_THREADS) {
            const int g = i / HEAD_DIM, d = i % HEAD_DIM;
            const float v = sacc[0][g][d] + sacc[1][g][d] + sacc[2][g][d] + sacc[3][g][d];
            float o = v / ssum[g];
            if (sinks != nullptr) {  // rescale to max(running max, sink) and add the sink's term
                const float sk = sinks[kh * GROUP + g] * 1.4426950408889634f, mx = fmaxf(smax[g], sk);
                const float c = exp2f(smax[g] - mx);
                o = v * c / (ssum[g] * c + exp2f(sk - mx));
            }
            out[((size_t)m * H + kh * GROUP + g) * HEAD_DIM + d] = __float2bfloat16(o);
        }
        return;
    }
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += DECODE_THREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        const float v = sacc[0][g][d] + sacc[1][g][d] + sacc[2][g][d] + sacc[3][g][d];
        const size_t row = ((size_t)m * H + kh * GROUP + g) * NUM_SPLITS + sp;
        o_part[row * HEAD_DIM + d] = v;
        if (d == 0) { ml[row * 2] = smax[g]; ml[row * 2 + 1] = ssum[g]; }
    }
    __threadfence();
    __syncthreads();
    __shared__ int is_last;
    if (threadIdx.x == 0) {
        const int prev = atomicAdd(counters + m * KVH + kh, 1);
        is_last = prev == ns - 1;
        if (is_last) counters[m * KVH + kh] = 0;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += DECODE_THREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        const size_t base = ((size_t)m * H + kh * GROUP + g) * NUM_SPLITS;
        float mx = -INFINITY;
        for (int s2 = 0; s2 < ns; s2++) mx = fmaxf(mx, __ldcg(ml + (base + s2) * 2));
        const float sk = sinks != nullptr ? sinks[kh * GROUP + g] * 1.4426950408889634f : -INFINITY;
        mx = fmaxf(mx, sk);
        float l = 0.f, o = 0.f;
        for (int s2 = 0; s2 < ns; s2++) {
            const float w = exp2f(__ldcg(ml + (base + s2) * 2) - mx);
            l += w * __ldcg(ml + (base + s2) * 2 + 1);
            o += w * __ldcg(o_part + (base + s2) * HEAD_DIM + d);
        }
        if (sinks != nullptr) l += exp2f(sk - mx);
        out[((size_t)m * H + kh * GROUP + g) * HEAD_DIM + d] = __float2bfloat16(o / l);
    }
}
