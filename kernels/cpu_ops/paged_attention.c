/* Paged attention for the CPU: reads K/V in place through the block table (no gather).
 *
 * Same contract as kernels/reference.py::paged_attention (the ground truth):
 *   q:           [T, Hq, D]  row stride q_stride (elements), heads contiguous
 *   k/v cache:   [num_blocks, BS, Hkv, D] contiguous
 *   block_table: [B, bt_stride] int32
 *   qsl:         [B + 1] int32 cumulative query lengths; seq_lens: [B] int32 (incl. new tokens)
 *   out:         [T, Hq, D] contiguous
 * Sequence i's query row j (of q_len) attends to cache positions lo .. p, p = ctx - q_len + j,
 * lo = max(0, p - window + 1) (window 0: lo = 0). Rows before the item's first lo are never
 * read (their blocks may belong to another sequence by now). soft_cap > 0 maps each score s
 * to soft_cap * tanh(s / soft_cap) before the softmax.
 * GQA: the G = Hq / Hkv query heads of KV head h share every K/V row load.
 * D must be a multiple of 16 (checked by the caller and here).
 *
 * Work item = (sequence, tile of up to ROWS query rows) with all its KV heads, whose slices
 * of a cache row are adjacent: one pass over the rows serves every head, so each row is
 * streamed from memory once, front to back. Items run in parallel with OpenMP (torch's
 * libgomp is already loaded, so both share one thread pool), claimed dynamically one item
 * ahead, so that the thread can prefetch the next item's first rows. Per item, in fp32 (bf16 is
 * widened on load, rounded RNE on store):
 *   pass 1  scores[a, s] = scale * q_a . k_s, 16 keys at a time. Decodes (items of at most QC
 *           query vectors, pass1_direct; bf16 on AVX2, pass1_direct_avx2_bf16) read each K
 *           row where it is stored; prefill tiles
 *           copy the group's rows into a workspace first, widened (pass1_workspace) or, in
 *           bf16 on AVX512-BF16, transposed so 16 keys lie across a register for dot
 *           products (pass1_transposed, attention_dp.h). The next 16 K and V rows are
 *           prefetched, every cache line (block-table order defeats the hardware
 *           prefetcher), spread over this group's row loads: as one burst they stalled on
 *           full fill buffers;
 *   softmax over the keys each vector may see (causal limit per query row);
 *   pass 2  acc[a] = sum_s p[a, s] * v_s, 16 keys at a time with a few vectors' accumulators
 *           in registers (memory accumulators would chain every key through a store); bf16
 *           prefill tiles on AVX512-BF16 round p to bf16, as torch's CPU flash attention
 *           does, and take key pairs through dot products (pass2_dp, attention_dp.h).
 * Written with GCC/Clang vector extensions: 512-bit registers on AVX-512, split otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "bf16.h"
#ifdef __AVX512F__
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
            const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + 16 * c)));
            dst[c] = (v16)_mm512_slli_epi32(w, 16);
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

/* First key any row of the item sees: its first row's window start. */
static inline int64_t item_first_key(const args_t *A, const item_t *it) {
    if (A->window <= 0) return 0;
    const int64_t lo = item_keys(A, it) - it->nrows + 1 - A->window;
    return lo > 0 ? lo : 0;
}

/* out[i] = byte address of cache row s0 + i (i < n) of `base` through `table`: one division
 * per call rather than one per row (rows are visited 16 at a time, and often) */
static inline void row_ptrs(const char *base, const int32_t *table, int64_t bs, int64_t row_bytes,
                            int64_t s0, int64_t n, const char **out) {
    int64_t blk = s0 / bs, off = s0 - blk * bs;
    for (int64_t i = 0; i < n; i++) {
        out[i] = base + ((int64_t)table[blk] * bs + off) * row_bytes;
        if (++off == bs) { off = 0; blk++; }
    }
}

/* The group of up to 16 keys at s0: its cache rows (krow, returned: how many) and those of
 * the next group (knext, vnext: *nn of them, to prefetch while this group is loaded) */
static inline __attribute__((always_inline)) int64_t group_rows(
    const args_t *A, const int32_t *table, int64_t row_bytes, int64_t s0, int64_t n_max, const char **krow,
    const char **knext, const char **vnext, int64_t *nn) {
    const int64_t kn = n_max - s0 < 16 ? n_max - s0 : 16;
    row_ptrs((const char *)A->k_cache, table, A->BS, row_bytes, s0, kn, krow);
    *nn = n_max - s0 - 16 < 16 ? n_max - s0 - 16 : 16;
    if (*nn > 0) {
        row_ptrs((const char *)A->k_cache, table, A->BS, row_bytes, s0 + 16, *nn, knext);
        row_ptrs((const char *)A->v_cache, table, A->BS, row_bytes, s0 + 16, *nn, vnext);
    }
    return kn;
}

/* Row j of the next group into cache while this group is loaded: its K and V slices of heads
 * [h0, h0 + nh), every line (block-table order defeats the hardware prefetcher) */
static inline __attribute__((always_inline)) void prefetch_next_row(
    const char *const *knext, const char *const *vnext, int64_t j, int64_t h0, int64_t nh, int64_t head_bytes) {
    const char *pk = knext[j] + h0 * head_bytes, *pv = vnext[j] + h0 * head_bytes;
    for (int64_t c = 0; c < nh * head_bytes; c += 64) {
        __builtin_prefetch(pk + c);
        __builtin_prefetch(pv + c, 0, 2);
    }
}

/* The item a thread runs next, prefetched into L2 while this item's softmax and pass 2 run
 * from cache: its K rows (up to pf_bytes() of them), then its first 16 V rows, a few lines per
 * pass-2 key, walking its block table incrementally (no division per line). Pass 1 then reads
 * K from L2 while its own prefetches stream V, so memory stays busy through both passes
 * instead of idling through pass 2. Not when the next item is this one's next row tile: those
 * rows are in cache already, and the prefetches made prefill steps slower. */
typedef struct {
    const char *base, *row;
    const int32_t *table;
    int64_t bs, row_bytes, off, lines;   /* block size, row stride, slice offset, lines per slice */
    int64_t blk, in_blk, line, left;     /* position; left: rows still to prefetch in this segment */
    const char *vbase; int64_t first, vrows; /* the V segment that follows */
} pf_t;

static inline void pf_seek(pf_t *pf, const char *base, int64_t first, int64_t rows) {
    pf->base = base;
    pf->blk = first / pf->bs;
    pf->in_blk = first - pf->blk * pf->bs;
    pf->row = base + ((int64_t)pf->table[pf->blk] * pf->bs + pf->in_blk) * pf->row_bytes;
    pf->line = 0;
    pf->left = rows;
}

static inline void pf_step(pf_t *pf, int64_t count) {
    for (; count > 0; count--) {
        if (pf->left == 0) {
            if (pf->vrows == 0) return;
            pf_seek(pf, pf->vbase, pf->first, pf->vrows);
            pf->vrows = 0;
        }
        __builtin_prefetch(pf->row + pf->off + 64 * pf->line, 0, 2);
        if (++pf->line < pf->lines) continue;
        pf->line = 0;
        if (--pf->left == 0) continue;
        if (++pf->in_blk < pf->bs) {
            pf->row += pf->row_bytes;
        } else {
            pf->in_blk = 0;
            pf->row = pf->base + (int64_t)pf->table[++pf->blk] * pf->bs * pf->row_bytes;
        }
    }
}

#define QC 16 /* query vectors (rows x heads) of the items that take pass1_direct */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_DP 1
#else
#define HAVE_DP 0
#endif

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
            if (j < nn) prefetch_next_row(knext, vnext, j, h0, nh, head_bytes); /* spread over the loads */
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

/* AVX2 pass 1 of a bf16 decode item (nc <= 4), instead of pass1_workspace's copy of the
 * group's rows: one query vector at a time, held in 2 nc ymm across the group's 16 keys, each
 * key's slice widened as it is read where it is stored (from L1 after the head's first
 * vector); reduce8_avx2's 8 x 8 transpose-add folds the keys in pairs as they come, so the
 * partial sums never leave registers. The next group's rows are prefetched one (row, head)
 * per key of each head's first vector. benchmarks.attention_ab, bf16 decode 64 x ~200 keys on
 * the AVX2 box: 4-10% faster than the workspace. fp32 decodes keep pass1_direct, whole rows
 * per key: this order made them 15-20% slower there. */
static inline __attribute__((always_inline)) void pass1_direct_avx2_bf16(
    const args_t *A, const item_t *it, int64_t h0, int64_t nh, const int32_t *table, const v16 *qv,
    float *scores, int64_t sstride, int64_t s_begin, int64_t n_max, const int64_t nc, const char **krow,
    const char **knext, const char **vnext) {
    const int64_t G = A->Hq / A->Hkv, nqh = (int64_t)it->nrows * G;
    const int64_t head_bytes = 2 * 16 * nc, row_bytes = head_bytes * A->Hkv;
    for (int64_t s0 = s_begin; s0 < n_max; s0 += 16) {
        int64_t nn;
        const int64_t kn = group_rows(A, table, row_bytes, s0, n_max, krow, knext, vnext, &nn);
        for (int64_t hh = 0; hh < nh; hh++) {
            const int64_t off = (h0 + hh) * head_bytes;
            for (int64_t a = hh * nqh; a < (hh + 1) * nqh; a++) {
                __m256 q[8] = {0}; /* [2 nc] */
#pragma GCC unroll 8
                for (int64_t i = 0; i < 2 * nc; i++) q[i] = _mm256_loadu_ps((const float *)(qv + a * nc) + 8 * i);
                const int pf = a == hh * nqh;
                for (int64_t r0 = 0; r0 < 16; r0 += 8) {
#define DOT(J) (r0 + (J) < kn ? dot8_bf16(q, krow[r0 + (J)] + off, nc) : _mm256_setzero_ps())
#define PF(J) if (pf && r0 + (J) < nn) prefetch_next_row(knext, vnext, r0 + (J), h0 + hh, 1, head_bytes)
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
                    /* t0: keys 0-3 over lanes 0-3 | over lanes 4-7; t1 likewise for keys 4-7 */
                    _mm256_storeu_ps(scores + a * sstride + s0 + r0, _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                                                                   _mm256_permute2f128_ps(t0, t1, 0x31)));
                }
            }
        }
    }
}
#endif

/* Pass 1 of a prefill item (more than QC query vectors), fp32 or bf16 without AVX512-BF16:
 * the group's 16 K rows are copied (widened) into the workspace kb front to back, every head
 * of a row in turn, so memory sees one sequential stream per block rather than nh strided
 * ones; each key then gives a vector of 16 partial sums per query vector, and reduce16 turns
 * 16 such vectors into the 16 scores. qv: q already scaled. */
static inline __attribute__((always_inline)) void pass1_workspace(
    const args_t *A, int64_t h0, int64_t nh, int64_t nqh, const int32_t *table, const v16 *qv, v16 *kb,
    float *scores, int64_t sstride, int64_t s_begin, int64_t n_max, const int64_t nc, const char **krow,
    const char **knext, const char **vnext) {
    const int64_t esz = A->bf16 ? 2 : 4, head_bytes = esz * 16 * nc, row_bytes = head_bytes * A->Hkv;
    for (int64_t s0 = s_begin; s0 < n_max; s0 += 16) {
        v16 part[16];
        int64_t nn;
        const int64_t kn = group_rows(A, table, row_bytes, s0, n_max, krow, knext, vnext, &nn);
        for (int64_t j = 0; j < 16; j++) {
            for (int64_t hh = 0; hh < nh; hh++) {
                v16 *dst = kb + (hh * 16 + j) * nc;
                if (j < kn) load_row(krow[j] + (h0 + hh) * head_bytes, A->bf16, nc, dst);
                else for (int64_t c = 0; c < nc; c++) dst[c] = (v16){0};
            }
            if (j < nn) prefetch_next_row(knext, vnext, j, h0, nh, head_bytes); /* spread over the loads */
        }
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

/* Pass 2 of an item: acc[a] += sum_s p[a, s] * v_s, 16 keys at a time (their V rows stay in
 * L1 across heads), GA vectors of one head at a time with their accumulators in registers
 * across the 16 keys (GA * nc <= 24). */
static inline __attribute__((always_inline)) void pass2(
    const args_t *A, const int32_t *table, int64_t h0, int64_t nh, int64_t nqh, int64_t s_begin,
    int64_t n_max, const int64_t nc, const int64_t GA, const float *scores, int64_t sstride, v16 *acc,
    pf_t *pf, int64_t pf_per, const char **vrow) {
    const int64_t esz = A->bf16 ? 2 : 4, head_bytes = esz * 16 * nc, row_bytes = head_bytes * A->Hkv;
    const char *vbase = (const char *)A->v_cache;
    for (int64_t s0 = s_begin; s0 < n_max; s0 += 16) {
        const int64_t s1 = n_max - s0 < 16 ? n_max : s0 + 16;
        row_ptrs(vbase, table, A->BS, row_bytes, s0, s1 - s0, vrow);
        for (int64_t hh = 0; hh < nh; hh++) {
            for (int64_t a0 = hh * nqh; a0 < (hh + 1) * nqh; a0 += GA) {
                const int64_t ga = (hh + 1) * nqh - a0 < GA ? (hh + 1) * nqh - a0 : GA;
#if P2_HALVES
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
                        const __m256 pv = _mm256_set1_ps(g < ga ? scores[(a0 + g) * sstride + s] : 0.f);
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
                for (int64_t s = s0; s < s1; s++) {
                    pf_step(pf, pf_per);
                    v16 v[MAX_NC];
                    load_row(vrow[s - s0] + (h0 + hh) * head_bytes, A->bf16, nc, v);
#pragma GCC unroll 16
                    for (int64_t g = 0; g < GA; g++) {
                        const float p = g < ga ? scores[(a0 + g) * sstride + s] : 0.f;
#pragma GCC unroll 16
                        for (int64_t c = 0; c < nc; c++) ac[g * nc + c] += p * v[c];
                    }
                }
#pragma GCC unroll 24
                for (int64_t i = 0; i < GA * nc; i++)
                    if (i < ga * nc) acc[a0 * nc + i] = ac[i];
#endif
            }
        }
    }
}

#include "attention_dp.h"

/* Heads [h0, h0 + nh) of one item; nx: the item this thread runs next, or NULL. ws: per-thread
 * fp32 workspace, nh*ROWS*G * (max_keys + 16) scores + 2 * nh*ROWS*G * D + 16 * nh * D. Each
 * cache row is streamed from memory once, front to back.
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
    float *scores = ws;                              /* [nq, sstride], vector a = hh * nqh + r * G + g */
    v16 *qv = (v16 *)(ws + nq * sstride);            /* [nq, nc] */
    v16 *acc = qv + nq * nc;                         /* [nq, nc] */
    v16 *kb = acc + nq * nc;                         /* [nh, 16 nc]: a group's K rows (or V pairs) */
    const char *kbase = (const char *)A->k_cache, *vbase = (const char *)A->v_cache;
    /* bf16 dot products (AVX512-BF16, head_dim a multiple of 32) read q as stored; the other
     * passes take it widened and scaled in qv */
    const int dp = HAVE_DP && A->bf16 && nc % 2 == 0;
    for (int64_t a = 0; !dp && a < nq; a++) {
        const int64_t hh = a / nqh, r = (a % nqh) / G, g = a % G;
        const char *src = (const char *)A->q + esz * ((q0 + it->row0 + r) * A->q_stride + ((h0 + hh) * G + g) * D);
        load_row(src, A->bf16, nc, qv + a * nc);
        for (int64_t c = 0; c < nc; c++) qv[a * nc + c] *= A->scale;
    }
    /* pass 1 */
    const int64_t row_bytes = esz * row_stride, head_bytes = esz * D;
    const char *krow[16], *vrow[16], *knext[16], *vnext[16];
#if P2_HALVES
    if (nq <= QC && nc <= 4 && A->bf16) {
        pass1_direct_avx2_bf16(A, it, h0, nh, table, qv, scores, sstride, s_begin, n_max, nc, krow, knext, vnext);
    } else
#endif
    if (nq <= QC && !A->bf16) { /* dp a constant in each call: two specialised copies */
        pass1_direct(A, it, h0, nh, table, qv, scores, sstride, s_begin, n_max, nc, 0, krow, knext, vnext);
    } else if (nq <= QC && dp) {
        pass1_direct(A, it, h0, nh, table, qv, scores, sstride, s_begin, n_max, nc, 1, krow, knext, vnext);
    }
#if HAVE_DP
    else if (dp) {
        pass1_transposed(A, it, h0, nh, table, qv, kb, scores, sstride, s_begin, n_max, nc, krow, knext, vnext);
    }
#endif
    else {
        pass1_workspace(A, h0, nh, nqh, table, qv, kb, scores, sstride, s_begin, n_max, nc, krow, knext, vnext);
    }
    pf_t pf = {.left = 0, .vrows = 0};
    int64_t pf_lines = 0;
    if (nx && (nx->seq != it->seq || nx->head != it->head)) { /* else: rows this item just read */
        const int64_t nfirst = item_first_key(A, nx), nkeys = item_keys(A, nx) - nfirst;
        pf.table = A->block_table + (int64_t)nx->seq * A->bt_stride;
        pf.bs = A->BS;
        pf.row_bytes = row_bytes;
        pf.off = nx->head >= 0 ? nx->head * head_bytes : 0;
        pf.lines = ((nx->head >= 0 ? head_bytes : row_bytes) + 63) / 64;
        const int64_t cap = A->pf_bytes / (64 * pf.lines), krows = nkeys < cap ? nkeys : cap;
        pf.vbase = vbase;
        pf.first = nfirst;
        pf.vrows = nkeys < 16 ? nkeys : 16;
        pf_lines = (krows + pf.vrows) * pf.lines;
        if (krows > 0) pf_seek(&pf, kbase, nfirst, krows);
    }
    /* pf_step calls: one per (pass-2 key, head) */
    const int64_t pass2_iters = (n_max - s_begin) * nh > 0 ? (n_max - s_begin) * nh : 1;
    const int64_t pf_per = (pf_lines + pass2_iters - 1) / pass2_iters;
    /* softmax over each vector's visible keys [lo, lim); the rest of [s_begin, n_max) get weight 0,
     * in bf16 for the prefill tiles that take pass2_dp */
#if HAVE_DP
    const int p_bf16 = nq > QC && A->bf16;
#endif
    for (int64_t a = 0; a < nq; a++) {
        const int64_t lim = first_lim + (a % nqh) / G;
        const int64_t lo = A->window > 0 && lim - A->window > 0 ? lim - A->window : 0;
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
        for (int64_t c = 0; c < nc; c++) acc[a * nc + c] = (v16){0};
#if HAVE_DP
        if (p_bf16) {
            weights_to_bf16(sc, s_begin, lo, lim, n_max, inv);
            continue;
        }
#endif
        for (int64_t s = lo; s < lim; s++) sc[s] *= inv;
        for (int64_t s = s_begin; s < lo; s++) sc[s] = 0.f;
        for (int64_t s = lim; s < n_max; s++) sc[s] = 0.f;
    }
    /* pass 2: GA vectors of a head at a time, their accumulators in registers: 6 (24 zmm)
     * when a head's vectors come in sixes (prefill tiles of head_dim 64), else 16 / nc */
#if HAVE_DP
    if (p_bf16) {
        if (nc == 4 && nqh % 6 == 0)
            pass2_dp(A, table, h0, nh, nqh, s_begin, n_max, nc, 6, scores, sstride, acc, (__m512i *)kb, &pf, pf_per, vrow);
        else
            pass2_dp(A, table, h0, nh, nqh, s_begin, n_max, nc, 16 / nc > 0 ? 16 / nc : 1, scores, sstride, acc,
                     (__m512i *)kb, &pf, pf_per, vrow);
    } else
#endif
    if (P2_VECS == 16 && nc == 4 && nqh % 6 == 0)
        pass2(A, table, h0, nh, nqh, s_begin, n_max, nc, 6, scores, sstride, acc, &pf, pf_per, vrow);
    else
        pass2(A, table, h0, nh, nqh, s_begin, n_max, nc, P2_VECS / nc > 0 ? P2_VECS / nc : 1, scores, sstride, acc,
              &pf, pf_per, vrow);
    for (int64_t a = 0; a < nq; a++) {
        const int64_t hh = a / nqh, r = (a % nqh) / G, g = a % G;
        const int64_t dst = ((q0 + it->row0 + r) * A->Hq + (h0 + hh) * G + g) * D;
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
#define DEFINE_RUN_ITEM(NAME, NC)                                                              \
    static void NAME(const args_t *A, const item_t *it, const item_t *nx, float *ws, int64_t mk) { \
        if (it->head >= 0) run_heads(A, it, it->head, 1, nx, ws, mk, (NC));                   \
        else run_heads(A, it, 0, A->Hkv, nx, ws, mk, (NC));                                   \
    }
DEFINE_RUN_ITEM(run_item_4, 4)
DEFINE_RUN_ITEM(run_item_8, 8)
DEFINE_RUN_ITEM(run_item_any, A->D / 16)

/* How many bytes of the next item's K rows pf_t prefetches: 256 KB with 1 MB or more of L2 per
 * core (measured on the Intel and Zen 4 boxes). With 512 KB (Zen 3), which an item's own K/V
 * (~200 keys x 3 heads: 300 KB in fp32) mostly fills, that much evicted the item's V rows
 * before pass 2 read them: 16 KB made 64-sequence decodes 5-14% faster there, fp32 and bf16,
 * with 0 and 64 KB within 2% of 16 KB (benchmarks.attention_ab, docs/cpu-kernels.md). */
static int64_t pf_bytes(void) {
    static int64_t cached; /* 0: not asked yet; every thread computes the same value */
    int64_t v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (v == 0) {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE); /* per core; 0 or -1 when unknown */
        v = l2 > 0 && l2 < (1l << 20) ? 16 << 10 : 256 << 10;
        __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
    }
    return v;
}

/* Returns 0 on success, -1 on a bad argument or no memory (the wrapper checks shapes first). */
int llmsvc_paged_attention(int dtype /* 0 = f32, 1 = bf16 */, const void *q, int64_t q_stride,
                           const void *k_cache, const void *v_cache, const int32_t *block_table,
                           int64_t bt_stride, const int32_t *qsl, const int32_t *seq_lens,
                           int64_t num_seqs, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
                           float scale, int64_t window, float soft_cap, void *out, int num_threads) {
    if (D <= 0 || D % 16 || D / 16 > MAX_NC || BS <= 0 || Hkv <= 0 || Hq % Hkv) return -1;
    const args_t A = {q, k_cache, v_cache, out, block_table, qsl, seq_lens,
                      q_stride, bt_stride, Hq, Hkv, D, BS, scale, soft_cap, window, dtype == 1, pf_bytes()};
    int64_t n_items = 0, max_keys = 1;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t q_len = qsl[i + 1] - qsl[i];
        if (q_len < 0 || q_len > seq_lens[i]) return -1;
        n_items += (q_len + ROWS - 1) / ROWS;
        if (seq_lens[i] > max_keys) max_keys = seq_lens[i];
    }
    if (n_items == 0) return 0;
    /* per-head items: when there are too few items to keep every thread busy, or when an
     * all-heads workspace (scores for every head) would pass 16 MB per thread */
    const int64_t all_heads_ws = ROWS * Hq * (max_keys + 16 + 2 * D);
    const int per_head = Hkv > 1 && (n_items < 4 * (int64_t)num_threads || all_heads_ws > (4 << 20));
    if (per_head) n_items *= Hkv;
    item_t *items = (item_t *)malloc(sizeof(item_t) * n_items);
    if (!items) return -1;
    int64_t n = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t q_len = qsl[i + 1] - qsl[i];
        for (int64_t r = 0; r < q_len; r += ROWS)
            for (int64_t h = per_head ? 0 : -1; h < (per_head ? Hkv : 0); h++) {
                item_t t = {(int32_t)i, (int32_t)r, (int32_t)(q_len - r < ROWS ? q_len - r : ROWS), (int32_t)h};
                items[n++] = t;
            }
    }
    const size_t ws_floats = (size_t)(ROWS * Hq / (per_head ? Hkv : 1)) * (size_t)(max_keys + 16 + 2 * D) +
                             (size_t)(16 * D * (per_head ? 1 : Hkv));
    void (*fn)(const args_t *, const item_t *, const item_t *, float *, int64_t) =
        D == 64 ? run_item_4 : D == 128 ? run_item_8 : run_item_any;
    int rc = 0;
    int64_t claimed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *ws = (float *)aligned_alloc(64, ((ws_floats * sizeof(float)) + 63) & ~(size_t)63);
        if (!ws) {
#pragma omp atomic write
            rc = -1;
        }
        /* dynamic, one item claimed ahead: the thread prefetches it while finishing this one */
        int64_t x = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (x < n_items) {
            const int64_t y = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            if (ws) fn(&A, &items[x], y < n_items ? &items[y] : NULL, ws, max_keys);
            x = y;
        }
        free(ws);
    }
    free(items);
    return rc;
}
