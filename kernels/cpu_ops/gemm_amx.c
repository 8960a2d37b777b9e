/* bf16 GEMM on AMX tiles for decode-sized batches: C[M, N] = A[M, K] @ W[N, K]^T (+ bias),
 * A, W, bias and C bf16, accumulated in fp32 and rounded once (to nearest even) at the end.
 *
 * At decode batch sizes the multiply is a stream of the weights from DRAM; one TDPBF16PS does
 * 16 x 16 x 32 multiply-adds, so the tiles leave the stream as the only cost. oneDNN's AMX
 * matmul (torch's bf16 linear) streams the weights far below the DRAM bandwidth at M = 16 on
 * SmolLM2-135M's layer shapes; this kernel is written for the stream.
 *
 * W is packed once (by the caller, in torch) into panels of NP = 64 outputs, K a multiple of
 * 32: panel p, K block kb, column tile j in 0..3 is one 1 KB B tile in VNNI order,
 * [16 K pairs][16 columns][2], holding W[64p + 16j + c, 32kb + 2r + e]; zero past N. A panel
 * is K * 128 bytes, contiguous, so each thread streams its run of panels front to back.
 *
 * Row blocks of up to 16 rows (M <= 16, and a tail): tmm0-3 accumulate a 16 x 64 block of C,
 * tmm4 holds A[rows, 32kb : +32] (loaded in place with A's row stride), tmm5-7 take turns
 * with the B tiles. Pairs of row blocks (32 rows): tmm0-3 are a 2 x 2 grid of C tiles over
 * half a panel, tmm4-5 the two A tiles, tmm6-7 two B tiles, so every B tile feeds two
 * multiplies; the panel is re-read from L2 per pair. While the tiles work, the next panel of
 * the thread's run is prefetched, its lines spread over the K steps. Built only where the
 * compiler targets AMX-BF16 (and AVX512-BF16 for the rounding); the process asks the kernel
 * for the tile state once. Timings against oneDNN (`python -m benchmarks.gemm --dtype
 * bfloat16`): docs/cpu-kernels.md.
 */
#define _GNU_SOURCE /* syscall() (amx_tiles.h) under -std=c11 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define NP 64 /* panel width: 4 column tiles of 16 */
#define KB 32 /* K per tile step */
#define PF_HINT _MM_HINT_T1 /* to L2: the panel is re-read from there per row block */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "amx_tiles.h"
#include "panel_runs.h"

int llmsvc_gemm_bf16_amx_supported(void) { return amx_permission(); }

/* mr1 == 0: one row block of mr rows (tmm0-4 mr rows); else two blocks, 16 and mr1 rows */
static void configure(int mr, int mr1) {
    amx_tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        if (!mr1) cfg.rows[t] = t < 5 ? (uint8_t)mr : 16; /* C and A: mr rows; B: 16 K pairs */
        else cfg.rows[t] = (t == 2 || t == 3 || t == 5) ? (uint8_t)mr1 : 16;
    }
    _tile_loadconfig(&cfg);
}

/* c[r, lo : nc] = bf16(acc[r, lo : nc] + bias) for r < mr; acc rows `lda_acc` floats apart */
static inline void store_acc(const float *acc, int lda_acc, uint16_t *c, int64_t ldc,
                             const uint16_t *bias, int mr, int nc) {
    for (int lo = 0; lo < nc; lo += 16) {
        const int n = nc - lo;
        const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
        __m512 bv = _mm512_setzero_ps();
        if (bias) bv = _mm512_castsi512_ps(_mm512_slli_epi32(
                           _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + lo)), 16));
        for (int r = 0; r < mr; r++) {
            const __m512 v = _mm512_add_ps(_mm512_load_ps(acc + r * lda_acc + lo), bv);
            _mm256_mask_storeu_epi16(c + r * ldc + lo, m, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

/* q lines of the next panel per K step (pf NULL: none), so its stream from DRAM keeps
 * running while the tiles work on this one */
static inline const char *prefetch_lines(const char *pf, int q) {
    if (!pf) return pf;
    for (int j = 0; j < q; j++) _mm_prefetch(pf + j * 64, PF_HINT);
    return pf + q * 64;
}

/* rows [m0, m0 + mr) of C against panel p (nc valid columns) */
static inline void block(const uint16_t *a, int64_t lda, const uint16_t *panel, int64_t nkb,
                         uint16_t *c, int64_t ldc, const uint16_t *bias, int mr, int nc,
                         const char *pf, int q) {
    float acc[16][NP] __attribute__((aligned(64)));
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < nkb; kb++) {
        const uint16_t *b = panel + kb * (4 * 512);
        pf = prefetch_lines(pf, q);
        _tile_loadd(4, a + kb * KB, lda * 2);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, b + 1024, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 1536, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, &acc[0][0], NP * 4);
    _tile_stored(1, &acc[0][16], NP * 4);
    _tile_stored(2, &acc[0][32], NP * 4);
    _tile_stored(3, &acc[0][48], NP * 4);
    store_acc(&acc[0][0], NP, c, ldc, bias, mr, nc);
}

/* rows [0, 16) and [16, 16 + mr1) against panel p: tmm0-1 / tmm2-3 accumulate the two row
 * blocks over a pair of column tiles, tmm4-5 hold the two A tiles, tmm6-7 the two B tiles,
 * so every tile load feeds two multiplies */
static inline void block2(const uint16_t *a, int64_t lda, const uint16_t *panel, int64_t nkb,
                          uint16_t *c, int64_t ldc, const uint16_t *bias, int mr1, int nc,
                          const char *pf, int q) {
    float acc[32][32] __attribute__((aligned(64)));
    for (int jp = 0; jp < 4; jp += 2) {
        if (16 * jp >= nc) break;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t kb = 0; kb < nkb; kb++) {
            const uint16_t *b = panel + kb * (4 * 512) + jp * 512;
            pf = prefetch_lines(pf, q);
            _tile_loadd(4, a + kb * KB, lda * 2);
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a + 16 * lda + kb * KB, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, &acc[0][0], 32 * 4);
        _tile_stored(1, &acc[0][16], 32 * 4);
        _tile_stored(2, &acc[16][0], 32 * 4);
        _tile_stored(3, &acc[16][16], 32 * 4);
        const int ncj = nc - 16 * jp < 32 ? nc - 16 * jp : 32;
        store_acc(&acc[0][0], 32, c + 16 * jp, ldc, bias ? bias + 16 * jp : 0, 16 + mr1, ncj);
    }
}

typedef struct {
    const uint16_t *a, *packed, *bias;
    uint16_t *c;
    int64_t lda, ldc, M, N, K, nkb, share;
    int q;
} amx_t;

typedef struct {
    const amx_t *g;
    int cur; /* the tile configuration this thread loaded: mr + 64 * mr1, 0 = none */
} amx_thread_t;

/* every row block of C against panel p; prefetches panel pf_p (-1: none) */
static void amx_panel(void *ctx, int64_t p, int64_t pf_p) {
    amx_thread_t *th = (amx_thread_t *)ctx;
    const amx_t *g = th->g;
    const int64_t K = g->K, M = g->M;
    const uint16_t *panel = g->packed + p * K * NP;
    const int nc = (int)(g->N - p * NP < NP ? g->N - p * NP : NP);
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int mr = (int)(M - m0 < 16 ? M - m0 : 16);
        const int mr1 = (int)(M - m0 <= 16 ? 0 : M - m0 - 16 < 16 ? M - m0 - 16 : 16);
        const int key = mr + 64 * mr1;
        if (key != th->cur) configure(mr, mr1), th->cur = key;
        /* a pair of row blocks takes its two shares over its 2 * nkb steps */
        const char *pf = pf_p >= 0 ? (const char *)(g->packed + pf_p * K * NP) + (m0 / 16) * g->share * 64 : 0;
        const uint16_t *bias = g->bias ? g->bias + p * NP : 0;
        if (mr1) block2(g->a + m0 * g->lda, g->lda, panel, g->nkb, g->c + m0 * g->ldc + p * NP, g->ldc, bias,
                        mr1, nc, pf, g->q);
        else block(g->a + m0 * g->lda, g->lda, panel, g->nkb, g->c + m0 * g->ldc + p * NP, g->ldc, bias, mr, nc,
                   pf, g->q);
    }
}

/* a [M, K] bf16 (row stride lda elements), packed as above (64-byte aligned), bias [N] or NULL,
 * c [M, N] bf16 (row stride ldc); K % 32 == 0; nt OpenMP threads sharing the panels as
 * panel_runs.h says. Returns -1 (nothing written) when AMX is unavailable or the arguments are
 * bad. */
int llmsvc_gemm_bf16_amx(const uint16_t *a, int64_t lda, const uint16_t *packed, const uint16_t *bias,
                         uint16_t *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    if (!llmsvc_gemm_bf16_amx_supported() || ((uintptr_t)packed) % 64 || M < 0 || N <= 0 || K <= 0 ||
        K % KB || lda < K || (N + NP - 1) / NP >= (1ll << 31))
        return -1;
    const int64_t np = (N + NP - 1) / NP, nkb = K / KB;
    /* the next panel's K * 2 lines, a share per row block of this panel, q lines per K step
     * (a prefetch never faults, so the last share may run past the panel's end) */
    const int64_t nb = (M + 15) / 16, share = (K * 2 + nb - 1) / nb;
    const amx_t g = {a, packed, bias, c, lda, ldc, M, N, K, nkb, share, (int)((share + nkb - 1) / nkb)};
    nt = nt < 1 ? 1 : nt > MAX_NT ? MAX_NT : nt;
    range_t ranges[MAX_NT] __attribute__((aligned(64)));
    split_runs(ranges, nt, np);
    _Pragma("omp parallel num_threads(nt) if (nt > 1 && np > 1)")
    {
        amx_thread_t th = {&g, 0};
        run_panels(ranges, nt, omp_get_thread_num(), omp_get_num_threads(), amx_panel, &th);
        if (th.cur) _tile_release();
    }
    return 0;
}

#else
int llmsvc_gemm_bf16_amx_supported(void) { return 0; }

int llmsvc_gemm_bf16_amx(const uint16_t *a, int64_t lda, const uint16_t *packed, const uint16_t *bias,
                         uint16_t *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    (void)a; (void)lda; (void)packed; (void)bias; (void)c; (void)ldc; (void)M; (void)N; (void)K; (void)nt;
    return -1;
}
#endif
