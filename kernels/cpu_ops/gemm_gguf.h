/* gemm.c's GGUF blocks (llmsvc_gemm_q8, `--quantization gguf`). Included by gemm.c only, after
 * its gemm_t and the ISA's q8_kernel.
 *
 * The blob: a GGUF_HEADER-byte header (int32 bs: weights per scale, 32 for Q4_0 ... Q5_K, 16
 * where a Q6_K tensor is part of the weight), then one int8 per weight in the fp32 panel layout
 * ([ceil(N / 48)][K][48], NP-wide sub-panels), then the scale and the offset panels
 * [ceil(N / 48)][K / bs][48] fp32 in the same layout: W = d * q + m per bs weights of a column.
 * The panel streams from DRAM at 1.25 bytes per weight (1 + 8 / 32) against fp32's 4.
 *
 * d * q is exact in fp32 where the GGUF type makes it so (an fp16 scale, or a K-quant's fp16
 * scale times its 6-bit sub-scale, times |q| <= 32 .. 128: at most 24 bits), and a single
 * rounding where not (Q6_K: d * sc * q, as gguf-py rounds it), so a fused multiply-add gives each
 * weight the value gguf-py dequantizes to, and every column sums over k in the fp32 kernel's
 * order: C is llmsvc_gemm_f32's on the dequantized weight, bit for bit. The loader keeps only
 * tensors whose dequantization it has checked against the checkpoint (llmsvc/models/gguf_blocks.py).
 *
 * Up to Q8_REG_MAX_M rows each panel is dequantized in registers (q8_kernel, 4 rows at a time,
 * again for every 4 rows); beyond, once into the thread's buffer for the fp32 micro-kernel: the
 * round trip through L2 costs more than the int8 stream saves at one row (15.4 against 8.0 ms a
 * weight pass of the default model) and nothing at 64 (docs/cpu-kernels.md). */
#define GGUF_HEADER 64
#ifndef Q8_REG_MAX_M
#define Q8_REG_MAX_M 16
#endif

/* w [K * NR] fp32 = d * q + m of panel q [K * NR] int8 with its scale and offset panels d, m
 * [K / bs * NR], all in the NP sub-panel layout; K % bs == 0. Intrinsics: GCC vectorizes the
 * plain loop in 4-lane pieces through 16-bit sign extensions, at ~1 weight per cycle. */
static void dequant_panel(float *restrict w, const int8_t *restrict q, const float *restrict d,
                          const float *restrict m, int64_t K, int64_t bs) {
    const int64_t KB = K / bs;
    for (int j = 0; j < NR / NP; j++) {
        const int8_t *qj = q + j * K * NP;
        const float *dj = d + j * KB * NP, *mj = m + j * KB * NP;
        float *wj = w + j * K * NP;
        for (int64_t kb = 0; kb < KB; kb++) {
            const float *db = dj + kb * NP, *mb = mj + kb * NP;
            const int8_t *qb = qj + kb * bs * NP;
            float *wb = wj + kb * bs * NP;
#if defined(__AVX512F__)
            __m512 dv[NP / 16], mv[NP / 16];
            for (int v = 0; v < NP / 16; v++) {
                dv[v] = _mm512_loadu_ps(db + 16 * v);
                mv[v] = _mm512_loadu_ps(mb + 16 * v);
            }
            for (int64_t k = 0; k < bs; k++)
                for (int v = 0; v < NP / 16; v++) {
                    const __m128i q16 = _mm_loadu_si128((const __m128i *)(qb + k * NP + 16 * v));
                    const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q16));
                    _mm512_store_ps(wb + k * NP + 16 * v, _mm512_fmadd_ps(dv[v], x, mv[v]));
                }
#else
            __m256 dv[NP / 8], mv[NP / 8];
            for (int v = 0; v < NP / 8; v++) dv[v] = _mm256_loadu_ps(db + 8 * v), mv[v] = _mm256_loadu_ps(mb + 8 * v);
            for (int64_t k = 0; k < bs; k++)
                for (int v = 0; v < NP / 8; v++) {
                    const __m128i q8 = _mm_loadl_epi64((const __m128i *)(qb + k * NP + 8 * v));
                    const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
                    _mm256_store_ps(wb + k * NP + 8 * v, _mm256_fmadd_ps(dv[v], x, mv[v]));
                }
#endif
        }
    }
}

#define Q8_CASE(R) case R: q8_kernel(R, a, g->lda, q, qd, qm, K, g->bs, c, g->ldc, nc, bias); break;

/* the rows of the chunk against GGUF panel p, dequantized in registers */
static void q8_panel_rows(const gemm_t *g, int64_t p) {
    const int64_t K = g->K, KB = K / g->bs;
    const int8_t *q = (const int8_t *)g->packed + p * K * NR;
    const float *qd = g->qd + p * KB * NR, *qm = g->qm + p * KB * NR, *bias = g->bias ? g->bias + p * NR : 0;
    const int nc = (int)(g->N - p * NR < NR ? g->N - p * NR : NR);
    for (int64_t m = 0; m < g->mc; m += 4) {
        const float *a = (const float *)g->a + (g->m0 + m) * g->lda;
        float *c = (float *)g->c + (g->m0 + m) * g->ldc + p * NR;
        switch (g->mc - m < 4 ? g->mc - m : 4) { Q8_CASE(1) Q8_CASE(2) Q8_CASE(3) Q8_CASE(4) }
    }
}
