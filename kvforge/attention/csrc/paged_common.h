/* What the paged decode (paged_decode.c, with its kernels in paged_decode_q8.c and paged_decode_avx2.c) and
 * prefill (paged_prefill.c) units share: the `kvf_kv` operand (a cache's rows as stored: dense, fp8, int8
 * or int4 with their scales), row loads and dequantisation, the AVX-512 / AVX2 building blocks, and the
 * head-group dispatch. Why a header and four units: they compile side by side (kvforge/native builds a
 * library's units at once, then links them), so the first-use build on a 2-core machine takes half the
 * compiler time. Everything here is static: each unit keeps what it calls.
 * The layouts and dtype codes are described at the top of paged_decode.c.
 */
#ifndef KVF_PAGED_COMMON_H
#define KVF_PAGED_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_bf16.h"
#include "kvf_omp.h"

/* Load n elements of dtype `code` starting at p into dst as fp32. */
/* Build time (issue 39): the decode kernel's variants (head-group size G x storage code x path) used to
 * be inlined into one OpenMP body, and gcc's dataflow and register-allocation passes grow faster than
 * linearly with a function's size: ~64 s of CPU for paged_decode.c. Each kernel a decode step calls per
 * 16-token chunk is instead its own function (KVF_OUTLINED), with its storage code and mode fixed by a
 * wrapper (KVF_Q8_VARIANT below) and G fixed by gcc's interprocedural constant propagation, which
 * clones a function once per constant it is called with (the attention library is built with
 * `--param ipa-cp-eval-threshold=1` so that every G gets its clone: kvforge/attention/cpu_kernel.py).
 * The clones hold the same code as the inlined variants did; a call per chunk costs nothing measurable. */
#define KVF_OUTLINED static __attribute__((noinline))

static inline __attribute__((always_inline)) void load_row(float *restrict dst, const void *p, int n, int code) {
    if (code == 0) {
        memcpy(dst, p, (size_t)n * sizeof(float));
    } else if (code == 1) {
        const uint16_t *s = (const uint16_t *)p;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        const _Float16 *s = (const _Float16 *)p;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = (float)s[i];
    }
}

static inline void store_row(void *p, const float *restrict src, int n, int code) {
    if (code == 0) {
        memcpy(p, src, (size_t)n * sizeof(float));
    } else if (code == 1) {
        uint16_t *d = (uint16_t *)p;
        for (int i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        _Float16 *d = (_Float16 *)p;
        for (int i = 0; i < n; i++) d[i] = (_Float16)src[i];
    }
}

/* ---- compressed rows ------------------------------------------------------------------------ */
enum { KVF_F32 = 0, KVF_BF16 = 1, KVF_F16 = 2, KVF_E4M3 = 3, KVF_E5M2 = 4, KVF_INT8 = 5, KVF_INT4 = 6 };
enum { KVF_SCALE_NONE = 0, KVF_SCALE_TENSOR = 1, KVF_SCALE_TOKEN = 2, KVF_SCALE_HEAD = 3, KVF_SCALE_CHANNEL = 4 };

/* One of K or V as it lies in the block pool. Token t of block b is row b * BS + t (its "slot"). */
typedef struct {
    const char *data;   /* codes or values */
    const float *scale; /* tensor: [1]; token: [NB * BS]; head: [NB * BS, heads]; channel: [NB, heads, dim] */
    int64_t row_bytes;  /* one token, all heads */
    int64_t head_bytes; /* one head within a row */
    int64_t heads;      /* heads per row (scale indexing) */
    int64_t dim;        /* elements per head (scale indexing) */
    int32_t code;       /* KVF_F32 .. KVF_INT4 */
    int32_t gran;       /* KVF_SCALE_* */
} kvf_kv;

/* fp8 e4m3 (no infinities; 0x7F/0xFF never produced by the quantizer) as fp32, branch-free so loops
 * vectorise, and without fp32 denormals (the kernels run with DAZ set): normals rebias the exponent
 * (+120), subnormals m * 2^-9 come from an integer conversion. */
static inline float e4m3_to_f32(uint8_t b) {
    const uint32_t em = b & 0x7Fu;
    const uint32_t u = ((uint32_t)(b & 0x80u) << 24) | ((em << 20) + (120u << 23));
    float normal, sub = (float)(em & 7u) * (1.f / 512.f);
    memcpy(&normal, &u, 4);
    sub = (b & 0x80u) ? -sub : sub;
    return (em >> 3) ? normal : sub;
}

/* fp8 e5m2 is the top byte of an IEEE half. */
static inline float e5m2_to_f32(uint8_t b) {
    const uint16_t u = (uint16_t)((uint16_t)b << 8);
    _Float16 h;
    memcpy(&h, &u, 2);
    return (float)h;
}

/* Round fp32 to the compute dtype in place (code 1 bf16, 2 fp16), as the reference's `.to(dtype)`. */
static inline __attribute__((always_inline)) void round_row(float *restrict x, int n, int code) {
    if (code == KVF_BF16) {
#pragma omp simd
        for (int i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
    } else if (code == KVF_F16) {
#pragma omp simd
        for (int i = 0; i < n; i++) x[i] = (float)(_Float16)x[i];
    }
}

/* Row `slot`, head h of operand `op` as n fp32 values: a pointer into the pool when it already holds
 * fp32, else decoded (and scaled, and rounded to `compute` when the storage differs) into dst. */
static inline __attribute__((always_inline)) const float *kv_row(
    float *restrict dst, const kvf_kv *op, int64_t slot, int64_t h, int n, int64_t BS, int compute) {
    const char *p = op->data + slot * op->row_bytes + h * op->head_bytes;
    const uint8_t *c = (const uint8_t *)p;
    switch (op->code) {
    case KVF_F32:
        if (compute == KVF_F32) return (const float *)p; /* fp32 storage is never scaled */
        memcpy(dst, p, (size_t)n * sizeof(float));
        break;
    case KVF_BF16:
    case KVF_F16:
        load_row(dst, p, n, op->code);
        break;
    case KVF_E4M3:
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = e4m3_to_f32(c[i]);
        break;
    case KVF_E5M2:
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = e5m2_to_f32(c[i]);
        break;
    case KVF_INT8:
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = (float)(int8_t)c[i];
        break;
    default: /* KVF_INT4: two offset-binary codes a byte, the even element in the low nibble */
#pragma omp simd
        for (int i = 0; i < n / 2; i++) {
            dst[2 * i] = (float)((int)(c[i] & 15u) - 8);
            dst[2 * i + 1] = (float)((int)(c[i] >> 4) - 8);
        }
        break;
    }
    if (op->gran == KVF_SCALE_CHANNEL) {
        const float *s = op->scale + ((slot / BS) * op->heads + h) * op->dim;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] *= s[i];
    } else if (op->gran != KVF_SCALE_NONE) {
        const float s = op->gran == KVF_SCALE_TENSOR ? op->scale[0]
                        : op->gran == KVF_SCALE_TOKEN ? op->scale[slot] : op->scale[slot * op->heads + h];
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] *= s;
    }
    if (compute != op->code) round_row(dst, n, compute);
    return dst;
}


static inline __attribute__((always_inline)) float dot_f32(const float *restrict a, const float *restrict b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline __attribute__((always_inline)) void axpy_f32(float *restrict y, float w, const float *restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += w * x[i];
}

/* One key row (fp32) against the G query heads of its group: scores st[g * stride]. */
static inline __attribute__((always_inline)) void score_row(
    const float *qf, const float *k, int64_t G, int D, float *st, int64_t stride) {
    for (int64_t g = 0; g < G; g++) st[g * stride] = dot_f32(qf + g * D, k, D);
}

/* One value row (fp32) added into the G heads' accumulators, weighted by their probabilities pt[g * stride]. */
static inline __attribute__((always_inline)) void accumulate_row(
    float *acc, const float *v, int64_t G, int DV, const float *pt, int64_t stride) {
    for (int64_t g = 0; g < G; g++) axpy_f32(acc + g * DV, pt[g * stride], v, DV);
}


#ifndef KVF_PREFETCH_ROWS
#define KVF_PREFETCH_ROWS 32
#endif
/* The dense AVX-512 path also fetches each V row into L2 while the score pass walks its K row (this
 * many rows behind the cursor), so the weighted-V pass after the softmax reads from cache: a thread
 * keeps two streams in flight instead of one. Past L2's size (long contexts) the rows wait in L3. */
#ifndef KVF_V_PREFETCH_LAG
#define KVF_V_PREFETCH_LAG 32
#endif
/* fp32 rows of several KV heads per item walk whole rows in order (`scores_rows_f32` below; 0: the per-head
 * passes, for an A/B), KVF_ROW_STREAMS 16-row tiles' rows in turn. */
#ifndef KVF_ROW_MAJOR_F32
#define KVF_ROW_MAJOR_F32 1
#endif
#ifndef KVF_ROW_STREAMS
#define KVF_ROW_STREAMS 3
#endif
/* Fetch the whole rows [i0, i0 + cnt) (all KV heads) ahead of use into L2 (prefetcht1): measured
 * 20% faster per bf16 layer out of DRAM than into L1, whose few miss buffers the 6-12 lines of each
 * row fill up. Blocks are scattered in the pool, so the hardware prefetchers lose the stream at
 * every block boundary; these do not. Past a pass's first rows, the AVX-512 paths issue them spread out
 * instead (`prefetch_segment`: per row and KV head computed, that head's segment of the row
 * KVF_PREFETCH_ROWS ahead): a burst of a tile's 48-192 prefetches stalled on the miss buffers and held
 * back the loads of the tile's compute, so memory and compute took turns. Spread, they overlap: per layer
 * out of DRAM on a 2-core Zen 5, 1.35x (fp32 KV), 1.3-1.45x (bf16), 1.12-1.25x (int8, fp8), same
 * outputs (`benchmarks/decode_kernel_ab.py`, 32 x 400 tokens, 30 layers); a plain read of the same
 * scattered blocks with 4 FMAs a line went from 0.90 to 0.56 ms a layer the same way. */
static inline void prefetch_rows(const char *cache, const int64_t *slots, int64_t i0, int64_t cnt, size_t row) {
    for (int64_t i = i0; i < i0 + cnt; i++)
        for (size_t off = 0; off < row; off += 64) __builtin_prefetch(cache + slots[i] * row + off, 0, 2);
}

/* One head's segment of a row (bytes, whole lines) into L2, for the spread prefetches of the dense paths. */
static inline __attribute__((always_inline)) void prefetch_segment(const char *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define KVF_HAVE_AVX512 1

/* Sixteen 16-lane partial dot products in, one vector of their sixteen sums out (lane r = sum of
 * v[r]). A transpose-and-add tree: 45 vector ops for 16 scores, where a horizontal reduction per
 * score would take about 8 each, and the reductions were what bounded the score pass. */
/* One add of the reduction tree: fp32, or int32 lanes held in float registers (exact integer sums). */
static inline __attribute__((always_inline)) __m512 add16(__m512 a, __m512 b, const int ints) {
    return ints ? _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)))
                : _mm512_add_ps(a, b);
}

static inline __attribute__((always_inline)) __m512 reduce16_as(const __m512 *v, const int ints) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = add16(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]), ints);
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = add16(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)), ints);
    }
    for (int i = 0; i < 2; i++)
        w[i] = add16(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                     _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD), ints);
    return add16(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD), ints);
}

static inline __attribute__((always_inline)) __m512 reduce16(const __m512 *v) { return reduce16_as(v, 0); }

/* q . k for 64 fp32 elements held in four vectors each, left as 16 lane sums (two chains, one add). */
static inline __attribute__((always_inline)) __m512 dot64_lanes(const __m512 *q, const __m512 *k) {
    __m512 x = _mm512_mul_ps(q[0], k[0]), y = _mm512_mul_ps(q[1], k[1]);
    x = _mm512_fmadd_ps(q[2], k[2], x);
    y = _mm512_fmadd_ps(q[3], k[3], y);
    return _mm512_add_ps(x, y);
}

/* 64 values of dtype code 0 (fp32) or 1 (bf16) as four fp32 vectors. */
static inline __attribute__((always_inline)) void load64(const char *p, int code, __m512 *x) {
    if (code == 0) {
        for (int c = 0; c < 4; c++) x[c] = _mm512_loadu_ps((const float *)p + 16 * c);
    } else {
        for (int c = 0; c < 4; c++) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)p + c);
            x[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
    }
}

/* Scores of rows [i0, i0 + cnt) (cnt <= 16) of one KV head against its G query heads, head size 64,
 * into st[g * n + i]. G is a compile-time constant at every call site, so the per-head loops
 * unroll. bf16 rows are multiplied as bf16 pairs (exact products, fp32 sums) where the CPU has
 * AVX512-BF16; fp32 queries (qf, 4 vectors a head) are used otherwise. */
KVF_OUTLINED void scores_d64(
    const char *qp, const char *k_cache, const int64_t *slots, int64_t i0, int cnt, int64_t n, size_t k_row,
    size_t head_off, int code, float *st, const char *v_cache, size_t v_row, const int G) {
    __m512 part[8 * 16];
    const size_t seg = code == 0 ? 256 : 128;
    __m512 qf[8][4];
#if defined(__AVX512BF16__)
    __m512bh qb[8][2];
    if (code == 1) {
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 2; c++) qb[g][c] = (__m512bh)_mm512_loadu_si512(qp + g * 128 + 64 * c);
    } else
#endif
        for (int g = 0; g < G; g++) load64(qp + (size_t)g * 64 * (code == 0 ? 4 : 2), code, qf[g]);
    for (int r = 0; r < 16; r++) {
        if (r >= cnt) {
            for (int g = 0; g < G; g++) part[g * 16 + r] = _mm512_setzero_ps();
            continue;
        }
        const char *kp = k_cache + slots[i0 + r] * k_row + head_off;
        const int64_t ik = i0 + r + KVF_PREFETCH_ROWS, iv = i0 + r - KVF_V_PREFETCH_LAG;
        if (ik < n) prefetch_segment(k_cache + slots[ik] * k_row + head_off, seg);
        if (iv >= 0) prefetch_segment(v_cache + slots[iv] * v_row + head_off, seg);
#if defined(__AVX512BF16__)
        if (code == 1) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp), k1 = (__m512bh)_mm512_loadu_si512(kp + 64);
            for (int g = 0; g < G; g++)
                part[g * 16 + r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], k0), qb[g][1], k1);
            continue;
        }
#endif
        __m512 k[4];
        load64(kp, code, k);
        for (int g = 0; g < G; g++) part[g * 16 + r] = dot64_lanes(qf[g], k);
    }
    const __mmask16 m = (__mmask16)((1u << cnt) - 1u);
    for (int g = 0; g < G; g++) _mm512_mask_storeu_ps(st + g * n + i0, m, reduce16(part + g * 16));
}

/* acc[g] += sum over rows [i0, i0 + cnt) of p_gi * v_i for one KV head, head size 64, where p_gi = e[g * n + i] x
 * inv[g] (the softmax's exponentials and 1 / their sum); the G x 64 accumulators stay in registers across the rows. */
KVF_OUTLINED void values_d64(
    const float *e, const float *inv, const char *v_cache, const int64_t *slots, int64_t i0, int cnt, int64_t n,
    size_t v_row, size_t head_off, int code, float *acc_mem, const int G) {
    __m512 acc[8][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_loadu_ps(acc_mem + g * 64 + 16 * c);
    for (int64_t i = i0; i < i0 + cnt; i++) {
        __m512 v[4];
        if (i + KVF_PREFETCH_ROWS < n) prefetch_segment(v_cache + slots[i + KVF_PREFETCH_ROWS] * v_row + head_off, code == 0 ? 256 : 128);
        load64(v_cache + slots[i] * v_row + head_off, code, v);
        for (int g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(e[g * n + i] * inv[g]);
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc_mem + g * 64 + 16 * c, acc[g][c]);
}

/* ---- fp32 rows walked whole, in order (all the item's KV heads of a row before the next row) ----------
 * The per-head passes above sweep a 16-row tile once per KV head, each sweep reading one head's 256 bytes
 * of every 768-byte row. Out of DRAM that order is slow on Intel (2-core Xeon with AMX): the block's lines
 * are demanded in a strided order and only software prefetches, limited by the core's L1 miss buffers,
 * keep them coming (a read of scattered 12 KiB blocks in that order, 20 GB/s at 2 threads). Read row by row,
 * the L2's own stream prefetcher, which needs no L1 miss buffers, follows each 4 KiB page once its first
 * line has been asked for; so these passes prefetch only the lines that start a page or a block (run
 * starts), 16 x KVF_ROW_STREAMS rows ahead (27 GB/s for the same read). The scores are bitwise
 * `scores_d64`'s; the V rows are summed in another order than `values_d64`'s (fp32 rounding apart). */
/* The lines of row i's bytes [off, off + len) that start a run the L2 stream prefetcher cannot see coming:
 * the segment's first line when it does not continue row i - 1's segment, and each line opening a new
 * 4 KiB page inside it. */
static inline __attribute__((always_inline)) void prefetch_run_starts(const char *cache, const int64_t *slots, int64_t i,
                                                                      size_t row, size_t off, size_t len) {
    const char *p = cache + slots[i] * row + off;
    const int follows = len == row && i > 0 && slots[i] == slots[i - 1] + 1;
    if (!follows || ((uintptr_t)p & 4095) < 64) __builtin_prefetch(p, 0, 2);
    const uintptr_t end = (uintptr_t)p + len;
    for (uintptr_t pg = ((uintptr_t)p | 4095) + 1; pg < end; pg += 4096) __builtin_prefetch((const char *)pg, 0, 2);
}

/* Scores of the rows of KVF_ROW_STREAMS consecutive 16-row tiles from i0 against HG consecutive KV heads'
 * G query heads each (qf: the item's fp32 queries, 64 floats a head), into st[h * n + i] for the item's
 * query head h = j * G + g. The tiles' rows are taken in turn (row r of each tile, then row r + 1), so
 * that as many page streams advance at once: each then moves at a third of the pace, which keeps the L2
 * stream prefetcher's fixed distance ahead of it long enough to cover DRAM latency. The rows r of the
 * tiles are scored together, each query loaded once for them. Each tile's scores are still its 16 rows'
 * products reduced together, so they are bitwise `scores_d64`'s.
 * part: scratch of KVF_ROW_STREAMS * HG * G * 16 vectors. */
KVF_OUTLINED void scores_rows_f32(
    const float *qf, const char *k_cache, const int64_t *slots, int64_t i0, int64_t n, size_t k_row,
    size_t off0, int64_t HG, float *st, __m512 *part, const int G) {
    const size_t seg = (size_t)HG * 256;
    const int64_t NHG = HG * G, ahead = 16 * KVF_ROW_STREAMS;
    int cnt[KVF_ROW_STREAMS];
    for (int t = 0; t < KVF_ROW_STREAMS; t++) {
        const int64_t left = n - i0 - 16 * t;
        cnt[t] = left <= 0 ? 0 : left < 16 ? (int)left : 16;
    }
    for (int r = 0; r < 16; r++) {
        /* rows past a tile's end read the first row instead: their lanes are never stored */
        const char *kp[KVF_ROW_STREAMS];
        for (int t = 0; t < KVF_ROW_STREAMS; t++) {
            const int64_t i = i0 + 16 * t + r;
            if (r < cnt[t] && i + ahead < n) prefetch_run_starts(k_cache, slots, i + ahead, k_row, off0, seg);
            kp[t] = k_cache + slots[r < cnt[t] ? i : i0] * k_row + off0;
        }
        for (int64_t j = 0; j < HG; j++) {
            __m512 k[KVF_ROW_STREAMS][4];
            for (int t = 0; t < KVF_ROW_STREAMS; t++) load64(kp[t] + j * 256, 0, k[t]);
            for (int g = 0; g < G; g++) {
                __m512 q[4];
                load64((const char *)(qf + (j * G + g) * 64), 0, q);
                for (int t = 0; t < KVF_ROW_STREAMS; t++) part[(t * NHG + j * G + g) * 16 + r] = dot64_lanes(q, k[t]);
            }
        }
    }
    for (int t = 0; t < KVF_ROW_STREAMS && cnt[t] > 0; t++) {
        const __mmask16 m = (__mmask16)((1u << cnt[t]) - 1u);
        for (int64_t h = 0; h < NHG; h++)
            _mm512_mask_storeu_ps(st + h * n + i0 + 16 * t, m, reduce16(part + (t * NHG + h) * 16));
    }
}

/* acc[h] = sum of e[h * n + i] x inv[h] x v_i over rows [0, n) for the item's query heads h = j * G + g of
 * HG consecutive KV heads, each row read whole once, in the score pass's order (row r of each of
 * KVF_ROW_STREAMS tiles in turn). The rows r of the tiles are added together, each head's accumulators
 * (in memory, acc) loaded and stored once for them. The order depends on n alone, so a sequence's output
 * does not depend on its batch. */
KVF_OUTLINED void values_rows_f32(
    const float *e, const float *inv, const char *v_cache, const int64_t *slots, int64_t n, size_t v_row,
    size_t off0, int64_t HG, float *acc, const int G) {
    const size_t seg = (size_t)HG * 256;
    const int64_t NHG = HG * G, ahead = 16 * KVF_ROW_STREAMS;
    memset(acc, 0, sizeof(float) * NHG * 64);
    for (int64_t i = 0; i < n && i < ahead; i++) prefetch_run_starts(v_cache, slots, i, v_row, off0, seg);
    for (int64_t i0 = 0; i0 < n; i0 += ahead)
        for (int r = 0; r < 16; r++) {
            int64_t idx[KVF_ROW_STREAMS];
            int nr = 0; /* the tiles' rows r that exist: a prefix of the tiles */
            for (int t = 0; t < KVF_ROW_STREAMS; t++) {
                const int64_t i = i0 + 16 * t + r;
                if (i >= n) break;
                if (i + ahead < n) prefetch_run_starts(v_cache, slots, i + ahead, v_row, off0, seg);
                idx[nr++] = i;
            }
            if (nr == 0) break;
            for (int64_t j = 0; j < HG; j++) {
                __m512 v[KVF_ROW_STREAMS][4];
                for (int t = 0; t < nr; t++) load64(v_cache + slots[idx[t]] * v_row + off0 + j * 256, 0, v[t]);
                for (int g = 0; g < G; g++) {
                    const int64_t h = j * G + g;
                    float *a = acc + h * 64;
                    __m512 s[4];
                    for (int c = 0; c < 4; c++) s[c] = _mm512_loadu_ps(a + 16 * c);
                    if (nr == KVF_ROW_STREAMS) { /* every group but the last: a constant trip count, unrolled */
                        for (int t = 0; t < KVF_ROW_STREAMS; t++) {
                            const __m512 w = _mm512_set1_ps(e[h * n + idx[t]] * inv[h]);
                            for (int c = 0; c < 4; c++) s[c] = _mm512_fmadd_ps(w, v[t][c], s[c]);
                        }
                    } else {
                        for (int t = 0; t < nr; t++) {
                            const __m512 w = _mm512_set1_ps(e[h * n + idx[t]] * inv[h]);
                            for (int c = 0; c < 4; c++) s[c] = _mm512_fmadd_ps(w, v[t][c], s[c]);
                        }
                    }
                    for (int c = 0; c < 4; c++) _mm512_storeu_ps(a + 16 * c, s[c]);
                }
            }
        }
}

/* ---- 8-bit rows on the AVX-512 path: int8, fp8 e4m3 and e5m2 with one scale per row -----------------
 * (token, head or tensor granularity; per-channel scales and int4 take the AVX2 path). 16 codes become
 * 16 floats in one register (int8: sign-extend + convert; e5m2: the top byte of a half; e4m3: its bits
 * moved into a half, i.e. the value / 256, as `load8`), and the row's scale multiplies its score (K)
 * or its probability (V) once instead of its 64 elements, for fp32 and bf16 compute alike: the same
 * products in another order, so the result differs from dequantize-then-attend by rounding only (bf16
 * compute: the reference rounds each dequantized element to bf16 first, this path keeps it in fp32). */
static inline __attribute__((always_inline)) __m512 load16_q8(const char *p, int c, const int code) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p + c);
    if (code == KVF_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    if (code == KVF_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7); /* KVF_E4M3: s eeee mmm -> half / 256 */
    return _mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16((short)0xBF80)));
}

/* The factor row `slot`, head h owes: its scale (x 256 for e4m3, whose codes load as value / 256). */
static inline __attribute__((always_inline)) float q8_factor(const kvf_kv *op, int64_t slot, int64_t h) {
    const float s = op->gran == KVF_SCALE_TENSOR ? op->scale[0]
                    : op->gran == KVF_SCALE_TOKEN ? op->scale[slot] : op->scale[slot * op->heads + h];
    return op->code == KVF_E4M3 ? s * 256.f : s;
}

/* The factors of rows [i0, i0 + cnt) (cnt <= 16) of KV head h, as `q8_factor` gives them, in one vector (zero
 * past cnt). Why: the 8-bit paths called the scalar `q8_factor` (a branch on the granularity, a dependent load)
 * per row and head, in the score pass and again for the V pass. A tile's rows are usually one block's
 * consecutive slots, whose per-token scales are consecutive floats (one load) and per-head scales a fixed
 * stride apart (one gather); tiles that straddle blocks (windows, blocks under 16 tokens) go row by row. */
static inline __attribute__((always_inline)) __m512 q8_factors16(const kvf_kv *op, const int64_t *slots, int64_t i0,
                                                                  int cnt, int64_t h) {
    const __mmask16 m = (__mmask16)((1u << cnt) - 1u);
    const int64_t s0 = slots[i0];
    int consecutive = 1;
    for (int r = 1; r < cnt && consecutive; r++) consecutive = slots[i0 + r] == s0 + r;
    if (!consecutive && op->gran != KVF_SCALE_TENSOR) { /* a tile across blocks: `q8_factor` row by row */
        float fr[16];
        for (int r = 0; r < cnt; r++) fr[r] = q8_factor(op, slots[i0 + r], h);
        return _mm512_maskz_loadu_ps(m, fr);
    }
    __m512 f;
    if (op->gran == KVF_SCALE_TENSOR) {
        f = _mm512_maskz_mov_ps(m, _mm512_set1_ps(op->scale[0]));
    } else if (op->gran == KVF_SCALE_TOKEN) {
        f = _mm512_maskz_loadu_ps(m, op->scale + s0);
    } else { /* KVF_SCALE_HEAD: scale[slot * heads + h] */
        const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32((int)op->heads));
        f = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, op->scale + s0 * op->heads + h, 4);
    }
    return op->code == KVF_E4M3 ? _mm512_mul_ps(f, _mm512_set1_ps(256.f)) : f; /* as `q8_factor` */
}

/* fac[i] = the factor of row i of KV head h, for the n rows of an item (`q8_factors16` a tile at a time). */
static void q8_factors(const kvf_kv *op, const int64_t *slots, int64_t n, int64_t h, float *fac) {
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
        _mm512_mask_storeu_ps(fac + i0, (__mmask16)((1u << cnt) - 1u), q8_factors16(op, slots, i0, cnt, h));
    }
}

/* True when the AVX-512 8-bit path reads this operand (head size 64 checked by the caller). */
static int q8_reads(const kvf_kv *op, int compute) {
    return (op->code == KVF_INT8 || op->code == KVF_E4M3 || op->code == KVF_E5M2) && compute != 2 &&
           (op->gran == KVF_SCALE_TENSOR || op->gran == KVF_SCALE_TOKEN || op->gran == KVF_SCALE_HEAD);
}

/* ---- 8-bit rows under bf16 compute, on VDPBF16PS ----------------------------------------------------
 * Why: widening 8-bit codes to fp32 and multiplying in fp32 (`scores_q8`/`values_q8`) costs about 80
 * vector ops per row and KV head, over twice a bf16 row's, so an 8-bit cache decoded no faster than a
 * bf16 one although it moves half the bytes. Every int8, e4m3 and e5m2 code is exactly a bf16 value (at
 * most 8 significant bits; e4m3 as value / 256, as `load16_q8` yields it), so the widened codes pack
 * into bf16 pairs without rounding and the products run on VDPBF16PS as the bf16 rows' do: scores with
 * the queries' own bf16 pairs, then the row's factor on its score. For P.V each row is dequantized to
 * bf16 as the reference does it (code x factor in fp32, one rounding) and the probabilities are rounded
 * to bf16, so a V row read with probability 1 comes out bit for bit as the reference's. */
#if defined(__AVX512BF16__)
/* 64 8-bit codes of one row as bf16 (exact: every int8/e4m3/e5m2 code is a bf16 value; e4m3 as value / 256):
 * lo = dims 0-31, hi = dims 32-63, pairs in dim order as a bf16 row's. */
static inline __attribute__((always_inline)) void codes_to_bf16(const char *p, const int code, __m512i *lo,
                                                                 __m512i *hi) {
    *lo = (__m512i)_mm512_cvtne2ps_pbh(load16_q8(p, 1, code), load16_q8(p, 0, code));
    *hi = (__m512i)_mm512_cvtne2ps_pbh(load16_q8(p, 3, code), load16_q8(p, 2, code));
}
#endif

/* ---- fp8 rows under bf16 compute by table lookup (AVX512-VBMI) ---------------------------------------
 * Why: widening fp8 codes through halves (`load16_q8`, then `codes_to_bf16` or `dequant_row_bf16`) costs
 * ~22-26 vector ops per 64-code row, which kept an fp8 cache's bf16 decode at the bf16 cache's speed
 * although it moves half the bytes (int8 has VPDPWSSD instead). Every e4m3 / e5m2 magnitude (7 bits) is
 * exactly a bf16 value, so two VPERMI2B lookups over 128-entry byte tables give each code's bf16 low and
 * high bytes (the sign bit is the code's own bit 7), and two byte unpacks make bf16 words: ~6 ops a row.
 * The unpacks leave the dims permuted within each 128-bit lane: word 8L + k of `w0` is dim 16L + k, of
 * `w1` dim 16L + 8 + k. Scores take queries permuted the same way (`lut_queries`); the V pass leaves its
 * accumulators permuted and `unpermute_lut_d64` restores them. e4m3 entries are value / 256 as
 * `load16_q8` yields them (the row factors carry the x 256), so the same factors serve both paths. */
#if defined(__AVX512VBMI__) && defined(__AVX512BF16__)
#define KVF_HAVE_FP8_LUT 1
/* [0: e4m3, 1: e5m2][low bytes of magnitudes 0-63, 64-127, high bytes 0-63, 64-127] */
static uint8_t fp8_lut[2][4][64] __attribute__((aligned(64)));

static void __attribute__((constructor)) fp8_lut_init(void) {
    for (int m = 0; m < 128; m++) {
        const uint16_t e4 = f32_to_bf16(e4m3_to_f32((uint8_t)m) * (1.f / 256.f)), e5 = f32_to_bf16(e5m2_to_f32((uint8_t)m));
        fp8_lut[0][m >> 6][m & 63] = (uint8_t)e4, fp8_lut[0][2 + (m >> 6)][m & 63] = (uint8_t)(e4 >> 8);
        fp8_lut[1][m >> 6][m & 63] = (uint8_t)e5, fp8_lut[1][2 + (m >> 6)][m & 63] = (uint8_t)(e5 >> 8);
    }
}

typedef struct { __m512i lo0, lo1, hi0, hi1; } fp8_tables;

static inline __attribute__((always_inline)) fp8_tables fp8_tables_of(const int code) {
    const uint8_t(*t)[64] = fp8_lut[code == KVF_E4M3 ? 0 : 1];
    return (fp8_tables){_mm512_load_si512(t[0]), _mm512_load_si512(t[1]), _mm512_load_si512(t[2]),
                        _mm512_load_si512(t[3])};
}

/* The 64 codes at p as bf16 words in lane-permuted order (see above): low and high bytes looked up by the
 * code's low 7 bits, the code's bit 7 OR-ed in as the sign (VPTERNLOG 0xF8: a | (b & c)). */
static inline __attribute__((always_inline)) void fp8_row_words(const char *p, const fp8_tables *t, __m512i *w0,
                                                                __m512i *w1) {
    const __m512i c = _mm512_loadu_si512(p);
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, c, t->lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, c, t->hi1), c,
                                                 _mm512_set1_epi8((char)0x80), 0xF8);
    *w0 = _mm512_unpacklo_epi8(lo, hi);
    *w1 = _mm512_unpackhi_epi8(lo, hi);
}

/* bf16 queries (64 per head, `heads` heads) into the order `fp8_row_words` leaves a row's dims in. */
static void lut_queries(const uint16_t *q, int64_t heads, uint16_t *out) {
    for (int64_t h = 0; h < heads; h++)
        for (int L = 0; L < 4; L++)
            for (int k = 0; k < 8; k++) {
                out[h * 64 + 8 * L + k] = q[h * 64 + 16 * L + k];
                out[h * 64 + 32 + 8 * L + k] = q[h * 64 + 16 * L + 8 + k];
            }
}

#endif /* __AVX512VBMI__ && __AVX512BF16__ */

/* Scores of rows [i0, i0 + cnt) (cnt <= 16) of KV head h against its G query heads into st[g * n + i], as
 * `scores_d64` with the rows' factors applied to the sums. `kind` (a compile-time constant) says how a row
 * meets the queries: SQ_F32 codes widened to fp32 against fp32 queries (qs, 4 vectors a head); SQ_BF16 codes
 * widened to bf16 pairs on VDPBF16PS against the queries' own bf16 pairs (qp); SQ_I16 int8 codes widened to
 * int16 on VPDPWSSD against int16 queries (qi, with qscale per head), summed exactly in int32; SQ_LUT fp8 codes
 * looked up as bf16 (`fp8_row_words`) on VDPBF16PS against queries permuted to match (qp, `lut_queries`). */
enum { SQ_F32 = 0, SQ_BF16 = 1, SQ_I16 = 2, SQ_LUT = 3 };
static inline __attribute__((always_inline)) void scores_q8(
    const float *qs, const char *qp, const int16_t *qi, const float *qscale, const kvf_kv *K, const int64_t *slots,
    int64_t i0, int cnt, int64_t n, int64_t h, float *st, const int G, const int code, const int kind) {
    __m512 part[8 * 16], qf[8][4];
    __m512i qw[8][2];
    const __m512 fv = q8_factors16(K, slots, i0, cnt, h);
#if defined(KVF_HAVE_FP8_LUT)
    const fp8_tables lut = fp8_tables_of(kind == SQ_LUT ? code : KVF_E4M3);
#endif
    for (int g = 0; g < G; g++) {
        if (kind == SQ_F32)
            for (int c = 0; c < 4; c++) qf[g][c] = _mm512_loadu_ps(qs + g * 64 + 16 * c);
        else if (kind == SQ_BF16 || kind == SQ_LUT)
            for (int c = 0; c < 2; c++) qw[g][c] = _mm512_loadu_si512(qp + g * 128 + 64 * c);
        else
            for (int c = 0; c < 2; c++) qw[g][c] = _mm512_loadu_si512(qi + g * 64 + 32 * c);
    }
    for (int r = 0; r < 16; r++) {
        if (r >= cnt) {
            for (int g = 0; g < G; g++) part[g * 16 + r] = _mm512_setzero_ps();
            continue;
        }
        const char *kp = K->data + slots[i0 + r] * K->row_bytes + h * K->head_bytes;
        if (i0 + r + KVF_PREFETCH_ROWS < n)
            prefetch_segment(K->data + slots[i0 + r + KVF_PREFETCH_ROWS] * K->row_bytes + h * K->head_bytes, (size_t)K->head_bytes);
        if (kind == SQ_F32) {
            __m512 k[4];
            for (int c = 0; c < 4; c++) k[c] = load16_q8(kp, c, code);
            for (int g = 0; g < G; g++) part[g * 16 + r] = dot64_lanes(qf[g], k);
        }
#if defined(__AVX512BF16__)
        if (kind == SQ_BF16) {
            __m512i k0, k1;
            codes_to_bf16(kp, code, &k0, &k1);
            for (int g = 0; g < G; g++)
                part[g * 16 + r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qw[g][0], (__m512bh)k0),
                                                    (__m512bh)qw[g][1], (__m512bh)k1);
        }
#endif
#if defined(KVF_HAVE_FP8_LUT)
        if (kind == SQ_LUT) {
            __m512i k0, k1;
            fp8_row_words(kp, &lut, &k0, &k1);
            for (int g = 0; g < G; g++)
                part[g * 16 + r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qw[g][0], (__m512bh)k0),
                                                    (__m512bh)qw[g][1], (__m512bh)k1);
        }
#endif
#if defined(__AVX512VNNI__)
        if (kind == SQ_I16) { /* exact int32 lane sums: |q| <= 32767, |k| <= 128, 4 products a lane */
            const __m512i k0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)kp));
            const __m512i k1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)kp + 1));
            for (int g = 0; g < G; g++)
                part[g * 16 + r] = _mm512_castsi512_ps(
                    _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), qw[g][0], k0), qw[g][1], k1));
        }
#endif
    }
    const __mmask16 m = (__mmask16)((1u << cnt) - 1u);
    for (int g = 0; g < G; g++) {
        const __m512 sum = reduce16_as(part + g * 16, kind == SQ_I16);
        const __m512 f = kind == SQ_I16 ? _mm512_mul_ps(fv, _mm512_set1_ps(qscale[g])) : fv;
        _mm512_mask_storeu_ps(st + g * n + i0, m,
                              _mm512_mul_ps(kind == SQ_I16 ? _mm512_cvtepi32_ps(_mm512_castps_si512(sum)) : sum, f));
    }
}

/* acc[g] += sum over rows [i0, i0 + cnt) of p_gi * fac[i] * codes_i for KV head h, p_gi = e[g * n + i] x inv[g]
 * as in `values_d64`. */
static inline __attribute__((always_inline)) void values_q8(
    const float *e, const float *inv, const kvf_kv *V, const int64_t *slots, int64_t i0, int cnt, int64_t n,
    int64_t h, const float *fac, float *acc_mem, const int G, const int code) {
    __m512 acc[8][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_loadu_ps(acc_mem + g * 64 + 16 * c);
    for (int64_t i = i0; i < i0 + cnt; i++) {
        const char *vp = V->data + slots[i] * V->row_bytes + h * V->head_bytes;
        if (i + KVF_PREFETCH_ROWS < n)
            prefetch_segment(V->data + slots[i + KVF_PREFETCH_ROWS] * V->row_bytes + h * V->head_bytes, (size_t)V->head_bytes);
        const float f = fac[i];
        __m512 v[4];
        for (int c = 0; c < 4; c++) v[c] = load16_q8(vp, c, code);
        for (int g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(e[g * n + i] * inv[g] * f);
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc_mem + g * 64 + 16 * c, acc[g][c]);
}

#if defined(__AVX512BF16__)
/* Probabilities of one head (the softmax's exponentials e times inv, its 1 / sum: the normalisation the
 * softmax leaves to this pass), rounded to bf16 (nearest even) into pb[0 .. n), with pb[n] = 0 so that
 * rows pair up: the bf16 V pass multiplies two rows at once. The reference backend rounds its
 * probabilities to the value dtype in the same way before its matmul with V. */
static inline void probs_to_bf16(const float *e, float inv, const float *fac, uint16_t *pb, int64_t n) {
    /* fac: NULL, or each row's factor to multiply in after inv (fp8 V rows read by table, `values_d64_bf16` with lut) */
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, e + i), iv);
        if (fac) p = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(m, fac + i));
        const __m256bh h = _mm512_cvtneps_pbh(p);
        _mm256_mask_storeu_epi16(pb + i, m, (__m256i)h);
    }
    pb[n] = 0;
}


/* 64 8-bit codes of one row dequantized as the reference does it: code x the row's factor in fp32, rounded
 * once to bf16 (e4m3's value / 256 times scale x 256 is the same product). */
static inline __attribute__((always_inline)) void dequant_row_bf16(const char *p, float factor, const int code,
                                                                    __m512i *lo, __m512i *hi) {
    const __m512 f = _mm512_set1_ps(factor);
    *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(load16_q8(p, 1, code), f), _mm512_mul_ps(load16_q8(p, 0, code), f));
    *hi = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(load16_q8(p, 3, code), f), _mm512_mul_ps(load16_q8(p, 2, code), f));
}

/* The bf16 V pass: rows i, i+1 interleaved element by element (unpack), so that one VDPBF16PS adds
 * p_i * v_i + p_{i+1} * v_{i+1} for 16 dims. The four accumulators per head then hold the dims in
 * unpack order; `unpermute_d64` restores them once per item. pb: bf16 probabilities, stride npad. */
static inline __attribute__((always_inline)) void values_d64_bf16(
    const uint16_t *pb, const char *v_cache, const int64_t *slots, int64_t i0, int cnt, int64_t n, int64_t npad,
    size_t v_row, size_t head_off, float *acc_mem, const int G, const float *fac, const int qcode, const int lut) {
    /* qcode 0: bf16 rows; else 8-bit rows of that format with factors fac[i], dequantized to bf16 as the
     * reference dequantizes them (`dequant_row_bf16`), or with lut (fp8, AVX512-VBMI) looked up as bf16 codes
     * whose factors ride on pb (`fp8_row_words`; accumulators in `unpermute_lut_d64`'s order) */
    __m512 acc[8][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_loadu_ps(acc_mem + g * 64 + 16 * c);
#if defined(KVF_HAVE_FP8_LUT)
    const fp8_tables t = fp8_tables_of(lut ? qcode : KVF_E4M3);
#endif
    for (int r = 0; r < cnt; r += 2) {
        const int64_t i = i0 + r;
        const char *v0 = v_cache + slots[i] * v_row + head_off;
        for (int64_t ip = i + KVF_PREFETCH_ROWS; ip < i + KVF_PREFETCH_ROWS + 2 && ip < n; ip++)
            prefetch_segment(v_cache + slots[ip] * v_row + head_off, qcode ? 64 : 128);
        __m512i a0, a1, b0 = _mm512_setzero_si512(), b1 = b0;
#if defined(KVF_HAVE_FP8_LUT)
        if (lut) {
            fp8_row_words(v0, &t, &a0, &a1);
            if (r + 1 < cnt) fp8_row_words(v_cache + slots[i + 1] * v_row + head_off, &t, &b0, &b1);
        } else
#endif
        if (qcode) {
            dequant_row_bf16(v0, fac[i], qcode, &a0, &a1);
            if (r + 1 < cnt)
                dequant_row_bf16(v_cache + slots[i + 1] * v_row + head_off, fac[i + 1], qcode, &b0, &b1);
        } else {
            a0 = _mm512_loadu_si512(v0);
            a1 = _mm512_loadu_si512(v0 + 64);
            if (r + 1 < cnt) {
                const char *v1 = v_cache + slots[i + 1] * v_row + head_off;
                b0 = _mm512_loadu_si512(v1);
                b1 = _mm512_loadu_si512(v1 + 64);
            }
        }
        const __m512bh x0 = (__m512bh)_mm512_unpacklo_epi16(a0, b0), x1 = (__m512bh)_mm512_unpackhi_epi16(a0, b0);
        const __m512bh x2 = (__m512bh)_mm512_unpacklo_epi16(a1, b1), x3 = (__m512bh)_mm512_unpackhi_epi16(a1, b1);
        for (int g = 0; g < G; g++) {
            int32_t pair;
            memcpy(&pair, pb + g * npad + i, 4);
            const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
            acc[g][0] = _mm512_dpbf16_ps(acc[g][0], w, x0);
            acc[g][1] = _mm512_dpbf16_ps(acc[g][1], w, x1);
            acc[g][2] = _mm512_dpbf16_ps(acc[g][2], w, x2);
            acc[g][3] = _mm512_dpbf16_ps(acc[g][3], w, x3);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc_mem + g * 64 + 16 * c, acc[g][c]);
}


#if defined(__AVX512VNNI__)
/* int8 K under bf16 compute, on VPDPWSSD: each query head scaled to int16 once per sequence (its largest
 * element to 32767: the added error is at most 1/65536 of that element, far below the bf16 rounding the
 * query already carries), key codes sign-extended to int16, and the products summed exactly in int32;
 * the sum is then scaled back by the query's and the row's factors. Half the instructions of widening the
 * codes to bf16 (`scores_q8`, SQ_BF16). */
static void quantize_query_i16(const float *qf, int64_t heads, int16_t *qi, float *qscale) {
    for (int64_t h = 0; h < heads; h++) {
        const float *x = qf + h * 64;
        float amax = 0.f;
        for (int d = 0; d < 64; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        qscale[h] = amax > 0.f ? amax / 32767.f : 0.f;
        for (int d = 0; d < 64; d++) qi[h * 64 + d] = (int16_t)lrintf(x[d] * inv);
    }
}

/* int8 V under bf16 compute, on VPDPWSSD: each head's probabilities times its rows' factors scaled to
 * int16 (the largest to 32767; every term's error is at most 1/65536 of the largest, against 1/512 of
 * itself for the bf16 rounding the reference applies, so the sum is at least as close) into pi (stride
 * npad, a zero after row n - 1), vscale[g] the step. Rows' codes are sign-extended to int16 and summed
 * exactly in int32: at most 2 x 32767 x 128 a row pair per lane, flushed to fp32 every 256 rows
 * (VNNI_FLUSH_ROWS) before 2^31. */
#define VNNI_FLUSH_ROWS 256
static void probs_q8_to_i16(const float *e, const float *inv, const float *fac, int64_t n, int G, int16_t *pi,
                            int64_t npad, float *vscale) {
    /* e: the softmax's exponentials, inv[g]: 1 / their sum (p = e x inv: the normalisation is done here) */
    for (int g = 0; g < G; g++) {
        const float *pg = e + g * n;
        const __m512 iv = _mm512_set1_ps(inv[g]);
        __m512 mx = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
            const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, pg + i), iv);
            mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_mul_ps(p, _mm512_maskz_loadu_ps(m, fac + i))));
        }
        const float amax = _mm512_reduce_max_ps(mx);
        vscale[g] = amax > 0.f ? amax / 32767.f : 0.f;
        const __m512 step = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
        int16_t *out = pi + g * npad;
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
            const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, pg + i), iv);
            const __m512 x = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_maskz_loadu_ps(m, fac + i)), step);
            _mm256_mask_storeu_epi16(out + i, m, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(x))); /* nearest even */
        }
        out[n] = 0;
    }
}

/* acc[g] (int32, in unpack order as `values_d64_bf16`) += sum over rows [i0, i0 + cnt) of pi[g][i] * codes_i */
KVF_OUTLINED void values_i8_vnni(
    const int16_t *pi, const kvf_kv *V, const int64_t *slots, int64_t i0, int cnt, int64_t n, int64_t npad, int64_t h,
    int32_t *acc_mem, const int G) {
    __m512i acc[8][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_loadu_si512(acc_mem + g * 64 + 16 * c);
    for (int r = 0; r < cnt; r += 2) {
        const int64_t i = i0 + r;
        const char *v0 = V->data + slots[i] * V->row_bytes + h * V->head_bytes;
        for (int64_t ip = i + KVF_PREFETCH_ROWS; ip < i + KVF_PREFETCH_ROWS + 2 && ip < n; ip++)
            prefetch_segment(V->data + slots[ip] * V->row_bytes + h * V->head_bytes, (size_t)V->head_bytes);
        const __m512i a0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)v0));
        const __m512i a1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)v0 + 1));
        __m512i b0 = _mm512_setzero_si512(), b1 = b0;
        if (r + 1 < cnt) {
            const char *v1 = V->data + slots[i + 1] * V->row_bytes + h * V->head_bytes;
            b0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)v1));
            b1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)v1 + 1));
        }
        const __m512i x0 = _mm512_unpacklo_epi16(a0, b0), x1 = _mm512_unpackhi_epi16(a0, b0);
        const __m512i x2 = _mm512_unpacklo_epi16(a1, b1), x3 = _mm512_unpackhi_epi16(a1, b1);
        for (int g = 0; g < G; g++) {
            int32_t pair;
            memcpy(&pair, pi + g * npad + i, 4);
            const __m512i w = _mm512_set1_epi32(pair);
            acc[g][0] = _mm512_dpwssd_epi32(acc[g][0], w, x0);
            acc[g][1] = _mm512_dpwssd_epi32(acc[g][1], w, x1);
            acc[g][2] = _mm512_dpwssd_epi32(acc[g][2], w, x2);
            acc[g][3] = _mm512_dpwssd_epi32(acc[g][3], w, x3);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) _mm512_storeu_si512(acc_mem + g * 64 + 16 * c, acc[g][c]);
}

/* acc (fp32) += acci x vscale per head, and acci back to zero */
static void flush_i32(float *acc, int32_t *acci, const float *vscale, int64_t heads) {
    for (int64_t h = 0; h < heads; h++) {
        const __m512 sc = _mm512_set1_ps(vscale[h]);
        for (int c = 0; c < 4; c++) {
            float *a = acc + h * 64 + 16 * c;
            int32_t *ai = acci + h * 64 + 16 * c;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(ai)), sc, _mm512_loadu_ps(a)));
            _mm512_storeu_si512(ai, _mm512_setzero_si512());
        }
    }
}
#endif



/* Accumulator c (unpack lo/hi of V's first or second 32 dims), lane 4L + m holds dim
 * 32 * (c / 2) + 8L + 4 * (c % 2) + m: back to dim order, in place. */
static inline void unpermute_d64(float *a) {
    float t[64];
    for (int c = 0; c < 4; c++)
        for (int L = 0; L < 4; L++)
            for (int m = 0; m < 4; m++) t[32 * (c / 2) + 8 * L + 4 * (c % 2) + m] = a[16 * c + 4 * L + m];
    memcpy(a, t, sizeof(t));
}

/* fp8 V under bf16 compute read by table (`values_d64_bf16` with lut): the probabilities times their rows'
 * factors are rounded to bf16 (`probs_to_bf16` with fac) and meet the codes' exact bf16 values. The factor
 * rides on the probability, as on the int8 VNNI path, instead of being multiplied into every element: each
 * term is rounded once (p x factor) where the reference rounds twice (p, and code x factor), so the sum is as
 * close to fp64 truth or closer (mean error 0.92-0.98x the exact-dequantize path's, 6 random caches of 1-300
 * tokens), but a row read with probability 1 equals the reference's only where its factor is a bf16 value
 * (within one bf16 rounding elsewhere). It ran 1.2x faster per layer than dequantizing each row exactly from
 * the same tables (code x factor in fp32, VCVTNE2PS2BF16, a word permute; measured in one process).
 * The accumulators come out in `fp8_row_words`' order: c, lane 4L + m holds dim 16L + 4c + m; this puts
 * them back in dim order, in place. */
static inline void unpermute_lut_d64(float *a) {
    float t[64];
    for (int c = 0; c < 4; c++)
        for (int L = 0; L < 4; L++)
            for (int m = 0; m < 4; m++) t[16 * L + 4 * c + m] = a[16 * c + 4 * L + m];
    memcpy(a, t, sizeof(t));
}
#endif

#endif

/* Which group sizes G (query heads per KV head, 1..8) get vector clones: bit G-1 of KVF_G_MASK. The
 * default is all eight (the kernel tests and benchmarks); the library an engine builds for its model
 * sets only that model's G (cpu_kernel.library_for), which compiles about a third of the code. A G
 * outside the mask takes the portable loops: the same results, only slower. */
#ifndef KVF_G_MASK
#define KVF_G_MASK 0xFF
#endif
#define KVF_HAS_G(G) ((G) >= 1 && (G) <= 8 && ((KVF_G_MASK >> ((G) - 1)) & 1))
#if KVF_G_MASK & 0x01
#define KVF_IF_G1(...) __VA_ARGS__
#else
#define KVF_IF_G1(...)
#endif
#if KVF_G_MASK & 0x02
#define KVF_IF_G2(...) __VA_ARGS__
#else
#define KVF_IF_G2(...)
#endif
#if KVF_G_MASK & 0x04
#define KVF_IF_G3(...) __VA_ARGS__
#else
#define KVF_IF_G3(...)
#endif
#if KVF_G_MASK & 0x08
#define KVF_IF_G4(...) __VA_ARGS__
#else
#define KVF_IF_G4(...)
#endif
#if KVF_G_MASK & 0x10
#define KVF_IF_G5(...) __VA_ARGS__
#else
#define KVF_IF_G5(...)
#endif
#if KVF_G_MASK & 0x20
#define KVF_IF_G6(...) __VA_ARGS__
#else
#define KVF_IF_G6(...)
#endif
#if KVF_G_MASK & 0x40
#define KVF_IF_G7(...) __VA_ARGS__
#else
#define KVF_IF_G7(...)
#endif
#if KVF_G_MASK & 0x80
#define KVF_IF_G8(...) __VA_ARGS__
#else
#define KVF_IF_G8(...)
#endif

/* G (1..8; callers check KVF_HAS_G) as a compile-time constant: the per-head loops of the vector
 * paths unroll. */
#define KVF_DISPATCH_G(G, CALL) \
    switch (G) { \
    KVF_IF_G1(case 1: CALL(1); break;)  \
    KVF_IF_G2(case 2: CALL(2); break;)  \
    KVF_IF_G3(case 3: CALL(3); break;)  \
    KVF_IF_G4(case 4: CALL(4); break;)  \
    KVF_IF_G5(case 5: CALL(5); break;)  \
    KVF_IF_G6(case 6: CALL(6); break;)  \
    KVF_IF_G7(case 7: CALL(7); break;)  \
    KVF_IF_G8(case 8: CALL(8); break;)  \
    default: break; \
    }

/* FN(args..., G) with G (a variable in scope) as a constant in each case: how an entry point of one
 * unit reaches the per-G clones gcc makes of a static outlined kernel (KVF_OUTLINED). */
#define KVF_SWITCH_G(FN, ...) \
    switch (G) { \
    KVF_IF_G1(case 1: FN(__VA_ARGS__, 1); break;)  \
    KVF_IF_G2(case 2: FN(__VA_ARGS__, 2); break;)  \
    KVF_IF_G3(case 3: FN(__VA_ARGS__, 3); break;)  \
    KVF_IF_G4(case 4: FN(__VA_ARGS__, 4); break;)  \
    KVF_IF_G5(case 5: FN(__VA_ARGS__, 5); break;)  \
    KVF_IF_G6(case 6: FN(__VA_ARGS__, 6); break;)  \
    KVF_IF_G7(case 7: FN(__VA_ARGS__, 7); break;)  \
    KVF_IF_G8(case 8: FN(__VA_ARGS__, 8); break;)  \
    default: break; \
    }

/* An 8-bit storage code as the compile-time constant `zcode` in each branch (straight-line decode per
 * format), then G as in KVF_DISPATCH_G. */
#define KVF_DISPATCH_Q8(CODE, CALL)         \
    if ((CODE) == KVF_INT8) {               \
        const int zcode = KVF_INT8;         \
        KVF_DISPATCH_G(G, CALL)             \
    } else if ((CODE) == KVF_E4M3) {        \
        const int zcode = KVF_E4M3;         \
        KVF_DISPATCH_G(G, CALL)             \
    } else {                                \
        const int zcode = KVF_E5M2;         \
        KVF_DISPATCH_G(G, CALL)             \
    }

/* An fp8 storage code (e4m3 or e5m2) as the compile-time constant `zcode`, then G as in KVF_DISPATCH_G. */
#define KVF_DISPATCH_FP8(CODE, CALL)        \
    if ((CODE) == KVF_E4M3) {               \
        const int zcode = KVF_E4M3;         \
        KVF_DISPATCH_G(G, CALL)             \
    } else {                                \
        const int zcode = KVF_E5M2;         \
        KVF_DISPATCH_G(G, CALL)             \
    }

/* ---- the AVX2 + FMA path (CPUs without AVX-512, and compressed operands on CPUs with it) ----------
 * Head size 64, at most 8 query heads per KV head, any compute dtype; K and V each taken when its
 * storage needs decoding: fp8/int8/int4 codes with any scale granularity, or 16/32-bit rows of
 * another dtype than the compute dtype, or 16-bit rows (fp32 rows in fp32 keep the portable loops,
 * see `avx2_reads`). The portable loops spent their time on a scalar decode of each row into a
 * scratch row per KV head, and a horizontal sum per key row and query head; here
 * - 8 codes become 8 floats in registers (int8: sign-extend + convert; e5m2: the top byte of a half,
 *   converted by F16C; e4m3: its bits moved into a half, which is the value / 256; int4: a variable
 *   shift of the row's 32-bit word per lane), one switch on the format per 16 rows;
 * - with fp32 compute and one scale per row (token, head, tensor), the scale multiplies the row's
 *   score (K) or its probability (V) once instead of its 64 elements: the same products in another
 *   order, so results differ from the portable loops by fp32 rounding only. Per-channel scales, and
 *   16-bit compute (where the dequantized element is rounded to the compute dtype as the reference's
 *   `.to(dtype)` rounds it), scale element by element, exactly as `kv_row` does;
 * - 16 rows (all the item's KV heads) are decoded in pool order into an L1 scratch, then
 *   scores: 8 rows at a time, 2 partial sums per (row, query head), one 8-way transpose-reduction
 *   per query head (no per-row horizontal sums); values: each query head walks the rows with its 64
 *   accumulators in 8 registers. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVF_HAVE_AVX2 1
#ifndef KVF_AVX2_PREFETCH_ROWS
/* Rows ahead that the decode loop prefetches (into L2), one row's lines per row decoded: spread like
 * this it kept pace with the portable loops on bf16 rows out of DRAM, where a burst of 16 rows'
 * lines per 16-row step (the AVX-512 path's way) ran up to 1.3x slower on this AMD EPYC. */
#define KVF_AVX2_PREFETCH_ROWS 16
#endif

/* True when the AVX2 path takes this operand (head size 64 checked by the caller). Not fp32 rows with
 * fp32 compute: they need no decoding, the portable loops read them in place at the memory's pace,
 * and this path (which copies them through L1) measured no faster on them (32 x 512 tokens, 1 thread). */
static int avx2_reads(const kvf_kv *op, int compute) {
    if (op->code == KVF_F32 && compute == KVF_F32) return 0;
    if (op->code < KVF_E4M3) return op->gran == KVF_SCALE_NONE;
    return op->code <= KVF_INT4 && op->gran != KVF_SCALE_NONE;
}

/* Elements 8c .. 8c + 7 of a row of storage `code` as fp32, unscaled (e4m3: the value / 256). */
static inline __attribute__((always_inline)) __m256 load8(const char *p, int c, int code) {
    switch (code) {
    case KVF_F32:
        return _mm256_loadu_ps((const float *)p + 8 * c);
    case KVF_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p + c)), 16));
    case KVF_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p + c));
    case KVF_E4M3: { /* s eeee mmm -> half s 0eeee mmm0000000: same bits, exponent bias 15 instead of 7 */
        const __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(p + 8 * c))), 7);
        return _mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16((short)0xBF80)));
    }
    case KVF_E5M2:
        return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(p + 8 * c))), 8));
    case KVF_INT8:
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * c))));
    default: { /* KVF_INT4: element k of these 8 is bits 4k .. 4k + 3 of the little-endian word */
        int32_t w;
        memcpy(&w, p + 4 * c, 4);
        const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                             _mm256_set1_epi32(15));
        return _mm256_cvtepi32_ps(_mm256_sub_epi32(nib, _mm256_set1_epi32(8)));
    }
    }
}

/* fp32 rounded to the compute dtype (bf16 nearest even as torch does, or fp16), as `round_row`. */
static inline __attribute__((always_inline)) __m256 round8(__m256 x, int compute) {
    if (compute == KVF_F16) return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* Row `slot`, head h of op (storage `code`, a constant where inlined) as 8 vectors x[0..7]. Returns
 * the factor the caller still owes the row (its scale, with fp32 compute and one scale per row), else
 * 1 with the scale already applied. */
static inline __attribute__((always_inline)) float row64(const kvf_kv *op, int64_t slot, int64_t h, int64_t BS,
                                                         int compute, const int code, __m256 *x) {
    const char *p = op->data + slot * op->row_bytes + h * op->head_bytes;
    for (int c = 0; c < 8; c++) x[c] = load8(p, c, code);
    float s = code == KVF_E4M3 ? 256.f : 1.f; /* exact: a power of two */
    if (op->gran == KVF_SCALE_CHANNEL) {
        const float *cs = op->scale + ((slot / BS) * op->heads + h) * 64;
        for (int c = 0; c < 8; c++) x[c] = _mm256_mul_ps(_mm256_mul_ps(x[c], _mm256_set1_ps(s)), _mm256_loadu_ps(cs + 8 * c));
    } else {
        if (op->gran != KVF_SCALE_NONE)
            s *= op->gran == KVF_SCALE_TENSOR ? op->scale[0]
                 : op->gran == KVF_SCALE_TOKEN ? op->scale[slot] : op->scale[slot * op->heads + h];
        if (compute == KVF_F32) return s;
        if (s != 1.f)
            for (int c = 0; c < 8; c++) x[c] = _mm256_mul_ps(x[c], _mm256_set1_ps(s));
    }
    if (compute != KVF_F32 && compute != code)
        for (int c = 0; c < 8; c++) x[c] = round8(x[c], compute);
    return 1.f;
}

/* Rows [i0, i0 + cnt) (cnt <= 16) of op, heads h0 .. h0 + nh - 1, decoded into buf as fp32: head j's
 * row r at buf + (j * 16 + r) * 64, owing the factor f[j * 16 + r]. Walked row by row, all heads of a
 * row together, in the order the pool holds them: walking one head's rows of a block and then the
 * next head's ran slower out of DRAM here. One switch on the storage per call, so
 * each format's decode loop is straight-line vector code. */
static inline __attribute__((always_inline)) void rows_avx2(
    const kvf_kv *op, const int64_t *slots, int64_t i0, int cnt, int64_t h0, int64_t nh, int64_t BS, int compute,
    float *buf, float *f, int64_t n) {
#define KVF_ROWS(CODE)                                                               \
    for (int r = 0; r < cnt; r++) {                                                  \
        if (i0 + r + KVF_AVX2_PREFETCH_ROWS < n) /* one row's lines at a time, never a burst */ \
            for (int64_t off = 0; off < op->row_bytes; off += 64)                    \
                __builtin_prefetch(op->data + slots[i0 + r + KVF_AVX2_PREFETCH_ROWS] * op->row_bytes + off, 0, 2); \
        for (int64_t j = 0; j < nh; j++) {                                           \
            __m256 x[8];                                                             \
            float *d = buf + (j * 16 + r) * 64;                                      \
            f[j * 16 + r] = row64(op, slots[i0 + r], h0 + j, BS, compute, CODE, x);  \
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(d + 8 * c, x[c]);           \
        }}                                                                            \
    break;
    switch (op->code) {
    case KVF_F32: KVF_ROWS(KVF_F32)
    case KVF_BF16: KVF_ROWS(KVF_BF16)
    case KVF_F16: KVF_ROWS(KVF_F16)
    case KVF_E4M3: KVF_ROWS(KVF_E4M3)
    case KVF_E5M2: KVF_ROWS(KVF_E5M2)
    case KVF_INT8: KVF_ROWS(KVF_INT8)
    default: KVF_ROWS(KVF_INT4)
    }
#undef KVF_ROWS
}

/* Eight 8-lane partial sums in, one vector of their eight totals out (lane r = sum of v[r]). */
static inline __attribute__((always_inline)) __m256 reduce8(const __m256 *v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* 128-bit halves: dims 0-3, 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Scores of rows[0 .. cnt) (cnt <= 16, fp32 rows of 64, owing factors f) against the G query heads
 * (fp32 q in qf, 64 a head) into st[g * n + r]: 8 rows at a time, one transpose-reduction per query
 * head. G is a compile-time constant at every call site. */
static inline __attribute__((always_inline)) void scores_avx2(
    const float *qf, const float *rows, const float *f, int cnt, int64_t n, float *st, const int G) {
    for (int r0 = 0; r0 < cnt; r0 += 8) {
        const int m = cnt - r0 < 8 ? cnt - r0 : 8;
        __m256 part[8 * 8];
        float fr[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int r = 0; r < 8; r++) {
            if (r >= m) {
                for (int g = 0; g < G; g++) part[g * 8 + r] = _mm256_setzero_ps();
                continue;
            }
            fr[r] = f[r0 + r];
            const float *kr = rows + (r0 + r) * 64;
            __m256 k[8];
            for (int c = 0; c < 8; c++) k[c] = _mm256_loadu_ps(kr + 8 * c);
            for (int g = 0; g < G; g++) {
                const float *qg = qf + g * 64;
                __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qg), k[0]);
                __m256 b = _mm256_mul_ps(_mm256_loadu_ps(qg + 8), k[1]);
                for (int c = 2; c < 8; c += 2) {
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), k[c], a);
                    b = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c + 8), k[c + 1], b);
                }
                part[g * 8 + r] = _mm256_add_ps(a, b);
            }
        }
        const __m256 fv = _mm256_loadu_ps(fr);
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int g = 0; g < G; g++) _mm256_maskstore_ps(st + g * n + r0, mask, _mm256_mul_ps(reduce8(part + g * 8), fv));
    }
}

/* acc[g] += sum over r < cnt of p[g * n + r] * f[r] * row r: each query head's 64 accumulators stay
 * in 8 registers across the rows, which are read from L1 once per head. */
static inline __attribute__((always_inline)) void values_avx2(
    const float *p, const float *rows, const float *f, int cnt, int64_t n, float *acc_mem, const int G) {
    for (int g = 0; g < G; g++) {
        __m256 a[8];
        float *am = acc_mem + g * 64;
        for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_ps(am + 8 * c);
        const float *pg = p + g * n;
        for (int r = 0; r < cnt; r++) {
            const __m256 w = _mm256_set1_ps(pg[r] * f[r]);
            for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows + r * 64 + 8 * c), a[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(am + 8 * c, a[c]);
    }
}
#endif


#endif /* KVF_PAGED_COMMON_H */
