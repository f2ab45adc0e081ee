// rope.cu: rotary embedding fused with the paged KV-cache write.
//
// In:  qkv fp32 [rows, (H + 2*KVH) * D] (the fused q|k|v projection, biases added),
//      positions int32 [rows], slots int32 [rows] (cache slot of each row's token),
//      inv_freq fp32 [D/2] (llama3 / linear scaling already folded in on the host).
// Out: q bf16 [rows, H, D] rotated; K rotated and V copied into the cache.
// Cache layout (bf16): [num_blocks][num_layers][2 (K,V)][block_size][KVH][D]; the
//   wrapper passes `cache` already offset to this layer, `block_stride` elements
//   between blocks. slot s -> block s / block_size, offset s % block_size.
// Rotation is Hugging Face's rotate_half: pairs (i, i + D/2), angle pos * inv_freq[i].
// interleaved = 1: each head's D values of qkv are in the backend's rope-interleaved order
//   (8-value groups: position 16j + r holds dim 8j + r, position 16j + 8 + r dim D/2 + 8j + r;
//   gemv.cu's gemv_tc_rope), q and the cache are written in natural order.
// Grid (rows + 1, H + KVH), block D/2 threads; blocks with head >= H do one KV head.
// The extra row of blocks (row == rows) only asks L2 to prefetch pf_bytes of pf (in a
// decode round: the o-projection weights, streamed while attention runs).

extern "C" __global__ void rope_kv_write(const float* __restrict__ qkv, const int* __restrict__ positions,
                                         const int* __restrict__ slots, const float* __restrict__ inv_freq,
                                         bf16* __restrict__ q_out, bf16* __restrict__ cache, int H, int KVH,
                                         int D, int block_size, long long block_stride, int rows, const void* pf,
                                         long long pf_bytes, int interleaved) {
    const int row = blockIdx.x, head = blockIdx.y, i = threadIdx.x, half = D / 2;
    const int ia = interleaved ? 16 * (i >> 3) + (i & 7) : i, ib = interleaved ? ia + 8 : i + half;
    if (row >= rows) {
        prefetch_l2(pf, pf_bytes, head * blockDim.x + i, gridDim.y * blockDim.x);
        return;
    }
    const float* src = qkv + (size_t)row * (H + 2 * KVH) * D;
    float s, c;
    sincosf((float)positions[row] * inv_freq[i], &s, &c);
    if (head < H) {
        const float* qh = src + head * D;
        const float a = qh[ia], b = qh[ib];
        bf16* o = q_out + ((size_t)row * H + head) * D;
        o[i] = __float2bfloat16(a * c - b * s);
        o[i + half] = __float2bfloat16(b * c + a * s);
    } else {
        const int kh = head - H;
        const float* kp = src + (H + kh) * D;
        const float* vp = src + (H + KVH + kh) * D;
        const int slot = slots[row];
        const int blk = slot / block_size, off = slot % block_size;
        bf16* kd = cache + (size_t)blk * block_stride + ((size_t)off * KVH + kh) * D;
        bf16* vd = kd + (size_t)block_size * KVH * D;
        const float a = kp[ia], b = kp[ib];
        kd[i] = __float2bfloat16(a * c - b * s);
        kd[i + half] = __float2bfloat16(b * c + a * s);
        vd[i] = __float2bfloat16(vp[ia]);
        vd[i + half] = __float2bfloat16(vp[ib]);
    }
}
