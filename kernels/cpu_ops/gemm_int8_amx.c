/* The int8 GEMM's AMX-INT8 kernel (gemm_int8.h has the contract; gemm_int8.c runs it only
 * where cpuid, XCR0 and the kernel's tile permission allow). Compiled on every x86-64 Linux
 * build through target attributes (GCC's tile intrinsics are inline asm), so an AMX-less build
 * machine still carries it.
 *
 * tdpbssd multiplies signed bytes by signed bytes, so the activations are plain q_a (no offset).
 * One call: up to 16 rows x one panel of 16 columns. tmm0 is C [mr][16] int32, tmm1 the A tile
 * [mr rows][64 k] read in place from aq (row stride Kp bytes), tmm2 the B tile: 16 k-quad rows
 * of the panel, which is exactly its next 1 KB ([16 k-quads][16 columns][4]), row stride 64.
 * Each thread loads its tile configuration for the row count it needs, once per change.
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <stdint.h>
#include <string.h>

#include "gemm_int8.h"

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>

#include "amx_tiles.h"

static _Thread_local int cur_rows; /* the loaded configuration's C / A rows; 0: none */

int i8_amx_permitted(void) { return amx_permission(); }

__attribute__((target("amx-tile"))) static void configure(int mr) {
    amx_tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 3; t++) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = (uint8_t)mr;
    cfg.rows[2] = 16;
    _tile_loadconfig(&cfg);
    cur_rows = mr;
}

void i8_amx_begin(void) { cur_rows = 0; }

__attribute__((target("amx-tile"))) void i8_amx_end(void) {
    if (cur_rows) _tile_release();
    cur_rows = 0;
}

__attribute__((target("amx-tile,amx-int8")))
void i8_kernel_amx(const i8_gemm_t *g, int64_t r0, int mr, int64_t p, const int8_t *pf, int32_t acc[][I8_NP]) {
    (void)pf;
    const int64_t kp = g->Kp;
    const int8_t *w = g->panels + p * kp * I8_NP;
    const int8_t *a = (const int8_t *)g->aq + r0 * kp;
    if (cur_rows != mr) configure(mr);
    _tile_zero(0);
    for (int64_t k = 0; k < kp; k += I8_KQ) {
        _tile_loadd(1, a + k, kp);
        _tile_loadd(2, w + k * I8_NP, 64);
        _tile_dpbssd(0, 1, 2);
    }
    _tile_stored(0, acc, I8_NP * sizeof(int32_t));
}
#else
int i8_amx_permitted(void) { return 0; }
void i8_amx_begin(void) {}
void i8_amx_end(void) {}
void i8_kernel_amx(const i8_gemm_t *g, int64_t r0, int mr, int64_t p, const int8_t *pf, int32_t acc[][I8_NP]) {
    (void)g, (void)r0, (void)mr, (void)p, (void)pf, (void)acc;
}
#endif
