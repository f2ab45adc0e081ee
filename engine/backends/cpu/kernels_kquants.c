/* Block types beyond Q8_0 / Q4_0 / Q4_1, kept as stored (#included by kernels.c, after h2f and rd16).
 *
 * Q5_0, Q5_1: blocks of 32 (d [, m], 32 high bits qh, 16 bytes of low nibbles).
 * Q4_K, Q5_K, Q6_K: super-blocks of 256 values, read as 8 sub-blocks of 32, so every type meets the
 * activations' 32-blocks (ig_xblk) the way Q4_1 does. docs/QUANT.md has the layouts; in short:
 *   Q4_K (144 B): d, dmin, 12 bytes of 6-bit scales sc_j and mins m_j, 128 bytes of nibbles;
 *                 weight = d*sc_j * q - dmin*m_j, q in 0..15 (Q4_1-like with a negative min).
 *   Q5_K (176 B): as Q4_K plus 32 bytes of high bits (bit j of byte i: sub-block j, element i).
 *   Q6_K (210 B): 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 values),
 *                 d last; weight = d * sc_g * (q - 32).
 * A 32-block b of a row comes out as 32 integers v with a float scale d and offset m,
 * weight i = d * v[i] + m, so a product is d * x.d * sum(v * x.q) + m * x.s. Q6_K's two scales a
 * block go into v (v = (q - 32) * sc: |v| <= 4096, exact in int16), leaving d the super-block's.
 * Every d and m is exact in float (an 11-bit half times a 6-bit integer), so the dequantized
 * weights equal gguf's bit for bit. */

static inline int kq_type(int type) {
    return type == IG_Q5_0 || type == IG_Q5_1 || type == IG_Q4_K || type == IG_Q5_K || type == IG_Q6_K;
}

/* Bytes of a Q5 block (32 values) or a K-quant super-block (256 values). */
static inline int kq_bytes(int type) {
    switch (type) {
    case IG_Q5_0: return 22;
    case IG_Q5_1: return 24;
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

/* Block b of a row (portable; the tiled kernel's unpacking and dequantization): v, d, m as above.
 * Q5_0's v is unsigned (0..31) with m = -16 d, as Q4_0's -8 in the decode path. */
static void kq_unpack(int type, const uint8_t *row, int b, int16_t *v, float *d, float *m) {
    if (type == IG_Q5_0 || type == IG_Q5_1) {
        const uint8_t *p = row + (int64_t)b * kq_bytes(type), *qh = p + (type == IG_Q5_0 ? 2 : 4), *qs = qh + 4;
        uint32_t h = qh[0] | qh[1] << 8 | qh[2] << 16 | (uint32_t)qh[3] << 24;
        *d = h2f(rd16(p));
        *m = type == IG_Q5_0 ? -16.0f * *d : h2f(rd16(p + 2));
        for (int i = 0; i < 16; i++) {
            v[i] = (int16_t)((qs[i] & 15) | ((h >> i) & 1) << 4);
            v[i + 16] = (int16_t)((qs[i] >> 4) | ((h >> (i + 16)) & 1) << 4);
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
/* A K-quant super-block's 8 sub-block scales and offsets, decoded once when its first block is met. */
typedef struct {
    float d[8], m[8];
} kq_scales;

static inline void kq_decode_scales(int type, const uint8_t *p, kq_scales *ks) {
    if (type == IG_Q6_K) {
        float d = _cvtsh_ss(rd16(p + 208));
        for (int j = 0; j < 8; j++) ks->d[j] = d, ks->m[j] = 0.0f;
        return;
    }
    float d = _cvtsh_ss(rd16(p)), dmin = _cvtsh_ss(rd16(p + 2));
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        kq_scale_min(p + 4, j, &sc, &mn);
        ks->d[j] = d * (float)sc;
        ks->m[j] = -(dmin * (float)mn);
    }
}

static inline __m256i kq_join(__m128i lo, __m128i hi) { return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1); }

/* Block b of a row (AVX2 decode path): its 32 weights as int16 in lo (elements 0..15) and hi
 * (16..31), d and m as kq_unpack's. Blocks must come in order from b = 0 (K-quant scales). */
static inline __attribute__((always_inline)) void kq_fetch(int type, const uint8_t *row, int b, kq_scales *ks,
                                                           __m256i *lo, __m256i *hi, float *d, float *m) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i v;
    if (type == IG_Q5_0 || type == IG_Q5_1) {
        const uint8_t *p = row + (int64_t)b * kq_bytes(type), *qh = p + (type == IG_Q5_0 ? 2 : 4);
        *d = _cvtsh_ss(rd16(p));
        *m = type == IG_Q5_0 ? -16.0f * *d : _cvtsh_ss(rd16(p + 2));
        int32_t h;
        memcpy(&h, qh, 4);
        __m128i t = _mm_loadu_si128((const __m128i *)(qh + 4));
        /* bit i of h to byte i (0x10 where set): byte i holds h's byte i / 8, tested against bit i % 8 */
        const __m256i sel = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        __m256i bytes = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(h), sel), bit);
        __m256i hb = _mm256_and_si256(_mm256_cmpeq_epi8(bytes, bit), _mm256_set1_epi8(0x10));
        v = _mm256_or_si256(_mm256_and_si256(kq_join(t, _mm_srli_epi16(t, 4)), m4), hb);
    } else {
        int j = b & 7;
        const uint8_t *p = row + (int64_t)(b >> 3) * kq_bytes(type);
        if (j == 0) kq_decode_scales(type, p, ks);
        *d = ks->d[j];
        *m = ks->m[j];
        if (type == IG_Q6_K) {
            int h = j >> 2, k = j & 3;
            __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32 * (k & 1)));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
            ql = _mm256_and_si256(k >> 1 ? _mm256_srli_epi16(ql, 4) : ql, m4);
            qh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
            v = _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)), _mm256_set1_epi8(32));
            const int8_t *sc = (const int8_t *)(p + 192) + 2 * j;
            *lo = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)), _mm256_set1_epi16(sc[0]));
            *hi = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)), _mm256_set1_epi16(sc[1]));
            return;
        }
        __m256i t = _mm256_loadu_si256((const __m256i *)(p + (type == IG_Q4_K ? 16 : 48) + 32 * (j >> 1)));
        v = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(t, 4) : t, m4);
        if (type == IG_Q5_K) {
            __m256i qh = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(p + 16)), _mm_cvtsi32_si128(j));
            v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(1)), 4));
        }
    }
    *lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v));
    *hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1));
}
#endif
