/* gemm.c's AVX2 + FMA micro-kernel: 6 x 16 passes over three [K][16] sub-panels, of fp32 or
 * (bf, the bf16 entry) of bf16 widened in registers, with C stored as fp32 or rounded to bf16.
 * Included by gemm.c only, after its NR, MC and K_LOOP. */
#include <immintrin.h>
#define GEMM_F32 1
#define MR 6 /* rows per micro-kernel: 6 x 2 accumulators + 2 panel vectors + 1 broadcast */
#define NP 16 /* columns per pass, the sub-panel width: a panel is three [K][16] sub-panels */
#define PACK_A 1 /* a = A's row block packed [K][MR] (pack_block) */
#define BF16_WIDEN 1 /* llmsvc_gemm_bf16_widen is built */

/* dst[0:n] = src[0:n] widened to fp32 (exact); n % 8 == 0, dst 32-byte aligned */
static void widen_panel(float *dst, const uint16_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) _mm256_store_ps(dst + i, bf16x8_to_f32(src + i));
}

/* bs / bh: this pass's sub-panel [K][16] as fp32 / bf16 (bf, a constant in each kernel) */
#define FMA_ROWS(K_)                                                                      \
    do {                                                                                  \
        __m256 w0, w1;                                                                    \
        if (bf & BF_B) {                                                                  \
            w0 = bf16x8_to_f32(bh + (K_) * NP);                                           \
            w1 = bf16x8_to_f32(bh + (K_) * NP + 8);                                       \
        } else {                                                                          \
            w0 = _mm256_load_ps(bs + (K_) * NP);                                          \
            w1 = _mm256_load_ps(bs + (K_) * NP + 8);                                      \
        }                                                                                 \
        _Pragma("GCC unroll 6") for (int r = 0; r < mr; r++) {                            \
            const __m256 av = _mm256_broadcast_ss(a + (K_) * MR + r);                     \
            acc[r][0] = _mm256_fmadd_ps(av, w0, acc[r][0]);                               \
            acc[r][1] = _mm256_fmadd_ps(av, w1, acc[r][1]);                               \
        }                                                                                 \
    } while (0)

/* Four k of a block of 4-6 rows: acc[r][j] += a[k][r] * bs[k][8j .. 8j + 7]. From the
 * intrinsics above GCC keeps the accumulators in registers but re-reads a panel vector from L1
 * for every row (up to 13 loads per 12 FMAs), and ran 4 or 5 rows at ~half the 6-row block's
 * rate per FMA (weights in L3: 16 rows = 6 + 6 + 4 took longer than 18); here ymm0-1 hold the
 * panel vectors and ymm2-3 take turns as the broadcast. a is packed [K][MR] whatever mr is. */
#define K6_ROW(J, R, T, C0, C1)                                                           \
    "vbroadcastss " #J "*24+" #R "*4(%[a]), %%ymm" #T "\n\t"                             \
    "vfmadd231ps %%ymm0, %%ymm" #T ", %[" #C0 "]\n\t"                                      \
    "vfmadd231ps %%ymm1, %%ymm" #T ", %[" #C1 "]\n\t"
#define K_ROWS4(J) K6_ROW(J, 0, 2, c00, c01) K6_ROW(J, 1, 3, c10, c11) K6_ROW(J, 2, 2, c20, c21) \
    K6_ROW(J, 3, 3, c30, c31)
#define K_ROWS5(J) K_ROWS4(J) K6_ROW(J, 4, 2, c40, c41)
#define K_ROWS6(J) K_ROWS5(J) K6_ROW(J, 5, 3, c50, c51)
#define K_LOAD_F32(J) "vmovaps " #J "*64(%[b]), %%ymm0\n\t" "vmovaps " #J "*64+32(%[b]), %%ymm1\n\t"
/* a bf16 sub-panel: each panel vector widened (zero-extend, shift by 16) */
#define K_LOAD_BF16(J)                                                                    \
    "vpmovzxwd " #J "*32(%[b]), %%ymm0\n\t"                                               \
    "vpmovzxwd " #J "*32+16(%[b]), %%ymm1\n\t"                                            \
    "vpslld $16, %%ymm0, %%ymm0\n\t"                                                      \
    "vpslld $16, %%ymm1, %%ymm1\n\t"

#define K_OUT4 [c00] "+x"(acc[0][0]), [c01] "+x"(acc[0][1]), [c10] "+x"(acc[1][0]), [c11] "+x"(acc[1][1]), \
    [c20] "+x"(acc[2][0]), [c21] "+x"(acc[2][1]), [c30] "+x"(acc[3][0]), [c31] "+x"(acc[3][1])
#define K_OUT5 K_OUT4, [c40] "+x"(acc[4][0]), [c41] "+x"(acc[4][1])
#define K_OUT6 K_OUT5, [c50] "+x"(acc[5][0]), [c51] "+x"(acc[5][1])

/* NAME(a, b, acc): four k of R rows, the panel LOAD-ed as BT */
#define K_FOUR_FN(NAME, R, LOAD, BT)                                                      \
    static inline __attribute__((always_inline)) void NAME(const float *a, const BT *b, __m256 acc[MR][2]) { \
        __asm__(LOAD(0) K_ROWS##R(0) LOAD(1) K_ROWS##R(1) LOAD(2) K_ROWS##R(2) LOAD(3) K_ROWS##R(3) \
                : K_OUT##R                                                                \
                : [a] "r"(a), [b] "r"(b), "m"(*(const float(*)[4 * MR])a), "m"(*(const BT(*)[4 * NP])b) \
                : "xmm0", "xmm1", "xmm2", "xmm3");                                         \
    }
K_FOUR_FN(k4_four, 4, K_LOAD_F32, float)
K_FOUR_FN(k5_four, 5, K_LOAD_F32, float)
K_FOUR_FN(k6_four, 6, K_LOAD_F32, float)
K_FOUR_FN(k4_four_bf16, 4, K_LOAD_BF16, uint16_t)
K_FOUR_FN(k5_four_bf16, 5, K_LOAD_BF16, uint16_t)
K_FOUR_FN(k6_four_bf16, 6, K_LOAD_BF16, uint16_t)

/* mr is a constant in each inlined kernel: blocks of 4-6 rows take the asm, the others the
 * intrinsics */
#define FMA_FOUR(K_)                                                                      \
    do {                                                                                  \
        const float *ak_ = a + (K_) * MR;                                                 \
        if (mr >= 4 && (bf & BF_B)) {                                                     \
            const uint16_t *bk_ = bh + (K_) * NP;                                         \
            if (mr == 6) k6_four_bf16(ak_, bk_, acc);                                     \
            else if (mr == 5) k5_four_bf16(ak_, bk_, acc);                                \
            else k4_four_bf16(ak_, bk_, acc);                                             \
        } else if (mr >= 4) {                                                             \
            const float *bk_ = bs + (K_) * NP;                                            \
            if (mr == 6) k6_four(ak_, bk_, acc);                                          \
            else if (mr == 5) k5_four(ak_, bk_, acc);                                     \
            else k4_four(ak_, bk_, acc);                                                  \
        } else {                                                                          \
            FMA_ROWS(K_); FMA_ROWS((K_) + 1); FMA_ROWS((K_) + 2); FMA_ROWS((K_) + 3);     \
        }                                                                                 \
    } while (0)

/* all-ones lanes for columns lo .. lo + 7 that are below nc */
static inline __m256i lane_mask(int nc, int lo) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(nc - lo), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* c[0:16] = v0, v1 where n >= 16 columns remain, else the lanes of masks m0, m1 (lane_mask):
 * VMASKMOVPS to memory is slow on AMD cores, and a 6-row pass ends in 12 of them (plain stores
 * made a 16-row fp32 pass 7% faster on Zen 3, docs/cpu-kernels.md); every panel of a shape
 * whose N % 48 == 0 is full */
static inline void store_c16(float *c, __m256 v0, __m256 v1, int n, __m256i m0, __m256i m1) {
    if (n >= 16) {
        _mm256_storeu_ps(c, v0);
        _mm256_storeu_ps(c + 8, v1);
    } else {
        _mm256_maskstore_ps(c, m0, v0);
        _mm256_maskstore_ps(c + 8, m1, v1);
    }
}

/* 8 fp32 -> 8 bf16, round to nearest even, NaN kept a quiet NaN (bf16.h's f32_to_bf16) */
static inline __m128i bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v), one = _mm256_set1_epi32(1);
    const __m256i rne = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                               _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i h = _mm256_blendv_epi8(_mm256_srli_epi32(rne, 16),
                                         _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)); /* h <= 0xffff */
}

/* dst[0:n] = bf16 of the 16 lanes v0, v1 (n <= 16) */
static inline void store_bf16(uint16_t *dst, __m256 v0, __m256 v1, int n) {
    const __m128i lo = bf16x8(v0), hi = bf16x8(v1);
    if (n >= 16) {
        _mm_storeu_si128((__m128i *)dst, lo);
        _mm_storeu_si128((__m128i *)(dst + 8), hi);
    } else {
        uint16_t t[16];
        _mm_storeu_si128((__m128i *)t, lo);
        _mm_storeu_si128((__m128i *)(t + 8), hi);
        memcpy(dst, t, (size_t)n * 2);
    }
}

/* c[0:mr, 0:nc] = a[0:mr, 0:K] @ b[0:K, 0:48] (+ bias[0:nc]) in passes over 16 columns (as
 * many as nc needs), pass h reading sub-panel b + h * K ([K][16]); a packed [K][MR]; each of
 * the first pq passes prefetches q lines every 4 k of its part of pf (NULL: none), the parts
 * q * K / 4 lines apart. b and c are fp32, or bf16 when bf (b widened exactly, each element of c
 * rounded once). */
static inline __attribute__((always_inline)) void kernel(
    const int mr, const float *a, int64_t lda, const void *b, int64_t K, void *cv, int64_t ldc,
    int nc, const float *bias, const char *pf, int q, int pq, const int bf) {
    (void)lda;
    float *c = (float *)cv;
    for (int h = 0; h < nc; h += NP) {
        __m256 acc[MR][2];
        const __m256i m0 = lane_mask(nc, h), m1 = lane_mask(nc, h + 8);
        __m256 b0 = _mm256_setzero_ps(), b1 = b0;
        if (bias) { /* masked-off lanes are not read */
            b0 = _mm256_maskload_ps(bias + h, m0);
            b1 = _mm256_maskload_ps(bias + h + 8, m1);
        }
        _Pragma("GCC unroll 6") for (int r = 0; r < mr; r++) {
            acc[r][0] = b0;
            acc[r][1] = b1;
        }
        const char *p = pf && h / NP < pq ? pf + (int64_t)(h / NP) * q * (K / 4) * 64 : 0; /* this pass's part */
        const float *bs = (const float *)b + (int64_t)h * K;
        const uint16_t *bh = (const uint16_t *)b + (int64_t)h * K;
        K_LOOP(p);
        if (bf & BF_C) {
            _Pragma("GCC unroll 6") for (int r = 0; r < mr; r++)
                store_bf16((uint16_t *)cv + r * ldc + h, acc[r][0], acc[r][1], nc - h);
        } else {
            _Pragma("GCC unroll 6") for (int r = 0; r < mr; r++)
                store_c16(c + r * ldc + h, acc[r][0], acc[r][1], nc - h, m0, m1);
        }
    }
}

/* GGUF blocks for a few rows, dequantized in registers (gemm_gguf.h, up to Q8_REG_MAX_M
 * rows): c[0:mr, 0:nc] = a[0:mr, 0:K] (row stride lda) @ (d * q + m) (+ bias), q the int8
 * panel in three [K][16] sub-panels, d and m its [K / bs][16] scale and offset sub-panels.
 * 2 x mr accumulators + 2 scale + 2 offset + 2 weight vectors + a broadcast: mr <= 4. */
static inline void q8_row(const float *a, const int8_t *q, const float *d, const float *m, int64_t K,
                          int64_t bs, float *c, int nc, const float *bias);

static inline __attribute__((always_inline)) void q8_kernel(
    const int mr, const float *a, int64_t lda, const int8_t *q, const float *d, const float *m,
    int64_t K, int64_t bs, float *c, int64_t ldc, int nc, const float *bias) {
    const int64_t KB = K / bs;
    if (mr == 1) {
        q8_row(a, q, d, m, K, bs, c, nc, bias);
        return;
    }
    for (int h = 0; h < nc; h += NP) {
        const int8_t *qh = q + (int64_t)h * K;
        const float *dh = d + (int64_t)h * KB, *mh = m + (int64_t)h * KB;
        const __m256i m0 = lane_mask(nc, h), m1 = lane_mask(nc, h + 8);
        __m256 acc[4][2], b0 = _mm256_setzero_ps(), b1 = b0;
        if (bias) {
            b0 = _mm256_maskload_ps(bias + h, m0);
            b1 = _mm256_maskload_ps(bias + h + 8, m1);
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++) acc[r][0] = b0, acc[r][1] = b1;
        for (int64_t kb = 0; kb < KB; kb++) {
            const __m256 d0 = _mm256_loadu_ps(dh + kb * NP), d1 = _mm256_loadu_ps(dh + kb * NP + 8);
            const __m256 o0 = _mm256_loadu_ps(mh + kb * NP), o1 = _mm256_loadu_ps(mh + kb * NP + 8);
            const int8_t *qk = qh + kb * bs * NP;
            const float *ak = a + kb * bs;
            _Pragma("GCC unroll 4") for (int64_t k = 0; k < bs; k++) {
                const __m256 w0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                          _mm_loadl_epi64((const __m128i *)(qk + k * NP)))), o0);
                const __m256 w1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                          _mm_loadl_epi64((const __m128i *)(qk + k * NP + 8)))), o1);
                _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++) {
                    const __m256 av = _mm256_broadcast_ss(ak + r * lda + k);
                    acc[r][0] = _mm256_fmadd_ps(av, w0, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(av, w1, acc[r][1]);
                }
            }
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++)
            store_c16(c + r * ldc + h, acc[r][0], acc[r][1], nc - h, m0, m1);
    }
}

/* q8_kernel for one row: the three sub-panels in one pass over k, so that six accumulators
 * (not two, each waiting on its previous FMA) are in flight; each column still sums over k in
 * order, bit for bit as the fp32 kernel. The scales come from L1 as FMA operands: 6 accumulators
 * + 6 offsets + a broadcast + a weight fill the 16 ymm. */
static inline void q8_row(const float *a, const int8_t *q, const float *d, const float *m, int64_t K,
                          int64_t bs, float *c, int nc, const float *bias) {
    const int64_t KB = K / bs;
    __m256 acc[6];
    for (int v = 0; v < 6; v++) {
        const __m256i mk = lane_mask(nc, 8 * v);
        acc[v] = bias ? _mm256_maskload_ps(bias + 8 * v, mk) : _mm256_setzero_ps();
    }
    for (int64_t kb = 0; kb < KB; kb++) {
        __m256 o[6];
        const float *dk[6];
        const int8_t *qk[6];
        for (int v = 0; v < 6; v++) { /* sub-panel v / 2, its columns 8 (v % 2) .. + 7 */
            const int64_t sub = v / 2, lo = 8 * (v % 2);
            o[v] = _mm256_loadu_ps(m + sub * KB * NP + kb * NP + lo);
            dk[v] = d + sub * KB * NP + kb * NP + lo;
            qk[v] = q + sub * K * NP + kb * bs * NP + lo;
        }
        const float *ak = a + kb * bs;
        _Pragma("GCC unroll 2") for (int64_t k = 0; k < bs; k++) {
            const __m256 av = _mm256_broadcast_ss(ak + k);
            _Pragma("GCC unroll 6") for (int v = 0; v < 6; v++) {
                const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                     _mm_loadl_epi64((const __m128i *)(qk[v] + k * NP)))),
                                                 _mm256_loadu_ps(dk[v]), o[v]);
                acc[v] = _mm256_fmadd_ps(av, w, acc[v]);
            }
        }
    }
    for (int v = 0; v < 6; v += 2) store_c16(c + 8 * v, acc[v], acc[v + 1], nc - 8 * v, lane_mask(nc, 8 * v),
                                             lane_mask(nc, 8 * v + 8));
}
