// common.cuh: helpers every ignis kernel file is compiled with (prepended by
// engine/cu/kernels.py, so PyCUDA's cache key covers it).
//
// bf16 storage, fp32 arithmetic. Warp/block reductions, 16-byte vector
// unpacking, cp.async and ldmatrix/mma.sync wrappers for sm_90.
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;
typedef __nv_bfloat162 bf162;

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : 0.f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

// bf16 pair packed in a u32 -> two floats (bf16 is the top half of an fp32).
__device__ __forceinline__ float bf_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ uint32_t pack_bf162(float a, float b) {
    bf162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}

// Streaming 16-byte load that does not allocate in L1 (weights are read once).
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// Ask L2 to fetch bytes [off, off + bytes) of p (fire and forget; sm_90 bulk prefetch). Thread
// `idx` of `count` takes every count-th 8 KB piece. Used by the small kernels of a decode round
// to start streaming the next GEMV's weights while the memory system would otherwise idle.
__device__ __forceinline__ void prefetch_l2(const void* p, long long bytes, int idx, int count) {
    const char* c = static_cast<const char*>(p);
    for (long long off = (long long)idx * 8192; off < bytes; off += (long long)count * 8192) {
        const unsigned n = (unsigned)min(8192LL, bytes - off) & ~15u;
        if (n) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(c + off), "r"(n) : "memory");
    }
}

// Programmatic dependent launch (PDL=1: engine/cu/launch.py compiles a source so for Kernels built
// with pdl, and launches it with cuLaunchKernelEx's programmatic stream serialization). The kernel
// may start while the one before it on the stream still runs: pdl_wait() blocks until that one
// has completed and its writes are visible, so nothing the kernels before wrote may be read
// before it (weights may: gemv.cu issues its first weight loads first). pdl_launch_dependents()
// lets the kernel after this one start (its blocks take SMs as this one's leave, and wait in
// their own pdl_wait). Every block that reads inputs calls pdl_wait, so a kernel completes only
// after the one before it did, and the chain stays ordered. Without PDL both are nothing.
__device__ __forceinline__ void pdl_wait() {
#if defined(PDL) && PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(PDL) && PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Predicated 16-byte loads (zero when !pred) without a branch, so a batch of them stays in flight.
__device__ __forceinline__ uint4 ld_stream_if(const void* p, bool pred) {
    uint4 r;
    asm volatile(
        "{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n"
        " mov.b32 %3, 0;\n @q ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n}"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "r"((int)pred));
    return r;
}
// PDL builds read what the kernel before writes with coherent loads (ld.global): a non-coherent one
// (.nc) promises the data stays unwritten for the kernel's whole life, which with PDL includes the
// kernel before's last writes, and ptxas may schedule it above griddepcontrol.wait (on the card
// gemv_tc's x loads read the previous kernel's stale output that way). PDL_IN qualifies such a
// pointer: __restrict__ (the compiler may pick .nc) without PDL, nothing with it.
#if defined(PDL) && PDL
#define LDX_NC ""
#define PDL_IN
#else
#define LDX_NC ".nc"
#define PDL_IN __restrict__
#endif
__device__ __forceinline__ uint4 ldg_if(const void* p, bool pred) {
    uint4 r;
    asm volatile(
        "{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n"
        " mov.b32 %3, 0;\n @q ld.global" LDX_NC ".v4.u32 {%0,%1,%2,%3}, [%4];\n}"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "r"((int)pred));
    return r;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
// 4 bytes (cp.async's .ca form; src_bytes 0 zero-fills), for operands scattered at 4-byte granules.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes) {
    uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* smem) {
    uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* smem) {
    uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}

// D = A(16x16 bf16, row) * B(16x8 bf16, col) + D, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One 16-wide k slice of gemv.cu's permuted order, twice: A rows g / g + 8 are wa / wb (a thread's
// 16-byte chunk of each, 8 k), B column g is xv (the same 8 k); values 0-3 of a chunk take k slots
// 2t, 2t + 1, 2t + 8, 2t + 9 of the first mma, values 4-7 those of the second. The same permutation
// on A and B, so 16 contiguous bytes a row feed the mma without shuffles (gemv.cu, attention_decode.cu).
__device__ __forceinline__ void tc_step(float* c, const uint4& wa, const uint4& wb, const uint4& xv) {
    const uint32_t a0[4] = {wa.x, wb.x, wa.y, wb.y};
    const uint32_t a1[4] = {wa.z, wb.z, wa.w, wb.w};
    mma_bf16(c, a0, xv.x, xv.y);
    mma_bf16(c, a1, xv.z, xv.w);
}

#if defined(MOE_MX) && MOE_MX  // MXFP4 experts (engine/cu/mxfp4.py): moe_gemv.cu and moe_gemm.cu
// A u32 of 8 e2m1 codes in mxfp4.py's nibble order -> (v0, v1) .. (v6, v7) as 4 bf16x2, unscaled.
// A code's magnitude bits go to bf16 bits 8..6 (exponent 0..3 and one mantissa bit: the value times
// 2^-126, subnormal for 0 and 0.5) and its sign to bit 15; one bf16x2 multiply by 2^126 (exact,
// subnormal inputs kept) gives the value.
__device__ __forceinline__ uint32_t mx_pair(uint32_t bits) {
    uint32_t r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(bits), "r"(0x7e807e80u), "r"(0x80008000u));
    return r;
}

__device__ __forceinline__ uint4 mx_decode(uint32_t q) {
    const uint32_t M = 0x01c001c0u, S = 0x80008000u;
    return make_uint4(mx_pair(((q << 6) & M) | ((q << 12) & S)), mx_pair(((q << 2) & M) | ((q << 8) & S)),
                      mx_pair(((q >> 2) & M) | ((q << 4) & S)), mx_pair(((q >> 6) & M) | (q & S)));
}

// e8m0 -> 2^(s - 127) (s = 0: 2^-127, an fp32 subnormal).
__device__ __forceinline__ float mx_scale(uint32_t s) {
    return __uint_as_float(s ? s << 23 : 0x00400000u);
}

// Byte j of four e8m0 scales -> 2^(s - 127) in two instructions (the decode's: s = 0 reads as 0, not
// 2^-127; a block that small contributes below 1e-37).
__device__ __forceinline__ float mx_scale_of(uint32_t s4, int j) {
    return __uint_as_float((j < 3 ? s4 << (23 - 8 * j) : s4 >> 1) & 0x7f800000u);
}
#endif
