/* int8 GEMM for `--quantization int8`: C[M, N] = dequant(quant(A) @ Wq^T) (+ bias), A and C fp32
 * or bf16, Wq per-channel int8 packed by kernels/cpu_ops/int8.py (layout in gemm_int8.h). The
 * formula and its torch reference: kernels/reference_int8.py; the integer sums are exact on
 * every path, so the paths agree with the reference up to the fp32 epilogue's last place.
 *
 * One entry, llmsvc_gemm_i8(isa, ...): the driver quantizes A per row (amax, then
 * round-half-even(x * (127 / amax))) into the ISA's activation format, shares the panels
 * over the threads (panel_runs.h) row block by row block, and turns each block's sums into
 * outputs. The ISA paths, each chosen only where cpuid and the OS say it runs and LLMSVC_CPU_ISA
 * does not cap it (i8_cpu_has; the code of all of them is compiled on every x86 build through
 * target attributes, whatever -march=native allows):
 *   AVX2 (gemm_int8_avx2.c): the int8 weights widened to int16 in registers and multiplied
 *     with int16 activations by vpmaddwd. Weights stay int8 in memory (the decode stream); a
 *     panel's first row block prefetches the next panel (panel_job).
 *   AVX2_W7 (gemm_int8_avx2.c), for blobs packed with weights in -64 .. 64: vpmaddubsw on
 *     u8 = q + 128 activations, a third fewer operations per multiply-add than AVX2's; the
 *     epilogue subtracts 128 colsum.
 *   AVX-VNNI, AVX512-VNNI (gemm_int8_vnni.c): vpdpbusd on u8 activations, as AVX2_W7.
 *   AMX-INT8 (gemm_int8_amx.c): tdpbssd on s8 x s8 tiles.
 */
#include <stdint.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "gemm_int8.h"
#include "panel_runs.h"

/* rows per block, a multiple of the ISA's MR: 96 x Kp int16 (AVX2) stays in L2; AMX takes two
 * of its 64-row calls per block */
#define MC 96
#define MC_AMX 128
#define HEADER 64
#define MAGIC 0x38544E49

/* ---- runtime detection ---- */

static uint64_t xcr0(void) {
    uint32_t a, b, c, d;
    __cpuid(1, a, b, c, d);
    if (!(c & (1u << 27))) return 0; /* no OSXSAVE: no xgetbv */
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

int i8_cpu_has(int isa) {
    uint32_t a, b, c, d, a1 = 0, b1, c1, d1;
#ifdef LLMSVC_CPU_ISA_LEVEL
    /* LLMSVC_CPU_ISA's cap (kernels/cpu_ops/isa.py's LEVELS index): the lowest level with each path,
     * AVX-VNNI counted with AVX-512 as isa.py removes it */
    static const int min_level[I8_NISA] = {0, 1, 1, 2, 3, 5};
    if (LLMSVC_CPU_ISA_LEVEL < min_level[isa]) return 0;
#endif
    if (__get_cpuid_max(0, 0) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    if (a >= 1) __cpuid_count(7, 1, a1, b1, c1, d1);
    const uint64_t x = xcr0();
    const int avx_os = (x & 0x6) == 0x6, avx512_os = avx_os && (x & 0xe0) == 0xe0;
    const int avx2 = avx_os && (b & (1u << 5));
    switch (isa) {
    case I8_AVX2: case I8_AVX2_W7: return avx2;
    case I8_AVXVNNI: return avx2 && (a1 & (1u << 4));
    case I8_AVX512VNNI: return avx512_os && (b & (1u << 16)) && (b & (1u << 30)) && (c & (1u << 11));
    case I8_AMX:
        return (d & (1u << 24)) && (d & (1u << 25)) && (x & (3ull << 17)) == (3ull << 17) && i8_amx_permitted();
    default: return 0;
    }
}

/* The widest weight range (|q_w| <= this) path isa multiplies exactly: what int8.py packs for it */
int llmsvc_gemm_i8_qmax(int isa) { return isa == I8_AVX2_W7 ? I8_W7_QMAX : 127; }

int llmsvc_gemm_i8_supported(int isa) {
    static int cache[I8_NISA]; /* 0 unknown, 1 yes, -1 no */
    if (isa <= I8_REF || isa >= I8_NISA) return 0;
    if (!cache[isa]) cache[isa] = i8_cpu_has(isa) ? 1 : -1;
    return cache[isa] == 1;
}

/* ---- activations ---- */

/* row x (K values, fp32 or bf16) -> aq row (Kp values in the ISA's format), returns s_a.
 * Exactly reference_int8.int8_linear's: v = x * sinv (SmoothQuant's 1 / f, kept in tmp [K] so
 * that no reassociation folds it into the next multiply), one fp32 division for
 * inv = 127 / amax(|v|), then rint(v * inv). */
static float quantize_row(const void *x, int dtype, int64_t K, int64_t Kp, int isa, const float *sinv,
                          float *tmp, void *out) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; k++) {
        const float v = dtype ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        tmp[k] = v * sinv[k];
        amax = fmaxf(amax, fabsf(tmp[k]));
    }
    const float inv = amax > 0.f ? 127.0f / amax : 0.f;
    for (int64_t k = 0; k < K; k++) tmp[k] = fminf(fmaxf(rintf(tmp[k] * inv), -127.f), 127.f);
    if (isa == I8_AVX2) {
        int16_t *o = out;
        for (int64_t k = 0; k < Kp; k++) o[k] = k < K ? (int16_t)tmp[k] : 0;
    } else if (isa == I8_AMX) {
        int8_t *o = out;
        for (int64_t k = 0; k < Kp; k++) o[k] = k < K ? (int8_t)tmp[k] : 0;
    } else {
        uint8_t *o = out;
        for (int64_t k = 0; k < Kp; k++) o[k] = (uint8_t)((k < K ? (int)tmp[k] : 0) + 128);
    }
    return amax / 127.0f;
}

/* ---- driver ---- */

typedef struct {
    i8_gemm_t g;
    i8_kernel_fn kern;
    int isa, mr, dtype;
    int64_t mc, m0, mb, N, ldc;
    const float *sa, *sw;
    const int32_t *colsum; /* NULL unless the u8 offset is to be undone */
    const void *bias;
    void *c;
} job_t;

/* rows [r0, r0 + mr) x panel p: sums -> C (+ bias), in C's dtype */
static void epilogue(const job_t *j, int64_t r0, int mr, int64_t p, int32_t acc[][I8_NP]) {
    const int64_t n0 = p * I8_NP, nc = j->N - n0 < I8_NP ? j->N - n0 : I8_NP;
    float sw[I8_NP], b[I8_NP];
    int32_t off[I8_NP];
    for (int c = 0; c < I8_NP; c++) {
        sw[c] = j->sw[n0 + c];
        off[c] = j->colsum ? 128 * j->colsum[n0 + c] : 0;
        b[c] = (!j->bias || c >= nc) ? 0.f
               : j->dtype ? bf16_to_f32(((const uint16_t *)j->bias)[n0 + c]) : ((const float *)j->bias)[n0 + c];
    }
    for (int r = 0; r < mr; r++) {
        const float sa = j->sa[r0 + r];
        float v[I8_NP];
        for (int c = 0; c < I8_NP; c++) v[c] = (float)(acc[r][c] - off[c]) * sa * sw[c] + b[c];
        if (j->dtype) {
            uint16_t *cr = (uint16_t *)j->c + (r0 + r) * j->ldc + n0;
            for (int c = 0; c < nc; c++) cr[c] = f32_to_bf16(v[c]);
        } else {
            memcpy((float *)j->c + (r0 + r) * j->ldc + n0, v, nc * sizeof(float));
        }
    }
}

/* Panel p for the block's rows; the first row block prefetches panel pf (the next this thread
 * takes, -1: none) as it reads p, so a few rows (a decode) stream the weights at memory's pace
 * rather than a line's latency at a time, the hardware prefetchers stopping at each 4 KB page. */
static void panel_job(void *ctx, int64_t p, int64_t pf) {
    const job_t *j = ctx;
    int32_t acc[I8_MR_MAX][I8_NP] __attribute__((aligned(64)));
    for (int64_t r = j->m0; r < j->m0 + j->mb; r += j->mr) {
        const int mr = j->m0 + j->mb - r < j->mr ? (int)(j->m0 + j->mb - r) : j->mr;
        const int8_t *next = r == j->m0 && pf >= 0 ? j->g.panels + pf * j->g.Kp * I8_NP : NULL;
        j->kern(&j->g, r, mr, p, next, acc);
        epilogue(j, r, mr, p, acc);
    }
}

static int setup(job_t *j, int isa) {
    j->isa = isa;
    j->mc = MC;
    switch (isa) {
    case I8_AVX2: j->kern = i8_kernel_avx2, j->mr = I8_MR_AVX2; return 2;
    case I8_AVX2_W7: j->kern = i8_kernel_avx2_w7, j->mr = I8_MR_AVX2_W7; return 1;
    case I8_AVXVNNI: j->kern = i8_kernel_avxvnni, j->mr = I8_MR_AVXVNNI; return 1;
    case I8_AVX512VNNI: j->kern = i8_kernel_avx512vnni, j->mr = I8_MR_AVX512VNNI; return 1;
    case I8_AMX: j->kern = i8_kernel_amx, j->mr = I8_MR_AMX, j->mc = MC_AMX; return 1;
    default: return 0;
    }
}

/* a [M, K] (row stride lda) fp32 (dtype 0) or bf16 (1); packed: int8.py's blob; bias [N] in
 * a's dtype or NULL; c [M, N] (row stride ldc) in a's dtype. 0, or -1 for rejected arguments
 * (an ISA this CPU lacks, a blob of another shape, weights wider than the path multiplies). */
int llmsvc_gemm_i8(int isa, const void *a, int64_t lda, int dtype, const int8_t *packed, const void *bias,
                   void *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    const int32_t *hdr = (const int32_t *)packed;
    if (!llmsvc_gemm_i8_supported(isa) || (dtype != 0 && dtype != 1) || M < 0 || hdr[0] != MAGIC
        || hdr[1] != N || hdr[2] != K || hdr[3] % I8_KQ || hdr[3] < K || ((uintptr_t)packed & 63)
        || hdr[4] < 1 || hdr[4] > llmsvc_gemm_i8_qmax(isa))
        return -1;
    if (M == 0 || N == 0) return 0;
    job_t j;
    memset(&j, 0, sizeof j);
    const int esize = setup(&j, isa);
    const int64_t Kp = hdr[3], np = (N + I8_NP - 1) / I8_NP;
    j.g.panels = packed + HEADER;
    j.g.Kp = Kp;
    j.sw = (const float *)(j.g.panels + np * I8_NP * Kp);
    const int u8 = isa == I8_AVX2_W7 || isa == I8_AVXVNNI || isa == I8_AVX512VNNI;
    j.colsum = u8 ? (const int32_t *)(j.sw + np * I8_NP) : NULL;
    const float *sinv = j.sw + 2 * np * I8_NP; /* [Kp], after the scales and colsums */
    j.dtype = dtype, j.N = N, j.ldc = ldc, j.bias = bias, j.c = c;
    const int64_t Mp = (M + 15) / 16 * 16, abytes = M * Kp * esize;
    void *aq = aligned_alloc(64, ((Mp * Kp * esize + 63) / 64) * 64);
    if (nt < 1) nt = 1;
    if (nt > MAX_NT) nt = MAX_NT;
    float *sa = malloc(M * sizeof(float)), *tmp = malloc(nt * K * sizeof(float));
    if (!aq || !sa || !tmp) return free(aq), free(sa), free(tmp), -1;
    memset((char *)aq + abytes, 0, (Mp - M) * Kp * esize);
    j.g.aq = aq, j.sa = sa;
    range_t ranges[MAX_NT];
    _Pragma("omp parallel num_threads(nt) if (nt > 1)") {
        _Pragma("omp for schedule(static)")
        for (int64_t r = 0; r < M; r++)
            sa[r] = quantize_row((const char *)a + r * lda * (dtype ? 2 : 4), dtype, K, Kp, isa, sinv,
                                 tmp + omp_get_thread_num() * K, (char *)aq + r * Kp * esize);
        if (isa == I8_AMX) i8_amx_begin();
        for (int64_t m0 = 0; m0 < M; m0 += j.mc) {
            _Pragma("omp single") {
                j.m0 = m0, j.mb = M - m0 < j.mc ? M - m0 : j.mc;
                split_runs(ranges, nt, np);
            } /* implied barrier: every thread sees this block's rows and runs */
            run_panels(ranges, nt, omp_get_thread_num(), omp_get_num_threads(), panel_job, &j);
            _Pragma("omp barrier")
        }
        if (isa == I8_AMX) i8_amx_end();
    }
    free(aq), free(sa), free(tmp);
    return 0;
}
#else /* other architectures: no native int8 GEMM (int8.py runs the torch reference) */
int llmsvc_gemm_i8_supported(int isa) { (void)isa; return 0; }
int llmsvc_gemm_i8_qmax(int isa) { (void)isa; return 127; }
int llmsvc_gemm_i8(int isa, const void *a, int64_t lda, int dtype, const int8_t *packed, const void *bias,
                   void *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    (void)isa, (void)a, (void)lda, (void)dtype, (void)packed, (void)bias, (void)c, (void)ldc, (void)M, (void)N,
        (void)K, (void)nt;
    return -1;
}
#endif
