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

/* c[0:mr, 0:nc] = bf16(a[0:mr, 0:K] @ panel + bias[0:nc]); prefetches q lines of pf (NULL:
 * none) per K block */
static inline __attribute__((always_inline)) void kernel(
    const int mr, const uint16_t *a, int64_t lda, const uint16_t *panel, int64_t nkb, uint16_t *c,
    int64_t ldc, int nc, const uint16_t *bias, const char *pf, int q) {
    __m512 acc[MR][4];
    _Pragma("GCC unroll 6") for (int i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nkb; kb++) {
        const uint16_t *b = panel + kb * (4 * 512), *ak = a + kb * KB;
        if (pf) {
            for (int j = 0; j < q; j++) _mm_prefetch(pf + j * 64, _MM_HINT_T1);
            pf += q * 64;
        }
        _Pragma("GCC unroll 2") for (int r = 0; r < 16; r++) {
            const __m512bh w0 = (__m512bh)_mm512_load_si512(b + r * 32);
            const __m512bh w1 = (__m512bh)_mm512_load_si512(b + 512 + r * 32);
            const __m512bh w2 = (__m512bh)_mm512_load_si512(b + 1024 + r * 32);
            const __m512bh w3 = (__m512bh)_mm512_load_si512(b + 1536 + r * 32);
            _Pragma("GCC unroll 6") for (int i = 0; i < mr; i++) {
                const __m512bh av = (__m512bh)_mm512_set1_epi32(*(const pair_t *)(ak + i * lda + 2 * r));
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], av, w0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], av, w1);
                acc[i][2] = _mm512_dpbf16_ps(acc[i][2], av, w2);
                acc[i][3] = _mm512_dpbf16_ps(acc[i][3], av, w3);
            }
        }
    }
    for (int j = 0; j < 4 && 16 * j < nc; j++) {
        const int n = nc - 16 * j;
        const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
        __m512 bv = _mm512_setzero_ps();
        if (bias) bv = _mm512_castsi512_ps(_mm512_slli_epi32(
                           _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + 16 * j)), 16));
        _Pragma("GCC unroll 6") for (int i = 0; i < mr; i++)
            _mm256_mask_storeu_epi16(c + i * ldc + 16 * j, m, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], bv)));
    }
}

#define KERNEL_CASE(R) \
    case R: kernel(R, a, lda, panel, nkb, c, ldc, nc, bias, pf, q); break;

static void row_block(int mr, const uint16_t *a, int64_t lda, const uint16_t *panel, int64_t nkb,
                      uint16_t *c, int64_t ldc, int nc, const uint16_t *bias, const char *pf, int q) {
    switch (mr) {
        KERNEL_CASE(1) KERNEL_CASE(2) KERNEL_CASE(3) KERNEL_CASE(4) KERNEL_CASE(5) KERNEL_CASE(6)
    }
}

typedef struct {
    const uint16_t *a, *packed, *bias;
    uint16_t *c;
    int64_t lda, ldc, M, N, K, nkb, nb, nr;
} dp_t;

/* Work unit u: panel u / nr against its row blocks' chunk u % nr (of nr). One chunk (nr = 1)
 * unless the panels do not divide evenly between the threads and there are row blocks enough:
 * 9 panels (N = 576: the o and down projections) on 2 threads kept one thread busy for 5 panel
 * times while the other waited after 4 (docs/cpu-kernels.md: those GEMMs ran ~8% slower than
 * gate_up's 48 panels). Chunking reads a panel once per chunk, so it is kept to GEMMs of
 * CHUNK_MIN_BLOCKS row blocks a thread or more (64 rows on 2 threads), whose panels are
 * compute-bound; a 16-row decode keeps whole panels. Prefetches the panel of unit pf_u (-1:
 * none) unless it is this one. */
static void dp_panel(void *ctx, int64_t u, int64_t pf_u) {
    const dp_t *g = (const dp_t *)ctx;
    const int64_t p = u / g->nr, r = u % g->nr, pf_p = pf_u < 0 || pf_u / g->nr == p ? -1 : pf_u / g->nr;
    const int64_t i0 = r * g->nb / g->nr, i1 = (r + 1) * g->nb / g->nr;
    const uint16_t *panel = g->packed + p * g->K * NP;
    const int nc = (int)(g->N - p * NP < NP ? g->N - p * NP : NP);
    const uint16_t *bias = g->bias ? g->bias + p * NP : 0;
    /* the next panel's K * 2 lines: a share per row block, q lines per K block */
    const int64_t share = (g->K * 2 + (i1 - i0) - 1) / (i1 - i0);
    const int q = (int)((share + g->nkb - 1) / g->nkb);
    for (int64_t i = i0; i < i1; i++) {
        const int64_t m0 = i * MR;
        /* a prefetch never faults, so the last share may run past the packed weight's end */
        const char *pf = pf_p >= 0 ? (const char *)(g->packed + pf_p * g->K * NP) + (i - i0) * share * 64 : 0;
        row_block((int)(g->M - m0 < MR ? g->M - m0 : MR), g->a + m0 * g->lda, g->lda, panel, g->nkb,
                  g->c + m0 * g->ldc + p * NP, g->ldc, nc, bias, pf, q);
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
    const int64_t nr = np % nt && nb >= CHUNK_MIN_BLOCKS * nt ? nt : 1, nu = np * nr;
    const dp_t g = {a, packed, bias, c, lda, ldc, M, N, K, nkb, nb, nr};
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
