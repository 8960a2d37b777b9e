/* Paged attention (paged_attention.c), prefill tiles on AVX-512 without bf16 dot products
 * (fp32 everywhere, bf16 on AVX512F-only CPUs): a head's query vectors across the lanes.
 *
 * pass1_workspace gives each (query vector, key) pair a vector of 16 partial sums and folds
 * 16 of them with reduce16's shuffle tree: a load per FMA and ~45 shuffles and adds per 64
 * FMAs, on the port the second FMA unit shares. Here pass 1 is a GEMM micro-kernel instead:
 *   qt [D][LD]        a head's nqh query vectors (scaled), transposed once per item; LD = 16 QZ
 *                     lanes, the lanes past nqh zero
 *   st [keys][LD]     scores, key s of vector j at st[s * LD + j]
 * per key block: st[s] = sum_d k_s[d] * qt[d], a broadcast of k_s[d] (from the group's rows,
 * copied to the workspace kb by attention_pass1.h's copy_group, widened in bf16) against QZ
 * loads, KB x QZ accumulators in registers. Per d: QZ + KB loads for KB x QZ FMAs.
 * The softmax then runs down the keys with every vector of the head in the lanes (a vector
 * max and sum, its causal limit a lane compare), leaving e^(s - max) unnormalised and
 * 1 / sum per vector in inv; run_heads scales the output. Pass 2 reads p(j, s) at
 * st[s * LD + j]: the six vectors of a pass-2 group on one cache line.
 * Included by paged_attention.c after its types, attention_rows.h and vexp.h. */
#pragma once

#ifdef __AVX512F__
#define HAVE_QLANES 1
#define QL_MAX_Z 4 /* zmm of query vectors per head: nqh <= 64 (8-row tiles up to G = 8) */

/* Whether a call's prefill tiles may take this path: bf16 on AVX512-BF16 keeps the dot-product
 * tiles of attention_dp.h, and a logit soft cap the per-vector softmax. The call sizes its
 * tiles by it (llmsvc_paged_attention), each item then checks its own vector count. */
static inline int qlanes_allowed(int bf16, float soft_cap) { return !(HAVE_DP && bf16) && soft_cap <= 0.f; }

/* st[s0 + k0 + kk] for kk < KB from the group's rows kp ([16][D] fp32) and qt; QZ, KB, D
 * constants after inlining: the KB x QZ accumulators stay in registers. */
static inline __attribute__((always_inline)) void ql_block(const float *kp, const float *qt, float *st,
                                                           const int64_t D, const int64_t QZ, const int64_t KB) {
    const int64_t LD = 16 * QZ;
    __m512 acc[16][QL_MAX_Z];
#pragma GCC unroll 16
    for (int64_t kk = 0; kk < KB; kk++)
#pragma GCC unroll 4
        for (int64_t z = 0; z < QZ; z++) acc[kk][z] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t d = 0; d < D; d++) {
        __m512 q[QL_MAX_Z];
#pragma GCC unroll 4
        for (int64_t z = 0; z < QZ; z++) q[z] = _mm512_load_ps(qt + d * LD + 16 * z);
#pragma GCC unroll 16
        for (int64_t kk = 0; kk < KB; kk++) {
            const __m512 b = _mm512_set1_ps(kp[kk * D + d]);
#pragma GCC unroll 4
            for (int64_t z = 0; z < QZ; z++) acc[kk][z] = _mm512_fmadd_ps(b, q[z], acc[kk][z]);
        }
    }
#pragma GCC unroll 16
    for (int64_t kk = 0; kk < KB; kk++)
#pragma GCC unroll 4
        for (int64_t z = 0; z < QZ; z++) _mm512_store_ps(st + kk * LD + 16 * z, acc[kk][z]);
}

/* Scores of 16 keys of one head: 16 or 24 accumulators per block. */
static inline __attribute__((always_inline)) void ql_group(const float *kp, const float *qt, float *st,
                                                           const int64_t D, const int64_t QZ) {
    const int64_t KB = QZ == 1 ? 16 : QZ == 4 ? 4 : 8, LD = 16 * QZ;
    for (int64_t k0 = 0; k0 < 16; k0 += KB) ql_block(kp + k0 * D, qt, st + k0 * LD, D, QZ, KB);
}

/* Pass 1 of a prefill item, every head's query vectors in lanes: st (scores), qt, kb as the
 * file comment says; qv: the nh * nqh vectors, scaled. */
static inline __attribute__((always_inline)) void pass1_qlanes(
    const args_t *A, int64_t h0, int64_t nh, int64_t nqh, const int32_t *table, const v16 *qv, v16 *kb,
    float *qt, float *st, int64_t sstride, int64_t s_begin, int64_t n_max, const int64_t nc, const char **krow,
    const char **knext, const char **vnext) {
    const int64_t D = 16 * nc, QZ = (nqh + 15) / 16, LD = 16 * QZ;
    const int64_t esz = A->bf16 ? 2 : 4, head_bytes = esz * D, row_bytes = head_bytes * A->Hkv;
    for (int64_t hh = 0; hh < nh; hh++) {
        float *t = qt + hh * D * LD;
        for (int64_t j = 0; j < LD; j++) {
            const float *q = (const float *)(qv + (hh * nqh + (j < nqh ? j : 0)) * nc);
            for (int64_t d = 0; d < D; d++) t[d * LD + j] = j < nqh ? q[d] : 0.f;
        }
    }
    for (int64_t s0 = s_begin; s0 < n_max; s0 += 16) {
        copy_group(A, table, row_bytes, head_bytes, s0, n_max, h0, nh, kb, nc, krow, knext, vnext);
        for (int64_t hh = 0; hh < nh; hh++) {
            const float *kp = (const float *)(kb + hh * 16 * nc), *t = qt + hh * D * LD;
            float *s = st + (hh * sstride + s0) * LD;
            switch (QZ) {
            case 1: ql_group(kp, t, s, D, 1); break;
            case 2: ql_group(kp, t, s, D, 2); break;
            case 3: ql_group(kp, t, s, D, 3); break;
            default: ql_group(kp, t, s, D, 4); break;
            }
        }
    }
}

/* Lanes of key s that are visible: lo <= s < lim. */
static inline __mmask16 ql_visible(int64_t s, __m512i lo, __m512i lim) {
    const __m512i sv = _mm512_set1_epi32((int32_t)s);
    return _mm512_cmplt_epi32_mask(sv, lim) & _mm512_cmpge_epi32_mask(sv, lo);
}

/* col[s * LD] = e^(col[s * LD] - m) where visible, else 0, for a <= s < b; returns sum + them. */
static inline __m512 ql_exp_masked(float *col, int64_t LD, int64_t a, int64_t b, __m512 m, __m512i lo,
                                   __m512i lim, __m512 sum) {
    for (int64_t s = a; s < b; s++) {
        const __m512 e = _mm512_maskz_mov_ps(ql_visible(s, lo, lim), exp_ps(_mm512_sub_ps(_mm512_load_ps(col + s * LD), m)));
        _mm512_store_ps(col + s * LD, e);
        sum = _mm512_add_ps(sum, e);
    }
    return sum;
}

/* Softmax of each head's vectors down the keys [s_begin, n_max): vector j = r * G + g of
 * the head sees keys [lo, lim), lim = first_lim + r, lo = lim - window (0 without one); the
 * others become 0. Leaves e^(s - max) in st and 1 / sum in inv[hh * nqh + j]. Keys that
 * every lane sees, [all_lo, all_hi), go without masks, the max over four chains (one vmaxps
 * chain waited on its latency key after key). */
static inline void softmax_qlanes(const args_t *A, int64_t nh, int64_t nqh, float *st, int64_t sstride,
                                  int64_t s_begin, int64_t n_max, int64_t first_lim, float *inv) {
    const int64_t G = A->Hq / A->Hkv, QZ = (nqh + 15) / 16, LD = 16 * QZ;
    const int64_t last_lo = window_lo(A, first_lim + (nqh - 1) / G); /* the last row's */
    const int64_t all_lo = last_lo > s_begin ? last_lo : s_begin, all_hi = first_lim > all_lo ? first_lim : all_lo;
    for (int64_t hh = 0; hh < nh; hh++) {
        for (int64_t z = 0; z < QZ; z++) {
            int32_t limv[16], lov[16];
            for (int64_t l = 0; l < 16; l++) {
                const int64_t j = 16 * z + l < nqh ? 16 * z + l : nqh - 1; /* padding lanes: a real row's */
                const int64_t lim = first_lim + j / G;
                limv[l] = (int32_t)lim;
                lov[l] = (int32_t)window_lo(A, lim);
            }
            const __m512i lim = _mm512_loadu_si512(limv), lo = _mm512_loadu_si512(lov);
            float *col = st + hh * sstride * LD + 16 * z;
            __m512 m4[4];
            for (int i = 0; i < 4; i++) m4[i] = _mm512_set1_ps(-INFINITY);
            int64_t s = all_lo;
            for (; s + 4 <= all_hi; s += 4)
                for (int i = 0; i < 4; i++) m4[i] = _mm512_max_ps(m4[i], _mm512_load_ps(col + (s + i) * LD));
            for (; s < all_hi; s++) m4[0] = _mm512_max_ps(m4[0], _mm512_load_ps(col + s * LD));
            for (s = s_begin; s < all_lo; s++)
                m4[1] = _mm512_mask_max_ps(m4[1], ql_visible(s, lo, lim), m4[1], _mm512_load_ps(col + s * LD));
            for (s = all_hi; s < n_max; s++)
                m4[2] = _mm512_mask_max_ps(m4[2], ql_visible(s, lo, lim), m4[2], _mm512_load_ps(col + s * LD));
            const __m512 m = _mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3]));
            __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
            for (s = all_lo; s < all_hi; s++) {
                const __m512 e = exp_ps(_mm512_sub_ps(_mm512_load_ps(col + s * LD), m));
                _mm512_store_ps(col + s * LD, e);
                if (s & 1) sum1 = _mm512_add_ps(sum1, e);
                else sum0 = _mm512_add_ps(sum0, e);
            }
            sum0 = ql_exp_masked(col, LD, s_begin, all_lo, m, lo, lim, sum0); /* the masked keys */
            sum0 = ql_exp_masked(col, LD, all_hi, n_max, m, lo, lim, sum0);
            float r[16];
            _mm512_storeu_ps(r, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(sum0, sum1)));
            for (int64_t l = 0; l < 16 && 16 * z + l < nqh; l++) inv[hh * nqh + 16 * z + l] = r[l];
        }
    }
}
#else
#define HAVE_QLANES 0
#define QL_MAX_Z 4
static inline int qlanes_allowed(int bf16, float soft_cap) { return (void)bf16, (void)soft_cap, 0; }
#endif
