/* Paged attention (paged_attention.c): cache-row addresses through the block table and the
 * prefetches that run ahead of the passes. Included by paged_attention.c after its types
 * (args_t, item_t); not a header of its own. */
#pragma once

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

/* Row j of the next group into cache while this group is loaded: its K slices of heads
 * [h0, h0 + nh), and with v its V slices, every line (block-table order defeats the hardware
 * prefetcher) */
static inline __attribute__((always_inline)) void prefetch_next_row(
    const char *const *knext, const char *const *vnext, int64_t j, int64_t h0, int64_t nh, int64_t head_bytes,
    const int v) {
    const char *pk = knext[j] + h0 * head_bytes, *pv = vnext[j] + h0 * head_bytes;
    for (int64_t c = 0; c < nh * head_bytes; c += 64) {
        __builtin_prefetch(pk + c);
        if (v) __builtin_prefetch(pv + c, 0, 2);
    }
}

/* How many bytes of the next item's K rows pf_t prefetches: 256 KB with 1 MB or more of L2 per
 * core (measured on the Intel and Zen 4 boxes). With 512 KB (Zen 3), which an item's own K/V
 * (~200 keys x 3 heads: 300 KB in fp32) mostly fills, that much evicted the item's V rows
 * before pass 2 read them: 16 KB made 64-sequence decodes 5-14% faster there, fp32 and bf16,
 * with 0 and 64 KB within 2% of 16 KB (benchmarks.attention_ab, docs/cpu-kernels.md). */
static inline int64_t pf_bytes(void) {
    static int64_t cached; /* 0: not asked yet; every thread computes the same value */
    int64_t v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (v == 0) {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE); /* per core; 0 or -1 when unknown */
        v = l2 > 0 && l2 < (1l << 20) ? 16 << 10 : 256 << 10;
        __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
    }
    return v;
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

/* Sets pf up for item nx (the next this thread runs): its K rows first, at most A->pf_bytes of
 * them, then its first 16 V rows. Returns the cache lines pf will touch. */
static inline int64_t pf_plan(const args_t *A, const item_t *nx, int64_t row_bytes, int64_t head_bytes, pf_t *pf) {
    const int64_t nfirst = item_first_key(A, nx), nkeys = item_keys(A, nx) - nfirst;
    pf->table = A->block_table + (int64_t)nx->seq * A->bt_stride;
    pf->bs = A->BS;
    pf->row_bytes = row_bytes;
    pf->off = nx->head >= 0 ? nx->head * head_bytes : 0;
    pf->lines = ((nx->head >= 0 ? head_bytes : row_bytes) + 63) / 64;
    const int64_t cap = A->pf_bytes / (64 * pf->lines), krows = nkeys < cap ? nkeys : cap;
    pf->vbase = (const char *)A->v_cache;
    pf->first = nfirst;
    pf->vrows = nkeys < 16 ? nkeys : 16;
    if (krows > 0) pf_seek(pf, (const char *)A->k_cache, nfirst, krows);
    return (krows + pf->vrows) * pf->lines;
}
