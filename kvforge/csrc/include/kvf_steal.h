/* Panel ranges that threads finish from both ends: each thread walks its own range front to back, and a
 * thread done with its own takes tiles from the back of the others' ranges.
 *
 * Why: a decode-row linear splits its panels evenly, and on a shared 2-vCPU VM the two threads rarely finish
 * together (a late wake-up, a vCPU the hypervisor took away for a while, the other core's share of the memory
 * bus). With an even split the first one done waits at the region's end, and for that stretch only one core
 * streams weights. py-spy on one int8 stream of the 1B preset found the calling thread waiting in that
 * barrier for 15% of the decode time. Figures where the kernels use it.
 *
 * Each range is one 64-bit word, [lo, hi) as two 32-bit halves, on its own cache line. The owner claims
 * from lo, a thief from hi, both by compare-and-swap of the whole word, so a panel is handed out once. The
 * claims are relaxed: the tiles write disjoint outputs, and the region's closing barrier orders the rest.
 * A thread's next tile is known before it starts the current one (the owner's is the one after it, a
 * thief's the one before), so the next-tile prefetch carries over.
 *
 * The ranges are laid out for `nthreads` before the region and initialised there, so a team smaller than
 * asked for (OpenMP may give fewer threads) still covers every panel: the missing threads' ranges are
 * taken from the back. */
#ifndef KVF_STEAL_H
#define KVF_STEAL_H

#include <stdint.h>
#include <stdlib.h>

typedef struct {
    uint64_t span; /* lo << 32 | hi */
    char pad[56];
} kvf_range;

static inline uint64_t kvf_span(int64_t lo, int64_t hi) { return ((uint64_t)lo << 32) | (uint64_t)hi; }

/* nthreads ranges splitting [0, P) evenly, cache-line aligned; NULL when out of memory. */
static inline kvf_range *kvf_ranges_new(int64_t P, int nthreads) {
    kvf_range *r = (kvf_range *)aligned_alloc(64, sizeof(kvf_range) * (size_t)nthreads);
    if (!r) return NULL;
    for (int t = 0; t < nthreads; t++) r[t].span = kvf_span(P * t / nthreads, P * (t + 1) / nthreads);
    return r;
}

/* Up to n panels of range r: from the front (back = 0) or the back. Returns the count (0: the range is
 * empty) and the first panel in *start. */
static inline int kvf_claim(kvf_range *r, int n, int back, int64_t *start) {
    uint64_t old = __atomic_load_n(&r->span, __ATOMIC_RELAXED);
    for (;;) {
        const int64_t lo = (int64_t)(old >> 32), hi = (int64_t)(old & 0xffffffffu);
        if (lo >= hi) return 0;
        const int64_t take = hi - lo < n ? hi - lo : n;
        const uint64_t next = back ? kvf_span(lo, hi - take) : kvf_span(lo + take, hi);
        if (__atomic_compare_exchange_n(&r->span, &old, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *start = back ? hi - take : lo;
            return (int)take;
        }
    }
}

/* The tiles one thread works through: its own range, then the others' from the back, nearest first. Without
 * `ranges` (out of memory) it is the plain even split: this thread's share alone, in order. */
typedef struct {
    kvf_range *ranges;
    kvf_range local;            /* the even share, when ranges is NULL */
    int nthreads, tid, victim;  /* victim: the range being taken from (tid while on its own) */
    int per;                    /* panels per tile */
} kvf_walk;

/* nthreads: the ranges laid out; nth: the team's size (for the even share of `total` panels without them). */
static inline kvf_walk kvf_walk_start(kvf_range *ranges, int nthreads, int nth, int tid, int per, int64_t total) {
    kvf_walk w;
    w.ranges = ranges;
    w.local.span = kvf_span(total * tid / nth, total * (tid + 1) / nth);
    w.nthreads = ranges ? nthreads : 1;
    w.tid = w.victim = ranges ? tid : 0;
    w.per = per;
    return w;
}

static inline kvf_range *kvf_walk_range(kvf_walk *w) {
    return w->ranges ? &w->ranges[w->victim % w->nthreads] : &w->local;
}

/* The next tile: *p its first panel, the count returned (0: no panel is left anywhere). */
static inline int kvf_walk_next(kvf_walk *w, int64_t *p) {
    while (w->victim < w->tid + w->nthreads) {
        const int own = w->victim == w->tid;
        const int n = kvf_claim(kvf_walk_range(w), w->per, !own, p);
        if (n) return n;
        w->victim++;
    }
    return 0;
}

/* The tile this thread is likely to take next (for its prefetch): *p and the count, 0 if none is seen. */
static inline int kvf_walk_peek(kvf_walk *w, int64_t *p) {
    if (w->victim >= w->tid + w->nthreads) return 0;
    const uint64_t span = __atomic_load_n(&kvf_walk_range(w)->span, __ATOMIC_RELAXED);
    const int64_t lo = (int64_t)(span >> 32), hi = (int64_t)(span & 0xffffffffu);
    if (lo >= hi) return 0;
    const int64_t take = hi - lo < w->per ? hi - lo : w->per;
    *p = w->victim == w->tid ? lo : hi - take;
    return (int)take;
}

#endif
