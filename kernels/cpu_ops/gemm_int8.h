/* Shared by the int8 GEMM files (gemm_int8.c: driver, detection; gemm_int8_avx2.c;
 * gemm_int8_vnni.c; gemm_int8_amx.c). kernels/cpu_ops/int8.py packs the weights; the layout is restated here.
 *
 * Header: int32 MAGIC, N, K, Kp, qmax (the weights' range, |q_w| <= qmax: 127, or 64 for the
 * avx2_w7 path, whose int16 pair sums hold only that), then zeros to 64 bytes.
 * Weights, per panel p of NP = 16 output columns: [Kp / 4][16][4] int8, the k-quad row g holding
 * q_w[16 p + c, 4 g + e] at [g][c][e] (64 bytes, one line), zero past N and K; Kp = K rounded up
 * to 64. Per column: fp32 scale s_w, int32 colsum = sum_k q_w.
 * Activations, quantized by the driver per row into `aq` [M][Kp] in the format the ISA path
 * reads (int16 for AVX2, uint8 = q + 128 for AVX2_W7 and VNNI, int8 for AMX), zero (q = 0) past K. The
 * buffer holds M rounded up to 16 rows, the extra ones zero bytes (AMX reads whole 16-row tiles).
 *
 * Every ISA kernel computes, for rows r0 .. r0 + mr - 1 (mr <= its MR) and one panel, the
 * integer sums over all of Kp into acc[mr][16] int32, offset by +128 colsum for the u8 paths;
 * the driver's epilogue turns them into outputs, so the paths differ only in those sums.
 */
#ifndef LLMSVC_GEMM_INT8_H
#define LLMSVC_GEMM_INT8_H
#include <stdint.h>

#define I8_NP 16
#define I8_KQ 64

/* int8.py's ISAS, in order */
enum { I8_REF = 0, I8_AVX2 = 1, I8_AVX2_W7 = 2, I8_AVXVNNI = 3, I8_AVX512VNNI = 4, I8_AMX = 5, I8_NISA = 6 };
#define I8_W7_QMAX 64 /* 255 * 64 * 2 = 32640 fits vpmaddubsw's int16 */

typedef struct {
    const int8_t *panels; /* [np][Kp / 4][16][4] */
    int64_t Kp;
    const void *aq; /* [M][Kp] quantized activations, element size by ISA */
} i8_gemm_t;

/* acc[mr][16] = sums of rows r0.. over panel p (see above). pf: where to prefetch one line per
 * k-quad (the next panel, read at the pace this one is; the AVX2 and AMX kernels), or NULL */
typedef void (*i8_kernel_fn)(const i8_gemm_t *g, int64_t r0, int mr, int64_t p, const int8_t *pf,
                             int32_t acc[][I8_NP]);

/* CPU and OS support, by runtime detection (cpuid, xgetbv, and for AMX the tile permission) */
int i8_cpu_has(int isa);

void i8_kernel_avx2(const i8_gemm_t *g, int64_t r0, int mr, int64_t p, const int8_t *pf,
                    int32_t acc[][I8_NP]);
void i8_kernel_avx2_w7(const i8_gemm_t *g, int64_t r0, int mr, int64_t p, const int8_t *pf,
                       int32_t acc[][I8_NP]);
void i8_kernel_avxvnni(const i8_gemm_t *g, int64_t r0, int mr, int64_t p, const int8_t *pf,
                       int32_t acc[][I8_NP]);
void i8_kernel_avx512vnni(const i8_gemm_t *g, int64_t r0, int mr, int64_t p, const int8_t *pf,
                          int32_t acc[][I8_NP]);
void i8_kernel_amx(const i8_gemm_t *g, int64_t r0, int mr, int64_t p, const int8_t *pf,
                   int32_t acc[][I8_NP]);
int i8_amx_permitted(void);
void i8_amx_begin(void); /* per thread, before its first i8_kernel_amx of a call */
void i8_amx_end(void);   /* per thread, after its last */

#define I8_MR_AVX2 6
#define I8_MR_AVX2_W7 6
#define I8_MR_AVXVNNI 6
#define I8_MR_AVX512VNNI 8
#define I8_MR_AMX 64
#define I8_MR_MAX 64
#endif
