// vision.cu: the Qwen2.5-VL vision tower's own kernels (engine/backends/cuda/vision.py runs the
// tower; its GEMMs, RMSNorms and SwiGLU are kernels.py's).
//
// vis_gather_bf16: out[i, :] = bf16(src[idx[i], :]), src fp32 [*, cols], idx int32 [rows],
//   out bf16 [rows, cols]: the patches in window order, as the patch-embedding GEMM reads them.
//   One block a row, threads over the columns.
// vis_gather_f32: out[i, :] = src[idx[i], :] in fp32 (the merged rows back to prompt order).
// vis_qkv_rope: q|k|v fp32 [n, 3, H, D] (the qkv GEMM's rows, bias added) -> q, k, v bf16
//   [H][n][D] (head-major: a head's rows contiguous for vis_attn), q and k rotated by the 2D
//   rotary embedding: pair i (dims i, i + D/2, rotate_half) at angle hw[r, 0] * inv_freq[i]
//   for i < D/4, hw[r, 1] * inv_freq[i - D/4] after (hw int32 [n, 2]: each row's patch (h, w);
//   inv_freq fp32 [D/4]). Grid (n, H), block D/2 threads, thread i one pair of q, k and v.
// vis_attn: bidirectional attention within row segments (a window, or a frame in the
//   full-attention blocks). tiles int32 [num_tiles][4] = (q0, q1, k0, k1): the tile's query rows
//   q0..q1 (at most 32) attend to keys k0..k1 (their segment). q, k, v bf16 [H][n][D], out bf16
//   [n, H * D]. Grid (num_tiles, H), block 128 threads: 4 threads a query row (its q in
//   registers), 32-key chunks of K and V staged in shared memory as fp32 (rows padded by 4
//   floats), scores in base 2 with an online softmax in fp32; thread t of a row scores keys
//   t, t + 4, ... of a chunk and accumulates output dims 4(t + 4g) .. 4(t + 4g) + 3.
//   Compile-time: VIS_HEAD_DIM (a multiple of 16, at most 128).
// vis_attn_tc: the same on the tensor cores, tiles of up to 64 query rows (below).
// vis_gelu: out = bf16(x * (1 + erf(x / sqrt 2)) / 2) over n fp32 values (the merger's exact GELU).

#ifndef VIS_HEAD_DIM
#define VIS_HEAD_DIM 80
#endif
static_assert(VIS_HEAD_DIM % 16 == 0 && VIS_HEAD_DIM <= 128, "vis_attn: head_dim a multiple of 16, <= 128");
#define VQT 32  // query rows a block
#define VKT 32  // keys a chunk
#define VLD (VIS_HEAD_DIM + 4)

extern "C" __global__ void vis_gather_bf16(const float* __restrict__ src, const int* __restrict__ idx,
                                           bf16* __restrict__ out, int cols) {
    const float* s = src + (size_t)idx[blockIdx.x] * cols;
    bf16* o = out + (size_t)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) o[c] = __float2bfloat16(s[c]);
}

extern "C" __global__ void vis_gather_f32(const float* __restrict__ src, const int* __restrict__ idx,
                                          float* __restrict__ out, int cols) {
    const float* s = src + (size_t)idx[blockIdx.x] * cols;
    float* o = out + (size_t)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) o[c] = s[c];
}

extern "C" __global__ void vis_qkv_rope(const float* __restrict__ qkv, const int* __restrict__ hw,
                                        const float* __restrict__ inv_freq, bf16* __restrict__ q,
                                        bf16* __restrict__ k, bf16* __restrict__ v, int n, int H) {
    const int row = blockIdx.x, head = blockIdx.y, i = threadIdx.x, D = VIS_HEAD_DIM, half = D / 2;
    const int quarter = D / 4;
    const float pos = (float)(i < quarter ? hw[row * 2] : hw[row * 2 + 1]);
    float s, c;
    sincosf(pos * inv_freq[i < quarter ? i : i - quarter], &s, &c);
    const float* src = qkv + (size_t)row * 3 * H * D + (size_t)head * D;
    const size_t dst = ((size_t)head * n + row) * D;
    const float qa = src[i], qb = src[i + half];
    const float ka = src[H * D + i], kb = src[H * D + i + half];
    q[dst + i] = __float2bfloat16(qa * c - qb * s);
    q[dst + i + half] = __float2bfloat16(qb * c + qa * s);
    k[dst + i] = __float2bfloat16(ka * c - kb * s);
    k[dst + i + half] = __float2bfloat16(kb * c + ka * s);
    v[dst + i] = __float2bfloat16(src[2 * H * D + i]);
    v[dst + i + half] = __float2bfloat16(src[2 * H * D + i + half]);
}

extern "C" __global__ void __launch_bounds__(128)
    vis_attn(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
             const int* __restrict__ tiles, bf16* __restrict__ out, int n, int H, float scale_log2) {
    constexpr int D = VIS_HEAD_DIM, D4 = D / 4, G = D / 16;  // float4 groups of a row; of a thread
    __shared__ __align__(16) float sK[VKT * VLD];
    __shared__ __align__(16) float sV[VKT * VLD];
    __shared__ float sP[VQT][VKT + 1];
    const int tile = blockIdx.x, head = blockIdx.y, tid = threadIdx.x, r = tid >> 2, t = tid & 3;
    const int q0 = tiles[tile * 4], q1 = tiles[tile * 4 + 1], k0 = tiles[tile * 4 + 2], k1 = tiles[tile * 4 + 3];
    const int qrow = q0 + r;
    const bool live = qrow < q1;
    const size_t hbase = (size_t)head * n * D;

    float qr[D];
    {
        const bf16* qp = q + hbase + (size_t)(live ? qrow : q0) * D;
#pragma unroll
        for (int d = 0; d < D; d += 8) {
            const uint4 u = *reinterpret_cast<const uint4*>(qp + d);
            qr[d] = bf_lo(u.x) * scale_log2, qr[d + 1] = bf_hi(u.x) * scale_log2;
            qr[d + 2] = bf_lo(u.y) * scale_log2, qr[d + 3] = bf_hi(u.y) * scale_log2;
            qr[d + 4] = bf_lo(u.z) * scale_log2, qr[d + 5] = bf_hi(u.z) * scale_log2;
            qr[d + 6] = bf_lo(u.w) * scale_log2, qr[d + 7] = bf_hi(u.w) * scale_log2;
        }
    }
    float acc[G * 4];
#pragma unroll
    for (int j = 0; j < G * 4; ++j) acc[j] = 0.f;
    float m = -INFINITY, l = 0.f;

    for (int kc = k0; kc < k1; kc += VKT) {
        const int nk = min(VKT, k1 - kc);
        __syncthreads();  // the previous chunk's readers are done
        for (int e = tid; e < VKT * (D / 8); e += 128) {
            const int j = e / (D / 8), d = (e % (D / 8)) * 8;
            float* kd = sK + j * VLD + d;
            float* vd = sV + j * VLD + d;
            if (j < nk) {
                const size_t off = hbase + (size_t)(kc + j) * D + d;
                const uint4 a = *reinterpret_cast<const uint4*>(k + off);
                const uint4 b = *reinterpret_cast<const uint4*>(v + off);
                *reinterpret_cast<float4*>(kd) = make_float4(bf_lo(a.x), bf_hi(a.x), bf_lo(a.y), bf_hi(a.y));
                *reinterpret_cast<float4*>(kd + 4) = make_float4(bf_lo(a.z), bf_hi(a.z), bf_lo(a.w), bf_hi(a.w));
                *reinterpret_cast<float4*>(vd) = make_float4(bf_lo(b.x), bf_hi(b.x), bf_lo(b.y), bf_hi(b.y));
                *reinterpret_cast<float4*>(vd + 4) = make_float4(bf_lo(b.z), bf_hi(b.z), bf_lo(b.w), bf_hi(b.w));
            } else {
                const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
                *reinterpret_cast<float4*>(kd) = z, *reinterpret_cast<float4*>(kd + 4) = z;
                *reinterpret_cast<float4*>(vd) = z, *reinterpret_cast<float4*>(vd + 4) = z;
            }
        }
        __syncthreads();
        float sc[VKT / 4];
#pragma unroll
        for (int jj = 0; jj < VKT / 4; ++jj) sc[jj] = 0.f;
#pragma unroll
        for (int d4 = 0; d4 < D4; ++d4) {
#pragma unroll
            for (int jj = 0; jj < VKT / 4; ++jj) {
                const float4 kv = *reinterpret_cast<const float4*>(sK + (t + 4 * jj) * VLD + 4 * d4);
                sc[jj] += qr[4 * d4] * kv.x + qr[4 * d4 + 1] * kv.y + qr[4 * d4 + 2] * kv.z + qr[4 * d4 + 3] * kv.w;
            }
        }
        float cmax = -INFINITY;
#pragma unroll
        for (int jj = 0; jj < VKT / 4; ++jj) {
            if (t + 4 * jj >= nk) sc[jj] = -INFINITY;
            cmax = fmaxf(cmax, sc[jj]);
        }
        cmax = fmaxf(cmax, __shfl_xor_sync(FULL_MASK, cmax, 1));
        cmax = fmaxf(cmax, __shfl_xor_sync(FULL_MASK, cmax, 2));
        const float mn = fmaxf(m, cmax);  // finite: every chunk holds a key
        const float corr = exp2f(m - mn);
        float psum = 0.f;
#pragma unroll
        for (int jj = 0; jj < VKT / 4; ++jj) {
            const float p = exp2f(sc[jj] - mn);
            psum += p;
            sP[r][t + 4 * jj] = p;
        }
        psum += __shfl_xor_sync(FULL_MASK, psum, 1);
        psum += __shfl_xor_sync(FULL_MASK, psum, 2);
        l = l * corr + psum;
        m = mn;
        __syncwarp();
#pragma unroll
        for (int j = 0; j < G * 4; ++j) acc[j] *= corr;
        for (int j = 0; j < nk; ++j) {
            const float p = sP[r][j];
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float4 vv = *reinterpret_cast<const float4*>(sV + j * VLD + 4 * (t + 4 * g));
                acc[4 * g] += p * vv.x, acc[4 * g + 1] += p * vv.y;
                acc[4 * g + 2] += p * vv.z, acc[4 * g + 3] += p * vv.w;
            }
        }
        __syncwarp();  // sP is rewritten by the next chunk
    }
    if (!live) return;
    const float inv = 1.f / l;
    bf16* o = out + (size_t)qrow * H * D + (size_t)head * D;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int d = 4 * (t + 4 * g);
        *reinterpret_cast<uint2*>(o + d) =
            make_uint2(pack_bf162(acc[4 * g] * inv, acc[4 * g + 1] * inv), pack_bf162(acc[4 * g + 2] * inv, acc[4 * g + 3] * inv));
    }
}

// vis_attn_tc: vis_attn on the tensor cores (mma.sync m16n8k16 bf16, fp32 accumulate), tiles of
//   up to 64 query rows. Block 128 threads = 4 warps, warp w owns query rows 16w .. 16w + 15 of the
//   tile (its q fragments in registers, read once from the tile staged where the K chunks go
//   after). Per 64-key chunk K is staged in shared memory as [key][dim] and V transposed as
//   [dim][key] (rows padded by 8 bf16, so the fragment loads hit distinct banks; thread e stages
//   key e % 64, so a warp's transposed stores do too); S = Q K^T, masked past the segment, online
//   softmax in base 2 over the accumulator rows (4 lanes a row: two shuffles), P re-packed from
//   the accumulators into A fragments, O += P V.
#define TQ 64
#define TK 64
#define TLD (VIS_HEAD_DIM + 8)
#define TLV (TK + 8)

__device__ __forceinline__ uint32_t lds32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

extern "C" __global__ void __launch_bounds__(128)
    vis_attn_tc(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                const int* __restrict__ tiles, bf16* __restrict__ out, int n, int H, float scale_log2) {
    constexpr int D = VIS_HEAD_DIM, KS = D / 16, NT = D / 8, C8 = D / 8;
    static_assert(TQ == TK, "the K chunk reuses the Q tile's shared memory");
    __shared__ __align__(16) bf16 sQ[TQ * TLD];  // the Q tile, then each K chunk (q lives in registers)
    __shared__ __align__(16) bf16 sVt[D * TLV];
    bf16* const sK = sQ;
    const int tile = blockIdx.x, head = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int q0 = tiles[tile * 4], q1 = tiles[tile * 4 + 1], k0 = tiles[tile * 4 + 2], k1 = tiles[tile * 4 + 3];
    const size_t hbase = (size_t)head * n * D;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

    for (int e = tid; e < TQ * C8; e += 128) {  // e % TQ: the row, so a warp's stores hit distinct banks
        const int r = e % TQ, c = (e / TQ) * 8;
        *reinterpret_cast<uint4*>(sQ + r * TLD + c) =
            q0 + r < q1 ? *reinterpret_cast<const uint4*>(q + hbase + (size_t)(q0 + r) * D + c) : zero;
    }
    __syncthreads();
    uint32_t qa[KS][4];
    const bf16* qw = sQ + (warp * 16 + g) * TLD + 2 * t;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        qa[ks][0] = lds32(qw + ks * 16);
        qa[ks][1] = lds32(qw + 8 * TLD + ks * 16);
        qa[ks][2] = lds32(qw + ks * 16 + 8);
        qa[ks][3] = lds32(qw + 8 * TLD + ks * 16 + 8);
    }
    float o[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    for (int kc = k0; kc < k1; kc += TK) {
        const int nk = min(TK, k1 - kc);
        __syncthreads();  // the previous chunk's readers are done
        for (int e = tid; e < TK * C8; e += 128) {
            const int j = e % TK, c = (e / TK) * 8;
            const size_t off = hbase + (size_t)(kc + j) * D + c;
            const uint4 kk = j < nk ? *reinterpret_cast<const uint4*>(k + off) : zero;
            const uint4 vv = j < nk ? *reinterpret_cast<const uint4*>(v + off) : zero;
            *reinterpret_cast<uint4*>(sK + j * TLD + c) = kk;
            const bf16* vb = reinterpret_cast<const bf16*>(&vv);
#pragma unroll
            for (int i = 0; i < 8; ++i) sVt[(c + i) * TLV + j] = vb[i];
        }
        __syncthreads();
        float sc[TK / 8][4];
#pragma unroll
        for (int nt = 0; nt < TK / 8; ++nt) {
            sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
            const bf16* kr = sK + (nt * 8 + g) * TLD + 2 * t;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) mma_bf16(sc[nt], qa[ks], lds32(kr + ks * 16), lds32(kr + ks * 16 + 8));
        }
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < TK / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool ok = nt * 8 + 2 * t + e < nk;
                sc[nt][e] = ok ? sc[nt][e] * scale_log2 : -INFINITY;
                sc[nt][2 + e] = ok ? sc[nt][2 + e] * scale_log2 : -INFINITY;
                mx0 = fmaxf(mx0, sc[nt][e]);
                mx1 = fmaxf(mx1, sc[nt][2 + e]);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 2));
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);  // finite: every chunk holds a key
        const float c0 = exp2f(m0 - n0), c1 = exp2f(m1 - n1);
        float r0 = 0.f, r1 = 0.f;
#pragma unroll
        for (int nt = 0; nt < TK / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                sc[nt][e] = exp2f(sc[nt][e] - n0);
                sc[nt][2 + e] = exp2f(sc[nt][2 + e] - n1);
                r0 += sc[nt][e];
                r1 += sc[nt][2 + e];
            }
        }
        r0 += __shfl_xor_sync(FULL_MASK, r0, 1);
        r0 += __shfl_xor_sync(FULL_MASK, r0, 2);
        r1 += __shfl_xor_sync(FULL_MASK, r1, 1);
        r1 += __shfl_xor_sync(FULL_MASK, r1, 2);
        l0 = l0 * c0 + r0, l1 = l1 * c1 + r1, m0 = n0, m1 = n1;
#pragma unroll
        for (int j = 0; j < NT; ++j) o[j][0] *= c0, o[j][1] *= c0, o[j][2] *= c1, o[j][3] *= c1;
#pragma unroll
        for (int kk = 0; kk < TK / 16; ++kk) {
            uint32_t pa[4];
            pa[0] = pack_bf162(sc[2 * kk][0], sc[2 * kk][1]);
            pa[1] = pack_bf162(sc[2 * kk][2], sc[2 * kk][3]);
            pa[2] = pack_bf162(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            pa[3] = pack_bf162(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const bf16* vr = sVt + (j * 8 + g) * TLV + kk * 16 + 2 * t;
                mma_bf16(o[j], pa, lds32(vr), lds32(vr + 8));
            }
        }
    }
    const int ra = q0 + warp * 16 + g, rb = ra + 8;
    const float ia = 1.f / l0, ib = 1.f / l1;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int d = j * 8 + 2 * t;
        if (ra < q1)
            *reinterpret_cast<uint32_t*>(out + (size_t)ra * H * D + (size_t)head * D + d) = pack_bf162(o[j][0] * ia, o[j][1] * ia);
        if (rb < q1)
            *reinterpret_cast<uint32_t*>(out + (size_t)rb * H * D + (size_t)head * D + d) = pack_bf162(o[j][2] * ib, o[j][3] * ib);
    }
}

extern "C" __global__ void vis_gelu(const float* __restrict__ x, bf16* __restrict__ out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float a = x[i];
        out[i] = __float2bfloat16(0.5f * a * (1.f + erff(a * 0.70710678118654752f)));
    }
}
