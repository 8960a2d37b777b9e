/* Paged attention (paged_attention.c), prefill tiles on AVX-512 without bf16 dot products
 * (fp32 everywhere, bf16 on AVX512F-only CPUs) and on AVX2 + FMA (fp32 and bf16): a head's
 * query vectors across the lanes, QL_LANES of them a register (16 zmm lanes, 8 ymm).
 *
 * pass1_workspace gives each (query vector, key) pair a vector of 16 partial sums and folds
 * 16 of them with reduce16's shuffle tree: a load per FMA and ~45 shuffles and adds per 64
 * FMAs, on the port the second FMA unit shares. Here pass 1 is a GEMM micro-kernel instead:
 *   qt [D][LD]        a head's nqh query vectors (scaled), transposed once per item; LD =
 *                     QL_LANES QZ lanes, the lanes past nqh zero
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
#define QL_LANES 16
#define QL_MAX_Z 4 /* zmm of query vectors per head: nqh <= 64 (8-row tiles up to G = 8) */
#define QL_KB(QZ) ((QZ) == 1 ? 16 : (QZ) == 4 ? 4 : 8) /* keys per ql_block: 16 or 24 accumulators */
#define QL(op) _mm512_##op /* the width's intrinsics */
typedef __m512 ql_v;
typedef __m512i ql_vi;
typedef __mmask16 ql_mask;

/* Whether a call's prefill tiles may take this path: bf16 on AVX512-BF16 keeps the dot-product
 * tiles of attention_dp.h, and a logit soft cap the per-vector softmax. The call sizes its
 * tiles by it (llmsvc_paged_attention), each item then checks its own vector count. */
static inline int qlanes_allowed(int bf16, float soft_cap) { return !(HAVE_DP && bf16) && soft_cap <= 0.f; }

/* Lanes of key s that are visible: lo <= s < lim. */
static inline ql_mask ql_visible(int64_t s, ql_vi lo, ql_vi lim) {
    const __m512i sv = _mm512_set1_epi32((int32_t)s);
    return _mm512_cmplt_epi32_mask(sv, lim) & _mm512_cmpge_epi32_mask(sv, lo);
}
static inline ql_v ql_max_where(ql_v m, ql_v x, ql_mask k) { return _mm512_mask_max_ps(m, k, m, x); }
static inline ql_v ql_zero_unless(ql_mask k, ql_v x) { return _mm512_maskz_mov_ps(k, x); }
static inline ql_vi ql_loadi(const int32_t *p) { return _mm512_loadu_si512(p); }
#define ql_bcast(p, i) _mm512_set1_ps((p)[i]) /* p[i] to every lane */
#define QL_UNROLL_KB _Pragma("GCC unroll 16") /* ql_block's loops over its KB keys */
#define ql_exp exp_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_QLANES 1
#define QL_LANES 8
#define QL_MAX_Z 4 /* ymm of query vectors per head: nqh <= 32 (8-row tiles up to G = 4) */
/* keys per ql_block: QZ x KB accumulators + QZ query vectors + a broadcast within 16 ymm, with
 * room to spare (at QZ = 3, four keys' 12 accumulators had GCC spill one inside the d loop) */
#define QL_KB(QZ) ((QZ) == 1 ? 8 : (QZ) == 2 ? 4 : 2)
#define QL(op) _mm256_##op
typedef __m256 ql_v;
typedef __m256i ql_vi;
typedef __m256 ql_mask; /* all-ones lanes */

/* Any soft cap keeps the per-vector softmax (attention_softmax.h); fp32 and bf16 alike. */
static inline int qlanes_allowed(int bf16, float soft_cap) { return (void)bf16, soft_cap <= 0.f; }

static inline ql_mask ql_visible(int64_t s, ql_vi lo, ql_vi lim) {
    const __m256i sv = _mm256_set1_epi32((int32_t)s);
    return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(lo, sv), _mm256_cmpgt_epi32(lim, sv)));
}
static inline ql_v ql_max_where(ql_v m, ql_v x, ql_mask k) { return _mm256_blendv_ps(m, _mm256_max_ps(m, x), k); }
static inline ql_v ql_zero_unless(ql_mask k, ql_v x) { return _mm256_and_ps(k, x); }
static inline ql_vi ql_loadi(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
#define ql_bcast(p, i) _mm256_broadcast_ss((p) + (i)) /* GCC's set1 of p[i] ran 1-7% slower */
#define QL_UNROLL_KB _Pragma("GCC unroll 8")
#define ql_exp exp8_ps
#else
#define HAVE_QLANES 0
#define QL_LANES 16
#define QL_MAX_Z 4
static inline int qlanes_allowed(int bf16, float soft_cap) { return (void)bf16, (void)soft_cap, 0; }
#endif

#if HAVE_QLANES
/* st[s0 + k0 + kk] for kk < KB from the group's rows kp ([16][D] fp32) and qt; QZ, KB, D
 * constants after inlining: the KB x QZ accumulators stay in registers. */
static inline __attribute__((always_inline)) void ql_block(const float *kp, const float *qt, float *st,
                                                           const int64_t D, const int64_t QZ, const int64_t KB) {
    const int64_t LD = QL_LANES * QZ;
    ql_v acc[QL_KB(1)][QL_MAX_Z]; /* QL_KB(1): the width's largest KB */
    QL_UNROLL_KB
    for (int64_t kk = 0; kk < KB; kk++)
#pragma GCC unroll 4
        for (int64_t z = 0; z < QZ; z++) acc[kk][z] = QL(setzero_ps)();
#pragma GCC unroll 2
    for (int64_t d = 0; d < D; d++) {
        ql_v q[QL_MAX_Z];
#pragma GCC unroll 4
        for (int64_t z = 0; z < QZ; z++) q[z] = QL(load_ps)(qt + d * LD + QL_LANES * z);
        QL_UNROLL_KB
        for (int64_t kk = 0; kk < KB; kk++) {
            const ql_v b = ql_bcast(kp, kk * D + d);
#pragma GCC unroll 4
            for (int64_t z = 0; z < QZ; z++) acc[kk][z] = QL(fmadd_ps)(b, q[z], acc[kk][z]);
        }
    }
    QL_UNROLL_KB
    for (int64_t kk = 0; kk < KB; kk++)
#pragma GCC unroll 4
        for (int64_t z = 0; z < QZ; z++) QL(store_ps)(st + kk * LD + QL_LANES * z, acc[kk][z]);
}

/* col[s * LD] = e^(col[s * LD] - m) where visible, else 0, for a <= s < b, each added to the
 * chain of its key's parity, sum[s & 1], as the unmasked keys are. */
static inline void ql_exp_masked(float *col, int64_t LD, int64_t a, int64_t b, ql_v m, ql_vi lo, ql_vi lim,
                                 ql_v sum[2]) {
    for (int64_t s = a; s < b; s++) {
        const ql_v e = ql_zero_unless(ql_visible(s, lo, lim), ql_exp(QL(sub_ps)(QL(load_ps)(col + s * LD), m)));
        QL(store_ps)(col + s * LD, e);
        sum[s & 1] = QL(add_ps)(sum[s & 1], e);
    }
}

/* Softmax of each head's vectors down the keys [s_begin, n_max): vector j = r * G + g of
 * the head sees keys [lo, lim), lim = first_lim + r, lo = lim - window (0 without one); the
 * others become 0. Leaves e^(s - max) in st and 1 / sum in inv[hh * nqh + j]. Keys that
 * every lane sees, [all_lo, all_hi), go without masks, the max over four chains (one vmaxps
 * chain waited on its latency key after key). */
static inline void softmax_qlanes(const args_t *A, int64_t nh, int64_t nqh, float *st, int64_t sstride,
                                  int64_t s_begin, int64_t n_max, int64_t first_lim, float *inv) {
    const int64_t G = A->Hq / A->Hkv, QZ = (nqh + QL_LANES - 1) / QL_LANES, LD = QL_LANES * QZ;
    const int64_t last_lo = window_lo(A, first_lim + (nqh - 1) / G); /* the last row's */
    const int64_t all_lo = last_lo > s_begin ? last_lo : s_begin, all_hi = first_lim > all_lo ? first_lim : all_lo;
    for (int64_t hh = 0; hh < nh; hh++) {
        for (int64_t z = 0; z < QZ; z++) {
            int32_t limv[QL_LANES], lov[QL_LANES];
            for (int64_t l = 0; l < QL_LANES; l++) {
                const int64_t j = QL_LANES * z + l < nqh ? QL_LANES * z + l : nqh - 1; /* padding lanes: a real row's */
                const int64_t lim = first_lim + j / G;
                limv[l] = (int32_t)lim;
                lov[l] = (int32_t)window_lo(A, lim);
            }
            const ql_vi lim = ql_loadi(limv), lo = ql_loadi(lov);
            float *col = st + hh * sstride * LD + QL_LANES * z;
            ql_v m4[4];
            for (int i = 0; i < 4; i++) m4[i] = QL(set1_ps)(-INFINITY);
            int64_t s = all_lo;
            for (; s + 4 <= all_hi; s += 4)
                for (int i = 0; i < 4; i++) m4[i] = QL(max_ps)(m4[i], QL(load_ps)(col + (s + i) * LD));
            for (; s < all_hi; s++) m4[0] = QL(max_ps)(m4[0], QL(load_ps)(col + s * LD));
            for (s = s_begin; s < all_lo; s++)
                m4[1] = ql_max_where(m4[1], QL(load_ps)(col + s * LD), ql_visible(s, lo, lim));
            for (s = all_hi; s < n_max; s++)
                m4[2] = ql_max_where(m4[2], QL(load_ps)(col + s * LD), ql_visible(s, lo, lim));
            const ql_v m = QL(max_ps)(QL(max_ps)(m4[0], m4[1]), QL(max_ps)(m4[2], m4[3]));
            /* each lane's sum runs in key order on two chains by parity, a masked key adding 0: the
             * same bits whichever tile holds the row (the unmasked range depends on the tile) */
            ql_v sum[2] = {QL(setzero_ps)(), QL(setzero_ps)()};
            ql_exp_masked(col, LD, s_begin, all_lo, m, lo, lim, sum);
            for (s = all_lo; s < all_hi; s++) {
                const ql_v e = ql_exp(QL(sub_ps)(QL(load_ps)(col + s * LD), m));
                QL(store_ps)(col + s * LD, e);
                sum[s & 1] = QL(add_ps)(sum[s & 1], e);
            }
            ql_exp_masked(col, LD, all_hi, n_max, m, lo, lim, sum);
            float r[QL_LANES];
            QL(storeu_ps)(r, QL(div_ps)(QL(set1_ps)(1.f), QL(add_ps)(sum[0], sum[1])));
            for (int64_t l = 0; l < QL_LANES && QL_LANES * z + l < nqh; l++) inv[hh * nqh + QL_LANES * z + l] = r[l];
        }
    }
}

/* Scores of 16 keys of one head, QL_KB(QZ) keys per block. */
static inline __attribute__((always_inline)) void ql_group(const float *kp, const float *qt, float *st,
                                                           const int64_t D, const int64_t QZ) {
    const int64_t KB = QL_KB(QZ), LD = QL_LANES * QZ;
    for (int64_t k0 = 0; k0 < 16; k0 += KB) ql_block(kp + k0 * D, qt, st + k0 * LD, D, QZ, KB);
}

/* Pass 1 of a prefill item, every head's query vectors in lanes: st (scores), qt, kb as the
 * file comment says; qv: the nh * nqh vectors, scaled. */
static inline __attribute__((always_inline)) void pass1_qlanes(
    const args_t *A, int64_t h0, int64_t nh, int64_t nqh, const int32_t *table, const v16 *qv, v16 *kb,
    float *qt, float *st, int64_t sstride, int64_t s_begin, int64_t n_max, const int64_t nc, const char **krow,
    const char **knext, const char **vnext) {
    const int64_t D = 16 * nc, QZ = (nqh + QL_LANES - 1) / QL_LANES, LD = QL_LANES * QZ;
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

#endif

