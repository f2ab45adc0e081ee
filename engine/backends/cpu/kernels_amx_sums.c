/* The amx build's products of one and two rows (#included by kernels_amx.c): AVX2 block sums with
 * the tiles' bits, from the stored bytes (one lane streams the weights; it does not read the copy). */

/* 8 weight rows of a kernels_kquants.c type unpacked once for the rows of a decode item: v[k][32 b + i]
 * (int16) and the scales by block, d[8 b + k], m[8 b + k]. */
struct amx_kq8 {
    int16_t *v;
    float *d, *m;
};

static __thread uint8_t *amx_kqbuf;
static __thread size_t amx_kqcap;

/* Rows [j0, j0 + n) of w (n <= 8) into a thread's amx_kq8 (rows past n zeros); 0 if it cannot be had.
 * ahead: the next item's 8 rows, a row's lines fetched while one is unpacked (one lane streams them). */
static int amx_kq_unpack(const ig_mat *w, int j0, int n, const char *ahead, amx_kq8 *u) {
    int nb = w->cols / QK;
    size_t need = (size_t)nb * (8 * QK * 2 + 64);
    if (need > amx_kqcap) {
        free(amx_kqbuf);
        amx_kqbuf = aligned_alloc(64, need);
        amx_kqcap = amx_kqbuf ? need : 0;
    }
    if (!amx_kqbuf) return 0;
    u->v = (int16_t *)amx_kqbuf, u->d = (float *)(amx_kqbuf + (size_t)nb * 8 * QK * 2), u->m = u->d + 8 * nb;
    float kd[nb], km[nb];
    for (int k = 0; k < 8; k++) {
        int16_t *v = u->v + (int64_t)k * nb * QK;
        if (ahead)
            for (int64_t c = 0; c < w->row_bytes; c += 64) _mm_prefetch(ahead + k * w->row_bytes + c, _MM_HINT_T0);
        if (k < n)
            kq_unpack_row(w->type, w->data + (int64_t)(j0 + k) * w->row_bytes, nb, v, kd, km);
        else
            memset(v, 0, sizeof(int16_t) * nb * QK), memset(kd, 0, sizeof kd), memset(km, 0, sizeof km);
        for (int b = 0; b < nb; b++) u->d[8 * b + k] = kd[b], u->m[8 * b + k] = km[b];
    }
    return 1;
}

/* Decode rows below amx_min_rows, with the same bits (each row alone): one activation row against 8
 * weight rows [j0, j0 + n) of w at a time, the 8 block sums reduced exactly (vphaddd) into one
 * vector, then f = fma(float(isum), d * x.d, f) and with an offset f = fma(m, x.s, f), as the tiles
 * do. The kernels_kquants.c types read u (amx_kq8), or without it (no buffer) kq_unpack block by block:
 * the same integers and scales. */
/* R (1 or 2, a constant) activation rows x and x2 at once, sharing each weight block's unpacking; the
 * same operations per (weight row, activation row) as R = 1, so the same bits. */
static inline __attribute__((always_inline)) void dot8_t(const int kq, const int R, const ig_mat *w, int j0, int n,
                                                         const ig_xblk *x, const ig_xblk *x2, const char *ahead,
                                                         float *out, float *out2, const amx_kq8 *u) {
    int nb = w->cols / QK, type = w->type, bb = block_bytes(type), qoff = type == IG_Q4_1 ? 4 : 2;
    int has_m = amx_has_m(type);
    const uint8_t *base = w->data + (int64_t)j0 * w->row_bytes;
    __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0),
                                     _mm512_set1_epi32((int)w->row_bytes));
    __mmask16 valid = (__mmask16)((1u << n) - 1);
    __m256i eight = _mm256_set1_epi16(type == IG_Q4_0 ? 8 : 0);
    __m256 f = _mm256_setzero_ps(), f2 = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const ig_xblk *xb = x + b, *xb2 = R == 2 ? x2 + b : xb;
        if (ahead && !kq) /* the next 8 rows, a block of each, while these are dotted (one lane streams the weights) */
            for (int k = 0; k < 8; k++) _mm_prefetch(ahead + k * w->row_bytes + (int64_t)b * bb, _MM_HINT_T0);
        __m256i x0 = _mm256_loadu_si256((const __m256i *)xb->q), x1 = _mm256_loadu_si256((const __m256i *)(xb->q + 16));
        __m256i y0 = _mm256_loadu_si256((const __m256i *)xb2->q), y1 = _mm256_loadu_si256((const __m256i *)(xb2->q + 16));
        __m256i p[8], p2[8];
        float kd[8] __attribute__((aligned(32))), km[8] __attribute__((aligned(32)));
        for (int k = 0; k < 8; k++) {
            if (k >= n) {
                p[k] = p2[k] = _mm256_setzero_si256();
                if (kq) kd[k] = km[k] = 0.0f;
                continue;
            }
            __m256i lo, hi;
            if (kq && u) {
                const int16_t *v = u->v + ((int64_t)k * nb + b) * QK;
                lo = _mm256_loadu_si256((const __m256i *)v), hi = _mm256_loadu_si256((const __m256i *)(v + 16));
            } else if (kq) {
                int16_t v[QK];
                kq_unpack(type, base + (int64_t)k * w->row_bytes, b, v, kd + k, km + k);
                lo = _mm256_loadu_si256((const __m256i *)v), hi = _mm256_loadu_si256((const __m256i *)(v + 16));
            } else {
                unpack_block(type, base + (int64_t)k * w->row_bytes + (int64_t)b * bb + qoff, &lo, &hi);
                lo = _mm256_sub_epi16(lo, eight), hi = _mm256_sub_epi16(hi, eight);
            }
            p[k] = _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
            if (R == 2) p2[k] = _mm256_add_epi32(_mm256_madd_epi16(lo, y0), _mm256_madd_epi16(hi, y1));
        }
#define REDUCE8(p)                                                                                              \
    _mm256_add_epi32(                                                                                           \
        _mm256_permute2x128_si256(_mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3])), \
                                  _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7])), \
                                  0x20),                                                                        \
        _mm256_permute2x128_si256(_mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3])), \
                                  _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7])), \
                                  0x31))
        __m256i isum = REDUCE8(p), isum2 = R == 2 ? REDUCE8(p2) : isum;
#undef REDUCE8
        __m256 d, m = _mm256_setzero_ps();
        if (kq) {
            d = u ? _mm256_loadu_ps(u->d + 8 * b) : _mm256_load_ps(kd);
            m = u ? _mm256_loadu_ps(u->m + 8 * b) : _mm256_load_ps(km);
        } else {
            __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, idx, base + (int64_t)b * bb, 1);
            d = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm512_cvtepi32_epi16(g)));
            if (has_m) m = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))));
        }
        f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(xb->d)), f);
        if (has_m) f = _mm256_fmadd_ps(m, _mm256_set1_ps(xb->s), f);
        if (R == 2) {
            f2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum2), _mm256_mul_ps(d, _mm256_set1_ps(xb2->d)), f2);
            if (has_m) f2 = _mm256_fmadd_ps(m, _mm256_set1_ps(xb2->s), f2);
        }
    }
    _mm256_storeu_ps(out, f);
    if (R == 2) _mm256_storeu_ps(out2, f2);
}

static void dot8_sums(const ig_mat *w, int j0, int n, const ig_xblk *x, const char *ahead, float *out,
                      const amx_kq8 *u) {
    if (kq_type(w->type))
        dot8_t(1, 1, w, j0, n, x, x, ahead, out, out, u);
    else
        dot8_t(0, 1, w, j0, n, x, x, ahead, out, out, NULL);
}

/* Two rows at once (the weights unpacked once for both). */
static void dot8_pair(const ig_mat *w, int j0, int n, const ig_xblk *x, const ig_xblk *x2, const char *ahead,
                      float *out, float *out2, const amx_kq8 *u) {
    if (kq_type(w->type))
        dot8_t(1, 2, w, j0, n, x, x2, ahead, out, out2, u);
    else
        dot8_t(0, 2, w, j0, n, x, x2, ahead, out, out2, NULL);
}

/* The decode product below amx_min_rows: items are 8 weight rows of one part against every row. */
static void sums_parts(ig_step *st, const ig_mat *parts, int nparts, const ig_xblk *x, int nx, float *y, int ldy) {
    int nb = parts[0].cols / QK, nitems = 0;
    for (int p = 0; p < nparts; p++) nitems += (parts[p].rows + 7) / 8;
    FOR_ITEMS(st, nitems, item) {
        int s = item, p = 0, off = 0;
        while (s >= (parts[p].rows + 7) / 8) s -= (parts[p].rows + 7) / 8, off += parts[p++].rows;
        const ig_mat *w = &parts[p];
        int j0 = s * 8, n = w->rows - j0 < 8 ? w->rows - j0 : 8;
        const char *ahead = j0 + 16 <= w->rows ? (const char *)w->data + (int64_t)(j0 + 8) * w->row_bytes : NULL;
        amx_kq8 u;
        int unpacked = kq_type(w->type) && amx_kq_unpack(w, j0, n, ahead, &u);
        for (int r = 0; r < nx; r += 2) {
            float o[16];
            if (r + 1 < nx)
                dot8_pair(w, j0, n, x + (int64_t)r * nb, x + (int64_t)(r + 1) * nb, r == 0 ? ahead : NULL, o, o + 8,
                          unpacked ? &u : NULL);
            else
                dot8_sums(w, j0, n, x + (int64_t)r * nb, r == 0 ? ahead : NULL, o, unpacked ? &u : NULL);
            for (int k = 0; k < n; k++) y[(int64_t)r * ldy + off + j0 + k] = o[k];
            if (r + 1 < nx)
                for (int k = 0; k < n; k++) y[(int64_t)(r + 1) * ldy + off + j0 + k] = o[8 + k];
        }
    }
}
