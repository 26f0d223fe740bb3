/* Weight-only int8 / int4 linear layers: y[M,N] = x[M,K] @ W^T (+ bias), W held as codes and fp32 scales
 * (kvforge/models/quant_linear.py packs them).
 *
 * Why: a decode step reads every weight once, so its speed is bytes per token over memory bandwidth; bf16
 * decode of a 1B model already runs at the machine's read bandwidth. int8 codes halve the bytes, int4
 * codes quarter them. The codes are turned into fp32 in registers and multiplied with fp32 activations, so
 * the only error is the weights' own quantization: each dequantized weight is code x scale (+ offset)
 * rounded once to fp32, exactly the value a dequantize-then-matmul reference multiplies, and the sums
 * differ from it only in the order of their fp32 additions.
 *
 * Layout (N padded to whole panels of NR = 16 output columns, Np = panels x 16):
 *   int8: codes [panels][K][16] int8; one k of a panel is 16 bytes, a cache line holds 4 k.
 *   int4: codes [panels][K2 = ceil(K/2)][16] bytes; byte j of pair kp holds column j's k = 2kp in its low
 *         nibble and k = 2kp + 1 in its high nibble, unsigned u in [0, 15] (an odd K pads a zero code).
 *   scales [groups][Np] fp32, groups of `group` consecutive k (the last may be short); int8 per output
 *   channel is group = K. int4 also has offsets [groups][Np]: w = u x scale + offset (symmetric formats
 *   store offset = -8 x scale, which is exact, so w = (u - 8) x scale rounded once); int8 groups may have them
 *   too (GGUF's Q5_1 / Q5_K: w = code x scale + offset, one FMA).
 *
 * Two paths, both splitting the panels statically over the threads (one sequential stream each):
 *   decode rows (M <= DECODE_ROWS): each group of panels is read once and its codes widened in registers
 *   for all rows at once (int8: widen, convert, scale; int4: widen, two table lookups `vpermps` that
 *   turn each nibble into its float without a mask or a convert, then one FMA with scale and offset);
 *   int4 rows in bf16 on AVX512-BF16 CPUs skip the floats: each code byte becomes a bf16 pair in one `vpermw` and
 *   `vdpbf16ps` multiplies it with the activations' pair (KVF_U4_BF16; 1.17x at 1 row, 1.71x at 4);
 *   int8 rows in bf16 (AVX512-BF16 + VBMI, KVF_I8_BF16) too: 1-2 rows split each code into its nibbles (exact
 *   bf16 pairs by table, I8_HI_BF16), 3 rows widen each pair of k to a bf16 pair once per 3-row tile, and 4-32
 *   rows run up to 8 at a time against one panel (decode_pairs8), widening each pair once per 8 rows; the 1B
 *   step's linears, A/B in one process: 1.0x at 1-2 rows (the read bound), 1.2-1.3x at 3-4, 2.0-2.2x at 6-8,
 *   1.3-1.4x at 12-16 and 1.05x at 32 against the fp32 FMAs (8 rows) and the bf16 GEMM path (9 and more);
 *   more rows, bf16 x on AVX512-BF16 CPUs: a panel group's codes are widened once into a bf16 scratch that
 *   stays in L2 (every code is exact in bf16) and register tiles of rows run `vdpbf16ps` over it, scale and
 *   offset applied per group (bgemm_tile; 2.1x the fp32 path, as fast as the bf16 panels from 256 rows);
 *   more rows otherwise: a panel group's weights are dequantized once into an fp32 scratch that stays in L2,
 *   and register-blocked tiles of rows run fp32 FMAs over it (each weight decoded once per call).
 *
 * AVX-512F where the compiler targets it, else AVX2 + FMA, else plain C over the same layout.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_omp.h"  /* OpenMP, KVF_TEAM */
#include "kvf_steal.h" /* panel ranges finished from both ends */
#include "kvf_bf16.h" /* bf16_to_f32, f32_to_bf16: the one rounding every kernel shares */

#define NR 16
#if defined(__AVX512F__)
#include <immintrin.h>
#define KVF_SIMD 2
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVF_SIMD 1
#else
#define KVF_SIMD 0
#endif

int kvf_qlinear_nr(void) { return NR; }
/* 2: AVX-512, 1: AVX2 + FMA, 0: plain C. */
int kvf_qlinear_simd(void) { return KVF_SIMD; }

#define INLINE static inline __attribute__((always_inline))

/* ---- 16 fp32 lanes: one zmm, two ymm, or a plain array ---- */
#if KVF_SIMD == 2
typedef __m512 v16;
INLINE v16 v_zero(void) { return _mm512_setzero_ps(); }
INLINE v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
INLINE void v_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
INLINE v16 v_fma_s(float a, v16 b, v16 c) { return _mm512_fmadd_ps(_mm512_set1_ps(a), b, c); }
INLINE v16 v_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
INLINE v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
INLINE v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
INLINE v16 v_from_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 16 bytes of nibble pairs -> the low and the high nibbles as floats: vpermps reads only the low 4 bits
 * of each index, so a table of 0..15 converts a nibble without masking it. */
INLINE void v_from_u4(const uint8_t *p, v16 *lo, v16 *hi) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_permutexvar_ps(v, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}
#define GM 8 /* GEMM tile: 8 rows x 3 panels = 24 accumulators */
#define GP 3
#elif KVF_SIMD == 1
typedef struct {
    __m256 a, b;
} v16;
INLINE v16 v_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
INLINE v16 v_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
INLINE void v_store(float *p, v16 v) { _mm256_storeu_ps(p, v.a), _mm256_storeu_ps(p + 8, v.b); }
INLINE v16 v_fma_s(float a, v16 b, v16 c) {
    const __m256 s = _mm256_set1_ps(a);
    return (v16){_mm256_fmadd_ps(s, b.a, c.a), _mm256_fmadd_ps(s, b.b, c.b)};
}
INLINE v16 v_fma(v16 a, v16 b, v16 c) { return (v16){_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)}; }
INLINE v16 v_mul(v16 a, v16 b) { return (v16){_mm256_mul_ps(a.a, b.a), _mm256_mul_ps(a.b, b.b)}; }
INLINE v16 v_add(v16 a, v16 b) { return (v16){_mm256_add_ps(a.a, b.a), _mm256_add_ps(a.b, b.b)}; }
INLINE v16 v_from_i8(const int8_t *p) {
    return (v16){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))))};
}
INLINE void v_from_u4(const uint8_t *p, v16 *lo, v16 *hi) {
    const __m256i m = _mm256_set1_epi32(15);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    *lo = (v16){_mm256_cvtepi32_ps(_mm256_and_si256(a, m)), _mm256_cvtepi32_ps(_mm256_and_si256(b, m))};
    *hi = (v16){_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
}
#define GM 4 /* 16 ymm: 4 rows x 1 panel = 8 accumulators, 2 weights, 1 broadcast */
#define GP 1
#else
typedef struct {
    float f[NR];
} v16;
INLINE v16 v_zero(void) { v16 v; memset(&v, 0, sizeof v); return v; }
INLINE v16 v_load(const float *p) { v16 v; memcpy(v.f, p, sizeof v.f); return v; }
INLINE void v_store(float *p, v16 v) { memcpy(p, v.f, sizeof v.f); }
INLINE v16 v_fma_s(float a, v16 b, v16 c) { for (int j = 0; j < NR; j++) c.f[j] += a * b.f[j]; return c; }
INLINE v16 v_fma(v16 a, v16 b, v16 c) { for (int j = 0; j < NR; j++) c.f[j] += a.f[j] * b.f[j]; return c; }
INLINE v16 v_mul(v16 a, v16 b) { for (int j = 0; j < NR; j++) a.f[j] *= b.f[j]; return a; }
INLINE v16 v_add(v16 a, v16 b) { for (int j = 0; j < NR; j++) a.f[j] += b.f[j]; return a; }
INLINE v16 v_from_i8(const int8_t *p) { v16 v; for (int j = 0; j < NR; j++) v.f[j] = (float)p[j]; return v; }
INLINE void v_from_u4(const uint8_t *p, v16 *lo, v16 *hi) {
    for (int j = 0; j < NR; j++) lo->f[j] = (float)(p[j] & 15), hi->f[j] = (float)(p[j] >> 4);
}
#define GM 4
#define GP 1
#endif

/* Next-tile prefetch: decode tiles of a few rows ask for the thread's next tile, line for line as they read their
 * own, into L2 (KVF_NEXT_HINT: the locality hint, 1 = prefetcht2), so the arithmetic on one tile overlaps the
 * next one's memory reads (bf16's GEMM tiles do the same, KVF_GEMM_PREFETCH). Figures beside each user.
 * int8 decode rows (up to QNEXT_ROWS), a step's linears of the 1B model, both threads, the builds' steps
 * interleaved in one process: 1.06-1.07x at one row, 1.10-1.14x at 4. Weight-only int4 measured 0.98-1.09x and
 * does not. */
#ifndef KVF_NEXT_HINT
#define KVF_NEXT_HINT 1
#endif
#ifndef QNEXT_ROWS
#define QNEXT_ROWS 4
#endif

/* int8 x bf16 decode rows (KVF_I8_BF16), chosen by A/B on the 1B step's linears in one process: from
 * I8_PAIR_ROWS rows a tile of up to 4 rows x 2 panels widens each pair of k to a bf16 pair (fewer rows: the
 * nibble split; at 2 rows both ran 0.99x); from PAIRS8_ROWS (4: 1.07x the 4 x 2 tile) to PAIRS8_MAX_ROWS
 * rows, passes of up to 8 rows against one panel (the walk hands PAIRS8_PANELS panels at a time: 1 ran
 * 1.43-1.52x the 4 x 2 tiles at 5-8 rows, 2 ran 1.29-1.40x, 4 ran 1.24-1.33x); at 32 rows that still ran
 * 1.05x the bf16 GEMM path. */
#ifndef I8_PAIR_ROWS
#define I8_PAIR_ROWS 3
#endif
#ifndef PAIRS8_PANELS
#define PAIRS8_PANELS 1
#endif
#ifndef PAIRS8_ROWS
#define PAIRS8_ROWS 4
#endif
#ifndef PAIRS8_MAX_ROWS
#define PAIRS8_MAX_ROWS 32
#endif

#define DR 4 /* decode tile: up to 4 rows x up to 4 panels (2 panels from 3 rows) */
#define DP 4
#ifndef DECODE_ROWS
#define DECODE_ROWS 8
#endif

/* What every path needs to know about the weight. */
typedef struct {
    const uint8_t *codes;
    const float *scales, *offsets; /* [groups][Np]; offsets: int4, and int8 groups that have them (else NULL) */
    int64_t K, Kp, N, Np, group, pstride; /* Kp: K rounded up to even for int4; pstride: bytes per panel */
    int bits;
} qweight;

/* Rows of out (fp32, [mr][np*16] tile) + bias, written to y (fp32 or bf16) for the valid columns. */
INLINE void write_rows(const float *tile, int mr, int np, void *y, int y_bf16, int64_t N, int64_t n0,
                       const float *bias) {
    const int64_t nv = N - n0 < np * NR ? N - n0 : np * NR;
#if KVF_SIMD == 2
    if (nv == np * NR) { /* whole panels: 16 columns a vector (a batch's rows are many; scalar rounding showed) */
        for (int r = 0; r < mr; r++)
            for (int q = 0; q < np; q++) {
                __m512 v = _mm512_loadu_ps(tile + (r * np + q) * NR);
                if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + q * NR));
                if (y_bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)y + r * N + n0 + q * NR), f32x16_to_bf16(v));
                else _mm512_storeu_ps((float *)y + r * N + n0 + q * NR, v);
            }
        return;
    }
#endif
    for (int r = 0; r < mr; r++) {
        const float *t = tile + r * np * NR;
        if (y_bf16) {
            uint16_t *yr = (uint16_t *)y + r * N + n0;
            for (int64_t j = 0; j < nv; j++) yr[j] = f32_to_bf16(bias ? t[j] + bias[n0 + j] : t[j]);
        } else {
            float *yr = (float *)y + r * N + n0;
            for (int64_t j = 0; j < nv; j++) yr[j] = bias ? t[j] + bias[n0 + j] : t[j];
        }
    }
}

/* A panel's scales (and offsets) of successive groups are Np floats apart: not a stream the hardware prefetcher
 * follows, so the decode tiles ask for group g's (two ahead) while they work. Measured on the 1B model's int4 g32
 * linears, bf16 rows, one thread, interleaved A/B in one process: 1.09x at 1 row, 1.11x at 4. */
INLINE void prefetch_group(const qweight *w, int64_t p, int np, int64_t g, int64_t ngroups) {
    if (g >= ngroups) return;
    for (int q = 0; q < np; q++) {
        __builtin_prefetch(w->scales + g * w->Np + (p + q) * NR);
        if (w->offsets) __builtin_prefetch(w->offsets + g * w->Np + (p + q) * NR);
    }
}

#if KVF_SIMD == 2 && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVF_U4_BF16 1
/* int4 decode rows with bf16 activations (AVX512-BF16): a byte of codes is the pair (k = 2kp, 2kp + 1) of its
 * column, which is what `vdpbf16ps` multiplies against the pair (x[2kp], x[2kp + 1]) of bf16 activations. The
 * byte b is widened to a dword t, u = t | t << 12 puts the low nibble in the low word's bits 0-3 (bit 4, the high
 * nibble's bit 0, is ignored by a table whose entries i and i + 16 agree) and the high nibble in the high word,
 * and one `vpermw` over bf16(0..15) turns both into bf16: 5 instructions per 32 weights instead of 6, and one
 * multiply-add per pair instead of two. Every product code x x is exact in fp32 (4-bit x 8-bit mantissas), so
 * the sums are those of the fp32 path up to the order of their additions (vdpbf16ps flushes denormal inputs
 * and results to zero, as no bf16 activation of a real model is). */
static const uint16_t U4_BF16[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                     0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
                                     0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                     0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

INLINE __m512bh u4_pairs_bf16(const uint8_t *p, __m512i table) {
    const __m512i t = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(t, _mm512_slli_epi32(t, 12)), table);
}

/* 16 int8 codes as the bf16 bits in the high halves of their fp32 (every code is exact in bf16) */
INLINE __m512i i8_bf16_bits(const int8_t *p) {
    return _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
}

/* A panel's codes of k (at c) and k + 1 (at c + NR) as 16 bf16 pairs, k in the low word; high = 0xFFFF0000 */
INLINE __m512i i8_pairs_bf16(const int8_t *c, __m512i high) {
    return _mm512_or_si512(_mm512_srli_epi32(i8_bf16_bits(c), 16), _mm512_and_si512(i8_bf16_bits(c + NR), high));
}

#if defined(__AVX512VBMI__)
#define KVF_I8_BF16 1
/* int8 decode rows with bf16 activations: each code c splits exactly into c = 16 h + l, h its signed high nibble
 * (-8..7) and l its low one (0..15), and both are tiny integers in bf16, so `vdpbf16ps` multiplies them with the
 * activations' pairs: x c = x l + x 16h, the two products exact in fp32. Per 4 k of a panel (one 64-byte line of
 * [K][16] codes) one `vpermb` puts column j's codes in its dword as (k, k + 2, k + 1, k + 3); then each 16-bit word
 * holds the codes of k and k + 1 (low bytes) or k + 2 and k + 3 (high bytes) of one column, and four `vpermw`s on
 * the word, shifted by 0, 4, 8 and 12, look up l(k), l(k+1) / 16h(k), 16h(k+1) / ... as bf16 pairs (a table
 * lookup reads the low 5 bits, so each table repeats its 16 entries). Per 64 codes and row: 1 permute, 3 shifts,
 * 4 lookups and 4 dot products, instead of 4 x (widen, convert, FMA); on one core, hot in L1, 27.3 against 25.0
 * G codes/s. The l and 16h sums run in two accumulators (more independent chains), added at the group's end. */
static const uint16_t I8_HI_BF16[32] = {0x0000, 0x4180, 0x4200, 0x4240, 0x4280, 0x42A0, 0x42C0, 0x42E0,
                                        0xC300, 0xC2E0, 0xC2C0, 0xC2A0, 0xC280, 0xC240, 0xC200, 0xC180,
                                        0x0000, 0x4180, 0x4200, 0x4240, 0x4280, 0x42A0, 0x42C0, 0x42E0,
                                        0xC300, 0xC2E0, 0xC2C0, 0xC2A0, 0xC280, 0xC240, 0xC200, 0xC180};
/* byte 4j + {0, 1, 2, 3} of the result <- column j's code of k + {0, 2, 1, 3}: row k + i is bytes 16i..16i+15 */
static const uint8_t I8_PAIR_ORDER[64] = {
    0,  32, 16, 48, 1,  33, 17, 49, 2,  34, 18, 50, 3,  35, 19, 51, 4,  36, 20, 52, 5,  37, 21, 53,
    6,  38, 22, 54, 7,  39, 23, 55, 8,  40, 24, 56, 9,  41, 25, 57, 10, 42, 26, 58, 11, 43, 27, 59,
    12, 44, 28, 60, 13, 45, 29, 61, 14, 46, 30, 62, 15, 47, 31, 63};
#else
#define KVF_I8_BF16 0
#endif

#else
#define KVF_U4_BF16 0
#define KVF_I8_BF16 0
#endif

/* Decode tiles' accumulators: DR rows x DP panels of 16 fp32 lanes. */
typedef v16 dtile[DR][DP];

#if KVF_U4_BF16
/* Column panel q of the tile's rows: acc (even = 1) or odd [r][q] += wv . (x[r][k], x[r][k + 1]), bf16 pairs. */
INLINE void dot_pair_rows(dtile acc, dtile odd, __m512bh wv, const uint16_t *xb, int64_t ldx, int64_t k, int q,
                          int mr, int even) {
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
        int32_t xp;
        memcpy(&xp, xb + r * ldx + k, 4);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp);
        if (even) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], wv, xv);
        else odd[r][q] = _mm512_dpbf16_ps(odd[r][q], wv, xv);
    }
}
#endif

INLINE void zero_tile(dtile t) {
    for (int r = 0; r < DR; r++)
        for (int q = 0; q < DP; q++) t[r][q] = v_zero();
}

INLINE void store_tile(dtile t, int mr, int np, float *tile) {
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < np; q++) v_store(tile + (r * np + q) * NR, t[r][q]);
}

/* decode_tile's `bits` for int8 groups with offsets (GGUF's Q5_1 / Q5_K): a copy of its own, so that plain int8
 * keeps the code it had (a run-time test in the group's end measured 0.97x at 4 rows) */
#define INT8_OFFSETS 9

/* The end of group g: tot += scale x (acc + odd) (+ offset x the group's sum of x, `xsum`: int4 and
 * INT8_OFFSETS). */
INLINE void add_group(dtile tot, dtile acc, dtile odd, const qweight *w, int64_t p, int mr, int np, const int bits,
                      const float *xsum, int64_t ngroups, int64_t g) {
#pragma GCC unroll 4
    for (int q = 0; q < np; q++) {
        const v16 sc = v_load(w->scales + g * w->Np + (p + q) * NR);
        if (bits == INT8_OFFSETS) {
            const v16 of = v_load(w->offsets + g * w->Np + (p + q) * NR);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) tot[r][q] = v_fma_s(xsum[r * ngroups + g], of, v_fma(acc[r][q], sc, tot[r][q]));
        } else if (bits == 8) {
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) tot[r][q] = v_fma(acc[r][q], sc, tot[r][q]);
        } else {
            const v16 of = v_load(w->offsets + g * w->Np + (p + q) * NR);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                tot[r][q] = v_fma(v_add(acc[r][q], odd[r][q]), sc, tot[r][q]);
                tot[r][q] = v_fma_s(xsum[r * ngroups + g], of, tot[r][q]);
            }
        }
    }
}

/* Decode rows: `mr` rows of xf (fp32, row stride Kp) against panels p..p+np-1, codes widened in registers.
 * Per group, each (row, panel) sums x x code (int4: the nibble, even and odd k in two accumulators, which
 * doubles the independent FMA chains), then adds scale x that sum (+ offset x the group's sum of x,
 * `xsum`, for int4): sum_k x_k (u_k s + o) = s sum_k x_k u_k + o sum_k x_k. One multiply per group and
 * column instead of one per weight; the same weights as code x scale (+ offset), summed in another order. */
INLINE void decode_tile(const float *xf, const uint16_t *xb, int64_t ldx, const qweight *w, int64_t p, int mr, int np,
                        const int bits, const float *xsum, int64_t ngroups, int64_t pnext, int nnext, float *tile) {
#if KVF_U4_BF16
    const __m512i table = _mm512_loadu_si512((const void *)U4_BF16);
#endif
#if KVF_I8_BF16
    const __m512i high = _mm512_loadu_si512((const void *)I8_HI_BF16);
    const __m512i order = _mm512_loadu_si512((const void *)I8_PAIR_ORDER);
#endif
    dtile tot, acc, odd;
    zero_tile(tot);
    const int64_t K = w->K, G = w->group;
    const uint8_t *base = w->codes + p * w->pstride, *next = w->codes + pnext * w->pstride; /* next: nnext panels from pnext */
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, g++) {
        const int64_t k1 = k0 + G < K ? k0 + G : K;
        zero_tile(acc), zero_tile(odd);
        prefetch_group(w, p, np, g + 2, ngroups);
        int64_t k = k0;
#if KVF_I8_BF16
        if (bits != 4 && xb && mr >= I8_PAIR_ROWS) { /* int8 x bf16 rows: codes as whole bf16 pairs */
            const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000u);
            for (; k + 2 <= k1; k += 2) {
                if (((k - k0) & 3) == 0)
                    for (int q = 0; q < nnext; q++) __builtin_prefetch(next + q * w->pstride + k * NR, 0, KVF_NEXT_HINT);
                const int even = ((k - k0) & 2) == 0;
#pragma GCC unroll 4
                for (int q = 0; q < np; q++) {
                    const __m512bh wv = (__m512bh)i8_pairs_bf16((const int8_t *)base + q * w->pstride + k * NR, hi16);
                    dot_pair_rows(acc, odd, wv, xb, ldx, k, q, mr, even);
                }
            }
#pragma GCC unroll 4
            for (int q = 0; q < np; q++)
#pragma GCC unroll 4
                for (int r = 0; r < mr; r++) acc[r][q] = v_add(acc[r][q], odd[r][q]);
        } else if (bits != 4 && xb) { /* int8 codes x bf16 rows, 4 k at a time (see I8_HI_BF16); the rest below */
            for (; k + 4 <= k1; k += 4) {
                for (int q = 0; q < nnext; q++) __builtin_prefetch(next + q * w->pstride + k * NR, 0, KVF_NEXT_HINT);
                __m512bh x0[DR], x1[DR];
#pragma GCC unroll 4
                for (int r = 0; r < mr; r++) {
                    int32_t a, b;
                    memcpy(&a, xb + r * ldx + k, 4), memcpy(&b, xb + r * ldx + k + 2, 4);
                    x0[r] = (__m512bh)_mm512_set1_epi32(a), x1[r] = (__m512bh)_mm512_set1_epi32(b);
                }
#pragma GCC unroll 4
                for (int q = 0; q < np; q++) {
                    const __m512i line = _mm512_loadu_si512(base + q * w->pstride + k * NR);
                    const __m512i v = _mm512_permutexvar_epi8(order, line);
                    const __m512bh l0 = (__m512bh)_mm512_permutexvar_epi16(v, table);
                    const __m512bh h0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), high);
                    const __m512bh l1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table);
                    const __m512bh h1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), high);
#pragma GCC unroll 4
                    for (int r = 0; r < mr; r++) {
                        acc[r][q] = _mm512_dpbf16_ps(acc[r][q], l0, x0[r]);
                        odd[r][q] = _mm512_dpbf16_ps(odd[r][q], h0, x0[r]);
                        acc[r][q] = _mm512_dpbf16_ps(acc[r][q], l1, x1[r]);
                        odd[r][q] = _mm512_dpbf16_ps(odd[r][q], h1, x1[r]);
                    }
                }
            }
#pragma GCC unroll 4
            for (int q = 0; q < np; q++)
#pragma GCC unroll 4
                for (int r = 0; r < mr; r++) acc[r][q] = v_add(acc[r][q], odd[r][q]);
        }
#endif
        if (bits != 4) { /* int8 codes, with or without offsets (with bf16 rows: the group's last k % 4) */
            for (; k < k1; k++) {
                if ((k & 3) == 0) /* the next tile's line of these 4 k, a panel at a time */
                    for (int q = 0; q < nnext; q++) __builtin_prefetch(next + q * w->pstride + k * NR, 0, KVF_NEXT_HINT);
#pragma GCC unroll 4
                for (int q = 0; q < np; q++) {
                    const v16 wv = v_from_i8((const int8_t *)base + q * w->pstride + k * NR);
#pragma GCC unroll 4
                    for (int r = 0; r < mr; r++) acc[r][q] = v_fma_s(xf[r * ldx + k], wv, acc[r][q]);
                }
            }
#if KVF_U4_BF16
        } else if (xb) { /* int4 x bf16 rows: one dot product per pair, pairs alternating between acc and odd */
            for (; k < k1; k += 2) {
                const int even = ((k - k0) & 2) == 0;
#pragma GCC unroll 4
                for (int q = 0; q < np; q++) {
                    const __m512bh wv = u4_pairs_bf16(base + q * w->pstride + (k / 2) * NR, table);
                    dot_pair_rows(acc, odd, wv, xb, ldx, k, q, mr, even);
                }
            }
#endif
        } else {
            for (; k < k1; k += 2) { /* groups are even, so a pair never straddles two */
#pragma GCC unroll 4
                for (int q = 0; q < np; q++) {
                    v16 lo, hi;
                    v_from_u4(base + q * w->pstride + (k / 2) * NR, &lo, &hi);
#pragma GCC unroll 4
                    for (int r = 0; r < mr; r++) {
                        acc[r][q] = v_fma_s(xf[r * ldx + k], lo, acc[r][q]);
                        odd[r][q] = v_fma_s(xf[r * ldx + k + 1], hi, odd[r][q]);
                    }
                }
            }
        }
        add_group(tot, acc, odd, w, p, mr, np, bits, xsum, ngroups, g);
    }
    store_tile(tot, mr, np, tile);
}

#if KVF_I8_BF16
/* int8 x bf16, up to 8 rows against one panel in one pass (a call of PAIRS8_ROWS to PAIRS8_MAX_ROWS rows makes
 * passes of 8): each pair of k's codes is widened to bf16 once for all of them (at 8 rows, two tiles of 4 rows x
 * 2 panels widened it twice). The same sums as decode_tile's whole-pair path. */
INLINE void decode_pairs8(const float *xf, const uint16_t *xb, int64_t ldx, const qweight *w, int64_t p, const int mr,
                          const int bits, const float *xsum, int64_t ngroups, int64_t pnext, int nnext, float *tile) {
    __m512 tot[8], acc[8], odd[8];
    for (int r = 0; r < 8; r++) tot[r] = _mm512_setzero_ps();
    const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000u);
    const int64_t K = w->K, G = w->group;
    const int8_t *base = (const int8_t *)w->codes + p * w->pstride;
    const uint8_t *next = w->codes + pnext * w->pstride;
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, g++) {
        const int64_t k1 = k0 + G < K ? k0 + G : K;
        for (int r = 0; r < 8; r++) acc[r] = odd[r] = _mm512_setzero_ps();
        prefetch_group(w, p, 1, g + 2, ngroups);
        int64_t k = k0;
        for (; k + 2 <= k1; k += 2) {
            if (((k - k0) & 3) == 0)
                for (int q = 0; q < nnext; q++) __builtin_prefetch(next + q * w->pstride + k * NR, 0, KVF_NEXT_HINT);
            const int even = ((k - k0) & 2) == 0;
            const __m512bh wv = (__m512bh)i8_pairs_bf16(base + k * NR, hi16);
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) {
                int32_t xp;
                memcpy(&xp, xb + r * ldx + k, 4);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp);
                if (even) acc[r] = _mm512_dpbf16_ps(acc[r], wv, xv);
                else odd[r] = _mm512_dpbf16_ps(odd[r], wv, xv);
            }
        }
        for (int r = 0; r < mr; r++) acc[r] = _mm512_add_ps(acc[r], odd[r]);
        for (; k < k1; k++) { /* an odd group's last k */
            const v16 wv = v_from_i8(base + k * NR);
            for (int r = 0; r < mr; r++) acc[r] = v_fma_s(xf[r * ldx + k], wv, acc[r]);
        }
        const v16 sc = v_load(w->scales + g * w->Np + p * NR);
        if (bits == INT8_OFFSETS) {
            const v16 of = v_load(w->offsets + g * w->Np + p * NR);
            for (int r = 0; r < mr; r++) tot[r] = v_fma_s(xsum[r * ngroups + g], of, v_fma(acc[r], sc, tot[r]));
        } else {
            for (int r = 0; r < mr; r++) tot[r] = v_fma(acc[r], sc, tot[r]);
        }
    }
    for (int r = 0; r < mr; r++) v_store(tile + r * NR, tot[r]);
}

static void decode_block8(const float *xf, const uint16_t *xb, int64_t ldx, const qweight *w, int64_t p, int mr,
                          const float *xsum, int64_t ngroups, int64_t pnext, int nnext, float *tile) {
#define KVF_PCASE(R)                                                                                          \
    case R:                                                                                                   \
        if (w->offsets) decode_pairs8(xf, xb, ldx, w, p, R, INT8_OFFSETS, xsum, ngroups, pnext, nnext, tile); \
        else decode_pairs8(xf, xb, ldx, w, p, R, 8, xsum, ngroups, pnext, nnext, tile);                       \
        break;
    switch (mr) {
        KVF_PCASE(1) KVF_PCASE(2) KVF_PCASE(3) KVF_PCASE(4) KVF_PCASE(5) KVF_PCASE(6) KVF_PCASE(7) KVF_PCASE(8)
    default: break;
    }
#undef KVF_PCASE
}
#endif

/* One specialised copy per (rows, panels, bits): up to 2 rows x 4 panels or 4 rows x 2 panels, so the
 * totals and both accumulator sets stay in registers. */
static void decode_block(const float *xf, const uint16_t *xb, int64_t ldx, const qweight *w, int64_t p, int mr,
                         int np, const float *xsum, int64_t ngroups, int64_t pnext, int nnext, float *tile) {
#define KVF_DCASE(R, P)                                                                                \
    case (R) * 8 + (P):                                                                                \
        if (w->bits == 8 && w->offsets)                                                                \
            decode_tile(xf, xb, ldx, w, p, R, P, INT8_OFFSETS, xsum, ngroups, pnext, nnext, tile);            \
        else if (w->bits == 8) decode_tile(xf, xb, ldx, w, p, R, P, 8, xsum, ngroups, pnext, nnext, tile);    \
        else if (xb) decode_tile(xf, xb, ldx, w, p, R, P, 4, xsum, ngroups, pnext, nnext, tile);              \
        else decode_tile(xf, NULL, ldx, w, p, R, P, 4, xsum, ngroups, pnext, nnext, tile);                    \
        break;
    switch (mr * 8 + np) {
        KVF_DCASE(1, 1) KVF_DCASE(1, 2) KVF_DCASE(1, 3) KVF_DCASE(1, 4)
        KVF_DCASE(2, 1) KVF_DCASE(2, 2) KVF_DCASE(2, 3) KVF_DCASE(2, 4)
        KVF_DCASE(3, 1) KVF_DCASE(3, 2) KVF_DCASE(4, 1) KVF_DCASE(4, 2)
    default: break;
    }
#undef KVF_DCASE
}



/* Panels p..p+np-1 dequantized into scratch [np][Kp][16] fp32 (the int4 pad k, if any, is a real zero code
 * times its scale plus offset; x's pad is zero, so it adds nothing). */
static void dequantize_panels(const qweight *w, int64_t p, int np, float *scratch) {
    const int64_t K = w->K, Kp = w->Kp, G = w->group;
    for (int q = 0; q < np; q++) {
        const uint8_t *base = w->codes + (p + q) * w->pstride;
        float *out = scratch + q * Kp * NR;
        for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, g++) {
            const int64_t k1 = k0 + G < K ? k0 + G : K;
            const v16 s = v_load(w->scales + g * w->Np + (p + q) * NR);
            if (w->bits == 8 && w->offsets) {
                const v16 o = v_load(w->offsets + g * w->Np + (p + q) * NR);
                for (int64_t k = k0; k < k1; k++) v_store(out + k * NR, v_fma(v_from_i8((const int8_t *)base + k * NR), s, o));
            } else if (w->bits == 8) {
                for (int64_t k = k0; k < k1; k++) v_store(out + k * NR, v_mul(v_from_i8((const int8_t *)base + k * NR), s));
            } else {
                const v16 o = v_load(w->offsets + g * w->Np + (p + q) * NR);
                for (int64_t k = k0; k < k1; k += 2) {
                    v16 lo, hi;
                    v_from_u4(base + (k / 2) * NR, &lo, &hi);
                    v_store(out + k * NR, v_fma(lo, s, o));
                    v_store(out + (k + 1) * NR, v_fma(hi, s, o));
                }
            }
        }
    }
}

/* GEMM rows: `mr` rows of xf against np dequantized panels in scratch, fp32 FMAs in a register tile. */
INLINE void gemm_tile(const float *xf, int64_t ldx, int64_t Kp, const float *scratch, int mr, int np, float *tile) {
    v16 acc[GM][GP];
    for (int r = 0; r < GM; r++)
        for (int q = 0; q < GP; q++) acc[r][q] = v_zero();
    for (int64_t k = 0; k < Kp; k++) {
        v16 wv[GP];
#pragma GCC unroll 3
        for (int q = 0; q < np; q++) wv[q] = v_load(scratch + (q * Kp + k) * NR);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const float a = xf[r * ldx + k];
#pragma GCC unroll 3
            for (int q = 0; q < np; q++) acc[r][q] = v_fma_s(a, wv[q], acc[r][q]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < np; q++) v_store(tile + (r * np + q) * NR, acc[r][q]);
}

static void gemm_block(const float *xf, int64_t ldx, int64_t Kp, const float *scratch, int mr, int np, float *tile) {
#define KVF_GCASE(R, P) \
    case (R) * 8 + (P): gemm_tile(xf, ldx, Kp, scratch, (R) <= GM ? (R) : GM, (P) <= GP ? (P) : GP, tile); break;
#define KVF_GROW(R) KVF_GCASE(R, 1) KVF_GCASE(R, 2) KVF_GCASE(R, 3)
    switch (mr * 8 + np) {
        KVF_GROW(1) KVF_GROW(2) KVF_GROW(3) KVF_GROW(4) KVF_GROW(5) KVF_GROW(6) KVF_GROW(7) KVF_GROW(8)
    default: break;
    }
#undef KVF_GROW
#undef KVF_GCASE
}

#if KVF_U4_BF16
/* GEMM rows with bf16 activations on AVX512-BF16 CPUs (batched decode, prefill): the codes themselves become
 * bf16, not the weights. Every int8 code (-128..127) and every int4 code (0..15) is exact in bf16, and so is each
 * product code x x in fp32, so `vdpbf16ps` sums x x code per group with no rounding the fp32 path lacks; the
 * scale (and offset x the group's sum of x) is applied per group and column as the decode tiles do. It does two
 * multiply-adds per lane and instruction where the fp32 GEMM does one: the int8 / int4 batch runs as fast as the
 * bf16 panels (measured in docs/benchmarks.md), where fp32 FMAs over dequantized weights ran it at half.
 * Scratch: panels p..p+np-1 as [np][K2][16] bf16 pairs (k = 2kp low, 2kp + 1 high), an odd K's pad pair zero. */
#define BM 8 /* one group over all of K (int8 per channel): 8 rows x 3 panels = 24 accumulators */
#define BMG 4 /* groups: 4 x 3 accumulators plus 4 x 3 totals */
#define BP 3

static void codes_to_bf16_pairs(const qweight *w, int64_t p, int np, int64_t K2, uint32_t *scratch) {
    const __m512i table = _mm512_loadu_si512((const void *)U4_BF16), high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int q = 0; q < np; q++) {
        const uint8_t *base = w->codes + (p + q) * w->pstride;
        uint32_t *out = scratch + q * K2 * NR;
        for (int64_t kp = 0; kp < K2; kp++) {
            __m512i v;
            if (w->bits == 8) { /* an integer's fp32 bits end in 16 zeros: its bf16 is the top half */
                const int8_t *c = (const int8_t *)base + 2 * kp * NR;
                v = 2 * kp + 1 < w->K ? i8_pairs_bf16(c, high) : _mm512_srli_epi32(i8_bf16_bits(c), 16);
            } else {
                v = (__m512i)u4_pairs_bf16(base + kp * NR, table);
            }
            _mm512_storeu_si512((void *)(out + kp * NR), v);
        }
    }
}

/* `mr` rows of bf16 pairs (row stride ldx pairs) against np panels of scratch; grouped: per-group sums scaled
 * into totals; else (one group) the sums scaled once at the end. */
INLINE void bgemm_tile(const uint32_t *xp, int64_t ldx, const uint32_t *scr, int64_t K2, const qweight *w, int64_t p,
                       int mr, int np, const float *xsum, int64_t ngroups, const int grouped, float *tile) {
    __m512 acc[BM][BP], tot[BMG][BP];
    const int64_t g2 = grouped ? w->group / 2 : K2;
    for (int64_t kp0 = 0, g = 0; kp0 < K2; kp0 += g2, g++) {
        const int64_t kp1 = kp0 + g2 < K2 ? kp0 + g2 : K2;
        for (int r = 0; r < mr; r++)
            for (int q = 0; q < np; q++) acc[r][q] = _mm512_setzero_ps();
        for (int64_t kp = kp0; kp < kp1; kp++) {
            __m512bh wv[BP];
#pragma GCC unroll 3
            for (int q = 0; q < np; q++) wv[q] = (__m512bh)_mm512_loadu_si512((const void *)(scr + (q * K2 + kp) * NR));
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[r * ldx + kp]);
#pragma GCC unroll 3
                for (int q = 0; q < np; q++) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], wv[q], xv);
            }
        }
#pragma GCC unroll 3
        for (int q = 0; q < np; q++) {
            const __m512 sc = _mm512_loadu_ps(w->scales + g * w->Np + (p + q) * NR);
            const __m512 of = w->offsets ? _mm512_loadu_ps(w->offsets + g * w->Np + (p + q) * NR) : _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) {
                __m512 t = grouped ? (g ? _mm512_fmadd_ps(acc[r][q], sc, tot[r % BMG][q]) : _mm512_mul_ps(acc[r][q], sc))
                                   : _mm512_mul_ps(acc[r][q], sc);
                if (w->offsets) t = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * ngroups + g]), of, t);
                if (grouped) tot[r % BMG][q] = t;
                else acc[r][q] = t;
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < np; q++) _mm512_storeu_ps(tile + (r * np + q) * NR, grouped ? tot[r % BMG][q] : acc[r][q]);
}

static void bgemm_block(const uint32_t *xp, int64_t ldx, const uint32_t *scr, int64_t K2, const qweight *w,
                        int64_t p, int mr, int np, const float *xsum, int64_t ngroups, int grouped, float *tile) {
#define KVF_BCASE(R, P)                                                                                      \
    case (R) * 8 + (P):                                                                                      \
        if (grouped) bgemm_tile(xp, ldx, scr, K2, w, p, (R) <= BMG ? (R) : BMG, P, xsum, ngroups, 1, tile); \
        else bgemm_tile(xp, ldx, scr, K2, w, p, R, P, xsum, ngroups, 0, tile);                               \
        break;
#define KVF_BROW(R) KVF_BCASE(R, 1) KVF_BCASE(R, 2) KVF_BCASE(R, 3)
    switch (mr * 8 + np) {
        KVF_BROW(1) KVF_BROW(2) KVF_BROW(3) KVF_BROW(4) KVF_BROW(5) KVF_BROW(6) KVF_BROW(7) KVF_BROW(8)
    default: break;
    }
#undef KVF_BROW
#undef KVF_BCASE
}
#endif

/* Scratch per thread for the GEMM path: as many panels (up to GP) as fit in this many bytes of L2. */
#define SCRATCH_BYTES (512 * 1024)
/* A tile's fp32 results: the larger of the GEMM tile (GM x GP panels) and the decode tile (DR x DP). */
#define TILE_FLOATS (GM * GP > DR * DP ? GM * GP * NR : DR * DP * NR)

/* x: [M, K] fp32 (x_bf16 = 0) or bf16; y: [M, N] in x's dtype; bias: [N] fp32 or NULL (the caller widens a
 * bf16 bias). codes / scales / offsets: the layout above. Returns 0, or -1 when out of memory. */
int kvf_qlinear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, int bits, const float *scales,
                const float *offsets, int64_t group, int64_t N, const float *bias, void *y, int nthreads) {
    const int64_t P = (N + NR - 1) / NR;
    qweight w = {codes, scales, offsets, K, bits == 4 ? K + (K & 1) : K, N, P * NR, group, 0, bits};
    w.pstride = bits == 4 ? (w.Kp / 2) * NR : K * NR;
    const int64_t Kp = w.Kp, K2 = (K + 1) / 2;
    const int64_t ngroups = (K + group - 1) / group;
    /* bf16 GEMM rows (codes as bf16, see bgemm_tile) wherever groups hold whole k pairs */
    /* int8 x bf16 rows from PAIRS8_ROWS to PAIRS8_MAX_ROWS: the decode walk, up to 8 rows a pass over each panel */
    const int rows8 = KVF_I8_BF16 && x_bf16 && bits == 8 && M >= PAIRS8_ROWS && M <= PAIRS8_MAX_ROWS;
    const int decode = M <= DECODE_ROWS || rows8;
    const int bgemm = KVF_U4_BF16 && x_bf16 && !decode && (ngroups == 1 || group % 2 == 0);
    /* x as fp32 rows of Kp (a copy when x is bf16 or K must be padded), for every path but bgemm */
    float *xpad = NULL;
    const float *xf = (const float *)x;
    if (!bgemm && (x_bf16 || Kp != K)) {
        xpad = (float *)malloc((size_t)(M * Kp) * sizeof(float));
        if (!xpad) return -1;
        for (int64_t r = 0; r < M; r++) {
            float *dst = xpad + r * Kp;
            if (x_bf16)
                for (int64_t k = 0; k < K; k++) dst[k] = bf16_to_f32(((const uint16_t *)x)[r * K + k]);
            else
                memcpy(dst, (const float *)x + r * K, (size_t)K * sizeof(float));
            for (int64_t k = K; k < Kp; k++) dst[k] = 0.0f;
        }
        xf = xpad;
    }
    /* decode rows and bgemm with offsets (int4; int8 groups from GGUF's Q5_1 / Q5_K): each row's sum of x per
     * group (the offsets' term) */
    float *xsum = NULL;
    if (offsets && (decode || bgemm)) {
        xsum = (float *)malloc((size_t)(M * ngroups) * sizeof(float));
        if (!xsum) {
            free(xpad);
            return -1;
        }
        for (int64_t r = 0; r < M; r++)
            for (int64_t g = 0; g < ngroups; g++) {
                float sum = 0.0f;
                for (int64_t k = g * group; k < (g + 1) * group && k < K; k++)
                    sum += bgemm ? bf16_to_f32(((const uint16_t *)x)[r * K + k]) : xf[r * Kp + k];
                xsum[r * ngroups + g] = sum;
            }
    }
    /* int4 decode rows and bgemm with bf16 x: the dot-product paths read x as bf16 pairs (a zero-padded copy
     * for odd K) */
    const uint16_t *xb = NULL;
    uint16_t *xbpad = NULL;
    if (KVF_I8_BF16 && x_bf16 && bits == 8 && decode) {
        xb = (const uint16_t *)x; /* int8 decode rows read x[k..k+3] for k + 4 <= K only: no padding */
    } else if (KVF_U4_BF16 && x_bf16 && ((bits == 4 && M <= DECODE_ROWS) || bgemm)) {
        xb = (const uint16_t *)x;
        if (K & 1) {
            xbpad = (uint16_t *)calloc((size_t)(M * 2 * K2), sizeof(uint16_t));
            if (!xbpad) {
                free(xsum), free(xpad);
                return -1;
            }
            for (int64_t r = 0; r < M; r++) memcpy(xbpad + r * 2 * K2, (const uint16_t *)x + r * K, (size_t)K * 2);
            xb = xbpad;
        }
    }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > P) nthreads = (int)P;
    const size_t ysz = x_bf16 ? 2 : 4;
    int failed = 0;
    /* decode rows: panels handed out from both ends (kvf_steal.h); NULL: the even split */
    kvf_range *ranges = decode ? kvf_ranges_new(P, nthreads) : NULL;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        KVF_TEAM(tid, nth);
        const int64_t p0 = P * tid / nth, p1 = P * (tid + 1) / nth;
        float tile[TILE_FLOATS];
        if (decode) {
            const int rows = (int)(M < DR ? M : DR), dp = rows8 ? PAIRS8_PANELS : rows <= 2 ? DP : 2;
            kvf_walk walk = kvf_walk_start(ranges, nthreads, (int)nth, (int)tid, dp, P);
            int64_t p, pnext = 0;
            for (int np; (np = kvf_walk_next(&walk, &p)) > 0;) {
                const int nnext = bits == 8 && (M <= QNEXT_ROWS || rows8) ? kvf_walk_peek(&walk, &pnext) : 0;
#if KVF_I8_BF16
                if (rows8) {
                    for (int q = 0; q < np; q++)
                        for (int64_t i = 0; i < M; i += 8) {
                            const int mr = (int)(M - i < 8 ? M - i : 8), last = i + 8 >= M;
                            const int64_t pn = q + 1 < np ? p + q + 1 : pnext; /* the next panel, prefetched */
                            const int nn = !last ? 0 : q + 1 < np ? 1 : nnext;   /* by the last pass only */
                            decode_block8(xf + i * Kp, xb + i * Kp, Kp, &w, p + q, mr, xsum ? xsum + i * ngroups : NULL,
                                          ngroups, pn, nn, tile);
                            write_rows(tile, mr, 1, (char *)y + (size_t)(i * N) * ysz, x_bf16, N, (p + q) * NR, bias);
                        }
                    continue;
                }
#endif
                for (int64_t i = 0; i < M; i += rows) {
                    const int mr = (int)(M - i < rows ? M - i : rows);
                    decode_block(xf + i * Kp, xb ? xb + i * Kp : NULL, Kp, &w, p, mr, np, xsum ? xsum + i * ngroups : NULL,
                                 ngroups, pnext, nnext, tile);
                    write_rows(tile, mr, np, (char *)y + (size_t)(i * N) * ysz, x_bf16, N, p * NR, bias);
                }
            }
        }
#if KVF_U4_BF16
        else if (bgemm && p1 > p0) {
            int64_t per = SCRATCH_BYTES / (K2 * NR * (int64_t)sizeof(uint32_t));
            per = per < 1 ? 1 : (per > BP ? BP : per);
            uint32_t *scratch = (uint32_t *)aligned_alloc(64, (size_t)((per * K2 * NR * sizeof(uint32_t) + 63) / 64 * 64));
            if (!scratch) {
                failed = 1;
            } else {
                const int grouped = ngroups > 1, rows = grouped ? BMG : BM;
                for (int64_t p = p0; p < p1; p += per) {
                    const int np = (int)(p1 - p < per ? p1 - p : per);
                    codes_to_bf16_pairs(&w, p, np, K2, scratch);
                    for (int64_t i = 0; i < M; i += rows) {
                        const int mr = (int)(M - i < rows ? M - i : rows);
                        bgemm_block((const uint32_t *)xb + i * K2, K2, scratch, K2, &w, p, mr, np,
                                    xsum ? xsum + i * ngroups : NULL, ngroups, grouped, tile);
                        write_rows(tile, mr, np, (char *)y + (size_t)(i * N) * ysz, x_bf16, N, p * NR, bias);
                    }
                }
                free(scratch);
            }
        }
#endif
        else if (p1 > p0) {
            int64_t per = SCRATCH_BYTES / (Kp * NR * (int64_t)sizeof(float));
            per = per < 1 ? 1 : (per > GP ? GP : per);
            float *scratch = (float *)aligned_alloc(64, (size_t)((per * Kp * NR * sizeof(float) + 63) / 64 * 64));
            if (!scratch) {
                failed = 1;
            } else {
                for (int64_t p = p0; p < p1; p += per) {
                    const int np = (int)(p1 - p < per ? p1 - p : per);
                    dequantize_panels(&w, p, np, scratch);
                    for (int64_t i = 0; i < M; i += GM) {
                        const int mr = (int)(M - i < GM ? M - i : GM);
                        gemm_block(xf + i * Kp, Kp, Kp, scratch, mr, np, tile);
                        write_rows(tile, mr, np, (char *)y + (size_t)(i * N) * ysz, x_bf16, N, p * NR, bias);
                    }
                }
                free(scratch);
            }
        }
    }
    free(ranges);
    free(xbpad);
    free(xsum);
    free(xpad);
    return failed ? -1 : 0;
}

/* ---- int8 activations (`quantization="w8a8_int8"`): int8 x int8 products summed in int32 ----
 *
 * Why: at 8 and more rows (a batch's decode, prefill) the multiply, not the bytes, bounds an int8 linear:
 * widening the codes to bf16 costs the bgemm path ~20% against the bf16 panels. With the activations also
 * int8, `vpdpbusd` does 4 multiply-adds per lane and instruction where `vdpbf16ps` does 2, on the stored codes.
 *
 * Each row of x is quantized in groups of A8_GROUP = 32 consecutive k (symmetric): s = max|x_g| / 127,
 * q = round(x / s) (nearest even). Per token, one scale for the whole row, took the default model's
 * perplexity up 4-7% (its attention inputs carry a few outlier channels); groups of 32 (OpenVINO's default
 * for dynamic quantization on CPU) hold it within 0.4%. Per group the integer dot d_g = sum_k q x code is
 * exact; y[r][n] = ws_n x sum_g float(d_g) x s_rg, the groups added in order with one fp32 FMA each.
 * `vpdpbusd` multiplies unsigned bytes with signed ones, so the codes become u = code + 128 (one xor per 64
 * codes) and each group's sum starts at -128 x sum_k q instead of 0: after the group it is d_g.
 *
 * The stored layout is kept ([panels][K][16]): 4 consecutive k of a panel are 64 contiguous bytes, and one
 * `vpermb` regroups them to the 4 bytes per column `vpdpbusd` reads.
 * AVX512-VNNI + VBMI where the compiler targets them, else plain C over the same integers and FMAs (the same
 * bits). */
#if KVF_SIMD == 2 && defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define KVF_A8_VNNI 1
#else
#define KVF_A8_VNNI 0
#endif
#define A8_GROUP 32
/* Tile: up to 4 rows x 3 panels, 12 int32 group sums and their 12 fp32 totals, all in registers. Measured on the
 * 1B model's four linears, 32 / 256 rows, 2 threads: 8 x 3 with the totals in L1 took 4.34 / 26.9 ms a layer, 6 x 3
 * 3.88 / 24.9, 4 x 4 3.67 / 24.5, 4 x 3 in L1 3.58 / 23.8, 4 x 3 in registers 3.42 / 21.6. */
#define A8M 4
#define A8P 3
/* One row runs A8P1 panels a tile (A8P1 code streams a thread), and up to A8NEXT_ROWS rows prefetch the thread's
 * next tile into L2 while they run (as w4a8's tiles, below). A step's linears of the 1B model, both threads, the
 * builds' steps interleaved in one process (lower quartile of 12 a round): one row with 6 panels 1.03-1.08x
 * the 3-panel tile (8 panels 1.01-1.09x, 4 panels 1.02-1.07x); the next-tile prefetch 1.03-1.06x at 4 rows,
 * 0.97-1.06x at one. */
#ifndef A8P1
#define A8P1 6
#endif
#define A8PMAX 8 /* the widest tile a8_block has a case for */
#if A8P1 > A8PMAX || A8P1 < 1
#error "A8P1 must be 1-8"
#endif
#ifndef A8NEXT_ROWS
#define A8NEXT_ROWS A8M
#endif
typedef int32_t kvf_i32a __attribute__((may_alias, aligned(1))); /* 4 bytes of q read as one */

int kvf_qlinear_a8_vnni(void) { return KVF_A8_VNNI; }
int kvf_qlinear_a8_group(void) { return A8_GROUP; }

/* Rows r0..r1 of x quantized: q [rows][K4 x 4] int8 (zero past K); per group g of A8_GROUP k, s [rows][G] and
 * start [rows][G] = -128 x sum of the group's q. */
static void quantize_rows_a8(const void *x, int x_bf16, int64_t r0, int64_t r1, int64_t K, int64_t K4, int64_t G,
                             int8_t *q, float *s, int32_t *start) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *xb = (const uint16_t *)x + r * K;
        const float *xf = (const float *)x + r * K;
        int8_t *qr = q + r * K4 * 4;
        for (int64_t g = 0; g < G; g++) {
            const int64_t k0 = g * A8_GROUP, k1 = k0 + A8_GROUP < K ? k0 + A8_GROUP : K;
#if KVF_SIMD == 2 && defined(__AVX512BW__)
            if (k1 - k0 == 32) { /* a whole group in two vectors: the same divide, rounding and clamp */
                __m512 v[2];
                for (int h = 0; h < 2; h++)
                    v[h] = x_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb + k0 + 16 * h))), 16))
                                  : _mm512_loadu_ps(xf + k0 + 16 * h);
                const float sc = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1]))) / 127.0f;
                __m512i sum = _mm512_setzero_si512();
                for (int h = 0; h < 2; h++) {
                    __m512i t = _mm512_setzero_si512();
                    if (sc > 0.0f) {
                        const __m512 d = _mm512_div_ps(v[h], _mm512_set1_ps(sc)); /* rounded as the MXCSR says: */
                        t = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(d, _mm512_set1_ps(-127.0f)),
                                                             _mm512_set1_ps(127.0f))); /* nearest even */
                    }
                    _mm_storeu_si128((__m128i *)(qr + k0 + 16 * h), _mm512_cvtepi32_epi8(t));
                    sum = _mm512_add_epi32(sum, t);
                }
                s[r * G + g] = sc;
                start[r * G + g] = -128 * _mm512_reduce_add_epi32(sum);
                continue;
            }
#endif
            float amax = 0.0f;
            for (int64_t k = k0; k < k1; k++) {
                const float v = x_bf16 ? bf16_to_f32(xb[k]) : xf[k];
                const float a = v < 0 ? -v : v;
                amax = a > amax || a != a ? a : amax; /* a NaN makes the group's scale NaN, as torch's amax does */
            }
            const float sc = amax / 127.0f;
            int32_t sum = 0;
            for (int64_t k = k0; k < k1; k++) {
                const float v = x_bf16 ? bf16_to_f32(xb[k]) : xf[k];
                float t = sc > 0.0f ? __builtin_nearbyintf(v / sc) : 0.0f;
                t = t > 127.0f ? 127.0f : (t < -127.0f ? -127.0f : t);
                qr[k] = (int8_t)t;
                sum += qr[k];
            }
            s[r * G + g] = sc;
            start[r * G + g] = -128 * sum;
        }
        for (int64_t k = K; k < K4 * 4; k++) qr[k] = 0;
    }
}

/* `mr` rows of q (row stride K4 x 4 bytes) against panels p..p+np-1: out[r][c][16] = sum_g float(d_g) x s_rg. */
INLINE void a8_tile(const int8_t *q, int64_t K4, int64_t K, int64_t G, const float *s, const int32_t *start,
                    const qweight *w, int64_t p, int mr, int np, int64_t pnext, int nnext, float *out) {
#if KVF_A8_VNNI
    /* byte 4c + j of the result is byte 16j + c of the 64 loaded: k = 4k4 + j of column c */
    const __m512i perm = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12,
                                         59, 43, 27, 11, 58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8,
                                         55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4,
                                         51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 tot[A8M][A8PMAX];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int c = 0; c < np; c++) tot[r][c] = _mm512_setzero_ps();
    const int64_t full = K / 4;
    const uint8_t *base = w->codes + p * w->pstride, *next = w->codes + pnext * w->pstride; /* next: nnext panels from pnext */
    __m512i acc[A8M][A8PMAX];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        const __m512i st = _mm512_set1_epi32(start[r * G]);
#pragma GCC unroll 8
        for (int c = 0; c < np; c++) acc[r][c] = st;
    }
    for (int64_t k4 = 0; k4 < K4; k4++) {
        /* past K (the last k4 only) a zero byte, 128 after the flip, meets q = 0 */
        const __mmask64 m = k4 < full ? ~(__mmask64)0 : (((__mmask64)1 << ((K - 4 * k4) * 16)) - 1);
        __m512i wv[A8PMAX];
        for (int c = 0; c < nnext; c++) __builtin_prefetch(next + c * w->pstride + k4 * 64, 0, KVF_NEXT_HINT);
#pragma GCC unroll 8
        for (int c = 0; c < np; c++)
            wv[c] = _mm512_xor_si512(
                _mm512_permutexvar_epi8(perm, _mm512_maskz_loadu_epi8(m, base + c * w->pstride + k4 * 64)), flip);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const __m512i xv = _mm512_set1_epi32(((const kvf_i32a *)(q + r * K4 * 4))[k4]);
#pragma GCC unroll 8
            for (int c = 0; c < np; c++) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], wv[c], xv);
        }
        if ((k4 + 1) % (A8_GROUP / 4) == 0 || k4 + 1 == K4) { /* the end of group g: into the fp32 sums */
            const int64_t g = k4 / (A8_GROUP / 4);
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) {
                const __m512 sv = _mm512_set1_ps(s[r * G + g]);
                const __m512i st = _mm512_set1_epi32(g + 1 < G ? start[r * G + g + 1] : 0);
#pragma GCC unroll 8
                for (int c = 0; c < np; c++) {
                    tot[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), sv, tot[r][c]);
                    acc[r][c] = st;
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int c = 0; c < np; c++) _mm512_storeu_ps(out + (r * np + c) * NR, tot[r][c]);
#else
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < np; c++) {
            const int8_t *codes = (const int8_t *)w->codes + (p + c) * w->pstride;
            for (int j = 0; j < NR; j++) {
                float tot = 0.0f;
                for (int64_t g = 0; g < G; g++) {
                    int32_t d = start[r * G + g];
                    for (int64_t k = g * A8_GROUP; k < (g + 1) * A8_GROUP && k < K; k++)
                        d += (int32_t)q[r * K4 * 4 + k] * ((int32_t)codes[k * NR + j] + 128);
                    tot = __builtin_fmaf((float)d, s[r * G + g], tot);
                }
                out[(r * np + c) * NR + j] = tot;
            }
        }
    (void)K4, (void)pnext, (void)nnext;
#endif
}

static void a8_block(const int8_t *q, int64_t K4, int64_t K, int64_t G, const float *s, const int32_t *start,
                     const qweight *w, int64_t p, int mr, int np, int64_t pnext, int nnext, float *out) {
#define KVF_ACASE(R, P) \
    case (R) * 8 + (P): a8_tile(q, K4, K, G, s, start, w, p, R, P, pnext, nnext, out); break;
#define KVF_AROW(R) KVF_ACASE(R, 1) KVF_ACASE(R, 2) KVF_ACASE(R, 3)
    switch (mr * 8 + np) {
        KVF_AROW(1) KVF_AROW(2) KVF_AROW(3) KVF_AROW(4)
        KVF_ACASE(1, 4) KVF_ACASE(1, 5) KVF_ACASE(1, 6) KVF_ACASE(1, 7) KVF_ACASE(1, 8)
    default: break;
    }
#undef KVF_AROW
#undef KVF_ACASE
}

/* The quantized rows of x: q [M][K4 x 4], per group s and start [M][G] (see quantize_rows_a8), and for w4a8 xs
 * [M][GW] (0: none). All NULL when out of memory. */
typedef struct {
    int8_t *q;
    float *s, *xs;
    int32_t *start;
} a8_rows;

static void a8_rows_free(a8_rows *a) {
    free(a->q), free(a->s), free(a->xs), free(a->start);
    a->q = NULL;
}

static a8_rows a8_rows_alloc(int64_t M, int64_t K4, int64_t G, int64_t GW) {
    a8_rows a = {(int8_t *)malloc((size_t)(M * K4 * 4)), (float *)malloc((size_t)(M * G) * sizeof(float)),
                 GW ? (float *)malloc((size_t)(M * GW) * sizeof(float)) : NULL,
                 (int32_t *)malloc((size_t)(M * G) * sizeof(int32_t))};
    if (!a.q || !a.s || !a.start || (GW && !a.xs)) a8_rows_free(&a);
    return a;
}

/* y[M, N] = x[M, K] @ W^T (+ bias) with W int8 per output channel (scales [Np]) and x quantized as above;
 * y in x's dtype (y = ws_n x the tile's sum, one fp32 multiply). Returns 0, or -1 when out of memory. */
int kvf_qlinear_a8(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, const float *scales,
                   int64_t N, const float *bias, void *y, int nthreads) {
    const int64_t P = (N + NR - 1) / NR, K4 = (K + 3) / 4, G = (K + A8_GROUP - 1) / A8_GROUP;
    const qweight w = {codes, scales, NULL, K, K, N, P * NR, K, K * NR, 8};
    a8_rows a = a8_rows_alloc(M, K4, G, 0);
    if (!a.q) return -1;
    int8_t *q = a.q;
    float *s = a.s;
    int32_t *start = a.start;
    nthreads = nthreads < 1 ? 1 : (nthreads > P ? (int)P : nthreads);
    const size_t ysz = x_bf16 ? 2 : 4;
    kvf_range *ranges = kvf_ranges_new(P, nthreads); /* panels from both ends (kvf_steal.h); NULL: even split */
#pragma omp parallel num_threads(nthreads)
    {
        KVF_TEAM(tid, nth);
        quantize_rows_a8(x, x_bf16, M * tid / nth, M * (tid + 1) / nth, K, K4, G, q, s, start);
#pragma omp barrier
        const int rows = M <= A8M ? (int)M : A8M, per = M == 1 ? A8P1 : A8P;
        float tile[A8M * A8PMAX * NR];
        kvf_walk walk = kvf_walk_start(ranges, nthreads, (int)nth, (int)tid, per, P);
        int64_t p, pnext = 0;
        for (int np; (np = kvf_walk_next(&walk, &p)) > 0;) {
            const int nnext = M <= A8NEXT_ROWS ? kvf_walk_peek(&walk, &pnext) : 0;
            for (int64_t i = 0; i < M; i += rows) {
                const int mr = (int)(M - i < rows ? M - i : rows);
                a8_block(q + i * K4 * 4, K4, K, G, s + i * G, start + i * G, &w, p, mr, np, pnext, nnext, tile);
                for (int r = 0; r < mr; r++)
                    for (int c = 0; c < np; c++)
                        for (int j = 0; j < NR; j++) tile[(r * np + c) * NR + j] *= scales[(p + c) * NR + j];
                write_rows(tile, mr, np, (char *)y + (size_t)(i * N) * ysz, x_bf16, N, p * NR, bias);
            }
        }
    }
    free(ranges);
    a8_rows_free(&a);
    return 0;
}

/* ---- int4 weights x int8 activations (`quantization="w4a8"`) ----
 *
 * Why: with bf16 activations an int4 decode row costs 5 instructions per 32 weights (widen, two to build the
 * nibble pair, `vpermw`, `vdpbf16ps`), so one stream of the 1B model reads its int4 bytes at ~0.8x the rate bf16
 * reads its own: the unpacking, not the bytes, sets the pace. With the activations quantized to int8 (as
 * w8a8_int8 does, groups of A8_GROUP k per row) the nibbles go to `vpdpbusd` as they are, unsigned bytes
 * against signed activations: 64 bytes of codes (128 weights) take one load, one shift, two masks and then
 * two `vpdpbusd` per row, each summing 4 products per lane.
 *
 * Its own layout, so that no byte needs moving: codes [panels][K8 = ceil(K/8)][16][4] bytes; byte b of
 * column j at k8 holds u(k = 8 k8 + b) in its low nibble and u(k = 8 k8 + 4 + b) in its high one (u in
 * [0, 15], zero past K). The low nibbles of 64 bytes are then 4 consecutive k per column (one dword lane),
 * multiplied with the row's q[8 k8 .. 8 k8 + 3] broadcast, and the high ones with q[8 k8 + 4 .. + 7].
 * Weight groups (scale s and offset o per group of `group` k and column, w = u s + o, both fp16 as GGUF's:
 * 4 bytes a group instead of 8, 5% of an int4 g128 weight's bytes) are whole activation
 * groups (group % A8_GROUP == 0), so per activation group h of row r there is the exact integer dot
 * d_h = sum_k q_k u_k; then per weight group g (scale s, offset o), with X_g the fp32 sum, in order, of the
 * row's a_h x sum_k q_k (a_h its activation scale) over g's h:
 *   gacc = fma(float(d_h), a_h, gacc) over g's h in order; tot = fma(gacc, s, tot); tot = fma(X_g, o, tot)
 * which is sum_k (u_k s + o) x q_k a_h: the dequantized weights times the dequantized activations. One FMA
 * per lane per activation group and two per weight group (a multiply-add for each of a_h, s and o per
 * activation group measured 1.66x one row's time at 4 rows). `reference_a8w4` (quant_linear.py) computes
 * the same bits in torch; the plain-C path (no VNNI) too. */

/* fp16 -> fp32 (exact) for the plain-C path; the AVX-512 path uses vcvtph2ps. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) { /* zero or subnormal: m x 2^-24, exact in fp32 */
        const float f = (float)m * 0x1p-24f;
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Tiles: 1 row x 8 panels (one stream: 8 streams of codes per thread read 4-8% faster than 4, A/B in one process
 * on the 1B model's linears, 2 threads), 2 rows x 4 panels, or up to 4 rows x 2 panels. W4PF: the codes W4PF x 64
 * bytes ahead are prefetched in each panel (4 rows: 1.11x; one row: no change).
 * Up to W4NEXT_ROWS rows (one row block a tile) also prefetch the thread's next tile (see KVF_NEXT_HINT; 8 panels
 * x K x 8 bytes, 128-512 KiB on the 1B model, fit in L2): twice the streams in flight. A step's linears of the
 * 1B model, both threads, the two builds' steps interleaved in one process (lower quartile of 12 a round): one
 * row 1.09-1.12x, 4 rows
 * 1.10-1.13x; one stream per 8-panel group (codes interleaved per k8) in place of 8 panel streams was 0.77x,
 * hint 3 (into L1) 0.87x. */
#ifndef W4PF
#define W4PF 8
#endif
#ifndef W4NEXT_ROWS
#define W4NEXT_ROWS W4M
#endif
#ifndef W4DP
#define W4DP 8
#endif
#define W4M 4
#define W4P 8

INLINE void w4_tile(const int8_t *q, int64_t K8, int64_t G, const float *s, const float *xs, int64_t GW,
                    const qweight *w, int64_t p, int mr, int np, int64_t pnext, int nnext, float *out) {
    const int64_t ldq = K8 * 8, Np = w->Np, hpg = w->group / A8_GROUP; /* activation groups per weight group */
    const uint16_t *sc = (const uint16_t *)w->scales, *of = (const uint16_t *)w->offsets; /* fp16 */
#if KVF_A8_VNNI
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 tot[W4M][W4P];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int c = 0; c < np; c++) tot[r][c] = _mm512_setzero_ps();
    const uint8_t *base = w->codes + p * w->pstride, *next = w->codes + pnext * w->pstride; /* next: nnext panels from pnext */
    for (int64_t gw = 0; gw < GW; gw++) {
        __m512 gacc[W4M][W4P];
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
            for (int c = 0; c < np; c++) gacc[r][c] = _mm512_setzero_ps();
        /* the next group's scales are Np floats away: no stream the hardware prefetcher follows */
        if (gw + 1 < GW)
            for (int c = 0; c < np; c++) {
                __builtin_prefetch(sc + (gw + 1) * Np + (p + c) * NR);
                __builtin_prefetch(of + (gw + 1) * Np + (p + c) * NR);
            }
        const int64_t h1 = (gw + 1) * hpg < G ? (gw + 1) * hpg : G;
        for (int64_t h = gw * hpg; h < h1; h++) {
            const int64_t k8a = h * (A8_GROUP / 8), k8b = k8a + A8_GROUP / 8 < K8 ? k8a + A8_GROUP / 8 : K8;
            __m512i acc[W4M][W4P];
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
                for (int c = 0; c < np; c++) acc[r][c] = _mm512_setzero_si512();
            for (int64_t k8 = k8a; k8 < k8b; k8++) {
                __m512i lo[W4P], hi[W4P];
#if W4PF
#pragma GCC unroll 8
                for (int c = 0; c < np; c++) __builtin_prefetch(base + c * w->pstride + (k8 + W4PF) * 64);
#endif
                for (int c = 0; c < nnext; c++) __builtin_prefetch(next + c * w->pstride + k8 * 64, 0, KVF_NEXT_HINT);
#pragma GCC unroll 8
                for (int c = 0; c < np; c++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(base + c * w->pstride + k8 * 64));
                    lo[c] = _mm512_and_si512(v, m4);
                    hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                }
#pragma GCC unroll 8
                for (int r = 0; r < mr; r++) {
                    const kvf_i32a *qr = (const kvf_i32a *)(q + r * ldq);
                    const __m512i xl = _mm512_set1_epi32(qr[2 * k8]), xh = _mm512_set1_epi32(qr[2 * k8 + 1]);
#pragma GCC unroll 8
                    for (int c = 0; c < np; c++) {
                        acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], lo[c], xl);
                        acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], hi[c], xh);
                    }
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) {
                const __m512 a = _mm512_set1_ps(s[r * G + h]);
#pragma GCC unroll 8
                for (int c = 0; c < np; c++) gacc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), a, gacc[r][c]);
            }
        }
#pragma GCC unroll 8
        for (int c = 0; c < np; c++) {
            const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + gw * Np + (p + c) * NR)));
            const __m512 ow = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(of + gw * Np + (p + c) * NR)));
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) {
                tot[r][c] = _mm512_fmadd_ps(gacc[r][c], sw, tot[r][c]);
                tot[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * GW + gw]), ow, tot[r][c]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int c = 0; c < np; c++) _mm512_storeu_ps(out + (r * np + c) * NR, tot[r][c]);
#else
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < np; c++) {
            const uint8_t *codes = w->codes + (p + c) * w->pstride;
            for (int j = 0; j < NR; j++) {
                const int64_t n = (p + c) * NR + j;
                float tot = 0.0f;
                for (int64_t gw = 0; gw < GW; gw++) {
                    float gacc = 0.0f;
                    for (int64_t h = gw * hpg; h < (gw + 1) * hpg && h < G; h++) {
                        int32_t d = 0;
                        for (int64_t k = h * A8_GROUP; k < (h + 1) * A8_GROUP && k < K8 * 8; k++) {
                            const uint8_t byte = codes[(k / 8) * 64 + j * 4 + (k % 4)];
                            d += (int32_t)q[r * ldq + k] * (int32_t)((k % 8) < 4 ? byte & 15 : byte >> 4);
                        }
                        gacc = __builtin_fmaf((float)d, s[r * G + h], gacc);
                    }
                    tot = __builtin_fmaf(gacc, f16_to_f32(sc[gw * Np + n]), tot);
                    tot = __builtin_fmaf(xs[r * GW + gw], f16_to_f32(of[gw * Np + n]), tot);
                }
                out[(r * np + c) * NR + j] = tot;
            }
        }
#endif
}

static void w4_block(const int8_t *q, int64_t K8, int64_t G, const float *s, const float *xs, int64_t GW,
                     const qweight *w, int64_t p, int mr, int np, int64_t pnext, int nnext, float *out) {
#define KVF_WCASE(R, P) \
    case (R) * 8 + (P): w4_tile(q, K8, G, s, xs, GW, w, p, R, P, pnext, nnext, out); break;
    switch (mr * 8 + np) {
        KVF_WCASE(1, 1) KVF_WCASE(1, 2) KVF_WCASE(1, 3) KVF_WCASE(1, 4)
        KVF_WCASE(1, 5) KVF_WCASE(1, 6) KVF_WCASE(1, 7) KVF_WCASE(1, 8)
        KVF_WCASE(2, 1) KVF_WCASE(2, 2) KVF_WCASE(2, 3) KVF_WCASE(2, 4)
        KVF_WCASE(3, 1) KVF_WCASE(3, 2) KVF_WCASE(4, 1) KVF_WCASE(4, 2)
    default: break;
    }
#undef KVF_WCASE
}

/* y[M, N] = x[M, K] @ W^T (+ bias) with W int4 in groups of `group` k (a multiple of A8_GROUP; scales and
 * offsets [groups][Np] fp16) in the layout above, and x quantized per row in groups of A8_GROUP; y in x's dtype.
 * Returns 0, or -1 when out of memory or `group` is not a multiple of A8_GROUP. */
int kvf_qlinear_a8w4(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, const void *scales,
                     const void *offsets, int64_t group, int64_t N, const float *bias, void *y, int nthreads) {
    if (group <= 0 || group % A8_GROUP) return -1;
    const int64_t P = (N + NR - 1) / NR, K8 = (K + 7) / 8, G = (K + A8_GROUP - 1) / A8_GROUP;
    const qweight w = {codes, (const float *)scales, (const float *)offsets, K, K8 * 8, N, P * NR, group, K8 * 64, 4};
    const int64_t GW = (K + group - 1) / group;
    a8_rows a = a8_rows_alloc(M, 2 * K8, G, GW);
    if (!a.q) return -1;
    int8_t *q = a.q;
    float *s = a.s, *xs = a.xs;
    int32_t *start = a.start;
    nthreads = nthreads < 1 ? 1 : (nthreads > P ? (int)P : nthreads);
    const size_t ysz = x_bf16 ? 2 : 4;
    kvf_range *ranges = kvf_ranges_new(P, nthreads); /* panels from both ends (kvf_steal.h); NULL: even split */
#pragma omp parallel num_threads(nthreads)
    {
        KVF_TEAM(tid, nth);
        const int64_t r0 = M * tid / nth, r1 = M * (tid + 1) / nth;
        quantize_rows_a8(x, x_bf16, r0, r1, K, 2 * K8, G, q, s, start);
        for (int64_t r = r0; r < r1; r++) /* per weight group: the sum over its h of a_h x sum_k q_k, in order */
            for (int64_t h = 0; h < G; h++) {
                const float v = s[r * G + h] * (float)(-start[r * G + h] / 128);
                float *t = xs + r * GW + h * A8_GROUP / group;
                *t = h * A8_GROUP % group == 0 ? v : *t + v;
            }
#pragma omp barrier
        const int rows = M < W4M ? (int)M : W4M, per = rows == 1 ? W4DP : (rows == 2 ? 4 : 2);
        float tile[W4M * W4P * NR];
        kvf_walk walk = kvf_walk_start(ranges, nthreads, (int)nth, (int)tid, per, P);
        int64_t p, pnext = 0;
        for (int np; (np = kvf_walk_next(&walk, &p)) > 0;) {
            const int nnext = M <= W4NEXT_ROWS ? kvf_walk_peek(&walk, &pnext) : 0;
            for (int64_t i = 0; i < M; i += rows) {
                const int mr = (int)(M - i < rows ? M - i : rows);
                w4_block(q + i * K8 * 8, K8, G, s + i * G, xs + i * GW, GW, &w, p, mr, np, pnext, nnext, tile);
                write_rows(tile, mr, np, (char *)y + (size_t)(i * N) * ysz, x_bf16, N, p * NR, bias);
            }
        }
    }
    free(ranges);
    a8_rows_free(&a);
    return 0;
}

/* One quantized weight as the fused decode layers (decode_layers.c) hold it: everything `kvf_qlinear` takes
 * about W, so the loop can call it through one pointer per matmul. */
typedef struct {
    const uint8_t *codes;
    const float *scales, *offsets;
    int64_t group;
    int64_t bits;
    int64_t act8; /* 1: int8 activations in groups along K (`kvf_qlinear_a8`, int8 per channel; `kvf_qlinear_a8w4`, int4) */
    const int32_t *perm; /* NULL, or [K]: stored k multiplies input x[perm[k]] (a GPTQ checkpoint in activation order) */
} kvf_qdesc;

int kvf_qlinear_desc(const void *x, int x_bf16, int64_t M, int64_t K, const void *desc, int64_t N, void *y,
                     int nthreads) {
    const kvf_qdesc *d = (const kvf_qdesc *)desc;
    if (d->act8 && d->bits == 4)
        return kvf_qlinear_a8w4(x, x_bf16, M, K, d->codes, d->scales, d->offsets, d->group, N, NULL, y, nthreads);
    if (d->act8) return kvf_qlinear_a8(x, x_bf16, M, K, d->codes, d->scales, N, NULL, y, nthreads);
    if (!d->perm)
        return kvf_qlinear(x, x_bf16, M, K, d->codes, (int)d->bits, d->scales, d->offsets, d->group, N, NULL, y,
                           nthreads);
    /* the inputs gathered into the codes' order: M x K values, a few KiB a decode row */
    size_t esz = x_bf16 ? 2 : 4;
    char *xp = malloc((size_t)(M * K) * esz);
    if (!xp) return -1;
    for (int64_t i = 0; i < M; i++) {
        const char *src = (const char *)x + (size_t)(i * K) * esz;
        char *dst = xp + (size_t)(i * K) * esz;
        if (x_bf16)
            for (int64_t k = 0; k < K; k++) ((uint16_t *)dst)[k] = ((const uint16_t *)src)[d->perm[k]];
        else
            for (int64_t k = 0; k < K; k++) ((float *)dst)[k] = ((const float *)src)[d->perm[k]];
    }
    int rc = kvf_qlinear(xp, x_bf16, M, K, d->codes, (int)d->bits, d->scales, d->offsets, d->group, N, NULL, y,
                         nthreads);
    free(xp);
    return rc;
}

/* ---- int4 weight quantization: each group's scale and offset chosen by a search ----
 *
 * Why: splitting a group's [min, max] into 15 steps wastes levels wherever the extremes are rare, and on a
 * weight that was already on a coarser grid (a GGUF's 4- or 5-bit blocks) it misses that grid. For every
 * candidate step count n (`cands`, quant_linear.INT4_STEP_CANDIDATES) the group is rounded on the step
 * (max - min) / n (n > 15 clips both ends evenly), then the scale and offset are refitted by least squares
 * to those codes, the group is rounded again on the fitted pair, and the pair with the least squared error
 * is kept, unless the plain min/max rule (tried first) does better, so the error never goes up; a group that
 * lies on a grid of at most 15 steps is found exactly. Codes [N][K] uint8 in [0, 15], scales and offsets
 * [N][ceil(K / group)] fp32 (rounded to fp16 first when fp16_params: w4a8 stores them so); w = code x scale
 * + offset.
 */
static float int4_group_error(const float *x, int64_t cnt, float s, float m) {
    const float inv = 1.0f / s;
    float e = 0.0f;
#pragma omp simd reduction(+ : e)
    for (int64_t i = 0; i < cnt; i++) {
        const float l = fminf(fmaxf(rintf((x[i] - m) * inv), 0.0f), 15.0f);
        const float d = l * s + m - x[i];
        e += d * d;
    }
    return e;
}

static float round_param(float v, int fp16) { return fp16 ? (float)(_Float16)v : v; }

static void int4_group(const float *x, int64_t cnt, const float *cands, int ncand, int fp16, uint8_t *codes,
                       float *scale, float *offset) {
    float lo = x[0], hi = x[0], sx = 0.0f;
#pragma omp simd reduction(min : lo) reduction(max : hi) reduction(+ : sx)
    for (int64_t i = 0; i < cnt; i++) {
        lo = fminf(lo, x[i]);
        hi = fmaxf(hi, x[i]);
        sx += x[i];
    }
    const float span = hi - lo, n0 = (float)cnt;
    float best_s = round_param(span / 15.0f, fp16), best_m = round_param(lo, fp16), best_e = INFINITY;
    if (span > 0.0f && best_s > 0.0f) best_e = int4_group_error(x, cnt, best_s, best_m); /* the min/max rule */
    for (int c = 0; c < ncand && span > 0.0f; c++) {
        const float s = span / cands[c], a = lo + fmaxf(span - 15.0f * s, 0.0f) * 0.5f, inv = 1.0f / s;
        float sl = 0.0f, sll = 0.0f, sxl = 0.0f;
#pragma omp simd reduction(+ : sl, sll, sxl)
        for (int64_t i = 0; i < cnt; i++) {
            const float l = fminf(fmaxf(rintf((x[i] - a) * inv), 0.0f), 15.0f);
            sl += l;
            sll += l * l;
            sxl += x[i] * l;
        }
        float fs = s, fm = a;
        const float det = n0 * sll - sl * sl;
        if (det > 1e-6f * n0 * n0) {
            const float f = (n0 * sxl - sx * sl) / det;
            if (f > 0.0f) fs = f, fm = (sx - f * sl) / n0;
        }
        fs = round_param(fs, fp16), fm = round_param(fm, fp16);
        if (!(fs > 0.0f) || !isfinite(fs) || !isfinite(fm)) continue;
        const float e = int4_group_error(x, cnt, fs, fm);
        if (e < best_e) best_e = e, best_s = fs, best_m = fm;
    }
    const float inv = best_s > 0.0f ? 1.0f / best_s : 1.0f;
    for (int64_t i = 0; i < cnt; i++) codes[i] = (uint8_t)fminf(fmaxf(rintf((x[i] - best_m) * inv), 0.0f), 15.0f);
    *scale = best_s, *offset = best_m;
}

/* The same search for LANES whole groups at once, one group per vector lane (GCC's generic vectors: one zmm,
 * two ymm, or what the target has): the groups are transposed into xt [group][LANES] (group <=
 * MAX_LANE_GROUP) so every step is a vertical operation and no sum is reduced across lanes; int4_group takes
 * the rest. The two compute the same formulas; their fp32 sums are added in different orders. */
#define LANES 16
#define MAX_LANE_GROUP 256
typedef float vlane __attribute__((vector_size(LANES * 4)));
typedef int32_t vlane_mask __attribute__((vector_size(LANES * 4)));

INLINE vlane lane_select(vlane_mask m, vlane a, vlane b) { return (vlane)((m & (vlane_mask)a) | (~m & (vlane_mask)b)); }
INLINE vlane lane_min(vlane a, vlane b) { return lane_select(a < b, a, b); }
INLINE vlane lane_max(vlane a, vlane b) { return lane_select(a > b, a, b); }
/* clamp(rint(v), 0, 15): clamped first to [-1, 16], where adding and taking away 1.5 x 2^23 rounds to the
 * nearest integer (ties to even), as rintf does */
INLINE vlane lane_code(vlane v) {
    const vlane zero = {0}, magic = zero + 12582912.0f;
    v = lane_min(lane_max(v, zero - 1.0f), zero + 16.0f);
    v = (v + magic) - magic;
    return lane_min(lane_max(v, zero), zero + 15.0f);
}

static void int4_lanes(const float *x, int64_t group, const float *cands, int ncand, int fp16, uint8_t *codes,
                       float *scale, float *offset, vlane *xt) {
    for (int64_t i = 0; i < group; i++)
        for (int j = 0; j < LANES; j++) xt[i][j] = x[j * group + i];
    const vlane zero = {0};
    vlane lo = xt[0], hi = xt[0], sx = zero;
    for (int64_t i = 0; i < group; i++) lo = lane_min(lo, xt[i]), hi = lane_max(hi, xt[i]), sx += xt[i];
    const vlane span = hi - lo, n0 = zero + (float)group;
    vlane best_s = span / 15.0f, best_m = lo, best_e = zero;
    for (int j = 0; j < LANES; j++) best_s[j] = round_param(best_s[j], fp16), best_m[j] = round_param(best_m[j], fp16);
    const vlane best_iv = 1.0f / best_s; /* the min/max rule's error, which the candidates must beat */
    for (int64_t i = 0; i < group; i++) {
        const vlane d = lane_code((xt[i] - best_m) * best_iv) * best_s + best_m - xt[i];
        best_e += d * d;
    }
    best_e = lane_select((span > zero) & (best_s > zero), best_e, zero + INFINITY);
    for (int c = 0; c < ncand; c++) {
        const vlane s = span / cands[c], a = lo + lane_max(span - 15.0f * s, zero) * 0.5f, inv = 1.0f / s;
        vlane sl = zero, sll = zero, sxl = zero;
        for (int64_t i = 0; i < group; i++) {
            const vlane l = lane_code((xt[i] - a) * inv);
            sl += l, sll += l * l, sxl += xt[i] * l;
        }
        const vlane det = n0 * sll - sl * sl, f = (n0 * sxl - sx * sl) / det;
        const vlane_mask fit = (det > 1e-6f * n0 * n0) & (f > zero);
        vlane fs = lane_select(fit, f, s), fm = lane_select(fit, (sx - f * sl) / n0, a);
        if (fp16)
            for (int j = 0; j < LANES; j++) fs[j] = round_param(fs[j], 1), fm[j] = round_param(fm[j], 1);
        const vlane iv = 1.0f / fs;
        vlane e = zero;
        for (int64_t i = 0; i < group; i++) {
            const vlane d = lane_code((xt[i] - fm) * iv) * fs + fm - xt[i];
            e += d * d;
        }
        const vlane_mask take = (span > zero) & (fs > zero) & (fs < INFINITY) & (fm < INFINITY) & (fm > -INFINITY) &
                                (e < best_e);
        best_e = lane_select(take, e, best_e), best_s = lane_select(take, fs, best_s);
        best_m = lane_select(take, fm, best_m);
    }
    const vlane iv = lane_select(best_s > zero, 1.0f / best_s, zero + 1.0f);
    for (int64_t i = 0; i < group; i++) {
        const vlane l = lane_code((xt[i] - best_m) * iv);
        for (int j = 0; j < LANES; j++) codes[j * group + i] = (uint8_t)l[j];
    }
    for (int j = 0; j < LANES; j++) scale[j] = best_s[j], offset[j] = best_m[j];
}

int kvf_quantize_int4(const float *w, int64_t N, int64_t K, int64_t group, const float *cands, int ncand,
                      int fp16_params, uint8_t *codes, float *scales, float *offsets, int nthreads) {
    if (group < 1 || K < 1) return -1;
    const int64_t G = (K + group - 1) / group, whole = K / group;
    const int64_t lane_groups = group <= MAX_LANE_GROUP ? whole / LANES * LANES : 0;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        vlane xt[MAX_LANE_GROUP];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < N; r++) {
            for (int64_t g = 0; g < lane_groups; g += LANES)
                int4_lanes(w + r * K + g * group, group, cands, ncand, fp16_params, codes + r * K + g * group,
                           scales + r * G + g, offsets + r * G + g, xt);
            for (int64_t g = lane_groups; g < G; g++) {
                const int64_t k0 = g * group, cnt = K - k0 < group ? K - k0 : group;
                int4_group(w + r * K + k0, cnt, cands, ncand, fp16_params, codes + r * K + k0, scales + r * G + g,
                           offsets + r * G + g);
            }
        }
    }
    return 0;
}
