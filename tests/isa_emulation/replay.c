/* Replays a trace of native-kernel calls (trace.py, gemm_cases.py) on this build and compares
 * every storage after each call with the trace's: byte for byte, or for fp32 and bf16 within
 * rounding (another vector width sums in another order). The int8 GEMM's calls run once per
 * int8 ISA this CPU has that takes the blob's weight range; their integer sums are exact, so
 * any difference there is a bug.
 *
 * Usage: replay TRACE...; REPLAY_VERBOSE=1 also prints each storage that differed within
 * rounding and by how much. Exit 1 if any call differs beyond it or returns another code. */
#define _GNU_SOURCE
#include <ffi.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../kernels/cpu_ops/gemm_int8.h" /* the int8 ISA codes */

#define ENTRIES(X) X(llmsvc_paged_attention) X(llmsvc_rms_norm) X(llmsvc_fused_add_rms_norm) \
    X(llmsvc_silu_and_mul) X(llmsvc_store_kv) X(llmsvc_argmax_rows) X(llmsvc_rotary_neox) X(llmsvc_gemm_i8) \
    X(llmsvc_gemm_f32) X(llmsvc_gemm_bf16_widen) X(llmsvc_gemm_bf16_dp) X(llmsvc_gemm_bf16_amx)
#define DECLARE(n) int n();
ENTRIES(DECLARE)
#define ROW(n) {#n, n},
static const struct { const char *name; int (*fn)(); } FNS[] = {ENTRIES(ROW)};
int llmsvc_gemm_i8_supported(int);
int llmsvc_gemm_i8_qmax(int);

enum { ARG_I32, ARG_I64, ARG_F32, ARG_PTR, ARG_NULL };      /* trace.py's argument kinds */
enum { T_F32 = 1, T_BF16 = 2, T_I32 = 6, T_I64 = 7 };       /* trace.py's DTYPE_CODES used here */
#define MAX_ARGS 64
typedef struct { int kind, idx; int64_t v; } arg_t;
typedef struct { uint64_t n; int type; uint32_t pad; uint8_t *before, *after, *mem; } stor_t;

static void rd(void *p, size_t n, FILE *f) {
    if (fread(p, 1, n, f) != n) { fprintf(stderr, "replay: truncated trace\n"); exit(2); }
}

static double bf16(const uint8_t *p) {
    uint32_t u = (uint32_t)(p[0] | p[1] << 8) << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* Storage s after the call against the trace: 0 equal within rounding (printed if verbose),
 * 1 not (printed). fp32: |d| <= 2e-5 (1 + |want|), the kernel tests' bound against the torch
 * reference; bf16: one unit in the last place and then some (1e-2 + 1.6e-2 |want|). */
static int differs(long call, const char *name, int isa, int s, const stor_t *st) {
    const uint8_t *got = st->mem, *want = st->after;
    const int esz = st->type == T_F32 || st->type == T_I32 ? 4 : st->type == T_BF16 ? 2 : st->type == T_I64 ? 8 : 1;
    double worst = 0, scale = 0;
    long bad = 0, first = -1;
    for (uint64_t i = 0; i + esz <= st->n; i += esz) {
        if (st->type != T_F32 && st->type != T_BF16) {
            if (memcmp(got + i, want + i, esz) && !bad++) first = (long)(i / esz);
            continue;
        }
        double x, y, tol;
        if (st->type == T_F32) {
            float a, b;
            memcpy(&a, got + i, 4), memcpy(&b, want + i, 4);
            x = a, y = b, tol = 2e-5 + 2e-5 * fabs(y);
        } else {
            x = bf16(got + i), y = bf16(want + i), tol = 1e-2 + 1.6e-2 * fabs(y);
        }
        const double d = isnan(x) != isnan(y) ? INFINITY : isnan(x) ? 0 : fabs(x - y);
        scale = fabs(y) > scale ? fabs(y) : scale;
        worst = d > worst ? d : worst;
        if (d > tol && !bad++) first = (long)(i / esz);
    }
    if (bad || getenv("REPLAY_VERBOSE"))
        printf("%s call %ld %s isa %d storage %d type %d: %ld out of tolerance (first at %ld), max |diff| %g, max |want| %g\n",
               bad ? "MISMATCH" : "rounding", call, name, isa, s, st->type, bad, first, worst, scale);
    return bad != 0;
}

/* one run of fn on fresh copies of the storages; 1 if it differs from the trace */
static int run(long call, const char *name, int (*fn)(), int isa, int rc, const arg_t *args, uint32_t na,
               stor_t *st, uint32_t ns, long *rounding) {
    ffi_type *types[MAX_ARGS];
    void *vals[MAX_ARGS], *ptrs[MAX_ARGS];
    int32_t i32[MAX_ARGS];
    int64_t i64[MAX_ARGS];
    float f32[MAX_ARGS];
    for (uint32_t s = 0; s < ns; s++) memcpy(st[s].mem, st[s].before, st[s].n);
    for (uint32_t i = 0; i < na; i++) {
        const arg_t *a = &args[i];
        if (a->kind == ARG_I32) i32[i] = isa && i == 0 ? isa : (int32_t)a->v, types[i] = &ffi_type_sint32, vals[i] = &i32[i];
        else if (a->kind == ARG_I64) i64[i] = a->v, types[i] = &ffi_type_sint64, vals[i] = &i64[i];
        else if (a->kind == ARG_F32) { uint32_t u = (uint32_t)a->v; memcpy(&f32[i], &u, 4); types[i] = &ffi_type_float, vals[i] = &f32[i]; }
        else ptrs[i] = a->kind == ARG_PTR ? st[a->idx].mem + a->v : NULL, types[i] = &ffi_type_pointer, vals[i] = &ptrs[i];
    }
    ffi_cif cif;
    ffi_arg r;
    if (ffi_prep_cif(&cif, FFI_DEFAULT_ABI, na, &ffi_type_sint32, types) != FFI_OK) exit(2);
    ffi_call(&cif, FFI_FN(fn), &r, vals);
    int bad = (int)r != rc;
    if (bad) printf("MISMATCH call %ld %s isa %d: returned %d, the trace %d\n", call, name, isa, (int)r, rc);
    for (uint32_t s = 0; s < ns; s++) {
        if (!memcmp(st[s].mem, st[s].after, st[s].n)) continue;
        if (differs(call, name, isa, (int)s, &st[s])) bad = 1;
        else ++*rounding;
    }
    return bad;
}

/* Whether int8 ISA isa multiplies the call's blob (argument 4; its header's qmax, gemm_int8.h):
 * a blob wider than the path's range is refused by design (8-bit weights on avx2_w7) */
static int i8_takes(int isa, const arg_t *args, const stor_t *st) {
    int32_t hdr[5];
    if (args[4].kind != ARG_PTR || st[args[4].idx].n < (uint64_t)args[4].v + sizeof hdr) return 1;
    memcpy(hdr, st[args[4].idx].before + args[4].v, sizeof hdr);
    return hdr[4] <= llmsvc_gemm_i8_qmax(isa);
}

int main(int argc, char **argv) {
    long calls = 0, runs = 0, failed = 0, rounding = 0;
    for (int t = 1; t < argc; t++) {
        FILE *f = fopen(argv[t], "rb");
        if (!f) { perror(argv[t]); return 2; }
        uint32_t len, na, ns;
        while (fread(&len, 4, 1, f) == 1) {
            char name[64] = {0};
            int rc;
            arg_t args[MAX_ARGS];
            stor_t st[MAX_ARGS];
            if (len >= sizeof name) { fprintf(stderr, "replay: bad record\n"); return 2; }
            rd(name, len, f), rd(&rc, 4, f), rd(&na, 4, f);
            if (na > MAX_ARGS) { fprintf(stderr, "replay: bad record\n"); return 2; }
            for (uint32_t i = 0; i < na; i++) rd(&args[i].kind, 4, f), rd(&args[i].idx, 4, f), rd(&args[i].v, 8, f);
            rd(&ns, 4, f);
            if (ns > MAX_ARGS) { fprintf(stderr, "replay: bad record\n"); return 2; }
            for (uint32_t s = 0; s < ns; s++) {
                rd(&st[s].n, 8, f), rd(&st[s].type, 4, f), rd(&st[s].pad, 4, f);
                st[s].before = malloc(st[s].n), st[s].after = malloc(st[s].n);
                st[s].mem = aligned_alloc(64, (st[s].n + 63) / 64 * 64); /* as the host's tensors */
                rd(st[s].before, st[s].n, f), rd(st[s].after, st[s].n, f);
            }
            int (*fn)() = NULL;
            for (size_t i = 0; i < sizeof FNS / sizeof *FNS; i++)
                if (!strcmp(FNS[i].name, name)) fn = FNS[i].fn;
            if (!fn) { fprintf(stderr, "replay: unknown entry %s\n", name); return 2; }
            int bad = 0;
            if (!strcmp(name, "llmsvc_gemm_i8")) { /* every int8 ISA here; the first argument names it */
                /* on each ISA that takes the blob's range as the recorded one did (a call
                 * refused for it is replayed where it is refused again) */
                const int takes = i8_takes((int)args[0].v, args, st);
                for (int isa = I8_REF + 1; isa < I8_NISA; isa++)
                    if (llmsvc_gemm_i8_supported(isa) && i8_takes(isa, args, st) == takes)
                        bad |= run(calls, name, fn, isa, rc, args, na, st, ns, &rounding), runs++;
            } else {
                bad = run(calls, name, fn, 0, rc, args, na, st, ns, &rounding), runs++;
            }
            failed += bad;
            for (uint32_t s = 0; s < ns; s++) free(st[s].before), free(st[s].after), free(st[s].mem);
            calls++;
        }
        fclose(f);
    }
    printf("replayed %ld calls (%ld runs): %ld differ, %ld storages equal within rounding\n", calls, runs, failed, rounding);
    return failed ? 1 : 0;
}
