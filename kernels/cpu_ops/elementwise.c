/* Row-wise ops for the CPU, one pass over memory each (the torch reference makes several).
 *
 * Same contracts and rounding as kernels/reference.py: fp32 math; bf16 storage is widened on
 * load and rounded to nearest-even once per value the reference rounds. Rows may be strided
 * (stride in elements), the hidden dim is contiguous. dtype: 0 = fp32, 1 = bf16.
 * Each op is written once as a per-row macro body and instantiated per storage type, so the
 * inner loops are branch-free and vectorize; rows are split over OpenMP threads once a call
 * has enough work to pay for the fork.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define PAR_MIN_ELEMS (1 << 16) /* below this, one thread (docs/cpu-kernels.md): the fork costs more than the work */

/* LD: storage -> fp32; ST: fp32 -> storage; RND: fp32 rounded as the storage would hold it */
#define F32_LD(v) (v)
#define F32_ST(v) (v)
#define F32_RND(v) (v)
#define BF16_LD(v) bf16_to_f32(v)
#define BF16_ST(v) f32_to_bf16(v)
#define BF16_RND(v) bf16_to_f32(f32_to_bf16(v))

/* out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w, out [T, H] contiguous. With res (fused
 * add): s = RND(x[t] + res[t]) is normalised and also written to res_out[t]. */
#define DEFINE_NORM(NAME, T_, LD, ST, RND)                                                     \
static void NAME(const T_ *x, int64_t xs, const T_ *res, int64_t rs, const T_ *w, T_ *out,   \
                 T_ *res_out, int64_t T, int64_t H, float eps, int nt) {                      \
    _Pragma("omp parallel for num_threads(nt) schedule(static) if (T * H >= PAR_MIN_ELEMS && nt > 1)") \
    for (int64_t t = 0; t < T; t++) {                                                         \
        float buf[H]; /* the row in fp32; H <= 64K */                                         \
        float ss = 0.f;                                                                       \
        const T_ *xr = x + t * xs;                                                            \
        if (res) {                                                                            \
            const T_ *rr = res + t * rs;                                                      \
            T_ *so = res_out + t * H;                                                         \
            for (int64_t i = 0; i < H; i++) {                                                 \
                const float v = RND(LD(xr[i]) + LD(rr[i]));                                   \
                so[i] = ST(v);                                                                \
                buf[i] = v;                                                                   \
                ss += v * v;                                                                  \
            }                                                                                 \
        } else {                                                                              \
            for (int64_t i = 0; i < H; i++) {                                                 \
                buf[i] = LD(xr[i]);                                                           \
                ss += buf[i] * buf[i];                                                        \
            }                                                                                 \
        }                                                                                     \
        const float inv = 1.f / sqrtf(ss / (float)H + eps);                                   \
        T_ *o = out + t * H;                                                                  \
        for (int64_t i = 0; i < H; i++) o[i] = ST(buf[i] * inv * LD(w[i]));                   \
    }                                                                                         \
}

/* RND(silu(g)) * u of one fp32 gate g and up value u. e^-g <= e^88 stays finite: -ffast-math
 * divides by a reciprocal estimate and a Newton step, which give NaN for an infinite divisor
 * (silu(-89) was NaN). elementwise_avx2.h's row tails use it too. */
#define SILU_MUL(g, u, RND) (RND((g) / (1.f + expf(fminf(-(g), 88.f)))) * (u))

/* x: [T, 2d] stride xs (gate | up) -> out [T, d] = RND(silu(gate)) * up (bf16 rounds silu
 * first, as torch's F.silu then product does) */
#define DEFINE_SILU(NAME, T_, LD, ST, RND)                                                     \
static void NAME(const T_ *x, int64_t xs, T_ *out, int64_t T, int64_t d, int nt) {           \
    _Pragma("omp parallel for num_threads(nt) schedule(static) if (T * d >= PAR_MIN_ELEMS && nt > 1)") \
    for (int64_t t = 0; t < T; t++) {                                                         \
        const T_ *g = x + t * xs, *u = g + d;                                                 \
        T_ *o = out + t * d;                                                                  \
        for (int64_t i = 0; i < d; i++) o[i] = ST(SILU_MUL(LD(g[i]), LD(u[i]), RND));         \
    }                                                                                         \
}

/* neox RoPE in place on the first rot dims of every head of q [T, hq*D] (row stride qs) and
 * k [T, hk*D] (row stride ks); cs: fp32 [max_pos, rot] (cos | sin) */
#define DEFINE_ROPE(NAME, T_, LD, ST)                                                          \
static void NAME(const int64_t *pos, T_ *q, int64_t qs, int64_t hq, T_ *k, int64_t ks,       \
                 int64_t hk, int64_t D, const float *cos_sin, int64_t rot, int64_t T, int nt) { \
    const int64_t half = rot / 2;                                                             \
    _Pragma("omp parallel for num_threads(nt) schedule(static) if (T * (hq + hk) * D >= PAR_MIN_ELEMS && nt > 1)") \
    for (int64_t t = 0; t < T; t++) {                                                         \
        const float *c = cos_sin + pos[t] * rot, *s = c + half;                               \
        for (int64_t h = 0; h < hq + hk; h++) {                                               \
            T_ *x = h < hq ? q + t * qs + h * D : k + t * ks + (h - hq) * D;                  \
            for (int64_t i = 0; i < half; i++) {                                              \
                const float x1 = LD(x[i]), x2 = LD(x[half + i]);                              \
                x[i] = ST(x1 * c[i] - x2 * s[i]);                                             \
                x[half + i] = ST(x2 * c[i] + x1 * s[i]);                                      \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}

DEFINE_NORM(norm_f32, float, F32_LD, F32_ST, F32_RND)
#if defined(__AVX512F__)
#include "elementwise_avx512.h" /* silu_f32; with AVX512-BF16 also silu_bf16 and norm_bf16 */
#ifdef __AVX512BF16__
#define HAVE_BF16_EW 1 /* silu_bf16 and norm_bf16 come from the header */
#else
#define HAVE_BF16_EW 0
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include "elementwise_avx2.h" /* silu_f32, silu_bf16 and norm_bf16 */
#define HAVE_BF16_EW 1
#else
DEFINE_SILU(silu_f32, float, F32_LD, F32_ST, F32_RND)
#define HAVE_BF16_EW 0
#endif
#if !HAVE_BF16_EW
DEFINE_NORM(norm_bf16, uint16_t, BF16_LD, BF16_ST, BF16_RND)
DEFINE_SILU(silu_bf16, uint16_t, BF16_LD, BF16_ST, BF16_RND)
#endif
DEFINE_ROPE(rope_f32, float, F32_LD, F32_ST)
DEFINE_ROPE(rope_bf16, uint16_t, BF16_LD, BF16_ST)

int llmsvc_rms_norm(int dtype, const void *x, int64_t xs, const void *w, void *out, int64_t T,
                    int64_t H, float eps, int nt) {
    if (H <= 0 || H > 65536) return -1;
    if (dtype == 1) norm_bf16(x, xs, NULL, 0, w, out, NULL, T, H, eps, nt);
    else norm_f32(x, xs, NULL, 0, w, out, NULL, T, H, eps, nt);
    return 0;
}

int llmsvc_fused_add_rms_norm(int dtype, const void *x, int64_t xs, const void *res, int64_t rs,
                              const void *w, void *out, void *res_out, int64_t T, int64_t H,
                              float eps, int nt) {
    if (H <= 0 || H > 65536) return -1;
    if (dtype == 1) norm_bf16(x, xs, res, rs, w, out, res_out, T, H, eps, nt);
    else norm_f32(x, xs, res, rs, w, out, res_out, T, H, eps, nt);
    return 0;
}

int llmsvc_silu_and_mul(int dtype, const void *x, int64_t xs, void *out, int64_t T, int64_t d,
                        int nt) {
    if (dtype == 1) silu_bf16(x, xs, out, T, d, nt);
    else silu_f32(x, xs, out, T, d, nt);
    return 0;
}

int llmsvc_rotary_neox(int dtype, const int64_t *pos, void *q, int64_t qs, int64_t hq, void *k,
                       int64_t ks, int64_t hk, int64_t D, const float *cos_sin, int64_t rot,
                       int64_t max_pos, int64_t T, int nt) {
    if (rot <= 0 || rot > D || rot % 2) return -1;
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return -1;
    if (dtype == 1) rope_bf16(pos, q, qs, hq, k, ks, hk, D, cos_sin, rot, T, nt);
    else rope_f32(pos, q, qs, hq, k, ks, hk, D, cos_sin, rot, T, nt);
    return 0;
}

/* out[t] = index of the first maximum of row t of x [T, V] fp32 (row stride xs); a NaN
 * counts as the maximum, as in torch.argmax. Rows in parallel, and vectorized: a max pass,
 * a NaN pass on the bit patterns (this file is built with -ffast-math, so no float NaN
 * tests), then a scan for the first index holding the result. torch's argmax reads the
 * logits on one thread. */
int llmsvc_argmax_rows(const float *x, int64_t xs, int64_t *out, int64_t T, int64_t V, int nt) {
    if (V <= 0) return -1;
#pragma omp parallel for num_threads(nt) schedule(static) if (T * V >= PAR_MIN_ELEMS && nt > 1)
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * xs;
        const uint32_t *bits = (const uint32_t *)r;
        uint32_t nan_seen = 0;
        float m = r[0];
        for (int64_t i = 0; i < V; i++) {
            m = r[i] > m ? r[i] : m;
            nan_seen |= (bits[i] & 0x7fffffffu) > 0x7f800000u;
        }
        int64_t best = 0;
        if (nan_seen) {
            while ((bits[best] & 0x7fffffffu) <= 0x7f800000u) best++;
        } else {
            while (r[best] != m) best++;
        }
        out[t] = best;
    }
    return 0;
}
