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
 * While it computes, it prefetches the thread's next panel, its lines split evenly over the
 * row blocks (and on AVX2 over a block's passes), so the weight stream from DRAM runs on while
 * the FMAs work on L2-resident data. Panels are not handed out by OpenMP's dynamic schedule:
 * the panel a thread takes next would not be the one it prefetched. A thread done with its run
 * steals from the back of another's (panel_runs.h), so a preempted thread does not hold the
 * others at the barrier. Timings against MKL: docs/cpu-kernels.md.
 *
 * Rows are taken in chunks of 256 so a chunk of A stays in L2. The caller keeps the panel
 * (K * 192 bytes) well inside L2 (K <= 4096). Built with AVX-512F or AVX2 + FMA; elsewhere
 * the entry point returns -1 and the caller uses its other GEMM.
 *
 * bf16 without AMX or AVX512-BF16 (llmsvc_gemm_bf16_widen, behind gemm_bf16.c; AVX2 or plain
 * AVX-512F): A, the panels (packed as above with bf16 elements, half the bytes to stream),
 * the bias and C are bf16. The micro-kernel widens each panel vector to fp32 as it loads it (a
 * zero-extend and a shift, beside the FMAs), or, for many row blocks, a thread widens the panel
 * once into its own buffer (WIDEN_MIN_BLOCKS); A is widened as it is packed (AVX2: [K][6]
 * blocks; AVX-512: rows, read by the kernel as fp32 A), and the fp32
 * accumulators are rounded to bf16 once on the store: the same arithmetic as llmsvc_gemm_f32
 * on the widened operands, bit for bit, with one rounding as F.linear's bf16 GEMMs.
 *
 * GGUF blocks (llmsvc_gemm_q8): int8 panels with scale and offset panels, turned back into fp32
 * as they are used (gemm_gguf.h).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "panel_runs.h"

#define NR 48 /* panel width: 3 zmm or 6 ymm of fp32 */
#define MC 256
#define BF_B 1 /* a kernel's panel is bf16 (the `bf` flags of the micro-kernels) */
#define BF_C 2 /* a kernel's C is bf16 */

/* A micro-kernel's k loop over its FMA_FOUR / FMA_ROWS (four k / one k, defined per ISA below,
 * expanded here at the use): with pf (a char pointer, advanced) q lines of the next panel
 * prefetched every 4 k, into L2 (T1): a panel (K * 192 bytes, 110 KB at K = 576) outgrows L1
 * and every row block reads it from L2 anyway; T1 was 1-4% faster than T0 at 1-16 rows
 * (docs/cpu-kernels.md). Then the K % 4 tail. */
#define K_LOOP(pf)                                                                        \
    do {                                                                                  \
        int64_t k = 0;                                                                    \
        if (pf) {                                                                         \
            for (; k + 4 <= K; k += 4) {                                                  \
                for (int j = 0; j < q; j++) _mm_prefetch((pf) + j * 64, _MM_HINT_T1);     \
                (pf) += q * 64;                                                           \
                FMA_FOUR(k);                                                              \
            }                                                                             \
        } else {                                                                          \
            for (; k + 4 <= K; k += 4) FMA_FOUR(k);                                       \
        }                                                                                 \
        for (; k < K; k++) FMA_ROWS(k);                                                   \
    } while (0)

#if defined(__AVX512F__)
#include "gemm_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "gemm_avx2.h"
#endif

#ifndef PACK_A
#define PACK_A 0
#endif
#ifndef NP
#define NP NR /* the panel is one [K][48] block */
#endif
#ifndef BF16_WIDEN
#define BF16_WIDEN 0
#endif
#ifndef WIDEN_A_ROWS
#define WIDEN_A_ROWS 0 /* bf16 A widened into apack as rows [mr][K] (kernels that read A by rows) */
#endif
/* bf16: row blocks per chunk from which a thread widens each panel once into its buffer and runs
 * the fp32-panel kernel, instead of widening every panel vector in registers in each row block
 * (4 more uops per 12 FMAs). In registers is faster for few blocks (one weight pass of the
 * default model: 15.6-17.7 against 24.7 ms at M = 1, 36-37 against 49 at M = 16), the buffer
 * for many (424 against 455 ms at M = 256, 1797 against 1918 at M = 1024); 32-128 rows were
 * within the noise (benchmarks/gemm.py, AVX2 Zen 3). */
#define WIDEN_MIN_BLOCKS 8

#ifdef GEMM_F32
int llmsvc_gemm_f32_supported(void) { return 1; }

/* Columns of a sub-panel: each panel [K][48] is stored as 48 / this blocks [K][this]. */
int llmsvc_gemm_f32_subpanel(void) { return NP; }

#define KERNEL_CASE(R)                                                                     \
    case R:                                                                                \
        if (BF16_WIDEN && bf == (BF_B | BF_C))                                             \
            kernel(R, a, lda, b, K, c, ldc, nc, bias, pf, q, pq, BF_B | BF_C);             \
        else if (BF16_WIDEN && bf == BF_C)                                                 \
            kernel(R, a, lda, b, K, c, ldc, nc, bias, pf, q, pq, BF_C);                    \
        else                                                                               \
            kernel(R, a, lda, b, K, c, ldc, nc, bias, pf, q, pq, 0);                       \
        break;

/* bf: BF_B (b bf16) and / or BF_C (c bf16); a constant in each kernel instance */
static void row_block(int mr, const float *a, int64_t lda, const void *b, int64_t K, void *c,
                      int64_t ldc, int nc, const float *bias, const char *pf, int q, int pq, int bf) {
    switch (mr) {
        KERNEL_CASE(1) KERNEL_CASE(2) KERNEL_CASE(3) KERNEL_CASE(4) KERNEL_CASE(5) KERNEL_CASE(6)
#if MR == 8
        KERNEL_CASE(7) KERNEL_CASE(8)
#endif
    }
}

typedef struct {
    const char *a, *packed; /* A [M, K] and the panels: esz bytes per element */
    const float *bias;      /* fp32 (a bf16 bias is widened by the caller) */
    float *apack;           /* PACK_A: the chunk's row blocks, [nb][K][MR] */
    float *wide;            /* bf16: [nt][K * NR], each thread's widened panel */
    char *c;                /* C [M, N]: esz bytes per element */
    int64_t lda, ldc, N, K, m0, mc, nb, share, steps, esz;
    const char *end;
    int q, pq;              /* prefetch: q lines every 4 k in each of a row block's first pq passes */
    int64_t wsz;            /* bytes per panel element: esz, or 1 for GGUF blocks */
    const float *qd, *qm;   /* GGUF blocks: scale and offset panels [np][K / bs][48]; else NULL */
    int64_t bs;             /* GGUF blocks: weights per scale (16 or 32) */
} gemm_t;

#include "gemm_gguf.h"

/* all row blocks of rows [m0, m0 + mc) against panel p; prefetches panel pf_p (-1: none) */
static void do_panel(void *ctx, int64_t p, int64_t pf_p) {
    const gemm_t *g = (const gemm_t *)ctx;
    const int64_t K = g->K, bytes = K * NR * g->wsz; /* one panel */
    const char *panel = g->packed + p * bytes;
    int bf = 0;
    if (g->qd && g->mc <= Q8_REG_MAX_M) {
        q8_panel_rows(g, p);
        return;
    }
    if (g->qd) { /* dequantized once here, read by nb row blocks */
        float *w = g->wide + (int64_t)omp_get_thread_num() * K * NR;
        dequant_panel(w, (const int8_t *)panel, g->qd + p * (K / g->bs) * NR, g->qm + p * (K / g->bs) * NR, K, g->bs);
        panel = (const char *)w;
    }
#if BF16_WIDEN
    if (g->esz == 2 && g->nb >= WIDEN_MIN_BLOCKS) { /* widened once here, read by nb row blocks */
        float *w = g->wide + (int64_t)omp_get_thread_num() * K * NR;
        widen_panel(w, (const uint16_t *)panel, K * NR);
        panel = (const char *)w;
        bf = BF_C;
    } else if (g->esz == 2) {
        bf = BF_B | BF_C;
    }
#endif
    const int nc = (int)(g->N - p * NR < NR ? g->N - p * NR : NR);
    for (int64_t i = 0; i < g->nb; i++) {
        const int64_t m = i * MR;
        const char *pf = pf_p < 0 ? 0 : g->packed + pf_p * bytes + i * g->share * 64;
        if (pf && pf + (int64_t)g->q * g->steps * g->pq * 64 > g->end) pf = 0;
        const float *a = PACK_A ? g->apack + i * K * MR : (const float *)g->a + (g->m0 + m) * g->lda;
        int64_t lda = g->lda;
        if (WIDEN_A_ROWS && g->esz == 2) a = g->apack + m * K, lda = K;
        row_block((int)(g->mc - m < MR ? g->mc - m : MR), a, lda, panel, K,
                  g->c + ((g->m0 + m) * g->ldc + p * NR) * g->esz, g->ldc, nc,
                  g->bias ? g->bias + p * NR : 0, pf, g->q, g->pq, bf);
    }
}

/* Row block i of the chunk into apack as [K][MR], widened from bf16 if need be (rows past the
 * chunk: zero); WIDEN_A_ROWS builds, which call it for bf16 A only: the rows widened as they
 * are, [mr][K] at apack + i MR K */
static void pack_block(const gemm_t *g, int64_t i) {
    const int64_t K = g->K, m = i * MR, mr = g->mc - m < MR ? g->mc - m : MR;
    float *dst = g->apack + i * K * MR;
    if (WIDEN_A_ROWS) {
        const uint16_t *src = (const uint16_t *)g->a + (g->m0 + m) * g->lda;
        for (int64_t r = 0; r < mr; r++)
            for (int64_t k = 0; k < K; k++) dst[r * K + k] = bf16_to_f32(src[r * g->lda + k]);
        return;
    }
    if (g->esz == 2) {
        const uint16_t *src = (const uint16_t *)g->a + (g->m0 + m) * g->lda;
        for (int64_t k = 0; k < K; k++)
            for (int64_t r = 0; r < MR; r++) dst[k * MR + r] = r < mr ? bf16_to_f32(src[r * g->lda + k]) : 0.f;
        return;
    }
    const float *src = (const float *)g->a + (g->m0 + m) * g->lda;
    for (int64_t k = 0; k < K; k++)
        for (int64_t r = 0; r < MR; r++) dst[k * MR + r] = r < mr ? src[r * g->lda + k] : 0.f;
}

/* The calling thread's scratch buffer `slot` for n floats (64-byte aligned); kept between
 * calls (a decode step makes a hundred), grown when a call needs more. NULL when out of memory.
 * Slots: 0 = packed A, 1 = widened bias, 2 = widened panels. */
static float *scratch(int slot, int64_t n) {
    static __thread float *buf[3];
    static __thread int64_t cap[3];
    if (n > cap[slot]) {
        free(buf[slot]);
        buf[slot] = aligned_alloc(64, (n * 4 + 63) / 64 * 64);
        cap[slot] = buf[slot] ? n : 0;
    }
    return buf[slot];
}

/* esz 4: fp32 A, panels, C; esz 2: bf16 (BF16_WIDEN builds only). bias: fp32 or NULL.
 * quant: `packed` is a GGUF-block blob (gemm_gguf.h), A and C fp32 (esz 4). */
static int gemm_run(const void *a, int64_t lda, const void *packed, const float *bias, void *c,
                    int64_t ldc, int64_t M, int64_t N, int64_t K, int nt, int64_t esz, int quant) {
    if (((uintptr_t)packed) % 64 || M < 0 || N <= 0 || K <= 0 || lda < K || ldc < N || N / NR >= (1ll << 31))
        return -1;
    const int64_t bs = quant ? *(const int32_t *)packed : 1;
    if (quant && ((bs != 16 && bs != 32) || K % bs || esz != 4)) return -1;
    if (quant) packed = (const char *)packed + GGUF_HEADER;
    const int64_t np = (N + NR - 1) / NR, wsz = quant ? 1 : esz;
    const float *qd = quant ? (const float *)((const char *)packed + np * K * NR) : 0;
    const float *qm = quant ? qd + np * (K / bs) * NR : 0;
    nt = nt < 1 ? 1 : nt > MAX_NT ? MAX_NT : nt;
    float *apack = 0, *wide = 0;
    const int64_t mc0 = M < MC ? M : MC; /* the first (largest) chunk's rows */
    const int in_registers = quant && mc0 <= Q8_REG_MAX_M; /* GGUF blocks: no packed A, no buffer */
    const int pack_a = PACK_A ? !in_registers : WIDEN_A_ROWS && esz == 2;
    if (pack_a && M > 0 && !(apack = scratch(0, (mc0 + MR - 1) / MR * MR * K))) return -1;
    /* the panel buffers only where a chunk has the row blocks do_panel widens into them for */
    if (((quant && !in_registers) || (esz == 2 && (mc0 + MR - 1) / MR >= WIDEN_MIN_BLOCKS))
        && !(wide = scratch(2, nt * K * NR)))
        return -1;
    const char *end = (const char *)packed + np * K * NR * wsz;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        gemm_t g = {.a = a, .packed = packed, .bias = bias, .apack = apack, .wide = wide, .c = c, .lda = lda,
                    .ldc = ldc, .N = N, .K = K, .m0 = m0, .esz = esz, .end = end, .wsz = wsz, .qd = qd, .qm = qm,
                    .bs = bs};
        g.mc = M - m0 < MC ? M - m0 : MC;
        g.nb = (g.mc + MR - 1) / MR;
        /* the next panel's lines, split over this panel's nb row blocks, and a block's share
         * over as many of its NR / NP passes as take at least a line every 4 k: the weight
         * stream then runs through all the passes of a few row blocks (AVX2, 16 rows: 14% off
         * a pass over the default model's weights), and many blocks issue no more prefetches */
        g.share = ((K * NR * wsz + 63) / 64 + g.nb - 1) / g.nb;
        g.steps = K / 4 > 0 ? K / 4 : 1;
        g.pq = (int)((g.share + g.steps - 1) / g.steps);
        g.pq = g.pq < NR / NP ? g.pq : NR / NP;
        g.q = (int)((g.share + g.steps * g.pq - 1) / (g.steps * g.pq));
        range_t ranges[MAX_NT] __attribute__((aligned(64)));
        split_runs(ranges, nt, np);
        _Pragma("omp parallel num_threads(nt) if (nt > 1 && np > 1)")
        {
            const int me = omp_get_thread_num(), team = omp_get_num_threads();
            if (pack_a && !(quant && g.mc <= Q8_REG_MAX_M)) { /* a short last chunk of GGUF rows: registers */
                for (int64_t i = me; i < g.nb; i += team) pack_block(&g, i);
                _Pragma("omp barrier")
            }
            run_panels(ranges, nt, me, team, do_panel, &g);
        }
    }
    return 0;
}

/* a [M, K] (row stride lda), packed [ceil(N / 48)][K][48] (64-byte aligned), bias [N] or
 * NULL, c [M, N] (row stride ldc); nt OpenMP threads sharing the panels as panel_runs.h says. */
int llmsvc_gemm_f32(const float *a, int64_t lda, const float *packed, const float *bias, float *c,
                    int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    return gemm_run(a, lda, packed, bias, c, ldc, M, N, K, nt, 4, 0);
}

/* llmsvc_gemm_f32's contract with a GGUF-block blob (gemm_gguf.h, 64-byte aligned):
 * W[n, k] = d * q + m */
int llmsvc_gemm_q8(const float *a, int64_t lda, const void *blob, const float *bias, float *c,
                   int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    return gemm_run(a, lda, blob, bias, c, ldc, M, N, K, nt, 4, 1);
}

#else
int llmsvc_gemm_f32_supported(void) { return 0; }
int llmsvc_gemm_f32_subpanel(void) { return 0; }

int llmsvc_gemm_f32(const float *a, int64_t lda, const float *packed, const float *bias, float *c,
                    int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    (void)a; (void)lda; (void)packed; (void)bias; (void)c; (void)ldc; (void)M; (void)N; (void)K; (void)nt;
    return -1;
}

int llmsvc_gemm_q8(const float *a, int64_t lda, const void *blob, const float *bias, float *c,
                   int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    (void)a; (void)lda; (void)blob; (void)bias; (void)c; (void)ldc; (void)M; (void)N; (void)K; (void)nt;
    return -1;
}
#endif

int llmsvc_gemm_bf16_widen_supported(void) { return BF16_WIDEN; }

/* llmsvc_gemm_f32's contract with bf16 a, packed (the same panel layout), bias and c; -1 where
 * not built (BF16_WIDEN 0) */
int llmsvc_gemm_bf16_widen(const uint16_t *a, int64_t lda, const uint16_t *packed, const uint16_t *bias,
                           uint16_t *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
#if BF16_WIDEN
    float *b32 = 0;
    if (bias) {
        if (N <= 0 || !(b32 = scratch(1, N))) return -1;
        for (int64_t n = 0; n < N; n++) b32[n] = bf16_to_f32(bias[n]);
    }
    return gemm_run(a, lda, packed, b32, c, ldc, M, N, K, nt, 2, 0);
#else
    (void)a; (void)lda; (void)packed; (void)bias; (void)c; (void)ldc; (void)M; (void)N; (void)K; (void)nt;
    return -1;
#endif
}
