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

// DECODE_LR > 1 (``Kernels(decode_lanes=True)``; HEAD_DIM <= 128 with DECODE_MMA, DECODE_VPRE and no
// DECODE_PIPE): a lane's verify rows share their blocks. lane_first int32 [M] gives each row the
// first row of its lane (a lane's rows are consecutive, at consecutive positions, with one block
// table). Rows f, f + LR, f + 2 LR, .. of a lane lead a group of up to LR rows (LR = DECODE_LR, with
// LR x GROUP <= 16: the group's query heads fill the score mma's 16 A rows), all of one split chunk
// (rows across a multiple of 2,048 keys do not share: each goes alone) and no sliding window; the
// leader's block (kh, leader, split) walks the split's keys once for all of them and every other
// member's block returns at once. Each row keeps its own keys (its context), softmax state and
// accumulators, and does per key and sub-chunk exactly what its block alone would: the same
// scores (a row's mma dot products do not depend on the other A rows), maxima, sums and fmaf
// order, its partials and merge under its own counter, and a split past its context skipped as
// its own block would have returned. So the output has the bits of one row a block (1, the
// default: the code is the kernel of before; tests/kernels/test_cuda_attention_lanes.py).
#ifndef DECODE_LR
#define DECODE_LR 1
#endif
#if DECODE_LR > 1 && !(HEAD_DIM <= 128 && DECODE_MMA && DECODE_VPRE && !DECODE_PIPE && DECODE_LR * GROUP <= 16)
#error "DECODE_LR > 1: HEAD_DIM <= 128, DECODE_MMA, DECODE_VPRE, no DECODE_PIPE, DECODE_LR x GROUP <= 16"
#endif
#define AR (DECODE_LR * GROUP)  // A rows in use at most: (row of the group, head)

extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
    decode_attn(const bf16* __restrict__ q, const int* __restrict__ positions, const int* __restrict__ block_tables,
                int bt_stride, const bf16* __restrict__ cache, long long block_stride, int block_size, int KVH,
                float scale_log2, float* __restrict__ o_part, float* __restrict__ ml, int* __restrict__ counters,
                bf16* __restrict__ out, int window, float cap_log2, const float* __restrict__ sinks
#if DECODE_LR > 1
                , const int* __restrict__ lane_first
#endif
                ) {
    pdl_wait();  // PDL: the kernel before has written what this one reads (common.cuh)
    pdl_launch_dependents();
    const int kh = blockIdx.x, m = blockIdx.y, sp = blockIdx.z;
#if DECODE_LR > 1
    int nr = 1;  // rows m .. m + nr - 1 are this block's
    {
        const int f = lane_first[m], gs = f + (m - f) / DECODE_LR * DECODE_LR;  // the group's leader
        int ge = gs + 1;
        if (window <= 0) {
            const int c0 = split_chunk(positions[gs] + 1);
            while (ge < gs + DECODE_LR && ge < (int)gridDim.y && lane_first[ge] == f &&
                   split_chunk(positions[ge] + 1) == c0)
                ge++;
        }
        if (m != gs && m < ge) return;  // the leader's block does this row
        if (m == gs) nr = ge - gs;
    }
    const int ctx = positions[m + nr - 1] + 1;  // the group's longest context (its last row's)
#else
    constexpr int nr = 1;
    const int ctx = positions[m] + 1;
#endif
    const int lo = window > 0 ? max(0, ctx - window) : 0;
    const int chunk = split_chunk(ctx - lo);
    const int tb = lo + sp * chunk;
    if (tb >= ctx) return;
    const int te = min(ctx, tb + chunk);
#if DECODE_LR > 1
    int te_r[DECODE_LR];  // row r's keys of this split end here (at tb: none, the row's block would return)
#pragma unroll
    for (int r = 0; r < DECODE_LR; r++) te_r[r] = r < nr ? max(tb, min(positions[m + r] + 1, tb + chunk)) : tb;
    auto row_te = [&](int r) {  // te_r[r] for a run-time r (te_r stays in registers)
        int v = tb;
#pragma unroll
        for (int rr = 0; rr < DECODE_LR; rr++)
            if (rr == r) v = te_r[rr];
        return v;
    };
#endif
    const int H = KVH * GROUP;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __shared__ float sp_[AR][SUB];
    __shared__ float sacc[4][AR][HEAD_DIM];
    __shared__ float smax[AR], ssum[AR], scorr[AR];

#if DECODE_MMA
    const int g8 = lane >> 2, t4 = lane & 3;
#if DECODE_LR > 1
    // A rows g8 (qa) and g8 + 8 (qb): head a % GROUP of the group's row a / GROUP; zero past the group.
    uint4 qa[DSTEPS][2], qb[DSTEPS][2];
#pragma unroll
    for (int st = 0; st < DSTEPS; st++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const int ra = g8 / GROUP, rb = (g8 + 8) / GROUP, o = st * 64 + (t4 + 4 * c) * 8;
            qa[st][c] = ra < nr ? *reinterpret_cast<const uint4*>(q + ((size_t)(m + ra) * H + kh * GROUP + g8 % GROUP) *
                                                                      HEAD_DIM + o)
                                : make_uint4(0u, 0u, 0u, 0u);
            qb[st][c] = AR > 8 && rb < nr
                            ? *reinterpret_cast<const uint4*>(q + ((size_t)(m + rb) * H + kh * GROUP + (g8 + 8) % GROUP) *
                                                                      HEAD_DIM + o)
                            : make_uint4(0u, 0u, 0u, 0u);
        }
#else
    uint4 qa[DSTEPS][2];  // row g8 of the A operand: chunks t4 and t4 + 4 of each 64-dim step
#pragma unroll
    for (int st = 0; st < DSTEPS; st++)
#pragma unroll
        for (int c = 0; c < 2; c++)
            qa[st][c] = g8 < GROUP ? *reinterpret_cast<const uint4*>(q + ((size_t)m * H + kh * GROUP + g8) * HEAD_DIM +
                                                                   st * 64 + (t4 + 4 * c) * 8)
                                   : make_uint4(0u, 0u, 0u, 0u);
#endif
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
    if (threadIdx.x < nr * GROUP) { smax[threadIdx.x] = -INFINITY; ssum[threadIdx.x] = 0.f; }
    const int* bt = block_tables + (size_t)m * bt_stride;
    const size_t kv_half = (size_t)block_size * KVH * HEAD_DIM;
    float acc[AR][E];
#pragma unroll
    for (int g = 0; g < AR; g++)
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
#if DECODE_LR > 1
#pragma unroll
                for (int st = 0; st < DSTEPS; st++)
#pragma unroll
                    for (int c = 0; c < 2; c++) tc_step(sc, qa[st][c], qb[st][c], kv[h][st][c]);
                // sc[0], sc[1]: A row g8's scores of keys kb + 8h + 2 t4 and the next; sc[2], sc[3]: row g8 + 8's
                const int t = kb + 8 * h + 2 * t4;
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    const int a = g8 + 8 * i, r = a / GROUP;
                    if (r < nr) {
                        const int tr = min(row_te(r), t0 + SUB);  // row r's end of the sub-chunk
                        if (t < tr) sp_[a][t - t0] = sc[2 * i] * scale_log2;
                        if (t + 1 < tr) sp_[a][t + 1 - t0] = sc[2 * i + 1] * scale_log2;
                    }
                }
#else
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
#endif
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
#if DECODE_LR > 1
        for (int g = warp; g < nr * GROUP; g += 4) {
            const int len = min(row_te(g / GROUP), t1) - t0;  // this row's keys of the sub-chunk
            if (len <= 0) continue;                         // past its context: untouched (warp-uniform)
#else
        for (int g = warp; g < GROUP; g += 4) {
#endif
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
        for (int g = 0; g < AR; g++) {
#if DECODE_LR > 1
            if (g >= nr * GROUP || t0 >= te_r[g / GROUP]) continue;  // no update of this row here
#endif
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
                for (int g = 0; g < AR; g++) {
#if DECODE_LR > 1
                    if (g >= nr * GROUP || tw + 4 * j >= te_r[g / GROUP]) continue;  // past this row's keys
#endif
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
    for (int g = 0; g < AR; g++)
#pragma unroll
        for (int e = 0; e < E; e++) sacc[warp][g][lane * E + e] = acc[g][e];
    __syncthreads();
    __shared__ int is_last;
    // Row mm (ns splits; its heads' state at g0 ..): the output if this is its one split, else the
    // split's partials, and the merge by whichever of its splits ends last.
    auto finish = [&](const int mm, const int ns, const int g0) {
        if (ns == 1) {  // one split: normalise and write the output here
            for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += DECODE_THREADS) {
                const int g = i / HEAD_DIM, d = i % HEAD_DIM;
                const float v = sacc[0][g0 + g][d] + sacc[1][g0 + g][d] + sacc[2][g0 + g][d] + sacc[3][g0 + g][d];
                float o = v / ssum[g0 + g];
                if (sinks != nullptr) {  // rescale to max(running max, sink) and add the sink's term
                    const float sk = sinks[kh * GROUP + g] * 1.4426950408889634f, mx = fmaxf(smax[g0 + g], sk);
                    const float c = exp2f(smax[g0 + g] - mx);
                    o = v * c / (ssum[g0 + g] * c + exp2f(sk - mx));
                }
                out[((size_t)mm * H + kh * GROUP + g) * HEAD_DIM + d] = __float2bfloat16(o);
            }
            return;
        }
        for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += DECODE_THREADS) {
            const int g = i / HEAD_DIM, d = i % HEAD_DIM;
            const float v = sacc[0][g0 + g][d] + sacc[1][g0 + g][d] + sacc[2][g0 + g][d] + sacc[3][g0 + g][d];
            const size_t row = ((size_t)mm * H + kh * GROUP + g) * NUM_SPLITS + sp;
            o_part[row * HEAD_DIM + d] = v;
            if (d == 0) { ml[row * 2] = smax[g0 + g]; ml[row * 2 + 1] = ssum[g0 + g]; }
        }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            const int prev = atomicAdd(counters + mm * KVH + kh, 1);
            is_last = prev == ns - 1;
            if (is_last) counters[mm * KVH + kh] = 0;
        }
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += DECODE_THREADS) {
            const int g = i / HEAD_DIM, d = i % HEAD_DIM;
            const size_t base = ((size_t)mm * H + kh * GROUP + g) * NUM_SPLITS;
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
            out[((size_t)mm * H + kh * GROUP + g) * HEAD_DIM + d] = __float2bfloat16(o / l);
        }
    };
#if DECODE_LR > 1
    for (int r = 0; r < nr; r++) {
        const int cx = positions[m + r] + 1;
        if (tb < cx) finish(m + r, (cx - lo + chunk - 1) / chunk, r * GROUP);  // else: its block would return
    }
#else
    const int ns = (ctx - lo + chunk - 1) / chunk;
    finish(m, ns, 0);
#endif
}
