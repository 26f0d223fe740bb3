/* fp32 y[M,N] = x[M,K] @ W^T (+ bias) on weights packed in column panels (kvforge/models/panel_linear.py).
 *
 * Why a panel layout: a decode step (M = 1..a few rows) is bound by reading W once from memory. With W
 * stored as panels of NR output columns, each panel [K][NR] contiguous, one thread reads its whole share of
 * W as a single sequential stream (one 64-byte cache line per k for NR = 16), which the hardware prefetcher
 * follows at full bandwidth, and every loaded weight is used by all M rows at once. For larger M the same
 * panel is reused from L1/L2 by a register-blocked MR x NR microkernel over blocks of rows, so W still comes
 * from memory once per call while x blocks sit in L2.
 *
 * Threads split the panels statically (each thread owns a contiguous range: one stream, no sharing of
 * output cache lines except at the range edges). N is padded up to a multiple of NR with zero columns in the
 * packed weight; only the first N columns are written. Any M >= 1, any K >= 1. x and y are contiguous.
 *
 * AVX2 + FMA intrinsics where the compiler targets them; otherwise a plain-C loop with the same order of
 * k-accumulation per column (results equal within fp32 rounding: FMA rounds once per step, mul+add twice).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_omp.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVF_SIMD 1
#else
#define KVF_SIMD 0
#endif

/* The gated epilogue's exp is libmvec's vector expf under `omp simd`, as fused_ops.c's SiLU calls it
 * (kvf_omp.h). */

#define NR 16 /* output columns per panel: two 8-float AVX2 registers */
#define MR 6  /* rows per GEMM microkernel tile: 12 accumulators + 2 weight + 1 broadcast registers */

int kvf_panel_nr(void) { return NR; }
int kvf_panel_simd(void) { return KVF_SIMD; }

/* Software prefetch distance in cache lines (= k steps) ahead of the weight stream, used on the first tile
 * over each panel (the one reading it from memory) when M >= 2. Measured (benchmarks/linear_kernels.py,
 * 1 thread): 10-25% faster at M = 2..8, where the FMA chains per line fill the out-of-order window and the
 * core runs fewer misses ahead; at M = 1 the hardware prefetcher alone was as fast or faster. */
#define PREFETCH_LINES 32

#if KVF_SIMD
/* Decode rows (mr <= 3): two independent accumulator sets over even/odd k hide the FMA latency; the
 * weight stream is the bottleneck here, prefetched `pf` floats ahead when pf != 0. */
static inline __attribute__((always_inline)) void tile_gemv(const float *x, int64_t ldx, int64_t K, const float *w, int mr,
                                                            float *tile, int64_t pf) {
    __m256 c0[3], c1[3], d0[3], d1[3];
    for (int r = 0; r < 3; r++) c0[r] = c1[r] = d0[r] = d1[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
        const float *wk = w + k * NR;
        if (pf) {
            _mm_prefetch((const char *)(wk + pf), _MM_HINT_T0);
            _mm_prefetch((const char *)(wk + pf + NR), _MM_HINT_T0);
        }
        __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
        __m256 v0 = _mm256_loadu_ps(wk + NR), v1 = _mm256_loadu_ps(wk + NR + 8);
#pragma GCC unroll 3
        for (int r = 0; r < mr; r++) {
            __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
            __m256 b = _mm256_broadcast_ss(x + r * ldx + k + 1);
            c0[r] = _mm256_fmadd_ps(a, w0, c0[r]);
            c1[r] = _mm256_fmadd_ps(a, w1, c1[r]);
            d0[r] = _mm256_fmadd_ps(b, v0, d0[r]);
            d1[r] = _mm256_fmadd_ps(b, v1, d1[r]);
        }
    }
    for (; k < K; k++) {
        __m256 w0 = _mm256_loadu_ps(w + k * NR), w1 = _mm256_loadu_ps(w + k * NR + 8);
#pragma GCC unroll 3
        for (int r = 0; r < mr; r++) {
            __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
            c0[r] = _mm256_fmadd_ps(a, w0, c0[r]);
            c1[r] = _mm256_fmadd_ps(a, w1, c1[r]);
        }
    }
#pragma GCC unroll 3
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(tile + r * NR, _mm256_add_ps(c0[r], d0[r]));
        _mm256_storeu_ps(tile + r * NR + 8, _mm256_add_ps(c1[r], d1[r]));
    }
}

/* GEMM rows (mr = 4..6): mr x 16 accumulators, the panel's k-th line reused by all rows. */
static inline __attribute__((always_inline)) void tile_gemm(const float *x, int64_t ldx, int64_t K, const float *w, int mr,
                                                            float *tile, int64_t pf) {
    __m256 c0[MR], c1[MR];
    for (int r = 0; r < MR; r++) c0[r] = c1[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        if (pf) _mm_prefetch((const char *)(w + k * NR + pf), _MM_HINT_T0);
        __m256 w0 = _mm256_loadu_ps(w + k * NR), w1 = _mm256_loadu_ps(w + k * NR + 8);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
            c0[r] = _mm256_fmadd_ps(a, w0, c0[r]);
            c1[r] = _mm256_fmadd_ps(a, w1, c1[r]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(tile + r * NR, c0[r]);
        _mm256_storeu_ps(tile + r * NR + 8, c1[r]);
    }
}

static void tile(const float *x, int64_t ldx, int64_t K, const float *w, int mr, float *out, int64_t pf) {
    /* one specialised copy per row count, so the accumulators stay in registers */
    switch (mr) {
    case 1: tile_gemv(x, ldx, K, w, 1, out, pf); break;
    case 2: tile_gemv(x, ldx, K, w, 2, out, pf); break;
    case 3: tile_gemv(x, ldx, K, w, 3, out, pf); break;
    case 4: tile_gemm(x, ldx, K, w, 4, out, pf); break;
    case 5: tile_gemm(x, ldx, K, w, 5, out, pf); break;
    default: tile_gemm(x, ldx, K, w, 6, out, pf); break;
    }
}
#else
static void tile(const float *x, int64_t ldx, int64_t K, const float *w, int mr, float *out, int64_t pf) {
    (void)pf;
    float acc[MR][NR];
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * NR;
        for (int r = 0; r < mr; r++) {
            const float a = x[r * ldx + k];
            for (int j = 0; j < NR; j++) acc[r][j] += a * wk[j];
        }
    }
    for (int r = 0; r < mr; r++) memcpy(out + r * NR, acc[r], sizeof acc[r]);
}
#endif

/* Write a tile's first N - n0 columns to y (+ bias), or with `accumulate` add it (a later block of K). */
static void store(const float *tile_out, int mr, float *y, int64_t N, int64_t n0, const float *bias, int accumulate) {
    const int64_t nv = N - n0 < NR ? N - n0 : NR;
    for (int r = 0; r < mr; r++) {
        float *yr = y + r * N + n0;
        const float *t = tile_out + r * NR;
        if (accumulate)
            for (int64_t j = 0; j < nv; j++) yr[j] += t[j];
        else if (bias)
            for (int64_t j = 0; j < nv; j++) yr[j] = t[j] + bias[n0 + j];
        else
            memcpy(yr, t, (size_t)nv * sizeof(float));
    }
}

/* Cache budgets that set the blocking: a chunk of panels sized to stay in L2 while a block of x rows
 * (also L2-sized) runs over it, so for large M each weight is read from memory once and x from L2. When
 * several row tiles share a panel, K is cut in blocks of KC so the [KC][NR] slice of the panel (16 KiB)
 * stays in L1 while all tiles of the row block use it. */
#define L2_PANEL_BYTES (192 * 1024)
#define L2_X_BYTES (128 * 1024)
#define KC 256

#if KVF_SIMD && defined(__AVX512F__)
/* Rows on AVX-512 (M >= GEMM512_MIN): a register tile of up to GM rows x GP panels, one zmm (16
 * columns) per panel and k: 8 x 3 = 24 accumulators + 3 weight lines + 1 broadcast = 28 of 32 zmm. Each
 * k's 3 weight lines serve 8 rows and each broadcast serves 48 columns, so the FMA ports, not the loads,
 * set the pace, and 24 independent chains cover the FMA latency. Full K per tile: the panel group
 * (3 x K x 64 B, <= 300 KB for K = 1536) stays in L2 while the row tiles pass over it. x is first copied
 * into row tiles of GM interleaved rows (`pack_rows`): the tile then reads x as one stream off one pointer;
 * read in place, the 8 row pointers and the prefetch bookkeeping outgrew the 16 general registers and the
 * k loop reloaded pointers from the stack (the tile alone: 157 -> 185 GFLOP/s on one Xeon core). The
 * order of the k sums is unchanged, so y is bitwise the same. Measured against oneDNN's packed fp32
 * kernels per shape and row count in benchmarks/linear_kernels.py --panel. */
#define GM 8
#define GP 3
/* Every row count takes these tiles, decode rows (1-3) included: on the 2-core AMX Xeon their 1-row tile
 * read the weights at ~29 GB/s where the AVX2 decode tile below (even/odd k accumulators, its own prefetch
 * distance) reached ~22: one decode step's linears out of DRAM 24.0 -> 18.6 ms at 1 row, 21.2 -> 18.8 at 2,
 * and single-stream fp32 decode of the default model 38-39 -> 48-50 tok/s. -DGEMM512_MIN=4 gives the old
 * split for an A/B; CPUs without AVX-512 keep the AVX2 tiles. */
#ifndef GEMM512_MIN
#define GEMM512_MIN 1
#endif
/* Rows per pass over the thread's panels, as x bytes: a prefill chunk's x (1,024 rows x K floats: 2.4 MB
 * at K = 576, 6.3 MB at 1,536) does not fit in L2, and every panel group re-read all of it from L3 or
 * DRAM; in chunks of ~GEMM_X_BYTES the chunk stays in L2 while the weights are re-read once a chunk
 * instead. 0: one pass over all rows. */
#ifndef GEMM_X_BYTES
#define GEMM_X_BYTES (512 * 1024)
#endif
/* Software pipelining of the weights: while the row tiles of one panel group multiply (from L2), they
 * prefetch the next group into L2, each tile an equal share of its lines. Why: a batch's decode step
 * (16-64 rows) is neither compute- nor memory-bound alone: without it the first row tile of each group
 * waits on DRAM and the later ones leave the memory bus idle. How the share is issued depends on the
 * number of row tiles (measured on a 2-core Xeon, a decode step's linears out of DRAM, default model):
 *  - 2 to 8 tiles (15-64 rows; 9-14 rows take the wide tile below): evenly over the tile's k loop, up to
 *    three lines a step, as KVF_PREFETCH_RUNS interleaved runs (see there);
 *  - 9 to 16 tiles (65-128 rows): evenly, in order. Issued up front, the prefetches held the core's few L1
 *    miss buffers that the tile's own weight loads (L2 hits) need: 32-128 rows took 6-10% less time spread
 *    evenly (in order, before the runs);
 *  - one tile: one to three lines a k step from the first step (it carries the whole next group);
 *  - more tiles (prefill chunks): the same up-front issue, a few lines a tile (spread was 2-4% slower).
 * With -DKVF_PREFETCH_RUNS=1 -DWIDE_MAX=0, 2-3 tiles issue up front, 4-8 in order, and 9-14 rows take two
 * 8-row tiles, as before the runs (an A/B build).
 * Tested branches, not an inner loop: a loop's bookkeeping per k cost the tile more than it hid.
 * KVF_GEMM_PREFETCH_EVEN=0 issues every share up front (the A/B in benchmarks/linear_kernels.py --step). */
#ifndef KVF_GEMM_PREFETCH
#define KVF_GEMM_PREFETCH 1
#endif
#ifndef KVF_GEMM_PREFETCH_EVEN
#define KVF_GEMM_PREFETCH_EVEN 1
#endif
/* Runs of a spread share: a tile's share of the next group, spread over its k loop, is issued as this many
 * interleaved runs (prefetch i goes to run i % RUNS, each run a contiguous stretch of the share) in the wide
 * tile (9-14 rows) and where a decode step has 2-8 row tiles (15-64 rows). Why: the prefetches then walk
 * several 4 KiB pages at once instead of one line after the next; in one run, in order, the wide tile's
 * 9-14 rows took 19-22 ms a step's 30 layers' linears, as 4 runs 16.4-17.8 (8 rows: 16.5); 33-40 rows
 * (5 tiles) 32-34 -> 29-32 ms, 48-64 rows the same. Measured on the 2-core AMX Xeon, weights out of
 * DRAM; 2 and 3 runs were slower than 4, 8 and 16 no faster. */
#ifndef KVF_PREFETCH_SPLIT
#define KVF_PREFETCH_SPLIT 1
#endif
#ifndef KVF_PREFETCH_RUNS
#define KVF_PREFETCH_RUNS 4
#endif
/* Spread modes of a tile's share (`spread` below): up front, evenly in order, evenly as runs. */
enum { KVF_UP_FRONT = 0, KVF_EVEN = 1, KVF_EVEN_RUNS = 2 };

/* One k step of a spread share: npf (<= 3K) lines of `pf` over the tile's K steps, Bresenham-style; with
 * KVF_EVEN_RUNS, line (slot, pos) = slot * run + pos as the slot cycles through the runs. The counters live
 * in the caller's registers: tested branches, not an inner loop (a loop's bookkeeping per k cost the tile
 * more than it hid). */
static inline __attribute__((always_inline)) void spread(const char *pf, int64_t npf, int64_t K, int runs,
                                                         int64_t run, int64_t *due, int64_t *slot, int64_t *pos) {
#define KVF_SPREAD_ONE()                                                              \
    do {                                                                              \
        _mm_prefetch(pf + 64 * (*slot * run + *pos), _MM_HINT_T1);                   \
        if (++*slot == runs) *slot = 0, ++*pos;                                       \
        *due -= K;                                                                    \
    } while (0)
    if ((*due += npf) >= K) {
        KVF_SPREAD_ONE();
        if (*due >= K) {
            KVF_SPREAD_ONE();
            if (*due >= K) KVF_SPREAD_ONE();
        }
    }
#undef KVF_SPREAD_ONE
}

static inline __attribute__((always_inline)) void gemm512_tile(const float *xp, int64_t K,
                                                               const float *w, int64_t pstride, int mr, int np,
                                                               float *y, int64_t N, int64_t n0,
                                                               const float *bias, const char *pf, int64_t npf,
                                                               int even, const int runs) {
    __m512 acc[GM][GP];
#pragma GCC unroll 8
    for (int r = 0; r < GM; r++)
#pragma GCC unroll 3
        for (int p = 0; p < GP; p++) acc[r][p] = _mm512_setzero_ps();
    const float *w1 = w + pstride, *w2 = w + 2 * pstride;
    /* the share's spread: with `runs` (a compile-time constant), as KVF_PREFETCH_RUNS runs (`spread`); else
     * up front (even == 0) or evenly in order. Separate copies: the run counters in the loop of the other
     * modes cost their tiles 3-8% (general registers spilled). */
    int64_t due = 0; /* even spacing: npf lines over K steps, Bresenham-style */
    const char *pnext = pf;
    const int64_t run = runs ? npf / KVF_PREFETCH_RUNS : 0;
    int64_t slot = 0, pos = 0;
#define KVF_TILE_K(k)                                                                        \
    do {                                                                                     \
        __m512 wv[GP];                                                                       \
        wv[0] = _mm512_loadu_ps(w + (k) * NR);                                               \
        if (np > 1) wv[1] = _mm512_loadu_ps(w1 + (k) * NR);                                  \
        if (np > 2) wv[2] = _mm512_loadu_ps(w2 + (k) * NR);                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; r++) {                               \
            const __m512 a = _mm512_set1_ps(xp[(k) * GM + r]);                               \
            _Pragma("GCC unroll 3") for (int p = 0; p < np; p++)                             \
                acc[r][p] = _mm512_fmadd_ps(a, wv[p], acc[r][p]);                            \
        }                                                                                    \
    } while (0)
    /* up front, the prefetches end at step npf (the first of the three lines a step): the steps after it
     * run a loop without their tests. A prefill chunk's tiles carry a few dozen lines of a K of 576-1536:
     * 512-1,024-row calls of the default model's 30 layers took 2-4% less time, outputs bitwise the same
     * (`linear_kernels.py --step`, 1,024 rows; -DKVF_PREFETCH_SPLIT=0 for the A/B). */
    const int64_t kp = !KVF_PREFETCH_SPLIT || (runs || even) ? K : npf < K ? npf : K;
    int64_t k = 0;
    for (; k < kp; k++) {
#if KVF_GEMM_PREFETCH
        if (runs) {
            spread(pf, npf, K, KVF_PREFETCH_RUNS, run, &due, &slot, &pos);
        } else if (!even) {
            if (k < npf) _mm_prefetch(pf + 64 * k, _MM_HINT_T1);
            if (k + K < npf) _mm_prefetch(pf + 64 * (k + K), _MM_HINT_T1);
            if (k + 2 * K < npf) _mm_prefetch(pf + 64 * (k + 2 * K), _MM_HINT_T1);
        } else if ((due += npf) >= K) {
            _mm_prefetch(pnext, _MM_HINT_T1);
            pnext += 64;
            due -= K;
        }
#endif
        KVF_TILE_K(k);
    }
    for (; k < K; k++) KVF_TILE_K(k);
#undef KVF_TILE_K
#pragma GCC unroll 3
    for (int p = 0; p < np; p++) {
        const int64_t c0 = n0 + p * NR, nv = N - c0 < NR ? N - c0 : NR;
        if (nv <= 0) break;
        const __mmask16 m = (__mmask16)((1u << nv) - 1u);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + c0) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++)
            _mm512_mask_storeu_ps(y + r * N + c0, m, bias ? _mm512_add_ps(acc[r][p], b) : acc[r][p]);
    }
}

/* One specialised copy per (rows, panels, spread as runs or not), so every accumulator loop is unrolled into
 * registers. `even`: KVF_UP_FRONT, KVF_EVEN or KVF_EVEN_RUNS. */
static void gemm512_block(const float *xp, int64_t K, const float *w, int64_t pstride, int mr, int np,
                          float *y, int64_t N, int64_t n0, const float *bias, const char *pf, int64_t npf, int even) {
#define KVF_GEMM_CASE(R, P) \
    case (R) * 4 + (P): gemm512_tile(xp, K, w, pstride, R, P, y, N, n0, bias, pf, npf, even, RUNS); break;
#define KVF_GEMM_ROW(R) KVF_GEMM_CASE(R, 1) KVF_GEMM_CASE(R, 2) KVF_GEMM_CASE(R, 3)
#define KVF_GEMM_SWITCH                                                          \
    switch (mr * 4 + np) {                                                       \
        KVF_GEMM_ROW(1) KVF_GEMM_ROW(2) KVF_GEMM_ROW(3) KVF_GEMM_ROW(4)          \
        KVF_GEMM_ROW(5) KVF_GEMM_ROW(6) KVF_GEMM_ROW(7) KVF_GEMM_ROW(8)          \
    default: break;                                                              \
    }
    if (even == KVF_EVEN_RUNS) {
#define RUNS 1
        KVF_GEMM_SWITCH
#undef RUNS
    } else {
#define RUNS 0
        KVF_GEMM_SWITCH
#undef RUNS
    }
#undef KVF_GEMM_SWITCH
#undef KVF_GEMM_ROW
#undef KVF_GEMM_CASE
}

/* Decode rows 9..WM (WIDE_MAX): one tile of up to WM rows x 2 panels, 28 accumulators + 2 weight lines
 * (x is broadcast from memory by the FMAs), x packed as xw[k * WS + r]. Why: 9-14 rows took two 8-row
 * tiles over each panel group, the second one's FMAs adding to the group's memory time; one tile covers
 * them in the pass that reads the weights, as 1-8 rows are covered. Its share of the next panel pair is
 * spread as runs (`spread`). Measured as the runs above: 9-14 rows 18.8-20.9 -> 16.4-17.8 ms a step's
 * linears (8 rows: 16.5). The k sums are in the same order as gemm512_tile's: y is bitwise the same. */
#define WM 14
#define WS 16
#ifndef WIDE_MAX
#define WIDE_MAX 14
#endif
static inline __attribute__((always_inline)) void wide_tile(const float *xw, int64_t K, const float *w, int64_t pstride,
                                                            int mr, int np, float *y, int64_t N, int64_t n0,
                                                            const float *bias, const char *pf, int64_t npf) {
    __m512 acc[WM][2];
#pragma GCC unroll 14
    for (int r = 0; r < WM; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float *w1 = w + pstride;
    const int64_t run = npf / KVF_PREFETCH_RUNS;
    int64_t due = 0, slot = 0, pos = 0;
    for (int64_t k = 0; k < K; k++) {
#if KVF_GEMM_PREFETCH
        spread(pf, npf, K, KVF_PREFETCH_RUNS, run, &due, &slot, &pos);
#endif
        const __m512 w0v = _mm512_loadu_ps(w + k * NR);
        const __m512 w1v = np > 1 ? _mm512_loadu_ps(w1 + k * NR) : w0v;
#pragma GCC unroll 14
        for (int r = 0; r < mr; r++) {
            const __m512 a = _mm512_set1_ps(xw[k * WS + r]);
            acc[r][0] = _mm512_fmadd_ps(a, w0v, acc[r][0]);
            if (np > 1) acc[r][1] = _mm512_fmadd_ps(a, w1v, acc[r][1]);
        }
    }
#pragma GCC unroll 2
    for (int p = 0; p < np; p++) {
        const int64_t c0 = n0 + p * NR, nv = N - c0 < NR ? N - c0 : NR;
        if (nv <= 0) break;
        const __mmask16 m = (__mmask16)((1u << nv) - 1u);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + c0) : _mm512_setzero_ps();
#pragma GCC unroll 14
        for (int r = 0; r < mr; r++)
            _mm512_mask_storeu_ps(y + r * N + c0, m, bias ? _mm512_add_ps(acc[r][p], b) : acc[r][p]);
    }
}

/* One specialised copy per (rows, panels), as gemm512_block. */
static void wide_block(const float *xw, int64_t K, const float *w, int64_t pstride, int mr, int np, float *y,
                       int64_t N, int64_t n0, const float *bias, const char *pf, int64_t npf) {
#define KVF_WIDE_CASE(R)                                                            \
    case R:                                                                         \
        if (np > 1)                                                                 \
            wide_tile(xw, K, w, pstride, R, 2, y, N, n0, bias, pf, npf);            \
        else                                                                        \
            wide_tile(xw, K, w, pstride, R, 1, y, N, n0, bias, pf, npf);            \
        break;
    switch (mr) {
        KVF_WIDE_CASE(9) KVF_WIDE_CASE(10) KVF_WIDE_CASE(11) KVF_WIDE_CASE(12) KVF_WIDE_CASE(13) KVF_WIDE_CASE(14)
    default: break;
    }
#undef KVF_WIDE_CASE
}

/* The wide tile's rows: xw[k * WS + r] (columns past M are never read). */
static void pack_wide(const float *x, int64_t M, int64_t K, float *xw) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t k = 0; k < K; k++) xw[k * WS + r] = x[r * K + k];
}

/* x rows [i, i + mr) as one tile of GM interleaved rows, xp[k * GM + r] (rows past mr are zeros): the tile
 * then reads one sequential stream of x with one pointer, where 8 row pointers spilled out of registers. */
static void pack_rows(const float *x, int64_t K, int mr, float *xp) {
    int64_t k = 0;
    if (mr == GM) {
        for (; k + 8 <= K; k += 8) {
            __m256 r0 = _mm256_loadu_ps(x + 0 * K + k), r1 = _mm256_loadu_ps(x + 1 * K + k);
            __m256 r2 = _mm256_loadu_ps(x + 2 * K + k), r3 = _mm256_loadu_ps(x + 3 * K + k);
            __m256 r4 = _mm256_loadu_ps(x + 4 * K + k), r5 = _mm256_loadu_ps(x + 5 * K + k);
            __m256 r6 = _mm256_loadu_ps(x + 6 * K + k), r7 = _mm256_loadu_ps(x + 7 * K + k);
            __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
            __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
            __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
            __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
            __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float *o = xp + k * GM;
            _mm256_storeu_ps(o + 0 * GM, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(o + 1 * GM, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(o + 2 * GM, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(o + 3 * GM, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(o + 4 * GM, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(o + 5 * GM, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(o + 6 * GM, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(o + 7 * GM, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
    }
    for (; k < K; k++)
        for (int r = 0; r < GM; r++) xp[k * GM + r] = r < mr ? x[r * K + k] : 0.0f;
}

/* This thread's packing buffer, kept between calls (OpenMP threads persist) and grown as needed. */
static float *pack_buffer(int64_t floats) {
    static __thread float *buf;
    static __thread int64_t cap;
    if (floats > cap) {
        free(buf);
        cap = floats;
        buf = (float *)aligned_alloc(64, (size_t)((cap * (int64_t)sizeof(float) + 63) / 64 * 64));
        if (!buf) cap = 0;
    }
    return buf;
}

/* Rows a pass over the thread's panels takes: a chunk whose x fits in L2 beside the panel group (see
 * GEMM_X_BYTES), whole tiles of GM rows. */
static int64_t rows_per_pass(int64_t M, int64_t K) {
    const int64_t mc = GEMM_X_BYTES > 0 ? GEMM_X_BYTES / (K * (int64_t)sizeof(float)) : M;
    return mc < 4 * GM ? 4 * GM : mc - mc % GM;
}

/* x rows [m0, me) as the pass's tiles of GM interleaved rows (`pack_rows`). */
static void pack_pass(const float *x, int64_t K, int64_t m0, int64_t me, float *xp) {
    for (int64_t i = m0, t = 0; i < me; i += GM, t++)
        pack_rows(x + i * K, K, (int)(me - i < GM ? me - i : GM), xp + t * GM * K);
}

/* Lines of the group of `g` panels after the one at p (up to p1), which this group's tiles prefetch
 * (contiguous: panels lie one after another). */
static int64_t next_group_lines(int64_t p, int64_t p1, int64_t g, int64_t K) {
    const int64_t next = p + g < p1 ? (p1 - p - g < g ? p1 - p - g : g) : 0;
    return next * K * NR * (int64_t)sizeof(float) / 64;
}

/* How a pass's `tiles` row tiles spread their shares of the next group (see KVF_GEMM_PREFETCH_EVEN). */
static int spread_mode_for(int64_t tiles) {
    return !KVF_GEMM_PREFETCH_EVEN || tiles < 2 || tiles > 16 ? KVF_UP_FRONT
           : tiles <= 8 && KVF_PREFETCH_RUNS > 1              ? KVF_EVEN_RUNS
           : tiles >= 4                                       ? KVF_EVEN
                                                              : KVF_UP_FRONT;
}
#endif

void kvf_panel_linear(const float *x, int64_t M, int64_t K, const float *wp, int64_t N, const float *bias,
                      float *y, int nthreads) {
    const int64_t P = (N + NR - 1) / NR;
    const int64_t panel_floats = K * NR;
    int64_t chunk = L2_PANEL_BYTES / (panel_floats * (int64_t)sizeof(float));
    if (chunk < 1) chunk = 1;
    const int64_t kc = M > MR && K > KC ? KC : K;
    int64_t mc = L2_X_BYTES / (kc * (int64_t)sizeof(float));
    mc = mc < MR ? MR : mc - mc % MR;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > P) nthreads = (int)P;
#pragma omp parallel num_threads(nthreads)
    {
        KVF_TEAM(tid, nth);
        const int64_t p0 = P * tid / nth;
        int64_t p1 = P * (tid + 1) / nth;
#if KVF_SIMD && defined(__AVX512F__)
        if (M > GM && M <= WIDE_MAX && M <= WM) {
            /* 9-14 rows: one wide tile a panel pair; the next pair's lines spread over its k loop */
            float *xw = pack_buffer(WS * K);
            if (xw) {
                pack_wide(x, M, K, xw);
                for (int64_t p = p0; p < p1; p += 2) {
                    const int np = (int)(p1 - p < 2 ? p1 - p : 2);
                    const int64_t lines = next_group_lines(p, p1, 2, K);
                    wide_block(xw, K, wp + p * panel_floats, panel_floats, (int)M, np, y, N, p * NR, bias,
                               (const char *)(wp + (p + 2) * panel_floats), lines);
                }
                p1 = p0; /* done: skip the loops below */
            }
        } else if (M >= GEMM512_MIN) {
            const int64_t mc = rows_per_pass(M, K);
            float *xp = pack_buffer(((mc < M ? mc : M) + GM) * K); /* NULL: no memory, the AVX2 loop runs */
            for (int64_t m0 = 0; m0 < M && xp; m0 += mc) {
                const int64_t me = m0 + mc < M ? m0 + mc : M;
                const int64_t tiles = (me - m0 + GM - 1) / GM;
                pack_pass(x, K, m0, me, xp);
                const int spread_mode = spread_mode_for(tiles);
                for (int64_t p = p0; p < p1; p += GP) {
                    const int np = (int)(p1 - p < GP ? p1 - p : GP);
                    /* the next panel group, its lines shared out among this group's row tiles */
                    const char *pf = (const char *)(wp + (p + GP) * panel_floats);
                    const int64_t lines = next_group_lines(p, p1, GP, K);
                    for (int64_t i = m0, t = 0; i < me; i += GM, t++) {
                        const int mr = (int)(me - i < GM ? me - i : GM);
                        const int64_t l0 = lines * t / tiles, l1 = lines * (t + 1) / tiles;
                        gemm512_block(xp + t * GM * K, K, wp + p * panel_floats, panel_floats, mr, np, y + i * N, N,
                                      p * NR, bias, pf + 64 * l0, l1 - l0,
                                      spread_mode);
                    }
                }
            }
            if (xp) p1 = p0; /* done: skip the AVX2 loop below */
        }
#endif
        float out[MR * NR];
        for (int64_t pc = p0; pc < p1; pc += chunk) {
            const int64_t pe = pc + chunk < p1 ? pc + chunk : p1;
            for (int64_t m0 = 0; m0 < M; m0 += mc) {
                const int64_t me = m0 + mc < M ? m0 + mc : M;
                for (int64_t k0 = 0; k0 < K; k0 += kc) {
                    const int64_t kn = k0 + kc < K ? kc : K - k0;
                    for (int64_t p = pc; p < pe; p++) {
                        const float *w = wp + p * panel_floats + k0 * NR;
                        for (int64_t i = m0; i < me; i += MR) {
                            const int mr = (int)(me - i < MR ? me - i : MR);
                            /* the first tile over a panel reads it from memory: prefetch ahead there only */
                            tile(x + i * K + k0, K, kn, w, mr, out, M >= 2 && i == 0 ? PREFETCH_LINES * NR : 0);
                            store(out, mr, y + i * N, N, p * NR, bias, k0 > 0);
                        }
                    }
                }
            }
        }
    }
}

/* h[M, I] = silu(x @ Wg^T) * (x @ Wu^T) on a packed gate|up weight (N2 = 2I rows: gate then up), I a
 * multiple of NR. Why: a prefill chunk's gate|up output (1,024 x 3,072 floats, 12.6 MB) went out to memory
 * and came back for SiLU-and-multiply, a pass that took ~1 ms a layer; here each row tile's gate and up
 * columns stay in a 1.5 KiB scratch and only h (half the bytes) is written. The same GEMM tiles in the same
 * k order and the same SiLU expression as fused_ops.c's kvf_silu_mul (x / (1 + exp(-x)) * u, 16 lanes of
 * libmvec's expf at a time): h is bitwise what the two calls give. Returns 1, or 0 where it cannot run (no
 * AVX-512, I not whole panels, no memory): the caller then makes the two calls. */
#if KVF_SIMD && defined(__AVX512F__)
static inline __attribute__((always_inline)) void silu_mul16(const float *g, const float *u, float *h) {
#pragma omp simd simdlen(16)
    for (int c = 0; c < 16; c++) h[c] = g[c] / (1.f + expf(-g[c])) * u[c];
}
#endif

int kvf_panel_linear_silu_mul(const float *x, int64_t M, int64_t K, const float *wp, int64_t N2, float *h,
                              int nthreads) {
#if KVF_SIMD && defined(__AVX512F__)
    const int64_t I = N2 / 2, Pg = I / NR, panel_floats = K * NR;
    if (M < 1 || K < 1 || I < NR || I % NR || N2 % 2) return 0;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > Pg) nthreads = (int)Pg;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        KVF_TEAM(tid, nth);
        /* this thread's gate panels [p0, p1) and their up panels [Pg + p0, Pg + p1) */
        const int64_t p0 = Pg * tid / nth, p1 = Pg * (tid + 1) / nth;
        const int64_t mc = rows_per_pass(M, K);
        float *xp = pack_buffer(((mc < M ? mc : M) + GM) * K);
        float gate[GM * GP * NR] __attribute__((aligned(64))), up[GM * GP * NR] __attribute__((aligned(64)));
        if (!xp) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M && xp; m0 += mc) {
            const int64_t me = m0 + mc < M ? m0 + mc : M;
            const int64_t tiles = (me - m0 + GM - 1) / GM;
            pack_pass(x, K, m0, me, xp);
            const int spread_mode = spread_mode_for(tiles);
            for (int64_t p = p0; p < p1; p += GP) {
                const int np = (int)(p1 - p < GP ? p1 - p : GP);
                /* the next gate and up groups, each tile a share of each (as kvf_panel_linear) */
                const char *pf_gate = (const char *)(wp + (p + GP) * panel_floats);
                const char *pf_up = (const char *)(wp + (Pg + p + GP) * panel_floats);
                const int64_t lines = next_group_lines(p, p1, GP, K);
                for (int64_t i = m0, t = 0; i < me; i += GM, t++) {
                    const int mr = (int)(me - i < GM ? me - i : GM);
                    const int64_t l0 = lines * t / tiles, l1 = lines * (t + 1) / tiles;
                    gemm512_block(xp + t * GM * K, K, wp + p * panel_floats, panel_floats, mr, np, gate, GP * NR, 0,
                                  NULL, pf_gate + 64 * l0, l1 - l0, spread_mode);
                    gemm512_block(xp + t * GM * K, K, wp + (Pg + p) * panel_floats, panel_floats, mr, np, up, GP * NR,
                                  0, NULL, pf_up + 64 * l0, l1 - l0, spread_mode);
                    for (int r = 0; r < mr; r++)
                        for (int c = 0; c < np * NR; c += 16)
                            silu_mul16(gate + r * GP * NR + c, up + r * GP * NR + c, h + (i + r) * I + p * NR + c);
                }
            }
        }
    }
    return !failed;
#else
    (void)x, (void)M, (void)K, (void)wp, (void)N2, (void)h, (void)nthreads;
    return 0;
#endif
}
