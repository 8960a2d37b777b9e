/* bf16 <-> fp32 for the native CPU kernels: widen exactly, round to nearest even (NaN stays
 * a quiet NaN), as torch's own conversions do. */
#ifndef LLMSVC_BF16_H
#define LLMSVC_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX2__)
#include <immintrin.h>

/* 8 bf16 at p (any alignment) -> 8 fp32, exact: zero-extend, shift into the high half */
static inline __m256 bf16x8_to_f32(const void *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 bf16 at p (any alignment) -> 16 fp32 in one widening load, exact */
static inline __m512 bf16x16_to_f32(const void *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif
#endif
