/* SiLU-and-mul on AVX-512 and bf16 RMSNorm on AVX512-BF16 (included by elementwise.c, same
 * contracts), written with intrinsics where the scalar macros vectorize poorly.
 *
 * In bf16, every rounding to bf16 is one VCVTNEPS2BF16: nearest even, NaN -> 0x7fc0 as torch, but a
 * denormal (|v| < 2^-126) becomes a signed zero where bf16.h keeps it, as the GEMMs' VDPBF16PS
 * already treat such inputs. The integer rounding of bf16.h (add, shift, NaN test and blend)
 * was half the scalar-macro SiLU's time: [128, 1536] on one Zen 4 core, 149 us with it against
 * 95-100 here. exp is inlined (vexp.h).
 */
#ifndef LLMSVC_ELEMENTWISE_AVX512_H
#define LLMSVC_ELEMENTWISE_AVX512_H
#include <immintrin.h>

#include "vexp.h"

static inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

static inline __m512 silu_ps(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

/* as DEFINE_SILU in fp32: out[t] = silu(gate) * up */
static void silu_f32(const float *x, int64_t xs, float *out, int64_t T, int64_t d, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (T * d >= PAR_MIN_ELEMS && nt > 1)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * xs, *u = g + d;
        float *o = out + t * d;
        for (int64_t i = 0; i < d; i += 16) {
            const __mmask16 m = tail_mask(d - i);
            _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(silu_ps(_mm512_maskz_loadu_ps(m, g + i)),
                                                          _mm512_maskz_loadu_ps(m, u + i)));
        }
    }
}

#ifdef __AVX512BF16__
/* n <= 16 bf16 -> fp32 lanes (the rest 0) */
static inline __m512 ld_bf16x16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline __m256i cvt_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

static inline __m512 widen_bf16x16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* o[0:16) = RND(silu(g)) * u under mask m (a constant 0xffff folds the masks away) */
static inline __attribute__((always_inline)) void silu16(const uint16_t *g, const uint16_t *u, uint16_t *o,
                                                         __mmask16 m) {
    const __m512 s = silu_ps(ld_bf16x16(g, m));
    _mm256_mask_storeu_epi16(o, m, cvt_bf16x16(_mm512_mul_ps(widen_bf16x16(cvt_bf16x16(s)), ld_bf16x16(u, m))));
}

/* as DEFINE_SILU: out[t] = RND(silu(gate)) * up */
static void silu_bf16(const uint16_t *x, int64_t xs, uint16_t *out, int64_t T, int64_t d, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (T * d >= PAR_MIN_ELEMS && nt > 1)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * xs, *u = g + d;
        uint16_t *o = out + t * d;
        int64_t i = 0;
        for (; i + 16 <= d; i += 16) silu16(g + i, u + i, o + i, 0xffff);
        if (i < d) silu16(g + i, u + i, o + i, tail_mask(d - i));
    }
}

/* as DEFINE_NORM: out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w; with res, s = RND(x[t] + res[t])
 * is normalised and written to res_out[t] */
static void norm_bf16(const uint16_t *x, int64_t xs, const uint16_t *res, int64_t rs, const uint16_t *w,
                          uint16_t *out, uint16_t *res_out, int64_t T, int64_t H, float eps, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (T * H >= PAR_MIN_ELEMS && nt > 1)
    for (int64_t t = 0; t < T; t++) {
        float buf[H] __attribute__((aligned(64))); /* the row in fp32; H <= 64K */
        const uint16_t *xr = x + t * xs;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            const __mmask16 m = tail_mask(H - i);
            __m512 v = ld_bf16x16(xr + i, m);
            if (res) {
                const __m256i h = cvt_bf16x16(_mm512_add_ps(v, ld_bf16x16(res + t * rs + i, m)));
                _mm256_mask_storeu_epi16(res_out + t * H + i, m, h);
                v = widen_bf16x16(h);
            }
            _mm512_mask_storeu_ps(buf + i, m, v);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
        uint16_t *o = out + t * H;
        for (int64_t i = 0; i < H; i += 16) {
            const __mmask16 m = tail_mask(H - i);
            const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, buf + i), inv), ld_bf16x16(w + i, m));
            _mm256_mask_storeu_epi16(o + i, m, cvt_bf16x16(y));
        }
    }
}
#endif
#endif
