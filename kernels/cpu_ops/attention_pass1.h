/* Paged attention (paged_attention.c), pass 1: scores[a, s] = scale * q_a . k_s, 16 keys at a
 * time, in three variants: decodes read each K row in place (pass1_direct; bf16 on AVX2,
 * pass1_direct_avx2_bf16), prefill tiles copy a group's rows into a workspace first
 * (pass1_workspace) where attention_qlanes.h's tiles do not run (no AVX2, a soft cap, or more
 * query vectors than they hold); AVX512-BF16 bf16 prefill tiles take attention_dp.h. Included by
 * paged_attention.c after its types, attention_rows.h, QC and HAVE_DP. */
#pragma once

/* Pass 1 of an item with at most QC query vectors (a decode: G per KV head), reading each K
 * row where it is stored; per key j (front to back, each head's slice in turn) every vector's
 * partial sums, then reduce16 per 16 keys, and the next group's rows prefetched while this
 * group's are loaded.
 *   fp32 (dp = 0): q already scaled (qv), 16-lane partial sums over the D / 16 chunks.
 *   bf16 (dp = 1, AVX512-BF16, head_dim a multiple of 32): VDPBF16PS on q and the K rows as
 *   stored, nothing widened. Each product of two bf16 is exact in fp32, as widened; the scale
 *   comes after the sum, and VDPBF16PS reads bf16 denormals as zero.
 * With a handful of vectors per KV head the transposition of pass1_transposed does not pay
 * for itself; prefill tiles (then 4 rows: 12 vectors per KV head) ran 1.6x slower in bf16
 * this way than with a workspace of widened rows, and take pass1_transposed. */
static inline __attribute__((always_inline)) void pass1_direct(
    const args_t *A, const item_t *it, int64_t h0, int64_t nh, const int32_t *table, const v16 *qv,
    float *scores, int64_t sstride, int64_t s_begin, int64_t n_max, const int64_t nc, const int dp,
    const char **krow, const char **knext, const char **vnext) {
    const int64_t G = A->Hq / A->Hkv, nqh = (int64_t)it->nrows * G, nq = nh * nqh;
    const int64_t esz = dp ? 2 : 4, D = 16 * nc, head_bytes = esz * D, row_bytes = esz * A->Hkv * D;
    int64_t koff[QC]; /* byte offset of vector a's head slice in a cache row */
    for (int64_t a = 0; a < nq; a++) koff[a] = (h0 + a / nqh) * head_bytes;
#if HAVE_DP
    __m512bh qb[QC][MAX_NC / 2]; /* dp: q_a as stored, pairs in the K rows' order */
    const int64_t q0 = A->qsl[it->seq];
    for (int64_t a = 0; dp && a < nq; a++) {
        const int64_t r = (a % nqh) / G, g = a % G;
        const uint16_t *src = (const uint16_t *)A->q + (q0 + it->row0 + r) * A->q_stride + ((h0 + a / nqh) * G + g) * D;
        for (int64_t c = 0; c < nc / 2; c++) qb[a][c] = (__m512bh)_mm512_loadu_si512(src + 32 * c);
    }
#endif
    for (int64_t s0 = s_begin; s0 < n_max; s0 += 16) {
        int64_t nn;
        const int64_t kn = group_rows(A, table, row_bytes, s0, n_max, krow, knext, vnext, &nn);
        v16 part[QC][16];
        for (int64_t j = 0; j < 16; j++) {
            if (j < nn) prefetch_next_row(knext, vnext, j, h0, nh, head_bytes, 1); /* spread over the loads */
            for (int64_t a = 0; a < nq; a++) {
                v16 p = (v16){0};
                if (j < kn && !dp) {
                    const v16 *k = (const v16 *)(krow[j] + koff[a]), *qa = qv + a * nc;
                    p = qa[0] * k[0];
                    for (int64_t c = 1; c < nc; c++) p += qa[c] * k[c];
                }
#if HAVE_DP
                if (j < kn && dp)
                    for (int64_t c = 0; c < nc / 2; c++)
                        p = (v16)_mm512_dpbf16_ps((__m512)p, qb[a][c], (__m512bh)_mm512_loadu_si512(krow[j] + koff[a] + 64 * c));
#endif
                part[a][j] = p;
            }
        }
        for (int64_t a = 0; a < nq; a++)
            *(v16 *)(scores + a * sstride + s0) = dp ? reduce16(part[a]) * A->scale : reduce16(part[a]);
    }
}

#if P2_HALVES
/* q . k over D = 16 nc as 8 partial sums; q: 2 nc ymm (in registers across the caller's
 * loop), k: one head's bf16 slice of a K row. Two accumulators: 4-cycle FMA latency. */
static inline __attribute__((always_inline)) __m256 dot8_bf16(const __m256 *q, const char *k, const int64_t nc) {
    __m256 s0 = _mm256_mul_ps(q[0], bf16x8_to_f32(k)), s1 = _mm256_mul_ps(q[1], bf16x8_to_f32(k + 16));
#pragma GCC unroll 8
    for (int64_t i = 2; i < 2 * nc; i += 2) {
        s0 = _mm256_fmadd_ps(q[i], bf16x8_to_f32(k + 16 * i), s0);
        s1 = _mm256_fmadd_ps(q[i + 1], bf16x8_to_f32(k + 16 * (i + 1)), s1);
    }
    return _mm256_add_ps(s0, s1);
}

/* The scores of 8 keys from two hadd trees: t0 holds keys 0-3 over lanes 0-3 | over lanes 4-7,
 * t1 likewise keys 4-7; their halves added give key j in lane j. */
static inline __attribute__((always_inline)) void store8_keys(float *out, __m256 t0, __m256 t1) {
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31)));
}

/* dot8_bf16 of three query vectors (qa: 3 x 2 nc floats, 16 nc apart) with one K slice, which
 * is widened once for all three; each vector's sums exactly as dot8_bf16 makes them. */
static inline __attribute__((always_inline)) void dot8x3_bf16(const float *qa, const char *k, const int64_t nc,
                                                               __m256 d[3]) {
    __m256 s[3][2];
    const __m256 k0 = bf16x8_to_f32(k), k1 = bf16x8_to_f32(k + 16);
    for (int g = 0; g < 3; g++) {
        s[g][0] = _mm256_mul_ps(_mm256_loadu_ps(qa + 16 * nc * g), k0);
        s[g][1] = _mm256_mul_ps(_mm256_loadu_ps(qa + 16 * nc * g + 8), k1);
    }
#pragma GCC unroll 8
    for (int64_t i = 2; i < 2 * nc; i += 2) {
        const __m256 ki = bf16x8_to_f32(k + 16 * i), kj = bf16x8_to_f32(k + 16 * (i + 1));
        for (int g = 0; g < 3; g++) {
            s[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qa + 16 * nc * g + 8 * i), ki, s[g][0]);
            s[g][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qa + 16 * nc * g + 8 * (i + 1)), kj, s[g][1]);
        }
    }
    for (int g = 0; g < 3; g++) d[g] = _mm256_add_ps(s[g][0], s[g][1]);
}

/* pass1_direct_avx2_bf16's scores of three vectors of one head over a group's kn keys (zeros
 * past kn), each K slice widened once for the three (one vector at a time widened it three
 * times), their 8-key hadd trees the same as for one vector: bit for bit its scores. qa: the
 * first vector's floats; out: its score row, the others sstride apart; pf: prefetch the next
 * group's row j < nn (this head; its V slice too with pv) per key j. Not inlined: its values
 * get registers of their own. */
__attribute__((noinline)) static void p1_three_bf16(const float *qa, const char *const *krow, int64_t off, int64_t kn,
                                                    int64_t nc, float *out, int64_t sstride, int pf, int64_t nn,
                                                    const char *const *knext, const char *const *vnext, int64_t head,
                                                    int64_t head_bytes, int pv) {
    for (int64_t r0 = 0; r0 < 16; r0 += 8) {
        __m256 d[8][3];
        for (int64_t j = 0; j < 8; j++) {
            if (pf && r0 + j < nn) prefetch_next_row(knext, vnext, r0 + j, head, 1, head_bytes, pv);
            if (r0 + j < kn) dot8x3_bf16(qa, krow[r0 + j] + off, nc, d[j]);
            else d[j][0] = d[j][1] = d[j][2] = _mm256_setzero_ps();
        }
        for (int g = 0; g < 3; g++) {
            const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(d[0][g], d[1][g]), _mm256_hadd_ps(d[2][g], d[3][g]));
            const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(d[4][g], d[5][g]), _mm256_hadd_ps(d[6][g], d[7][g]));
            store8_keys(out + g * sstride + r0, t0, t1);
        }
    }
}

/* AVX2 pass 1 of a bf16 decode item (nc <= 4), instead of pass1_workspace's copy of the
 * group's rows: one query vector at a time, held in 2 nc ymm across the group's 16 keys, each
 * key's slice widened as it is read where it is stored (from L1 after the head's first
 * vector); reduce8_avx2's 8 x 8 transpose-add folds the keys in pairs as they come, so the
 * partial sums never leave registers. The next group's rows are prefetched one (row, head)
 * per key of each head's first vector, their V rows too unless pv is 0 (pass 2 prefetches
 * them: paged_attention.c's run_heads). benchmarks.attention_ab, bf16 decode 64 x ~200 keys on
 * the AVX2 box: 4-10% faster than the workspace. Vectors come three at a time where a head has
 * them (p1_three_bf16): 23.2 -> 19.9 ms there. fp32 decodes keep pass1_direct, whole rows
 * per key: this order made them 15-20% slower there. */
static inline __attribute__((always_inline)) void pass1_direct_avx2_bf16(
    const args_t *A, const item_t *it, int64_t h0, int64_t nh, const int32_t *table, const v16 *qv,
    float *scores, int64_t sstride, int64_t s_begin, int64_t n_max, const int64_t nc, const char **krow,
    const char **knext, const char **vnext, const int pv) {
    const int64_t G = A->Hq / A->Hkv, nqh = (int64_t)it->nrows * G;
    const int64_t head_bytes = 2 * 16 * nc, row_bytes = head_bytes * A->Hkv;
    for (int64_t s0 = s_begin; s0 < n_max; s0 += 16) {
        int64_t nn;
        const int64_t kn = group_rows(A, table, row_bytes, s0, n_max, krow, knext, vnext, &nn);
        for (int64_t hh = 0; hh < nh; hh++) {
            const int64_t off = (h0 + hh) * head_bytes;
            for (int64_t a = hh * nqh; a < (hh + 1) * nqh; a++) {
                if ((hh + 1) * nqh - a >= 3) { /* the next three vectors at once (p1_three_bf16) */
                    p1_three_bf16((const float *)(qv + a * nc), krow, off, kn, nc, scores + a * sstride + s0, sstride,
                                  a == hh * nqh, nn, knext, vnext, h0 + hh, head_bytes, pv);
                    a += 2; /* the loop adds the third */
                    continue;
                }
                __m256 q[8] = {0}; /* [2 nc] */
#pragma GCC unroll 8
                for (int64_t i = 0; i < 2 * nc; i++) q[i] = _mm256_loadu_ps((const float *)(qv + a * nc) + 8 * i);
                const int pf = a == hh * nqh;
                for (int64_t r0 = 0; r0 < 16; r0 += 8) {
#define DOT(J) (r0 + (J) < kn ? dot8_bf16(q, krow[r0 + (J)] + off, nc) : _mm256_setzero_ps())
#define PF(J) if (pf && r0 + (J) < nn) prefetch_next_row(knext, vnext, r0 + (J), h0 + hh, 1, head_bytes, pv)
                    /* live at most: q, t0, one pair sum and the dot in flight */
                    PF(0); PF(1);
                    const __m256 h01 = _mm256_hadd_ps(DOT(0), DOT(1));
                    PF(2); PF(3);
                    const __m256 t0 = _mm256_hadd_ps(h01, _mm256_hadd_ps(DOT(2), DOT(3)));
                    PF(4); PF(5);
                    const __m256 h45 = _mm256_hadd_ps(DOT(4), DOT(5));
                    PF(6); PF(7);
                    const __m256 t1 = _mm256_hadd_ps(h45, _mm256_hadd_ps(DOT(6), DOT(7)));
#undef DOT
#undef PF
                    store8_keys(scores + a * sstride + s0 + r0, t0, t1);
                }
            }
        }
    }
}
#endif

/* The group of up to 16 keys at s0 into the workspace kb [nh][16][D] fp32 (widened from
 * bf16; zeros past the item's last key), front to back, every head of a row in turn, so memory
 * sees one sequential stream per block rather than nh strided ones; the next group's rows are
 * prefetched as these are loaded. */
static inline __attribute__((always_inline)) void copy_group(
    const args_t *A, const int32_t *table, int64_t row_bytes, int64_t head_bytes, int64_t s0, int64_t n_max,
    int64_t h0, int64_t nh, v16 *kb, const int64_t nc, const char **krow, const char **knext, const char **vnext) {
    int64_t nn;
    const int64_t kn = group_rows(A, table, row_bytes, s0, n_max, krow, knext, vnext, &nn);
    for (int64_t j = 0; j < 16; j++) {
        for (int64_t hh = 0; hh < nh; hh++) {
            v16 *dst = kb + (hh * 16 + j) * nc;
            if (j < kn) load_row(krow[j] + (h0 + hh) * head_bytes, A->bf16, nc, dst);
            else for (int64_t c = 0; c < nc; c++) dst[c] = (v16){0};
        }
        if (j < nn) prefetch_next_row(knext, vnext, j, h0, nh, head_bytes, 1); /* spread over the loads */
    }
}

/* Pass 1 of a prefill item (more than QC query vectors), fp32 or bf16 without AVX512-BF16:
 * the group's 16 K rows are copied (widened) into the workspace kb (copy_group); each key
 * then gives a vector of 16 partial sums per query vector, and reduce16 turns
 * 16 such vectors into the 16 scores. qv: q already scaled. */
static inline __attribute__((always_inline)) void pass1_workspace(
    const args_t *A, int64_t h0, int64_t nh, int64_t nqh, const int32_t *table, const v16 *qv, v16 *kb,
    float *scores, int64_t sstride, int64_t s_begin, int64_t n_max, const int64_t nc, const char **krow,
    const char **knext, const char **vnext) {
    const int64_t esz = A->bf16 ? 2 : 4, head_bytes = esz * 16 * nc, row_bytes = head_bytes * A->Hkv;
    for (int64_t s0 = s_begin; s0 < n_max; s0 += 16) {
        v16 part[16];
        copy_group(A, table, row_bytes, head_bytes, s0, n_max, h0, nh, kb, nc, krow, knext, vnext);
        for (int64_t hh = 0; hh < nh; hh++) {
            const v16 *k = kb + hh * 16 * nc;
            for (int64_t a = hh * nqh; a < (hh + 1) * nqh; a++) {
                const v16 *qa = qv + a * nc;
                for (int64_t j = 0; j < 16; j++) {
                    v16 p = qa[0] * k[j * nc];
                    for (int64_t c = 1; c < nc; c++) p += qa[c] * k[j * nc + c];
                    part[j] = p;
                }
                *(v16 *)(scores + a * sstride + s0) = reduce16(part);
            }
        }
    }
}
