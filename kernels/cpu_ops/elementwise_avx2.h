/* SiLU-and-mul (fp32, bf16) and the bf16 RMSNorm on AVX2 without AVX-512 (included by
 * elementwise.c, same contracts), written with intrinsics where the scalar macros vectorize
 * poorly: bf16.h's integer rounding (add, shift, NaN test) per value, and expf, which a
 * vectorized loop turns into a libmvec call that spills the live ymm around it.
 *
 * Rounding to bf16 is bf16.h's exactly (nearest even, denormals kept, NaN -> quiet NaN), eight
 * lanes at a time, so a bf16 sum (the fused add's residual) is bit for bit the macros'. exp is
 * vexp.h's polynomial on eight lanes (within 2 ulp of expf). Zen 3, [1024, 3072] gate|up in
 * bf16, 2 threads: 1.37 ms through the macros, 1.22 with one vector at a time here, 0.83 with
 * four side by side (docs/cpu-kernels.md has the figures).
 * Widths that are not a multiple of 8 finish their rows with the macros' scalar arithmetic.
 */
#ifndef LLMSVC_ELEMENTWISE_AVX2_H
#define LLMSVC_ELEMENTWISE_AVX2_H
#include <immintrin.h>

#include "bf16.h"
#include "vexp.h"

static inline __m256 silu8_ps(__m256 g) {
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

/* 8 fp32 -> their bf16 bit patterns in the low 16 bits of each 32-bit lane, as f32_to_bf16 */
static inline __m256i round8_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, quiet, nan);
}

/* round8_bf16's patterns as the fp32 values they hold (RND of the macros) */
static inline __m256 widen8_bf16(__m256i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)); }

static inline void store8_bf16(uint16_t *p, __m256i h) {
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

/* SiLU-and-mul of w x 8 lanes, fp32 or bf16 (bf): o = RND(silu(g)) * u, RND only in bf16. The w
 * vectors' chains (e^-g, the division, two roundings) are written side by side: one 8-lane chain
 * at a time left most of the FP pipes idle behind its latency, 1.22 ms for a [1024, 3072] bf16
 * gate|up on Zen 3 against 0.83 with four (docs/cpu-kernels.md). Each lane's arithmetic is
 * unchanged: bit for bit the one-vector result. */
#define SILU_W 4
static inline __attribute__((always_inline)) void silu_lanes(const void *g, const void *u, void *o, const int w,
                                                             const int bf) {
    __m256 s[SILU_W];
    _Pragma("GCC unroll 4") for (int k = 0; k < w; k++) {
        const __m256 gk = bf ? bf16x8_to_f32((const uint16_t *)g + 8 * k) : _mm256_loadu_ps((const float *)g + 8 * k);
        s[k] = silu8_ps(gk);
    }
    _Pragma("GCC unroll 4") for (int k = 0; k < w; k++) {
        if (bf) {
            const __m256 uk = bf16x8_to_f32((const uint16_t *)u + 8 * k);
            store8_bf16((uint16_t *)o + 8 * k, round8_bf16(_mm256_mul_ps(widen8_bf16(round8_bf16(s[k])), uk)));
        } else {
            _mm256_storeu_ps((float *)o + 8 * k, _mm256_mul_ps(s[k], _mm256_loadu_ps((const float *)u + 8 * k)));
        }
    }
}

/* as DEFINE_SILU: out[t] = RND(silu(gate)) * up, SILU_W x 8 lanes at a time, then 8, the row's
 * last d % 8 values by the macros' scalar SILU_MUL */
#define DEFINE_SILU8(NAME, T_, BF, LD, ST, RND)                                                \
static void NAME(const T_ *x, int64_t xs, T_ *out, int64_t T, int64_t d, int nt) {           \
    _Pragma("omp parallel for num_threads(nt) schedule(static) if (T * d >= PAR_MIN_ELEMS && nt > 1)") \
    for (int64_t t = 0; t < T; t++) {                                                         \
        const T_ *g = x + t * xs, *u = g + d;                                                 \
        T_ *o = out + t * d;                                                                  \
        int64_t i = 0;                                                                        \
        for (; i + 8 * SILU_W <= d; i += 8 * SILU_W) silu_lanes(g + i, u + i, o + i, SILU_W, (BF)); \
        for (; i + 8 <= d; i += 8) silu_lanes(g + i, u + i, o + i, 1, (BF));                  \
        for (; i < d; i++) o[i] = ST(SILU_MUL(LD(g[i]), LD(u[i]), RND));                      \
    }                                                                                         \
}
DEFINE_SILU8(silu_f32, float, 0, F32_LD, F32_ST, F32_RND)
DEFINE_SILU8(silu_bf16, uint16_t, 1, BF16_LD, BF16_ST, BF16_RND)

/* as DEFINE_NORM: out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w; with res, s = RND(x[t] + res[t])
 * is normalised and written to res_out[t] */
static void norm_bf16(const uint16_t *x, int64_t xs, const uint16_t *res, int64_t rs, const uint16_t *w,
                      uint16_t *out, uint16_t *res_out, int64_t T, int64_t H, float eps, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (T * H >= PAR_MIN_ELEMS && nt > 1)
    for (int64_t t = 0; t < T; t++) {
        float buf[H] __attribute__((aligned(32))); /* the row in fp32; H <= 64K */
        const uint16_t *xr = x + t * xs, *rr = res ? res + t * rs : NULL;
        uint16_t *so = res ? res_out + t * H : NULL;
        __m256 ss8 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= H; i += 8) {
            __m256 v = bf16x8_to_f32(xr + i);
            if (res) {
                const __m256i h = round8_bf16(_mm256_add_ps(v, bf16x8_to_f32(rr + i)));
                store8_bf16(so + i, h);
                v = widen8_bf16(h);
            }
            _mm256_storeu_ps(buf + i, v);
            ss8 = _mm256_fmadd_ps(v, v, ss8);
        }
        float ss = 0.f;
        for (; i < H; i++) {
            float v = bf16_to_f32(xr[i]);
            if (res) {
                so[i] = f32_to_bf16(v + bf16_to_f32(rr[i]));
                v = bf16_to_f32(so[i]);
            }
            buf[i] = v;
            ss += v * v;
        }
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(ss8), _mm256_extractf128_ps(ss8, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        ss += _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        const __m256 inv8 = _mm256_set1_ps(inv);
        uint16_t *o = out + t * H;
        for (i = 0; i + 8 <= H; i += 8)
            store8_bf16(o + i, round8_bf16(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(buf + i), inv8),
                                                         bf16x8_to_f32(w + i))));
        for (; i < H; i++) o[i] = f32_to_bf16(buf[i] * inv * bf16_to_f32(w[i]));
    }
}
#endif
