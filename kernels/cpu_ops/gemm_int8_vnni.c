/* The int8 GEMM's VNNI kernels (gemm_int8.h has the contract; gemm_int8.c runs them only where
 * i8_cpu_has says the CPU and OS do). Compiled on every x86 build through target attributes,
 * so an AVX2-only build machine still carries them.
 *
 * vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products to an int32
 * lane, with no intermediate saturation. The activations arrive as u8 = q_a + 128 (0 .. 254),
 * so each sum is the signed one plus 128 colsum[n], which the driver's epilogue subtracts
 * (exact: |sum| < 2^31 for K < 66000).
 *
 * A panel's k-quad row (16 columns x 4 bytes) is one zmm, or two ymm: per k-quad each row's
 * 4 activation bytes are broadcast to every lane and multiplied into its accumulators.
 *   AVX512-VNNI: MR = 8 rows, 8 zmm accumulators, one panel load per 8 vpdpbusd.
 *   AVX-VNNI:    MR = 6 rows, 12 ymm accumulators (columns 0-7 and 8-15).
 */
#if defined(__x86_64__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "gemm_int8.h"

#define VNNI512_T __attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline
#define VNNI256_T __attribute__((target("avx2,avxvnni"), always_inline)) static inline

/* acc + the 4-byte dot products of u8 a and s8 w per int32 lane: vpdpbusd, with the
 * accumulator tied to its register ("+"). Through the intrinsics GCC 12 gave each k-quad's
 * result a register of its own and copied it back at the loop's end: 16 register moves per
 * 8 vpdpbusd in the AVX512-VNNI loop, and in the AVX-VNNI loop, with 16 ymm for 12
 * accumulators and their 12 copies, stores to the stack. The 256-bit form must be VEX
 * ({vex}): AVX-VNNI CPUs without AVX-512 cannot run the EVEX one, so its registers are "x"
 * (ymm0-15, all VEX can encode). Operands in GCC's order for the intrinsic: w, a, acc. */
VNNI512_T __m512i dpbusd512(__m512i acc, __m512i a, __m512i w) {
    __asm__("vpdpbusd {%2, %1, %0|%0, %1, %2}" : "+v"(acc) : "v"(a), "v"(w));
    return acc;
}

VNNI256_T __m256i dpbusd256(__m256i acc, __m256i a, __m256i w) {
    __asm__("%{vex%} vpdpbusd {%2, %1, %0|%0, %1, %2}" : "+x"(acc) : "x"(a), "x"(w));
    return acc;
}

static inline int32_t quad(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

VNNI512_T void vnni512_block(const i8_gemm_t *g, int64_t r0, int64_t p, int32_t acc[][I8_NP], const int mr) {
    const int64_t kp = g->Kp, nq = kp / 4;
    const int8_t *w = g->panels + p * kp * I8_NP;
    const uint8_t *a = (const uint8_t *)g->aq + r0 * kp;
    __m512i s[I8_MR_AVX512VNNI];
    for (int r = 0; r < mr; r++) s[r] = _mm512_setzero_si512();
    for (int64_t q = 0; q < nq; q++, w += 64) {
        const __m512i wv = _mm512_load_si512((const void *)w);
        for (int r = 0; r < mr; r++) s[r] = dpbusd512(s[r], _mm512_set1_epi32(quad(a + r * kp + 4 * q)), wv);
    }
    for (int r = 0; r < mr; r++) _mm512_storeu_si512((void *)acc[r], s[r]);
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
void i8_kernel_avx512vnni(const i8_gemm_t *g, int64_t r0, int mr, int64_t p, const int8_t *pf,
                          int32_t acc[][I8_NP]) {
    (void)pf; /* no prefetch measured on these paths */
    switch (mr) { /* constant row counts: the accumulators stay in registers */
    case 8: vnni512_block(g, r0, p, acc, 8); break;
    case 7: vnni512_block(g, r0, p, acc, 7); break;
    case 6: vnni512_block(g, r0, p, acc, 6); break;
    case 5: vnni512_block(g, r0, p, acc, 5); break;
    case 4: vnni512_block(g, r0, p, acc, 4); break;
    case 3: vnni512_block(g, r0, p, acc, 3); break;
    case 2: vnni512_block(g, r0, p, acc, 2); break;
    default: vnni512_block(g, r0, p, acc, 1); break;
    }
}

VNNI256_T void vnni256_block(const i8_gemm_t *g, int64_t r0, int64_t p, int32_t acc[][I8_NP], const int mr) {
    const int64_t kp = g->Kp, nq = kp / 4;
    const int8_t *w = g->panels + p * kp * I8_NP;
    const uint8_t *a = (const uint8_t *)g->aq + r0 * kp;
    __m256i s[I8_MR_AVXVNNI][2];
    for (int r = 0; r < mr; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
    for (int64_t q = 0; q < nq; q++, w += 64) {
        const __m256i w0 = _mm256_load_si256((const __m256i *)w), w1 = _mm256_load_si256((const __m256i *)(w + 32));
        for (int r = 0; r < mr; r++) {
            const __m256i av = _mm256_set1_epi32(quad(a + r * kp + 4 * q));
            s[r][0] = dpbusd256(s[r][0], av, w0);
            s[r][1] = dpbusd256(s[r][1], av, w1);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_si256((__m256i *)acc[r], s[r][0]);
        _mm256_storeu_si256((__m256i *)(acc[r] + 8), s[r][1]);
    }
}

__attribute__((target("avx2,avxvnni")))
void i8_kernel_avxvnni(const i8_gemm_t *g, int64_t r0, int mr, int64_t p, const int8_t *pf,
                       int32_t acc[][I8_NP]) {
    (void)pf; /* no prefetch measured on these paths */
    switch (mr) {
    case 6: vnni256_block(g, r0, p, acc, 6); break;
    case 5: vnni256_block(g, r0, p, acc, 5); break;
    case 4: vnni256_block(g, r0, p, acc, 4); break;
    case 3: vnni256_block(g, r0, p, acc, 3); break;
    case 2: vnni256_block(g, r0, p, acc, 2); break;
    default: vnni256_block(g, r0, p, acc, 1); break;
    }
}
#endif
