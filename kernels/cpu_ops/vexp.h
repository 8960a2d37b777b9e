/* e^x on 16 fp32 lanes (AVX-512F) or 8 (AVX2 + FMA), inlined: a libmvec call (what expf in a
 * vectorized loop becomes) spills every live vector register around it, under the SysV ABI that
 * saves none. */
#ifndef LLMSVC_VEXP_H
#define LLMSVC_VEXP_H
#include <immintrin.h>

/* e^x within 2 ulp on [-87.3, 88.3] (Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, Cephes'
 * degree-6 polynomial, 2^n built in the exponent bits); x is clamped to that range, so the result
 * saturates at ~1.2e-38 and ~2.1e38 instead of reaching 0 or inf. Zen 4 runs a zmm FMA a cycle,
 * and these 15 operations are most of the SiLU's time. Written once for both widths: V is the
 * vector type, P the intrinsics' prefix (_mm512 / _mm256), VI the integer vector's cast suffix,
 * ROUND(v) rounds to the nearest integer. */
#define VEXP_BODY(V, P, VI, ROUND)                                                              \
    x = P##_max_ps(P##_min_ps(x, P##_set1_ps(88.3f)), P##_set1_ps(-87.3f));                     \
    const V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)));                        \
    V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                       \
    r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                      \
    V p = P##_set1_ps(1.9875691500e-4f);                                                        \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                                      \
    p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                                      \
    p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                                      \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                                      \
    p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                                      \
    p = P##_fmadd_ps(p, P##_mul_ps(r, r), P##_add_ps(r, P##_set1_ps(1.f)));                     \
    return P##_mul_ps(p, P##_castsi##VI##_ps(P##_slli_epi32(                                    \
        P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23)));

#ifdef __AVX512F__
#define VEXP_ROUND16(v) _mm512_roundscale_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline __m512 exp_ps(__m512 x) { VEXP_BODY(__m512, _mm512, 512, VEXP_ROUND16) }
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define VEXP_ROUND8(v) _mm256_round_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* exp_ps on 8 lanes */
static inline __m256 exp8_ps(__m256 x) { VEXP_BODY(__m256, _mm256, 256, VEXP_ROUND8) }
#endif
#endif
