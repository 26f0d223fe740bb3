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
 * the packed weight; only the first N columns are written. Any M >= 1: rows go in tiles of up to MR.
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
        const int64_t p0 = P * tid / nth, p1 = P * (tid + 1) / nth;
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
