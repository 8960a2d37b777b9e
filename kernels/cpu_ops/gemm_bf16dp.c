/* bf16 GEMM on AVX512-BF16 dot products, for CPUs with AVX512-BF16 but no AMX (AMD Zen 4,
 * Intel Cooper Lake): C[M, N] = A[M, K] @ W[N, K]^T (+ bias), A, W, bias and C bf16,
 * accumulated in fp32 and rounded once (to nearest even) at the end, as gemm_amx.c does.
 *
 * It reads gemm_amx.c's packed panels (linear.pack_amx), K a multiple of 32: panel p, K block
 * kb, column tile j is [16 K pairs][16 columns][2], so one 64-byte row of a tile is the VNNI
 * operand of VDPBF16PS for 16 columns and one K pair. A micro-kernel of MR = 6 rows x 64
 * columns keeps its 24 accumulators in zmm registers over the whole K: per K pair, 4 tile-row
 * loads, 6 broadcasts of an A pair and 24 VDPBF16PS (16 columns x 2 K each). The panel
 * (K * 128 bytes) is re-read from L2 for every 6-row block; while the FMAs run, the thread's
 * next panel is prefetched, its lines spread over this panel's row blocks and K blocks, so the
 * weight stream from DRAM keeps running (panel_runs.h shares the panels between threads).
 * Panels that do not divide evenly between the threads are split by rows or by column tiles
 * (dp_panel), each part computed by the same micro-kernel over 2 or 1 tiles.
 *
 * VDPBF16PS treats bf16 denormal inputs as zero and flushes denormal results, as the AMX
 * tile multiply does; each product of two bf16 is exact in fp32.
 */
#include <omp.h>
#include <stdint.h>

#define NP 64 /* panel width: 4 column tiles of 16 */
#define KB 32 /* K per packed block: 16 pairs */
#define MR 6  /* rows per micro-kernel: 6 x 4 accumulators */
#define CHUNK_MIN_BLOCKS 4 /* row blocks per thread before a panel's rows are split (dp_panel) */

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "panel_runs.h"

int llmsvc_gemm_bf16_dp_supported(void) { return 1; }

typedef int32_t pair_t __attribute__((may_alias, aligned(2))); /* two adjacent bf16 of A */

/* c[0:mr, 0:nc] = bf16(a[0:mr, 0:K] @ panel[:, 0:16 nt] + bias[0:nc]) over nt column tiles
 * (4: a whole panel; 2 or 1: a part of one, panel pointing at its first tile; never 3); prefetches q
 * lines from pf (NULL: none) per K block, then moves pf on by pf_step bytes */
static inline __attribute__((always_inline)) void kernel(
    const int mr, const int nt, const uint16_t *a, int64_t lda, const uint16_t *panel, int64_t nkb,
    uint16_t *c, int64_t ldc, int nc, const uint16_t *bias, const char *pf, int q, int64_t pf_step) {
    __m512 acc[MR][4];
    _Pragma("GCC unroll 6") for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nkb; kb++) {
        const uint16_t *b = panel + kb * (4 * 512), *ak = a + kb * KB;
        if (pf) {
            for (int j = 0; j < q; j++) _mm_prefetch(pf + j * 64, _MM_HINT_T1);
            pf += pf_step;
        }
        _Pragma("GCC unroll 2") for (int r = 0; r < 16; r++) {
            /* nt is a constant in every instance (row_block): the unused tiles fold away */
            const __m512bh w0 = (__m512bh)_mm512_load_si512(b + r * 32);
            const __m512bh w1 = nt > 1 ? (__m512bh)_mm512_load_si512(b + 512 + r * 32) : w0;
            const __m512bh w2 = nt > 2 ? (__m512bh)_mm512_load_si512(b + 1024 + r * 32) : w0;
            const __m512bh w3 = nt > 2 ? (__m512bh)_mm512_load_si512(b + 1536 + r * 32) : w0;
            _Pragma("GCC unroll 6") for (int i = 0; i < mr; i++) {
                const __m512bh av = (__m512bh)_mm512_set1_epi32(*(const pair_t *)(ak + i * lda + 2 * r));
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], av, w0);
                if (nt > 1) acc[i][1] = _mm512_dpbf16_ps(acc[i][1], av, w1);
                if (nt > 2) {
                    acc[i][2] = _mm512_dpbf16_ps(acc[i][2], av, w2);
                    acc[i][3] = _mm512_dpbf16_ps(acc[i][3], av, w3);
                }
            }
        }
    }
    for (int j = 0; j < nt && 16 * j < nc; j++) {
        const int n = nc - 16 * j;
        const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
        __m512 bv = _mm512_setzero_ps();
        if (bias) bv = _mm512_castsi512_ps(_mm512_slli_epi32(
                           _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + 16 * j)), 16));
        _Pragma("GCC unroll 6") for (int i = 0; i < mr; i++)
            _mm256_mask_storeu_epi16(c + i * ldc + 16 * j, m, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], bv)));
    }
}

#define KERNEL_CASE(R, NT) \
    case R: kernel(R, NT, a, lda, panel, nkb, c, ldc, nc, bias, pf, q, pf_step); break;
#define KERNEL_CASES(NT) \
    switch (mr) { KERNEL_CASE(1, NT) KERNEL_CASE(2, NT) KERNEL_CASE(3, NT) KERNEL_CASE(4, NT) \
                  KERNEL_CASE(5, NT) KERNEL_CASE(6, NT) }

static void row_block(int mr, int nt, const uint16_t *a, int64_t lda, const uint16_t *panel, int64_t nkb,
                      uint16_t *c, int64_t ldc, int nc, const uint16_t *bias, const char *pf, int q,
                      int64_t pf_step) {
    if (nt == 4) KERNEL_CASES(4)
    else if (nt == 2) KERNEL_CASES(2)
    else KERNEL_CASES(1)
}

typedef struct {
    const uint16_t *a, *packed, *bias;
    uint16_t *c;
    int64_t lda, ldc, M, N, K, nkb, nb, nr;
    /* column parts (tp > 0): run t of nt is its whole = nf / nt panels, then part t (tiles
     * [t tp, (t + 1) tp)) of each of the nl panels left over after nf; per = whole + nl */
    int64_t nf, nl, per, whole;
    int tp;
} dp_t;

/* What work unit u is: panel *p, column tiles [*t0, *t0 + *nt) of it, row-block chunk *r */
static inline void unit_of(const dp_t *g, int64_t u, int64_t *p, int *t0, int *nt, int64_t *r) {
    *t0 = 0, *nt = 4, *r = 0;
    if (!g->tp) {
        *p = u / g->nr, *r = u % g->nr;
        return;
    }
    const int64_t t = u / g->per, k = u % g->per;
    if (k < g->whole) {
        *p = t * g->whole + k;
    } else {
        *p = g->nf + k - g->whole, *t0 = (int)t * g->tp, *nt = g->tp;
    }
}

/* Work unit u: panel p's row-block chunk r (of nr), or a part of panel p's columns (tp > 0).
 *
 * Rows: one chunk (nr = 1) unless the panels do not divide evenly between the threads and
 * there are row blocks enough: 9 panels (N = 576: the o and down projections) on 2 threads
 * kept one thread busy for 5 panel times while the other waited after 4 (docs/cpu-kernels.md:
 * those GEMMs ran ~8% slower than gate_up's 48 panels). Chunking reads a panel once per chunk,
 * so it is kept to GEMMs of CHUNK_MIN_BLOCKS row blocks a thread or more (64 rows on 2
 * threads), whose panels are compute-bound.
 *
 * Columns: below that (up to 42 rows on 2 threads) the panels left over after an even share
 * are split by column tiles instead, one part per thread (2 or 4 threads: 2 or 1 tiles each),
 * so each thread reads its own quarter or half of them and none waits a whole panel time.
 *
 * Prefetches unit pf_u's weights (-1: none) unless they are this unit's. */
static void dp_panel(void *ctx, int64_t u, int64_t pf_u) {
    const dp_t *g = (const dp_t *)ctx;
    int64_t p, r, pf_p = -1, pf_r = 0;
    int t0, nt, pf_t0 = 0, pf_nt = 4;
    unit_of(g, u, &p, &t0, &nt, &r);
    if (pf_u >= 0) {
        unit_of(g, pf_u, &pf_p, &pf_t0, &pf_nt, &pf_r);
        if (pf_p == p) pf_p = -1;
    }
    const int64_t i0 = r * g->nb / g->nr, i1 = (r + 1) * g->nb / g->nr, nbl = i1 - i0;
    const uint16_t *panel = g->packed + p * g->K * NP;
    int nc = (int)(g->N - p * NP < NP ? g->N - p * NP : NP) - 16 * t0;
    if (nc <= 0) return; /* a part wholly past N */
    if (nc > 16 * nt) nc = 16 * nt;
    const uint16_t *bias = g->bias ? g->bias + p * NP + 16 * t0 : 0;
    /* the next unit's lines, a share per row block: a whole panel is K * 2 contiguous lines,
     * q per K block; a part is pf_nt * 16 lines in each 4 KB K block, share of them per block */
    const int64_t lines = pf_nt == 4 ? g->K * 2 : pf_nt * 16;
    const int64_t share = (lines + nbl - 1) / nbl;
    const int q = pf_nt == 4 ? (int)((share + g->nkb - 1) / g->nkb) : (int)share;
    const int64_t pf_step = pf_nt == 4 ? (int64_t)q * 64 : 4 * 512 * 2;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t m0 = i * MR;
        /* a prefetch never faults, so the last share may run past the packed weight's end */
        const char *pf = pf_p >= 0 ? (const char *)(g->packed + pf_p * g->K * NP + pf_t0 * 512) + (i - i0) * share * 64 : 0;
        row_block((int)(g->M - m0 < MR ? g->M - m0 : MR), nt, g->a + m0 * g->lda, g->lda, panel + t0 * 512,
                  g->nkb, g->c + m0 * g->ldc + p * NP + 16 * t0, g->ldc, nc, bias, pf, q, pf_step);
    }
}

/* a [M, K] bf16 (row stride lda elements), packed as gemm_amx.c's (64-byte aligned), bias [N]
 * or NULL, c [M, N] bf16 (row stride ldc); K % 32 == 0; nt OpenMP threads. Returns -1 (nothing
 * written) on bad arguments. */
int llmsvc_gemm_bf16_dp(const uint16_t *a, int64_t lda, const uint16_t *packed, const uint16_t *bias,
                        uint16_t *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    if (((uintptr_t)packed) % 64 || M < 0 || N <= 0 || K <= 0 || K % KB || lda < K ||
        (N + NP - 1) / NP * MAX_NT >= (1ll << 31))
        return -1;
    if (M == 0) return 0;
    const int64_t np = (N + NP - 1) / NP, nkb = K / KB, nb = (M + MR - 1) / MR;
    nt = nt < 1 ? 1 : nt > MAX_NT ? MAX_NT : nt;
    const int64_t nr = np % nt && nb >= CHUNK_MIN_BLOCKS * nt ? nt : 1;
    dp_t g = {a, packed, bias, c, lda, ldc, M, N, K, nkb, nb, nr, 0, 0, 0, 0, 0};
    int64_t nu = np * nr;
    if (nr == 1 && np % nt && (nt == 2 || nt == 4)) {
        g.tp = 4 / nt, g.nl = np % nt, g.nf = np - g.nl, g.whole = g.nf / nt, g.per = g.whole + g.nl;
        nu = g.per * nt;
    }
    range_t ranges[MAX_NT] __attribute__((aligned(64)));
    split_runs(ranges, nt, nu);
    _Pragma("omp parallel num_threads(nt) if (nt > 1 && nu > 1)")
    run_panels(ranges, nt, omp_get_thread_num(), omp_get_num_threads(), dp_panel, (void *)&g);
    return 0;
}

#else
int llmsvc_gemm_bf16_dp_supported(void) { return 0; }

int llmsvc_gemm_bf16_dp(const uint16_t *a, int64_t lda, const uint16_t *packed, const uint16_t *bias,
                        uint16_t *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    (void)a; (void)lda; (void)packed; (void)bias; (void)c; (void)ldc; (void)M; (void)N; (void)K; (void)nt;
    return -1;
}
#endif
