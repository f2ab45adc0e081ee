// norm.cu: RMSNorm, the post-norm residual add, SwiGLU / GeGLU and the logit soft-cap: the
// elementwise members of a layer.
//
// rmsnorm: out[row, :] = bf16(x[row, :] * rsqrt(mean(x[row, :]^2) + eps) * w)
//   x fp32 [rows, H] (row stride x_stride), w bf16 [H], out bf16 [rows, H].
//   The residual add is fused into the GEMV/GEMM epilogue that produces x
//   (accumulate mode), so this kernel reads the already-updated residual.
//   One block of 256 threads per row, two passes over the row (L1-resident).
//   Blocks past `rows` (decode rounds) only ask L2 to prefetch pf_bytes of pf, the
//   weights of the GEMV that follows, so DRAM streams while this kernel runs.
// swiglu: out[r, j] = bf16(silu(gate_j) * up_j) from gu fp32 [rows, 2I], the fused
//   gate_up projection, out bf16 [rows, I]. interleaved = 0: gate_j = gu[r, j], up_j =
//   gu[r, I + j]; interleaved = 1 (the backend's layout, I % 8 == 0): 8-row groups,
//   gate_j = gu[r, 16(j/8) + j%8], up_j = gu[r, 16(j/8) + 8 + j%8]. Decode rounds fuse
//   this into the gate_up GEMV (gemv.cu, gemv_tc_swiglu); prefill chunks run it. Grid-stride.
//   act = 1: gelu_tanh(gate_j) * up_j instead (GeGLU, HF's gelu_pytorch_tanh).
// add_rmsnorm: x[row, :] += y[row, :] * rsqrt(mean(y[row, :]^2) + eps) * w, the post-norm
//   ("sandwich") residual add of gemma: y fp32 [rows, H] is the o / down projection.
//   With nw (decode rounds) also the next RMSNorm's inputs from the new x, as embed.cu:
//   xw = bf16(x * nw) and ss_out[row] = sum(x^2) (one partial per row). One block per row.
// softcap: x = cap * tanh(x / cap) in place over n values (gemma2's final logits). Grid-stride.

extern "C" __global__ void rmsnorm(const float* __restrict__ x, const bf16* __restrict__ w,
                                   bf16* __restrict__ out, int H, int x_stride, float eps, int rows,
                                   const void* pf, long long pf_bytes) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) {
        prefetch_l2(pf, pf_bytes, (row - rows) * blockDim.x + threadIdx.x, (gridDim.x - rows) * blockDim.x);
        return;  // weights only: no pdl_wait (the row blocks wait)
    }
    pdl_wait();  // PDL: the kernel before has written what this one reads (common.cuh)
    pdl_launch_dependents();
    const float* xr = x + (size_t)row * x_stride;
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    const float r = rsqrtf(ss / H + eps);
    bf16* o = out + (size_t)row * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = __float2bfloat16(xr[i] * r * __bfloat162float(w[i]));
}

extern "C" __global__ void swiglu(const float* __restrict__ gu, bf16* __restrict__ out, int I, int rows,
                                  int interleaved, int act) {
    pdl_wait();  // PDL: the kernel before has written what this one reads (common.cuh)
    pdl_launch_dependents();
    const size_t n = (size_t)rows * I;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / I, j = i % I;
        const size_t gi = interleaved ? (j >> 3) * 16 + (j & 7) : j, ui = interleaved ? gi + 8 : I + j;
        const float g = gu[r * 2 * I + gi], u = gu[r * 2 * I + ui];
        const float a = act ? 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)))
                            : g / (1.f + expf(-g));
        out[i] = __float2bfloat16(a * u);
    }
}

extern "C" __global__ void add_rmsnorm(const float* __restrict__ y, const bf16* __restrict__ w, float* __restrict__ x,
                                       int H, float eps, const bf16* __restrict__ nw, bf16* __restrict__ xw,
                                       float* __restrict__ ss_out) {
    pdl_wait();  // PDL: the kernel before has written what this one reads (common.cuh)
    pdl_launch_dependents();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    const float* yr = y + (size_t)row * H;
    float* xr = x + (size_t)row * H;
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss += yr[i] * yr[i];
    const float r = rsqrtf(block_sum(ss, scratch) / H + eps);
    float s2 = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float h = xr[i] + yr[i] * r * __bfloat162float(w[i]);
        xr[i] = h;
        if (nw != nullptr) {
            xw[(size_t)row * H + i] = __float2bfloat16(h * __bfloat162float(nw[i]));
            s2 += h * h;
        }
    }
    if (nw != nullptr) {
        s2 = block_sum(s2, scratch);
        if (threadIdx.x == 0) ss_out[row] = s2;
    }
}

extern "C" __global__ void softcap(float* __restrict__ x, long long n, float cap) {
    pdl_wait();  // PDL: the kernel before has written what this one reads (common.cuh)
    pdl_launch_dependents();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}
