// embed.cu: token embedding gather.
//
// x[row, :] = float(table[tokens[row], :])
//   tokens int32 [rows]; table bf16 [vocab, H]; x fp32 [rows, H] (the residual stream).
// One block per row; threads stride over H with 16-byte loads (8 bf16).
// Preconditions (checked by the wrapper): H % 8 == 0, 0 <= token < vocab.

extern "C" __global__ void embed(const int* __restrict__ tokens, const bf16* __restrict__ table,
                                 float* __restrict__ x, int H) {
    const int row = blockIdx.x;
    const uint4* src = reinterpret_cast<const uint4*>(table + (size_t)tokens[row] * H);
    float4* dst = reinterpret_cast<float4*>(x + (size_t)row * H);
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
        uint4 v = src[c];
        dst[2 * c] = make_float4(bf_lo(v.x), bf_hi(v.x), bf_lo(v.y), bf_hi(v.y));
        dst[2 * c + 1] = make_float4(bf_lo(v.z), bf_hi(v.z), bf_lo(v.w), bf_hi(v.w));
    }
}
