/* The cpu backend's kernels: one decode round (or prefill chunk) of a llama-family
 * model in one call, over weights kept in GGML's block formats.
 *
 * Weights: Q8_0, Q4_0 and Q4_1 rows as stored in the GGUF (blocks of 32 along the
 * input dimension); Q5_0, Q5_1, Q3_K, Q4_K, Q5_K and Q6_K through kernels_kquants.c,
 * which reads their blocks (K-quants: sub-blocks) of 32 the same way. Activations are
 * quantized per row to blocks of 32 int16 with a float scale d and s = d * sum(q)
 * (llama.cpp's Q8_1 idea at 16 bits: int8 cost a percent of the logits, int16 a few
 * parts in 10^5), so every weight block meets
 * every row's block as an integer multiply-add.
 *
 * One weight stream a round: a product walks the weight rows once; each row's
 * blocks (a few hundred bytes) stay in L1 while every activation row of the
 * round is dotted against them, four rows at a time sharing one unpacking.
 *
 * The whole forward runs inside one OpenMP parallel region: each step (output
 * rows of a product, rows of a norm, (row, head) pairs of attention) is a list
 * of items the threads claim from a counter (see "work sharing" below).
 *
 * Compiled twice by build.py: with -mavx2 -mfma -mf16c (the IG_AVX2 path below)
 * and without (portable C); the backend picks by the processor's flags. Two more
 * builds add -mavxvnni (avx2vnni) and AMX tiles with AVX-512 (amx: IG_AMX,
 * kernels_amx.c's tile products and AVX2 block sums).
 */
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define IG_AVX2 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define IG_AMX 1 /* the amx build: tile products (kernels_amx.c) */
#endif
#endif

#include "kernels.h"

#define QK 32

#ifdef IG_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* ---- scalars ------------------------------------------------------------------- */

static inline float h2f(uint16_t h) {
#ifdef IG_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* float -> IEEE half, round to nearest even (the KV cache's element). */
static inline uint16_t f2h(float x) {
#ifdef IG_AVX2
    return (uint16_t)_cvtss_sh(x, 0);
#else
    _Float16 h = (_Float16)x;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
#endif
}

/* Bytes of one 32-wide block of each weight type. */
static int block_bytes(int type) {
    switch (type) {
    case IG_Q8_0: return 34;
    case IG_Q4_0: return 18;
    case IG_Q4_1: return 20;
    default: return 0;
    }
}

/* ---- dequantization (embedding rows, tests) ---------------------------------------- */

#include "kernels_kquants.c"

static void dequant_row(const ig_mat *w, int row, float *out) {
    const uint8_t *p = w->data + (int64_t)row * w->row_bytes;
    int nb = w->cols / QK, bb = block_bytes(w->type);
    if (kq_type(w->type)) {
        for (int b = 0; b < nb; b++, out += QK) {
            int16_t v[QK];
            float d, m;
            kq_unpack(w->type, p, b, v, &d, &m);
            for (int i = 0; i < QK; i++) out[i] = d * (float)v[i] + m;
        }
        return;
    }
    for (int b = 0; b < nb; b++, p += bb, out += QK) {
        float d = h2f(rd16(p));
        if (w->type == IG_Q8_0) {
            for (int i = 0; i < QK; i++) out[i] = d * (float)(int8_t)p[2 + i];
        } else if (w->type == IG_Q4_0) {
            for (int i = 0; i < 16; i++) {
                out[i] = ((float)(p[2 + i] & 15) - 8.0f) * d;
                out[i + 16] = ((float)(p[2 + i] >> 4) - 8.0f) * d;
            }
        } else {
            float m = h2f(rd16(p + 2));
            for (int i = 0; i < 16; i++) {
                out[i] = (float)(p[4 + i] & 15) * d + m;
                out[i + 16] = (float)(p[4 + i] >> 4) * d + m;
            }
        }
    }
}

void ig_dequant(const ig_mat *w, int row0, int nrows, float *out) {
    for (int r = 0; r < nrows; r++) dequant_row(w, row0 + r, out + (int64_t)r * w->cols);
}

/* ---- activation quantization -------------------------------------------------------- */

/* Blocks of 32 int16 (scale amax / 32767): close to float32 (2^-15 of the block's
 * largest value), while the products stay integer multiply-adds (vpmaddwd). The AVX2
 * path computes the same values (x * id rounded to nearest even, the same sums). */
static void quant_row(const float *x, int n, ig_xblk *out) {
#ifdef IG_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < n / QK; b++, x += QK) {
        __m256 v[4], m;
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(x + 8 * k);
        m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                          _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float amax = _mm_cvtss_f32(h);
        float d = amax / 32767.0f, id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        __m256 vid = _mm256_set1_ps(id);
        __m256i q[4], sum;
        for (int k = 0; k < 4; k++) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vid)); /* nearest even */
        sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        /* packs works within 128-bit lanes: restore element order with a 64-bit permute */
        _mm256_storeu_si256((__m256i *)out[b].q, _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8));
        _mm256_storeu_si256((__m256i *)(out[b].q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        out[b].d = d;
        out[b].s = d * (float)_mm_cvtsi128_si32(s4);
    }
#else
    for (int b = 0; b < n / QK; b++, x += QK) {
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(x[i]));
        float d = amax / 32767.0f, id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            int q = (int)nearbyintf(x[i] * id);
            out[b].q[i] = (int16_t)q;
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
#endif
}

void ig_quantize(const float *x, int nrows, int n, ig_xblk *out) {
    for (int r = 0; r < nrows; r++) quant_row(x + (int64_t)r * n, n, out + (int64_t)r * (n / QK));
}

/* ---- exp ---------------------------------------------------------------------------- */

#ifdef IG_AVX2
/* e^x for 8 floats (Cephes' expf: x = n ln2 + r, a polynomial in r, times 2^n); within 1 ulp of
 * the correctly rounded e^x over [-87, 88] (checked at 1.9M points), clamped to [-87.3, 88.4]
 * (below: ~1e-38 instead of 0, which no softmax or SwiGLU here tells apart). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365448f)), _mm256_set1_ps(88.3762626f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* x[i] = e^(x[i] - mx) for i in [lo, hi); returns their sum. */
static float exp_shifted(float *x, int lo, int hi, float mx) {
    float den = 0.0f;
    int i = lo;
#ifdef IG_AVX2
    __m256 acc = _mm256_setzero_ps(), vm = _mm256_set1_ps(mx);
    for (; i + 8 <= hi; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    den = hsum(acc);
#endif
    for (; i < hi; i++) {
        x[i] = expf(x[i] - mx);
        den += x[i];
    }
    return den;
}

/* g[i] = silu(g[i]) * u[i] for i < n (SwiGLU, in place over the gate). */
static void swiglu(float *g, const float *u, int n) {
    int i = 0;
#ifdef IG_AVX2
    for (; i + 8 <= n; i += 8) {
        __m256 gi = _mm256_loadu_ps(g + i);
        __m256 sig = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gi)));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(gi, sig), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* ---- dot products: one weight row against R activation rows --------------------------- */

#ifdef IG_AVX2

/* 8 halves as floats. */
#define LOADH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))

/* A block's 32 weights as two vectors of 16 int16 (elements 0..15, 16..31). */
static inline void unpack_block(int type, const uint8_t *qs, __m256i *lo, __m256i *hi) {
    __m128i t = _mm_loadu_si128((const __m128i *)qs);
    if (type == IG_Q8_0) {
        *lo = _mm256_cvtepi8_epi16(t);
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
    } else { /* Q4: low nibbles are elements 0..15 */
        __m128i mask = _mm_set1_epi8(0x0f);
        *lo = _mm256_cvtepu8_epi16(_mm_and_si128(t, mask));
        *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(t, 4), mask));
    }
}
#endif

/* out[r] = dot(weight row, x rows r) for r < R (R a compile-time constant after inlining).
 * Per block: Q8_0 d*q, Q4_0 d*(q-8), Q4_1 d*q+m; with x = dx*qx and s = dx*sum(qx):
 * dot = d*dx*sum(q*qx) (- 8*d*s for Q4_0, + m*s for Q4_1). */
static inline __attribute__((always_inline)) void dot_rows(const ig_mat *w, const uint8_t *row,
                                                            const ig_xblk *const *x, int R, float *out) {
    int nb = w->cols / QK, type = w->type, bb = type == IG_Q8_0 ? 34 : type == IG_Q4_0 ? 18 : 20;
    int qoff = type == IG_Q4_1 ? 4 : 2, kq = kq_type(type); /* kernels_kquants.c's types */
#ifdef IG_AVX2
    if (kq) {
        kq_dot(type, row, nb, x, NULL, NULL, 0, R, out);
        return;
    }
    __m256 acc[4];
    float extra[4];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        extra[r] = 0.0f;
    }
    for (int b = 0; b < nb; b++, row += bb) {
        float d = _cvtsh_ss(rd16(row));
        float m = type == IG_Q4_1 ? _cvtsh_ss(rd16(row + 2)) : type == IG_Q4_0 ? -8.0f * d : 0.0f;
        __m256i lo, hi;
        unpack_block(type, row + qoff, &lo, &hi);
        for (int r = 0; r < R; r++) {
            const ig_xblk *xb = x[r] + b;
            __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xb->q)),
                                         _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xb->q + 16))));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(p), acc[r]);
            extra[r] += m * xb->s;
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]) + extra[r];
#else
    for (int r = 0; r < R; r++) {
        const uint8_t *p = row;
        float sum = 0.0f;
        for (int b = 0; b < nb; b++, p += kq ? 0 : bb) {
            const ig_xblk *xb = x[r] + b;
            const uint8_t *q = p + qoff;
            float d = h2f(rd16(p)), m = 0.0f;
            int isum = 0;
            int64_t lsum = 0; /* Q6_K's |v| <= 4096: 32 products may pass int32 */
            if (kq) {
                int16_t v[QK];
                kq_unpack(type, row, b, v, &d, &m);
                for (int i = 0; i < QK; i++) lsum += v[i] * xb->q[i];
            } else if (type == IG_Q8_0) {
                for (int i = 0; i < QK; i++) isum += (int8_t)q[i] * xb->q[i];
            } else {
                for (int i = 0; i < 16; i++) isum += (q[i] & 15) * xb->q[i] + (q[i] >> 4) * xb->q[i + 16];
            }
            if (!kq) m = type == IG_Q4_1 ? h2f(rd16(p + 2)) : type == IG_Q4_0 ? -8.0f * d : 0.0f;
            sum += d * xb->d * (float)(kq ? lsum : isum) + m * xb->s;
        }
        out[r] = sum;
    }
#endif
}

#ifdef IG_AVX2
/* A group of G (8 or 4) activation rows against one weight row, with the rows' scales d and
 * sums s laid out by block (dtab[b * G + k] = x[k][b].d, stab alike; see build_tabs). Per block,
 * the G products d * x.d come from one vector multiply and the G terms m * x.s from one FMA;
 * per (block, row) pair there remain the two vpmaddwd, their sum, its conversion and one FMA
 * whose scale is a broadcast load. Against four rows with scalar scales, this takes the two
 * scalar multiply-adds of every pair off the FMA ports (docs/CPU.md, "profile"). */
static inline __attribute__((always_inline)) void dot_group(const ig_mat *w, const uint8_t *row,
                                                             const ig_xblk *const *x, const float *dtab,
                                                             const float *stab, int G, float *out) {
    int nb = w->cols / QK, type = w->type, bb = type == IG_Q8_0 ? 34 : type == IG_Q4_0 ? 18 : 20;
    int qoff = type == IG_Q4_1 ? 4 : 2;
    if (kq_type(type)) {
        kq_dot(type, row, nb, x, dtab, stab, 1, G, out);
        return;
    }
    __m256 acc[8], ex = _mm256_setzero_ps();
    float sc[8] __attribute__((aligned(32)));
    for (int r = 0; r < G; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, row += bb) {
        float d = _cvtsh_ss(rd16(row));
        float m = type == IG_Q4_1 ? _cvtsh_ss(rd16(row + 2)) : type == IG_Q4_0 ? -8.0f * d : 0.0f;
        __m256 xd = G == 8 ? _mm256_loadu_ps(dtab + b * 8) : _mm256_zextps128_ps256(_mm_loadu_ps(dtab + b * 4));
        __m256 xs = G == 8 ? _mm256_loadu_ps(stab + b * 8) : _mm256_zextps128_ps256(_mm_loadu_ps(stab + b * 4));
        _mm256_store_ps(sc, _mm256_mul_ps(xd, _mm256_set1_ps(d)));
        ex = _mm256_fmadd_ps(_mm256_set1_ps(m), xs, ex);
        __m256i lo, hi;
        unpack_block(type, row + qoff, &lo, &hi);
        for (int r = 0; r < G; r++) {
            const ig_xblk *xb = x[r] + b;
            __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xb->q)),
                                         _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xb->q + 16))));
            acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + r), _mm256_cvtepi32_ps(p), acc[r]);
        }
    }
    float e[8] __attribute__((aligned(32)));
    _mm256_store_ps(e, ex);
    for (int r = 0; r < G; r++) out[r] = hsum(acc[r]) + e[r];
}
#endif

/* Rows [r, r1) of a tile go in groups of 8, then 4, then one at a time. */
static inline int group_at(int r, int r1) { return r + 8 <= r1 ? 8 : r + 4 <= r1 ? 4 : 1; }

/* The scales of tile rows [r0, r1) by group and block: dtab[(r - r0) * nb + b * G + k] = x[r + k][b].d
 * for the group of G rows starting at r (stab likewise with s). */
static void build_tabs(const ig_xblk *x, int nb, int r0, int r1, float *dtab, float *stab) {
    for (int r = r0, g; r < r1; r += g) {
        g = group_at(r, r1);
        float *dt = dtab + (int64_t)(r - r0) * nb, *st = stab + (int64_t)(r - r0) * nb;
        for (int k = 0; k < g; k++)
            for (int b = 0; b < nb; b++) {
                dt[b * g + k] = x[(int64_t)(r + k) * nb + b].d;
                st[b * g + k] = x[(int64_t)(r + k) * nb + b].s;
            }
    }
}

/* ---- work sharing ------------------------------------------------------------------ *
 * Each step of a forward is a list of items that the team's threads claim one at a
 * time from a shared counter; a step is over when all its items are done, not when
 * every thread has arrived. On a machine whose cores are shared with other
 * processes a descheduled thread then holds nobody up unless it is inside an item
 * (a few microseconds of work): the others take what it has not claimed. A plain
 * barrier per step (OpenMP's) made a 2-thread decode round 30x slower than one
 * thread under load. */

typedef struct {
    atomic_int next;
    atomic_int done;
} ig_step;

static void step_wait(ig_step *st, int n) {
    for (int spins = 0; atomic_load_explicit(&st->done, memory_order_acquire) < n; spins++) {
        if (spins < 2000) {
#ifdef IG_AVX2
            _mm_pause();
#endif
        } else {
            sched_yield();
        }
    }
}

/* for (i ...) over the step's items claimed by this thread, then wait for the step to finish. */
#define FOR_ITEMS(st, n, i)                                                                                \
    for (int i = atomic_fetch_add(&(st)->next, 1), _n = (n); i < _n || (step_wait((st), _n), 0);       \
         atomic_fetch_add_explicit(&(st)->done, 1, memory_order_release), i = atomic_fetch_add(&(st)->next, 1))

/* Activation rows per tile: as many as fit XTILE_BYTES (L1), so each weight row is dotted
 * against rows already in L1; the weights stream from L2/L3 once per tile. Measured on a
 * 1,000-row prefill, 64-row tiles (in L2) cost 3.6 cycles per block pair against ~2.4. */
#define XTILE_BYTES 16384
#define JCHUNK 8
/* Weight rows ahead of the one being dotted that are prefetched: one row (~360 B) is ~30 ns of
 * work at one lane, less than a miss to memory; 4 measured best of 1, 4, 8, 16. */
#define ROWS_AHEAD 4

/* y[r * ldy + off + j] = W[j] . x[r] for the parts of a fused product (outputs concatenated). */
static void matmul_parts(ig_step *st, const ig_mat *parts, int nparts, const ig_xblk *x, int nx, float *y, int ldy) {
    int rows = 0;
    for (int p = 0; p < nparts; p++) rows += parts[p].rows;
    int nbx = parts[0].cols / QK, xtile = XTILE_BYTES / (nbx * (int)sizeof(ig_xblk)) & ~7;
    xtile = xtile < 8 ? 8 : xtile;
    int nchunks = (rows + JCHUNK - 1) / JCHUNK, ntiles = (nx + xtile - 1) / xtile;
    int ntab = (nx < xtile ? nx : xtile) * nbx, built = -1;
    float *dtab = malloc(sizeof(float) * 2 * ntab), *stab = dtab ? dtab + ntab : NULL;
    FOR_ITEMS(st, ntiles * nchunks, item) {
        int tile = item / nchunks, j0 = (item % nchunks) * JCHUNK;
        int r0 = tile * xtile, r1 = r0 + xtile < nx ? r0 + xtile : nx;
        if (dtab && tile != built) { /* items run tile by tile: a thread builds each tile's tables about once */
            build_tabs(x, nbx, r0, r1, dtab, stab);
            built = tile;
        }
        for (int j = j0; j < j0 + JCHUNK && j < rows; j++) {
            int p = 0, jj = j, off = 0;
            while (jj >= parts[p].rows) {
                jj -= parts[p].rows;
                off += parts[p].rows;
                p++;
            }
            const ig_mat *w = &parts[p];
            const uint8_t *row = w->data + (int64_t)jj * w->row_bytes;
#ifdef IG_AVX2
            if (jj + ROWS_AHEAD < w->rows) { /* a row ROWS_AHEAD on from memory while this one is dotted */
                const char *ahead = (const char *)row + ROWS_AHEAD * w->row_bytes;
                for (int64_t o = 0; o < w->row_bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
            }
#endif
            for (int r = r0, g; r < r1; r += g) {
                g = group_at(r, r1);
                const ig_xblk *xs[8];
                float o[8];
                for (int k = 0; k < g; k++) xs[k] = x + (int64_t)(r + k) * nbx;
#ifdef IG_AVX2
                const float *dt = dtab + (int64_t)(r - r0) * nbx, *stb = stab + (int64_t)(r - r0) * nbx;
                if (g == 8 && dtab)
                    dot_group(w, row, xs, dt, stb, 8, o);
                else if (g == 4 && dtab)
                    dot_group(w, row, xs, dt, stb, 4, o);
                else
#endif
                    if (g >= 4) {
                    for (int k = 0; k < g; k += 4) dot_rows(w, row, xs + k, 4, o + k);
                } else {
                    dot_rows(w, row, xs, 1, o);
                }
                for (int k = 0; k < g; k++) y[(int64_t)(r + k) * ldy + off + jj] = o[k];
            }
        }
    }
    free(dtab);
}

#ifdef IG_AMX
#include "kernels_amx.c"
#else
int ig_amx_init(void) { return -1; }
int64_t ig_amx_repack_bytes(const ig_mat *w) {
    (void)w;
    return 0;
}
void ig_amx_repack(const ig_mat *w, uint8_t *out) { (void)w, (void)out; }
int ig_amx_rows(int rows) {
    (void)rows;
    return 0;
}
#endif

/* ---- prefill: a register-blocked product over many rows ---------------------------------
 *
 * A span of many rows (a prefill chunk) meets each weight row often enough to unpack it
 * once. An item is a strip of TILE_COLS weight rows (output columns) against every row
 * of the span: the strip's blocks are unpacked into int16 laid out by k-pair (for block b
 * and pair p, the TILE_COLS columns' weights 2p and 2p+1 side by side), so one broadcast
 * of a row's activation pair meets 8 columns in one vpmaddwd (vpdpwssd with AVX-VNNI,
 * which also does the accumulate). Per block, TILE_ROWS rows x TILE_COLS columns of int32
 * sums are exact; then scaled into float: sum += float(isum) * (d * x.d), and for Q4_1
 * sum += m * x.s (Q4_0's -8 is applied while unpacking). A strip with a Q6_K column scales its
 * sums per 16 weights (16 pairs of its int16 v = q * sc, |v| <= 4096, stay within int32; 32
 * might not; Q3_K's |v| <= 128 needs no split). Decode rows keep dot_group's path and its
 * bits; a row's result here does not depend on the rows beside it either. */
#define TILE_COLS 16
#define TILE_ROWS 4

#ifdef IG_AVX2
#if defined(__AVXVNNI__)
#define PAIRS_ACC(acc, w, x) _mm256_dpwssd_avx_epi32((acc), (w), (x))
#else
#define PAIRS_ACC(acc, w, x) _mm256_add_epi32((acc), _mm256_madd_epi16((w), (x)))
#endif

/* Unpack output columns [j0, j0 + TILE_COLS) of the fused parts: ws[(b * 16 + p) * 2 * TILE_COLS
 * + 2 * c + t] = weight 32 b + 2 p + t of column c (int16; Q4_0 minus 8, Q5_0 minus 16), dw /
 * mw[b * TILE_COLS + c] its block's scale and offset (Q4_1, Q5_1, Q4_K, Q5_K; 0 otherwise). Columns
 * past the last are zeros. Returns 1 if any column has an offset, plus 2 if any is Q6_K. */
static int unpack_strip(const ig_mat *parts, int nparts, int j0, int rows, int nb, int16_t *ws, float *dw, float *mw) {
    int has_m = 0, split = 0;
    for (int c = 0; c < TILE_COLS; c++) {
        int j = j0 + c;
        if (j >= rows) {
            for (int b = 0; b < nb; b++) {
                for (int i = 0; i < QK; i++) ws[(b * 16 + i / 2) * 2 * TILE_COLS + 2 * c + (i & 1)] = 0;
                dw[b * TILE_COLS + c] = mw[b * TILE_COLS + c] = 0.0f;
            }
            continue;
        }
        int p = 0, jj = j;
        while (p < nparts - 1 && jj >= parts[p].rows) jj -= parts[p++].rows;
        const ig_mat *w = &parts[p];
        int type = w->type, bb = block_bytes(type), qoff = type == IG_Q4_1 ? 4 : 2, kq = kq_type(type);
        const uint8_t *blk = w->data + (int64_t)jj * w->row_bytes, *row0 = blk;
        has_m |= type == IG_Q4_1 || type == IG_Q5_1 || type == IG_Q4_K || type == IG_Q5_K;
        split |= type == IG_Q6_K;
        int16_t kv[kq ? nb * QK : 1];
        float kd[kq ? nb : 1], km[kq ? nb : 1];
        if (kq) kq_unpack_row(type, row0, nb, kv, kd, km); /* the new types' blocks, by SIMD */
        for (int b = 0; b < nb; b++, blk += bb) {
            const uint8_t *q = blk + qoff;
            int16_t v[QK];
            float d, m = 0.0f;
            if (kq) {
                memcpy(v, kv + b * QK, sizeof(v));
                d = kd[b], m = km[b];
            } else if (type == IG_Q8_0) {
                for (int i = 0; i < QK; i++) v[i] = (int8_t)q[i];
            } else {
                int off = type == IG_Q4_0 ? 8 : 0;
                for (int i = 0; i < 16; i++) {
                    v[i] = (int16_t)((q[i] & 15) - off);
                    v[i + 16] = (int16_t)((q[i] >> 4) - off);
                }
            }
            int16_t *dst = ws + (int64_t)b * 16 * 2 * TILE_COLS + 2 * c;
            for (int i = 0; i < QK; i += 2) {
                dst[(i / 2) * 2 * TILE_COLS] = v[i];
                dst[(i / 2) * 2 * TILE_COLS + 1] = v[i + 1];
            }
            if (!kq) d = h2f(rd16(blk)), m = type == IG_Q4_1 ? h2f(rd16(blk + 2)) : 0.0f;
            dw[b * TILE_COLS + c] = d;
            mw[b * TILE_COLS + c] = m;
        }
    }
    return has_m | split << 1;
}

static inline __m256i bcast_pair(const int16_t *q) {
    int32_t pair;
    memcpy(&pair, q, 4);
    return _mm256_set1_epi32(pair);
}

/* out[k * TILE_COLS + c] += the int32 sums acc of block b's rows xb[k] scaled into float: d * x.d, and
 * with has_m, m * x.s. */
static inline __attribute__((always_inline)) void tile_scale(__m256i acc[TILE_ROWS][2], const float *dw,
                                                              const float *mw, int has_m, int b,
                                                              const ig_xblk *const *xb, int R, float *out) {
    __m256 d0 = _mm256_loadu_ps(dw + b * TILE_COLS), d1 = _mm256_loadu_ps(dw + b * TILE_COLS + 8);
    __m256 m0 = _mm256_loadu_ps(mw + b * TILE_COLS), m1 = _mm256_loadu_ps(mw + b * TILE_COLS + 8);
    for (int k = 0; k < R; k++) {
        __m256 dx = _mm256_set1_ps(xb[k]->d), f0 = _mm256_loadu_ps(out + k * TILE_COLS),
               f1 = _mm256_loadu_ps(out + k * TILE_COLS + 8);
        f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[k][0]), _mm256_mul_ps(d0, dx), f0);
        f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[k][1]), _mm256_mul_ps(d1, dx), f1);
        if (has_m) {
            __m256 sx = _mm256_set1_ps(xb[k]->s);
            f0 = _mm256_fmadd_ps(m0, sx, f0);
            f1 = _mm256_fmadd_ps(m1, sx, f1);
        }
        _mm256_storeu_ps(out + k * TILE_COLS, f0);
        _mm256_storeu_ps(out + k * TILE_COLS + 8, f1);
    }
}

/* out[k * TILE_COLS + c] = column c of the strip . x[k] for k < R (R: 1 or TILE_ROWS, constant after
 * inlining). The R x 16 int32 sums of a block stay in registers (8 of the 16 at R = 4); the float
 * sums live in ``out`` across blocks. ``split``: the sums are scaled after each 16 weights. */
static inline __attribute__((always_inline)) void tile_rows(const int16_t *ws, const float *dw, const float *mw,
                                                             int has_m, int split, int nb, const ig_xblk *const *x,
                                                             int R, float *out) {
    for (int i = 0; i < R * TILE_COLS; i++) out[i] = 0.0f;
    const ig_xblk *x0 = x[0], *x1 = x[R > 1 ? 1 : 0], *x2 = x[R > 1 ? 2 : 0], *x3 = x[R > 1 ? 3 : 0];
    for (int b = 0; b < nb; b++) {
        const int16_t *wb = ws + (int64_t)b * 16 * 2 * TILE_COLS;
        const int16_t *q0 = x0[b].q, *q1 = x1[b].q, *q2 = x2[b].q, *q3 = x3[b].q;
        const ig_xblk *xb[TILE_ROWS] = {x0 + b, x1 + b, x2 + b, x3 + b};
        __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
                a31 = a00;
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) {
            __m256i w0 = _mm256_load_si256((const __m256i *)(wb + p * 2 * TILE_COLS));
            __m256i w1 = _mm256_load_si256((const __m256i *)(wb + p * 2 * TILE_COLS + 16));
            __m256i xv = bcast_pair(q0 + 2 * p);
            a00 = PAIRS_ACC(a00, w0, xv);
            a01 = PAIRS_ACC(a01, w1, xv);
            if (R > 1) {
                xv = bcast_pair(q1 + 2 * p);
                a10 = PAIRS_ACC(a10, w0, xv);
                a11 = PAIRS_ACC(a11, w1, xv);
                xv = bcast_pair(q2 + 2 * p);
                a20 = PAIRS_ACC(a20, w0, xv);
                a21 = PAIRS_ACC(a21, w1, xv);
                xv = bcast_pair(q3 + 2 * p);
                a30 = PAIRS_ACC(a30, w0, xv);
                a31 = PAIRS_ACC(a31, w1, xv);
            }
            /* keep the sums in registers, one add after each multiply (left alone, the compiler
             * reassociates the integer adds into trees over spilled products) */
            __asm__("" : "+x"(a00), "+x"(a01), "+x"(a10), "+x"(a11));
            __asm__("" : "+x"(a20), "+x"(a21), "+x"(a30), "+x"(a31));
            if (split && p == 7) { /* Q6_K: the first 16 weights' sums into float now */
                __m256i half[TILE_ROWS][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
                tile_scale(half, dw, mw, 0, b, xb, R, out);
                a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = _mm256_setzero_si256();
            }
        }
        __m256i acc[TILE_ROWS][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
        tile_scale(acc, dw, mw, has_m, b, xb, R, out);
    }
}

/* matmul_parts' result for many rows: items are strips of TILE_COLS output columns, each
 * against every row. */
static void tiled_parts(ig_step *st, const ig_mat *parts, int nparts, const ig_xblk *x, int nx, float *y, int ldy) {
    int rows = 0;
    for (int p = 0; p < nparts; p++) rows += parts[p].rows;
    int nb = parts[0].cols / QK, nstrips = (rows + TILE_COLS - 1) / TILE_COLS;
    int16_t *ws = aligned_alloc(32, (size_t)nb * 16 * 2 * TILE_COLS * sizeof(int16_t));
    float *dw = malloc(sizeof(float) * 2 * nb * TILE_COLS), *mw = dw ? dw + nb * TILE_COLS : NULL;
    int ok = ws && dw;
    /* every thread claims items alike, so a thread whose allocation failed does its items the slow way */
    FOR_ITEMS(st, nstrips, item) {
        int j0 = item * TILE_COLS, ncols = rows - j0 < TILE_COLS ? rows - j0 : TILE_COLS;
        float o[TILE_ROWS * TILE_COLS];
        if (!ok) {
            for (int c = 0; c < ncols; c++) {
                int p = 0, jj = j0 + c;
                while (p < nparts - 1 && jj >= parts[p].rows) jj -= parts[p++].rows;
                for (int r = 0; r < nx; r++) {
                    const ig_xblk *xs = x + (int64_t)r * nb;
                    dot_rows(&parts[p], parts[p].data + (int64_t)jj * parts[p].row_bytes, &xs, 1, o);
                    y[(int64_t)r * ldy + j0 + c] = o[0];
                }
            }
            continue;
        }
        int flags = unpack_strip(parts, nparts, j0, rows, nb, ws, dw, mw), has_m = flags & 1, split = flags >> 1;
        for (int r = 0, g; r < nx; r += g) {
            const ig_xblk *xs[TILE_ROWS];
            g = r + TILE_ROWS <= nx ? TILE_ROWS : 1;
            for (int k = 0; k < g; k++) xs[k] = x + (int64_t)(r + k) * nb;
            if (g == TILE_ROWS)
                tile_rows(ws, dw, mw, has_m, split, nb, xs, TILE_ROWS, o);
            else
                tile_rows(ws, dw, mw, has_m, split, nb, xs, 1, o);
            for (int k = 0; k < g; k++)
                for (int c = 0; c < ncols; c++) y[(int64_t)(r + k) * ldy + j0 + c] = o[k * TILE_COLS + c];
        }
    }
    free(ws), free(dw);
}
#endif

/* The product over ``nx`` rows: tiled where the rows are at least ``tiled_rows`` (0: never) and
 * the build has the tiled kernel, else the decode path (matmul_parts). */
static void product(ig_step *st, const ig_mat *parts, int nparts, const ig_xblk *x, int nx, float *y, int ldy,
                    int tiled_rows) {
#ifdef IG_AMX
    /* prefill chunks and decode rounds of amx_min_rows rows on through the tiles, decode rounds
     * below on AVX2 with the same bits (tiled_parts'); amx_min_rows 0: decode keeps dot_group's */
    if (amx_usable(parts, nparts) && ((tiled_rows > 0 && nx >= tiled_rows) || amx_min_rows > 0)) {
        if ((tiled_rows > 0 && nx >= tiled_rows) || nx >= amx_min_rows)
            amx_parts(st, parts, nparts, x, nx, y, ldy);
        else
            sums_parts(st, parts, nparts, x, nx, y, ldy);
        return;
    }
#endif
#ifdef IG_AVX2
    if (tiled_rows > 0 && nx >= tiled_rows) {
        tiled_parts(st, parts, nparts, x, nx, y, ldy);
        return;
    }
#else
    (void)tiled_rows;
#endif
    matmul_parts(st, parts, nparts, x, nx, y, ldy);
}

void ig_matmul_tiled(const ig_mat *parts, int nparts, const ig_xblk *x, int nx, float *y, int ldy, int threads) {
    ig_step st = {0, 0};
#pragma omp parallel num_threads(threads)
    product(&st, parts, nparts, x, nx, y, ldy, 1);
}

void ig_matmul(const ig_mat *parts, int nparts, const ig_xblk *x, int nx, float *y, int ldy, int threads) {
    ig_step st = {0, 0};
#pragma omp parallel num_threads(threads)
    product(&st, parts, nparts, x, nx, y, ldy, 0);
}

/* ---- the forward ------------------------------------------------------------------ */

static void rms_row(const float *x, const float *w, int h, float eps, float *o) {
    float ss = 0.0f;
    for (int i = 0; i < h; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)h + eps);
    for (int i = 0; i < h; i++) o[i] = w[i] * (x[i] * inv);
}

/* ---- attention over the paged cache ---------------------------------------------- */

/* q . k with k in half precision. */
static inline float dot_kv(const float *a, const uint16_t *b, int n) {
#ifdef IG_AVX2
    if (n % 32 == 0) { /* four independent FMA chains */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int e = 0; e < n; e += 32) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), LOADH(b + e), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e + 8), LOADH(b + e + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e + 16), LOADH(b + e + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e + 24), LOADH(b + e + 24), a3);
        }
        return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    }
#endif
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int e = 0; e < n; e++) s += a[e] * h2f(b[e]);
    return s;
}

/* out = sum_i p[i] * v_i over entries [first, last) of the context, then times ``scale``. */
static void weighted_values(const uint16_t *vc, int64_t kvw, const int64_t *slots, const float *p, int first, int last,
                            int hd, float scale, float *out) {
#ifdef IG_AVX2
    if (hd % 8 == 0) {
        int e0 = 0;
        for (; e0 + 64 <= hd; e0 += 64) { /* 64 output lanes held in 8 registers */
            __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0, o4 = o0, o5 = o0, o6 = o0, o7 = o0;
            for (int i = first; i < last; i++) {
                const uint16_t *vv = vc + slots[i] * kvw + e0;
                __m256 w = _mm256_set1_ps(p[i]);
                o0 = _mm256_fmadd_ps(w, LOADH(vv), o0);
                o1 = _mm256_fmadd_ps(w, LOADH(vv + 8), o1);
                o2 = _mm256_fmadd_ps(w, LOADH(vv + 16), o2);
                o3 = _mm256_fmadd_ps(w, LOADH(vv + 24), o3);
                o4 = _mm256_fmadd_ps(w, LOADH(vv + 32), o4);
                o5 = _mm256_fmadd_ps(w, LOADH(vv + 40), o5);
                o6 = _mm256_fmadd_ps(w, LOADH(vv + 48), o6);
                o7 = _mm256_fmadd_ps(w, LOADH(vv + 56), o7);
            }
            __m256 sc = _mm256_set1_ps(scale), o[8] = {o0, o1, o2, o3, o4, o5, o6, o7};
            for (int v = 0; v < 8; v++) _mm256_storeu_ps(out + e0 + 8 * v, _mm256_mul_ps(o[v], sc));
        }
        for (; e0 < hd; e0 += 8) { /* the rest, 8 lanes at a time */
            __m256 o = _mm256_setzero_ps();
            for (int i = first; i < last; i++)
                o = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), LOADH(vc + slots[i] * kvw + e0), o);
            _mm256_storeu_ps(out + e0, _mm256_mul_ps(o, _mm256_set1_ps(scale)));
        }
        return;
    }
#endif
    for (int e = 0; e < hd; e++) out[e] = 0.0f;
    for (int i = first; i < last; i++) {
        const uint16_t *v = vc + slots[i] * kvw;
        for (int e = 0; e < hd; e++) out[e] += p[i] * h2f(v[e]);
    }
    for (int e = 0; e < hd; e++) out[e] *= scale;
}

/* Rows per attention item: the query heads of one kv head for up to ATT_ROWS rows of one
 * sequence read each key and value once (from L1) for all of them. */
#define ATT_ROWS 8
/* Keys ahead of the one being scored whose K and V lines are prefetched. */
#define KV_AHEAD 8

/* The queries of rows [r0, r0 + nq / g) for kv head ``kvh``, scaled into qs [nq, hd], and each
 * one's visible context entries [lo, hi) (the sliding window's start); first / last: their union. */
static void query_rows(const ig_model *m, const ig_batch *bt, int window, const float *qkv, int nqkv, int r0, int nq,
                       int kvh, float *qs, int *lo, int *hi, int *first, int *last) {
    int hd = m->head_dim, g = m->num_heads / m->num_kv_heads;
    for (int qi = 0; qi < nq; qi++) {
        int r = r0 + qi / g, head = kvh * g + qi % g;
        const float *src = qkv + (int64_t)r * nqkv + head * hd;
        for (int e = 0; e < hd; e++) qs[qi * hd + e] = src[e] * m->attn_scale;
        int p0 = bt->row_ctx_p0[r], qpos = bt->positions[r];
        hi[qi] = bt->row_ctx_n[r];
        lo[qi] = window > 0 && qpos - p0 >= window ? qpos - p0 - window + 1 : 0;
        *first = lo[qi] < *first ? lo[qi] : *first;
        *last = hi[qi] > *last ? hi[qi] : *last;
    }
}

/* Attention of rows [r0, r1) (one sequence: they share one context list) for the query
 * heads of kv head ``kvh``; q is read from the fused qkv rows, the result goes to ``h``.
 * Scratch: qs [ATT_ROWS * g * hd], sc [ATT_ROWS * g * maxctx]. */
static void attend_rows(const ig_model *m, const ig_batch *bt, int layer, int window, const float *qkv, int nqkv,
                        int r0, int r1, int kvh, float *qs, float *sc, int maxctx, float *h) {
    int hd = m->head_dim, nh = m->num_heads, g = nh / m->num_kv_heads, kvw = m->num_kv_heads * hd;
    const uint16_t *kc = m->k_cache + (int64_t)layer * m->layer_stride + kvh * hd;
    const uint16_t *vc = m->v_cache + (int64_t)layer * m->layer_stride + kvh * hd;
    const int64_t *slots = bt->ctx_slots + bt->row_ctx_off[r0];
    int nq = (r1 - r0) * g, first = 1 << 30, last = 0;
    int lo[nq], hi[nq]; /* each query's visible entries: [lo, hi) */
    query_rows(m, bt, window, qkv, nqkv, r0, nq, kvh, qs, lo, hi, &first, &last);
    for (int i = first; i < last; i++) { /* each key once, against every query that sees it */
        const uint16_t *k = kc + slots[i] * kvw;
#ifdef IG_AVX2
        if (i + KV_AHEAD < last) { /* the caches of 8 lanes pass L2: ask for the keys (and values) ahead */
            for (int o = 0; o < 2 * hd; o += 64) {
                _mm_prefetch((const char *)(kc + slots[i + KV_AHEAD] * kvw) + o, _MM_HINT_T0);
                _mm_prefetch((const char *)(vc + slots[i + KV_AHEAD] * kvw) + o, _MM_HINT_T0);
            }
        }
#endif
        for (int qi = 0; qi < nq; qi++)
            if (i >= lo[qi] && i < hi[qi]) sc[(int64_t)qi * maxctx + i] = dot_kv(qs + qi * hd, k, hd);
    }
    for (int qi = 0; qi < nq; qi++) {
        float *s = sc + (int64_t)qi * maxctx, mx = -INFINITY, den = 0.0f;
        for (int i = lo[qi]; i < hi[qi]; i++) mx = s[i] > mx ? s[i] : mx;
        den = exp_shifted(s, lo[qi], hi[qi], mx);
        int r = r0 + qi / g, head = kvh * g + qi % g;
        weighted_values(vc, kvw, slots, s, lo[qi], hi[qi], hd, 1.0f / den, h + (int64_t)r * nh * hd + head * hd);
    }
}

#ifdef IG_AVX2
/* Keys (and values) per chunk of the prefill attention. */
#define KCH 16

/* attend_rows for a prefill chunk's rows (AVX2, head_dim a multiple of 8): each chunk of KCH keys
 * is converted from half precision once, transposed (kt[e * KCH + t]), and met by 4 queries at a
 * time in 8 accumulators (4 queries x 16 keys), one FMA per 8 (query, key) products instead of
 * one dot product and a horizontal sum per pair; the chunk's values, converted once too, are
 * weighted into every query's output (acc, [nq, hd]). The same scores and weights as
 * attend_rows up to the order of the float sums. Scratch: qs, acc [ATT_ROWS * g * hd], kt and
 * vf [KCH * hd], sc [ATT_ROWS * g * ldsc] with ldsc >= the context + KCH. */
static void attend_tile(const ig_model *m, const ig_batch *bt, int layer, int window, const float *qkv, int nqkv,
                        int r0, int r1, int kvh, float *qs, float *acc, float *kt, float *vf, float *sc, int ldsc,
                        float *h) {
    int hd = m->head_dim, nh = m->num_heads, g = nh / m->num_kv_heads, kvw = m->num_kv_heads * hd;
    const uint16_t *kc = m->k_cache + (int64_t)layer * m->layer_stride + kvh * hd;
    const uint16_t *vc = m->v_cache + (int64_t)layer * m->layer_stride + kvh * hd;
    const int64_t *slots = bt->ctx_slots + bt->row_ctx_off[r0];
    int nq = (r1 - r0) * g, first = 1 << 30, last = 0;
    int lo[nq + 3], hi[nq + 3];
    query_rows(m, bt, window, qkv, nqkv, r0, nq, kvh, qs, lo, hi, &first, &last);
    for (int qi = nq; qi < nq + 3; qi++) lo[qi] = 1 << 30, hi[qi] = 0; /* the last group's missing queries */
    for (int i0 = first; i0 < last; i0 += KCH) {
        int nk = last - i0 < KCH ? last - i0 : KCH;
        for (int t0 = 0; t0 < KCH; t0 += 8) { /* 8 keys x 8 dims at a time, transposed in registers */
            const uint16_t *k[8];
            for (int t = 0; t < 8; t++) k[t] = kc + slots[t0 + t < nk ? i0 + t0 + t : i0] * kvw;
            __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nk - t0), lane)); /* keys < nk */
            for (int e = 0; e < hd; e += 8) {
                __m256 r[8], t[8];
                for (int j = 0; j < 8; j++) r[j] = LOADH(k[j] + e);
                for (int j = 0; j < 8; j += 2) {
                    t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
                    t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
                }
                for (int j = 0; j < 8; j += 4) {
                    r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
                    r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xee);
                    r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
                    r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xee);
                }
                for (int j = 0; j < 4; j++) {
                    __m256 a = _mm256_permute2f128_ps(r[j], r[j + 4], 0x20);
                    __m256 b = _mm256_permute2f128_ps(r[j], r[j + 4], 0x31);
                    _mm256_storeu_ps(kt + (e + j) * KCH + t0, _mm256_and_ps(a, keep));
                    _mm256_storeu_ps(kt + (e + j + 4) * KCH + t0, _mm256_and_ps(b, keep));
                }
            }
        }
        for (int q0 = 0; q0 < nq; q0 += 4) {
            int seen = 0;
            for (int qi = q0; qi < q0 + 4; qi++) seen |= i0 < hi[qi] && i0 + KCH > lo[qi];
            if (!seen) continue;
            const float *a = qs + q0 * hd;
            int nb4 = nq - q0 < 4 ? nq - q0 : 4;
            const float *a1 = a + (nb4 > 1 ? hd : 0), *a2 = a + (nb4 > 2 ? 2 * hd : 0);
            const float *a3 = a + (nb4 > 3 ? 3 * hd : 0);
            __m256 s00 = _mm256_setzero_ps(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00,
                   s31 = s00;
            for (int e = 0; e < hd; e++) {
                __m256 k0 = _mm256_loadu_ps(kt + e * KCH), k1 = _mm256_loadu_ps(kt + e * KCH + 8), b;
                b = _mm256_broadcast_ss(a + e);
                s00 = _mm256_fmadd_ps(b, k0, s00), s01 = _mm256_fmadd_ps(b, k1, s01);
                b = _mm256_broadcast_ss(a1 + e);
                s10 = _mm256_fmadd_ps(b, k0, s10), s11 = _mm256_fmadd_ps(b, k1, s11);
                b = _mm256_broadcast_ss(a2 + e);
                s20 = _mm256_fmadd_ps(b, k0, s20), s21 = _mm256_fmadd_ps(b, k1, s21);
                b = _mm256_broadcast_ss(a3 + e);
                s30 = _mm256_fmadd_ps(b, k0, s30), s31 = _mm256_fmadd_ps(b, k1, s31);
            }
            __m256 res[4][2] = {{s00, s01}, {s10, s11}, {s20, s21}, {s30, s31}};
            for (int k = 0; k < nb4; k++) { /* entries outside a query's [lo, hi) are written, never read */
                _mm256_storeu_ps(sc + (int64_t)(q0 + k) * ldsc + i0, res[k][0]);
                _mm256_storeu_ps(sc + (int64_t)(q0 + k) * ldsc + i0 + 8, res[k][1]);
            }
        }
    }
    for (int qi = 0; qi < nq; qi++) {
        float *s = sc + (int64_t)qi * ldsc, mx = -INFINITY;
        int i = lo[qi];
        __m256 vm = _mm256_set1_ps(-INFINITY);
        for (; i + 8 <= hi[qi]; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + i));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        for (; i < hi[qi]; i++) mx = s[i] > mx ? s[i] : mx;
        float den = exp_shifted(s, lo[qi], hi[qi], mx);
        for (int i = lo[qi]; i < hi[qi]; i++) s[i] /= den;
        for (int e = 0; e < hd; e++) acc[qi * hd + e] = 0.0f;
    }
    for (int i0 = first; i0 < last; i0 += KCH) {
        int nk = last - i0 < KCH ? last - i0 : KCH;
        for (int t = 0; t < nk; t++) {
            const uint16_t *v = vc + slots[i0 + t] * kvw;
            for (int e = 0; e < hd; e += 8) _mm256_storeu_ps(vf + t * hd + e, LOADH(v + e));
        }
        for (int qi = 0; qi < nq; qi++) {
            int t0 = lo[qi] > i0 ? lo[qi] - i0 : 0, t1 = hi[qi] - i0 < nk ? hi[qi] - i0 : nk;
            const float *p = sc + (int64_t)qi * ldsc + i0;
            float *o = acc + qi * hd;
            for (int e = 0; e + 32 <= hd; e += 32) { /* 32 outputs in 4 registers across the chunk */
                __m256 o0 = _mm256_loadu_ps(o + e), o1 = _mm256_loadu_ps(o + e + 8);
                __m256 o2 = _mm256_loadu_ps(o + e + 16), o3 = _mm256_loadu_ps(o + e + 24);
                for (int t = t0; t < t1; t++) {
                    __m256 w = _mm256_broadcast_ss(p + t);
                    const float *vv = vf + t * hd + e;
                    o0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv), o0);
                    o1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + 8), o1);
                    o2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + 16), o2);
                    o3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + 24), o3);
                }
                _mm256_storeu_ps(o + e, o0), _mm256_storeu_ps(o + e + 8, o1);
                _mm256_storeu_ps(o + e + 16, o2), _mm256_storeu_ps(o + e + 24, o3);
            }
            for (int e = hd / 32 * 32; e < hd; e += 8) {
                __m256 o0 = _mm256_loadu_ps(o + e);
                for (int t = t0; t < t1; t++)
                    o0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t), _mm256_loadu_ps(vf + t * hd + e), o0);
                _mm256_storeu_ps(o + e, o0);
            }
        }
    }
    for (int qi = 0; qi < nq; qi++) {
        int r = r0 + qi / g, head = kvh * g + qi % g;
        memcpy(h + (int64_t)r * nh * hd + head * hd, acc + qi * hd, sizeof(float) * hd);
    }
}
#endif

#define STEPS_PER_LAYER 11
#ifdef IG_AVX2
#define KCH_PAD KCH
#define TILED_ATT 1
#else
#define KCH_PAD 16
#define TILED_ATT 0
#endif

int ig_forward(const ig_model *m, const ig_batch *bt, float *out_h) {
    int n = bt->n, H = m->hidden, nh = m->num_heads, nkvh = m->num_kv_heads, hd = m->head_dim;
    int nq = nh * hd, nkv = nkvh * hd, nqkv = nq + 2 * nkv, I = m->intermediate, rd = m->rot_dim;
    int maxk = H > nq ? H : nq;
    maxk = maxk > I ? maxk : I;
    int maxctx = 1;
    for (int r = 0; r < n; r++) maxctx = bt->row_ctx_n[r] > maxctx ? bt->row_ctx_n[r] : maxctx;
    int threads = m->threads, nsteps = 2 + STEPS_PER_LAYER * m->num_layers;
    float *x = malloc(sizeof(float) * n * H), *h = malloc(sizeof(float) * n * (H > nq ? H : nq));
    float *big = malloc(sizeof(float) * n * (2 * I > nqkv ? 2 * I : nqkv));
    ig_xblk *xq = malloc(sizeof(ig_xblk) * n * (maxk / QK));
    int g = nh / nkvh, ldsc = maxctx + KCH_PAD, per_thread = ATT_ROWS * g * (ldsc + 2 * hd) + 2 * KCH_PAD * hd;
    float *scores = malloc(sizeof(float) * (int64_t)per_thread * threads);
    ig_step *steps = calloc(nsteps, sizeof(ig_step));
    if (!x || !h || !big || !xq || !scores || !steps) {
        free(x), free(h), free(big), free(xq), free(scores), free(steps);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *qs = scores + (int64_t)tid * per_thread, *acc = qs + ATT_ROWS * g * hd, *kt = acc + ATT_ROWS * g * hd;
        float *vf = kt + KCH_PAD * hd, *sc = vf + KCH_PAD * hd;
        /* prefill chunks' attention through attend_tile (the decode rounds keep attend_rows and its bits) */
        int tiled_att = TILED_ATT && bt->tiled_rows > 0 && n >= bt->tiled_rows && hd % 8 == 0;
        (void)acc, (void)kt, (void)vf, (void)tiled_att;
        ig_step *st = steps;
        FOR_ITEMS(st, n, r) {
            dequant_row(&m->embed, bt->tokens[r], x + (int64_t)r * H);
            if (m->embed_scale != 1.0f)
                for (int i = 0; i < H; i++) x[(int64_t)r * H + i] *= m->embed_scale;
        }
        st++;
        for (int l = 0; l < m->num_layers; l++) {
            const ig_layer *L = &m->layers[l];
            uint16_t *kc = m->k_cache + (int64_t)l * m->layer_stride, *vc = m->v_cache + (int64_t)l * m->layer_stride;
            FOR_ITEMS(st, n, r) {
                rms_row(x + (int64_t)r * H, L->attn_norm, H, m->eps, h + (int64_t)r * H);
                quant_row(h + (int64_t)r * H, H, xq + (int64_t)r * (H / QK));
            }
            st++;
            product(st++, L->qkv, 3, xq, n, big, nqkv, bt->tiled_rows);
            /* bias, rope on q and k heads, then this round's K/V into the cache */
            FOR_ITEMS(st, n, r) {
                float *row = big + (int64_t)r * nqkv;
                if (L->qkv_bias)
                    for (int i = 0; i < nqkv; i++) row[i] += L->qkv_bias[i];
                const float *c = bt->cos + (int64_t)r * rd, *s = bt->sin + (int64_t)r * rd;
                int half = rd / 2;
                for (int hh = 0; hh < nh + nkvh; hh++) {
                    float *v = row + hh * hd;
                    for (int i = 0; i < half; i++) {
                        float a = v[i], b = v[i + half];
                        v[i] = a * c[i] - b * s[i];
                        v[i + half] = b * c[i + half] + a * s[i + half];
                    }
                }
                int64_t slot = bt->write_slots[r];
                for (int e = 0; e < nkv; e++) {
                    kc[slot * nkv + e] = f2h(row[nq + e]);
                    vc[slot * nkv + e] = f2h(row[nq + nkv + e]);
                }
            }
            st++;
            /* items: (ATT_ROWS rows, kv head); rows of one sequence share a context list */
            FOR_ITEMS(st, (n + ATT_ROWS - 1) / ATT_ROWS * nkvh, item) {
                int r0 = item / nkvh * ATT_ROWS, kvh = item % nkvh, end = r0 + ATT_ROWS < n ? r0 + ATT_ROWS : n;
                while (r0 < end) {
                    int r1 = r0 + 1;
                    while (r1 < end && bt->row_ctx_off[r1] == bt->row_ctx_off[r0]) r1++;
#ifdef IG_AVX2
                    if (tiled_att)
                        attend_tile(m, bt, l, L->window, big, nqkv, r0, r1, kvh, qs, acc, kt, vf, sc, ldsc, h);
                    else
#endif
                        attend_rows(m, bt, l, L->window, big, nqkv, r0, r1, kvh, qs, sc, ldsc, h);
                    r0 = r1;
                }
            }
            st++;
            FOR_ITEMS(st, n, r) quant_row(h + (int64_t)r * nq, nq, xq + (int64_t)r * (nq / QK));
            st++;
            product(st++, &L->o, 1, xq, n, big, H, bt->tiled_rows);
            /* residual, then the MLP's norm: rows are whole again */
            FOR_ITEMS(st, n, r) {
                float *xr = x + (int64_t)r * H;
                for (int i = 0; i < H; i++) xr[i] += big[(int64_t)r * H + i];
                rms_row(xr, L->mlp_norm, H, m->eps, h + (int64_t)r * H);
                quant_row(h + (int64_t)r * H, H, xq + (int64_t)r * (H / QK));
            }
            st++;
            product(st++, L->gate_up, 2, xq, n, big, 2 * I, bt->tiled_rows);
            FOR_ITEMS(st, n, r) { /* SwiGLU, in place over the gate half */
                float *gu = big + (int64_t)r * 2 * I;
                swiglu(gu, gu + I, I);
                quant_row(gu, I, xq + (int64_t)r * (I / QK));
            }
            st++;
            product(st++, &L->down, 1, xq, n, big, H, bt->tiled_rows);
            FOR_ITEMS(st, n, r) {
                float *xr = x + (int64_t)r * H;
                for (int i = 0; i < H; i++) xr[i] += big[(int64_t)r * H + i];
            }
            st++;
        }
        FOR_ITEMS(st, n, r) rms_row(x + (int64_t)r * H, m->final_norm, H, m->eps, out_h + (int64_t)r * H);
    }
    free(x), free(h), free(big), free(xq), free(scores), free(steps);
    return 0;
}

int ig_logits(const ig_model *m, const float *hrows, int n, float *logits) {
    int H = m->hidden;
    ig_xblk *xq = malloc(sizeof(ig_xblk) * n * (H / QK));
    if (!xq) return -1;
    ig_quantize(hrows, n, H, xq);
    ig_matmul(&m->lm_head, 1, xq, n, logits, m->lm_head.rows, m->threads);
    free(xq);
    return 0;
}
