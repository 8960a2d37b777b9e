/* bf16 prefill tiles of the paged attention on AVX512-BF16 (VDPBF16PS): pass 1 on K rows
 * transposed so that 16 keys lie across a register, pass 2 on key pairs of V with the weights
 * rounded to bf16. Included by paged_attention.c after its types, row_ptrs and pf_step, where
 * HAVE_DP is set; the measurements are in docs/cpu-kernels.md. */
#pragma once
#if HAVE_DP
/* r[i][l] -> r[l][i] for 16 x 16 32-bit lanes: the off-diagonal g x g blocks swap places for
 * g = 8, 4, 2, 1 (reduce16.h's index vectors are exactly these swaps), 16 shuffles a level */
static inline void transpose16(v16i *r) {
#define SWAP_BLOCKS(G, LO, HI)                                                   \
    for (int i = 0; i < 16; i++)                                                 \
        if (!(i & (G))) {                                                        \
            const v16i x = r[i], y = r[i + (G)];                                 \
            r[i] = __builtin_shuffle(x, y, LO), r[i + (G)] = __builtin_shuffle(x, y, HI); \
        }
    SWAP_BLOCKS(8, LO8, HI8) SWAP_BLOCKS(4, LO4, HI4) SWAP_BLOCKS(2, LO2, HI2) SWAP_BLOCKS(1, LO1, HI1)
#undef SWAP_BLOCKS
}

typedef int32_t v16iu __attribute__((vector_size(64), aligned(4)));
#define KA 8 /* query vectors per pass-1 block: KA accumulators share each kt row load */

/* Pass 1 of a bf16 prefill item on AVX512-BF16 (head_dim a multiple of 32). Per group of 16
 * keys and KV head the K rows are transposed into kt, [D / 2][16] bf16 pairs as stored; a query
 * vector's 16 scores are then one accumulator of D / 2 VDPBF16PS on its broadcast q pairs, KA
 * vectors sharing each kt row, with nothing widened and no horizontal reduction (the widened
 * rows and reduce16 of pass1_workspace cost ~1.7x the FMAs, in fp32). Products exact in fp32,
 * the scale after the sum, as pass1_direct's. qv is overwritten by the q pairs; the next
 * group's K and V rows are prefetched while this group's are loaded. */
static inline __attribute__((always_inline)) void pass1_transposed(
    const args_t *A, const item_t *it, int64_t h0, int64_t nh, const int32_t *table, v16 *qv,
    v16 *kt, float *scores, int64_t sstride, int64_t s_begin, int64_t n_max, const int64_t nc,
    const char **krow, const char **knext, const char **vnext) {
    const int64_t G = A->Hq / A->Hkv, nqh = (int64_t)it->nrows * G;
    const int64_t head_bytes = 32 * nc, row_bytes = head_bytes * A->Hkv, nd = 8 * nc; /* kt rows per head */
    const int64_t q0 = A->qsl[it->seq];
    int32_t *qb = (int32_t *)qv; /* [nq][nd] q pairs as stored (pass 2 does not read qv) */
    for (int64_t a = 0; a < nh * nqh; a++) {
        const int64_t r = (a % nqh) / G, g = a % G;
        const int32_t *src = (const int32_t *)((const uint16_t *)A->q + (q0 + it->row0 + r) * A->q_stride +
                                               ((h0 + a / nqh) * G + g) * 16 * nc);
        for (int64_t d = 0; d < nd; d++) qb[a * nd + d] = src[d];
    }
    for (int64_t s0 = s_begin; s0 < n_max; s0 += 16) {
        int64_t nn;
        const int64_t kn = group_rows(A, table, row_bytes, s0, n_max, krow, knext, vnext, &nn);
        for (int64_t j = 0; j < nn; j++) prefetch_next_row(knext, vnext, j, h0, nh, head_bytes, 1);
        for (int64_t hh = 0; hh < nh; hh++) {
            v16 *kh = kt + hh * nd;
            for (int64_t c = 0; c < nd / 16; c++) { /* kt rows [16 c, 16 c + 16): 16 pairs of 16 keys */
                v16i r[16];
                for (int64_t j = 0; j < 16; j++)
                    r[j] = j < kn ? *(const v16iu *)(krow[j] + (h0 + hh) * head_bytes + 64 * c) : (v16i){0};
                transpose16(r);
                for (int64_t i = 0; i < 16; i++) kh[16 * c + i] = (v16)r[i];
            }
            for (int64_t a0 = hh * nqh; a0 < (hh + 1) * nqh; a0 += KA) {
                /* a tail block computes past its last vector on whatever follows in ws, unstored */
                const int64_t ga = (hh + 1) * nqh - a0 < KA ? (hh + 1) * nqh - a0 : KA;
                const int32_t *qa = qb + a0 * nd;
                v16 acc[KA];
#pragma GCC unroll 8
                for (int g = 0; g < KA; g++) acc[g] = (v16){0};
#pragma GCC unroll 4
                for (int64_t d = 0; d < nd; d++) {
                    const __m512bh w = (__m512bh)kh[d];
#pragma GCC unroll 8
                    for (int g = 0; g < KA; g++)
                        acc[g] = (v16)_mm512_dpbf16_ps((__m512)acc[g], (__m512bh)_mm512_set1_epi32(qa[g * nd + d]), w);
                }
                for (int g = 0; g < ga; g++) *(v16 *)(scores + (a0 + g) * sstride + s0) = acc[g] * A->scale;
            }
        }
    }
}

/* Row sc of a vector's scores after its exponentials (keys [s_begin, n_max), visible [lo, lim))
 * -> its weights sc[s] * inv rounded to bf16, in place from the row's start: key s_begin + i at
 * bf16 i, zero outside [lo, lim) and past n_max up to the group end. Block k's 16 floats become
 * 16 bf16 at byte 32 k, behind its read. One pass instead of the fp32 softmax's normalisation
 * and zero fills. */
static inline void weights_to_bf16(float *sc, int64_t s_begin, int64_t lo, int64_t lim, int64_t n_max,
                                   float inv) {
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    uint16_t *pb = (uint16_t *)sc;
    for (int64_t s0 = s_begin; s0 < n_max; s0 += 16) {
        const __m512i s = _mm512_add_epi32(_mm512_set1_epi32((int)s0), lane);
        const __mmask16 vis = _mm512_cmpge_epi32_mask(s, _mm512_set1_epi32((int)lo)) &
                              _mm512_cmplt_epi32_mask(s, _mm512_set1_epi32((int)lim));
        const __m512 x = _mm512_maskz_mul_ps(vis, _mm512_maskz_loadu_ps(vis, sc + s0), vinv);
        _mm256_storeu_si256((__m256i *)(pb + (s0 - s_begin)), (__m256i)_mm512_cvtneps_pbh(x));
    }
}

/* acc[g] += sum over the group's 8 key pairs t of p pair (g, t) . vt[t] for ga of GA vectors
 * (VDPBF16PS: lanes d, each the dot of a bf16 weight pair with the pair (v_2t[d], v_2t+1[d]));
 * pp: vector 0's weight pairs of this group, a vector's every pstride int32 */
static inline __attribute__((always_inline)) void pass2_dp_block(
    const int64_t nc, const int64_t GA, const int64_t ga, const int32_t *pp, int64_t pstride, v16 *acc,
    const __m512i *vt) {
    v16 ac[MAX_NC]; /* GA * nc <= 24, or nc alone (GA = 1) up to MAX_NC */
#pragma GCC unroll 24
    for (int64_t i = 0; i < GA * nc; i++) ac[i] = i < ga * nc ? acc[i] : (v16){0};
#pragma GCC unroll 2
    for (int t = 0; t < 8; t++) {
#pragma GCC unroll 16
        for (int64_t g = 0; g < GA; g++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32(g < ga ? pp[g * pstride + t] : 0);
#pragma GCC unroll 16
            for (int64_t c = 0; c < nc; c++)
                ac[g * nc + c] = (v16)_mm512_dpbf16_ps((__m512)ac[g * nc + c], w, (__m512bh)_mm512_loadu_si512(vt + t * nc + c));
        }
    }
#pragma GCC unroll 24
    for (int64_t i = 0; i < GA * nc; i++)
        if (i < ga * nc) acc[i] = ac[i];
}

/* Pass 2 of a bf16 prefill item on AVX512-BF16, on weights rounded to bf16 by weights_to_bf16
 * (as torch's CPU flash attention rounds them before its P @ V GEMM). Per group of 16 keys and
 * KV head the V rows are interleaved in key pairs into vt ([8 pairs][nc][16 lanes of (v_s,
 * v_s+1)]; rows past n_max are zeros, not read; vt lies in ws, which is not 64-byte aligned
 * here), and each vector's weight pairs go through VDPBF16PS against them: half the
 * instructions of the fp32 pass, whose FMAs took half of a prefill's attention. */
static inline __attribute__((always_inline)) void pass2_dp(
    const args_t *A, const int32_t *table, int64_t h0, int64_t nh, int64_t nqh, int64_t s_begin,
    int64_t n_max, const int64_t nc, const int64_t GA, float *scores, int64_t sstride, v16 *acc,
    __m512i *vt, pf_t *pf, int64_t pf_per, const char **vrow) {
    const int64_t head_bytes = 32 * nc, row_bytes = head_bytes * A->Hkv, ng = (n_max - s_begin + 15) / 16;
    const char *vbase = (const char *)A->v_cache;
    int16_t il_w[32]; /* word 2l <- x[l], 2l + 1 <- y[l] */
    for (int l = 0; l < 16; l++) il_w[2 * l] = (int16_t)l, il_w[2 * l + 1] = (int16_t)(32 + l);
    const __m512i il = _mm512_loadu_si512(il_w);
    for (int64_t k = 0; k < ng; k++) {
        const int64_t s0 = s_begin + 16 * k, kn = n_max - s0 < 16 ? n_max - s0 : 16;
        row_ptrs(vbase, table, A->BS, row_bytes, s0, kn, vrow);
        for (int64_t hh = 0; hh < nh; hh++) {
            for (int t = 0; t < 8; t++) {
                pf_step(pf, 2 * pf_per);
                const char *x = 2 * t < kn ? vrow[2 * t] + (h0 + hh) * head_bytes : 0;
                const char *y = 2 * t + 1 < kn ? vrow[2 * t + 1] + (h0 + hh) * head_bytes : 0;
                for (int64_t c = 0; c < nc; c++) {
                    const __m256i xc = x ? _mm256_loadu_si256((const __m256i *)(x + 32 * c)) : _mm256_setzero_si256();
                    const __m256i yc = y ? _mm256_loadu_si256((const __m256i *)(y + 32 * c)) : _mm256_setzero_si256();
                    _mm512_storeu_si512(vt + t * nc + c, _mm512_permutex2var_epi16(_mm512_castsi256_si512(xc), il,
                                                                                    _mm512_castsi256_si512(yc)));
                }
            }
            for (int64_t a0 = hh * nqh; a0 < (hh + 1) * nqh; a0 += GA) {
                const int64_t ga = (hh + 1) * nqh - a0 < GA ? (hh + 1) * nqh - a0 : GA;
                const int32_t *pp = (const int32_t *)(scores + a0 * sstride) + 8 * k;
                if (ga == GA) pass2_dp_block(nc, GA, GA, pp, sstride, acc + a0 * nc, vt);
                else pass2_dp_block(nc, GA, ga, pp, sstride, acc + a0 * nc, vt);
            }
        }
    }
}
#endif
