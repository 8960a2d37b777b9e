/* AMX tiles on Linux: asking the kernel for tile-data permission, and the 64-byte tile
 * configuration that ldtilecfg reads (palette 1). Shared by the bf16 (gemm_amx.c) and int8
 * (gemm_int8_amx.c) AMX kernels; include it only where x86-64 Linux is known. */
#ifndef LLMSVC_AMX_TILES_H
#define LLMSVC_AMX_TILES_H

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16]; /* bytes per row of tile t */
    uint8_t rows[16];   /* rows of tile t */
} amx_tilecfg_t;

/* Whether this process may use tile data: asked once per translation unit (1 granted). */
static inline int amx_permission(void) {
    static int state; /* 0 unknown, 1 granted, -1 refused by the kernel */
    if (!state) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

#endif
