/* Work sharing of a packed GEMM's column panels over an OpenMP team (gemm.c, gemm_amx.c).
 *
 * Each thread owns a static run of panels, taken front to back, so the panel it prefetches
 * while computing one is the one it takes next; a thread that finishes its run early takes
 * panels from the back of the others' runs. On a small shared VM the threads do not run at
 * one speed: the gRPC server, the client or another process preempts one now and then, and
 * the AMX throughput of one vCPU swings severalfold from second to second (a sibling
 * hyperthread of another guest, presumably). With a plain static split the faster thread
 * waits at the barrier.
 */
#ifndef LLMSVC_PANEL_RUNS_H
#define LLMSVC_PANEL_RUNS_H
#include <stdint.h>

/* Panels [lo, hi) of one thread, packed in one word (lo in the low 32 bits) so that the owner
 * (taking lo, front to back, prefetching lo + 1) and a thief (taking hi - 1, back to front)
 * claim each panel exactly once with one compare-and-swap. */
typedef struct { uint64_t lo_hi; char pad[56]; } range_t;
#define MAX_NT 256

static inline int64_t take(range_t *r, int front) {
    uint64_t v = __atomic_load_n(&r->lo_hi, __ATOMIC_RELAXED);
    for (;;) {
        const uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
        if (lo >= hi) return -1;
        const uint64_t nv = front ? ((uint64_t)hi << 32) | (lo + 1) : ((uint64_t)(hi - 1) << 32) | lo;
        if (__atomic_compare_exchange_n(&r->lo_hi, &v, nv, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return front ? (int64_t)lo : (int64_t)hi - 1;
    }
}

/* run t of nt threads: panels [t * np / nt, (t + 1) * np / nt); np < 2^31 */
static inline void split_runs(range_t *ranges, int nt, int64_t np) {
    for (int t = 0; t < nt; t++)
        ranges[t].lo_hi = ((uint64_t)((t + 1) * np / nt) << 32) | (uint64_t)(t * np / nt);
}

/* Thread me of a team of `team` calls panel(ctx, p, pf_p) for the panels it claims: pf_p is
 * the panel it will most likely take next (to prefetch), -1 for none. Run t goes to thread
 * t % team when OpenMP gives fewer than nt threads. */
static inline __attribute__((always_inline)) void run_panels(
    range_t *ranges, int nt, int me, int team, void (*panel)(void *, int64_t, int64_t), void *ctx) {
    for (int t = me; t < nt; t += team) {
        int64_t p;
        while ((p = take(&ranges[t], 1)) >= 0) {
            const uint64_t v = __atomic_load_n(&ranges[t].lo_hi, __ATOMIC_RELAXED);
            panel(ctx, p, (uint32_t)v < (uint32_t)(v >> 32) ? p + 1 : -1);
        }
    }
    for (int d = 1; d < nt; d++) { /* then the others', from the back */
        range_t *r = &ranges[(me + d) % nt];
        int64_t p;
        while ((p = take(r, 0)) >= 0) panel(ctx, p, p > 0 ? p - 1 : -1);
    }
}
#endif
