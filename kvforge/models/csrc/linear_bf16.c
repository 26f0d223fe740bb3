/* bf16 y[M,N] = x[M,K] @ W^T (+ bias) for decode rows, on weights packed in column panels of k-pairs
 * (kvforge/models/panel_linear.py, `pack_panels_bf16`).
 *
 * Why: a decode step multiplies a few rows by every weight matrix, so its speed is how fast the weights
 * stream from memory. oneDNN's packed bf16 kernels are built for GEMM and read a decode step's weights at
 * well under the machine's bandwidth. Here a weight [N, K] is re-laid out once, at load, as panels of NR (16)
 * output columns; inside a panel the k dimension goes in pairs, [K/2][NR][2] bf16, because AVX512-BF16's
 * `vdpbf16ps` multiplies a pair of bf16 values per lane and adds both products to an fp32 accumulator. One
 * panel line (k-pair) is one 64-byte cache line and one zmm register: each thread reads its share of the
 * weights as one sequential stream, and every loaded line serves all M rows at once.
 *
 * Accumulation is in fp32 and the result is rounded to bf16 once (round to nearest even), as oneDNN does.
 * Threads split the panels statically. N is padded to whole panels and K to an even count with zeros in
 * the packed weight; only the first N columns are written. Any M >= 1 goes in GEMM tiles of 8 rows x 3
 * panels (below; decode rows too, see BF16_GEMM_MIN), which beat oneDNN's packed bf16 kernels from 5 to
 * 1,024 rows on this project's shapes on the AVX-512 CPUs without AMX measured here
 * (benchmarks/linear_kernels.py --panel --dtype bfloat16); where the CPU has AMX, AMX tiles on the same
 * layout (amx_gemm) run more than MR rows instead. The decode tile (up to MR rows, one panel at a time)
 * serves -DBF16_GEMM_MIN=5 builds and the plain-C build.
 *
 * AVX512-BF16 intrinsics where the compiler targets them; otherwise a plain-C loop over the same layout
 * (bf16 -> fp32 by a 16-bit shift, fp32 multiply-add), so the layout and the results hold on any CPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvf_amx.h"
#include "kvf_bf16.h"
#include "kvf_omp.h"
#include "kvf_steal.h" /* panel groups handed out from both ends */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVF_SIMD 1
#else
#define KVF_SIMD 0
#endif
/* AMX (Sapphire Rapids and later Xeons) where the compiler targets it: see amx_gemm below. */
#if KVF_SIMD && KVF_AMX_BUILT && !defined(KVF_NO_AMX)
#define KVF_AMX 1
#else
#define KVF_AMX 0
#endif

#define NR 16 /* output columns per panel: one zmm of fp32 accumulators */
#define MR 4  /* rows per tile: 4 rows x 4 k-pair accumulator sets = 16 accumulators */

int kvf_panel_bf16_nr(void) { return NR; }
int kvf_panel_bf16_simd(void) { return KVF_SIMD; }

/* One tile: `mr` rows of x (padded to K2 pairs, as uint32 pairs) against one panel -> fp32 out[mr][NR]. */
#if KVF_SIMD
static inline __attribute__((always_inline)) void tile(const uint32_t *x, int64_t ldx, int64_t K2,
                                                       const uint16_t *w, int mr, float *out) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; r++)
        for (int u = 0; u < 4; u++) acc[r][u] = _mm512_setzero_ps();
    int64_t kp = 0;
    /* four independent accumulators per row over consecutive k-pairs hide vdpbf16ps's latency */
    for (; kp + 4 <= K2; kp += 4) {
        const uint16_t *wk = w + kp * 2 * NR;
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 2 * NR);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 4 * NR), w3 = (__m512bh)_mm512_loadu_si512(wk + 6 * NR);
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            const uint32_t *xr = x + r * ldx + kp;
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_set1_epi32((int)xr[0]), w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_set1_epi32((int)xr[1]), w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], (__m512bh)_mm512_set1_epi32((int)xr[2]), w2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], (__m512bh)_mm512_set1_epi32((int)xr[3]), w3);
        }
    }
    for (; kp < K2; kp++) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kp * 2 * NR);
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_set1_epi32((int)x[r * ldx + kp]), w0);
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
        _mm512_storeu_ps(out + r * NR,
                         _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}
#else
static void tile(const uint32_t *x, int64_t ldx, int64_t K2, const uint16_t *w, int mr, float *out) {
    float acc[MR][NR];
    memset(acc, 0, sizeof acc);
    for (int64_t kp = 0; kp < K2; kp++) {
        const uint16_t *wk = w + kp * 2 * NR;
        for (int r = 0; r < mr; r++) {
            const uint32_t pair = x[r * ldx + kp];
            const float a0 = bf16_to_f32((uint16_t)(pair & 0xffffu)), a1 = bf16_to_f32((uint16_t)(pair >> 16));
            for (int j = 0; j < NR; j++) acc[r][j] += a0 * bf16_to_f32(wk[2 * j]) + a1 * bf16_to_f32(wk[2 * j + 1]);
        }
    }
    for (int r = 0; r < mr; r++) memcpy(out + r * NR, acc[r], sizeof acc[r]);
}
#endif

#if KVF_SIMD
/* GEMM rows (M > MR): a register tile of up to GM rows x GP panels (8 x 3 = 24 accumulators, 3 weight
 * lines and one broadcast: 28 of 32 zmm). Each k-pair's 3 weight lines serve 8 rows, and each row's
 * broadcast pair serves 48 columns, so loads stay far below the vdpbf16ps rate; 24 independent chains
 * cover its latency. The panel group (3 x K/2 x 64 B) is re-read from L2 by each row tile. Results are
 * rounded to bf16 in registers (the same round-to-nearest-even as f32_to_bf16, bit for bit, NaN
 * included) and stored 16 columns at a time, so the conversion costs no scalar loop. */
#define GM 8
#define GP 3
/* Row tiles prefetch the next panel group into L2 while they multiply this one (as linear_f32.c does):
 * a batch's decode step then overlaps its weight reads with its arithmetic. Below KVF_GEMM_PF_MIN_ROWS
 * rows, on long panels (K2 >= KVF_GEMM_PF_LONG_K2 k-pairs), they do not: a group is then one row tile,
 * one long sequential read the hardware prefetcher follows by itself, and the instructions only cost.
 * The 1B preset's four linears (K = 2,048 and 8,192) on Zen 4, both threads, builds interleaved in one
 * process (medians of 11-15 rounds): without the prefetch 1.04-1.12x at 1-4 rows, 0.96-0.99x at 8,
 * 0.93-1.00x at 16. The default model's short panels (K = 576 and 1,536) lost 4-11% without it at 2-6
 * rows, so they keep it (benchmarks/results/2026-12-07_bf16_gemm_prefetch_rows_k_chunks_ab.txt). */
#ifndef KVF_GEMM_PREFETCH
#define KVF_GEMM_PREFETCH 1
#endif
#ifndef KVF_GEMM_PF_MIN_ROWS
#define KVF_GEMM_PF_MIN_ROWS 8
#endif
#ifndef KVF_GEMM_PF_LONG_K2
#define KVF_GEMM_PF_LONG_K2 1024
#endif
/* Rows from which the GEMM tiles run, in the kind measured at load (AMX, vdpbf16ps or fp32 FMAs). Decode
 * rows (1-4) take them too: on the 2-core AMX Xeon the tiles' next-group prefetch read one decode step's
 * weights (269 MB) at ~26-28 GB/s where the decode tile below, one panel at a time without it, reached
 * ~16-22: the step's linears 12.1-13.5 -> 9.6-9.8 ms at 1 row, 17.1 -> 10.4 at 4 (AMX; 12.8 on the dot
 * tiles). -DBF16_GEMM_MIN=5 gives the old split for an A/B; builds without AVX512-BF16 keep the plain-C
 * tile. */
#ifndef BF16_GEMM_MIN
#define BF16_GEMM_MIN 1
#endif

static inline __attribute__((always_inline)) void zero_tile(__m512 acc[GM][GP]) {
#pragma GCC unroll 8
    for (int r = 0; r < GM; r++)
#pragma GCC unroll 3
        for (int p = 0; p < GP; p++) acc[r][p] = _mm512_setzero_ps();
}

/* The lines a tile prefetches: the next k chunk of a panel group is a run of lines in each of its panels, a
 * panel stride apart (one contiguous stretch without k chunks). The group's row tiles share the runs taken
 * one after the other, each tile a stretch of `n` lines: `cur` the next, `run_end` where its run ends,
 * `jump` from there to the next run. Why in that order: the tiles then walk the next group front to back as
 * one stream, which the hardware prefetcher extends; a share of every run at once measured 0.91-0.96x at
 * 12-16 rows. */
typedef struct {
    const char *cur, *run_end;
    int64_t jump, n;
} kvf_pf;

/* The locality hint of those prefetches: into L2 (T1; T2 measured the same, T0 0.80-0.93x at 1-16 rows). */
#ifndef KVF_PF_HINT
#define KVF_PF_HINT _MM_HINT_T1
#endif
/* Step k of a tile's share (`per_k` lines a step); `stride`: bytes between the runs. */
static inline __attribute__((always_inline)) void prefetch_share(kvf_pf *pf, int64_t stride, int64_t per_k,
                                                                 int64_t k) {
#if KVF_GEMM_PREFETCH
    for (int64_t j = k * per_k; j < (k + 1) * per_k && j < pf->n; j++) {
        _mm_prefetch(pf->cur, KVF_PF_HINT);
        pf->cur += 64;
        if (pf->cur == pf->run_end) pf->cur += pf->jump, pf->run_end += stride;
    }
#else
    (void)pf, (void)stride, (void)per_k, (void)k;
#endif
}

/* How many of a tile's k-pairs carry its prefetch share, `per_k` lines each: the first ones only. Why: a
 * prefill's row tiles are many, so each tile's share is a few lines, yet testing every k-pair for one cost
 * the tiles 5-7% at 128-1,024 rows (the share's bounds took registers the row pointers needed). The tiles
 * run those k-pairs with the prefetch and the rest bare, so batch decode keeps its overlap (16-32 rows) and
 * prefill loses the bookkeeping. */
static inline int64_t prefetch_steps(int64_t npf, int64_t K2, int64_t *per_k) {
    *per_k = (npf + K2 - 1) / K2;
    return KVF_GEMM_PREFETCH && *per_k ? (npf + *per_k - 1) / *per_k : 0;
}

/* A tile's accumulators (+ bias) rounded to bf16 and stored, 16 columns at a time (the first N - n0). */
static inline __attribute__((always_inline)) void store_tile(__m512 acc[GM][GP], int mr, int np, uint16_t *y,
                                                             int64_t N, int64_t n0, const uint16_t *bias) {
#pragma GCC unroll 3
    for (int p = 0; p < np; p++) {
        const int64_t c0 = n0 + p * NR, nv = N - c0 < NR ? N - c0 : NR;
        if (nv <= 0) break;
        const __mmask16 m = (__mmask16)((1u << nv) - 1u);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + c0)), 16));
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const __m512 v = bias ? _mm512_add_ps(acc[r][p], b) : acc[r][p];
            _mm256_mask_storeu_epi16(y + r * N + c0, m, f32x16_to_bf16(v));
        }
    }
}

/* One k-pair of a vdpbf16ps tile: np weight lines, each against mr broadcast x pairs. */
static inline __attribute__((always_inline)) void dot_step(__m512 acc[GM][GP], const uint32_t *x, int64_t ldx,
                                                           const uint16_t *w, int64_t pstride, int mr, int np,
                                                           int64_t kp) {
    __m512bh wv[GP];
#pragma GCC unroll 3
    for (int p = 0; p < np; p++) wv[p] = (__m512bh)_mm512_loadu_si512(w + p * pstride + kp * 2 * NR);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x[r * ldx + kp]);
#pragma GCC unroll 3
        for (int p = 0; p < np; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], a, wv[p]);
    }
}

/* A tile's fp32 accumulators, unrounded, to out[r][p * NR + c] (GP x NR floats a row): the gated GEMM's
 * scratch (kvf_panel_linear_bf16_silu_mul). */
static inline __attribute__((always_inline)) void store_f32(__m512 acc[GM][GP], int mr, int np, float *out) {
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int p = 0; p < np; p++) _mm512_store_ps(out + (r * GP + p) * NR, acc[r][p]);
}

/* A tile's accumulators from an earlier k chunk's store_f32 (the same layout): the sums go on exactly as
 * in one pass over K, so chunked results are bitwise the unchunked ones. */
static inline __attribute__((always_inline)) void load_f32(__m512 acc[GM][GP], int mr, int np, const float *in) {
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int p = 0; p < np; p++) acc[r][p] = _mm512_load_ps(in + (r * GP + p) * NR);
}

static inline __attribute__((always_inline)) void gemm_tile(const uint32_t *x, int64_t ldx, int64_t K2,
                                                            const uint16_t *w, int64_t pstride, int mr, int np,
                                                            uint16_t *y, int64_t N, int64_t n0,
                                                            const uint16_t *bias, kvf_pf pf, const float *f32in,
                                                            float *f32out) {
    __m512 acc[GM][GP];
    if (f32in) load_f32(acc, mr, np, f32in);
    else zero_tile(acc);
    int64_t per_k; /* prefetched lines of the next panel group per k-pair, over the first `steps` k-pairs */
    const int64_t steps = prefetch_steps(pf.n, K2, &per_k);
    for (int64_t kp = 0; kp < steps; kp++) {
        prefetch_share(&pf, 2 * pstride, per_k, kp);
        dot_step(acc, x, ldx, w, pstride, mr, np, kp);
    }
    for (int64_t kp = steps; kp < K2; kp++) dot_step(acc, x, ldx, w, pstride, mr, np, kp);
    if (f32out) store_f32(acc, mr, np, f32out);
    else store_tile(acc, mr, np, y, N, n0, bias);
}

/* The same tile on fp32 FMAs. Why: AVX512-BF16's `vdpbf16ps` is not the fastest way to multiply bf16 on
 * every CPU that has it. Zen 4 retires one a cycle (32 products, twice its fp32 FMA rate), but the Intel
 * Xeons measured here retire one every ~2 cycles while issuing two fp32 FMAs a cycle: there a bf16 GEMM
 * runs 1.2-1.6x faster widened to fp32. A weight line (k-pair kp of 16 columns) splits into its even-k and
 * odd-k halves by one shift and one AND (a bf16 is the top half of its fp32), and x comes in widened
 * once per call (`xf`, [M][2 x K2] floats), so each weight register serves GM rows and each broadcast
 * GP panels as above: 6 integer ops per 48 FMAs. Every product is exact in fp32 (8-bit mantissas), as in
 * vdpbf16ps; only the order of the fp32 additions differs (even k then odd k, per accumulator). One k-pair
 * of it: np weight lines split into even and odd k, each against mr broadcast x values. */
static inline __attribute__((always_inline)) void fma_step(__m512 acc[GM][GP], const float *xf, int64_t ldx,
                                                           const uint16_t *w, int64_t pstride, int mr, int np,
                                                           int64_t kp, __m512i hi_mask) {
    __m512i line[GP];
    __m512 wv[GP];
#pragma GCC unroll 3
    for (int p = 0; p < np; p++) {
        line[p] = _mm512_loadu_si512(w + p * pstride + kp * 2 * NR);
        wv[p] = _mm512_castsi512_ps(_mm512_slli_epi32(line[p], 16)); /* even k */
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        const __m512 a = _mm512_set1_ps(xf[r * ldx + 2 * kp]);
#pragma GCC unroll 3
        for (int p = 0; p < np; p++) acc[r][p] = _mm512_fmadd_ps(a, wv[p], acc[r][p]);
    }
#pragma GCC unroll 3
    for (int p = 0; p < np; p++) wv[p] = _mm512_castsi512_ps(_mm512_and_si512(line[p], hi_mask)); /* odd k */
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        const __m512 a = _mm512_set1_ps(xf[r * ldx + 2 * kp + 1]);
#pragma GCC unroll 3
        for (int p = 0; p < np; p++) acc[r][p] = _mm512_fmadd_ps(a, wv[p], acc[r][p]);
    }
}

static inline __attribute__((always_inline)) void gemm_tile_fma(const float *xf, int64_t ldx, int64_t K2,
                                                                const uint16_t *w, int64_t pstride, int mr, int np,
                                                                uint16_t *y, int64_t N, int64_t n0,
                                                                const uint16_t *bias, kvf_pf pf, const float *f32in,
                                                                float *f32out) {
    __m512 acc[GM][GP];
    if (f32in) load_f32(acc, mr, np, f32in);
    else zero_tile(acc);
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    int64_t per_k; /* as in gemm_tile */
    const int64_t steps = prefetch_steps(pf.n, K2, &per_k);
    for (int64_t kp = 0; kp < steps; kp++) {
        prefetch_share(&pf, 2 * pstride, per_k, kp);
        fma_step(acc, xf, ldx, w, pstride, mr, np, kp, hi_mask);
    }
    for (int64_t kp = steps; kp < K2; kp++) fma_step(acc, xf, ldx, w, pstride, mr, np, kp, hi_mask);
    if (f32out) store_f32(acc, mr, np, f32out);
    else store_tile(acc, mr, np, y, N, n0, bias);
}

/* Which GEMM tile this CPU runs faster, measured once: 12 independent chains of each instruction, best
 * of several short rounds (~0.1 ms each). FMA wins when its fp32 products come at least 1.25x as fast
 * as vdpbf16ps's, the margin covering its 6 integer ops per 48 FMAs. */
static double chain_seconds(int fma) {
    __m512 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i * 1e-9f);
    const __m512 b = _mm512_set1_ps(1.0f), c = _mm512_set1_ps(1e-9f);
    const __m512bh qb = (__m512bh)_mm512_set1_epi16(0x3f80), kb = (__m512bh)_mm512_set1_epi16(0x3000);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int n = 0; n < 4000; n++) {
        if (fma) {
#pragma GCC unroll 12
            for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
        } else {
#pragma GCC unroll 12
            for (int i = 0; i < 12; i++) a[i] = _mm512_dpbf16_ps(a[i], qb, kb);
        }
        __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]), "+v"(a[5]), "+v"(a[6]),
                         "+v"(a[7]), "+v"(a[8]), "+v"(a[9]), "+v"(a[10]), "+v"(a[11]));
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}

static int measured_mode(void) {
    double dot = 1e9, fma = 1e9;
    for (int round = 0; round < 7; round++) {
        const double d = chain_seconds(0), f = chain_seconds(1);
        if (d < dot) dot = d;
        if (f < fma) fma = f;
    }
    /* per product: a vdpbf16ps does 32, an FMA 16 */
    return (dot / 32.0) >= 1.25 * (fma / 16.0) ? 1 : 0;
}
#endif

#if KVF_AMX
/* GEMM rows on AMX tiles. Why: where a Xeon has AMX, its tile unit multiplies bf16 at several times the
 * vector units' rate (`tdpbf16ps`: a 16 x 16 fp32 tile += 16 x 32 bf16 by 32 x 16 bf16), and the panel
 * layout is already AMX's operand layout: a panel's 16 consecutive k-pairs are 16 lines of 16 columns x 2
 * bf16, exactly one B tile (64-byte rows), so the weights are read where they lie. x rows are the A tiles
 * (16 rows x 32 k, the row stride of x). Each call step multiplies 32 rows by 2 panels (four C tiles, two
 * A and two B tiles: all eight tile registers), over the whole of K, then rounds the fp32 tiles to bf16
 * as the vector tiles do (same rounding, bias added in fp32). Rows go in chunks of AMX_MC so a chunk's
 * x stays in L2 while every panel of the thread's share streams past it. The tile unit accumulates each
 * k-pair's two products before adding them (flushing fp32 denormals): results agree with the vector
 * tiles to fp32 rounding, not bit for bit. Linux grants the tile state per process
 * (arch_prctl ARCH_REQ_XCOMP_PERM); where it refuses, the vector tiles run. */
#define AMX_MC 256
/* The tile configuration and the permission request: kvf_amx.h (shared with the attention prefill). */
static void amx_configure(void) {
    kvf_amx_config cfg;
    kvf_amx_config_full(&cfg);
    _tile_loadconfig(&cfg);
}

/* Rows i..i+15 of x as an A tile's source: x itself, or `tail` (the last M % 16 rows, zero-padded). */
static inline const char *amx_rows(const uint32_t *x, int64_t K2, int64_t M, int64_t i, const uint32_t *tail) {
    return i + 16 <= M ? (const char *)(x + i * K2) : (const char *)tail;
}

/* Round a C tile's fp32 rows (+ bias) to bf16 and store the first `mr` rows' valid columns. */
static inline void amx_store(const float *c, int mr, uint16_t *y, int64_t N, int64_t c0, const uint16_t *bias) {
    const int64_t nv = N - c0 < NR ? N - c0 : NR;
    if (nv <= 0) return;
    const __mmask16 m = (__mmask16)((1u << nv) - 1u);
    __m512 b = _mm512_setzero_ps();
    if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + c0)), 16));
    for (int r = 0; r < mr; r++) {
        const __m512 v = _mm512_loadu_ps(c + r * NR);
        _mm256_mask_storeu_epi16(y + r * N + c0, m, f32x16_to_bf16(bias ? _mm512_add_ps(v, b) : v));
    }
}

/* This thread's panels [p0, p1) for all M rows; K2 is a multiple of 16. */
static void amx_gemm(const uint32_t *x, int64_t M, int64_t K2, const uint16_t *wp, int64_t panel_elems, int64_t p0,
                     int64_t p1, uint16_t *y, int64_t N, const uint16_t *bias, const uint32_t *tail) {
    amx_configure();
    float c[4][16 * NR] __attribute__((aligned(64)));
    const int64_t xs = K2 * 4; /* bytes per x row */
    for (int64_t i0 = 0; i0 < M; i0 += AMX_MC) {
        const int64_t i1 = i0 + AMX_MC < M ? i0 + AMX_MC : M;
        for (int64_t p = p0; p < p1; p += 2) {
            const int two = p + 1 < p1;
            const char *b0 = (const char *)(wp + p * panel_elems), *b1 = (const char *)(wp + (p + 1) * panel_elems);
            for (int64_t i = i0; i < i1; i += 32) {
                const int lower = i + 16 < i1; /* a second 16-row half */
                const char *a0 = amx_rows(x, K2, M, i, tail), *a1 = lower ? amx_rows(x, K2, M, i + 16, tail) : a0;
                const int64_t s0 = a0 == (const char *)tail ? K2 * 4 : xs, s1 = a1 == (const char *)tail ? K2 * 4 : xs;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < K2; kb += 16) {
                    _tile_loadd(4, a0 + kb * 4, s0);
                    _tile_loadd(6, b0 + kb * 64, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two) {
                        _tile_loadd(7, b1 + kb * 64, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (lower) {
                        _tile_loadd(5, a1 + kb * 4, s1);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, c[0], 64);
                if (two) _tile_stored(1, c[1], 64);
                if (lower) {
                    _tile_stored(2, c[2], 64);
                    if (two) _tile_stored(3, c[3], 64);
                }
                const int mr0 = (int)(M - i < 16 ? M - i : 16);
                amx_store(c[0], mr0, y + i * N, N, p * NR, bias);
                if (two) amx_store(c[1], mr0, y + i * N, N, (p + 1) * NR, bias);
                if (lower) {
                    const int mr1 = (int)(M - i - 16 < 16 ? M - i - 16 : 16);
                    amx_store(c[2], mr1, y + (i + 16) * N, N, p * NR, bias);
                    if (two) amx_store(c[3], mr1, y + (i + 16) * N, N, (p + 1) * NR, bias);
                }
            }
        }
    }
    _tile_release();
}
#endif

/* 1 where the AMX tiles can run here (built for AMX, and Linux granted the tile state). */
int kvf_panel_bf16_amx(void) {
#if KVF_AMX
    return kvf_amx_permitted();
#else
    return 0;
#endif
}

static int gemm_mode = -1; /* -1: not chosen yet; 0: vdpbf16ps tiles; 1: FMA tiles; 2: AMX tiles */

static int vector_mode = -1; /* the faster vector tile, measured once: 0 vdpbf16ps, 1 FMA */

/* Which vector tile this CPU runs faster (0 vdpbf16ps, 1 fp32 FMA), measured once; 0 without the SIMD path.
 * Why apart from the GEMM mode: calls the AMX tiles cannot take (K not whole 16-pair blocks) run this one,
 * and so does the attention kernel's vector bf16 prefill where AMX is off. */
int kvf_panel_bf16_fma_faster(void) {
#if KVF_SIMD
    if (vector_mode < 0) vector_mode = measured_mode();
    return vector_mode;
#else
    return 0;
#endif
}

/* The GEMM tile in use (0 vdpbf16ps, 1 fp32 FMA, 2 AMX): AMX where it runs, else the faster vector tile;
 * always 0 without the SIMD path. */
int kvf_panel_bf16_gemm_mode(void) {
    if (gemm_mode < 0) gemm_mode = kvf_panel_bf16_amx() ? 2 : kvf_panel_bf16_fma_faster();
    return gemm_mode;
}

/* Force the GEMM tile (0, 1, or 2 where AMX runs; -1 chooses again). Why: A/B benchmarks and tests of
 * every path. Returns the mode now in use (AMX asked for where it cannot run leaves the choice as it was). */
int kvf_panel_bf16_set_gemm_mode(int mode) {
    if (mode >= 2 && !kvf_panel_bf16_amx()) return kvf_panel_bf16_gemm_mode();
    gemm_mode = mode < 0 ? -1 : (mode > 2 ? 2 : mode);
    return kvf_panel_bf16_gemm_mode();
}

#if KVF_SIMD
/* One specialised copy per (rows, panels), so every accumulator loop is unrolled into registers. */
static void gemm_block(const uint32_t *x, const float *xf, int64_t ldx, int64_t kc, const uint16_t *w,
                       int64_t pstride, int mr, int np, uint16_t *y, int64_t N, int64_t n0, const uint16_t *bias,
                       kvf_pf pf, const float *f32in, float *f32out) {
#define KVF_GEMM_CASE(R, P)                                                                               \
    case (R) * 4 + (P):                                                                                   \
        if (xf) gemm_tile_fma(xf, 2 * ldx, kc, w, pstride, R, P, y, N, n0, bias, pf, f32in, f32out);      \
        else gemm_tile(x, ldx, kc, w, pstride, R, P, y, N, n0, bias, pf, f32in, f32out);                   \
        break;
#define KVF_GEMM_ROW(R) KVF_GEMM_CASE(R, 1) KVF_GEMM_CASE(R, 2) KVF_GEMM_CASE(R, 3)
    switch (mr * 4 + np) {
        KVF_GEMM_ROW(1) KVF_GEMM_ROW(2) KVF_GEMM_ROW(3) KVF_GEMM_ROW(4)
        KVF_GEMM_ROW(5) KVF_GEMM_ROW(6) KVF_GEMM_ROW(7) KVF_GEMM_ROW(8)
    default: break;
    }
#undef KVF_GEMM_ROW
#undef KVF_GEMM_CASE
}
#endif

#if KVF_SIMD
/* x's padded rows (M x 2K2 bf16 in k order) widened to fp32 for the FMA tiles, each by a 16-bit shift; NULL
 * where there is no memory for them (the dot tiles then run: the same products). */
static float *widen_rows(const uint32_t *xp, int64_t M, int64_t K2) {
    float *xf = (float *)aligned_alloc(64, (size_t)((M * 2 * K2 * sizeof(float) + 63) / 64 * 64));
    if (!xf) return NULL;
    const uint16_t *src = (const uint16_t *)xp;
    const int64_t total = M * 2 * K2;
    for (int64_t e = 0; e < total; e += 16) {
        const __mmask16 m = (__mmask16)(total - e >= 16 ? 0xffffu : (1u << (total - e)) - 1u);
        const __m512i v = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src + e)), 16);
        _mm512_mask_storeu_ps(xf + e, m, _mm512_castsi512_ps(v));
    }
    return xf;
}
#endif

#if KVF_SIMD
static inline __attribute__((always_inline)) void silu_mul_bf16x16(const uint16_t *g, const float *u, uint16_t *h) {
#pragma omp simd simdlen(16)
    for (int c = 0; c < 16; c++) {
        const float x = bf16_to_f32(g[c]), up = round_to_bf16(u[c]);
        h[c] = f32_to_bf16(round_to_bf16(x / (1.f + expf(-x))) * up);
    }
}
#endif

#if KVF_SIMD
/* k chunks. Why: the GEMM tiles re-read a panel group from L2 for each row tile while the next group is
 * prefetched beside it, so two groups (GP x K/2 x 64 bytes each) must fit in L2. At K = 8,192 (the 1B
 * preset's down projection) a group is 768 KiB, and two of them overflow Zen 4's 1 MiB L2: lines were
 * fetched twice, and the down projection ran at 71-84% of its bounds at 1-32 rows. Past KVF_GEMM_KC
 * k-pairs a group goes in even k chunks of at most that many; a row tile keeps its fp32 sums between
 * chunks (`partial`), so the sums run in the same order and the results are bitwise those of one pass.
 * The down projection at 12-32 rows: 1.03-1.06x (same file as above); at 1-8 rows no change. */
#ifndef KVF_GEMM_KC
#define KVF_GEMM_KC 1024
#endif
static int64_t gemm_kc = KVF_GEMM_KC;
/* Up to KVF_GEMM_KC_MAX_ROWS rows only: a prefill's many row tiles re-read a group often enough that the
 * hardware keeps it close anyway, and chunks measured 0.98x on the down projection at 1,024 rows. */
#ifndef KVF_GEMM_KC_MAX_ROWS
#define KVF_GEMM_KC_MAX_ROWS 64
#endif
static inline int64_t k_chunks(int64_t K2, int64_t M) {
    return gemm_kc > 0 && K2 > gemm_kc && M <= KVF_GEMM_KC_MAX_ROWS ? (K2 + gemm_kc - 1) / gemm_kc : 1;
}

/* A thread's row tiles' sums between k chunks (group_rows' `partial`): NULL with one chunk, or without
 * memory for them, and then *nc = 1 (one pass over K, the same bits). */
static float *alloc_partial(int64_t M, int64_t nchunks, int64_t *nc) {
    float *partial = nchunks > 1 ? (float *)aligned_alloc(64, (size_t)((M + GM - 1) / GM * GM * GP * NR) * sizeof(float))
                                 : NULL;
    *nc = partial ? nchunks : 1;
    return partial;
}
#endif

/* The most k-pairs a GEMM k chunk takes (0: K in one pass); returns the setting before. Why: tests check
 * that every chunking gives the same bits, and benchmarks compare chunk sizes in one process. */
int64_t kvf_panel_bf16_set_kc(int64_t kc) {
#if KVF_SIMD
    const int64_t before = gemm_kc;
    gemm_kc = kc < 0 ? KVF_GEMM_KC : kc;
    return before;
#else
    (void)kc;
    return 0;
#endif
}

#if KVF_SIMD
/* Where a panel group's finished row tiles go: rounded to bf16 (+ bias) into y; or, for the gated GEMM,
 * its gate pass's bf16 gate columns (GP x NR a row) or its up pass's silu(gate) * up into h. */
typedef struct {
    uint16_t *y;
    int64_t N, n0;
    const uint16_t *bias;
    uint16_t *gate;     /* the gate pass: write the gate columns here */
    const uint16_t *up; /* the up pass: the gate columns to read ... */
    uint16_t *h;        /* ... and h's first column of this group (row stride I) */
    int64_t I;
} kvf_fin;

/* One panel group (np panels from wg) over all M rows, chunk by chunk in k, each chunk's row tiles
 * prefetching the next chunk: this group's next k chunk, or the first chunk of `after` (np_after panels;
 * NULL: nothing follows). `partial`: tiles x GM x GP x NR floats, needed only with more than one chunk. */
static void group_rows(const uint32_t *xp, const float *xf, int64_t M, int64_t K2, int64_t nchunks, const uint16_t *wg,
                       int64_t panel_elems, int np, const uint16_t *after, int np_after, float *partial,
                       const kvf_fin *fin) {
    const int64_t tiles = (M + GM - 1) / GM, stride = panel_elems * (int64_t)sizeof(uint16_t);
    float tmp[GM * GP * NR] __attribute__((aligned(64)));
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t k0 = K2 * c / nchunks, kc = K2 * (c + 1) / nchunks - k0;
        const int last = c == nchunks - 1;
        /* the next chunk: this group's, or the first one of what follows */
        const int64_t nk0 = last ? 0 : k0 + kc, nkc = last ? K2 / nchunks : K2 * (c + 2) / nchunks - nk0;
        const char *nb = last ? (const char *)after : (const char *)(wg + nk0 * 2 * NR);
        const int pn = nb && (M >= KVF_GEMM_PF_MIN_ROWS || K2 < KVF_GEMM_PF_LONG_K2) ? (last ? np_after : np) : 0;
        for (int64_t i = 0, t = 0; i < M; i += GM, t++) {
            const int mr = (int)(M - i < GM ? M - i : GM);
            /* this tile's share of the runs taken one after the other (nkc >= 1 lines each) */
            kvf_pf pf = {0};
            if (pn) {
                const int64_t f0 = pn * nkc * t / tiles, f1 = pn * nkc * (t + 1) / tiles;
                const char *run = nb + f0 / nkc * stride;
                pf = (kvf_pf){run + 64 * (f0 % nkc), run + 64 * nkc, stride - 64 * nkc, f1 - f0};
            }
            float *part = nchunks > 1 ? partial + t * GM * GP * NR : NULL;
            const float *in = c ? part : NULL;
            const uint32_t *xr = xp + i * K2 + k0;
            const float *xfr = xf ? xf + i * 2 * K2 + 2 * k0 : NULL;
            const uint16_t *w = wg + k0 * 2 * NR;
            if (!last) {
                gemm_block(xr, xfr, K2, kc, w, panel_elems, mr, np, NULL, 0, 0, NULL, pf, in, part);
            } else if (fin->y) {
                gemm_block(xr, xfr, K2, kc, w, panel_elems, mr, np, fin->y + i * fin->N, fin->N, fin->n0, fin->bias,
                           pf, in, NULL);
            } else {
                gemm_block(xr, xfr, K2, kc, w, panel_elems, mr, np, NULL, 0, 0, NULL, pf, in, tmp);
                for (int r = 0; r < mr; r++)
                    for (int col = 0; col < np * NR; col += 16) {
                        if (fin->gate)
                            _mm256_storeu_si256((__m256i *)(fin->gate + (i + r) * GP * NR + col),
                                                f32x16_to_bf16(_mm512_load_ps(tmp + r * GP * NR + col)));
                        else
                            silu_mul_bf16x16(fin->up + (i + r) * GP * NR + col, tmp + r * GP * NR + col,
                                             fin->h + (i + r) * fin->I + col);
                    }
            }
        }
    }
}
#endif

/* x: [M, K] bf16 rows; wp: packed panels; bias: [N] bf16 or NULL; y: [M, N] bf16. */
void kvf_panel_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                           const uint16_t *bias, uint16_t *y, int nthreads) {
    const int64_t P = (N + NR - 1) / NR, K2 = (K + 1) / 2;
    const int64_t panel_elems = K2 * 2 * NR;
    /* x as whole k-pairs: rows padded with a zero to an even K (a copy only when K is odd) */
    uint32_t *xpad = NULL;
    const uint32_t *xp = (const uint32_t *)x;
    if (K % 2) {
        xpad = (uint32_t *)calloc((size_t)(M * K2), sizeof(uint32_t));
        if (!xpad) return;
        for (int64_t r = 0; r < M; r++) memcpy(xpad + r * K2, x + r * K, (size_t)K * sizeof(uint16_t));
        xp = xpad;
    }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > P) nthreads = (int)P;
    /* the FMA tiles read x widened to fp32 once: [M][2 x K2] floats, the odd K's pad a zero */
    float *xf = NULL;
#if KVF_SIMD
    int mode = M >= BF16_GEMM_MIN ? kvf_panel_bf16_gemm_mode() : 0;
#if KVF_AMX
    /* AMX: whole 16-pair k blocks only (every shape of the default model); the last M % 16 rows zero-padded */
    int amx = mode == 2 && K2 % 16 == 0;
    uint32_t *tail = NULL;
    if (amx && M % 16) {
        tail = (uint32_t *)calloc((size_t)(16 * K2), sizeof(uint32_t));
        if (tail) memcpy(tail, xp + (M - M % 16) * K2, (size_t)((M % 16) * K2) * sizeof(uint32_t));
        else amx = 0; /* no memory for the padded rows: the vector tiles need none */
    }
#else
    const int amx = 0;
#endif
    if (mode == 2 && !amx) mode = kvf_panel_bf16_fma_faster(); /* AMX cannot take this call: the faster vector tile */
    if (mode == 1) xf = widen_rows(xp, M, K2);
#endif
    /* the vector GEMM tiles' panel groups, handed out from both ends (kvf_steal.h); NULL: the even split */
    kvf_range *ranges = NULL;
#if KVF_SIMD
    if (!amx && M >= BF16_GEMM_MIN) ranges = kvf_ranges_new((P + GP - 1) / GP, nthreads);
    const int64_t nchunks = k_chunks(K2, M);
#endif
#pragma omp parallel num_threads(nthreads)
    {
        KVF_TEAM(tid, nth);
        const int64_t p0 = P * tid / nth;
        int64_t p1 = P * (tid + 1) / nth;
#if KVF_AMX
        if (amx) {
            amx_gemm(xp, M, K2, wp, panel_elems, p0, p1, y, N, bias, tail);
            p1 = p0; /* done: skip the loops below */
        }
#endif
#if KVF_SIMD
        if (M >= BF16_GEMM_MIN && p1 > p0) { /* GEMM tiles (every row count by default, see BF16_GEMM_MIN) */
            int64_t nc;
            float *partial = alloc_partial(M, nchunks, &nc);
            kvf_walk walk = kvf_walk_start(ranges, nthreads, (int)nth, (int)tid, 1, (P + GP - 1) / GP);
            int64_t g, gnext = 0;
            while (kvf_walk_next(&walk, &g)) {
                const int64_t p = g * GP;
                const int np = (int)(P - p < GP ? P - p : GP);
                /* the next panel group, prefetched by this group's last chunk (see KVF_GEMM_PREFETCH) */
                const int next = kvf_walk_peek(&walk, &gnext) ? (int)(P - gnext * GP < GP ? P - gnext * GP : GP) : 0;
                const kvf_fin fin = {.y = y, .N = N, .n0 = p * NR, .bias = bias};
                group_rows(xp, xf, M, K2, nc, wp + p * panel_elems, panel_elems, np,
                           next ? wp + gnext * GP * panel_elems : NULL, next, partial, &fin);
            }
            free(partial);
            p1 = p0; /* done: skip the decode-row loop below */
        }
#endif
        float out[MR * NR];
        for (int64_t p = p0; p < p1; p++) {
            const uint16_t *w = wp + p * panel_elems;
            const int64_t n0 = p * NR, nv = N - n0 < NR ? N - n0 : NR;
            for (int64_t i = 0; i < M; i += MR) {
                const int mr = (int)(M - i < MR ? M - i : MR);
                tile(xp + i * K2, K2, K2, w, mr, out);
                for (int r = 0; r < mr; r++) {
                    uint16_t *yr = y + (i + r) * N + n0;
                    const float *t = out + r * NR;
                    for (int64_t j = 0; j < nv; j++)
                        yr[j] = f32_to_bf16(bias ? t[j] + bf16_to_f32(bias[n0 + j]) : t[j]);
                }
            }
        }
    }
#if KVF_AMX
    free(tail);
#endif
    free(ranges);
    free(xf);
    free(xpad);
}

/* h[M, I] = silu(x @ Wg^T) * (x @ Wu^T) on a packed bf16 gate|up weight (N2 = 2I rows: gate then up), I a
 * multiple of NR, K even. Why: a prefill chunk's gate|up product is the largest buffer of a step (the 1B
 * preset at 1,024 rows: 32 MB a layer). Written out, read back by SiLU-and-multiply and freed, it also came
 * back from glibc as a fresh mapping every layer (32 MB is past the mmap threshold glibc raises by itself),
 * faulted in page by page: a 1,024-token step took 139,000 minor faults with it, 8,200 without. Here a
 * thread runs a group's gate panels over every row tile, keeping the gate columns as bf16 (M x 48 of them),
 * then its up panels, whose tiles apply SiLU-and-multiply on the way out: only h (half the bytes) is
 * written, and one weight group at a time sits in L2 (gate and up tiles alternating row by row, two groups
 * there, measured 0.97-0.99x the two calls). Bitwise what
 * kvf_panel_linear_bf16 then fused_ops.c's kvf_silu_mul give: the same tiles in the same k order, each
 * product rounded to bf16 as the linear stores it, and kvf_silu_mul's expression and roundings
 * (round(silu(g)) * u, libmvec's 16-lane expf). Returns 1, or 0 where it cannot run (no AVX512-BF16 build,
 * AMX tiles in use, odd K, I not whole panels, no memory): the caller then makes the two calls. */

int kvf_panel_linear_bf16_silu_mul(const uint16_t *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N2,
                                   uint16_t *h, int nthreads) {
#if KVF_SIMD
    const int64_t I = N2 / 2, Pg = I / NR, K2 = K / 2, panel_elems = K2 * 2 * NR;
    if (M < 1 || K < 2 || K % 2 || I < NR || I % NR || N2 % 2) return 0;
    int mode = kvf_panel_bf16_gemm_mode();
    if (mode == 2) return 0; /* AMX tiles: the two calls (their linear runs on AMX) */
    const uint32_t *xp = (const uint32_t *)x;
    float *xf = mode == 1 ? widen_rows(xp, M, K2) : NULL;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > Pg) nthreads = (int)Pg;
    int failed = 0;
    /* groups of GP gate panels (each with its up panels), handed out from both ends (kvf_steal.h) */
    const int64_t groups = (Pg + GP - 1) / GP, nchunks = k_chunks(K2, M);
    kvf_range *ranges = kvf_ranges_new(groups, nthreads);
#pragma omp parallel num_threads(nthreads)
    {
        KVF_TEAM(tid, nth);
        const int64_t tiles = (M + GM - 1) / GM;
        /* every row's gate columns of the group, rounded to bf16: the up pass reads them back */
        uint16_t *gate = (uint16_t *)malloc((size_t)(tiles * GM * GP * NR) * sizeof(uint16_t));
        int64_t nc;
        float *partial = alloc_partial(M, nchunks, &nc);
        if (!gate) {
#pragma omp atomic write
            failed = 1;
        }
        kvf_walk walk = kvf_walk_start(ranges, nthreads, (int)nth, (int)tid, 1, groups);
        int64_t g, gnext = 0;
        while (gate && kvf_walk_next(&walk, &g)) {
            const int64_t p = g * GP;
            const int np = (int)(Pg - p < GP ? Pg - p : GP);
            const int next = kvf_walk_peek(&walk, &gnext) ? (int)(Pg - gnext * GP < GP ? Pg - gnext * GP : GP) : 0;
            /* the gate pass prefetches this group's up panels; the up pass the next group's gate panels */
            const kvf_fin to_gate = {.gate = gate};
            group_rows(xp, xf, M, K2, nc, wp + p * panel_elems, panel_elems, np, wp + (Pg + p) * panel_elems, np,
                       partial, &to_gate);
            const kvf_fin to_h = {.up = gate, .h = h + p * NR, .I = I};
            group_rows(xp, xf, M, K2, nc, wp + (Pg + p) * panel_elems, panel_elems, np,
                       next ? wp + gnext * GP * panel_elems : NULL, next, partial, &to_h);
        }
        free(partial);
        free(gate);
    }
    free(ranges);
    free(xf);
    return !failed;
#else
    (void)x, (void)M, (void)K, (void)wp, (void)N2, (void)h, (void)nthreads;
    return 0;
#endif
}
