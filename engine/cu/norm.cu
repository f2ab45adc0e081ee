// norm.cu: RMSNorm and SwiGLU, the elementwise members of a layer.
//
// rmsnorm: out[row, :] = bf16(x[row, :] * rsqrt(mean(x[row, :]^2) + eps) * w)
//   x fp32 [rows, H] (row stride x_stride), w bf16 [H], out bf16 [rows, H].
//   The residual add is fused into the GEMV/GEMM epilogue that produces x
//   (accumulate mode), so this kernel reads the already-updated residual.
//   One block of 256 threads per row, two passes over the row (L1-resident).
// swiglu: out[r, j] = bf16(silu(gu[r, j]) * gu[r, I + j])
//   gu fp32 [rows, 2I] (gate then up, the fused gate_up projection), out bf16 [rows, I].
//   Grid-stride over rows*I.

extern "C" __global__ void rmsnorm(const float* __restrict__ x, const bf16* __restrict__ w,
                                   bf16* __restrict__ out, int H, int x_stride, float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    const float* xr = x + (size_t)row * x_stride;
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    const float r = rsqrtf(ss / H + eps);
    bf16* o = out + (size_t)row * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = __float2bfloat16(xr[i] * r * __bfloat162float(w[i]));
}

extern "C" __global__ void swiglu(const float* __restrict__ gu, bf16* __restrict__ out, int I, int rows) {
    const size_t n = (size_t)rows * I;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / I, j = i % I;
        const float g = gu[r * 2 * I + j], u = gu[r * 2 * I + I + j];
        out[i] = __float2bfloat16(g / (1.f + expf(-g)) * u);
    }
}
