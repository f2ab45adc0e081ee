/* Block types beyond Q8_0 / Q4_0 / Q4_1, kept as stored (#included by kernels.c, after h2f and rd16).
 *
 * Q5_0, Q5_1: blocks of 32 (d [, m], 32 high bits qh, 16 bytes of low nibbles).
 * Q3_K, Q4_K, Q5_K, Q6_K: super-blocks of 256 values, read as 8 sub-blocks of 32, so every type meets the
 * activations' 32-blocks (ig_xblk) the way Q4_1 does. docs/QUANT.md has the layouts; in short:
 *   Q4_K (144 B): d, dmin, 12 bytes of 6-bit scales sc_j and mins m_j, 128 bytes of nibbles;
 *                 weight = d*sc_j * q - dmin*m_j, q in 0..15 (Q4_1-like with a negative min).
 *   Q5_K (176 B): as Q4_K plus 32 bytes of high bits (bit j of byte i: sub-block j, element i).
 *   Q6_K (210 B): 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 values),
 *                 d last; weight = d * sc_g * (q - 32).
 *   Q3_K (110 B): 32 bytes of high bits (bit j of byte i: sub-block j, element i), 64 of 2-bit lows,
 *                 12 bytes of 6-bit scales (one per 16 values, minus 32), d last;
 *                 weight = d * sc_g * (q - (high bit ? 0 : 4)).
 * A 32-block b of a row comes out as 32 integers v with a float scale d and offset m,
 * weight i = d * v[i] + m, so a product is d * x.d * sum(v * x.q) + m * x.s. Q6_K's two scales a
 * block go into v (v = (q - 32) * sc: |v| <= 4096, exact in int16), leaving d the super-block's; Q3_K's
 * likewise (|v| <= 128).
 * Every d and m is exact in float (an 11-bit half times a 6-bit integer), so the dequantized
 * weights equal gguf's bit for bit. */

static inline int kq_type(int type) {
    return type == IG_Q5_0 || type == IG_Q5_1 || type == IG_Q3_K || type == IG_Q4_K || type == IG_Q5_K ||
           type == IG_Q6_K;
}

/* Bytes of a Q5 block (32 values) or a K-quant super-block (256 values). */
static inline int kq_bytes(int type) {
    switch (type) {
    case IG_Q5_0: return 22;
    case IG_Q5_1: return 24;
    case IG_Q3_K: return 110;
    case IG_Q4_K: return 144;
    case IG_Q5_K: return 176;
    case IG_Q6_K: return 210;
    default: return 0;
    }
}

/* Q4_K / Q5_K sub-block j's 6-bit scale and min from the 12 packed bytes s. */
static inline void kq_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q3_K's 16 scales (minus 32) from the 12 packed bytes s: low 4 bits from s[0..7], high 2 from s[8..11]. */
static inline void kq_q3_scales(const uint8_t *s, int8_t *sc) {
    for (int k = 0; k < 16; k++) {
        int lo = k < 8 ? s[k] & 15 : s[k - 8] >> 4, hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        sc[k] = (int8_t)((lo | hi << 4) - 32);
    }
}

/* Block b of a row (portable; the tiled kernel's unpacking and dequantization): v, d, m as above.
 * Q5_0's v is signed (q - 16, m = 0). */
static void kq_unpack(int type, const uint8_t *row, int b, int16_t *v, float *d, float *m) {
    if (type == IG_Q5_0 || type == IG_Q5_1) {
        const uint8_t *p = row + (int64_t)b * kq_bytes(type), *qh = p + (type == IG_Q5_0 ? 2 : 4), *qs = qh + 4;
        uint32_t h = qh[0] | qh[1] << 8 | qh[2] << 16 | (uint32_t)qh[3] << 24;
        int off = type == IG_Q5_0 ? 16 : 0;
        *d = h2f(rd16(p));
        *m = type == IG_Q5_0 ? 0.0f : h2f(rd16(p + 2));
        for (int i = 0; i < 16; i++) {
            v[i] = (int16_t)(((qs[i] & 15) | ((h >> i) & 1) << 4) - off);
            v[i + 16] = (int16_t)(((qs[i] >> 4) | ((h >> (i + 16)) & 1) << 4) - off);
        }
    } else if (type == IG_Q4_K || type == IG_Q5_K) {
        const uint8_t *p = row + (int64_t)(b / 8) * kq_bytes(type);
        int j = b % 8, sc, mn, shift = 4 * (j & 1);
        kq_scale_min(p + 4, j, &sc, &mn);
        *d = h2f(rd16(p)) * (float)sc;
        *m = -(h2f(rd16(p + 2)) * (float)mn);
        const uint8_t *qs = p + (type == IG_Q4_K ? 16 : 48) + 32 * (j / 2), *qh = p + 16;
        for (int i = 0; i < QK; i++)
            v[i] = (int16_t)(((qs[i] >> shift) & 15) | (type == IG_Q5_K ? ((qh[i] >> j) & 1) << 4 : 0));
    } else if (type == IG_Q3_K) { /* block j: 2-bit lows at shift 2 (j % 4) of bytes 32 (j / 4)..; bit j of hmask */
        const uint8_t *p = row + (int64_t)(b / 8) * 110;
        int j = b % 8;
        int8_t sc[16];
        kq_q3_scales(p + 96, sc);
        const uint8_t *ql = p + 32 + 32 * (j / 4);
        *d = h2f(rd16(p + 108));
        *m = 0.0f;
        for (int i = 0; i < QK; i++)
            v[i] = (int16_t)((((ql[i] >> (2 * (j % 4))) & 3) - (((p[i] >> j) & 1) ? 0 : 4)) * sc[2 * j + i / 16]);
    } else { /* Q6_K: block j is quarter k of half h; its low nibbles, high 2-bit pairs, two scales */
        const uint8_t *p = row + (int64_t)(b / 8) * 210;
        int j = b % 8, h = j / 4, k = j % 4;
        const uint8_t *ql = p + 64 * h + 32 * (k & 1), *qh = p + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(p + 192) + 2 * j;
        *d = h2f(rd16(p + 208));
        *m = 0.0f;
        for (int i = 0; i < QK; i++)
            v[i] = (int16_t)(((((ql[i] >> (4 * (k >> 1))) & 15) | (((qh[i] >> (2 * k)) & 3) << 4)) - 32) * sc[i / 16]);
    }
}

#ifdef IG_AVX2
/* The decode path (dot_rows / dot_group hand these types here): one weight row against G activation
 * rows, specialised by type (T a constant after inlining), K-quant scales decoded once a super-block
 * for all G rows. With tables (tabs: dtab / stab by block, as dot_group's) the G products d * x.d come
 * from one vector multiply and the offsets from one FMA, else per row; the same IEEE operations per
 * row either way, so a row's bits do not depend on its group. */

/* A block's int32 pair sums against a row: lo * x.q[0..15] + hi * x.q[16..31] pairwise (AVX-VNNI adds the
 * second product in the same instruction; the integers, so the bits, are the same). */
#if defined(__AVXVNNI__)
#define KQ_PAIRS(lo, hi, q) _mm256_dpwssd_avx_epi32(_mm256_madd_epi16((lo), _mm256_loadu_si256((const __m256i *)(q))), \
                                                     (hi), _mm256_loadu_si256((const __m256i *)((q) + 16)))
#else
#define KQ_PAIRS(lo, hi, q) _mm256_add_epi32(_mm256_madd_epi16((lo), _mm256_loadu_si256((const __m256i *)(q))), \
                                             _mm256_madd_epi16((hi), _mm256_loadu_si256((const __m256i *)((q) + 16))))
#endif

/* A K-quant super-block's 8 sub-block scales and offsets. */
typedef struct {
    float d[8], m[8];
} kq_scales;

/* Q4_K / Q5_K: kq_scale_min for the 8 sub-blocks at once, 4 bytes a word. */
static inline void kq_decode_scales(const uint8_t *p, kq_scales *ks) {
    uint32_t u0, u1, u2;
    memcpy(&u0, p + 4, 4), memcpy(&u1, p + 8, 4), memcpy(&u2, p + 12, 4);
    uint32_t sc_lo = u0 & 0x3f3f3f3f, sc_hi = (u2 & 0x0f0f0f0f) | ((u0 >> 2) & 0x30303030);
    uint32_t m_lo = u1 & 0x3f3f3f3f, m_hi = ((u2 >> 4) & 0x0f0f0f0f) | ((u1 >> 2) & 0x30303030);
    __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo)));
    __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)m_hi, (int)m_lo)));
    _mm256_storeu_ps(ks->d, _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(rd16(p))), sc));
    /* -(dmin * m): the product is exact, so its negation is kq_unpack's value */
    _mm256_storeu_ps(ks->m, _mm256_mul_ps(_mm256_set1_ps(-_cvtsh_ss(rd16(p + 2))), mn));
}

/* kq_q3_scales 8 bytes at a time: the low 4 bits of scales 0..7 and 8..15 are the nibbles of s[0..7], the
 * high 2 of scale 4 q + i bits 2 q of s[8 + i]. */
static inline void kq_q3_scales_8(const uint8_t *s, int8_t *sc) {
    uint64_t l;
    uint32_t h;
    memcpy(&l, s, 8), memcpy(&h, s + 8, 4);
    const uint64_t m4 = 0x0f0f0f0f0f0f0f0fULL, m2 = 0x0303030303030303ULL;
    uint64_t h01 = ((uint64_t)h & 0x03030303) | (((uint64_t)h >> 2) & 0x03030303) << 32;
    uint64_t h23 = (((uint64_t)h >> 4) & 0x03030303) | (((uint64_t)h >> 6) & 0x03030303) << 32;
    __m128i v = _mm_set_epi64x((long long)((l >> 4 & m4) | (h23 & m2) << 4), (long long)((l & m4) | (h01 & m2) << 4));
    _mm_storeu_si128((__m128i *)sc, _mm_sub_epi8(v, _mm_set1_epi8(32)));
}

/* Block b's 32 weights (lo: elements 0..15, hi: 16..31, int16, scale *dp, offset m) met by the G rows;
 * has_m (a constant): the type has offsets (Q5_0 and Q6_K have none, and an FMA by m = 0 is not free).
 * The scales d * x.d come from two broadcast loads and a multiply: no shuffle-port work (that port,
 * busy with the unpacking, is what one row waits on). */
static inline __attribute__((always_inline)) void kq_rows(__m256i lo, __m256i hi, const float *dp, float m, int has_m, int b,
                                                          const ig_xblk *const *x, const float *dtab,
                                                          const float *stab, int tabs, int G, __m256 *acc,
                                                          float *ex, __m256 *exv) {
    float sc[8] __attribute__((aligned(32)));
    if (tabs) {
        __m256 xd = G == 8 ? _mm256_loadu_ps(dtab + b * 8) : _mm256_zextps128_ps256(_mm_loadu_ps(dtab + b * 4));
        __m256 xs = G == 8 ? _mm256_loadu_ps(stab + b * 8) : _mm256_zextps128_ps256(_mm_loadu_ps(stab + b * 4));
        _mm256_store_ps(sc, _mm256_mul_ps(xd, _mm256_broadcast_ss(dp)));
        if (has_m) *exv = _mm256_fmadd_ps(_mm256_set1_ps(m), xs, *exv);
    }
    for (int r = 0; r < G; r++) {
        const ig_xblk *xb = x[r] + b;
        __m256i p = KQ_PAIRS(lo, hi, xb->q);
        __m256 s = tabs ? _mm256_broadcast_ss(sc + r) : _mm256_mul_ps(_mm256_broadcast_ss(dp), _mm256_broadcast_ss(&xb->d));
        acc[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(p), acc[r]);
        if (!tabs && has_m) ex[r] = fmaf(m, xb->s, ex[r]);
    }
}

static inline __m256i kq_join(__m128i lo, __m128i hi) { return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1); }

/* 32 unsigned bytes as elements 0..15 and 16..31 in int16. */
#define KQ_WIDEN_U8(v, lo, hi)                                                                              \
    ((lo) = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), (hi) = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)))

/* Block b's weights, scale and offset: met by the G rows, or (vout non-NULL, a constant) stored for the
 * tiled kernel's strips. */
#define KQ_EMIT(dp, m, has_m, b)                                                                           \
    do {                                                                                                  \
        if (vout) {                                                                                       \
            _mm256_storeu_si256((__m256i *)(vout + (int64_t)(b) * QK), lo);                               \
            _mm256_storeu_si256((__m256i *)(vout + (int64_t)(b) * QK + 16), hi);                          \
            dout[b] = *(dp), mout[b] = (m);                                                               \
        } else {                                                                                          \
            kq_rows(lo, hi, dp, m, has_m, b, x, dtab, stab, tabs, G, acc, ex, &exv);                      \
        }                                                                                                 \
    } while (0)

static inline __attribute__((always_inline)) void kq_dot_t(const int T, const uint8_t *row, int nb,
                                                           const ig_xblk *const *x, const float *dtab,
                                                           const float *stab, int tabs, int G, float *out,
                                                           int16_t *vout, float *dout, float *mout) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[8], exv = _mm256_setzero_ps();
    float ex[8] __attribute__((aligned(32)));
    __m256i lo, hi;
    for (int r = 0; r < G; r++) acc[r] = _mm256_setzero_ps(), ex[r] = 0.0f;
    if (T == IG_Q5_0 || T == IG_Q5_1) {
        /* bit i of qh to byte i (0x10 where set): byte i holds qh's byte i / 8, tested against bit i % 8 */
        const __m256i sel = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i b16 = _mm256_set1_epi8(0x10), neg16 = _mm256_set1_epi8(-16);
        for (int b = 0; b < nb; b++) {
            const uint8_t *p = row + (int64_t)b * kq_bytes(T), *qh = p + (T == IG_Q5_0 ? 2 : 4);
            float d = _cvtsh_ss(rd16(p));
            float m = T == IG_Q5_0 ? 0.0f : _cvtsh_ss(rd16(p + 2));
            __m256i h = _mm256_castps_si256(_mm256_broadcast_ss((const float *)qh)); /* the 32 bits, each lane */
            __m128i t = _mm_loadu_si128((const __m128i *)(qh + 4));
            __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(h, sel), bit), bit);
            __m256i v = _mm256_and_si256(kq_join(t, _mm_srli_epi16(t, 4)), m4);
            if (T == IG_Q5_0) { /* q - 16 = nibble - (high bit clear ? 16 : 0) */
                v = _mm256_add_epi8(v, _mm256_andnot_si256(set, neg16));
                lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
                hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
            } else {
                v = _mm256_or_si256(v, _mm256_and_si256(set, b16));
                KQ_WIDEN_U8(v, lo, hi);
            }
            KQ_EMIT(&d, m, T == IG_Q5_1, b);
        }
    } else {
        for (int sb = 0; sb < nb / 8; sb++) {
            const uint8_t *p = row + (int64_t)sb * kq_bytes(T);
            if (T == IG_Q3_K) { /* block j = 4 h + k: the 2-bit lows of bytes 32 h.. at shift 2 k, bit j of hmask */
                int8_t sc[16];
                kq_q3_scales_8(p + 96, sc);
                float d = _cvtsh_ss(rd16(p + 108));
                __m256i hm = _mm256_loadu_si256((const __m256i *)p);
                for (int h = 0; h < 2; h++) {
                    __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 32 + 32 * h));
                    for (int k = 0; k < 4; k++) {
                        int j = 4 * h + k;
                        __m256i q = _mm256_and_si256(ql, _mm256_set1_epi8(3)); /* ql, hm shifted as they are used */
                        __m256i hb = _mm256_slli_epi16(_mm256_and_si256(hm, _mm256_set1_epi8(1)), 2);
                        ql = _mm256_srli_epi16(ql, 2), hm = _mm256_srli_epi16(hm, 1);
                        __m256i v = _mm256_sub_epi8(_mm256_or_si256(q, hb), _mm256_set1_epi8(4));
                        lo = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)),
                                                _mm256_set1_epi16(sc[2 * j]));
                        hi = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)),
                                                _mm256_set1_epi16(sc[2 * j + 1]));
                        KQ_EMIT(&d, 0.0f, 0, sb * 8 + j);
                    }
                }
            } else if (T == IG_Q6_K) { /* block j = 4 h + k: quarter k of half h */
                const int8_t *sc = (const int8_t *)(p + 192);
                float d = _cvtsh_ss(rd16(p + 208));
                for (int h = 0; h < 2; h++) {
                    __m256i ql2[2] = {_mm256_loadu_si256((const __m256i *)(p + 64 * h)),
                                      _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32))};
                    __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
                    for (int k = 0; k < 4; k++) {
                        int j = 4 * h + k;
                        __m256i ql = _mm256_and_si256(k >> 1 ? _mm256_srli_epi16(ql2[k & 1], 4) : ql2[k & 1], m4);
                        __m256i q2 = _mm256_and_si256(qh, _mm256_set1_epi8(3)); /* qh shifted 2 bits a quarter */
                        qh = _mm256_srli_epi16(qh, 2);
                        __m256i v = _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(q2, 4)), _mm256_set1_epi8(32));
                        lo = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)),
                                                _mm256_set1_epi16(sc[2 * j]));
                        hi = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)),
                                                _mm256_set1_epi16(sc[2 * j + 1]));
                        KQ_EMIT(&d, 0.0f, 0, sb * 8 + j);
                    }
                }
            } else { /* Q4_K, Q5_K: sub-blocks 2c and 2c + 1 are the low and high nibbles of 32 bytes */
                kq_scales ks;
                kq_decode_scales(p, &ks);
                __m256i qh = T == IG_Q5_K ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    __m256i t = _mm256_loadu_si256((const __m256i *)(p + (T == IG_Q4_K ? 16 : 48) + 32 * c));
                    for (int half = 0; half < 2; half++) {
                        int j = 2 * c + half;
                        __m256i v = _mm256_and_si256(half ? _mm256_srli_epi16(t, 4) : t, m4);
                        if (T == IG_Q5_K) { /* bit j of each byte: qh is shifted one bit a sub-block */
                            v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(1)), 4));
                            qh = _mm256_srli_epi16(qh, 1);
                        }
                        KQ_WIDEN_U8(v, lo, hi);
                        KQ_EMIT(ks.d + j, ks.m[j], 1, sb * 8 + j);
                    }
                }
            }
        }
    }
    if (vout) return;
    if (tabs) _mm256_store_ps(ex, exv);
    for (int r = 0; r < G; r++) out[r] = hsum(acc[r]) + ex[r];
}

/* dot_rows (tabs 0) and dot_group (tabs 1) for the types here. */
static inline __attribute__((always_inline)) void kq_dot(int type, const uint8_t *row, int nb, const ig_xblk *const *x,
                                                         const float *dtab, const float *stab, int tabs, int G,
                                                         float *out) {
    switch (type) {
    case IG_Q5_0: kq_dot_t(IG_Q5_0, row, nb, x, dtab, stab, tabs, G, out, NULL, NULL, NULL); break;
    case IG_Q5_1: kq_dot_t(IG_Q5_1, row, nb, x, dtab, stab, tabs, G, out, NULL, NULL, NULL); break;
    case IG_Q3_K: kq_dot_t(IG_Q3_K, row, nb, x, dtab, stab, tabs, G, out, NULL, NULL, NULL); break;
    case IG_Q4_K: kq_dot_t(IG_Q4_K, row, nb, x, dtab, stab, tabs, G, out, NULL, NULL, NULL); break;
    case IG_Q5_K: kq_dot_t(IG_Q5_K, row, nb, x, dtab, stab, tabs, G, out, NULL, NULL, NULL); break;
    default: kq_dot_t(IG_Q6_K, row, nb, x, dtab, stab, tabs, G, out, NULL, NULL, NULL); break;
    }
}

/* A row's nb blocks as kq_unpack gives them (v[32 b + i], d[b], m[b]), by the decode path's unpacking. */
static void kq_unpack_row(int type, const uint8_t *row, int nb, int16_t *v, float *d, float *m) {
    switch (type) {
    case IG_Q5_0: kq_dot_t(IG_Q5_0, row, nb, NULL, NULL, NULL, 0, 1, NULL, v, d, m); break;
    case IG_Q5_1: kq_dot_t(IG_Q5_1, row, nb, NULL, NULL, NULL, 0, 1, NULL, v, d, m); break;
    case IG_Q3_K: kq_dot_t(IG_Q3_K, row, nb, NULL, NULL, NULL, 0, 1, NULL, v, d, m); break;
    case IG_Q4_K: kq_dot_t(IG_Q4_K, row, nb, NULL, NULL, NULL, 0, 1, NULL, v, d, m); break;
    case IG_Q5_K: kq_dot_t(IG_Q5_K, row, nb, NULL, NULL, NULL, 0, 1, NULL, v, d, m); break;
    default: kq_dot_t(IG_Q6_K, row, nb, NULL, NULL, NULL, 0, 1, NULL, v, d, m); break;
    }
}
#endif
