/* AMX-INT8 weight products (the amx build; #included from kernels.c where IG_AMX is set).
 *
 * The same bits as the AVX2 decode path (dot_group / dot_rows). There, a (block, row) pair's
 * integer sum is kept as 8 partial sums ("lanes": lane i holds weights k = 2i, 2i+1, 16+2i,
 * 17+2i), each scaled into its own float accumulator, and the 8 accumulators are added at
 * the end in hsum's order. A tile product gives whole sums, so the lanes are made separate
 * outputs: tile B holds two activation rows x 8 lanes as its 16 columns, column (row, i)
 * keeping only lane i's activations (zeros elsewhere). Tile A is 16 weight rows of one
 * block as int8 (Q8_0 straight from the stored rows; Q4 nibbles unpacked to 0..15, the -8
 * of Q4_0 stays in the offset term as in dot_rows). Activations are int16: hi = q >> 8
 * (signed) and lo = q & 255 (unsigned) are two tiles, TDPBSSD and TDPBSUD give their sums,
 * and isum = 256 * hi + lo is the decode path's integer exactly. Then per C row (weight
 * row): acc = fma(d * x.d, float(isum), acc) over blocks, per lane, and at the end
 * out = hsum(lanes) + sum of m * x.s (fma over blocks), as dot_group does.
 *
 * Tiles: 0 weights (16 x 32 B), 1 and 2 activations hi / lo (8 x 64 B), 3 and 4 the int32
 * sums (16 x 64 B). Each thread loads the config before its first tile instruction and
 * releases the tiles at the end of the product. */
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_XT 32 /* activation rows a tile of items (16 row pairs) */

static int amx_state = 0; /* 0 untried, 1 usable, -1 refused */
static int amx_min_rows = 0; /* decode products of at least this many rows go through AMX; 0: never (slower, see docs/CPU.md) */

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

void ig_amx_rows(int rows) { amx_min_rows = rows; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

static void amx_config(void) {
    amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = 16, c.colsb[0] = 32;
    c.rows[1] = 8, c.colsb[1] = 64;
    c.rows[2] = 8, c.colsb[2] = 64;
    c.rows[3] = 16, c.colsb[3] = 64;
    c.rows[4] = 16, c.colsb[4] = 64;
    _tile_loadconfig(&c);
}

/* A thread's activation tiles: per row pair and block, hi then lo (512 B each), then the
 * pair's scales xd2[16] (row 0's d x 8, row 1's d x 8) and sums xs[2]. Kept between products
 * (a thread of the pool lives on): only the nonzero bytes of each tile are written, always
 * the same positions, so the zeros of a fresh (calloc) buffer stay zeros. */
static __thread uint8_t *amx_x;
static __thread size_t amx_xcap;
static __thread float *amx_sc;
static __thread size_t amx_sccap;

static int amx_reserve(int pairs, int nb) {
    size_t need = (size_t)pairs * nb * 1024, sneed = (size_t)pairs * nb * 18 * sizeof(float);
    if (need > amx_xcap) {
        free(amx_x);
        amx_x = aligned_alloc(64, need);
        amx_xcap = amx_x ? need : 0;
        if (!amx_x) return 0;
        memset(amx_x, 0, need);
    }
    if (sneed > amx_sccap) {
        free(amx_sc);
        amx_sc = malloc(sneed);
        amx_sccap = amx_sc ? sneed : 0;
        if (!amx_sc) return 0;
    }
    return 1;
}

/* Tile B of group g (k 4g..4g+3): column (row mm, lane i) holds the bytes of lane i only. Lane of
 * k is (k & 15) >> 1, so group g feeds lanes 2(g & 3) (k 4g, 4g+1) and 2(g & 3) + 1 (k 4g+2, 4g+3):
 * row g has 8 nonzero bytes per activation row, at 64 g + 4 (8 mm + 2 (g & 3)): x0 x1 0 0 0 0 x2 x3. */
static void amx_build_x(const ig_xblk *x, int nb, int r0, int r1) {
    for (int p = 0; p < (r1 - r0 + 1) / 2; p++)
        for (int b = 0; b < nb; b++) {
            uint8_t *hi = amx_x + ((size_t)p * nb + b) * 1024, *lo = hi + 512;
            float *sc = amx_sc + ((size_t)p * nb + b) * 18;
            for (int mm = 0; mm < 2; mm++) {
                int r = r0 + 2 * p + mm;
                const ig_xblk *xb = r < r1 ? x + (int64_t)r * nb + b : NULL;
                for (int g = 0; g < 8; g++) {
                    uint64_t vh = 0, vl = 0;
                    if (xb) {
                        const int16_t *q = xb->q + 4 * g;
                        vh = (uint64_t)(uint8_t)(q[0] >> 8) | (uint64_t)(uint8_t)(q[1] >> 8) << 8 |
                             (uint64_t)(uint8_t)(q[2] >> 8) << 48 | (uint64_t)(uint8_t)(q[3] >> 8) << 56;
                        vl = (uint64_t)(uint8_t)q[0] | (uint64_t)(uint8_t)q[1] << 8 | (uint64_t)(uint8_t)q[2] << 48 |
                             (uint64_t)(uint8_t)q[3] << 56;
                    }
                    int o = 64 * g + 4 * (8 * mm + 2 * (g & 3));
                    memcpy(hi + o, &vh, 8);
                    memcpy(lo + o, &vl, 8);
                }
                for (int i = 0; i < 8; i++) sc[8 * mm + i] = xb ? xb->d : 0.0f;
                sc[16 + mm] = xb ? xb->s : 0.0f;
            }
        }
}

/* Output rows [j0, j0 + 16) of w (n valid) against activation rows [r0, r1): y[r * ldy + off + j]. */
static void amx_strip(const ig_mat *w, int j0, int n, int r0, int r1, float *y, int ldy, int off, int8_t *ua,
                      float *dw, float *mw) {
    int nb = w->cols / QK, type = w->type, bb = block_bytes(type), qoff = type == IG_Q4_1 ? 4 : 2;
    const uint8_t *base = w->data + (int64_t)j0 * w->row_bytes;
    int direct = type == IG_Q8_0 && n == 16; /* tile A straight from the stored rows */
    __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm512_set1_epi32((int)w->row_bytes));
    __mmask16 valid = (__mmask16)((1u << n) - 1);
    for (int b = 0; b < nb; b++) { /* scales (and unpacked weights) of the strip, by block */
        __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, idx, base + (int64_t)b * bb, 1);
        __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
        __m512 m = type == IG_Q4_1   ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)))
                   : type == IG_Q4_0 ? _mm512_mul_ps(_mm512_set1_ps(-8.0f), d)
                                     : _mm512_setzero_ps();
        _mm512_storeu_ps(dw + b * 16, d);
        _mm512_storeu_ps(mw + b * 16, m);
        if (direct) continue;
        int8_t *ub = ua + b * 512;
        for (int r = 0; r < 16; r++) {
            if (r >= n) {
                memset(ub + 32 * r, 0, 32);
                continue;
            }
            const uint8_t *q = base + (int64_t)r * w->row_bytes + (int64_t)b * bb + qoff;
            __m128i t = _mm_loadu_si128((const __m128i *)q);
            if (type == IG_Q8_0) {
                _mm_storeu_si128((__m128i *)(ub + 32 * r), t);
                _mm_storeu_si128((__m128i *)(ub + 32 * r + 16), _mm_loadu_si128((const __m128i *)(q + 16)));
            } else {
                __m128i mask = _mm_set1_epi8(0x0f);
                _mm_storeu_si128((__m128i *)(ub + 32 * r), _mm_and_si128(t, mask));
                _mm_storeu_si128((__m128i *)(ub + 32 * r + 16), _mm_and_si128(_mm_srli_epi16(t, 4), mask));
            }
        }
    }
    int32_t chi[256] __attribute__((aligned(64))), clo[256] __attribute__((aligned(64)));
    for (int p = 0; p < (r1 - r0 + 1) / 2; p++) {
        __m512 acc[16], ex0 = _mm512_setzero_ps(), ex1 = _mm512_setzero_ps();
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *xt = amx_x + ((size_t)p * nb + b) * 1024;
            const float *sc = amx_sc + ((size_t)p * nb + b) * 18;
            if (direct)
                _tile_loadd(0, base + (int64_t)b * bb + 2, w->row_bytes);
            else
                _tile_loadd(0, ua + b * 512, 32);
            _tile_loadd(1, xt, 64);
            _tile_loadd(2, xt + 512, 64);
            _tile_zero(3);
            _tile_zero(4);
            _tile_dpbssd(3, 0, 1);
            _tile_dpbsud(4, 0, 2);
            _tile_stored(3, chi, 64);
            _tile_stored(4, clo, 64);
            __m512 xd2 = _mm512_loadu_ps(sc);
            ex0 = _mm512_fmadd_ps(_mm512_loadu_ps(mw + b * 16), _mm512_set1_ps(sc[16]), ex0);
            ex1 = _mm512_fmadd_ps(_mm512_loadu_ps(mw + b * 16), _mm512_set1_ps(sc[17]), ex1);
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) {
                __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(chi + 16 * i), 8),
                                             _mm512_load_si512(clo + 16 * i));
                __m512 sci = _mm512_mul_ps(xd2, _mm512_set1_ps(dw[b * 16 + i]));
                acc[i] = _mm512_fmadd_ps(sci, _mm512_cvtepi32_ps(s), acc[i]);
            }
        }
        float a[16][16] __attribute__((aligned(64))), e[2][16];
        for (int i = 0; i < 16; i++) _mm512_store_ps(a[i], acc[i]);
        _mm512_storeu_ps(e[0], ex0);
        _mm512_storeu_ps(e[1], ex1);
        for (int mm = 0; mm < 2; mm++) {
            int r = r0 + 2 * p + mm;
            if (r >= r1) break;
            for (int i = 0; i < n; i++) {
                const float *l = a[i] + 8 * mm; /* hsum's order */
                y[(int64_t)r * ldy + off + j0 + i] = (((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))) + e[mm][i];
            }
        }
    }
}

/* matmul_parts' result (and bits) through tile products. Items: (tile of AMX_XT rows, strip of
 * 16 output rows of one part), tile by tile; a thread builds a tile's activations about once. */
static void amx_parts(ig_step *st, const ig_mat *parts, int nparts, const ig_xblk *x, int nx, float *y, int ldy) {
    int nb = parts[0].cols / QK, nstrips = 0, ntiles = (nx + AMX_XT - 1) / AMX_XT, built = -1;
    for (int p = 0; p < nparts; p++) nstrips += (parts[p].rows + 15) / 16;
    int ok = amx_reserve(AMX_XT / 2, nb);
    int8_t *ua = aligned_alloc(64, (size_t)nb * 512);
    float *dw = malloc(sizeof(float) * 32 * nb), *mw = dw ? dw + 16 * nb : NULL;
    ok = ok && ua && dw;
    if (ok) amx_config();
    FOR_ITEMS(st, ntiles * nstrips, item) {
        int tile = item / nstrips, s = item % nstrips, p = 0, off = 0;
        while (s >= (parts[p].rows + 15) / 16) s -= (parts[p].rows + 15) / 16, off += parts[p++].rows;
        int r0 = tile * AMX_XT, r1 = r0 + AMX_XT < nx ? r0 + AMX_XT : nx, j0 = s * 16;
        int n = parts[p].rows - j0 < 16 ? parts[p].rows - j0 : 16;
        if (!ok) { /* every thread claims items alike: one without buffers does its items the AVX2 way */
            for (int r = r0; r < r1; r++)
                for (int j = j0; j < j0 + n; j++) {
                    const ig_xblk *xs = x + (int64_t)r * nb;
                    dot_rows(&parts[p], parts[p].data + (int64_t)j * parts[p].row_bytes, &xs, 1,
                             y + (int64_t)r * ldy + off + j);
                }
            continue;
        }
        if (tile != built) {
            amx_build_x(x, nb, r0, r1);
            built = tile;
        }
        amx_strip(&parts[p], j0, n, r0, r1, y, ldy, off, ua, dw, mw);
    }
    if (ok) _tile_release();
    free(ua), free(dw);
}

/* Whether a product of nx rows goes through AMX: the process has the tiles, the row count is at
 * least amx_min_rows, and every part is Q8_0, Q4_0 or Q4_1. */
static int amx_takes(const ig_mat *parts, int nparts, int nx) {
    if (amx_state != 1 || amx_min_rows <= 0 || nx < amx_min_rows) return 0;
    for (int p = 0; p < nparts; p++)
        if (parts[p].type != IG_Q8_0 && parts[p].type != IG_Q4_0 && parts[p].type != IG_Q4_1) return 0;
    return 1;
}
