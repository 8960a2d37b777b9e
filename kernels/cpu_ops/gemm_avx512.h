/* gemm.c's AVX-512 micro-kernel: 8 x 48 with 24 zmm accumulators, over a [K][48] panel of
 * fp32 or (bf, the bf16 entry) of bf16 widened in registers, with C stored as fp32 or rounded
 * to bf16. Included by gemm.c only, after its NR, MC and K_LOOP. */
#include <immintrin.h>
#define GEMM_F32 1
#define MR 8 /* rows per micro-kernel */
#define BF16_WIDEN 1 /* llmsvc_gemm_bf16_widen is built (taken where neither AMX nor AVX512-BF16 is) */
#define WIDEN_A_ROWS 1 /* bf16 A: its rows widened into apack as [mr][K] fp32 (pack_block) */

/* dst[0:n] = src[0:n] widened to fp32 (exact); n % 16 == 0, dst 64-byte aligned */
static void widen_panel(float *dst, const uint16_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) _mm512_store_ps(dst + i, bf16x16_to_f32(src + i));
}

#define FMA_ROWS(K_)                                                                      \
    do {                                                                                  \
        __m512 w0, w1, w2;                                                                \
        if (bf & BF_B) {                                                                  \
            const uint16_t *bk = (const uint16_t *)bv + (K_) * NR;                        \
            w0 = bf16x16_to_f32(bk), w1 = bf16x16_to_f32(bk + 16), w2 = bf16x16_to_f32(bk + 32); \
        } else {                                                                          \
            const float *bk = (const float *)bv + (K_) * NR;                              \
            w0 = _mm512_load_ps(bk), w1 = _mm512_load_ps(bk + 16), w2 = _mm512_load_ps(bk + 32); \
        }                                                                                 \
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; r++) {                            \
            const __m512 av = _mm512_set1_ps(a[r * lda + (K_)]);                          \
            acc[r][0] = _mm512_fmadd_ps(av, w0, acc[r][0]);                               \
            acc[r][1] = _mm512_fmadd_ps(av, w1, acc[r][1]);                               \
            acc[r][2] = _mm512_fmadd_ps(av, w2, acc[r][2]);                               \
        }                                                                                 \
    } while (0)

#define FMA_FOUR(K_)                                                                      \
    do {                                                                                  \
        FMA_ROWS(K_); FMA_ROWS((K_) + 1); FMA_ROWS((K_) + 2); FMA_ROWS((K_) + 3);         \
    } while (0)

static inline __mmask16 lane_mask(int nc, int lo) {
    const int n = nc - lo;
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* 16 fp32 -> 16 bf16 at dst, lanes in mask only: round to nearest even, NaN kept a quiet NaN
 * (bf16.h's f32_to_bf16) */
static inline void store_bf16x16(uint16_t *dst, __mmask16 mask, __m512 v) {
    const __m512i u = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    const __m512i rne = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), one))), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i h = _mm512_mask_or_epi32(rne, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm512_mask_cvtepi32_storeu_epi16(dst, mask, h); /* h <= 0xffff: the truncation keeps it */
}

/* c[0:mr, 0:nc] = a[0:mr, 0:K] @ b[0:K, 0:48] (+ bias[0:nc]); prefetches q lines of pf
 * (NULL: none) every 4 k. b and c are fp32, or bf16 when bf (b widened exactly, each element of
 * c rounded once). */
static inline __attribute__((always_inline)) void kernel(
    const int mr, const float *a, int64_t lda, const void *bv, int64_t K, void *cv, int64_t ldc,
    int nc, const float *bias, const char *pf, int q, int pq, const int bf) {
    (void)pq; /* one pass per panel */
    float *c = (float *)cv;
    __m512 acc[MR][3];
    const __mmask16 m0 = lane_mask(nc, 0), m1 = lane_mask(nc, 16), m2 = lane_mask(nc, 32);
    __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0;
    if (bias) {
        b0 = _mm512_maskz_loadu_ps(m0, bias);
        b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
        b2 = _mm512_maskz_loadu_ps(m2, bias + 32);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < mr; r++) {
        acc[r][0] = b0;
        acc[r][1] = b1;
        acc[r][2] = b2;
    }
    K_LOOP(pf);
    if (bf & BF_C) {
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; r++) {
            uint16_t *cr = (uint16_t *)cv + r * ldc;
            store_bf16x16(cr, m0, acc[r][0]);
            store_bf16x16(cr + 16, m1, acc[r][1]);
            store_bf16x16(cr + 32, m2, acc[r][2]);
        }
        return;
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < mr; r++) {
        _mm512_mask_storeu_ps(c + r * ldc, m0, acc[r][0]);
        _mm512_mask_storeu_ps(c + r * ldc + 16, m1, acc[r][1]);
        _mm512_mask_storeu_ps(c + r * ldc + 32, m2, acc[r][2]);
    }
}

/* GGUF blocks for a few rows, dequantized in registers (gemm_gguf.h, up to Q8_REG_MAX_M
 * rows): c[0:mr, 0:nc] = a[0:mr, 0:K] (row stride lda) @ (d * q + m) (+ bias), q the int8
 * panel [K][48], d and m its [K / bs][48] scale and offset panels; mr <= 4. */
static inline __attribute__((always_inline)) void q8_kernel(
    const int mr, const float *a, int64_t lda, const int8_t *q, const float *d, const float *m,
    int64_t K, int64_t bs, float *c, int64_t ldc, int nc, const float *bias) {
    const int64_t KB = K / bs;
    const __mmask16 mk[3] = {lane_mask(nc, 0), lane_mask(nc, 16), lane_mask(nc, 32)};
    __m512 acc[4][3];
    _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++)
        for (int v = 0; v < 3; v++)
            acc[r][v] = bias ? _mm512_maskz_loadu_ps(mk[v], bias + 16 * v) : _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; kb++) {
        __m512 dv[3], ov[3];
        for (int v = 0; v < 3; v++) {
            dv[v] = _mm512_loadu_ps(d + kb * NR + 16 * v);
            ov[v] = _mm512_loadu_ps(m + kb * NR + 16 * v);
        }
        const int8_t *qk = q + kb * bs * NR;
        const float *ak = a + kb * bs;
        _Pragma("GCC unroll 2") for (int64_t k = 0; k < bs; k++) {
            __m512 w[3];
            for (int v = 0; v < 3; v++)
                w[v] = _mm512_fmadd_ps(dv[v], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                  _mm_loadu_si128((const __m128i *)(qk + k * NR + 16 * v)))), ov[v]);
            _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++) {
                const __m512 av = _mm512_set1_ps(ak[r * lda + k]);
                for (int v = 0; v < 3; v++) acc[r][v] = _mm512_fmadd_ps(av, w[v], acc[r][v]);
            }
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++)
        for (int v = 0; v < 3; v++) _mm512_mask_storeu_ps(c + r * ldc + 16 * v, mk[v], acc[r][v]);
}
