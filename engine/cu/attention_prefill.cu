// attention_prefill.cu: causal flash attention for a prefill chunk over the paged KV
// cache, including the retained prefix (positions before the chunk).
//
// q bf16 [n, H, D] (rotated) for positions start .. start + n - 1; the chunk's own K/V
// are already in the cache (rope_kv_write ran first). block_table int32 [*] of the
// sequence; cache bf16 [num_blocks][L][2][block_size][KVH][D] offset to the layer.
// out bf16 [n, H * D].
// Grid (ceil(n / 64), H), block PREFILL_THREADS = 128 = 4 warps; warp w owns 16 query rows of the
// block's 64. Per 64-key tile: K and V gathered through the block table with
// cp.async (two commit groups, so V lands while S = Q K^T runs), S on mma.sync
// m16n8k16 bf16 with fp32 accumulate, causal mask, online softmax in base 2 in
// registers (rows shared by 4 lanes reduce with two shuffles), P re-packed from
// the accumulator layout straight into A fragments, O += P V with V read through
// ldmatrix.trans. The score matrix never leaves registers. Heaviest (last) query
// tiles are launched first. Shared rows are padded by 8 bf16 (conflict-free ldmatrix).
// Scores as attention_decode.cu's: q . k * scale_log2, or with cap_log2 > 0 cap_log2 *
// tanh(q . k * scale_log2) (scale_log2 then holds scale / cap); with window > 0 query position p
// sees keys p - window < key <= p, and the block starts at the first tile its lowest query
// sees: keys before that (and their block-table entries) are never read. A row whose keys in a
// tile are all masked keeps its running max (no NaN). sinks fp32 [H] or null: head h's sinks[h]
// joins its softmax denominator (gpt-oss).
// HEAD_DIM 256 (gemma): 48-key tiles and grid (ceil(n / 64), H, 2), block z computing output dims
// [128 z, 128 z + 128) (S is computed by both halves), so registers and shared memory stay in bounds.
// Compile-time: HEAD_DIM (64, 128 or 256), GROUP (H / KVH), PREFILL_THREADS (from the wrapper).

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 4
#endif
#ifndef PREFILL_THREADS
#error "PREFILL_THREADS is defined by engine/cu/kernels.py"
#endif
static_assert(PREFILL_THREADS == 128, "prefill_attn: 4 warps of 16 query rows each");
#define LDK (HEAD_DIM + 8)
#if HEAD_DIM == 256
#define KT 48
#define VS 2  // output dims split over blockIdx.z
#else
#define KT 64
#define VS 1
#endif
#define DV (HEAD_DIM / VS)  // output (V) dims of one block
#define LDV (DV + 8)
// HEAD_DIM 256: the K tile, then the V tile, in one array through which the 64 query rows are
// staged first (the K tile alone is too small for them).
#define SMEM_ELEMS (KT * (LDK + LDV) > 64 * LDK ? KT * (LDK + LDV) : 64 * LDK)

extern "C" __global__ void __launch_bounds__(PREFILL_THREADS)
    prefill_attn(const bf16* __restrict__ q, const int* __restrict__ block_table, const bf16* __restrict__ cache,
                 long long block_stride, int block_size, int KVH, int n, int start, float scale_log2,
                 bf16* __restrict__ out, int window, float cap_log2, const float* __restrict__ sinks) {
#if VS == 1
    __shared__ __align__(16) bf16 sK[KT * LDK];  // also stages the 64 query rows
    __shared__ __align__(16) bf16 sV[KT * LDV];
#else
    __shared__ __align__(16) bf16 smem[SMEM_ELEMS];
    bf16* const sK = smem;
    bf16* const sV = smem + KT * LDK;
#endif
    const int H = KVH * GROUP, v0 = VS == 1 ? 0 : blockIdx.z * DV;  // this block's output dims: v0 .. v0 + DV
    const int qtile = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, kh = h / GROUP;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int q0 = qtile * 64;
    constexpr int CH = HEAD_DIM / 8;  // 16-byte chunks per row
    constexpr int CHV = DV / 8;

    for (int idx = tid; idx < 64 * CH; idx += PREFILL_THREADS) {
        const int r = idx / CH, c = idx % CH, qi = q0 + r;
        const bool ok = qi < n;
        cp_async16(&sK[r * LDK + c * 8], q + ((size_t)(ok ? qi : 0) * H + h) * HEAD_DIM + c * 8, ok ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    uint32_t qf[HEAD_DIM / 16][4];
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ks++)
        ldmatrix_x4(qf[ks], &sK[(warp * 16 + (lane & 15)) * LDK + ks * 16 + (lane >> 4) * 8]);
    __syncthreads();

    float o[DV / 8][4];
#pragma unroll
    for (int j = 0; j < DV / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[j][e] = 0.f;
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
    const int qp0 = start + q0 + warp * 16 + (lane >> 2);  // this thread's rows: qp0, qp0 + 8
    const int nkeys = start + min(q0 + 64, n);
    const int kfirst = window > 0 ? max(0, start + q0 - window + 1) : 0;  // the block's first visible key
    const size_t kv_half = (size_t)block_size * KVH * HEAD_DIM;

    for (int k0 = kfirst / KT * KT; k0 < nkeys; k0 += KT) {
        for (int idx = tid; idx < KT * CH; idx += PREFILL_THREADS) {
            const int r = idx / CH, c = idx % CH, t = k0 + r;
            const bool ok = t < nkeys && t >= kfirst;
            const bf16* src = cache + (size_t)(ok ? block_table[t / block_size] : 0) * block_stride +
                              ((size_t)(ok ? t % block_size : 0) * KVH + kh) * HEAD_DIM + c * 8;
            cp_async16(&sK[r * LDK + c * 8], src, ok ? 16 : 0);
        }
        cp_async_commit();
        for (int idx = tid; idx < KT * CHV; idx += PREFILL_THREADS) {
            const int r = idx / CHV, c = idx % CHV, t = k0 + r;
            const bool ok = t < nkeys && t >= kfirst;
            const bf16* src = cache + (size_t)(ok ? block_table[t / block_size] : 0) * block_stride + kv_half +
                              ((size_t)(ok ? t % block_size : 0) * KVH + kh) * HEAD_DIM + v0 + c * 8;
            cp_async16(&sV[r * LDV + c * 8], src, ok ? 16 : 0);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        float s[KT / 8][4];
#pragma unroll
        for (int j = 0; j < KT / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[j][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ks++)
#pragma unroll
            for (int nj = 0; nj < KT / 16; nj++) {
                uint32_t r[4];
                ldmatrix_x4(r, &sK[(nj * 16 + (lane & 7) + (lane >> 4) * 8) * LDK + ks * 16 + ((lane >> 3) & 1) * 8]);
                mma_bf16(s[2 * nj], qf[ks], r[0], r[1]);
                mma_bf16(s[2 * nj + 1], qf[ks], r[2], r[3]);
            }

        float mnew[2] = {mrow[0], mrow[1]};
#pragma unroll
        for (int j = 0; j < KT / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = k0 + j * 8 + (lane & 3) * 2 + (e & 1);
                const int qp = qp0 + (e >> 1) * 8;
                const bool seen = key <= qp && (window <= 0 || qp - key < window);
                float v = s[j][e] * scale_log2;
                if (cap_log2 > 0.f) v = cap_log2 * tanhf(v);
                v = seen ? v : -INFINITY;
                s[j][e] = v;
                mnew[e >> 1] = fmaxf(mnew[e >> 1], v);
            }
        float corr[2], rs[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mnew[i] = fmaxf(mnew[i], __shfl_xor_sync(FULL_MASK, mnew[i], 1));
            mnew[i] = fmaxf(mnew[i], __shfl_xor_sync(FULL_MASK, mnew[i], 2));
            const float mold = mrow[i];
            mrow[i] = mnew[i];
            if (mnew[i] == -INFINITY) mnew[i] = 0.f;  // nothing seen yet: p = 0, corr = 0, no NaN
            corr[i] = exp2f(mold - mnew[i]);
        }
        uint32_t pa[KT / 16][4];
#pragma unroll
        for (int j = 0; j < KT / 8; j++) {
            const float p0 = exp2f(s[j][0] - mnew[0]), p1 = exp2f(s[j][1] - mnew[0]);
            const float p2 = exp2f(s[j][2] - mnew[1]), p3 = exp2f(s[j][3] - mnew[1]);
            rs[0] += p0 + p1;
            rs[1] += p2 + p3;
            pa[j / 2][(j & 1) * 2] = pack_bf162(p0, p1);
            pa[j / 2][(j & 1) * 2 + 1] = pack_bf162(p2, p3);
        }
#pragma unroll
        for (int i = 0; i < 2; i++) lrow[i] = lrow[i] * corr[i] + rs[i];
#pragma unroll
        for (int j = 0; j < DV / 8; j++) {
            o[j][0] *= corr[0]; o[j][1] *= corr[0];
            o[j][2] *= corr[1]; o[j][3] *= corr[1];
        }

        cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++)
#pragma unroll
            for (int dj = 0; dj < DV / 16; dj++) {
                uint32_t r[4];
                ldmatrix_x4_trans(r, &sV[(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDV + dj * 16 + (lane >> 4) * 8]);
                mma_bf16(o[2 * dj], pa[kk], r[0], r[1]);
                mma_bf16(o[2 * dj + 1], pa[kk], r[2], r[3]);
            }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 2; i++) {
        lrow[i] += __shfl_xor_sync(FULL_MASK, lrow[i], 1);
        lrow[i] += __shfl_xor_sync(FULL_MASK, lrow[i], 2);
        if (sinks != nullptr) {  // rescale to max(running max, sink) and add the sink's term
            const float sk = sinks[h] * 1.4426950408889634f, mx = fmaxf(mrow[i], sk), c = exp2f(mrow[i] - mx);
            lrow[i] = c / (lrow[i] * c + exp2f(sk - mx));
        } else {
            lrow[i] = 1.f / lrow[i];
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int qi = q0 + warp * 16 + (lane >> 2) + i * 8;
        if (qi >= n) continue;
        bf16* dst = out + ((size_t)qi * H + h) * HEAD_DIM + v0 + (lane & 3) * 2;
#pragma unroll
        for (int j = 0; j < DV / 8; j++)
            *reinterpret_cast<uint32_t*>(dst + j * 8) = pack_bf162(o[j][2 * i] * lrow[i], o[j][2 * i + 1] * lrow[i]);
    }
}
