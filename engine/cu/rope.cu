// rope.cu: rotary embedding fused with the paged KV-cache write (and the per-head q/k RMSNorm).
//
// In:  qkv fp32 [rows, (H + 2*KVH) * D] (the fused q|k|v projection, biases added),
//      positions int32 [rows], slots int32 [rows] (cache slot of each row's token),
//      inv_freq fp32 [R/2] (the layer's rope, scaling already folded in on the host).
// Out: q bf16 [rows, H, D] rotated; K rotated and V copied into the cache.
// Cache layout (bf16): [num_blocks][num_layers][2 (K,V)][block_size][KVH][D]; the
//   wrapper passes `cache` already offset to this layer, `block_stride` elements
//   between blocks. slot s -> block s / block_size, offset s % block_size.
// Rotation is Hugging Face's rotate_half over the first R = rotary_dim dims: pairs
//   (i, i + R/2), angle pos * inv_freq[i], cos and sin times `factor` (yarn / longrope);
//   dims R.. pass through (partial rotary). R = 0: no rope at all.
// QK-norm (qwen3, gemma3): with q_norm / k_norm (bf16 [D]) each q / k head is RMSNormed
//   over its D values before the rotation (x * rsqrt(mean(x^2) + eps) * w); V is not.
// interleaved = 1: each head's D values of qkv are in the backend's rope-interleaved order
//   (the first R values in 8-value groups: position 16j + r holds dim 8j + r, position
//   16j + 8 + r dim R/2 + 8j + r; the rest in natural order; gemv.cu's gemv_tc_rope);
//   q and the cache are written in natural order.
// Multimodal rope (qwen2_5_vl, mrope1 > 0): positions int32 [rows][3] (temporal, height, width);
//   pair i rotates by component (i >= mrope1) + (i >= mrope2), the cumulative bounds of
//   mrope_section's runs (in pairs). mrope1 = 0: positions int32 [rows], one per row.
// Grid (rows + 1, H + KVH), block D/2 threads; blocks with head >= H do one KV head.
// Thread i handles dims (i, i + R/2) for i < R/2, else two of the pass-through dims.
// The extra row of blocks (row == rows) only asks L2 to prefetch pf_bytes of pf.

__device__ __forceinline__ int rope_src(int d, int R, int interleaved) {
    if (!interleaved || d >= R) return d;
    const int hr = R >> 1, j = d < hr ? d : d - hr;
    return 16 * (j >> 3) + (d < hr ? 0 : 8) + (j & 7);
}

extern "C" __global__ void rope_kv_write(const float* __restrict__ qkv, const int* __restrict__ positions,
                                         const int* __restrict__ slots, const float* __restrict__ inv_freq,
                                         bf16* __restrict__ q_out, bf16* __restrict__ cache, int H, int KVH,
                                         int D, int block_size, long long block_stride, int rows, const void* pf,
                                         long long pf_bytes, int interleaved, int rotary_dim, float factor,
                                         const bf16* __restrict__ q_norm, const bf16* __restrict__ k_norm,
                                         float eps, int mrope1, int mrope2) {
    __shared__ float scratch[32];
    const int row = blockIdx.x, head = blockIdx.y, i = threadIdx.x, R = rotary_dim, hr = R >> 1;
    if (row >= rows) {
        prefetch_l2(pf, pf_bytes, head * blockDim.x + i, gridDim.y * blockDim.x);
        return;  // weights only: no pdl_wait (the row blocks wait)
    }
    pdl_wait();  // PDL: the kernel before has written what this one reads (common.cuh)
    pdl_launch_dependents();
    const bool rot = i < hr;
    const int pass = (D - R) >> 1;  // pass-through dims per half
    const int da = rot ? i : R + (i - hr), db = rot ? i + hr : R + pass + (i - hr);
    const int sa = rope_src(da, R, interleaved), sb = rope_src(db, R, interleaved);
    const float* src = qkv + (size_t)row * (H + 2 * KVH) * D;
    float s = 0.f, c = 1.f;
    if (rot) {
        const int pos = mrope1 > 0 ? positions[row * 3 + (i >= mrope1) + (i >= mrope2)] : positions[row];
        sincosf((float)pos * inv_freq[i], &s, &c);
        c *= factor;
        s *= factor;
    }
    const float* xh = src + (size_t)head * D;  // q head, or k head (head - H) since k follows q
    float a = xh[sa], b = xh[sb];
    const bf16* nw = head < H ? q_norm : k_norm;
    if (nw != nullptr) {  // block-uniform
        const float r = rsqrtf(block_sum(a * a + b * b, scratch) / D + eps);
        a = a * r * __bfloat162float(nw[da]);
        b = b * r * __bfloat162float(nw[db]);
    }
    const float ra = rot ? a * c - b * s : a, rb = rot ? b * c + a * s : b;
    if (head < H) {
        bf16* o = q_out + ((size_t)row * H + head) * D;
        o[da] = __float2bfloat16(ra);
        o[db] = __float2bfloat16(rb);
    } else {
        const int kh = head - H;
        const float* vp = src + (size_t)(H + KVH + kh) * D;
        const int slot = slots[row];
        const int blk = slot / block_size, off = slot % block_size;
        bf16* kd = cache + (size_t)blk * block_stride + ((size_t)off * KVH + kh) * D;
        bf16* vd = kd + (size_t)block_size * KVH * D;
        kd[da] = __float2bfloat16(ra);
        kd[db] = __float2bfloat16(rb);
        vd[da] = __float2bfloat16(vp[sa]);
        vd[db] = __float2bfloat16(vp[sb]);
    }
}
