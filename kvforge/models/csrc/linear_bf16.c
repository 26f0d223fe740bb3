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
 * the packed weight; only the first N columns are written. Any M >= 1: up to MR rows go in decode tiles
 * that stream each panel once; more rows (prefill chunks, a batch's decode steps) in GEMM tiles of 8 rows
 * x 3 panels (below), which beat oneDNN's packed bf16 kernels from 5 to 1,024 rows on this project's
 * shapes (benchmarks/linear_kernels.py --panel --dtype bfloat16).
 *
 * AVX512-BF16 intrinsics where the compiler targets them; otherwise a plain-C loop over the same layout
 * (bf16 -> fp32 by a 16-bit shift, fp32 multiply-add), so the layout and the results hold on any CPU.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVF_SIMD 1
#else
#define KVF_SIMD 0
#endif

#define NR 16 /* output columns per panel: one zmm of fp32 accumulators */
#define MR 4  /* rows per tile: 4 rows x 4 k-pair accumulator sets = 16 accumulators */

int kvf_panel_bf16_nr(void) { return NR; }
int kvf_panel_bf16_simd(void) { return KVF_SIMD; }

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

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

static inline __attribute__((always_inline)) __m256i round_bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

static inline __attribute__((always_inline)) void gemm_tile(const uint32_t *x, int64_t ldx, int64_t K2,
                                                            const uint16_t *w, int64_t pstride, int mr, int np,
                                                            uint16_t *y, int64_t N, int64_t n0,
                                                            const uint16_t *bias) {
    __m512 acc[GM][GP];
#pragma GCC unroll 8
    for (int r = 0; r < GM; r++)
#pragma GCC unroll 3
        for (int p = 0; p < GP; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < K2; kp++) {
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
            _mm256_mask_storeu_epi16(y + r * N + c0, m, round_bf16x16(v));
        }
    }
}

/* One specialised copy per (rows, panels), so every accumulator loop is unrolled into registers. */
static void gemm_block(const uint32_t *x, int64_t ldx, int64_t K2, const uint16_t *w, int64_t pstride, int mr,
                       int np, uint16_t *y, int64_t N, int64_t n0, const uint16_t *bias) {
#define KVF_GEMM_CASE(R, P) \
    case (R) * 4 + (P): gemm_tile(x, ldx, K2, w, pstride, R, P, y, N, n0, bias); break;
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
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
#else
        const int64_t tid = 0, nth = 1;
#endif
        const int64_t p0 = P * tid / nth;
        int64_t p1 = P * (tid + 1) / nth;
#if KVF_SIMD
        if (M > MR) { /* more rows than a decode tile: GEMM tiles */
            for (int64_t p = p0; p < p1; p += GP) {
                const int np = (int)(p1 - p < GP ? p1 - p : GP);
                for (int64_t i = 0; i < M; i += GM) {
                    const int mr = (int)(M - i < GM ? M - i : GM);
                    gemm_block(xp + i * K2, K2, K2, wp + p * panel_elems, panel_elems, mr, np, y + i * N, N,
                               p * NR, bias);
                }
            }
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
    free(xpad);
}
