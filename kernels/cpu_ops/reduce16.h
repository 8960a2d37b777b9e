/* 16 vectors of 16 partial sums -> one vector of 16 full sums, with a 4-level shuffle tree
 * (no per-vector horizontal reduction). Included by paged_attention.c after its v16 / v16i
 * vector types. */
#pragma once

/* x, y: vectors whose lanes, in segments of 2g, hold two partial sums (lanes i and g+i) for
 * g keys each; returns segments of 2g lanes: g summed keys from x, then g from y. */
#define COMBINE(x, y, lo, hi) (__builtin_shuffle((x), (y), (lo)) + __builtin_shuffle((x), (y), (hi)))
static const v16i LO1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
static const v16i HI1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
static const v16i LO2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
static const v16i HI2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
static const v16i LO4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
static const v16i HI4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
static const v16i LO8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
static const v16i HI8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#include <string.h>

/* AVX2: GCC lowers the 16-lane two-source shuffles of the tree below lane by lane through
 * general registers. Here each 16-lane vector is two 8-lane halves, added first; then
 * the 8 x 8 transpose-and-add of horizontal pair sums, per 8 keys. */
static inline __m256 reduce8_avx2(const v16 *p) {
    __m256 v[8];
    for (int i = 0; i < 8; i++)
        v[i] = _mm256_add_ps(_mm256_loadu_ps((const float *)&p[i]), _mm256_loadu_ps((const float *)&p[i] + 8));
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* t0 = [keys 0-3 over lanes 0-3 | keys 0-3 over lanes 4-7], t1 likewise for keys 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* p[j]: 16 partial-sum vectors, one per key j -> lane j holds the full sum of key j. */
static inline v16 reduce16(const v16 *p) {
    const __m256 lo = reduce8_avx2(p), hi = reduce8_avx2(p + 8);
    v16 r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
}
#else
/* p[j]: 16 partial-sum vectors, one per key j -> lane j holds the full sum of key j. */
static inline v16 reduce16(const v16 *p) {
    v16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = COMBINE(p[2 * i], p[2 * i + 1], LO1, HI1);
    for (int i = 0; i < 4; i++) b[i] = COMBINE(a[2 * i], a[2 * i + 1], LO2, HI2);
    for (int i = 0; i < 2; i++) c[i] = COMBINE(b[2 * i], b[2 * i + 1], LO4, HI4);
    return COMBINE(c[0], c[1], LO8, HI8);
}
#endif
