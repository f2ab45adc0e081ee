// sample.cu: on-device sampling from the LM head's logits, one block per row (lane).
//
// apply_penalties: grid M, block 256. For row m, the host-built list
//   pen_tokens int32 [M, pen_stride] / pen_counts int32 [M, pen_stride] (count among
//   generated tokens; 0 for tokens seen only in the prompt), pen_num int32 [M] entries,
//   params fp32 [M, 8] = (temperature, top_p, top_k, min_p, presence, frequency,
//   repetition, unused), adjusts logits fp32 [M, V] in place, OpenAI / HF style:
//   l = l > 0 ? l / rep : l * rep (every listed token), then
//   l -= presence * (count > 0) + frequency * count.
// sample: grid M, block SAMPLE_THREADS (defined by the wrapper). seeds uint64 [M],
//   positions int32 [M] (the position of the token being drawn: the row's own
//   position + 1, as engine/sampler.py keys it), out_tokens int32 [M].
//   Greedy (temperature below MIN_TEMPERATURE, 0 and NaN included, or top_k == 1): argmax,
//   lowest index on ties. MIN_TEMPERATURE is engine/sampling.py's (a define from the wrapper):
//   1 / T for a smaller T overflows, and the wrapper stages greedy rows with T = 0 anyway,
//   so the host's choice of greedy and this one agree at the boundary too.
//   Otherwise, with l' = l / T and mx = max l': a token is kept when
//     l' >= mx - 30 (mass below is < V * e^-30, negligible),
//     l' >= mx + log(min_p)                          (min-p),
//     l' >= the k-th largest l'                       (top-k, ties kept),
//     l' >= the highest cut whose kept mass >= top_p * the mass kept so far (top-p);
//   the cuts are found by bisection on the value (24 passes over the row, each a block
//   reduction). Then u = numpy's Philox(key=[seed, position]).random(), and the token is the first index where the running kept mass, in
//   vocabulary order, exceeds u * total (each thread owns a contiguous range; a block
//   scan of the per-thread sums finds the range). The draw depends only on the row's
//   logits, seed and position, never on the other rows of the round.

#ifndef SAMPLE_THREADS
#error "SAMPLE_THREADS is defined by engine/cu/kernels.py"
#endif
#ifndef MIN_TEMPERATURE
#error "MIN_TEMPERATURE is defined by engine/cu/kernels.py (engine/sampling.py's)"
#endif
#define BISECT_STEPS 24

// Philox4x64-10 (Salmon et al. 2011), first output word for counter (1, 0, 0, 0): the
// first 64 bits numpy.random.Philox(key=[seed, position]) produces, so the draw here and
// engine/sampler.py's use the same uniform.
__device__ uint64_t philox_first(uint64_t k0, uint64_t k1) {
    uint64_t c0 = 1, c1 = 0, c2 = 0, c3 = 0;
#pragma unroll
    for (int i = 0; i < 10; i++) {
        const uint64_t hi0 = __umul64hi(0xD2E7470EE14C6C93ull, c0), lo0 = 0xD2E7470EE14C6C93ull * c0;
        const uint64_t hi1 = __umul64hi(0xCA5A826395121157ull, c2), lo1 = 0xCA5A826395121157ull * c2;
        const uint64_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
        k0 += 0x9E3779B97F4A7C15ull;
        k1 += 0xBB67AE8584CAA73Bull;
    }
    return c0;
}

extern "C" __global__ void apply_penalties(float* __restrict__ logits, int V, const float* __restrict__ params,
                                           const int* __restrict__ pen_tokens, const int* __restrict__ pen_counts,
                                           const int* __restrict__ pen_num, int pen_stride) {
    pdl_wait();  // PDL: the kernel before has written what this one reads (common.cuh)
    pdl_launch_dependents();
    const int m = blockIdx.x;
    const float* p = params + m * 8;
    const float presence = p[4], frequency = p[5], rep = p[6];
    float* l = logits + (size_t)m * V;
    for (int i = threadIdx.x; i < pen_num[m]; i += blockDim.x) {
        const int t = pen_tokens[(size_t)m * pen_stride + i], c = pen_counts[(size_t)m * pen_stride + i];
        float v = l[t];
        if (rep != 1.f) v = v > 0.f ? v / rep : v * rep;
        v -= presence * (c > 0 ? 1.f : 0.f) + frequency * (float)c;
        l[t] = v;
    }
}

// Sum over the block of exp(l' - mx) for l' >= cut (or the count when `count`).
__device__ float kept_mass(const float* l, int V, float invT, float mx, float cut, bool count, float* scratch) {
    float s = 0.f;
    for (int i = threadIdx.x; i < V; i += SAMPLE_THREADS) {
        const float v = l[i] * invT;
        if (v >= cut) s += count ? 1.f : __expf(v - mx);
    }
    return block_sum(s, scratch);
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample(const float* __restrict__ logits, int V, const float* __restrict__ params,
           const uint64_t* __restrict__ seeds, const int* __restrict__ positions, int* __restrict__ out_tokens) {
    pdl_wait();  // PDL: the kernel before has written what this one reads (common.cuh)
    pdl_launch_dependents();
    __shared__ float scratch[32];
    __shared__ float sval[32];
    __shared__ int sidx[32];
    const int m = blockIdx.x;
    const float* l = logits + (size_t)m * V;
    const float* p = params + m * 8;
    const float temperature = p[0], top_p = p[1], min_p = p[3];
    const int top_k = (int)p[2];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    if (!(temperature >= (float)MIN_TEMPERATURE) || top_k == 1) {
        float best = -INFINITY;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < V; i += SAMPLE_THREADS) {
            const float v = l[i];
            if (v > best) { best = v; bi = i; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, best, o);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (lane == 0) { sval[warp] = best; sidx[warp] = bi; }
        __syncthreads();
        if (warp == 0) {
            best = sval[lane];
            bi = sidx[lane];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(FULL_MASK, best, o);
                const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
                if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
            }
            if (lane == 0) out_tokens[m] = bi;
        }
        return;
    }

    const float invT = 1.f / temperature;
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < V; i += SAMPLE_THREADS) mx = fmaxf(mx, l[i] * invT);
    mx = block_max(mx, scratch);
    float cut = mx - 30.f;
    if (min_p > 0.f) cut = fmaxf(cut, mx + logf(min_p));
    if (top_k > 0 && top_k < V) {
        // Largest c in [cut, mx] with count(l' >= c) >= top_k.
        float lo = cut, hi = mx;
        if (kept_mass(l, V, invT, mx, lo, true, scratch) > (float)top_k) {
            for (int it = 0; it < BISECT_STEPS; it++) {
                const float mid = 0.5f * (lo + hi);
                if (kept_mass(l, V, invT, mx, mid, true, scratch) >= (float)top_k) lo = mid; else hi = mid;
            }
            cut = lo;
        }
    }
    if (top_p < 1.f) {
        const float target = top_p * kept_mass(l, V, invT, mx, cut, false, scratch);
        float lo = cut, hi = mx;
        for (int it = 0; it < BISECT_STEPS; it++) {
            const float mid = 0.5f * (lo + hi);
            if (kept_mass(l, V, invT, mx, mid, false, scratch) >= target) lo = mid; else hi = mid;
        }
        cut = lo;
    }

    // Inverse-CDF draw in vocabulary order over the kept tokens.
    const int per = (V + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int b = threadIdx.x * per, e = min(V, b + per);
    float part = 0.f;
    int last_kept = -1;
    for (int i = b; i < e; i++) {
        const float v = l[i] * invT;
        if (v >= cut) { part += __expf(v - mx); last_kept = i; }
    }
    // Block exclusive scan of `part`.
    float incl = part;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += y;
    }
    __shared__ float wsum[32];
    __shared__ int s_tok;
    if (lane == 31) wsum[warp] = incl;
    if (threadIdx.x == 0) s_tok = -1;
    __syncthreads();
    if (warp == 0) {
        float w = wsum[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float y = __shfl_up_sync(FULL_MASK, w, o);
            if (lane >= o) w += y;
        }
        wsum[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const float total = wsum[31];
    const float before = (warp > 0 ? wsum[warp - 1] : 0.f) + incl - part;
    const double u = (double)(philox_first(seeds[m], (uint64_t)(int64_t)positions[m]) >> 11) * 0x1.0p-53;
    const float target = (float)(u * (double)total);
    if (part > 0.f && target >= before && target < before + part) {
        float run = before;
        int tok = last_kept;
        for (int i = b; i < e; i++) {
            const float v = l[i] * invT;
            if (v >= cut) {
                run += __expf(v - mx);
                if (run > target) { tok = i; break; }
            }
        }
        s_tok = tok;
    }
    // Rounding can leave the target past every range: take the last kept token.
    __shared__ int s_last;
    if (threadIdx.x == 0) s_last = -1;
    __syncthreads();
    if (last_kept >= 0) atomicMax(&s_last, last_kept);
    __syncthreads();
    if (threadIdx.x == 0) out_tokens[m] = s_tok >= 0 ? s_tok : s_last;
}
