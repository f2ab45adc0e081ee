// gemv_q.cu: GEMV / skinny GEMM over GGUF block-quantized weights read as stored, and the
// dequant of such a matrix to bf16 (prefill's GEMM input) or fp32 (tests).
//
// out[m, n] (+)= sum_k x[m, k] * W[n, k] (+ bias[n]), then any epilogue of gemv.cu, for M = 1..8.
//   x bf16 [M, K]; W: N rows of K / QK blocks of one GGML type (QTYPE), each row row_bytes =
//   K / QK * BB bytes, rows back to back, blocks exactly as the GGUF file holds them (no repack).
// Formats (QK values, BB bytes a block; w = the value gguf's dequantize gives):
//   Q4_0 (32, 18): d f16, qs[16]           w = d * (q - 8), q = nibble
//   Q4_1 (32, 20): d, m f16, qs[16]        w = d * q + m
//   Q5_0 (32, 22): d, qh u32, qs[16]       w = d * (q - 16), q = nibble | qh bit << 4
//   Q5_1 (32, 24): d, m, qh, qs            w = d * q + m
//   Q8_0 (32, 34): d, qs int8[32]          w = d * q
//   Q4_K (256, 144): d, dmin f16, scales[12] (8 x 6-bit sc, m), qs[128]   w = (d sc_j) q - (dmin m_j)
//   Q5_K (256, 176): as Q4_K plus qh[32] (bit j of byte i: sub-block j, element i)
//   Q6_K (256, 210): ql[128], qh[64], sc int8[16], d f16            w = (d sc_j) (q - 32), 16 a scale
// Element order inside a 32-value group (a block, or a sub-block pair's half for K-quants): the
// nibble formats store element i and i + 16 in byte i (low, high nibble); K-quants store 64
// values as 32 bytes, sub-block 2c in the low nibbles and 2c + 1 in the high ones.
//
// Thread mapping: as gemv_tc (a block of 256 threads, 16 output rows, 8 warps splitting K), with
// the weights staged: the block's 16 rows are one contiguous range, copied stage by stage (2,048
// values a row at QU = 4) into shared memory by the bulk copy engine, QNST stages in flight (the
// stage pipeline below). Warp w takes units QU w .. QU w + QU - 1 of each stage. A unit is two
// 32-value groups of the 16 rows (two blocks; a K-quant sub-block pair whose values share qs
// bytes; Q6_K groups a and a + 2 of a half, which share ql / qh bytes): per group, thread
// (g = lane / 4, t = lane % 4) takes 8 values of rows g and g + 8 (4t..4t+3 for the first mma and
// 16+4t..16+4t+3 for the second; Q4_K / Q5_K: 8t..8t+7) and the same values of activation row g.
// Their quant bytes are one or two 32-bit words of the block; a PRMT with the byte 0x43 makes
// bf16 128 + q exactly, the mma sums (128 + q) x over the group in fp32, and with the group's
// fp32 scale s and min term mn (w = s (q - OFF) + mn) the group adds s * that +
// (mn - s (128 + OFF)) * sum(x), sum(x) from an mma with all-ones A (Q6_K: a scale per mma, its
// 16-value sub-blocks; Q8_0: int8 -> fp32 -> bf16, exact, no offset). So no dequantized weight
// is rounded to bf16 for the product. The accumulators then go through gemv.cu's epilogues (the
// same code as bf16), so every row's arithmetic is independent of M: width-invariant lanes.
//
// dequant_q_bf16 / dequant_q_f32: out[n, k] = w, computed in fp32 exactly as gguf's numpy
// dequantize (no fused multiply-add: __fmul_rn / __fadd_rn), then rounded to bf16 (or not).
// One thread a (row, unit, t): the same fetch and byte decode as the GEMV.
//
// Preconditions (wrapper): K % QK == 0 (FP8: K % 16 == 0), M in 1..8, W 16-byte aligned (every
// row's loads then stay aligned: 16-byte headers of Q4_K / Q5_K, 4-byte words of Q4_1 / Q5_1,
// 2-byte pieces of the others; the stages keep each address's offset mod 16), x 16-byte aligned;
// the launch's dynamic shared memory is QSMEM (engine/cu/quant.py's stage_smem). A stage's copy
// of the last row may read up to 15 bytes past the matrix's end (inside its allocation's
// granule; never written, never decoded). Compile-time: QTYPE (the GGML type id), TC_THREADS,
// QU, QMINB, QNST, QSMEM, QKH, QUF, QACT8. Compiled after common.cuh and gemv.cu (GEMV_EPILOGUES_ONLY).
//
// QACT8 = 1 (cuda.quant_activations; the block formats, not FP8): int8 activations. x is then not
// bf16 but quant_act.cu's buffer (int8 qx [M, K], then float2 sc[K / 32][8] = (dx, dx * xsum) per
// group of 32 and row), and a group's product is an integer mma: the group's quants, made signed
// (q - OFF, one IADD + LOP3 a word: (v + (0x80 - OFF) 0x01010101) ^ 0x80808080 puts q - OFF in
// -128..127 as a byte; Q8_0 as stored), are the A fragment of mma.m16n8k32.s8 as they come from the
// decode (a0 / a2: the thread's first / second 4 values of row g, a1 / a3 row g + 8; the same k slots
// of B take the same values' qx: XC formats one 8-byte load at 8t, the others two 4-byte loads at 4t
// and 16 + 4t), and the int32 dot gives sum w x = dx (s dot) + mn (dx xsum). Q6_K (a scale per 16
// values): two mma.m16n8k16.s8, one a half, dx (s0 dot0 + s1 dot1). The dots leave the mma as fp32
// bits by a biased accumulator (DOT0, one FADD each, no I2F). So a group costs a thread one or two
// mma and 12 to 20 FP32 ops for its 16 weights, against the bf16 path's 4 mma (two of them
// all-ones), 8 PRMT and 14 to 26 FP32 ops. The stage pipeline, the thread mapping and the
// epilogues are the same; a row's arithmetic still does not depend on M. QACT8 0: the code is the
// bf16 path's, unchanged.

#ifndef QTYPE
#error "QTYPE is defined by engine/cu/quant.py"
#endif
#ifndef QU
#define QU 4
#endif
#ifndef QMINB
#define QMINB 2
#endif
#ifndef QNST
#define QNST 3
#endif
#ifndef QSMEM
#define QSMEM 0
#endif
#ifndef QKH
#define QKH 1
#endif
#ifndef QUF
#define QUF 2
#endif
#ifndef QACT8
#define QACT8 0
#endif
// QPROBE (bench/quant_probe.py only; 0 in every build the backend makes): 1 = the stage pipeline
// alone (copies and barriers, no decode: the accumulators stay 0), 2 = the decode alone (no copies:
// it reads whatever the slots hold). They time the two halves of the main loop apart.
#ifndef QPROBE
#define QPROBE 0
#endif

// FP8 (QTYPE 200, not a GGML id): rows of K float8_e4m3fn bytes (the torch [out, in] layout,
// engine/loaders/fp8.py's Fp8Tensor with per-output-channel scales), all N rows back to back, then
// the N fp32 scales at W + N * K (the part's own: a fused matrix's parts each carry theirs).
// w[n, k] = decode(W[n, k]) * scale[n]. Its main loop is gemv_fp8.cu's: a thread loads 16 bytes of
// rows g and g + 8 (chunk t of a warp's 64-byte step) and the same 16 activations, e4m3 -> f16 ->
// bf16 is exact, four bf16 mma a step with the k order permuted alike for W and x; the row scale
// multiplies the accumulators once, before gemv.cu's epilogues. Dequant: one thread 16 values,
// bf16(__fmul_rn(decode, scale)) (numpy's float32 product, then rounded). K % 16 == 0.
//
// FP8B (QTYPE 201): the same bytes with a scale per row and 128 columns (a block-wise FP8
// checkpoint's 128 x 128 tiles, each tile's scale repeated over its rows by the loader, so the
// row permutations move a row's scales with it): the N rows' bytes, then fp32 scales [N][KB],
// KB = ceil(K / 128); w[n, k] = decode(W[n, k]) * scale[n][k / 128]. A warp's 64-value step lies
// inside one 128-column block, so the step's four mma go to a zeroed partial that one FFMA per
// accumulator adds at its rows' scales; nothing else differs from FP8.
#define QFP8 200
#define QFP8B 201
#define IS_FP8 (QTYPE == QFP8 || QTYPE == QFP8B)
#if QACT8 && IS_FP8
#error "QACT8: the GGUF block formats only"
#endif

#if !IS_FP8
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q4_K = 12,
       GGML_Q5_K = 13, GGML_Q6_K = 14 };

// Plain loads: the GEMV reads its stage in shared memory, the dequant global memory, through the same code.
__device__ __forceinline__ uint32_t ld16(const uint8_t* p) { return *reinterpret_cast<const unsigned short*>(p); }
__device__ __forceinline__ uint32_t ld32(const uint8_t* p) { return *reinterpret_cast<const unsigned int*>(p); }
__device__ __forceinline__ uint2 ld64(const uint8_t* p) { return *reinterpret_cast<const uint2*>(p); }
__device__ __forceinline__ uint4 ld128(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
// A 32-bit word at a 2-byte aligned address (blocks of 18, 22, 34, 210 bytes).
__device__ __forceinline__ uint32_t ld32_2(const uint8_t* p) { return ld16(p) | (ld16(p + 2) << 16); }
__device__ __forceinline__ float f16_lo(uint32_t v) { return __half2float(__ushort_as_half((unsigned short)(v & 0xffff))); }
__device__ __forceinline__ float f16_hi(uint32_t v) { return __half2float(__ushort_as_half((unsigned short)(v >> 16))); }

// One row's bytes of one group, for one thread: v0 / v1 hold the 4 + 4 quant values (one a byte,
// unsigned, below 128; Q8_0: int8), s0 / s1 the fp32 scales of the two halves, mn the min term:
// w = s * (q - OFF) + mn.
struct QVals {
    uint32_t v0, v1;
    float s0, s1, mn;
};

// Byte i of v as an exact fp32: 2^23 + byte from the bits (a PRMT), less 2^23 (an FADD).
__device__ __forceinline__ float byte_f32(uint32_t v, int i) {
    return __int_as_float(__byte_perm(v, 0x4b000000u, 0x7650 | i)) - 8388608.f;
}

// K-quant sub-block j's scale d * sc_j and min term -(dmin * m_j) (gguf's Q4_K.get_scale_min, its
// float32 products), from the 16-byte header (d, dmin, then the 12 scale bytes in words y, z, w):
// the four 6-bit values of a word half come out together with masks, the GEMV's j is a constant.
__device__ __forceinline__ void k_scale_min(const uint4& hd, int j, float& s, float& mn) {
    const uint32_t sc4 = j < 4 ? hd.y & 0x3f3f3f3fu : (hd.w & 0x0f0f0f0fu) | ((hd.y >> 2) & 0x30303030u);
    const uint32_t m4 = j < 4 ? hd.z & 0x3f3f3f3fu : ((hd.w >> 4) & 0x0f0f0f0fu) | ((hd.z >> 2) & 0x30303030u);
    s = __fmul_rn(f16_lo(hd.x), byte_f32(sc4, j & 3));
    mn = -__fmul_rn(f16_hi(hd.x), byte_f32(m4, j & 3));
}

// Bits 0..3 of a Q5 block's (shifted) qh, one a byte, at bit 4 of each.
__device__ __forceinline__ uint32_t spread4(uint32_t bits) { return ((bits & 0xfu) * 0x00204081u & 0x01010101u) << 4; }

// A format is read in units of two 32-value groups (h = 0, 1) that share loaded words where the
// layout allows: fetch(row, P, c, t) loads unit P's bytes for thread t (row: the bytes of the row
// from unit 0 on; c = P % 4, which the GEMV knows at compile time), decode(raw, c, h) gives group
// h's values, base(P, c, h) the group's first value in the row. Units per row: units(K). XC: the
// thread's 8 values of a group are 8t..8t+7 (one 16-byte activation load); else 4t..4t+3 and
// 16+4t..16+4t+3 (the nibble layouts, Q8_0 and Q6_K).
template <int T>
struct QFmt;

// The 32-value block formats: unit P = blocks 2P and 2P + 1 (the second may be past the row's end).
template <int T, int BB_>
struct QBlock32 {
    static constexpr int QK = 32, BB = BB_;
    static constexpr bool XC = false;
    static __device__ __forceinline__ int units(int K) { return (K / 32 + 1) >> 1; }
    static __device__ __forceinline__ int base(int P, int c, int h) { return 64 * P + 32 * h; }
    static __device__ __forceinline__ const uint8_t* block(const uint8_t* row, int P, int h) {
        return row + (size_t)(2 * P + h) * BB;
    }
};

template <>
struct QFmt<GGML_Q4_0> : QBlock32<GGML_Q4_0, 18> {
    static constexpr int OFF = 8;
    static constexpr bool MIN = false, SPLIT = false, INT8 = false;
    struct Raw { uint32_t d[2], qs[2]; };
    static __device__ __forceinline__ Raw fetch(const uint8_t* row, int P, int c, int t, bool ok0, bool ok1) {
        Raw r{{0u, 0u}, {0u, 0u}};
        if (ok0) r.d[0] = ld16(block(row, P, 0)), r.qs[0] = ld32_2(block(row, P, 0) + 2 + 4 * t);
        if (ok1) r.d[1] = ld16(block(row, P, 1)), r.qs[1] = ld32_2(block(row, P, 1) + 2 + 4 * t);
        return r;
    }
    static __device__ __forceinline__ QVals decode(const Raw& r, int c, int h) {
        const float d = f16_lo(r.d[h]);
        return QVals{r.qs[h] & 0x0f0f0f0fu, (r.qs[h] >> 4) & 0x0f0f0f0fu, d, d, 0.f};
    }
};

template <>
struct QFmt<GGML_Q4_1> : QBlock32<GGML_Q4_1, 20> {
    static constexpr int OFF = 0;
    static constexpr bool MIN = true, SPLIT = false, INT8 = false;
    struct Raw { uint32_t dm[2], qs[2]; };
    static __device__ __forceinline__ Raw fetch(const uint8_t* row, int P, int c, int t, bool ok0, bool ok1) {
        Raw r{{0u, 0u}, {0u, 0u}};
        if (ok0) r.dm[0] = ld32(block(row, P, 0)), r.qs[0] = ld32(block(row, P, 0) + 4 + 4 * t);
        if (ok1) r.dm[1] = ld32(block(row, P, 1)), r.qs[1] = ld32(block(row, P, 1) + 4 + 4 * t);
        return r;
    }
    static __device__ __forceinline__ QVals decode(const Raw& r, int c, int h) {
        const float d = f16_lo(r.dm[h]);
        return QVals{r.qs[h] & 0x0f0f0f0fu, (r.qs[h] >> 4) & 0x0f0f0f0fu, d, d, f16_hi(r.dm[h])};
    }
};

template <>
struct QFmt<GGML_Q5_0> : QBlock32<GGML_Q5_0, 22> {
    static constexpr int OFF = 16;
    static constexpr bool MIN = false, SPLIT = false, INT8 = false;
    struct Raw { uint32_t d[2], qh[2], qs[2]; };
    static __device__ __forceinline__ Raw fetch(const uint8_t* row, int P, int c, int t, bool ok0, bool ok1) {
        Raw r{{0u, 0u}, {0u, 0u}, {0u, 0u}};
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const uint8_t* p = block(row, P, h);
            if (h ? ok1 : ok0) r.d[h] = ld16(p), r.qh[h] = ld32_2(p + 2) >> (4 * t), r.qs[h] = ld32_2(p + 6 + 4 * t);
        }
        return r;
    }
    static __device__ __forceinline__ QVals decode(const Raw& r, int c, int h) {
        const float d = f16_lo(r.d[h]);
        return QVals{(r.qs[h] & 0x0f0f0f0fu) | spread4(r.qh[h]), ((r.qs[h] >> 4) & 0x0f0f0f0fu) | spread4(r.qh[h] >> 16),
                     d, d, 0.f};
    }
};

template <>
struct QFmt<GGML_Q5_1> : QBlock32<GGML_Q5_1, 24> {
    static constexpr int OFF = 0;
    static constexpr bool MIN = true, SPLIT = false, INT8 = false;
    struct Raw { uint32_t dm[2], qh[2], qs[2]; };
    static __device__ __forceinline__ Raw fetch(const uint8_t* row, int P, int c, int t, bool ok0, bool ok1) {
        Raw r{{0u, 0u}, {0u, 0u}, {0u, 0u}};
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const uint8_t* p = block(row, P, h);
            if (h ? ok1 : ok0) r.dm[h] = ld32(p), r.qh[h] = ld32(p + 4) >> (4 * t), r.qs[h] = ld32(p + 8 + 4 * t);
        }
        return r;
    }
    static __device__ __forceinline__ QVals decode(const Raw& r, int c, int h) {
        const float d = f16_lo(r.dm[h]);
        return QVals{(r.qs[h] & 0x0f0f0f0fu) | spread4(r.qh[h]), ((r.qs[h] >> 4) & 0x0f0f0f0fu) | spread4(r.qh[h] >> 16),
                     d, d, f16_hi(r.dm[h])};
    }
};

template <>
struct QFmt<GGML_Q8_0> : QBlock32<GGML_Q8_0, 34> {
    static constexpr int OFF = 0;
    static constexpr bool MIN = false, SPLIT = false, INT8 = true;
    struct Raw { uint32_t d[2], q0[2], q1[2]; };
    static __device__ __forceinline__ Raw fetch(const uint8_t* row, int P, int c, int t, bool ok0, bool ok1) {
        Raw r{{0u, 0u}, {0u, 0u}, {0u, 0u}};
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const uint8_t* p = block(row, P, h);
            if (h ? ok1 : ok0) r.d[h] = ld16(p), r.q0[h] = ld32_2(p + 2 + 4 * t), r.q1[h] = ld32_2(p + 18 + 4 * t);
        }
        return r;
    }
    static __device__ __forceinline__ QVals decode(const Raw& r, int c, int h) {
        const float d = f16_lo(r.d[h]);
        return QVals{r.q0[h], r.q1[h], d, d, 0.f};
    }
};

// Q4_K / Q5_K: unit P = sub-blocks 2c, 2c + 1 of super-block P / 4 (c = P % 4): values 64c.. of the
// super-block, in the low and high nibbles of the same 32 qs bytes; thread t takes bytes 8t..8t+7
// (one 8-byte load: values 8t..8t+7 of both sub-blocks).
template <>
struct QFmt<GGML_Q4_K> {
    static constexpr int QK = 256, BB = 144, OFF = 0;
    static constexpr bool MIN = true, SPLIT = false, INT8 = false, XC = true;
    static __device__ __forceinline__ int units(int K) { return K / 64; }
    static __device__ __forceinline__ int base(int P, int c, int h) { return 64 * P + 32 * h; }
    struct Raw { uint4 hd; uint2 q; };
    // fetch_q: the quants only (the GEMV's hoisted path reads the header once a super-block).
    static __device__ __forceinline__ Raw fetch_q(const uint8_t* row, int P, int c, int t, bool ok0) {
        const uint8_t* p = row + (size_t)(P >> 2) * BB;
        Raw r{make_uint4(0u, 0u, 0u, 0u), make_uint2(0u, 0u)};
        if (ok0) r.q = ld64(p + 16 + 32 * c + 8 * t);
        return r;
    }
    static __device__ __forceinline__ Raw fetch(const uint8_t* row, int P, int c, int t, bool ok0, bool ok1) {
        Raw r = fetch_q(row, P, c, t, ok0);
        if (ok0) r.hd = ld128(row + (size_t)(P >> 2) * BB);
        return r;
    }
    static __device__ __forceinline__ uint2 values(const Raw& r, int c, int h) {
        const int sh = 4 * h;
        return make_uint2((r.q.x >> sh) & 0x0f0f0f0fu, (r.q.y >> sh) & 0x0f0f0f0fu);
    }
    static __device__ __forceinline__ QVals decode(const Raw& r, int c, int h) {
        float s, mn;
        k_scale_min(r.hd, 2 * c + h, s, mn);
        const uint2 v = values(r, c, h);
        return QVals{v.x, v.y, s, s, mn};
    }
};

template <>
struct QFmt<GGML_Q5_K> {
    static constexpr int QK = 256, BB = 176, OFF = 0;
    static constexpr bool MIN = true, SPLIT = false, INT8 = false, XC = true;
    static __device__ __forceinline__ int units(int K) { return K / 64; }
    static __device__ __forceinline__ int base(int P, int c, int h) { return 64 * P + 32 * h; }
    struct Raw { uint4 hd; uint2 qh, q; };
    static __device__ __forceinline__ Raw fetch_q(const uint8_t* row, int P, int c, int t, bool ok0) {
        const uint8_t* p = row + (size_t)(P >> 2) * BB;
        Raw r{make_uint4(0u, 0u, 0u, 0u), make_uint2(0u, 0u), make_uint2(0u, 0u)};
        if (ok0) r.qh = ld64(p + 16 + 8 * t), r.q = ld64(p + 48 + 32 * c + 8 * t);
        return r;
    }
    static __device__ __forceinline__ Raw fetch(const uint8_t* row, int P, int c, int t, bool ok0, bool ok1) {
        Raw r = fetch_q(row, P, c, t, ok0);
        if (ok0) r.hd = ld128(row + (size_t)(P >> 2) * BB);
        return r;
    }
    static __device__ __forceinline__ uint2 values(const Raw& r, int c, int h) {
        const int j = 2 * c + h, sh = 4 * h;
        return make_uint2(((r.q.x >> sh) & 0x0f0f0f0fu) | (((r.qh.x >> j) & 0x01010101u) << 4),
                          ((r.q.y >> sh) & 0x0f0f0f0fu) | (((r.qh.y >> j) & 0x01010101u) << 4));
    }
    static __device__ __forceinline__ QVals decode(const Raw& r, int c, int h) {
        float s, mn;
        k_scale_min(r.hd, 2 * c + h, s, mn);
        const uint2 v = values(r, c, h);
        return QVals{v.x, v.y, s, s, mn};
    }
};

// Q6_K: values 128n + 32a + l (l < 32) of a super-block have their low 4 bits in
// ql[64n + 32(a & 1) + l] (nibble a >> 1), their high 2 in qh[32n + l] (bits 2a, 2a + 1), scale
// sc[8n + 2a + l / 16]. Unit P (c = P % 4: n = c / 2, a = c % 2) = groups a and a + 2 of half n,
// which share their ql and qh bytes.
template <>
struct QFmt<GGML_Q6_K> {
    static constexpr int QK = 256, BB = 210, OFF = 32;
    static constexpr bool MIN = false, SPLIT = true, INT8 = false, XC = false;
    static __device__ __forceinline__ int units(int K) { return K / 64; }
    static __device__ __forceinline__ int base(int P, int c, int h) {
        return 256 * (P >> 2) + 128 * (c >> 1) + 32 * ((c & 1) + 2 * h);
    }
    struct Raw { uint32_t la, lb, ha, hb, s01, s45, d; };
    static __device__ __forceinline__ Raw fetch(const uint8_t* row, int P, int c, int t, bool ok0, bool ok1) {
        const uint8_t* p = row + (size_t)(P >> 2) * BB;
        const int n = c >> 1, a = c & 1;
        const uint8_t* ql = p + 64 * n + 32 * a + 4 * t;
        const uint8_t* qh = p + 128 + 32 * n + 4 * t;
        const uint8_t* sc = p + 192 + 8 * n + 2 * a;
        Raw r{0u, 0u, 0u, 0u, 0u, 0u, 0u};
        if (ok0) r = Raw{ld32_2(ql), ld32_2(ql + 16), ld32_2(qh), ld32_2(qh + 16), ld16(sc), ld16(sc + 4), ld16(p + 208)};
        return r;
    }
    static __device__ __forceinline__ QVals decode(const Raw& r, int c, int h) {
        const int sl = 4 * h, sh = 2 * ((c & 1) + 2 * h);
        const uint32_t sc = h ? r.s45 : r.s01;
        const float d = f16_lo(r.d);
        const float s0 = __fmul_rn(d, (float)(int8_t)(sc & 0xff)), s1 = __fmul_rn(d, (float)(int8_t)(sc >> 8));
        return QVals{((r.la >> sl) & 0x0f0f0f0fu) | (((r.ha >> sh) & 0x03030303u) << 4),
                     ((r.lb >> sl) & 0x0f0f0f0fu) | (((r.hb >> sh) & 0x03030303u) << 4), s0, s1, 0.f};
    }
};

using Fmt = QFmt<QTYPE>;

// Values h..h+1 (h = 0 or 2) of a QVals word as a bf16 pair: 128 + q exactly (Q8_0: q exactly).
__device__ __forceinline__ uint32_t q_pair(uint32_t v, int h) {
    if constexpr (Fmt::INT8) {
        // int8 -> fp32 exactly: 2^23 + (q + 128) from the bits, less 2^23 + 128; then a bf16 pair (exact).
        const uint32_t u = v ^ 0x80808080u;
        const float a = __int_as_float(__byte_perm(u, 0x4b000000u, 0x7440 + h)) - 8388736.f;
        const float b = __int_as_float(__byte_perm(u, 0x4b000000u, 0x7441 + h)) - 8388736.f;
        return pack_bf162(a, b);
    } else {
        return __byte_perm(v, 0x43434343u, h ? 0x4342 : 0x4140);  // bf16 0x43 q = 128 + q: one PRMT a pair
    }
}

// One group of rows g (qa) and g + 8 (qb) against activation elements x0, x1 (the thread's first and
// second four values of the group). The mma sums (128 + q) x exactly-ish in fp32; w = s (q - OFF) + mn,
// so sum w x = s * sum (128 + q) x + (mn - s (128 + OFF)) * sum x, sum x from the all-ones mma.
// PRE: qa.mn / qb.mn already hold mn - s (128 + OFF) (k_hoist's, the same fp32 value).
template <bool PRE = false>
__device__ __forceinline__ void q_group(float* c, const QVals& qa, const QVals& qb, uint2 x0, uint2 x1) {
    float s[4] = {0.f, 0.f, 0.f, 0.f}, s2[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t a0[4] = {q_pair(qa.v0, 0), q_pair(qb.v0, 0), q_pair(qa.v0, 2), q_pair(qb.v0, 2)};
    const uint32_t a1[4] = {q_pair(qa.v1, 0), q_pair(qb.v1, 0), q_pair(qa.v1, 2), q_pair(qb.v1, 2)};
    mma_bf16(s, a0, x0.x, x0.y);
    mma_bf16(Fmt::SPLIT ? s2 : s, a1, x1.x, x1.y);
    c[0] += qa.s0 * s[0];
    c[1] += qa.s0 * s[1];
    c[2] += qb.s0 * s[2];
    c[3] += qb.s0 * s[3];
    if constexpr (Fmt::SPLIT) {
        c[0] += qa.s1 * s2[0];
        c[1] += qa.s1 * s2[1];
        c[2] += qb.s1 * s2[2];
        c[3] += qb.s1 * s2[3];
    }
    if constexpr (!Fmt::INT8) {
        constexpr float off = 128.f + Fmt::OFF;
        const uint32_t ones[4] = {0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u};
        float sx[4] = {0.f, 0.f, 0.f, 0.f}, sx2[4] = {0.f, 0.f, 0.f, 0.f};
        mma_bf16(sx, ones, x0.x, x0.y);
        mma_bf16(Fmt::SPLIT ? sx2 : sx, ones, x1.x, x1.y);
        const float ma = PRE ? qa.mn : qa.mn - qa.s0 * off, mb = PRE ? qb.mn : qb.mn - qb.s0 * off;
        c[0] += ma * sx[0];
        c[1] += ma * sx[1];
        c[2] += mb * sx[2];
        c[3] += mb * sx[3];
        if constexpr (Fmt::SPLIT) {  // no min: -s1 (128 + OFF) for the second half
            const float ma2 = -qa.s1 * off, mb2 = -qb.s1 * off;
            c[0] += ma2 * sx2[0];
            c[1] += ma2 * sx2[1];
            c[2] += mb2 * sx2[2];
            c[3] += mb2 * sx2[3];
        }
    }
}

#if QACT8
// D += A (16 x 32 int8, rows g / g + 8 as a0..a3) B (32 x 8 int8), int32: the group's dot products.
__device__ __forceinline__ void mma_s8_k32(int* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// The same over 16 k (a0: row g k 4t..4t+3, a1: row g + 8; b: k 4t..4t+3 of column g).
__device__ __forceinline__ void mma_s8_k16(int* d, uint32_t a0, uint32_t a1, uint32_t b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b));
}

// Four quant bytes (unsigned, below 128 + OFF) as the signed bytes q - OFF (Q8_0: as stored).
__device__ __forceinline__ uint32_t q_s8(uint32_t v) {
    if constexpr (Fmt::INT8 || Fmt::OFF == 0) {
        return v;
    } else {
        return (v + (0x80u - Fmt::OFF) * 0x01010101u) ^ 0x80808080u;
    }
}

// The int32 accumulators start at the bits of 1.5 2^23 (DOT0): a dot |v| < 2^22 (a group's is below
// 32 127 127 = 516,129) then leaves the bits of 1.5 2^23 + v, so one FADD gives v exactly as fp32
// (no I2F: the conversion pipe runs at a fraction of the FP32 rate).
constexpr int DOT0 = 0x4b400000;
__device__ __forceinline__ float dot_f32(int d) { return __int_as_float(d) - 12582912.f; }

// One group of rows g (qa) and g + 8 (qb) against the group's qx (b0: the k slots of the thread's
// first 4 values, b1: its second 4) and xd = (dx, dx xsum) of activation rows 2t, 2t + 1 (the columns
// of c[0], c[1] / c[2], c[3]).
__device__ __forceinline__ void q_group8(float* c, const QVals& qa, const QVals& qb, uint32_t b0, uint32_t b1,
                                         const float4& xd) {
    int d[4] = {DOT0, DOT0, DOT0, DOT0};
    if constexpr (Fmt::SPLIT) {  // Q6_K: s0 for the first 16 values, s1 for the second
        int d2[4] = {DOT0, DOT0, DOT0, DOT0};
        mma_s8_k16(d, q_s8(qa.v0), q_s8(qb.v0), b0);
        mma_s8_k16(d2, q_s8(qa.v1), q_s8(qb.v1), b1);
        c[0] += xd.x * (qa.s0 * dot_f32(d[0]) + qa.s1 * dot_f32(d2[0]));
        c[1] += xd.z * (qa.s0 * dot_f32(d[1]) + qa.s1 * dot_f32(d2[1]));
        c[2] += xd.x * (qb.s0 * dot_f32(d[2]) + qb.s1 * dot_f32(d2[2]));
        c[3] += xd.z * (qb.s0 * dot_f32(d[3]) + qb.s1 * dot_f32(d2[3]));
    } else {
        const uint32_t a[4] = {q_s8(qa.v0), q_s8(qb.v0), q_s8(qa.v1), q_s8(qb.v1)};
        mma_s8_k32(d, a, b0, b1);
        c[0] += (qa.s0 * xd.x) * dot_f32(d[0]);
        c[1] += (qa.s0 * xd.z) * dot_f32(d[1]);
        c[2] += (qb.s0 * xd.x) * dot_f32(d[2]);
        c[3] += (qb.s0 * xd.z) * dot_f32(d[3]);
        if constexpr (Fmt::MIN) {
            c[0] += qa.mn * xd.y;
            c[1] += qa.mn * xd.w;
            c[2] += qb.mn * xd.y;
            c[3] += qb.mn * xd.w;
        }
    }
}
#endif  // QACT8

// --- the stage pipeline ---------------------------------------------------------------------
// A stage is KC values of each of the block's 16 rows: STAGE_BLOCKS blocks a row, copied from
// global memory by the bulk copy engine (cp.async.bulk, completing on the stage's mbarrier) into
// RS bytes of shared memory per row. A row's piece goes as the 16-byte aligned range around it
// (the source's address mod 16 kept: data at byte lead = address % 16 of its RS), so any block
// size and row length works and every load the decode makes is as aligned as in global memory.
// RS: the piece plus the two partial 16-byte ends, rounded so that a load instruction's rows fall
// on different banks: the 4-byte reads (4 threads a row, 8 rows) want an odd number of 16-byte
// units; the K-quants' 8-byte reads (XC: a half-warp, 4 rows of 32 bytes each, per shared-memory
// wavefront) want RS = 32 mod 128 (rows 8 banks apart; an odd count of units put rows 0 and 1 of
// a half-warp 12 banks apart, on 4 common banks: a third of the wavefronts in excess, ncu).
// QNST stages are in flight; warp 0 refills a stage once every warp has passed the barrier
// after reading it.
constexpr int KC = 8 * QU * 64;
constexpr int STAGE_BLOCKS = KC / Fmt::QK;
constexpr int PIECE = STAGE_BLOCKS * Fmt::BB;
constexpr int RS0 = (PIECE + 15) / 16 * 16 + 32;
constexpr int RS = Fmt::XC ? (RS0 + 95) / 128 * 128 + 32 : (RS0 / 16) % 2 ? RS0 : RS0 + 16;
constexpr int STAGE_BYTES = TC_ROWS * RS;
static_assert(KC % Fmt::QK == 0, "a stage holds whole blocks");
static_assert(Fmt::QK == 32 || QU % 4 == 0, "K-quants: a warp's units of a stage are whole super-blocks");
static_assert(QNST * STAGE_BYTES <= QSMEM, "engine/cu/quant.py's QSMEM must hold QNST stages");
static_assert(QU % QUF == 0, "QUF units at a time");
static_assert(PIECE % 16 == 0, "a row's lead in its slot is the same in every stage of a tile");

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    } while (!done);
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// Warp 0, every lane: stage j of a tile (its pieces of rows 0..rows-1) into slot J % QNST (J: the
// block's stage count, over every tile it walks). Lane r < rows copies row r; lane 0 arms the barrier
// with the stage's bytes (one warp-wide sum), so the warp spends a few instructions a stage, not a
// loop over the rows in one thread that the block's next barrier waits for.
__device__ __forceinline__ void issue_stage(uint8_t* slots, uint64_t* bars, const uint8_t* tile, size_t row_bytes,
                                            int rows, int NB, int j, int J, int lane) {
    const int blk0 = j * STAGE_BLOCKS, nb = min(STAGE_BLOCKS, NB - blk0);
    uint64_t* bar = bars + J % QNST;
    const bool mine = lane < rows;
    const uintptr_t a = reinterpret_cast<uintptr_t>(tile + (size_t)(mine ? lane : 0) * row_bytes + (size_t)blk0 * Fmt::BB);
    const uintptr_t a0 = a & ~(uintptr_t)15, a1 = (a + (size_t)nb * Fmt::BB + 15) & ~(uintptr_t)15;
    const uint32_t bytes = mine ? (uint32_t)(a1 - a0) : 0u;
    const uint32_t total = __reduce_add_sync(FULL_MASK, bytes);
    if (lane == 0) mbar_expect(bar, total);
    if (mine) bulk_copy(slots + (J % QNST) * STAGE_BYTES + lane * RS, reinterpret_cast<const void*>(a0), bytes, bar);
}

// KH (QKH, Q4_K and Q5_K): a super-block's 8 scales and mins of a row are computed once by the
// warp, not once a unit by all four threads of the row: thread t does sub-blocks 2t, 2t + 1 of its
// rows g and g + 8 from the 16-byte header (the bf16 path's min term less 128 s, as q_group<true>
// takes it) and writes them to the warp's q_ks (rows 80 bytes apart: the 8 rows a load
// instruction reads fall on different banks); every thread then reads its rows' 8 pairs. The
// per-unit fetch then loads only the quants.
constexpr bool KH = QKH && Fmt::QK == 256 && Fmt::MIN;

__device__ __forceinline__ float4 k_hoist(const uint8_t* sb, int t, bool ok) {
    const uint4 hd = ok ? ld128(sb) : make_uint4(0u, 0u, 0u, 0u);  // zeros: s = mn = 0 for rows past N
    float s0, m0, s1, m1;
    k_scale_min(hd, 2 * t, s0, m0);
    k_scale_min(hd, 2 * t + 1, s1, m1);
#if !QACT8  // q_group's min term, mn - 128 s (the bf16 path's offset), once here instead of once a group
    m0 = m0 - s0 * 128.f;
    m1 = m1 - s1 * 128.f;
#endif
    return make_float4(s0, m0, s1, m1);
}
template <class F>
__device__ __forceinline__ typename F::Raw kfetch_q(const uint8_t* row, int P, int c, int t, bool ok) {
    return F::fetch_q(row, P, c, t, ok);
}
template <class F>
__device__ __forceinline__ uint2 kvalues(const typename F::Raw& r, int c, int h) {
    return F::values(r, c, h);
}

// Unit P's first byte in a row (P a multiple of 4 for the K-quants: whole super-blocks).
__device__ __forceinline__ int unit_bytes(int P) { return Fmt::QK == 32 ? 2 * Fmt::BB * P : (P >> 2) * Fmt::BB; }

// One stage of a tile for one warp: its U units of rows g (pa: the row's bytes in the slot from the
// warp's first unit on) and g + 8 (pb) against activation row g (xs: from the warp's first value in
// the stage, at the thread's first value of a group; QACT8: xss, the warp's (dx, dx xsum) at column
// pair t), ks its hoisted K-quant scales. P0: the warp's first unit in the row. FULL: every unit of
// the stage is inside K (no guards). Every offset inside is a compile-time constant.
#if QACT8
using XT = uint8_t;
#else
using XT = bf16;
#endif
template <int U, bool FULL>
__device__ __forceinline__ void q_stage(float* c, const uint8_t* pa, const uint8_t* pb, const XT* __restrict__ xs,
                                        const float* __restrict__ xss, float4* ks, int t, int g, int P0, int NP,
                                        int NG, bool ra, bool rb) {
    if constexpr (KH) {
        __syncwarp();  // every lane has read the previous stage's scales (no block barrier between stages)
#pragma unroll
        for (int sb = 0; sb < U / 4; sb++) {
            if (FULL || P0 + 4 * sb < NP) {  // warp-uniform
                ks[sb * TC_ROWS * 5 + g * 5 + t] = k_hoist(pa + sb * Fmt::BB, t, ra);
                ks[sb * TC_ROWS * 5 + (g + 8) * 5 + t] = k_hoist(pb + sb * Fmt::BB, t, rb);
            }
        }
        __syncwarp();
    }
    // Shared-memory loads need no guard: a slot's rows past N and units past K hold stale bytes,
    // which reach only accumulators of rows past N (never stored) or are not decoded at all. The
    // activation loads are guarded by unit (warp-uniform branches); rows g >= M read row 0 (xr),
    // whose products land in the columns >= M the epilogue does not read. QUF units at a time:
    // their loads first, then their decode (fewer live registers than all QU at once).
#pragma unroll
    for (int u0 = 0; u0 < U; u0 += QUF) {
        typename Fmt::Raw A[QUF], B[QUF];
#if QACT8
        uint2 xv[QUF][2];   // per group: the qx words of the thread's two k slot quads
        float4 xd[QUF][2];  // per group: (dx, dx xsum) of activation rows 2t, 2t + 1
#else
        uint2 xv[QUF][4];
#endif
#pragma unroll
        for (int du = 0; du < QUF; du++) {
            const int u = u0 + du, P = P0 + u, cu = u & 3;
            const bool ok0 = FULL || P < NP, ok1 = FULL || (ok0 && (Fmt::QK != 32 || 2 * P + 1 < NG));
            if constexpr (KH) {
                A[du] = kfetch_q<Fmt>(pa, u, cu, t, true);
                B[du] = kfetch_q<Fmt>(pb, u, cu, t, true);
            } else {
                A[du] = Fmt::fetch(pa, u, cu, t, true, true);
                B[du] = Fmt::fetch(pb, u, cu, t, true, true);
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (h ? ok1 : ok0) {  // warp-uniform
                    const XT* xp = xs + Fmt::base(u, cu, h);
#if QACT8
                    if constexpr (Fmt::XC) {
                        xv[du][h] = __ldg(reinterpret_cast<const uint2*>(xp));
                    } else {
                        xv[du][h] = make_uint2(__ldg(reinterpret_cast<const unsigned int*>(xp)),
                                               __ldg(reinterpret_cast<const unsigned int*>(xp + 16)));
                    }
                    xd[du][h] = __ldg(reinterpret_cast<const float4*>(xss + (Fmt::base(u, cu, h) >> 5) * 16));
#else
                    if constexpr (Fmt::XC) {
                        const uint4 v = __ldg(reinterpret_cast<const uint4*>(xp));
                        xv[du][2 * h] = make_uint2(v.x, v.y);
                        xv[du][2 * h + 1] = make_uint2(v.z, v.w);
                    } else {
                        xv[du][2 * h] = __ldg(reinterpret_cast<const uint2*>(xp));
                        xv[du][2 * h + 1] = __ldg(reinterpret_cast<const uint2*>(xp + 16));
                    }
#endif
                }
            }
        }
#pragma unroll
        for (int du = 0; du < QUF; du++) {
            const int u = u0 + du, P = P0 + u, cu = u & 3;
            const bool ok0 = FULL || P < NP, ok1 = FULL || (ok0 && (Fmt::QK != 32 || 2 * P + 1 < NG));
            float4 ka, kb;  // KH: rows g, g + 8: (s, mn) of sub-blocks 2 cu, 2 cu + 1
            if constexpr (KH) {
                ka = ks[(u / 4) * TC_ROWS * 5 + g * 5 + cu], kb = ks[(u / 4) * TC_ROWS * 5 + (g + 8) * 5 + cu];
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (h ? ok1 : ok0) {  // warp-uniform
                    if constexpr (KH) {
                        const uint2 va = kvalues<Fmt>(A[du], cu, h), vb = kvalues<Fmt>(B[du], cu, h);
                        const QVals qa{va.x, va.y, h ? ka.z : ka.x, h ? ka.z : ka.x, h ? ka.w : ka.y};
                        const QVals qb{vb.x, vb.y, h ? kb.z : kb.x, h ? kb.z : kb.x, h ? kb.w : kb.y};
#if QACT8
                        q_group8(c, qa, qb, xv[du][h].x, xv[du][h].y, xd[du][h]);
#else
                        q_group<true>(c, qa, qb, xv[du][2 * h], xv[du][2 * h + 1]);
#endif
                    } else {
#if QACT8
                        q_group8(c, Fmt::decode(A[du], cu, h), Fmt::decode(B[du], cu, h), xv[du][h].x, xv[du][h].y,
                                 xd[du][h]);
#else
                        q_group(c, Fmt::decode(A[du], cu, h), Fmt::decode(B[du], cu, h), xv[du][2 * h],
                                xv[du][2 * h + 1]);
#endif
                    }
                }
            }
        }
    }
}

// A block walks tiles blockIdx.x, + gridDim.x, .. (one when the grid is a block a tile; fewer
// blocks than tiles keep the stage pipeline going from one tile into the next: Kernels'
// quant_persist) and hands each tile's accumulators to done(c, tile, tiles), its epilogue.
template <int U, class Done>
__device__ __forceinline__ void gemv_q_main(const bf16* __restrict__ x, const uint8_t* __restrict__ W, int M, int N,
                                            int K, Done done) {
    extern __shared__ __align__(16) uint8_t q_slots[];
    __shared__ __align__(8) uint64_t q_bars[QNST];
    __shared__ __align__(16) float4 q_ks[KH ? 8 * (U / 4) * TC_ROWS * 5 : 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int NP = Fmt::units(K), NG = K >> 5, NB = K / Fmt::QK, nst = (NB + STAGE_BLOCKS - 1) / STAGE_BLOCKS;
    const size_t row_bytes = (size_t)NB * Fmt::BB;
    const int ntiles = (N + TC_ROWS - 1) / TC_ROWS;
    const int mine = (int)blockIdx.x < ntiles ? (ntiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int total = mine * nst;  // stages this block copies, tile after tile
    const bool rx = g < M;
#if QACT8
    // x is quant_act.cu's buffer: int8 rows, then the groups' (dx, dx xsum) of 8 rows each.
    const uint8_t* xr = reinterpret_cast<const uint8_t*>(x) + (size_t)(rx ? g : 0) * K;
    const float* xsc = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(x) + (size_t)M * K) + 4 * t;
#else
    const bf16* xr = x + (size_t)(rx ? g : 0) * K;
#endif
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < QNST; s++) mbar_init(q_bars + s);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int J) {  // the block's stage J: stage J % nst of its tile J / nst
        const int n0 = ((int)blockIdx.x + J / nst * (int)gridDim.x) * TC_ROWS;
        issue_stage(q_slots, q_bars, W + (size_t)n0 * row_bytes, row_bytes, min(TC_ROWS, N - n0), NB, J % nst, J,
                    lane);
    };
    if (warp == 0)
        for (int J = 0; J < min(QNST, total); J++)
            if (QPROBE != 2) issue(J);
    for (int ti = 0; ti < mine; ti++) {
        const int tl = (int)blockIdx.x + ti * (int)gridDim.x, n0 = tl * TC_ROWS, rows = min(TC_ROWS, N - n0);
        const bool ra = g < rows, rb = g + 8 < rows;
        const uint8_t* tile = W + (size_t)n0 * row_bytes;
        // Rows g and g + 8 in a slot: at lead = their address % 16, the same in every stage of the tile
        // (a stage's bytes of a row are a multiple of 16), so once a tile.
        const uint8_t* pa0 = q_slots + g * RS + (int)(reinterpret_cast<uintptr_t>(tile + g * row_bytes) & 15);
        const uint8_t* pb0 = q_slots + (g + 8) * RS + (int)(reinterpret_cast<uintptr_t>(tile + (g + 8) * row_bytes) & 15);
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        for (int j = 0; j < nst; j++) {
            const int J = ti * nst + j;
            if (QPROBE != 2) mbar_wait(q_bars + J % QNST, (J / QNST) & 1);
            if constexpr (QPROBE != 1) {
                const int so = (J % QNST) * STAGE_BYTES + unit_bytes(U * warp), P0 = j * (KC / 64) + U * warp;
#if QACT8
                const uint8_t* xs = xr + (size_t)j * KC + 64 * U * warp + (Fmt::XC ? 8 * t : 4 * t);
                const float* xss = xsc + (size_t)(j * KC + 64 * U * warp) / 32 * 16;
#else
                const bf16* xs = xr + (size_t)j * KC + 64 * U * warp + (Fmt::XC ? 8 * t : 4 * t);
                const float* xss = nullptr;
#endif
                float4* ks = q_ks + warp * (U / 4) * TC_ROWS * 5;
                // A stage of whole blocks (every stage but a partial last one) has no unit past K: its
                // body has no guards (the same arithmetic, so the same bits).
                const bool full = (j + 1) * STAGE_BLOCKS <= NB;
                if (full)
                    q_stage<U, true>(c, pa0 + so, pb0 + so, xs, xss, ks, t, g, P0, NP, NG, ra, rb);
                else
                    q_stage<U, false>(c, pa0 + so, pb0 + so, xs, xss, ks, t, g, P0, NP, NG, ra, rb);
            }
            if (J + QNST < total) {  // block-uniform: a refill of this slot follows
                __syncthreads();     // every warp is done with the slot
                if (QPROBE != 2 && warp == 0) issue(J + QNST);
            }  // else nothing reads or writes the slot again: no barrier (the epilogue has its own)
        }
        if (ti) __syncthreads();  // the previous tile's epilogue has read its shared sums
        done(c, tl, ntiles);
    }
}
#else  // IS_FP8
#include <cuda_fp8.h>

// Two e4m3 bytes (the low byte first) -> a bf16 pair packed as mma operands are (low element low).
__device__ __forceinline__ uint32_t fp8x2_to_bf162(uint32_t two) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
    float2 f = __half22float2(*reinterpret_cast<__half2*>(&h));
    return pack_bf162(f.x, f.y);
}

__device__ __forceinline__ const float* fp8_scales(const uint8_t* W, int N, int K) {
    return reinterpret_cast<const float*>(W + (size_t)N * K);
}

template <int U, class Done>
__device__ __forceinline__ void gemv_q_main(const bf16* __restrict__ x, const uint8_t* __restrict__ W, int M, int N,
                                            int K, Done done) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int ntiles = (N + TC_ROWS - 1) / TC_ROWS;
    for (int tl = blockIdx.x; tl < ntiles; tl += gridDim.x) {
        const int n0 = tl * TC_ROWS;
        const bool ra = n0 + g < N, rb = n0 + g + 8 < N, rx = g < M;
        const uint8_t* wa_p = W + (size_t)(ra ? n0 + g : 0) * K + 16 * t;
        const uint8_t* wb_p = W + (size_t)(rb ? n0 + g + 8 : 0) * K + 16 * t;
        const bf16* x_p = x + (size_t)(rx ? g : 0) * K + 16 * t;
#if QTYPE == QFP8B
        const int KB = (K + 127) >> 7;
        const float* sa_p = fp8_scales(W, N, K) + (size_t)(ra ? n0 + g : 0) * KB;
        const float* sb_p = fp8_scales(W, N, K) + (size_t)(rb ? n0 + g + 8 : 0) * KB;
#endif
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int s0 = warp; s0 * 64 < K; s0 += 8 * U) {
            uint4 wa[U], wb[U], xa[U], xb[U];
#if QTYPE == QFP8B
            float sa[U], sb[U];
#endif
#pragma unroll
            for (int l = 0; l < U; ++l) {
                const int k = (s0 + 8 * l) * 64;
                const bool in = k + 16 * t < K;
                wa[l] = ld_stream_if(wa_p + k, in && ra);
                wb[l] = ld_stream_if(wb_p + k, in && rb);
                xa[l] = ldg_if(x_p + k, in && rx);
                xb[l] = ldg_if(x_p + k + 8, in && rx);
#if QTYPE == QFP8B
                // the step's scale whether or not this thread's own chunk is in: its accumulators (x rows
                // 2t, 2t + 1) hold the whole step's sums
                sa[l] = k < K && ra ? __ldg(sa_p + (k >> 7)) : 0.f;
                sb[l] = k < K && rb ? __ldg(sb_p + (k >> 7)) : 0.f;
#endif
            }
#pragma unroll
            for (int l = 0; l < U; ++l) {
                const uint32_t wa4[4] = {wa[l].x, wa[l].y, wa[l].z, wa[l].w};
                const uint32_t wb4[4] = {wb[l].x, wb[l].y, wb[l].z, wb[l].w};
                const uint32_t xs[8] = {xa[l].x, xa[l].y, xa[l].z, xa[l].w, xb[l].x, xb[l].y, xb[l].z, xb[l].w};
#if QTYPE == QFP8B
                float part[4] = {0.f, 0.f, 0.f, 0.f};
#else
                float* part = acc;
#endif
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    // mma j: k-slots 2t, 2t+1 <- bytes 4j, 4j+1; slots 2t+8, 2t+9 <- bytes 4j+2, 4j+3.
                    const uint32_t a[4] = {fp8x2_to_bf162(wa4[j]), fp8x2_to_bf162(wb4[j]), fp8x2_to_bf162(wa4[j] >> 16),
                                           fp8x2_to_bf162(wb4[j] >> 16)};
                    mma_bf16(part, a, xs[2 * j], xs[2 * j + 1]);
                }
#if QTYPE == QFP8B
                acc[0] = fmaf(part[0], sa[l], acc[0]);
                acc[1] = fmaf(part[1], sa[l], acc[1]);
                acc[2] = fmaf(part[2], sb[l], acc[2]);
                acc[3] = fmaf(part[3], sb[l], acc[3]);
#endif
            }
        }
#if QTYPE == QFP8B
        done(acc, tl, ntiles);
#else
        const float* sc = fp8_scales(W, N, K);
        const float sa = ra ? __ldg(sc + n0 + g) : 0.f, sb = rb ? __ldg(sc + n0 + g + 8) : 0.f;
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        c[0] += acc[0] * sa;
        c[1] += acc[1] * sa;
        c[2] += acc[2] * sb;
        c[3] += acc[3] * sb;
        done(c, tl, ntiles);
#endif
    }
}

#endif  // QTYPE

// store / acc: out fp32 [M, ldo]; with nw, also the next norm's xw / ss_out (gemv.cu).
#define GEMV_Q_LINEAR(NAME, EPI)                                                                             \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, QMINB)                                          \
        NAME(const bf16* x, const uint8_t* W, const float* bias, float* out, int M, int N, int K, int ldo,    \
             const float* ss_in, int ss_nparts, float eps, const bf16* nw, bf16* xw, float* ss_out) {         \
        const TcNorm nm{ss_in, ss_nparts, eps, nw, xw, ss_out};                                              \
        const TcRope rp{};                                                                                   \
        gemv_q_main<QU>(x, W, M, N, K, [&](const float* c, int tile, int tiles) {                            \
            gemv_tc_epilogue<EPI>(c, bias, out, M, N, K, ldo, nm, rp, 0, tile, tiles);                       \
        });                                                                                                  \
    }
// swiglu / geglu: out bf16 act [M, ldo]; W the gate|up matrix interleaved in 8-row groups.
#define GEMV_Q_SWIGLU(NAME, EPI)                                                                             \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, QMINB)                                          \
        NAME(const bf16* x, const uint8_t* W, bf16* out, int M, int N, int K, int ldo, const float* ss_in,    \
             int ss_nparts, float eps) {                                                                     \
        const TcNorm nm{ss_in, ss_nparts, eps, nullptr, nullptr, nullptr};                                   \
        const TcRope rp{};                                                                                   \
        gemv_q_main<QU>(x, W, M, N, K, [&](const float* c, int tile, int tiles) {                            \
            gemv_tc_epilogue<EPI>(c, nullptr, out, M, N, K, ldo, nm, rp, 0, tile, tiles);                    \
        });                                                                                                  \
    }
GEMV_Q_LINEAR(gemv_q_store, EPI_STORE)
GEMV_Q_LINEAR(gemv_q_acc, EPI_ACC)
GEMV_Q_SWIGLU(gemv_q_swiglu, EPI_SWIGLU)
GEMV_Q_SWIGLU(gemv_q_geglu, EPI_GEGLU)

// rope: out bf16 q [M, H, D], K and V into the cache. W is rows n_base.. of the fused q|k|v
// matrix (a part of one format; bias points at its row n_base too).
extern "C" __global__ void __launch_bounds__(TC_THREADS, QMINB)
    gemv_q_rope(const bf16* x, const uint8_t* W, const float* bias, bf16* out, int M, int N, int K, int ldo,
                const float* ss_in, int ss_nparts, float eps, const int* positions, const int* slots,
                const float* inv_freq, bf16* cache, int H, int KVH, int D, int block_size, long long block_stride,
                int rotary_dim, float rope_factor, int n_base) {
    const TcNorm nm{ss_in, ss_nparts, eps, nullptr, nullptr, nullptr};
    const TcRope rp{positions, slots, inv_freq, cache, H, KVH, D, block_size, block_stride, rotary_dim, rope_factor};
    gemv_q_main<QU>(x, W, M, N, K, [&](const float* c, int tile, int tiles) {
        gemv_tc_epilogue<EPI_ROPE_KV>(c, bias, out, M, N, K, ldo, nm, rp, n_base, tile, tiles);
    });
}

// --- dequant -------------------------------------------------------------------------------

__device__ __forceinline__ void store4(bf16* p, const float* v) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf162(v[0], v[1]), pack_bf162(v[2], v[3]));
}
__device__ __forceinline__ void store4(float* p, const float* v) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

#if !IS_FP8

__device__ __forceinline__ float q_value(uint32_t v, int i) {
    const uint32_t b = (v >> (8 * i)) & 0xffu;
    if constexpr (Fmt::INT8) return (float)(int8_t)b;
    return (float)((int)b - Fmt::OFF);
}

__device__ __forceinline__ float w_value(float s, float q, float mn) {
    if constexpr (Fmt::MIN) return __fadd_rn(__fmul_rn(s, q), mn);
    return __fmul_rn(s, q);
}

template <typename T>
__device__ __forceinline__ void dequant_body(const uint8_t* __restrict__ W, T* __restrict__ out, int N, int K) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int NP = Fmt::units(K), NG = K >> 5, t = (int)(idx & 3);
    const long long rp = idx >> 2;
    if (rp >= (long long)N * NP) return;
    const int n = (int)(rp / NP), P = (int)(rp % NP);
    const size_t row_bytes = (size_t)(K / Fmt::QK) * Fmt::BB;
    const bool ok1 = Fmt::QK != 32 || 2 * P + 1 < NG;
    const typename Fmt::Raw r = Fmt::fetch(W + n * row_bytes, P, P & 3, t, true, ok1);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (h && !ok1) break;
        const QVals q = Fmt::decode(r, P & 3, h);
        float lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo[i] = w_value(q.s0, q_value(q.v0, i), q.mn);
            hi[i] = w_value(q.s1, q_value(q.v1, i), q.mn);
        }
        T* o = out + (size_t)n * K + Fmt::base(P, P & 3, h);
        store4(o + (Fmt::XC ? 8 * t : 4 * t), lo);
        store4(o + (Fmt::XC ? 8 * t + 4 : 16 + 4 * t), hi);
    }
}

#else  // IS_FP8

// One thread: 16 values (one 16-byte chunk) of a row.
template <typename T>
__device__ __forceinline__ void dequant_body(const uint8_t* __restrict__ W, T* __restrict__ out, int N, int K) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x, per_row = K >> 4;
    if (idx >= (long long)N * per_row) return;
    const int n = (int)(idx / per_row), ch = (int)(idx % per_row);
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(W + (size_t)n * K + 16 * ch));
#if QTYPE == QFP8B
    const float s = __ldg(fp8_scales(W, N, K) + (size_t)n * ((K + 127) >> 7) + ((16 * ch) >> 7));
#else
    const float s = __ldg(fp8_scales(W, N, K) + n);
#endif
    const uint32_t w4[4] = {q.x, q.y, q.z, q.w};
    T* o = out + (size_t)n * K + 16 * ch;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint32_t lo = fp8x2_to_bf162(w4[j]), hi = fp8x2_to_bf162(w4[j] >> 16);  // exact
        const float v[4] = {__fmul_rn(__uint_as_float(lo << 16), s), __fmul_rn(__uint_as_float(lo & 0xffff0000u), s),
                            __fmul_rn(__uint_as_float(hi << 16), s), __fmul_rn(__uint_as_float(hi & 0xffff0000u), s)};
        store4(o + 4 * j, v);
    }
}

#endif  // QTYPE

extern "C" __global__ void dequant_q_bf16(const uint8_t* W, bf16* out, int N, int K) { dequant_body(W, out, N, K); }
extern "C" __global__ void dequant_q_f32(const uint8_t* W, float* out, int N, int K) { dequant_body(W, out, N, K); }
