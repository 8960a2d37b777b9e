/* fp32 GEMM for decode-sized batches: C[M, N] = A[M, K] @ W[N, K]^T (+ bias).
 *
 * At decode batch sizes a step reads every weight from DRAM once and uses it M times, so the
 * multiply is as fast as the weight stream keeps up with the FMAs. W is packed once (by the
 * caller, in torch) into column panels of NR = 48 outputs: panel p = W[48p : 48p + 48, :]^T
 * as [K][48] contiguous, zero-padded past N. Each OpenMP thread owns a run of panels;
 * for every MR-row block of A a micro-kernel keeps its accumulators in registers across the
 * whole K, re-reading the panel from L2 for the next row block:
 *   AVX-512: 8 x 48, 24 zmm accumulators (3 panel loads + 8 broadcasts + 24 FMAs per k);
 *   AVX2 + FMA: 6 x 16, three passes per panel, 12 ymm accumulators (2 panel loads + 6
 *   broadcasts + 12 FMAs per k) of the 16 registers the ISA has. Here a panel is stored as
 *   three [K][16] sub-panels, one per pass, so each pass streams contiguous lines; the caller
 *   asks llmsvc_gemm_f32_subpanel() which layout to pack. A's row blocks are packed per call
 *   as [K][6], so the six broadcasts of a k come from one line.
 * While it computes, it prefetches the thread's
 * next panel, its lines split evenly over the row blocks, so the weight stream from DRAM
 * runs on while the FMAs work on L2-resident data. Panels are not handed out by OpenMP's
 * dynamic schedule: the panel a thread takes next would not be the one it prefetched. A
 * thread done with its run steals from the back of another's (panel_runs.h), so a preempted
 * thread does not hold the others at the barrier. Timings against MKL: docs/cpu-kernels.md.
 *
 * Rows are taken in chunks of 256 so a chunk of A stays in L2. The caller keeps the panel
 * (K * 192 bytes) well inside L2 (K <= 4096). Built with AVX-512F or AVX2 + FMA; elsewhere
 * the entry point returns -1 and the caller uses its other GEMM.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "panel_runs.h"

#define NR 48 /* panel width: 3 zmm or 6 ymm of fp32 */
#define MC 256

/* A micro-kernel's k loop over its FMA_FOUR / FMA_ROWS (four k / one k, defined per ISA below,
 * expanded here at the use): with pf (a char pointer, advanced) q lines of the next panel
 * prefetched every 4 k; then the K % 4 tail. */
#define K_LOOP(pf)                                                                        \
    do {                                                                                  \
        int64_t k = 0;                                                                    \
        if (pf) {                                                                         \
            for (; k + 4 <= K; k += 4) {                                                  \
                for (int j = 0; j < q; j++) _mm_prefetch((pf) + j * 64, _MM_HINT_T0);     \
                (pf) += q * 64;                                                           \
                FMA_FOUR(k);                                                              \
            }                                                                             \
        } else {                                                                          \
            for (; k + 4 <= K; k += 4) FMA_FOUR(k);                                       \
        }                                                                                 \
        for (; k < K; k++) FMA_ROWS(k);                                                   \
    } while (0)

#if defined(__AVX512F__)
#include <immintrin.h>
#define GEMM_F32 1
#define MR 8 /* rows per micro-kernel */

#define FMA_ROWS(K_)                                                                      \
    do {                                                                                  \
        const float *bk = b + (K_) * NR;                                                  \
        const __m512 w0 = _mm512_load_ps(bk), w1 = _mm512_load_ps(bk + 16),               \
                     w2 = _mm512_load_ps(bk + 32);                                        \
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

/* c[0:mr, 0:nc] = a[0:mr, 0:K] @ b[0:K, 0:48] (+ bias[0:nc]); prefetches q lines of pf
 * (NULL: none) every 4 k */
static inline __attribute__((always_inline)) void kernel(
    const int mr, const float *a, int64_t lda, const float *b, int64_t K, float *c, int64_t ldc,
    int nc, const float *bias, const char *pf, int q) {
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
    _Pragma("GCC unroll 8") for (int r = 0; r < mr; r++) {
        _mm512_mask_storeu_ps(c + r * ldc, m0, acc[r][0]);
        _mm512_mask_storeu_ps(c + r * ldc + 16, m1, acc[r][1]);
        _mm512_mask_storeu_ps(c + r * ldc + 32, m2, acc[r][2]);
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GEMM_F32 1
#define MR 6 /* rows per micro-kernel: 6 x 2 accumulators + 2 panel vectors + 1 broadcast */
#define NP 16 /* columns per pass, the sub-panel width: a panel is three [K][16] sub-panels */
#define PACK_A 1 /* a = A's row block packed [K][MR] (pack_block) */

/* bs: this pass's sub-panel [K][16] */
#define FMA_ROWS(K_)                                                                      \
    do {                                                                                  \
        const float *bk = bs + (K_) * NP;                                                 \
        const __m256 w0 = _mm256_load_ps(bk), w1 = _mm256_load_ps(bk + 8);               \
        _Pragma("GCC unroll 6") for (int r = 0; r < mr; r++) {                            \
            const __m256 av = _mm256_broadcast_ss(a + (K_) * MR + r);                     \
            acc[r][0] = _mm256_fmadd_ps(av, w0, acc[r][0]);                               \
            acc[r][1] = _mm256_fmadd_ps(av, w1, acc[r][1]);                               \
        }                                                                                 \
    } while (0)

/* Four k of a full 6-row block: acc[r][j] += a[k][r] * bs[k][8j .. 8j + 7]. From the
 * intrinsics above GCC keeps the 12 accumulators in registers but re-reads a panel vector
 * from L1 for every row (up to 13 loads per 12 FMAs); here ymm0-1 hold the panel vectors and
 * ymm2-3 take turns as the broadcast. */
#define K6_ROW(J, R, T, C0, C1)                                                           \
    "vbroadcastss " #J "*24+" #R "*4(%[a]), %%ymm" #T "\n\t"                             \
    "vfmadd231ps %%ymm0, %%ymm" #T ", %[" #C0 "]\n\t"                                      \
    "vfmadd231ps %%ymm1, %%ymm" #T ", %[" #C1 "]\n\t"
#define K6_STEP(J)                                                                        \
    "vmovaps " #J "*64(%[b]), %%ymm0\n\t"                                                  \
    "vmovaps " #J "*64+32(%[b]), %%ymm1\n\t"                                               \
    K6_ROW(J, 0, 2, c00, c01) K6_ROW(J, 1, 3, c10, c11) K6_ROW(J, 2, 2, c20, c21)          \
    K6_ROW(J, 3, 3, c30, c31) K6_ROW(J, 4, 2, c40, c41) K6_ROW(J, 5, 3, c50, c51)

static inline __attribute__((always_inline)) void k6_four(const float *a, const float *b, __m256 acc[MR][2]) {
    __asm__(K6_STEP(0) K6_STEP(1) K6_STEP(2) K6_STEP(3)
            : [c00] "+x"(acc[0][0]), [c01] "+x"(acc[0][1]), [c10] "+x"(acc[1][0]), [c11] "+x"(acc[1][1]),
              [c20] "+x"(acc[2][0]), [c21] "+x"(acc[2][1]), [c30] "+x"(acc[3][0]), [c31] "+x"(acc[3][1]),
              [c40] "+x"(acc[4][0]), [c41] "+x"(acc[4][1]), [c50] "+x"(acc[5][0]), [c51] "+x"(acc[5][1])
            : [a] "r"(a), [b] "r"(b), "m"(*(const float(*)[4 * MR])a), "m"(*(const float(*)[4 * NP])b)
            : "xmm0", "xmm1", "xmm2", "xmm3");
}

/* mr is a constant in each inlined kernel: full blocks take the asm, the others the intrinsics */
#define FMA_FOUR(K_)                                                                      \
    do {                                                                                  \
        if (mr == MR) {                                                                   \
            k6_four(a + (K_) * MR, bs + (K_) * NP, acc);                                  \
        } else {                                                                          \
            FMA_ROWS(K_); FMA_ROWS((K_) + 1); FMA_ROWS((K_) + 2); FMA_ROWS((K_) + 3);     \
        }                                                                                 \
    } while (0)

/* all-ones lanes for columns lo .. lo + 7 that are below nc */
static inline __m256i lane_mask(int nc, int lo) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(nc - lo), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* c[0:mr, 0:nc] = a[0:mr, 0:K] @ b[0:K, 0:48] (+ bias[0:nc]) in passes over 16 columns (as
 * many as nc needs), pass h reading sub-panel b + h * K ([K][16], 64-byte aligned); a packed
 * [K][MR]; the first pass prefetches q lines of pf (NULL: none) every 4 k. */
static inline __attribute__((always_inline)) void kernel(
    const int mr, const float *a, int64_t lda, const float *b, int64_t K, float *c, int64_t ldc,
    int nc, const float *bias, const char *pf, int q) {
    (void)lda;
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
        const char *p = h == 0 ? pf : 0;
        const float *bs = b + (int64_t)h * K;
        K_LOOP(p);
        _Pragma("GCC unroll 6") for (int r = 0; r < mr; r++) {
            _mm256_maskstore_ps(c + r * ldc + h, m0, acc[r][0]);
            _mm256_maskstore_ps(c + r * ldc + h + 8, m1, acc[r][1]);
        }
    }
}
#endif

#ifndef PACK_A
#define PACK_A 0
#endif
#ifndef NP
#define NP NR /* the panel is one [K][48] block */
#endif

#ifdef GEMM_F32
int llmsvc_gemm_f32_supported(void) { return 1; }

/* Columns of a sub-panel: each panel [K][48] is stored as 48 / this blocks [K][this]. */
int llmsvc_gemm_f32_subpanel(void) { return NP; }

#define KERNEL_CASE(R) \
    case R: kernel(R, a, lda, b, K, c, ldc, nc, bias, pf, q); break;

static void row_block(int mr, const float *a, int64_t lda, const float *b, int64_t K, float *c,
                      int64_t ldc, int nc, const float *bias, const char *pf, int q) {
    switch (mr) {
        KERNEL_CASE(1) KERNEL_CASE(2) KERNEL_CASE(3) KERNEL_CASE(4) KERNEL_CASE(5) KERNEL_CASE(6)
#if MR == 8
        KERNEL_CASE(7) KERNEL_CASE(8)
#endif
    }
}

typedef struct {
    const float *a, *packed, *bias;
    float *apack; /* PACK_A: the chunk's row blocks, [nb][K][MR] */
    float *c;
    int64_t lda, ldc, N, K, m0, mc, nb, share, steps;
    const char *end;
    int q;
} gemm_t;

/* all row blocks of rows [m0, m0 + mc) against panel p; prefetches panel pf_p (-1: none) */
static void do_panel(void *ctx, int64_t p, int64_t pf_p) {
    const gemm_t *g = (const gemm_t *)ctx;
    const int64_t K = g->K;
    const float *panel = g->packed + p * K * NR;
    const int nc = (int)(g->N - p * NR < NR ? g->N - p * NR : NR);
    for (int64_t i = 0; i < g->nb; i++) {
        const int64_t m = i * MR;
        const char *pf = pf_p < 0 ? 0 : (const char *)(g->packed + pf_p * K * NR) + i * g->share * 64;
        if (pf && pf + (int64_t)g->q * g->steps * 64 > g->end) pf = 0;
        const float *a = PACK_A ? g->apack + i * K * MR : g->a + (g->m0 + m) * g->lda;
        row_block((int)(g->mc - m < MR ? g->mc - m : MR), a, g->lda, panel, K,
                  g->c + (g->m0 + m) * g->ldc + p * NR, g->ldc, nc, g->bias ? g->bias + p * NR : 0, pf, g->q);
    }
}

/* Row block i of the chunk into apack as [K][MR] (rows past the chunk: zero) */
static void pack_block(const gemm_t *g, int64_t i) {
    const int64_t K = g->K, m = i * MR, mr = g->mc - m < MR ? g->mc - m : MR;
    const float *src = g->a + (g->m0 + m) * g->lda;
    float *dst = g->apack + i * K * MR;
    for (int64_t k = 0; k < K; k++)
        for (int64_t r = 0; r < MR; r++) dst[k * MR + r] = r < mr ? src[r * g->lda + k] : 0.f;
}

/* The calling thread's packing buffer for rows x K floats; kept between calls (a decode step
 * makes a hundred), grown when a call needs more. NULL when out of memory. */
static float *apack_buffer(int64_t rows, int64_t K) {
    static __thread float *buf;
    static __thread int64_t cap;
    if (rows * K > cap) {
        free(buf);
        buf = aligned_alloc(64, (rows * K * 4 + 63) / 64 * 64);
        cap = buf ? rows * K : 0;
    }
    return buf;
}

/* a [M, K] (row stride lda), packed [ceil(N / 48)][K][48] (64-byte aligned), bias [N] or
 * NULL, c [M, N] (row stride ldc); nt OpenMP threads sharing the panels as panel_runs.h says. */
int llmsvc_gemm_f32(const float *a, int64_t lda, const float *packed, const float *bias, float *c,
                    int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    if (((uintptr_t)packed) % 64 || M < 0 || N <= 0 || K <= 0 || N / NR >= (1ll << 31)) return -1;
    const int64_t np = (N + NR - 1) / NR;
    nt = nt < 1 ? 1 : nt > MAX_NT ? MAX_NT : nt;
    float *apack = 0;
    if (PACK_A && M > 0 && !(apack = apack_buffer(((M < MC ? M : MC) + MR - 1) / MR * MR, K))) return -1;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        gemm_t g = {a, packed, bias, apack, c, lda, ldc, N, K, m0, 0, 0, 0, 0, (const char *)(packed + np * K * NR), 0};
        g.mc = M - m0 < MC ? M - m0 : MC;
        g.nb = (g.mc + MR - 1) / MR;
        /* the next panel's K * 3 lines, split over this panel's nb row blocks */
        g.share = (K * 3 + g.nb - 1) / g.nb;
        g.steps = K / 4 > 0 ? K / 4 : 1;
        g.q = (int)((g.share + g.steps - 1) / g.steps);
        range_t ranges[MAX_NT] __attribute__((aligned(64)));
        split_runs(ranges, nt, np);
        _Pragma("omp parallel num_threads(nt) if (nt > 1 && np > 1)")
        {
            const int me = omp_get_thread_num(), team = omp_get_num_threads();
            if (PACK_A) {
                for (int64_t i = me; i < g.nb; i += team) pack_block(&g, i);
                _Pragma("omp barrier")
            }
            run_panels(ranges, nt, me, team, do_panel, &g);
        }
    }
    return 0;
}

#else
int llmsvc_gemm_f32_supported(void) { return 0; }
int llmsvc_gemm_f32_subpanel(void) { return 0; }

int llmsvc_gemm_f32(const float *a, int64_t lda, const float *packed, const float *bias, float *c,
                    int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    (void)a; (void)lda; (void)packed; (void)bias; (void)c; (void)ldc; (void)M; (void)N; (void)K; (void)nt;
    return -1;
}
#endif
