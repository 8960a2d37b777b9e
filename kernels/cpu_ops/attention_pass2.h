/* Paged attention (paged_attention.c), pass 2: acc[a] = sum_s p[a, s] * v_s. Included by
 * paged_attention.c after its types and attention_rows.h (pf_step prefetches the next item
 * as the keys go by). */
#pragma once

/* Keys per pass-2 block: a group's accumulators are loaded and stored once a block, and the
 * block's V rows of one head (64 x 256 B at head_dim 64, fp32) stay in L1 across its groups */
#if !P2_HALVES
#define P2_KEYS 64
#else
#define P2_KEYS 16
#endif

#if !P2_HALVES
/* ac[g] += p(g, s) * v_s for keys s0 <= s < s1 (vr[s]: the row, off: the head's slice in it)
 * and the group's vectors g < ga (of GA); p(g, s) = ps[g sa + s ss]. */
static inline __attribute__((always_inline)) void p2_keys(
    v16 *ac, const float *ps, const int64_t sa, int64_t ss, const char *const *vr, int64_t off, int64_t s0,
    int64_t s1, const int64_t nc, const int64_t GA, const int64_t ga, const int bf16, pf_t *pf, int64_t pf_per) {
    for (int64_t s = s0; s < s1; s++) {
        pf_step(pf, pf_per);
        v16 v[MAX_NC];
        load_row(vr[s] + off, bf16, nc, v);
#pragma GCC unroll 16
        for (int64_t g = 0; g < GA; g++) {
            const float p = g < ga ? ps[g * sa + s * ss] : 0.f;
#pragma GCC unroll 16
            for (int64_t c = 0; c < nc; c++) ac[g * nc + c] += p * v[c];
        }
    }
}
#endif

#if P2_HALVES
/* AVX2, three vectors of one head at once (a decode's G = 3 query heads per KV head): each V
 * row is read and widened once for all three, 32 of its elements at a time, with 12
 * accumulators, 4 elements of V and 3 weights p in the 16 ymm. One vector at a time widened
 * every row three times, and inside run_heads GCC kept the key counter and the dtype test in
 * memory (a store-forwarding round trip per key). Each accumulator element still sums its keys
 * in order with the same FMAs: the result is pass2's bit for bit. Its own (not inlined)
 * function, so that its few values get registers. acc rows: vector g at accf + 16 nc g.
 * vp: key s also prefetches row s of the next block (vn[s], s < nvn), this head's slice. */
static inline __attribute__((always_inline)) void p2_three_body(
    const char *const *vr, int64_t off, int64_t n, const float *ps, int64_t sa, int64_t ss, float *accf,
    int64_t nc, const int bf16, pf_t *pf, int64_t pf_per, const char *const *vn, int64_t nvn, const int vp) {
    const int64_t esz = bf16 ? 2 : 4;
    for (int64_t h = 0; h < nc / 2; h++) {
        __m256 a[3][4];
        for (int g = 0; g < 3; g++)
            for (int i = 0; i < 4; i++) a[g][i] = _mm256_loadu_ps(accf + 16 * nc * g + 32 * h + 8 * i);
        for (int64_t s = 0; s < n; s++) {
            if (h == 0) pf_step(pf, pf_per);
            if (vp && h == 0 && s < nvn)
                for (int64_t c = 0; c < 16 * nc * esz; c += 64) __builtin_prefetch(vn[s] + off + c, 0, 3);
            const char *row = vr[s] + off + 32 * esz * h;
            const __m256 p0 = _mm256_broadcast_ss(ps + s * ss), p1 = _mm256_broadcast_ss(ps + sa + s * ss),
                         p2 = _mm256_broadcast_ss(ps + 2 * sa + s * ss);
            for (int i = 0; i < 4; i++) {
                const __m256 v = bf16 ? bf16x8_to_f32(row + 16 * i) : _mm256_loadu_ps((const float *)row + 8 * i);
                a[0][i] = _mm256_fmadd_ps(p0, v, a[0][i]);
                a[1][i] = _mm256_fmadd_ps(p1, v, a[1][i]);
                a[2][i] = _mm256_fmadd_ps(p2, v, a[2][i]);
            }
        }
        for (int g = 0; g < 3; g++)
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(accf + 16 * nc * g + 32 * h + 8 * i, a[g][i]);
    }
}

__attribute__((noinline)) static void p2_three(const char *const *vr, int64_t off, int64_t n, const float *ps,
                                               int64_t sa, int64_t ss, float *accf, int64_t nc, int bf16, pf_t *pf,
                                               int64_t pf_per, const char *const *vn, int64_t nvn) {
    if (bf16 && nvn > 0) p2_three_body(vr, off, n, ps, sa, ss, accf, nc, 1, pf, pf_per, vn, nvn, 1);
    else if (bf16) p2_three_body(vr, off, n, ps, sa, ss, accf, nc, 1, pf, pf_per, vn, nvn, 0);
    else p2_three_body(vr, off, n, ps, sa, ss, accf, nc, 0, pf, pf_per, vn, nvn, 0);
}
#endif

/* Pass 2 of an item: acc[a] += sum_s p[a, s] * v_s, P2_KEYS keys at a time (a head's V rows
 * of the block stay in L1 across its groups), GA vectors of one head at a time with their
 * accumulators in registers across the block (GA * nc <= 24). p of the head's vector j
 * (a = hh * nqh + j) and key s at scores[hh * sh + j * sa + s * ss]: a row per vector
 * (sa = sstride, ss = 1) or, after pass1_qlanes, a row per key (sa = 1, ss = LD).
 * vpf (AVX2, three vectors a head): the next block's V rows are prefetched, their addresses
 * in vn [P2_KEYS], as p2_three reads this block's. */
static inline __attribute__((always_inline)) void pass2(
    const args_t *A, const int32_t *table, int64_t h0, int64_t nh, int64_t nqh, int64_t s_begin,
    int64_t n_max, const int64_t nc, const int64_t GA, const float *scores, int64_t sh, int64_t sa, int64_t ss, v16 *acc,
    pf_t *pf, int64_t pf_per, const char **vrow, const char **vn, const int vpf) {
    (void)vpf;
    const int64_t esz = A->bf16 ? 2 : 4, head_bytes = esz * 16 * nc, row_bytes = head_bytes * A->Hkv;
    const char *vbase = (const char *)A->v_cache;
    for (int64_t s0 = s_begin; s0 < n_max; s0 += P2_KEYS) {
        const int64_t s1 = n_max - s0 < P2_KEYS ? n_max : s0 + P2_KEYS;
        row_ptrs(vbase, table, A->BS, row_bytes, s0, s1 - s0, vrow);
#if P2_HALVES
        const int64_t nvn = !vpf ? 0 : n_max - s1 < P2_KEYS ? n_max - s1 : P2_KEYS;
        if (nvn > 0) row_ptrs(vbase, table, A->BS, row_bytes, s1, nvn, vn);
#endif
        for (int64_t hh = 0; hh < nh; hh++) {
            for (int64_t a0 = hh * nqh; a0 < (hh + 1) * nqh; a0 += GA) {
                const int64_t ga = (hh + 1) * nqh - a0 < GA ? (hh + 1) * nqh - a0 : GA;
                const float *ps = scores + hh * sh + (a0 - hh * nqh) * sa; /* p(a0 + g, s) = ps[g sa + s ss] */
#if P2_HALVES
                if (GA == 1 && nc % 2 == 0 && (hh + 1) * nqh - a0 >= 3) { /* the next three vectors at once */
                    p2_three(vrow, (h0 + hh) * head_bytes, s1 - s0, ps + s0 * ss, sa, ss, (float *)(acc + a0 * nc), nc,
                             A->bf16, pf, pf_per, vn, nvn);
                    a0 += 2; /* the loop adds the third */
                    continue;
                }
                /* AVX2: GCC keeps an array of 64-byte vectors on the stack, a store and a reload
                 * per key; 8-lane halves with constant indexes stay in ymm. ah[g * 2nc + i]:
                 * lanes 8i .. 8i + 7 of vector a0 + g. */
                __m256 ah[2 * MAX_NC]; /* 2 GA nc <= 2 P2_VECS, or 2 nc (GA = 1) */
                float *accf = (float *)(acc + a0 * nc);
#pragma GCC unroll 8
                for (int64_t i = 0; i < 2 * GA * nc; i++)
                    ah[i] = i < 2 * ga * nc ? _mm256_loadu_ps(accf + 8 * i) : _mm256_setzero_ps();
                for (int64_t s = s0; s < s1; s++) {
                    pf_step(pf, pf_per);
                    const char *vr = vrow[s - s0] + (h0 + hh) * head_bytes;
#pragma GCC unroll 4
                    for (int64_t g = 0; g < GA; g++) {
                        const __m256 pv = _mm256_set1_ps(g < ga ? ps[g * sa + s * ss] : 0.f);
#pragma GCC unroll 8
                        for (int64_t i = 0; i < 2 * nc; i++) {
                            const __m256 v = A->bf16 ? bf16x8_to_f32((const uint16_t *)vr + 8 * i)
                                                     : _mm256_loadu_ps((const float *)vr + 8 * i);
                            ah[g * 2 * nc + i] = _mm256_fmadd_ps(pv, v, ah[g * 2 * nc + i]);
                        }
                    }
                }
#pragma GCC unroll 8
                for (int64_t i = 0; i < 2 * ga * nc; i++) _mm256_storeu_ps(accf + 8 * i, ah[i]);
#else
                v16 ac[MAX_NC]; /* GA * nc <= 24, or nc alone (GA = 1) up to MAX_NC */
#pragma GCC unroll 24
                for (int64_t i = 0; i < GA * nc; i++) ac[i] = i < ga * nc ? acc[a0 * nc + i] : (v16){0};
                const char *const *vr = vrow - s0;
                const int64_t off = (h0 + hh) * head_bytes;
                /* constants where they can be: a whole group, rows of fp32 or bf16, and p of
                 * the group's vectors side by side (sa = 1) inline as immediates, with no test
                 * per key (the generic form left GCC a branch per vector and per row) */
                if (ga == GA && sa == 1 && !A->bf16) p2_keys(ac, ps, 1, ss, vr, off, s0, s1, nc, GA, GA, 0, pf, pf_per);
                else if (ga == GA && sa == 1) p2_keys(ac, ps, 1, ss, vr, off, s0, s1, nc, GA, GA, 1, pf, pf_per);
                else if (ga == GA && !A->bf16) p2_keys(ac, ps, sa, ss, vr, off, s0, s1, nc, GA, GA, 0, pf, pf_per);
                else if (ga == GA) p2_keys(ac, ps, sa, ss, vr, off, s0, s1, nc, GA, GA, 1, pf, pf_per);
                else p2_keys(ac, ps, sa, ss, vr, off, s0, s1, nc, GA, ga, A->bf16, pf, pf_per);
#pragma GCC unroll 24
                for (int64_t i = 0; i < GA * nc; i++)
                    if (i < ga * nc) acc[a0 * nc + i] = ac[i];
#endif
            }
        }
    }
}
