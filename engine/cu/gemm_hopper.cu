// gemm_hopper.cu: the Hopper prefill GEMM (wgmma m64nNk16 bf16, fp32 accumulate, TMA, mbarriers).
//
// C[m, n] (+)= sum_k A[m, k] * W[n, k] (+ bias[n])   -- gemm.cu's contract, sm_90a only
//   A bf16 [M, K] row-major (activations), W bf16 [N, K] (torch Linear layout), bias fp32 [N] or
//   null, C fp32 [M, ldc]; accumulate != 0 adds into C (the fused residual add).
// Tiles: BM x BN x 64 per block, BM = 64 * HG_NC (HG_NC consumer warpgroups of 64 rows each),
//   BN = HG_BN (128 or 256). Block = 128 * (HG_NC + 1) threads: warpgroup 0 is the producer
//   (one thread issues the TMA copies; with 2 consumers setmaxnreg moves registers to them),
//   warpgroups 1..HG_NC each own 64 rows x BN columns of the tile in registers (BN / 2 fp32
//   a thread) and issue 4 wgmma m64nBNk16 per 64-wide k step, both operands from shared memory.
// Pipeline: HG_STAGES shared-memory stages of (BM + BN) x 64 bf16, each row 128 bytes with the
//   128-byte swizzle (TMA writes it, the wgmma descriptors read it: SBO 1024 bytes between
//   8-row groups, a k step of 16 advances the start address by 32 bytes). Stage s has two
//   mbarriers: full[s] (1 arrival + the bytes the TMA copies complete) and empty[s] (one
//   arrival per consumer warpgroup, after the wgmma reading it retired; the consumers arrive
//   once up front so the producer's first pass finds every stage empty). Parities flip each
//   pass over the ring; the counters run on across tiles. One wgmma batch stays in flight: a
//   stage is released when the next one's batch is committed and the earlier batch waited.
// Persistent: grid = min(tiles, SMs) blocks walk tiles t = blockIdx.x + i * gridDim.x; tiles go
//   in groups of HG_GROUP_M row blocks (row block fastest), so the blocks resident at once share
//   W tiles and A rows in L2. The producer runs ahead into the next tile while the consumers
//   write this one's epilogue straight from registers (float2 stores, bias, accumulate).
// Out of range rows / columns / k are zero-filled by the TMA (so any M, N and K % 8 == 0 work);
//   stores are guarded by row < M, col < N.
// Dynamic shared memory: HG_STAGES * (BM + BN) * 128 + 1024 (alignment) + 256 (barriers).
// Preconditions (engine/cu/hopper.py): K % 8 == 0, A and W 16-byte aligned (TMA), C 8-byte
//   aligned and ldc even, the tensor maps encoded for A [M, K] box (64, BM) and W [N, K] box
//   (64, BN), bf16, 128-byte swizzle; passed by value (__grid_constant__).

#ifndef HG_NC
#error "HG_NC, HG_BN, HG_STAGES are defined by engine/cu/hopper.py"
#endif
#define BM (64 * HG_NC)
#define BN HG_BN
#define BK 64
#define HG_THREADS (128 * (HG_NC + 1))
#define STAGE_BYTES ((BM + BN) * BK * 2)
#ifndef HG_GROUP_M
#define HG_GROUP_M 16
#endif
static_assert(HG_NC == 1 || HG_NC == 2, "one or two consumer warpgroups");
static_assert(BN == 128 || BN == 256, "wgmma n128 or n256");

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

// wgmma shared-memory descriptor of a K-major tile with 128-byte rows, 128-byte swizzle.
__device__ __forceinline__ uint64_t sw128_desc(const void* p) {
    const uint64_t a = smem_u32(p);
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pin a register across the asynchronous wgmma (no read or move of it hoisted over a fence or wait).
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// D[64 x 128] (+)= A[64 x 16] * B[128 x 16]^T, both K-major in shared memory (descriptors);
// d: 64 fp32 a thread; scale_d == 0 overwrites D.
__device__ __forceinline__ void wgmma_n128(float* d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(scale_d));
}

// D[64 x 256] (+)= A[64 x 16] * B[256 x 16]^T, both K-major in shared memory (descriptors);
// d: 128 fp32 a thread; scale_d == 0 overwrites D.
__device__ __forceinline__ void wgmma_n256(float* d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(scale_d));
}

#if BN == 256
#define WGMMA wgmma_n256
#else
#define WGMMA wgmma_n128
#endif

// Tile t -> (row block, column block): groups of HG_GROUP_M row blocks, the row block fastest.
__device__ __forceinline__ void tile_coords(int t, int mt, int nt, int& mb, int& nb) {
    const int per_group = HG_GROUP_M * nt, g = t / per_group, first = g * HG_GROUP_M;
    const int size = min(mt - first, HG_GROUP_M), r = t - g * per_group;
    mb = first + r % size;
    nb = r / size;
}

extern "C" __global__ void __launch_bounds__(HG_THREADS, 1)
    gemm_hopper(const __grid_constant__ TmaMap tmA, const __grid_constant__ TmaMap tmW,
                const float* __restrict__ bias, float* __restrict__ C, int M, int N, int K, int ldc, int accumulate) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);  // 128B swizzle: 1 KB aligned
    bf16* sA = reinterpret_cast<bf16*>(smem);  // [HG_STAGES][BM][BK]
    bf16* sB = sA + HG_STAGES * BM * BK;       // [HG_STAGES][BN][BK]
    uint64_t* full = reinterpret_cast<uint64_t*>(sB + HG_STAGES * BN * BK);
    uint64_t* empty = full + HG_STAGES;

    const int mt = (M + BM - 1) / BM, nt = (N + BN - 1) / BN, tiles = mt * nt, KT = (K + BK - 1) / BK;
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < HG_STAGES; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], HG_NC);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {  // producer
#if HG_NC == 2
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
#endif
        if (tid == 0) {
            int s = 0, ph = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                int mb, nb;
                tile_coords(t, mt, nt, mb, nb);
                for (int kt = 0; kt < KT; kt++) {
                    mbar_wait(&empty[s], ph);
                    mbar_expect_tx(&full[s], STAGE_BYTES);
                    tma_load(sA + s * BM * BK, &tmA, &full[s], kt * BK, mb * BM);
                    tma_load(sB + s * BN * BK, &tmW, &full[s], kt * BK, nb * BN);
                    if (++s == HG_STAGES) {
                        s = 0;
                        ph ^= 1;
                    }
                }
            }
        }
    } else {  // consumers: warpgroup wg owns rows (wg - 1) * 64 .. + 63 of the tile
#if HG_NC == 2
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
#endif
        if (tid == 0)
            for (int s = 0; s < HG_STAGES; s++) mbar_arrive(&empty[s]);
        const int warp = tid / 32, lane = tid % 32;
        float d[BN / 2];
        int s = 0, ph = 0;
        for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
            int mb, nb;
            tile_coords(t, mt, nt, mb, nb);
            int prev = 0;
            for (int kt = 0; kt < KT; kt++) {
                mbar_wait(&full[s], ph);
                const bf16* a = sA + s * BM * BK + (wg - 1) * 64 * BK;
                const bf16* b = sB + s * BN * BK;
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < BK / 16; k++) WGMMA(d, sw128_desc(a + k * 16), sw128_desc(b + k * 16), kt | k);
                wgmma_commit();
                wgmma_wait<1>();  // the previous stage's batch has retired: hand that stage back
                if (kt > 0 && tid == 0) mbar_arrive(&empty[prev]);
                prev = s;
                if (++s == HG_STAGES) {
                    s = 0;
                    ph ^= 1;
                }
            }
            wgmma_wait<0>();
            if (tid == 0) mbar_arrive(&empty[prev]);
#pragma unroll
            for (int i = 0; i < BN / 2; i++) reg_fence(d[i]);

            // d[4j + 2h + e]: row 16 * warp + lane / 4 + 8h, column 8j + 2 * (lane % 4) + e of the 64 x BN part.
            const int row0 = mb * BM + (wg - 1) * 64 + warp * 16 + lane / 4, col0 = nb * BN + 2 * (lane % 4);
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                const int col = col0 + 8 * j;
                if (col >= N) continue;
                float b0 = 0.f, b1 = 0.f;
                if (bias) {
                    b0 = bias[col];
                    if (col + 1 < N) b1 = bias[col + 1];
                }
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int row = row0 + 8 * h;
                    if (row >= M) continue;
                    float v0 = d[4 * j + 2 * h] + b0, v1 = d[4 * j + 2 * h + 1] + b1;
                    float* c = C + (size_t)row * ldc + col;
                    if (col + 1 < N) {
                        if (accumulate) {
                            const float2 o = *reinterpret_cast<const float2*>(c);
                            v0 += o.x;
                            v1 += o.y;
                        }
                        *reinterpret_cast<float2*>(c) = make_float2(v0, v1);
                    } else {
                        *c = accumulate ? *c + v0 : v0;
                    }
                }
            }
        }
    }
}
