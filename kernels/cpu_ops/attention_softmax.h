/* Paged attention (paged_attention.c): the softmax of the paths that keep a row of scores per
 * query vector (decodes, and prefill tiles without attention_qlanes.h). Included by
 * paged_attention.c after its types and attention_dp.h; not a header of its own. */
#pragma once

/* scores: [nq, sstride], vector a = hh * nqh + r * G + g sees keys [lo, lim) of [s_begin, n_max),
 * lim = first_lim + r. Leaves its normalised weights there, 0 for the keys it does not see, or
 * with p_bf16 (pass2_dp's tiles) the weights rounded to bf16 (weights_to_bf16). A soft cap
 * maps each score s to soft_cap * tanh(s / soft_cap) first. */
static inline void softmax_rows(const args_t *A, int64_t nq, int64_t nqh, int64_t G, float *scores,
                                int64_t sstride, int64_t s_begin, int64_t n_max, int64_t first_lim, int p_bf16) {
    for (int64_t a = 0; a < nq; a++) {
        const int64_t lim = first_lim + (a % nqh) / G;
        const int64_t lo = window_lo(A, lim);
        float *sc = scores + a * sstride;
        if (A->soft_cap > 0.f) {
            const float cap = A->soft_cap, inv_cap = 1.f / A->soft_cap;
            for (int64_t s = lo; s < lim; s++) sc[s] = cap * tanhf(sc[s] * inv_cap);
        }
        float m = sc[lo], sum = 0.f;
        for (int64_t s = lo + 1; s < lim; s++) m = sc[s] > m ? sc[s] : m;
#ifdef __AVX512F__
        {
            const __m512 vm = _mm512_set1_ps(m);
            __m512 vs = _mm512_setzero_ps();
            for (int64_t s = lo; s < lim; s += 16) {
                const __mmask16 k = lim - s >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (lim - s)) - 1);
                const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + s), vm));
                _mm512_mask_storeu_ps(sc + s, k, e);
                vs = _mm512_mask_add_ps(vs, k, vs, e);
            }
            sum = _mm512_reduce_add_ps(vs);
        }
#else
        for (int64_t s = lo; s < lim; s++) { sc[s] = expf(sc[s] - m); sum += sc[s]; }
#endif
        const float inv = 1.f / sum;
#if HAVE_DP
        if (p_bf16) {
            weights_to_bf16(sc, s_begin, lo, lim, n_max, inv);
            continue;
        }
#else
        (void)p_bf16;
#endif
        for (int64_t s = lo; s < lim; s++) sc[s] *= inv;
        for (int64_t s = s_begin; s < lo; s++) sc[s] = 0.f;
        for (int64_t s = lim; s < n_max; s++) sc[s] = 0.f;
    }
}
