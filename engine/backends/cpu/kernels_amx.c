/* AMX-INT8 weight products (the amx build; #included from kernels.c where IG_AMX is set).
 *
 * The tiled (prefill) product's result, the same bits as tiled_parts: per (output column,
 * activation row, block) the exact int32 sum of the block, then f = fma(float(isum), d * x.d, f)
 * and, with an offset (Q4_1, Q5_1, Q4_K, Q5_K), f = fma(m, x.s, f), block after block. The tile
 * types are those with exact int8 weights and one scale (and offset) a 32-block: Q8_0, Q4_0, Q4_1,
 * Q5_0, Q5_1, Q4_K, Q5_K (Q3_K's and Q6_K's values with their scales folded in pass int8; they
 * stay on dot_group / tiled_parts). Activations are int16: hi = q >> 8 (signed) and lo = q & 255
 * (unsigned) are two A tiles (M activation rows x 32 bytes, M the product's rows up to 16); the
 * weights are the B tile (16 weight rows in VNNI order: row g holds weights 4g..4g+3 of each);
 * TDPBSSD and TDPBUSD give the sums and isum = 256 * hi + lo exactly. A block's scales force
 * K = 32 a product: per block two TDPs, two tile stores and the float epilogue (AVX-512: a
 * vector of 16 weight rows for each of the M activation rows), all in proportion to M, so a
 * round of 8 rows does half the work of 16.
 *
 * The B tiles come from a copy made at load (ig_amx_repack, w->tiles: per strip of 16 rows and
 * block, the 512 B tile, then the 16 d and the 16 m as floats); a matrix without one is unpacked
 * into that layout at every product (amx_fill). One and two rows read the stored bytes instead
 * (sums_parts: one lane streams the weights, and the copy is ~2x the Q4 bytes).
 *
 * The other builds' decode path (dot_group) keeps each block's sum as 8 partial sums with float
 * accumulators of their own; tile products can give those too (one lane per column) at 8x the
 * products and stores, which measured slower than AVX2 (docs/CPU.md, "AMX products"). So this
 * build's decode rounds carry the prefill's bits instead: through the tiles from amx_min_rows
 * rows on, below that through sums_parts (AVX2, the same sums and order), so a row's bits do not
 * depend on the rows beside it at any width.
 *
 * Tiles: 0 and 7 weights (8 x 64 B), 1 and 2 activations hi / lo (M x 32 B), 3, 4 and 5, 6 the
 * int32 sums (M x 64 B): even blocks in 0, 3, 4 and odd ones in 7, 5, 6, so block b + 1's products
 * run while block b's sums are stored and scaled. Each thread loads the config before its first
 * tile instruction and releases the tiles at the end of the product; the process asks for them
 * once (ig_amx_init). */
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_XT 64 /* activation rows a tile of items: four A tiles of 16 */

static int amx_state = 0;    /* 0 untried, 1 usable, -1 refused */
/* Decode products of at least this many rows take the tiles, those below sums_parts (the same bits);
 * 0: decode keeps dot_group's path and bits. 3: where the tiles win (docs/CPU.md, "AMX products"). */
static int amx_min_rows = 3;

int ig_amx_init(void) {
    if (amx_state == 0) {
        /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA (18), then ARCH_GET_XCOMP_PERM to check it */
        unsigned long bits = 0;
        long rc = syscall(SYS_arch_prctl, 0x1023, 18);
        long rg = syscall(SYS_arch_prctl, 0x1022, &bits);
        amx_state = rc == 0 && rg == 0 && (bits & (1ul << 18)) ? 1 : -1;
    }
    return amx_state == 1 ? 0 : -1;
}

int ig_amx_rows(int rows) {
    int was = amx_min_rows;
    amx_min_rows = rows;
    return was;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

/* Tiles 1, 2: activations hi / lo (M rows x 32 B), 0 and 7: weights (8 x 64 B, VNNI order), 3-6: the
 * int32 sums (M rows x 16). M: the product's rows, at most 16 (a round of 8 rows does half a tile's work). */
static void amx_config(int M) {
    amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[7] = 8, c.colsb[0] = c.colsb[7] = 64;
    c.rows[1] = c.rows[2] = (uint8_t)M, c.colsb[1] = c.colsb[2] = 32;
    for (int t = 3; t <= 6; t++) c.rows[t] = (uint8_t)M, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* A thread's activation tiles, kept between products (the pool's threads live on): per group of
 * 16 rows and block, A hi then A lo (16 rows x 32 B each) and the rows' d[16], s[16]. */
static __thread uint8_t *amx_x;
static __thread size_t amx_xcap;

static int amx_reserve(int groups, int nb) {
    size_t need = (size_t)groups * nb * (1024 + 128);
    if (need > amx_xcap) {
        free(amx_x);
        amx_x = aligned_alloc(64, need);
        amx_xcap = amx_x ? need : 0;
    }
    return amx_x != NULL;
}

/* Rows [r0, r1) into A tiles: row n of group t is activation row r0 + 16 t + n (zeros past r1). */
static void amx_build_x(const ig_xblk *x, int nb, int r0, int r1) {
    for (int t = 0; t < (r1 - r0 + 15) / 16; t++)
        for (int b = 0; b < nb; b++) {
            uint8_t *hi = amx_x + ((size_t)t * nb + b) * (1024 + 128), *lo = hi + 512;
            float *xd = (float *)(hi + 1024), *xs = xd + 16;
            for (int n = 0; n < 16; n++) {
                int r = r0 + 16 * t + n;
                uint8_t h8[32], l8[32];
                if (r < r1) {
                    const ig_xblk *xb = x + (int64_t)r * nb + b;
                    __m512i q = _mm512_loadu_si512(xb->q);
                    _mm256_storeu_si256((__m256i *)h8, _mm512_cvtepi16_epi8(_mm512_srai_epi16(q, 8)));
                    _mm256_storeu_si256((__m256i *)l8, _mm512_cvtepi16_epi8(q)); /* q & 255 */
                    xd[n] = xb->d, xs[n] = xb->s;
                } else {
                    memset(h8, 0, 32), memset(l8, 0, 32);
                    xd[n] = xs[n] = 0.0f;
                }
                memcpy(hi + 32 * n, h8, 32);
                memcpy(lo + 32 * n, l8, 32);
            }
        }
}

/* The tile types: exact int8 weights with one scale (and offset) a 32-block. Q6_K (|v| <= 4096) and
 * Q3_K (|v| <= 128) do not fit int8: they stay on dot_group / tiled_parts. */
static int amx_type(int type) {
    return type == IG_Q8_0 || type == IG_Q4_0 || type == IG_Q4_1 || type == IG_Q5_0 || type == IG_Q5_1 ||
           type == IG_Q4_K || type == IG_Q5_K;
}

static int amx_has_m(int type) { return type == IG_Q4_1 || type == IG_Q5_1 || type == IG_Q4_K || type == IG_Q5_K; }

/* Bytes a (strip of 16 rows, block) in the tile layout: the weight tile (B: 8 rows of 64 B in VNNI
 * order, row g holding weights 4g..4g+3 of each of the 16 weight rows; int8, Q4_0 minus 8, Q5_0 minus
 * 16; rows past the matrix zeros), then the 16 rows' scales d as floats, then (types with an offset)
 * the 16 offsets m. */
static int amx_pack_bytes(int type) { return 512 + 64 * (1 + amx_has_m(type)); }

/* Rows [j0, j0 + n) of w (n <= 16), every block, into the tile layout at dst (nb blocks of
 * amx_pack_bytes): unpacked row by row (row r's 32 weights at 32 r), then each block's 16 x 8 words
 * turned into VNNI order in place (8 gathers). The scales are the ones tiled_parts uses
 * (unpack_strip), the weights the same integers. */
static void amx_fill(const ig_mat *w, int j0, int n, uint8_t *dst) {
    int nb = w->cols / QK, type = w->type, bb = block_bytes(type), qoff = type == IG_Q4_1 ? 4 : 2;
    int pb = amx_pack_bytes(type), has_m = amx_has_m(type);
    const uint8_t *base = w->data + (int64_t)j0 * w->row_bytes;
    if (!kq_type(type)) { /* the 16 rows' d (and m) of a block by one gather (rows past n: zeros) */
        __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32((int)w->row_bytes));
        __mmask16 valid = (__mmask16)((1u << n) - 1);
        for (int b = 0; b < nb; b++) {
            float *dw = (float *)(dst + (int64_t)b * pb + 512);
            __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, idx, base + (int64_t)b * bb, 1);
            _mm512_storeu_ps(dw, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)));
            if (has_m) _mm512_storeu_ps(dw + 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16))));
        }
    }
    for (int r = 0; r < 16; r++) {
        const uint8_t *row = base + (int64_t)r * w->row_bytes;
        if (r >= n) {
            for (int b = 0; b < nb; b++) {
                uint8_t *ub = dst + (int64_t)b * pb;
                memset(ub + 32 * r, 0, 32);
                ((float *)(ub + 512))[r] = 0.0f;
                if (has_m) ((float *)(ub + 512))[16 + r] = 0.0f;
            }
            continue;
        }
        if (kq_type(type)) { /* the decode path's SIMD unpacking, narrowed to int8 (|v| <= 31) */
            int16_t kv[nb * QK];
            float kd[nb], km[nb];
            kq_unpack_row(type, row, nb, kv, kd, km);
            for (int b = 0; b < nb; b++) {
                uint8_t *ub = dst + (int64_t)b * pb;
                _mm256_storeu_si256((__m256i *)(ub + 32 * r), _mm512_cvtepi16_epi8(_mm512_loadu_si512(kv + b * QK)));
                ((float *)(ub + 512))[r] = kd[b];
                if (has_m) ((float *)(ub + 512))[16 + r] = km[b];
            }
            continue;
        }
        for (int b = 0; b < nb; b++) {
            const uint8_t *q = row + (int64_t)b * bb + qoff;
            uint8_t *ub = dst + (int64_t)b * pb;
            __m128i t = _mm_loadu_si128((const __m128i *)q), lo, hi;
            if (type == IG_Q8_0) {
                lo = t, hi = _mm_loadu_si128((const __m128i *)(q + 16));
            } else {
                __m128i mask = _mm_set1_epi8(0x0f), off8 = _mm_set1_epi8(type == IG_Q4_0 ? 8 : 0);
                lo = _mm_sub_epi8(_mm_and_si128(t, mask), off8);
                hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(t, 4), mask), off8);
            }
            _mm_storeu_si128((__m128i *)(ub + 32 * r), lo);
            _mm_storeu_si128((__m128i *)(ub + 32 * r + 16), hi);
        }
    }
    __m512i rows32 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(32));
    for (int b = 0; b < nb; b++) {
        uint8_t *ub = dst + (int64_t)b * pb;
        __m512i g[8];
        for (int k = 0; k < 8; k++) g[k] = _mm512_i32gather_epi32(rows32, ub + 4 * k, 1);
        for (int k = 0; k < 8; k++) _mm512_storeu_si512(ub + 64 * k, g[k]);
    }
}

/* Whether a matrix gets a repacked copy: every tile type (Q8_0 too: its bytes are not in VNNI order). */
static int amx_repacks(const ig_mat *w) { return amx_type(w->type); }

int64_t ig_amx_repack_bytes(const ig_mat *w) {
    if (!amx_repacks(w) || w->cols % QK) return 0;
    return (int64_t)(w->rows + 15) / 16 * (w->cols / QK) * amx_pack_bytes(w->type);
}

void ig_amx_repack(const ig_mat *w, uint8_t *out) {
    int64_t strip = (int64_t)(w->cols / QK) * amx_pack_bytes(w->type);
    for (int j0 = 0; j0 < w->rows; j0 += 16)
        amx_fill(w, j0, w->rows - j0 < 16 ? w->rows - j0 : 16, out + j0 / 16 * strip);
}

/* Output rows [j0, j0 + n) of w (n <= 16, j0 a multiple of 16) against activation rows [r0, r1) in
 * groups of M (the config's tile rows): y[r * ldy + off + j]. The weight tiles and scales from
 * w->tiles where the matrix has the repacked copy, else unpacked into ua here. Sums: C[m][j] =
 * row m's block sum with weight row j; scaled per activation row m, 16 weight rows a vector. */
static void amx_strip(const ig_mat *w, int j0, int n, int r0, int r1, int M, float *y, int ldy, int off,
                      uint8_t *ua) {
    int nb = w->cols / QK, pb = amx_pack_bytes(w->type), has_m = amx_has_m(w->type);
    const uint8_t *pk = ua;
    if (w->tiles)
        pk = w->tiles + (int64_t)(j0 / 16) * nb * pb;
    else
        amx_fill(w, j0, n, ua);
    __mmask16 cols = (__mmask16)((1u << n) - 1);
    int32_t cs[4][256] __attribute__((aligned(64)));
    for (int r = r0; r < r1; r += M) {
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        const uint8_t *xp = amx_x + (size_t)((r - r0) / 16) * nb * (1024 + 128) + ((r - r0) % 16) * 32;
        const float *xdp = (const float *)(amx_x + (size_t)((r - r0) / 16) * nb * (1024 + 128) + 1024) + (r - r0) % 16;
#define ISSUE(b, ta, th, tl)                                                            \
    do {                                                                                \
        const uint8_t *xt_ = xp + (size_t)(b) * (1024 + 128);                           \
        _tile_loadd(ta, pk + (int64_t)(b) * pb, 64);                                    \
        _tile_loadd(1, xt_, 32);                                                        \
        _tile_loadd(2, xt_ + 512, 32);                                                  \
        _tile_zero(th);                                                                 \
        _tile_zero(tl);                                                                 \
        _tile_dpbssd(th, 1, ta);                                                        \
        _tile_dpbusd(tl, 2, ta);                                                        \
    } while (0)
#define SCALE(b, chi, clo)                                                                                      \
    do {                                                                                                        \
        const float *xd_ = xdp + (size_t)(b) * (1024 + 128) / 4;                                                \
        const float *dw_ = (const float *)(pk + (int64_t)(b) * pb + 512);                                       \
        __m512 dv = _mm512_loadu_ps(dw_), mv = has_m ? _mm512_loadu_ps(dw_ + 16) : dv;                          \
        _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) {                                                 \
            if (i >= M) break;                                                                                  \
            __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((chi) + 16 * i), 8),               \
                                         _mm512_load_si512((clo) + 16 * i));                                    \
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(xd_[i])), acc[i]); \
            if (has_m) acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xd_[16 + i]), acc[i]);                      \
        }                                                                                                       \
    } while (0)
        ISSUE(0, 0, 3, 4);
        for (int b = 0; b < nb; b += 2) {
            if (b + 1 < nb) ISSUE(b + 1, 7, 5, 6);
            _tile_stored(3, cs[0], 64);
            _tile_stored(4, cs[1], 64);
            SCALE(b, cs[0], cs[1]);
            if (b + 1 < nb) {
                if (b + 2 < nb) ISSUE(b + 2, 0, 3, 4);
                _tile_stored(5, cs[2], 64);
                _tile_stored(6, cs[3], 64);
                SCALE(b + 1, cs[2], cs[3]);
            }
        }
#undef ISSUE
#undef SCALE
        for (int i = 0; i < M && r + i < r1; i++) _mm512_mask_storeu_ps(y + (int64_t)(r + i) * ldy + off + j0, cols, acc[i]);
    }
}

typedef struct amx_kq8 amx_kq8;
static void dot8_sums(const ig_mat *w, int j0, int n, const ig_xblk *x, const char *ahead, float *out,
                      const amx_kq8 *u);

/* tiled_parts' result (and bits) through tile products. Items: (tile of AMX_XT rows, strip of 16
 * output rows of one part), tile by tile; a thread builds a tile's activations about once. */
static void amx_parts(ig_step *st, const ig_mat *parts, int nparts, const ig_xblk *x, int nx, float *y, int ldy) {
    int nb = parts[0].cols / QK, nstrips = 0, ntiles = (nx + AMX_XT - 1) / AMX_XT, built = -1;
    for (int p = 0; p < nparts; p++) nstrips += (parts[p].rows + 15) / 16;
    uint8_t *ua = aligned_alloc(64, (size_t)nb * 640); /* a strip unpacked, where its matrix has no copy */
    int ok = amx_reserve(AMX_XT / 16, nb) && ua;
    int M = nx < 16 ? nx : 16; /* tile rows: a round of fewer rows configures tiles of its size */
    if (ok) amx_config(M);
    FOR_ITEMS(st, ntiles * nstrips, item) {
        int tile = item / nstrips, s = item % nstrips, p = 0, off = 0;
        while (s >= (parts[p].rows + 15) / 16) s -= (parts[p].rows + 15) / 16, off += parts[p++].rows;
        int r0 = tile * AMX_XT, r1 = r0 + AMX_XT < nx ? r0 + AMX_XT : nx, j0 = s * 16;
        int n = parts[p].rows - j0 < 16 ? parts[p].rows - j0 : 16;
        if (!ok) { /* every thread claims items alike: one without buffers does its items on AVX2, same bits */
            for (int r = r0; r < r1; r++)
                for (int k = 0; k < n; k += 8) {
                    float o[8];
                    dot8_sums(&parts[p], j0 + k, n - k < 8 ? n - k : 8, x + (int64_t)r * nb, NULL, o, NULL);
                    for (int i = 0; i < 8 && k + i < n; i++) y[(int64_t)r * ldy + off + j0 + k + i] = o[i];
                }
            continue;
        }
        if (tile != built) {
            amx_build_x(x, nb, r0, r1);
            built = tile;
        }
        amx_strip(&parts[p], j0, n, r0, r1, M, y, ldy, off, ua);
    }
    if (ok) _tile_release();
    free(ua);
}

#include "kernels_amx_sums.c" /* sums_parts: one and two rows, the same bits, from the stored bytes */

/* Whether the tiles take a product: the process has them, and every part is a tile type. */
static int amx_usable(const ig_mat *parts, int nparts) {
    if (amx_state != 1) return 0;
    for (int p = 0; p < nparts; p++)
        if (!amx_type(parts[p].type)) return 0;
    return 1;
}
