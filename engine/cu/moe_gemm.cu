// moe_gemm.cu: a prefill chunk's expert products, grouped by expert (moe.cu routes and groups).
//
// One block computes a 128-pair x 128-column tile of one expert: tile t of the groups table
// (moe.cu: tiles[3t..3t+2] = expert, first pair, count <= 128) over pairs[first .. first + count).
// Its A rows are gathered through the group: row r is A + (pairs[first + r] / a_div) * K (the
// gate|up pass reads x[m] for pair m*k + s with a_div = k; the down pass reads act[pair], a_div = 1),
// and its outputs land at row pairs[first + r]: each pair's result in its own row, no atomics.
//   moe_gemm_gu:   act bf16 [P, N/2] = act(gate, up) of A @ Wgu^T (+ bias), Wgu interleaved in
//                  8-row groups (moe.cu), so a thread's fragments ni = 0, 1 (and 2, 3) hold a gate
//                  column and its up column: the activation is the epilogue.
//   moe_gemm_down: y fp32 [P, N] = A @ Wd^T (+ bias).
// Expert weights through the slot table as in moe.cu: pool + slot_of[e] * stride.
// Grid (tmax, ceil(N / 128)); blocks past n_tiles (grp[1]) return. Tiles as gemm.cu's: 128 x 128 x
// 32, 8 warps as 2 x 4 (64 x 32 each), 3-stage cp.async pipeline, rows padded to 40 bf16 for
// ldmatrix, zero-filled edges. Dynamic shared memory MOE_GEMM_SMEM bytes.
// Preconditions (wrapper): K % 8 == 0, N % 16 == 0 for moe_gemm_gu, 16-byte aligned pointers.
// MOE_MX 1: the pools hold MXFP4 blobs (engine/cu/mxfp4.py's layout, stride in bytes; K % 32 == 0). A
// k-tile of 32 is one block a row: its 4 nibble words (one a quad lane's 16 bytes) and the row's scale
// word come in by 4-byte cp.async with the A tile, and after they land the block turns them into the
// bf16 B tile with moe_mx_dequant's operations (mx_decode, times mx_scale in fp32, rounded: exact), so
// the products are the dequantized scratch's GEMM bit for bit while HBM streams a quarter of the bytes.

#define BM 128
#define BN 128
#define BK 32
#define LDS 40
#define STAGES 3
#ifndef MOE_THREADS
#error "MOE_THREADS is defined by engine/backends/cuda/moe.py"
#endif
static_assert(MOE_THREADS == 256, "moe_gemm: 8 warps as 2 x 4");
#ifndef MOE_MX
#define MOE_MX 0
#endif
#if MOE_MX
typedef unsigned char wt_t;  // MXFP4 blobs, addressed in bytes
#define MX_WORDS 5           // a row's raw k-tile: 4 nibble words (lanes t = 0..3), then its group's scale word
#else
typedef bf16 wt_t;
#endif

__device__ __forceinline__ float act_fn(float g, float u, int oai, float limit) {
    if (oai) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
        return (u + 1.f) * (g / (1.f + expf(-1.702f * g)));
    }
    return g / (1.f + expf(-g)) * u;
}

// acc = this warp's 64 x 32 of A_tile @ W_tile^T over all of K.
__device__ __forceinline__ void tile_mma(const bf16* __restrict__ A, int a_div, const int* __restrict__ prs,
                                         int rows, const wt_t* __restrict__ W, int N, int K, int n0,
                                         float (&acc)[4][4][4]) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* sA = reinterpret_cast<bf16*>(smem_raw);
    bf16* sB = sA + STAGES * BM * LDS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wm = warp >> 2, wn = warp & 3;
    const bf16* arow[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int row = (tid + i * MOE_THREADS) >> 2;
        arow[i] = row < rows ? A + (size_t)(prs[row] / a_div) * K : nullptr;
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
    const int KT = (K + BK - 1) / BK;
#if MOE_MX
    // sB: the one bf16 B tile; raw: STAGES x BN rows x MX_WORDS u32 after it.
    uint32_t* raw = reinterpret_cast<uint32_t*>(sB + BN * LDS);
    const int Kp = (K + 127) / 128 * 128;
    const unsigned char* S = W + (size_t)N * (Kp / 2);
#endif
    auto load_stage = [&](int stage, int k0) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int idx = tid + i * MOE_THREADS, row = idx >> 2, ch = idx & 3;
            const int gk = k0 + ch * 8, gn = n0 + row;
            const bool oka = arow[i] != nullptr && gk < K, okb = gn < N && gk < K;
            cp_async16(&sA[(stage * BM + row) * LDS + ch * 8], oka ? arow[i] + gk : A, oka ? 16 : 0);
#if MOE_MX  // item idx: row idx / 4's nibble word of lane ch (block k0 / 32 = 4 G + j of the row's groups)
            const int b = k0 / BK, G = b >> 2, j = b & 3;
            cp_async4(&raw[(stage * BN + row) * MX_WORDS + ch],
                      W + (size_t)(okb ? gn : 0) * (Kp / 2) + G * 64 + 16 * ch + 4 * j, okb ? 4 : 0);
            if (i == 0 && tid < BN) {  // row tid's scale word (the 4 blocks of group G)
                const bool oks = n0 + tid < N;
                cp_async4(&raw[(stage * BN + tid) * MX_WORDS + 4], S + (size_t)(oks ? n0 + tid : 0) * (Kp / 32) + 4 * G,
                          oks ? 4 : 0);
            }
#else
            cp_async16(&sB[(stage * BN + row) * LDS + ch * 8], W + (size_t)(okb ? gn : 0) * K + (okb ? gk : 0),
                       okb ? 16 : 0);
#endif
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < KT) load_stage(s, s * BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int nk = kt + STAGES - 1;
        if (nk < KT) load_stage(nk % STAGES, nk * BK);
        cp_async_commit();
        const bf16* a_st = sA + (kt % STAGES) * BM * LDS;
#if MOE_MX
        {  // thread (row r, half h): lanes 2h, 2h + 1's 8 values each, moe_mx_dequant's arithmetic
            const int r = tid >> 1, h = tid & 1;
            const uint32_t* rw = raw + ((kt % STAGES) * BN + r) * MX_WORDS;
            const float f = mx_scale((rw[4] >> (8 * (kt & 3))) & 0xffu);
#pragma unroll
            for (int t = 2 * h; t < 2 * h + 2; t++) {
                const uint4 v = mx_decode(rw[t]);
                *reinterpret_cast<uint4*>(&sB[r * LDS + 8 * t]) =
                    make_uint4(pack_bf162(bf_lo(v.x) * f, bf_hi(v.x) * f), pack_bf162(bf_lo(v.y) * f, bf_hi(v.y) * f),
                               pack_bf162(bf_lo(v.z) * f, bf_hi(v.z) * f), pack_bf162(bf_lo(v.w) * f, bf_hi(v.w) * f));
            }
        }
        __syncthreads();
        const bf16* b_st = sB;
#else
        const bf16* b_st = sB + (kt % STAGES) * BN * LDS;
#endif
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[4][4], bfr[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
                ldmatrix_x4(af[mi], a_st + (wm * 64 + mi * 16 + (lane & 15)) * LDS + kk + (lane >> 4) * 8);
#pragma unroll
            for (int nj = 0; nj < 2; nj++) {
                uint32_t r[4];
                ldmatrix_x4(r, b_st + (wn * 32 + nj * 16 + (lane & 7) + (lane >> 4) * 8) * LDS + kk +
                                   ((lane >> 3) & 1) * 8);
                bfr[2 * nj][0] = r[0];
                bfr[2 * nj][1] = r[1];
                bfr[2 * nj + 1][0] = r[2];
                bfr[2 * nj + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int ni = 0; ni < 4; ni++) mma_bf16(acc[mi][ni], af[mi], bfr[ni][0], bfr[ni][1]);
        }
    }
    cp_async_wait<0>();
}

#define TILE_HEAD                                                                                     \
    if ((int)blockIdx.x >= grp[1]) return;                                                            \
    const int e = tiles[3 * blockIdx.x], first = tiles[3 * blockIdx.x + 1], rows = tiles[3 * blockIdx.x + 2]; \
    const int* prs = pairs + first;                                                                   \
    const wt_t* W = pool + (size_t)slot_of[e] * stride;                                               \
    const int n0 = blockIdx.y * BN, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;                 \
    const int wm = warp >> 2, wn = warp & 3;                                                          \
    float acc[4][4][4];                                                                               \
    tile_mma(A, a_div, prs, rows, W, N, K, n0, acc);

extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_gemm_gu(const bf16* __restrict__ A, int a_div, const wt_t* __restrict__ pool, long long stride,
                const int* __restrict__ slot_of, const float* __restrict__ bias, const int* __restrict__ grp,
                const int* __restrict__ tiles, const int* __restrict__ pairs, int N, int K, bf16* __restrict__ act,
                int oai, float limit) {
    TILE_HEAD
    const int half = N >> 1;
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni += 2) {  // ni: gate columns 16J + c, ni + 1: up columns 16J + 8 + c
            const int col = n0 + wn * 32 + ni * 8 + (lane & 3) * 2;
            if (col >= N) continue;
            const int i = (col >> 4) * 8 + (col & 15);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = wm * 64 + mi * 16 + (lane >> 2) + h * 8;
                if (row >= rows) continue;
                float g0 = acc[mi][ni][2 * h], g1 = acc[mi][ni][2 * h + 1];
                float u0 = acc[mi][ni + 1][2 * h], u1 = acc[mi][ni + 1][2 * h + 1];
                if (bias != nullptr) {
                    const float* b = bias + (size_t)e * N + col;
                    g0 += b[0]; g1 += b[1]; u0 += b[8]; u1 += b[9];
                }
                *reinterpret_cast<uint32_t*>(act + (size_t)prs[row] * half + i) =
                    pack_bf162(act_fn(g0, u0, oai, limit), act_fn(g1, u1, oai, limit));
            }
        }
}

extern "C" __global__ void __launch_bounds__(MOE_THREADS)
    moe_gemm_down(const bf16* __restrict__ A, int a_div, const wt_t* __restrict__ pool, long long stride,
                  const int* __restrict__ slot_of, const float* __restrict__ bias, const int* __restrict__ grp,
                  const int* __restrict__ tiles, const int* __restrict__ pairs, int N, int K, float* __restrict__ y) {
    TILE_HEAD
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++) {
            const int col = n0 + wn * 32 + ni * 8 + (lane & 3) * 2;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = wm * 64 + mi * 16 + (lane >> 2) + h * 8;
                if (row >= rows) continue;
                float* c = y + (size_t)prs[row] * N + col;
                float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
                if (bias != nullptr) {
                    if (col < N) v0 += bias[(size_t)e * N + col];
                    if (col + 1 < N) v1 += bias[(size_t)e * N + col + 1];
                }
                if (col + 1 < N) *reinterpret_cast<float2*>(c) = make_float2(v0, v1);
                else if (col < N) *c = v0;
            }
        }
}
