/* One work item of paged attention: the passes of attention_*.h put together for every KV head
 * of one (sequence, row tile). paged_attention.c has the contract, the plan and the driver.
 * Each translation unit that includes this instantiates run_heads once (DEFINE_RUN_ITEM):
 * paged_attention.c for head_dim 64, attention_item_128.c and attention_item_any.c for the
 * rest, so the three compile in parallel (as one file they were ~23 s of a ~30 s build on the
 * 2-core AVX2 box). */
#ifndef LLMSVC_ATTENTION_ITEM_H
#define LLMSVC_ATTENTION_ITEM_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "bf16.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#include "vexp.h"
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16u __attribute__((vector_size(64)));

#if defined(__AVX512F__)
#define P2_VECS 16 /* pass-2 accumulators (v16) a group keeps in registers: 16 zmm */
#else
#define P2_VECS 4 /* 8 of the 16 ymm: more spilled every accumulator to the stack */
#ifdef __AVX2__
#include <immintrin.h>
#define P2_HALVES 1 /* pass 2 on explicit 8-lane halves (see pass2) */
#endif
#endif

#ifndef P2_HALVES
#define P2_HALVES 0
#endif

#define ROWS 8      /* query rows per work item (prefill tiles): 24 vectors per KV head at G = 3,
                     * which pass 2 takes six at a time; 4 rows gave a 1 x 256 prefill ~9% more
                     * attention time (docs/cpu-kernels.md) */
#define MAX_NC 32   /* D / 16 bound: head_dim <= 512 */

#include "reduce16.h"

/* Row of D = 16 * nc elements at p (fp32 or bf16) -> nc fp32 vectors. */
static inline void load_row(const void *p, int bf16, int64_t nc, v16 *dst) {
    if (!bf16) {
        for (int64_t c = 0; c < nc; c++) dst[c] = *(const v16 *)((const float *)p + 16 * c);
    } else {
        for (int64_t c = 0; c < nc; c++) {
#ifdef __AVX512F__ /* one widening load; GCC splits the generic conversion into 8-lane halves,
            * which costs time when K/V sit in cache (docs/cpu-kernels.md) */
            dst[c] = (v16)bf16x16_to_f32((const uint16_t *)p + 16 * c);
#else
            v16u u = __builtin_convertvector(*(const v16h *)((const uint16_t *)p + 16 * c), v16u);
            dst[c] = (v16)(u << 16);
#endif
        }
    }
}

typedef struct {
    int32_t seq, row0, nrows, head; /* head < 0: every KV head in turn */
} item_t;

typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int32_t *block_table, *qsl, *seq_lens;
    int64_t q_stride, bt_stride, Hq, Hkv, D, BS;
    float scale, soft_cap;
    int64_t window; /* 0: none */
    int bf16;
    int64_t pf_bytes; /* pf_bytes() */
} args_t;

/* Keys the item's last query row sees: the cache rows the item reads. */
static inline int64_t item_keys(const args_t *A, const item_t *it) {
    const int64_t q_len = A->qsl[it->seq + 1] - A->qsl[it->seq];
    return A->seq_lens[it->seq] - q_len + it->row0 + it->nrows;
}

/* First key a query row sees when it sees keys up to lim (exclusive): its window's start. */
static inline int64_t window_lo(const args_t *A, int64_t lim) {
    return A->window > 0 && lim - A->window > 0 ? lim - A->window : 0;
}

/* First key any row of the item sees: its first row's window start. */
static inline int64_t item_first_key(const args_t *A, const item_t *it) {
    return window_lo(A, item_keys(A, it) - it->nrows + 1);
}

#include "attention_rows.h"

#define QC 16 /* query vectors (rows x heads) of the items that take pass1_direct */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_DP 1
#else
#define HAVE_DP 0
#endif

#include "attention_pass1.h"
#include "attention_pass2.h"
#include "attention_dp.h"
#include "attention_qlanes.h"
#include "attention_softmax.h"

/* Heads [h0, h0 + nh) of one item; nx: the item this thread runs next, or NULL. ws: per-thread
 * fp32 workspace of ws_floats(nh, ...): nh * LD * (max_keys + 16) scores, nq * D query vectors
 * and as many accumulators, 16 * nh * D for a group's K rows, and for pass1_qlanes nh * D * LD
 * transposed queries and nq inverse sums (LD: nqh rounded up to 16). Each cache row is streamed
 * from memory once, front to back.
 * Always inlined into run_item_<nc> below, so the common head sizes get constant trip counts. */
static inline __attribute__((always_inline)) void run_heads(const args_t *A, const item_t *it, int64_t h0,
                                                            int64_t nh, const item_t *nx, float *ws,
                                                            int64_t max_keys, const int64_t nc) {
    const int64_t G = A->Hq / A->Hkv, nqh = (int64_t)it->nrows * G, nq = nqh * nh, D = 16 * nc;
    const int64_t esz = A->bf16 ? 2 : 4, row_stride = A->Hkv * D; /* elements between keys */
    const int64_t q0 = A->qsl[it->seq], q_len = A->qsl[it->seq + 1] - q0;
    const int64_t ctx = A->seq_lens[it->seq], first_lim = ctx - q_len + it->row0 + 1;
    const int64_t n_max = item_keys(A, it); /* = first_lim + nrows - 1 */
    const int64_t s_begin = item_first_key(A, it), sstride = max_keys + 16; /* scores by key position */
    const int32_t *table = A->block_table + (int64_t)it->seq * A->bt_stride;
    /* bf16 dot products (AVX512-BF16, head_dim a multiple of 32) read q as stored; the other
     * passes take it widened and scaled in qv */
    const int dp = HAVE_DP && A->bf16 && nc % 2 == 0;
    /* prefill tiles on AVX-512 (unless bf16 takes attention_dp.h's tiles) and on AVX2: query
     * vectors in lanes (attention_qlanes.h) */
    const int ql = qlanes_allowed(A->bf16, A->soft_cap) && nq > QC && nqh <= QL_LANES * QL_MAX_Z;
    const int64_t LD = QL_LANES * ((nqh + QL_LANES - 1) / QL_LANES);
    float *scores = ws;                              /* ql: [nh, sstride, LD]; else [nq, sstride], a = hh * nqh + r * G + g */
    v16 *qv = (v16 *)(ws + (ql ? nh * LD : nq) * sstride); /* [nq, nc] */
    v16 *acc = qv + nq * nc;                         /* [nq, nc] */
    v16 *kb = acc + nq * nc;                         /* [nh, 16 nc]: a group's K rows (or V pairs) */
    float *qt = (float *)(kb + nh * 16 * nc);        /* ql: [nh, D, LD] */
    float *inv = qt + nh * D * LD;                   /* ql: [nq] */
    for (int64_t a = 0; !dp && a < nq; a++) {
        const int64_t hh = a / nqh, r = (a % nqh) / G, g = a % G;
        const char *src = (const char *)A->q + esz * ((q0 + it->row0 + r) * A->q_stride + ((h0 + hh) * G + g) * D);
        load_row(src, A->bf16, nc, qv + a * nc);
        for (int64_t c = 0; c < nc; c++) qv[a * nc + c] *= A->scale;
    }
    /* pass 1 */
    const int64_t row_bytes = esz * row_stride, head_bytes = esz * D;
    const char *krow[16], *vrow[P2_KEYS], *knext[16], *vnext[16]; /* vrow: pass 2's block */
    /* bf16 decodes on AVX2 (pass1_direct_avx2_bf16, then p2_three): pass 1 prefetches K only and
     * pass 2 the V rows of its next block. With both in pass 1, which these decodes run fast,
     * V's prefetches crowded K's and memory idled through pass 2: 3-8% faster this way on the
     * AVX2 box (docs/cpu-kernels.md). fp32 decodes gained nothing from it and keep both in pass 1.
     * Pass 2 takes vnext (done with by then) for the next block's V row addresses. */
    const int vpf = P2_HALVES && A->bf16 && nq <= QC && nc <= 4 && nc % 2 == 0 && nqh >= 3;
    _Static_assert(!P2_HALVES || P2_KEYS <= 16, "pass 2's next-block V rows go into vnext [16]");
#if P2_HALVES
    if (nq <= QC && nc <= 4 && A->bf16) {
        pass1_direct_avx2_bf16(A, it, h0, nh, table, qv, scores, sstride, s_begin, n_max, nc, krow, knext, vnext,
                               !vpf);
    } else
#endif
    if (nq <= QC && !A->bf16) { /* dp a constant in each call: two specialised copies */
        pass1_direct(A, it, h0, nh, table, qv, scores, sstride, s_begin, n_max, nc, 0, krow, knext, vnext);
    } else if (nq <= QC && dp) {
        pass1_direct(A, it, h0, nh, table, qv, scores, sstride, s_begin, n_max, nc, 1, krow, knext, vnext);
    }
#if HAVE_QLANES
    else if (ql) {
        pass1_qlanes(A, h0, nh, nqh, table, qv, kb, qt, scores, sstride, s_begin, n_max, nc, krow, knext, vnext);
    }
#endif
#if HAVE_DP
    else if (dp) {
        pass1_transposed(A, it, h0, nh, table, qv, kb, scores, sstride, s_begin, n_max, nc, krow, knext, vnext);
    }
#endif
    else {
        pass1_workspace(A, h0, nh, nqh, table, qv, kb, scores, sstride, s_begin, n_max, nc, krow, knext, vnext);
    }
    pf_t pf = {.left = 0, .vrows = 0};
    const int64_t pf_lines = nx && (nx->seq != it->seq || nx->head != it->head) /* else: rows this item just read */
                                 ? pf_plan(A, nx, row_bytes, head_bytes, &pf) : 0;
    /* pf_step calls: one per (pass-2 key, head) */
    const int64_t pass2_iters = (n_max - s_begin) * nh > 0 ? (n_max - s_begin) * nh : 1;
    const int64_t pf_per = (pf_lines + pass2_iters - 1) / pass2_iters;
    /* softmax over each vector's visible keys; in bf16 for the prefill tiles that take pass2_dp */
    const int p_bf16 = HAVE_DP && nq > QC && A->bf16;
#if HAVE_QLANES
    if (ql)
        softmax_qlanes(A, nh, nqh, scores, sstride, s_begin, n_max, first_lim, inv);
    else
#endif
        softmax_rows(A, nq, nqh, G, scores, sstride, s_begin, n_max, first_lim, p_bf16);
    for (int64_t i = 0; i < nq * nc; i++) acc[i] = (v16){0};
    /* pass 2: GA vectors of a head at a time, their accumulators in registers: 6 (24 zmm)
     * when a head's vectors come in sixes (prefill tiles of head_dim 64), else 16 / nc; on
     * AVX2 three at a time where a head has them (p2_three) */
#if HAVE_DP
    if (p_bf16) {
        if (nc == 4 && nqh % 6 == 0)
            pass2_dp(A, table, h0, nh, nqh, s_begin, n_max, nc, 6, scores, sstride, acc, (__m512i *)kb, &pf, pf_per, vrow);
        else
            pass2_dp(A, table, h0, nh, nqh, s_begin, n_max, nc, 16 / nc > 0 ? 16 / nc : 1, scores, sstride, acc,
                     (__m512i *)kb, &pf, pf_per, vrow);
    } else
#endif
    {
        /* p(vector j of head hh, key s): a row per key after pass1_qlanes, else a row per vector */
        const int64_t sh = ql ? sstride * LD : nqh * sstride, sa = ql ? 1 : sstride, ss = ql ? LD : 1;
        if (P2_VECS == 16 && nc == 4 && nqh % 6 == 0)
            pass2(A, table, h0, nh, nqh, s_begin, n_max, nc, 6, scores, sh, sa, ss, acc, &pf, pf_per, vrow, vnext, vpf);
        else
            pass2(A, table, h0, nh, nqh, s_begin, n_max, nc, P2_VECS / nc > 0 ? P2_VECS / nc : 1, scores, sh, sa, ss,
                  acc, &pf, pf_per, vrow, vnext, vpf);
    }
    for (int64_t a = 0; a < nq; a++) {
        const int64_t hh = a / nqh, r = (a % nqh) / G, g = a % G;
        const int64_t dst = ((q0 + it->row0 + r) * A->Hq + (h0 + hh) * G + g) * D;
        if (ql) /* pass1_qlanes left the weights unnormalised */
            for (int64_t c = 0; c < nc; c++) acc[a * nc + c] *= inv[a];
        if (!A->bf16) {
            for (int64_t c = 0; c < nc; c++) *(v16 *)((float *)A->out + dst + 16 * c) = acc[a * nc + c];
        } else {
            const float *f = (const float *)(acc + a * nc);
            for (int64_t d = 0; d < D; d++) ((uint16_t *)A->out)[dst + d] = f32_to_bf16(f[d]);
        }
    }
}


/* One item = every KV head of one (sequence, row tile), in one pass over its cache rows.
 * With few tiles (a lone long decode) items are split per head instead, to keep every
 * thread busy. */
typedef void item_fn(const args_t *A, const item_t *it, const item_t *nx, float *ws, int64_t max_keys);
#define DEFINE_RUN_ITEM(NAME, NC)                                                              \
    __attribute__((visibility("hidden"))) void NAME(const args_t *A, const item_t *it,            \
                                                    const item_t *nx, float *ws, int64_t mk) {    \
        if (it->head >= 0) run_heads(A, it, it->head, 1, nx, ws, mk, (NC));                   \
        else run_heads(A, it, 0, A->Hkv, nx, ws, mk, (NC));                                   \
    }
/* head_dim 64 (paged_attention.c), 128 (attention_item_128.c), any other (attention_item_any.c):
 * constant trip counts for the common sizes */
__attribute__((visibility("hidden"))) item_fn run_item_4, run_item_8, run_item_any;

/* Floats of run_heads' workspace for nh heads of nqh query vectors each. */
static inline int64_t ws_floats(int64_t nh, int64_t nqh, int64_t max_keys, int64_t D) {
    const int64_t LD = QL_LANES * ((nqh + QL_LANES - 1) / QL_LANES);
    return nh * (LD * (max_keys + 16 + D) + nqh * (2 * D + 1) + 16 * D);
}
#endif
