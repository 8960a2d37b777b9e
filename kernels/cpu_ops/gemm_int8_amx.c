/* The int8 GEMM's AMX-INT8 kernel (gemm_int8.h has the contract; gemm_int8.c runs it only
 * where cpuid, XCR0 and the kernel's tile permission allow). Compiled on every x86-64 Linux
 * build through target attributes (GCC's tile intrinsics are inline asm), so an AMX-less build
 * machine still carries it.
 *
 * tdpbssd multiplies signed bytes by signed bytes, so the activations are plain q_a (no offset).
 * One call: up to 64 rows (four row blocks of 16) x one panel of 16 columns. Per k step of 64:
 * tmm4 or tmm7 (in turn) takes the panel's B tile, its 16 k-quad rows being exactly its next
 * 1 KB ([16 k-quads][16 columns][4], row stride 64), loaded once for every row block; tmm5 and
 * tmm6 take the row blocks' A tiles in turn ([16 rows][64 k], read in place from aq, row
 * stride Kp); tmm0-3 accumulate the row blocks' C [16][16] int32. That is 1.25 tile loads per
 * tdpbssd at 64 rows (2 with one row block per call, the B tile re-read for each). Every tile is 16 rows:
 * the driver pads aq with zero rows to a multiple of 16, so one configuration serves every
 * call, and a short last block's extra rows sum to zeros that the epilogue never reads.
 * Each thread loads that configuration at its first call and releases it in i8_amx_end.
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <stdint.h>
#include <string.h>

#include "gemm_int8.h"

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>

#include "amx_tiles.h"

static _Thread_local int configured; /* this thread loaded the tile configuration */

int i8_amx_permitted(void) { return amx_permission(); }

__attribute__((target("amx-tile"))) static void configure(void) {
    amx_tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
    configured = 1;
}

void i8_amx_begin(void) { configured = 0; }

__attribute__((target("amx-tile"))) void i8_amx_end(void) {
    if (configured) _tile_release();
    configured = 0;
}

/* the 16 lines of the next panel that match this k step (pf NULL: none) */
static inline void prefetch_step(const int8_t *pf, int64_t k) {
    if (!pf) return;
    for (int i = 0; i < 16; i++) _mm_prefetch((const char *)(pf + k * I8_NP + i * 64), _MM_HINT_T0);
}

/* One k step (k: its byte offset in a row): the B tile into tile bt, each row block's A tile
 * into tmm5 (blocks 0 and 2) or tmm6 (1 and 3), so that an A load waits at most on the
 * multiply issued two before, each multiplied into its C tile. bt alternates between tmm4 and
 * tmm7 from step to step, so the next step's B load need not wait for this step's last
 * multiply to finish reading it (gemm_amx.c rotates its B tiles for the same reason). */
#define AMX_STEP(bt, k)                                                                            \
    do {                                                                                           \
        prefetch_step(pf, k);                                                                      \
        _tile_loadd(bt, w + (k) * I8_NP, 64);                                                      \
        _tile_loadd(5, a + (k), kp);                                                               \
        _tile_dpbssd(0, 5, bt);                                                                    \
        if (nb > 1) { _tile_loadd(6, a + 16 * kp + (k), kp); _tile_dpbssd(1, 6, bt); }             \
        if (nb > 2) { _tile_loadd(5, a + 32 * kp + (k), kp); _tile_dpbssd(2, 5, bt); }             \
        if (nb > 3) { _tile_loadd(6, a + 48 * kp + (k), kp); _tile_dpbssd(3, 6, bt); }             \
    } while (0)

__attribute__((target("amx-tile,amx-int8")))
void i8_kernel_amx(const i8_gemm_t *g, int64_t r0, int mr, int64_t p, const int8_t *pf, int32_t acc[][I8_NP]) {
    const int64_t kp = g->Kp;
    const int8_t *w = g->panels + p * kp * I8_NP;
    const int8_t *a = (const int8_t *)g->aq + r0 * kp;
    const int nb = (mr + 15) / 16; /* 1..4 row blocks; the tile numbers must be constants */
    if (!configured) configure();
    _tile_zero(0);
    if (nb > 1) _tile_zero(1);
    if (nb > 2) _tile_zero(2);
    if (nb > 3) _tile_zero(3);
    int64_t k = 0;
    for (; k + I8_KQ < kp; k += 2 * I8_KQ) {
        AMX_STEP(4, k);
        AMX_STEP(7, k + I8_KQ);
    }
    if (k < kp) AMX_STEP(4, k);
    _tile_stored(0, acc, I8_NP * sizeof(int32_t));
    if (nb > 1) _tile_stored(1, acc + 16, I8_NP * sizeof(int32_t));
    if (nb > 2) _tile_stored(2, acc + 32, I8_NP * sizeof(int32_t));
    if (nb > 3) _tile_stored(3, acc + 48, I8_NP * sizeof(int32_t));
}
#else
int i8_amx_permitted(void) { return 0; }
void i8_amx_begin(void) {}
void i8_amx_end(void) {}
void i8_kernel_amx(const i8_gemm_t *g, int64_t r0, int mr, int64_t p, const int8_t *pf, int32_t acc[][I8_NP]) {
    (void)g, (void)r0, (void)mr, (void)p, (void)pf, (void)acc;
}
#endif
