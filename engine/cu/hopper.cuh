// hopper.cuh: the sm_90a building blocks gemm_hopper.cu and attention_prefill_hopper.cu share
// (prepended after common.cuh by engine/cu/hopper.py).
//
// TmaMap: a CUtensorMap passed by value (__grid_constant__). mbarriers (init, expect_tx, arrive,
// wait on a parity), TMA tile loads of a 2-D or 3-D tensor map completing on an mbarrier, wgmma
// shared-memory descriptors for the 128-byte swizzle (K-major: 128-byte rows of K; MN-major:
// 128-byte rows of 64 MN elements, one row per k), and the wgmma m64nNk16 bf16 -> fp32 wrappers:
// both operands from shared memory (n128, n256), or A from registers and B MN-major (n128,
// the P V product of attention). Accumulator layout of m64nN: d[4j + 2h + e] of a thread is
// row 16 * warp + lane / 4 + 8h, column 8j + 2 * (lane % 4) + e (warp within the warpgroup).



struct __align__(64) TmaMap {
    unsigned long long v[16];  // a CUtensorMap, opaque (cuTensorMapEncodeTiled's output)
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
    const uint32_t a = smem_u32(bar);
    uint32_t done;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(a), "r"(parity) : "memory");
    } while (!done);
}
// A box of the 2-D tensor map at (c0 = k, c1 = row) into shared memory, completing on bar.
__device__ __forceinline__ void tma_load(void* dst, const TmaMap* map, uint64_t* bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
        ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
        : "memory");
}

// A box of the 3-D tensor map at (c0, c1, c2) into shared memory, completing on bar.
__device__ __forceinline__ void tma_load_3d(void* dst, const TmaMap* map, uint64_t* bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
        ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}

// wgmma shared-memory descriptor of a K-major tile with 128-byte rows, 128-byte swizzle.
__device__ __forceinline__ uint64_t sw128_desc(const void* p) {
    const uint64_t a = smem_u32(p);
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
// wgmma descriptor of an MN-major tile with the 128-byte swizzle: rows of 64 MN elements (128
// bytes), one a k, 8-row groups 1024 bytes apart (SBO); the next 64 MN elements lbo bytes on (LBO).
__device__ __forceinline__ uint64_t sw128_mn_desc(const void* p, uint32_t lbo) {
    const uint64_t a = smem_u32(p);
    return ((a & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pin a register across the asynchronous wgmma (no read or move of it hoisted over a fence or wait).
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void reg_fence(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// The accumulator operands of the wrappers below: "+f"(d[i]) .. "+f"(d[i + 31]) (one list for every shape).
#define WG_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_D16(i) WG_D4(i), WG_D4(i + 4), WG_D4(i + 8), WG_D4(i + 12)
#define WG_D32(i) WG_D16(i), WG_D16(i + 16)

// The accumulator lists of the wrappers' asm text: "%0, ..., %15" (n32), "%0, ..., %31" (n64),
// "%0, ..., %63" (n128) and "%0, ..., %127" (n256).
#define WG_R16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define WG_R32 WG_R16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_R64 \
    WG_R32 ","                                                                               \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"       \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_R128 \
    WG_R64 ","                                                                               \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"       \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"       \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// NAME(d, da, db, scale_d): D[64 x N] (+)= A[64 x K] * B[N x K]^T, both K-major in shared memory
// (descriptors); d: N / 2 fp32 a thread; scale_d == 0 overwrites D. SHAPE_TYPES is the instruction's
// ".kK.f32.A.B" part, IMM its immediates after the predicate (bf16: scale a, scale b, transpose a, b;
// fp8 takes no transpose). bf16 here (wgmma_n32 .. wgmma_n256, K 16); gemm_hopper.cu's fp8 build
// makes its e4m3 ones (K 32) with the same macros.
#define WGMMA_SS_N32(NAME, SHAPE_TYPES, IMM)                                                               \
    __device__ __forceinline__ void NAME(float* d, uint64_t da, uint64_t db, int scale_d) {               \
        asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n wgmma.mma_async.sync.aligned.m64n32"   \
                     SHAPE_TYPES " {" WG_R16 "}, %16, %17, p" IMM ";\n}\n"                                \
                     : WG_D16(0)                                                                          \
                     : "l"(da), "l"(db), "r"(scale_d));                                                    \
    }
#define WGMMA_SS_N64(NAME, SHAPE_TYPES, IMM)                                                               \
    __device__ __forceinline__ void NAME(float* d, uint64_t da, uint64_t db, int scale_d) {               \
        asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n wgmma.mma_async.sync.aligned.m64n64"   \
                     SHAPE_TYPES " {" WG_R32 "}, %32, %33, p" IMM ";\n}\n"                                \
                     : WG_D32(0)                                                                          \
                     : "l"(da), "l"(db), "r"(scale_d));                                                    \
    }
#define WGMMA_SS_N128(NAME, SHAPE_TYPES, IMM)                                                              \
    __device__ __forceinline__ void NAME(float* d, uint64_t da, uint64_t db, int scale_d) {               \
        asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n wgmma.mma_async.sync.aligned.m64n128" \
                     SHAPE_TYPES " {" WG_R64 "}, %64, %65, p" IMM ";\n}\n"                                \
                     : WG_D32(0), WG_D32(32)                                                              \
                     : "l"(da), "l"(db), "r"(scale_d));                                                    \
    }
#define WGMMA_SS_N256(NAME, SHAPE_TYPES, IMM)                                                              \
    __device__ __forceinline__ void NAME(float* d, uint64_t da, uint64_t db, int scale_d) {               \
        asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n wgmma.mma_async.sync.aligned.m64n256" \
                     SHAPE_TYPES " {" WG_R128 "}, %128, %129, p" IMM ";\n}\n"                           \
                     : WG_D32(0), WG_D32(32), WG_D32(64), WG_D32(96)                                      \
                     : "l"(da), "l"(db), "r"(scale_d));                                                    \
    }
WGMMA_SS_N32(wgmma_n32, "k16.f32.bf16.bf16", ", 1, 1, 0, 0")
WGMMA_SS_N64(wgmma_n64, "k16.f32.bf16.bf16", ", 1, 1, 0, 0")
WGMMA_SS_N128(wgmma_n128, "k16.f32.bf16.bf16", ", 1, 1, 0, 0")
WGMMA_SS_N256(wgmma_n256, "k16.f32.bf16.bf16", ", 1, 1, 0, 0")

// D[64 x 128] += A[64 x 16] * B[16 x 128], A from registers (a[4]: mma.sync's m16k16 A fragment of
// this warp's 16 rows), B MN-major in shared memory (descriptor, transposed: imm-trans-b = 1).
__device__ __forceinline__ void wgmma_rs_n128_t(float* d, const uint32_t* a, uint64_t db) {
    asm volatile(
        "{\n wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n}\n"
        : WG_D32(0), WG_D32(32)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// D[64 x 64] += A[64 x 16] * B[16 x 64], as wgmma_rs_n128_t over one 64-wide MN chunk.
__device__ __forceinline__ void wgmma_rs_n64_t(float* d, const uint32_t* a, uint64_t db) {
    asm volatile(
        "{\n wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n}\n"
        : WG_D32(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
