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
 *           copy the group's rows into a workspace first, widened, and then on AVX-512 and
 *           AVX2 take a head's query vectors across the lanes (pass1_qlanes, attention_qlanes.h;
 *           tiles of up to 16 or 8 lanes x 4 registers / G rows), without either (or with a
 *           soft cap) reduce partial sums (pass1_workspace); in
 *           bf16 on AVX512-BF16 the rows are transposed so 16 keys lie across a register for
 *           dot products (pass1_transposed, attention_dp.h). The next 16 K and V rows are
 *           prefetched, every cache line (block-table order defeats the hardware
 *           prefetcher), spread over this group's row loads: as one burst they stalled on
 *           full fill buffers (bf16 decodes on AVX2: K only, pass 2 prefetches V);
 *   softmax over the keys each vector may see (causal limit per query row);
 *   pass 2  acc[a] = sum_s p[a, s] * v_s, 16 keys at a time with a few vectors' accumulators
 *           in registers (memory accumulators would chain every key through a store); bf16
 *           prefill tiles on AVX512-BF16 round p to bf16, as torch's CPU flash attention
 *           does, and take key pairs through dot products (pass2_dp, attention_dp.h).
 * Written with GCC/Clang vector extensions: 512-bit registers on AVX-512, split otherwise.
 * Files: this one (items, threads, the driver), attention_item.h (one item's passes, compiled
 * in three files: here, attention_item_128.c, attention_item_any.c), attention_rows.h (row
 * addresses, prefetches), attention_pass1.h, attention_softmax.h, attention_pass2.h, attention_dp.h
 * (AVX512-BF16 tiles), attention_qlanes.h (AVX-512 and AVX2 prefill tiles, their softmax).
 */
#include "attention_item.h"

DEFINE_RUN_ITEM(run_item_4, 4)

/* Returns 0 on success, -1 on a bad argument or no memory (the wrapper checks shapes first). */
int llmsvc_paged_attention(int dtype /* 0 = f32, 1 = bf16 */, const void *q, int64_t q_stride,
                           const void *k_cache, const void *v_cache, const int32_t *block_table,
                           int64_t bt_stride, const int32_t *qsl, const int32_t *seq_lens,
                           int64_t num_seqs, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
                           float scale, int64_t window, float soft_cap, void *out, int num_threads) {
    if (D <= 0 || D % 16 || D / 16 > MAX_NC || BS <= 0 || Hkv <= 0 || Hq % Hkv) return -1;
    const args_t A = {q, k_cache, v_cache, out, block_table, qsl, seq_lens,
                      q_stride, bt_stride, Hq, Hkv, D, BS, scale, soft_cap, window, dtype == 1, pf_bytes()};
    /* query rows per prefill tile: ROWS, or with query vectors in lanes (attention_qlanes.h) up
     * to 64 / G of them (at most 32): each K/V row a tile reads serves twice the vectors, and
     * at G = 3 the 48 vectors fill three registers where 24 left a fourth of two empty */
    const int64_t G = Hq / Hkv;
    int64_t rows = ROWS;
    if (qlanes_allowed(dtype == 1, soft_cap)) {
        const int64_t r = (QL_LANES * QL_MAX_Z / G) / 8 * 8;
        rows = r > 32 ? 32 : r > ROWS ? r : ROWS;
    }
    int64_t n_items = 0, max_keys = 1;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t q_len = qsl[i + 1] - qsl[i];
        if (q_len < 0 || q_len > seq_lens[i]) return -1;
        n_items += (q_len + rows - 1) / rows;
        if (seq_lens[i] > max_keys) max_keys = seq_lens[i];
    }
    if (n_items == 0) return 0;
    /* per-head items: when there are too few items to keep every thread busy, or when an
     * all-heads workspace (scores for every head) would pass 16 MB per thread */
    const int64_t all_heads_ws = ws_floats(Hkv, rows * G, max_keys, D);
    const int per_head = Hkv > 1 && (n_items < 4 * (int64_t)num_threads || all_heads_ws > (4 << 20));
    if (per_head) n_items *= Hkv;
    item_t *items = (item_t *)malloc(sizeof(item_t) * n_items);
    if (!items) return -1;
    int64_t n = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t q_len = qsl[i + 1] - qsl[i];
        for (int64_t r = 0; r < q_len; r += rows)
            for (int64_t h = per_head ? 0 : -1; h < (per_head ? Hkv : 0); h++) {
                item_t t = {(int32_t)i, (int32_t)r, (int32_t)(q_len - r < rows ? q_len - r : rows), (int32_t)h};
                items[n++] = t;
            }
    }
    const size_t ws_size = (size_t)ws_floats(per_head ? 1 : Hkv, rows * G, max_keys, D);
    void (*fn)(const args_t *, const item_t *, const item_t *, float *, int64_t) =
        D == 64 ? run_item_4 : D == 128 ? run_item_8 : run_item_any;
    int rc = 0;
    int64_t claimed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *ws = (float *)aligned_alloc(64, ((ws_size * sizeof(float)) + 63) & ~(size_t)63);
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
