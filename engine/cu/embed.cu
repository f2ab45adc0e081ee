// embed.cu: token embedding gather.
//
// x[row, :] = float(table[tokens[row], :]) * scale (gemma: sqrt(hidden); 1 otherwise)
//   tokens int32 [rows]; table bf16 [vocab, H]; x fp32 [rows, H] (the residual stream).
// With src (decode rounds planned ahead, docs/CUDA.md): a row with src[row] >= 0 embeds
//   prev[src[row]] instead, the token row src[row] of the round before drew (still in the
//   round's `out`, which this round's sampling overwrites only after its last layer).
// With nw (decode rounds: the first layer's RMSNorm fused, see gemv.cu): also
//   xw[row, :] = bf16(x[row, :] * nw) and ss_out[row] = sum(x[row, :]^2) (one partial per row).
// One block per row; threads stride over H with 16-byte loads (8 bf16).
// Preconditions (checked by the wrapper): H % 8 == 0, 0 <= token < vocab.

extern "C" __global__ void embed(const int* __restrict__ tokens, const bf16* __restrict__ table,
                                 float* __restrict__ x, int H, const bf16* __restrict__ nw, bf16* __restrict__ xw,
                                 float* __restrict__ ss_out, float scale, const int* __restrict__ src_rows,
                                 const int* __restrict__ prev) {
    pdl_wait();  // PDL: the kernel before has written what this one reads (common.cuh)
    pdl_launch_dependents();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    int token = tokens[row];
    if (src_rows != nullptr && src_rows[row] >= 0) token = prev[src_rows[row]];
    const uint4* src = reinterpret_cast<const uint4*>(table + (size_t)token * H);
    float4* dst = reinterpret_cast<float4*>(x + (size_t)row * H);
    float ss = 0.f;
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
        uint4 v = src[c];
        const float f[8] = {bf_lo(v.x) * scale, bf_hi(v.x) * scale, bf_lo(v.y) * scale, bf_hi(v.y) * scale,
                            bf_lo(v.z) * scale, bf_hi(v.z) * scale, bf_lo(v.w) * scale, bf_hi(v.w) * scale};
        dst[2 * c] = make_float4(f[0], f[1], f[2], f[3]);
        dst[2 * c + 1] = make_float4(f[4], f[5], f[6], f[7]);
        if (nw != nullptr) {
            const uint4 wv = reinterpret_cast<const uint4*>(nw)[c];
            const float w[8] = {bf_lo(wv.x), bf_hi(wv.x), bf_lo(wv.y), bf_hi(wv.y),
                                bf_lo(wv.z), bf_hi(wv.z), bf_lo(wv.w), bf_hi(wv.w)};
#pragma unroll
            for (int j = 0; j < 8; j++) ss += f[j] * f[j];
            reinterpret_cast<uint4*>(xw + (size_t)row * H)[c] =
                make_uint4(pack_bf162(f[0] * w[0], f[1] * w[1]), pack_bf162(f[2] * w[2], f[3] * w[3]),
                           pack_bf162(f[4] * w[4], f[5] * w[5]), pack_bf162(f[6] * w[6], f[7] * w[7]));
        }
    }
    if (nw != nullptr) {
        ss = block_sum(ss, scratch);
        if (threadIdx.x == 0) ss_out[row] = ss;
    }
}
