/* Every decoder layer of a Llama-family model (Llama / SmolLM, Qwen2, Mistral) in one call.
 *
 * The per-op path runs each layer as ~11 module calls and ~10 ctypes calls with their
 * argument checks and output allocations: host time per layer that, over 30 layers, is a large
 * share of a small decode step whatever the batch (docs/cpu-kernels.md). This file makes the
 * same calls into the same kernels (same order, same arguments, same thread count), so its
 * output is bit for bit the per-op path's; only the host work between them goes. The caller
 * owns every buffer:
 *   x    [T, H]     in: the embeddings; out: the last layer's MLP output (the model's hidden)
 *   res  [T, H]     out: the residual stream (x + every layer's outputs)
 *   nrm  [T, H], qkv [T, (Hq + 2 Hkv) D], att [T, Hq D], gu [T, 2 I], act [T, I]: scratch
 * lp: [L][LP_N] int64 addresses per layer, see LP_* below (qkv bias 0 = none; the o, gate_up
 * and down projections have no bias on this path). dtype 0 = fp32 (weights packed for
 * gemm.c), 1 = bf16 (packed for gemm_bf16.c). LP_GGUF: a bit per projection (1 << LP_QKV, ...)
 * whose weight is GGUF blocks for llmsvc_gemm_q8 (fp32 only). LP_INT8: the same bits for the
 * projections whose weight is an int8 blob for llmsvc_gemm_i8 (`--quantization int8`, either
 * dtype), with that GEMM's ISA code in bits 16 and up. Stops at the first rejected call and
 * returns -1.
 * prof: NULL, or [2][PROF_N] doubles to which each kind of call adds its wall seconds (row 0)
 * and the calling thread's CPU seconds (row 1: unlike wall time, not inflated while another
 * process holds the core; the whole work with one thread). PROF_* below;
 * benchmarks/step_profile.py reads them. Four clock reads per call, ~11 calls a layer.
 * lora: NULL, or the step's LoRA adapters (lora_t below): after each projection's GEMM, every
 * group of rows sharing an adapter gets (x[rows] @ A^T) @ B^T added, through the same packed
 * GEMMs and the same rounding as the per-op path's ops.lora_add_.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "bf16.h"

enum { LP_IN_NORM, LP_POST_NORM, LP_QKV, LP_QKV_BIAS, LP_O, LP_GATE_UP, LP_DOWN, LP_K_CACHE,
       LP_V_CACHE, LP_GGUF, LP_INT8, LP_N };
enum { PROF_NORM, PROF_QKV, PROF_ROPE, PROF_STORE_KV, PROF_ATTENTION, PROF_O, PROF_GATE_UP,
       PROF_SILU, PROF_DOWN, PROF_N };

int llmsvc_rms_norm(int dtype, const void *x, int64_t xs, const void *w, void *out, int64_t T,
                    int64_t H, float eps, int nt);
int llmsvc_fused_add_rms_norm(int dtype, const void *x, int64_t xs, const void *res, int64_t rs,
                              const void *w, void *out, void *res_out, int64_t T, int64_t H,
                              float eps, int nt);
int llmsvc_silu_and_mul(int dtype, const void *x, int64_t xs, void *out, int64_t T, int64_t d,
                        int nt);
int llmsvc_rotary_neox(int dtype, const int64_t *pos, void *q, int64_t qs, int64_t hq, void *k,
                       int64_t ks, int64_t hk, int64_t D, const float *cos_sin, int64_t rot,
                       int64_t max_pos, int64_t T, int nt);
int llmsvc_store_kv(const void *key, int64_t ks, const void *value, int64_t vs, void *k_cache,
                    void *v_cache, const int64_t *slot_mapping, int64_t T, int64_t row_elems,
                    int64_t num_slots, int64_t esz);
int llmsvc_paged_attention(int dtype, const void *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, const int32_t *block_table, int64_t bt_stride,
                           const int32_t *qsl, const int32_t *seq_lens, int64_t num_seqs,
                           int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, float scale, int64_t window,
                           float soft_cap, void *out,
                           int num_threads);
int llmsvc_gemm_f32(const float *a, int64_t lda, const float *packed, const float *bias, float *c,
                    int64_t ldc, int64_t M, int64_t N, int64_t K, int nt);
int llmsvc_gemm_bf16(const uint16_t *a, int64_t lda, const uint16_t *packed, const uint16_t *bias,
                     uint16_t *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt);
int llmsvc_gemm_q8(const float *a, int64_t lda, const void *blob, const float *bias, float *c,
                   int64_t ldc, int64_t M, int64_t N, int64_t K, int nt);
int llmsvc_gemm_i8(int isa, const void *a, int64_t lda, int dtype, const int8_t *packed, const void *bias,
                   void *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt);

/* The step's LoRA adapters. Group g holds rows[off[g] .. off[g+1]) (ascending token indexes)
 * that run with adapter slot slot[g]. ptrs [L][LORA_N][S][2]: the packed A [R, K] and B [N, R]
 * of each layer, projection and slot (0: the slot's adapter leaves it alone); width [L][LORA_N]:
 * R. Scratch: xg [T, max K], h [T, max R], d [T, max N], ridx [T]. */
enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_N };
typedef struct {
    int64_t G, S;
    const int64_t *slot, *off, *rows, *ptrs, *width;
    void *xg, *h, *d;
    int64_t *ridx;
} lora_t;

/* c [M, N] (contiguous) = a [M, K] (contiguous) @ packed float weight (+ bias), in dtype */
static int gemm(int dtype, const void *a, int64_t K, int64_t packed, int64_t bias, void *c,
                int64_t M, int64_t N, int nt) {
    if (dtype == 1)
        return llmsvc_gemm_bf16(a, K, (const uint16_t *)packed, (const uint16_t *)bias, c, N, M, N, K, nt);
    return llmsvc_gemm_f32(a, K, (const float *)packed, (const float *)bias, c, N, M, N, K, nt);
}

/* gemm() with projection `proj` of the layer whose LP_* row is lp (bias: an address or 0): its
 * weight is packed floats, GGUF blocks (its LP_GGUF bit) or an int8 blob (its LP_INT8 bit) */
static int project(const int64_t *lp, int proj, int dtype, const void *a, int64_t K, int64_t bias,
                   void *c, int64_t M, int64_t N, int nt) {
    const int64_t w = lp[proj];
    if ((lp[LP_INT8] >> proj) & 1)
        return llmsvc_gemm_i8((int)(lp[LP_INT8] >> 16), a, K, dtype, (const int8_t *)(intptr_t)w,
                              (const void *)(intptr_t)bias, c, N, M, N, K, nt);
    if ((lp[LP_GGUF] >> proj) & 1)
        return llmsvc_gemm_q8(a, K, (const void *)(intptr_t)w, (const float *)(intptr_t)bias, c, N, M, N, K, nt);
    return gemm(dtype, a, K, w, bias, c, M, N, nt);
}

/* out rows [r0, r0 + m) (out, in: row r0 first; widths N, K) += each group's LoRA update of
 * projection `proj` of layer l, for the group's rows in that range */
static int lora_add(int dtype, const lora_t *lo, int64_t l, int proj, const void *in, int64_t K,
                    void *out, int64_t N, int64_t r0, int64_t m, int nt) {
    const int64_t esz = dtype ? 2 : 4, R = lo->width[l * LORA_N + proj];
    for (int64_t g = 0; g < lo->G; g++) {
        const int64_t *p = lo->ptrs + ((l * LORA_N + proj) * lo->S + lo->slot[g]) * 2;
        if (!p[0]) continue;
        int64_t n = 0;
        for (int64_t i = lo->off[g]; i < lo->off[g + 1]; i++) {
            const int64_t row = lo->rows[i] - r0;
            if (row < 0 || row >= m) continue;
            memcpy((char *)lo->xg + n * K * esz, (const char *)in + row * K * esz, (size_t)(K * esz));
            lo->ridx[n++] = row;
        }
        if (!n) continue;
        if (gemm(dtype, lo->xg, K, p[0], 0, lo->h, n, R, nt) != 0) return -1;
        if (gemm(dtype, lo->h, R, p[1], 0, lo->d, n, N, nt) != 0) return -1;
        for (int64_t j = 0; j < n; j++) {
            if (dtype) {
                uint16_t *y = (uint16_t *)out + lo->ridx[j] * N;
                const uint16_t *dv = (const uint16_t *)lo->d + j * N;
                for (int64_t c = 0; c < N; c++) y[c] = f32_to_bf16(bf16_to_f32(y[c]) + bf16_to_f32(dv[c]));
            } else {
                float *y = (float *)out + lo->ridx[j] * N;
                const float *dv = (const float *)lo->d + j * N;
                for (int64_t c = 0; c < N; c++) y[c] += dv[c];
            }
        }
    }
    return 0;
}

static double seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* runs e, adding its wall and thread CPU time to prof when profiling; returns -1 from the
 * caller if e fails */
#define CALL(kind, e) do {                                                                  \
        const double w0_ = prof ? seconds(CLOCK_MONOTONIC) : 0.;                           \
        const double c0_ = prof ? seconds(CLOCK_THREAD_CPUTIME_ID) : 0.;                   \
        if ((e) != 0) return -1;                                                            \
        if (prof) {                                                                         \
            prof[PROF_N + (kind)] += seconds(CLOCK_THREAD_CPUTIME_ID) - c0_;               \
            prof[kind] += seconds(CLOCK_MONOTONIC) - w0_;                                   \
        }                                                                                   \
    } while (0)
#define P(i) ((void *)(intptr_t)lp[(i)])

/* In fp32 the MLP of a prefill step runs MLP_ROWS rows at a time: its gate_up output ([rows, 2 I],
 * 1.5 MB at 128 rows for I = 1536) and activation then stay in L2 between the GEMM, SiLU-and-mul
 * and the down GEMM instead of a [T, 2 I] round trip through L3 (12.6 MB at T = 1024), while the
 * weights come from L3 on every chunk after the first. A 1024-token fp32 prefill step of the
 * default model took 478-494 ms against 510-532 whole (docs/cpu-kernels.md); in bf16 chunks were
 * 1-2% slower, so bf16 runs whole. Each row's arithmetic is unchanged (the GEMMs accumulate every
 * row over K in the same order whatever the row grouping): still bit for bit the per-op path. */
#define MLP_ROWS 128

int llmsvc_llama_layers(int dtype, int64_t L, const int64_t *lps, void *x, void *res, void *nrm,
                        void *qkv, void *att, void *gu, void *act, const int64_t *pos,
                        const float *cos_sin, int64_t rot, int64_t max_pos, const int64_t *slots,
                        int64_t num_slots, const int32_t *bt, int64_t bt_stride,
                        const int32_t *qsl, const int32_t *seq_lens, int64_t B, int64_t T,
                        int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t I, int64_t BS,
                        float eps, float scale, int64_t window, int nt, double *prof, const lora_t *lora) {
    if (dtype < 0 || dtype > 1 || L <= 0 || T <= 0) return -1;
    const int64_t esz = dtype ? 2 : 4, Q = Hq * D, KV = Hkv * D, NQKV = Q + 2 * KV;
    char *q = (char *)qkv, *k = q + Q * esz, *v = k + KV * esz;
    const int64_t mlp_rows = dtype ? T : MLP_ROWS;
    for (int64_t l = 0; l < L; l++) {
        const int64_t *lp = lps + l * LP_N;
        if (l == 0) {
            memcpy(res, x, (size_t)(T * H * esz));
            CALL(PROF_NORM, llmsvc_rms_norm(dtype, x, H, P(LP_IN_NORM), nrm, T, H, eps, nt));
        } else {
            CALL(PROF_NORM, llmsvc_fused_add_rms_norm(dtype, x, H, res, H, P(LP_IN_NORM), nrm, res, T, H, eps, nt));
        }
        CALL(PROF_QKV, project(lp, LP_QKV, dtype, nrm, H, lp[LP_QKV_BIAS], qkv, T, NQKV, nt));
        if (lora) CALL(PROF_QKV, lora_add(dtype, lora, l, LORA_QKV, nrm, H, qkv, NQKV, 0, T, nt));
        CALL(PROF_ROPE, llmsvc_rotary_neox(dtype, pos, q, NQKV, Hq, k, NQKV, Hkv, D, cos_sin, rot, max_pos, T, nt));
        CALL(PROF_STORE_KV, llmsvc_store_kv(k, NQKV, v, NQKV, P(LP_K_CACHE), P(LP_V_CACHE), slots, T, KV,
                                            num_slots, esz));
        CALL(PROF_ATTENTION, llmsvc_paged_attention(dtype, q, NQKV, P(LP_K_CACHE), P(LP_V_CACHE), bt, bt_stride,
                                                    qsl, seq_lens, B, Hq, Hkv, D, BS, scale, window, 0.f, att, nt));
        CALL(PROF_O, project(lp, LP_O, dtype, att, Q, 0, x, T, H, nt));
        if (lora) CALL(PROF_O, lora_add(dtype, lora, l, LORA_O, att, Q, x, H, 0, T, nt));
        CALL(PROF_NORM, llmsvc_fused_add_rms_norm(dtype, x, H, res, H, P(LP_POST_NORM), nrm, res, T, H, eps, nt));
        for (int64_t r0 = 0; r0 < T; r0 += mlp_rows) {
            const int64_t m = T - r0 < mlp_rows ? T - r0 : mlp_rows;
            CALL(PROF_GATE_UP, project(lp, LP_GATE_UP, dtype, (char *)nrm + r0 * H * esz, H, 0, gu, m, 2 * I, nt));
            if (lora)
                CALL(PROF_GATE_UP, lora_add(dtype, lora, l, LORA_GATE_UP, (char *)nrm + r0 * H * esz, H, gu, 2 * I,
                                            r0, m, nt));
            CALL(PROF_SILU, llmsvc_silu_and_mul(dtype, gu, 2 * I, act, m, I, nt));
            CALL(PROF_DOWN, project(lp, LP_DOWN, dtype, act, I, 0, (char *)x + r0 * H * esz, m, H, nt));
            if (lora)
                CALL(PROF_DOWN, lora_add(dtype, lora, l, LORA_DOWN, act, I, (char *)x + r0 * H * esz, H, r0, m, nt));
        }
    }
    return 0;
}
