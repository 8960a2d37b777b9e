/* The int8 GEMM's two AVX2 kernels (gemm_int8.h has the contract; gemm_int8.c runs them only
 * where i8_cpu_has says the CPU and OS do). Compiled on every x86 build through target attributes.
 *
 * i8_kernel_avx2, for 8-bit weights: the weights are widened to int16 in registers (vpmovsxbw)
 * and multiplied with int16 activations by vpmaddwd: exact, with no saturation. vpmaddubsw's
 * u8 x s8 pair sums would overflow int16 under the unsigned-offset trick (255 * 127 * 2), and
 * the sign trick (vpsignb + vpabsb) costs two more uops per multiply. Zen 3 issues two vpmaddwd
 * a cycle (32 multiply-adds, against its two FMAs' 16), so the k-loops of the full row block (6
 * rows, one half-panel at a time) and of a 3-row remainder are written in assembly to keep
 * their sums in registers.
 * i8_kernel_avx2_w7, for weights in -64 .. 64 (the default on AVX2, int8.py): vpmaddubsw,
 * whose pair sums fit int16 at that range. Below.
 */
#if defined(__x86_64__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "gemm_int8.h"

/* ---- AVX2 kernel: MR = 6 rows (two 6 x 8 halves of the panel, avx2_half6_asm); fewer rows:
 * 3 x 16 in assembly (avx2_block3_asm), then 1 or 2 in C (avx2_block) ----
 * Per k-quad: the panel's 64-byte row as four 16-byte pieces (columns 4j .. 4j + 3, 4 k each),
 * each widened to 16 int16; each row's 4 int16 activations broadcast to every 64-bit lane;
 * vpmaddwd then gives per column two partial sums (k 0-1, k 2-3), added pairwise at the end. */

#define AVX2_T __attribute__((target("avx2"), always_inline)) static inline

/* The assembly blocks' 12 sums: ymm0-11 set to zero before the k-loop, stored after it to %[s]
 * (12 consecutive __m256i) */
#define I8_ZERO_SUMS                                                                        \
    "vpxor %%xmm0, %%xmm0, %%xmm0\n\t"                                                     \
    "vmovdqa %%ymm0, %%ymm1\n\t" "vmovdqa %%ymm0, %%ymm2\n\t" "vmovdqa %%ymm0, %%ymm3\n\t"     \
    "vmovdqa %%ymm0, %%ymm4\n\t" "vmovdqa %%ymm0, %%ymm5\n\t" "vmovdqa %%ymm0, %%ymm6\n\t"     \
    "vmovdqa %%ymm0, %%ymm7\n\t" "vmovdqa %%ymm0, %%ymm8\n\t" "vmovdqa %%ymm0, %%ymm9\n\t"     \
    "vmovdqa %%ymm0, %%ymm10\n\t" "vmovdqa %%ymm0, %%ymm11\n\t"
#define I8_STORE_SUMS                                                                       \
    "vmovdqu %%ymm0, 0(%[s])\n\t" "vmovdqu %%ymm1, 32(%[s])\n\t" "vmovdqu %%ymm2, 64(%[s])\n\t"     \
    "vmovdqu %%ymm3, 96(%[s])\n\t" "vmovdqu %%ymm4, 128(%[s])\n\t" "vmovdqu %%ymm5, 160(%[s])\n\t"  \
    "vmovdqu %%ymm6, 192(%[s])\n\t" "vmovdqu %%ymm7, 224(%[s])\n\t" "vmovdqu %%ymm8, 256(%[s])\n\t" \
    "vmovdqu %%ymm9, 288(%[s])\n\t" "vmovdqu %%ymm10, 320(%[s])\n\t" "vmovdqu %%ymm11, 352(%[s])\n\t"

/* dst[0:8) = the 8 columns' sums of two pieces' partial sums a (columns 0-3) and b (4-7), each
 * [c0 k01, c0 k23, c1 k01, ...]: hadd gives [c0 c1 c4 c5 | c2 c3 c6 c7], 0xD8 puts them in order */
AVX2_T void store_pair_sums(int32_t *dst, __m256i a, __m256i b) {
    _mm256_storeu_si256((__m256i *)dst, _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xD8));
}

AVX2_T void avx2_block(const i8_gemm_t *g, int64_t r0, int64_t p, const int8_t *pf, int32_t acc[][I8_NP],
                       const int mr) {
    const int64_t kp = g->Kp, nq = kp / 4;
    const int8_t *w = g->panels + p * kp * I8_NP;
    const int16_t *a = (const int16_t *)g->aq + r0 * kp;
    __m256i s[2][4];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++) s[r][j] = _mm256_setzero_si256();
    for (int64_t q = 0; q < nq; q++, w += 64, pf += 64) {
        _mm_prefetch((const char *)pf, _MM_HINT_T0);
        __m256i av[2];
        for (int r = 0; r < mr; r++) av[r] = _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(a + r * kp + 4 * q)));
        for (int j = 0; j < 4; j++) {
            const __m256i wv = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)(w + 16 * j)));
            for (int r = 0; r < mr; r++) s[r][j] = _mm256_add_epi32(s[r][j], _mm256_madd_epi16(wv, av[r]));
        }
    }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) store_pair_sums(acc[r] + 8 * h, s[r][2 * h], s[r][2 * h + 1]);
}

/* avx2_block for 3 rows with its k-loop in assembly. GCC kept 9 of the 12 accumulators on the
 * stack (a store and a reload per k-quad each: a store-forwarding round trip in every sum's
 * dependency chain). Here the sums live in ymm0-11 (row r, piece j in ymm 4 r + j), rows 0 and
 * 1's broadcast activations in ymm12-13 for the whole k-quad, the widened weight piece in ymm14;
 * row 2's activations are broadcast again for each piece into ymm15, which then takes products.
 * 16 registers, no spill. A broadcast from memory costs about a cycle on Zen 3, so six per
 * k-quad instead of twelve. Each k-quad also prefetches a line at pf (i8_kernel_avx2). Integer
 * sums: avx2_block's result exactly. */
AVX2_T void avx2_block3_asm(const i8_gemm_t *g, int64_t r0, int64_t p, const int8_t *pf, int32_t acc[][I8_NP]) {
    const int64_t kp = g->Kp;
    int64_t nq = kp / 4; /* >= 16: Kp is a multiple of 64 */
    const int8_t *w = g->panels + p * kp * I8_NP;
    const int16_t *a0 = (const int16_t *)g->aq + r0 * kp, *a1 = a0 + kp, *a2 = a1 + kp;
    __m256i s[3][4];
    /* piece J (byte offset 16 J of the k-quad's 64) into sums ymm J, 4 + J, 8 + J */
#define I8_PIECE(OFF, A, B, C)                                                              \
    "vpmovsxbw " #OFF "(%[w]), %%ymm14\n\t"                                                 \
    "vpbroadcastq (%[a2]), %%ymm15\n\t"                                                     \
    "vpmaddwd %%ymm14, %%ymm15, %%ymm15\n\t"                                                \
    "vpaddd %%ymm15, %%ymm" #C ", %%ymm" #C "\n\t"                                          \
    "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\t"                                                \
    "vpaddd %%ymm15, %%ymm" #A ", %%ymm" #A "\n\t"                                          \
    "vpmaddwd %%ymm14, %%ymm13, %%ymm14\n\t"                                                \
    "vpaddd %%ymm14, %%ymm" #B ", %%ymm" #B "\n\t"
    __asm__ volatile(
        I8_ZERO_SUMS
        "1:\n\t"
        "prefetcht0 (%[pf])\n\t"
        "vpbroadcastq (%[a0]), %%ymm12\n\t"
        "vpbroadcastq (%[a1]), %%ymm13\n\t"
        I8_PIECE(0, 0, 4, 8) I8_PIECE(16, 1, 5, 9) I8_PIECE(32, 2, 6, 10) I8_PIECE(48, 3, 7, 11)
        "add $64, %[w]\n\t" "add $64, %[pf]\n\t" "add $8, %[a0]\n\t" "add $8, %[a1]\n\t" "add $8, %[a2]\n\t"
        "dec %[n]\n\t" "jnz 1b\n\t"
        I8_STORE_SUMS
        : [w] "+r"(w), [pf] "+r"(pf), [a0] "+r"(a0), [a1] "+r"(a1), [a2] "+r"(a2), [n] "+r"(nq)
        : [s] "r"(&s[0][0])
        : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
#undef I8_PIECE
    for (int r = 0; r < 3; r++)
        for (int h = 0; h < 2; h++) store_pair_sums(acc[r] + 8 * h, s[r][2 * h], s[r][2 * h + 1]);
}

/* Six rows x one half (8 columns) of the panel, k-loop in assembly. Against avx2_block3_asm it
 * widens half as many weight pieces per multiply (2 vpmovsxbw per 12 vpmaddwd, not 4) and
 * indexes every stream off one counter, so a k-quad is 33 macro-ops instead of 41: the 3-row
 * loop was bound by Zen 3's 6-wide dispatch and its four FP pipes (~7 cycles a k-quad for 12
 * vpmaddwd that need 6); this one's 26 FP-pipe operations take ~6.5.
 * Registers: sums of row r, piece j in ymm 2 r + j (ymm0-11), the half's two widened pieces in
 * ymm12-13, each row's broadcast activations in ymm14, the product in ymm15. The counter i runs
 * from -8 nq to 0 in bytes of activations (4 int16 per k-quad); the panel and pf advance 64
 * bytes a k-quad, so they are addressed at 8 i from their ends. pf: one line a k-quad (the
 * next panel, or this one again). Half h's sums go to acc[r][8 h .. 8 h + 7]. */
AVX2_T void avx2_half6_asm(const i8_gemm_t *g, int64_t r0, int64_t p, int h, const int8_t *pf,
                           int32_t acc[][I8_NP]) {
    const int64_t kp = g->Kp, nq = kp / 4;
    const int8_t *wend = g->panels + p * kp * I8_NP + 32 * h + 64 * nq, *pfend = pf + 64 * nq;
    const int16_t *a0 = (const int16_t *)g->aq + r0 * kp + 4 * nq;
    const int16_t *a1 = a0 + kp, *a2 = a1 + kp, *a3 = a2 + kp, *a4 = a3 + kp, *a5 = a4 + kp;
    int64_t i = -8 * nq;
    __m256i s[6][2];
#define I8_ROW(A, S0, S1)                                                                   \
    "vpbroadcastq (%[" #A "], %[i]), %%ymm14\n\t"                                           \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"                                                \
    "vpaddd %%ymm15, %%ymm" #S0 ", %%ymm" #S0 "\n\t"                                        \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm14\n\t"                                                \
    "vpaddd %%ymm14, %%ymm" #S1 ", %%ymm" #S1 "\n\t"
    __asm__ volatile(
        I8_ZERO_SUMS
        "1:\n\t"
        "prefetcht0 (%[pf], %[i], 8)\n\t"
        "vpmovsxbw (%[w], %[i], 8), %%ymm12\n\t"
        "vpmovsxbw 16(%[w], %[i], 8), %%ymm13\n\t"
        I8_ROW(a0, 0, 1) I8_ROW(a1, 2, 3) I8_ROW(a2, 4, 5) I8_ROW(a3, 6, 7) I8_ROW(a4, 8, 9) I8_ROW(a5, 10, 11)
        "add $8, %[i]\n\t"
        "jnz 1b\n\t"
        I8_STORE_SUMS
        : [i] "+r"(i)
        : [w] "r"(wend), [pf] "r"(pfend), [a0] "r"(a0), [a1] "r"(a1), [a2] "r"(a2), [a3] "r"(a3), [a4] "r"(a4),
          [a5] "r"(a5), [s] "r"(&s[0][0])
        : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
#undef I8_ROW
    for (int r = 0; r < 6; r++) store_pair_sums(acc[r] + 8 * h, s[r][0], s[r][1]);
}

__attribute__((target("avx2"))) void i8_kernel_avx2(const i8_gemm_t *g, int64_t r0, int mr, int64_t p,
                                                    const int8_t *pf, int32_t acc[][I8_NP]) {
    if (!pf) pf = g->panels + p * g->Kp * I8_NP; /* this panel again: lines in cache, no branch per k-quad */
    if (mr == 6) { /* the first half prefetches pf's every line, the second reads this panel's again */
        avx2_half6_asm(g, r0, p, 0, pf, acc);
        avx2_half6_asm(g, r0, p, 1, g->panels + p * g->Kp * I8_NP, acc);
        return;
    }
    if (mr >= 3) avx2_block3_asm(g, r0, p, pf, acc), r0 += 3, acc += 3, mr -= 3;
    if (mr == 2) avx2_block(g, r0, p, pf, acc, 2);
    else if (mr == 1) avx2_block(g, r0, p, pf, acc, 1);
}

/* ---- AVX2 on weights in -64 .. 64 (the avx2_w7 path): vpmaddubsw, MR = 6 ----
 * u8 activations (q + 128, the VNNI paths' format) times s8 weights: vpmaddubsw adds each
 * column's two adjacent k products in int16, at most 255 * 64 * 2 = 32640 with |w| <= 64, so
 * nothing saturates; vpmaddwd by ones adds a k-quad's two pairs into int32. A k-quad's 64-byte
 * panel row is two ymm (columns 0-7 and 8-15, 4 k each), so the sums come out in column order,
 * offset by +128 colsum like VNNI's. Per row and k-quad: one broadcast, then per half
 * vpmaddubsw, vpmaddwd, vpaddd: 3 operations per 32 multiply-adds against the int16 path's 4.
 * On Zen 3, over one L1-resident panel: 39-40 multiply-adds a tick against 30. Blocks of 4-6
 * rows run in assembly (w7_block_asm), 1-3 in C (w7_block). */

/* rows 1 .. 3 in C: mr x 2 sums, the two weight halves, ones, the broadcast and two products */
AVX2_T void w7_block(const i8_gemm_t *g, int64_t r0, int64_t p, const int8_t *pf, int32_t acc[][I8_NP],
                     const int mr) {
    const int64_t kp = g->Kp, nq = kp / 4;
    const int8_t *w = g->panels + p * kp * I8_NP;
    const uint8_t *a = (const uint8_t *)g->aq + r0 * kp;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s[3][2];
    for (int r = 0; r < mr; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
    for (int64_t q = 0; q < nq; q++, w += 64, pf += 64) {
        _mm_prefetch((const char *)pf, _MM_HINT_T0);
        const __m256i w0 = _mm256_load_si256((const __m256i *)w), w1 = _mm256_load_si256((const __m256i *)(w + 32));
        for (int r = 0; r < mr; r++) {
            int32_t quad;
            memcpy(&quad, a + r * kp + 4 * q, 4);
            const __m256i av = _mm256_set1_epi32(quad);
            s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(av, w0), ones));
            s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(av, w1), ones));
        }
    }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_si256((__m256i *)(acc[r] + 8 * h), s[r][h]);
}

/* Four to six rows, k-loop in assembly: row r's sums in ymm 2r and 2r + 1, ones in ymm12, the
 * row's broadcast activations in ymm13, products in ymm14-15; the weights are vpmaddubsw's
 * memory operand (12 loads a k-quad at six rows, which Zen 3's three load ports absorb), leaving
 * 12 registers for sums. Activations are indexed by i, which runs from -Kp to 0 (4 bytes a
 * k-quad); the panel and pf advance 64 bytes a k-quad. In C, GCC spilled a sum at four rows and
 * ran them at about half the six-row rate per multiply (16 rows took as long as 18). */
#define I8_W7_ROW(A, S0, S1)                                                                \
    "vpbroadcastd (%[" #A "], %[i]), %%ymm13\n\t"                                           \
    "vpmaddubsw (%[w]), %%ymm13, %%ymm14\n\t"                                               \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm14\n\t"                                                \
    "vpaddd %%ymm14, %%ymm" #S0 ", %%ymm" #S0 "\n\t"                                        \
    "vpmaddubsw 32(%[w]), %%ymm13, %%ymm15\n\t"                                             \
    "vpmaddwd %%ymm12, %%ymm15, %%ymm15\n\t"                                                \
    "vpaddd %%ymm15, %%ymm" #S1 ", %%ymm" #S1 "\n\t"
#define I8_W7_ROWS4 I8_W7_ROW(a0, 0, 1) I8_W7_ROW(a1, 2, 3) I8_W7_ROW(a2, 4, 5) I8_W7_ROW(a3, 6, 7)
#define I8_W7_ROWS5 I8_W7_ROWS4 I8_W7_ROW(a4, 8, 9)
#define I8_W7_ROWS6 I8_W7_ROWS5 I8_W7_ROW(a5, 10, 11)
#define I8_W7_LOOP(ROWS)                                                                    \
    __asm__ volatile(                                                                       \
        I8_ZERO_SUMS                                                                        \
        "vpcmpeqw %%ymm12, %%ymm12, %%ymm12\n\t"                                            \
        "vpsrlw $15, %%ymm12, %%ymm12\n\t" /* int16 ones */                                 \
        "1:\n\t"                                                                            \
        "prefetcht0 (%[pf])\n\t"                                                            \
        ROWS                                                                                \
        "add $64, %[w]\n\t" "add $64, %[pf]\n\t"                                            \
        "add $4, %[i]\n\t"                                                                  \
        "jnz 1b\n\t"                                                                        \
        I8_STORE_SUMS                                                                       \
        : [i] "+r"(i), [w] "+r"(w), [pf] "+r"(pf)                                           \
        : [a0] "r"(a0), [a1] "r"(a1), [a2] "r"(a2), [a3] "r"(a3), [a4] "r"(a4), [a5] "r"(a5), [s] "r"(&s[0][0]) \
        : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", \
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15")

AVX2_T void w7_block_asm(const i8_gemm_t *g, int64_t r0, int64_t p, const int8_t *pf, int32_t acc[][I8_NP],
                         const int mr) {
    const int64_t kp = g->Kp;
    const int8_t *w = g->panels + p * kp * I8_NP;
    /* rows past mr: addresses only, never read */
    const uint8_t *a0 = (const uint8_t *)g->aq + r0 * kp + kp;
    const uint8_t *a1 = a0 + kp, *a2 = a1 + kp, *a3 = a2 + kp, *a4 = a3 + kp, *a5 = a4 + kp;
    int64_t i = -kp;
    __m256i s[6][2]; /* all 12 sums are stored; rows past mr hold zeros */
    if (mr == 6) I8_W7_LOOP(I8_W7_ROWS6);
    else if (mr == 5) I8_W7_LOOP(I8_W7_ROWS5);
    else I8_W7_LOOP(I8_W7_ROWS4);
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_si256((__m256i *)(acc[r] + 8 * h), s[r][h]);
}
#undef I8_W7_LOOP
#undef I8_W7_ROWS6
#undef I8_W7_ROWS5
#undef I8_W7_ROWS4
#undef I8_W7_ROW

__attribute__((target("avx2"))) void i8_kernel_avx2_w7(const i8_gemm_t *g, int64_t r0, int mr, int64_t p,
                                                       const int8_t *pf, int32_t acc[][I8_NP]) {
    if (!pf) pf = g->panels + p * g->Kp * I8_NP;
    switch (mr) { /* constant row counts, so each block keeps its sums in registers */
    case 6: w7_block_asm(g, r0, p, pf, acc, 6); break;
    case 5: w7_block_asm(g, r0, p, pf, acc, 5); break;
    case 4: w7_block_asm(g, r0, p, pf, acc, 4); break;
    case 3: w7_block(g, r0, p, pf, acc, 3); break;
    case 2: w7_block(g, r0, p, pf, acc, 2); break;
    default: w7_block(g, r0, p, pf, acc, 1); break;
    }
}
#endif
