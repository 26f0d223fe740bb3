/* Paged decode attention for CPUs: one query per sequence, K/V read in place from the block pool.
 *
 * Why a kernel: the torch path gathers every decode row's blocks into a contiguous workspace
 * before attending, so each KV byte is read, written and read again. Here each sequence (or,
 * for small batches, each of its KV heads) walks its block table once, scores the G query heads
 * of each group against each key row (GQA by head index, K/V never repeated), and accumulates V
 * weighted by the softmax. 16-bit rows are widened to fp32 once per row; scores and the softmax
 * run in fp32 whatever the storage dtype.
 *
 * Head size 64 with at most 8 query heads per KV head (SmolLM2, Llama 3, Mistral, Qwen2) takes an
 * AVX-512 path where the compiler targets it: blocks of 16 rows, the per-row dot products reduced
 * 16 at a time by a transpose tree, V accumulators held in registers, and bf16 scores by
 * VDPBF16PS (bf16 pairs multiplied exactly, summed in fp32), bf16 V rows two at a time by
 * VDPBF16PS on probabilities rounded to bf16 (as the reference rounds them), and rows prefetched
 * into L2 a few blocks ahead. Per layer out of DRAM (32 sequences, ~400 tokens): bf16 0.95 -> 0.67
 * ms, fp32 1.2 -> 1.0 ms against the scalar loop (`benchmarks/attention_backends.py` times them).
 *
 * Compressed caches are read in place too (`kvf_kv` below): fp8 e4m3/e5m2, int8 and packed int4
 * codes with their scales (per tensor, token, token x head, or block x head x channel), and 16-bit
 * or fp32 rows of another dtype than the compute dtype. Each row is decoded into fp32 registers
 * (code * scale in fp32, then rounded to the compute dtype when that is 16-bit, exactly as
 * `kvforge.kv.quant.dequantize(...).to(dtype)` does), so greedy output is the reference's; no copy of
 * the cache is made. At head size 64 such operands take the AVX2 path below (the AVX-512 paths read
 * dense rows), which is also what CPUs without AVX-512 run for 16-bit rows; other shapes, and fp32
 * rows with fp32 compute on those CPUs, take the portable loops.
 * K and V may alias one tensor with different widths: the MLA latent cache (K = [c_kv, k_rope],
 * V = c_kv) is one operand pair over one pool.
 *
 * Layouts (all contiguous):
 *   q        [B, H, D]              compute dtype
 *   k        [NB, BS, HKV, D]       any `kvf_kv` storage; rows of k->row_bytes bytes
 *   v        [NB, BS, HKV, DV]
 *   tables   [B, MAXNB] int64
 *   seq_lens [B] int64 (context length including the new token, >= 1)
 *   out      [B, H, DV]
 * dtype codes: 0 float32, 1 bfloat16, 2 float16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_bf16.h"
#include "kvf_omp.h"

/* Load n elements of dtype `code` starting at p into dst as fp32. */
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

/* One row decoded the kernels' way, for tests of every code of every format (same FTZ/DAZ mode). */
int kvf_dequant_row(const kvf_kv *op, int64_t slot, int64_t h, int64_t n, int64_t BS, int compute, float *out) {
    KVF_FTZ_BEGIN();
    const float *r = kv_row(out, op, slot, h, (int)n, BS, compute);
    if (r != out) memcpy(out, r, sizeof(float) * (size_t)n);
    KVF_FTZ_END();
    return 0;
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
static inline __attribute__((always_inline)) void scores_d64(
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
static inline __attribute__((always_inline)) void values_d64(
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
static inline __attribute__((always_inline)) void scores_rows_f32(
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
static inline __attribute__((always_inline)) void values_rows_f32(
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
static inline __attribute__((always_inline)) void values_i8_vnni(
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

/* G (1..8) as a compile-time constant: the per-head loops of the vector paths unroll. */
#define KVF_DISPATCH_G(G, CALL) \
    switch (G) {                \
    case 1: CALL(1); break;     \
    case 2: CALL(2); break;     \
    case 3: CALL(3); break;     \
    case 4: CALL(4); break;     \
    case 5: CALL(5); break;     \
    case 6: CALL(6); break;     \
    case 7: CALL(7); break;     \
    default: CALL(8); break;    \
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

/* Insertion sort of sequence indices by decreasing length: B is a batch size, and the usual input
 * is small. */
static void sort_by_length_desc(int64_t *order, const int64_t *lens, int64_t B) {
    for (int64_t i = 1; i < B; i++) {
        const int64_t x = order[i];
        int64_t j = i - 1;
        while (j >= 0 && lens[order[j]] < lens[x]) {
            order[j + 1] = order[j];
            j--;
        }
        order[j + 1] = x;
    }
}

/* True when op holds plain rows of the compute dtype in the dense [NB, BS, HKV, dim] layout. */
static int dense_rows(const kvf_kv *op, int code, int64_t HKV, int64_t dim) {
    const int64_t esz = code == 0 ? 4 : 2;
    return op->code == code && op->gran == KVF_SCALE_NONE && op->head_bytes == dim * esz && op->row_bytes == HKV * dim * esz;
}

int kvf_paged_decode(
    const void *q, const kvf_kv *K, const kvf_kv *V, const int64_t *tables, const int64_t *seq_lens,
    void *out, int64_t B, int64_t H, int64_t HKV, int64_t D, int64_t DV, int64_t BS, int64_t MAXNB,
    int64_t window, float scale, float softcap, int dtype_code) {
    const int64_t G = H / HKV;
    const size_t esz = dtype_code == 0 ? 4 : 2;
    const void *k_cache = K->data, *v_cache = V->data;
    const size_t k_row = (size_t)K->row_bytes, v_row = (size_t)V->row_bytes; /* one token, all KV heads */
    /* The AVX-512 paths read dense rows of the compute dtype; compressed rows take the portable loops. */
    const int dense = dense_rows(K, dtype_code, HKV, D) && dense_rows(V, dtype_code, HKV, DV);
    (void)dense;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    /* Work items are sequences, so each token's K/V row (all KV heads) is read whole and in order:
     * a block is one contiguous run the prefetchers can follow. With fewer sequences than threads
     * to keep busy, items split a sequence's KV heads instead. */
    const int64_t splits = B >= 2 * omp_get_max_threads() ? 1 : HKV;
    const int64_t heads_per_item = HKV / splits;
    /* Longest contexts first: with dynamic scheduling the threads then finish together. */
    int64_t *order = malloc(sizeof(int64_t) * (B > 0 ? B : 1));
    if (!order) return -1;
    for (int64_t b = 0; b < B; b++) order[b] = b;
    sort_by_length_desc(order, seq_lens, B);
    int failed = 0;

#pragma omp parallel
    {
        KVF_FTZ_BEGIN(); /* denormals flushed in this thread (kvf_omp.h says why) */
        const int64_t n_max = max_len > 0 ? max_len : 1;
        float *qf = malloc(sizeof(float) * heads_per_item * G * D);
        float *scores = malloc(sizeof(float) * heads_per_item * G * n_max);
        float *acc = malloc(sizeof(float) * heads_per_item * G * DV);
        float *row = malloc(sizeof(float) * (D > DV ? D : DV));
        int64_t *slots = malloc(sizeof(int64_t) * n_max);
        uint16_t *pb16 = malloc(sizeof(uint16_t) * heads_per_item * G * (n_max + 2));
        /* the AVX2 path's decoded rows (16 per head of the item) and their owed factors */
        float *vbuf = malloc(sizeof(float) * heads_per_item * 16 * 64), *vf = malloc(sizeof(float) * heads_per_item * 16);
        float *fac = malloc(sizeof(float) * heads_per_item * n_max); /* 8-bit V: each row's factor, per KV head */
        int16_t *qi16 = malloc(sizeof(int16_t) * heads_per_item * G * 64); /* int8 K under bf16: int16 queries */
        uint16_t *qlut = malloc(sizeof(uint16_t) * heads_per_item * G * 64); /* fp8 K under bf16: permuted queries */
        float *qscale = malloc(sizeof(float) * heads_per_item * G);
        float *vscale = malloc(sizeof(float) * heads_per_item * G); /* int8 V under bf16: int16 probability steps */
        int32_t *acci = malloc(sizeof(int32_t) * heads_per_item * G * 64);
        float *pinv = malloc(sizeof(float) * heads_per_item * G); /* 1 / each head's softmax sum */
        const int ok = qf && scores && acc && row && slots && pb16 && vbuf && vf && fac && qi16 && qlut && qscale && vscale && acci && pinv;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* Every thread reaches the worksharing loop, even one whose scratch failed. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * splits; item++) {
            if (!ok) continue;
            const int64_t b = order[item / splits], kv0 = (item % splits) * heads_per_item;
            const int64_t NH = heads_per_item * G; /* query heads this item serves, from head kv0 * G */
            const int64_t len = seq_lens[b];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            const int64_t n = len - start;
            const int64_t *table = tables + b * MAXNB;
            for (int64_t h = 0; h < NH; h++)
                load_row(qf + h * D, (const char *)q + ((b * H + kv0 * G + h) * D) * esz, (int)D, dtype_code);

            /* The context's slots, walked block by block once (no per-token division). */
            for (int64_t t = start, blk = start / BS; t < len; blk++)
                for (int64_t off = t - blk * BS; off < BS && t < len; off++, t++) slots[t - start] = table[blk] * BS + off;

            /* Head size 64 with up to 8 query heads per KV head, fp32 or bf16: the AVX-512 path. */
#ifdef KVF_HAVE_AVX512
            const int fast = dense && D == 64 && DV == 64 && G <= 8 && dtype_code != 2;
            /* 8-bit rows with one scale per row: the AVX-512 8-bit path, K and V each on its own */
            const int zk = !fast && D == 64 && DV == 64 && G <= 8 && q8_reads(K, dtype_code);
            const int zv = !fast && D == 64 && DV == 64 && G <= 8 && q8_reads(V, dtype_code);
#else
            const int fast = 0, zk = 0, zv = 0;
#endif
            /* What AVX-512 does not take (everything without it; compressed operands with it), AVX2
             * does at head size 64, K and V each as its storage allows. */
#ifdef KVF_HAVE_AVX2
            const int avx2 = !fast && D == 64 && DV == 64 && G <= 8;
            const int fast_k = avx2 && !zk && avx2_reads(K, dtype_code), fast_v = avx2 && !zv && avx2_reads(V, dtype_code);
#else
            const int fast_k = 0, fast_v = 0;
#endif
            /* fp32 rows of several KV heads: walked whole, row by row (`scores_rows_f32`) */
            const int rows_f32 = fast && KVF_ROW_MAJOR_F32 && dtype_code == 0 && heads_per_item > 1 && heads_per_item * G <= 16;
            if (rows_f32) {
#ifdef KVF_HAVE_AVX512
                __m512 part[KVF_ROW_STREAMS * 16 * 16];
                const size_t off0 = (size_t)kv0 * D * esz;
                for (int64_t i = 0; i < n && i < 16 * KVF_ROW_STREAMS; i++)
                    prefetch_run_starts((const char *)k_cache, slots, i, k_row, off0, (size_t)heads_per_item * 256);
                for (int64_t i0 = 0; i0 < n; i0 += 16 * KVF_ROW_STREAMS) {
#define KVF_SCORES(GC) scores_rows_f32(qf, (const char *)k_cache, slots, i0, n, k_row, off0, heads_per_item, scores, part, GC)
                    KVF_DISPATCH_G(G, KVF_SCORES)
#undef KVF_SCORES
                }
#endif
            } else if (fast) {
#ifdef KVF_HAVE_AVX512
                /* Block by block: a block's rows (all the item's KV heads) are fetched from memory
                 * once and reused from L1 by each head, while the rows KVF_PREFETCH_ROWS ahead are
                 * prefetched (the first ones now, and V's first ones before the softmax). */
                prefetch_rows((const char *)k_cache, slots, 0, n < KVF_PREFETCH_ROWS ? n : KVF_PREFETCH_ROWS, k_row);
                for (int64_t i0 = 0; i0 < n; i0 += 16) {
                    const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                    for (int64_t j = 0; j < heads_per_item; j++) {
                        const char *qp = (const char *)q + ((b * H + (kv0 + j) * G) * D) * esz;
                        const size_t off = (size_t)(kv0 + j) * D * esz;
#define KVF_SCORES(GC) scores_d64(qp, (const char *)k_cache, slots, i0, cnt, n, k_row, off, dtype_code, scores + (j * G) * n, (const char *)v_cache, v_row, GC)
                        KVF_DISPATCH_G(G, KVF_SCORES)
#undef KVF_SCORES
                    }
                }
#endif
            } else if (zk) {
#ifdef KVF_HAVE_AVX512
                /* int8 keys under bf16 compute: VPDPWSSD against the item's queries scaled to int16 once */
                int i8_k = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
                i8_k = dtype_code == 1 && K->code == KVF_INT8;
                if (i8_k) quantize_query_i16(qf, NH, qi16, qscale);
#endif
                (void)i8_k;
                /* fp8 keys under bf16 compute: table lookups against the item's queries permuted once */
                int lut_k = 0;
#if defined(KVF_HAVE_FP8_LUT)
                lut_k = dtype_code == 1 && (K->code == KVF_E4M3 || K->code == KVF_E5M2);
                if (lut_k) lut_queries((const uint16_t *)q + (b * H + kv0 * G) * 64, NH, qlut);
#endif
                (void)lut_k;
                prefetch_rows(K->data, slots, 0, n < KVF_PREFETCH_ROWS ? n : KVF_PREFETCH_ROWS, k_row);
                for (int64_t i0 = 0; i0 < n; i0 += 16) {
                    const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                    for (int64_t j = 0; j < heads_per_item; j++) {
                        const char *qp = (const char *)q + ((b * H + (kv0 + j) * G) * D) * esz;
                        const int16_t *qij = qi16 + j * G * 64;
                        const float *qsj = qscale + j * G;
                        (void)qp, (void)qij, (void)qsj; /* each build uses the ones its paths take */
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
                        if (i8_k) {
#define KVF_SCORES(GC) scores_q8(NULL, NULL, qij, qsj, K, slots, i0, cnt, n, kv0 + j, scores + (j * G) * n, GC, KVF_INT8, SQ_I16)
                            KVF_DISPATCH_G(G, KVF_SCORES)
#undef KVF_SCORES
                            continue;
                        }
#endif
#if defined(KVF_HAVE_FP8_LUT)
                        if (lut_k) {
#define KVF_SCORES(GC) scores_q8(NULL, (const char *)(qlut + j * G * 64), NULL, NULL, K, slots, i0, cnt, n, kv0 + j, scores + (j * G) * n, GC, zcode, SQ_LUT)
                            KVF_DISPATCH_FP8(K->code, KVF_SCORES)
#undef KVF_SCORES
                            continue;
                        }
#endif
#if defined(__AVX512BF16__)
                        if (dtype_code == 1) {
#define KVF_SCORES(GC) scores_q8(NULL, qp, NULL, NULL, K, slots, i0, cnt, n, kv0 + j, scores + (j * G) * n, GC, zcode, SQ_BF16)
                            KVF_DISPATCH_Q8(K->code, KVF_SCORES)
#undef KVF_SCORES
                            continue;
                        }
#endif
#define KVF_SCORES(GC) scores_q8(qf + j * G * 64, NULL, NULL, NULL, K, slots, i0, cnt, n, kv0 + j, scores + (j * G) * n, GC, zcode, SQ_F32)
                        KVF_DISPATCH_Q8(K->code, KVF_SCORES)
#undef KVF_SCORES
                    }
                }
#endif
            } else if (fast_k) {
#ifdef KVF_HAVE_AVX2
                prefetch_rows((const char *)k_cache, slots, 0, n < KVF_AVX2_PREFETCH_ROWS ? n : KVF_AVX2_PREFETCH_ROWS, k_row);
                for (int64_t i0 = 0; i0 < n; i0 += 16) {
                    const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                    rows_avx2(K, slots, i0, cnt, kv0, heads_per_item, BS, dtype_code, vbuf, vf, n);
                    for (int64_t j = 0; j < heads_per_item; j++) {
#define KVF_SCORES(GC) scores_avx2(qf + j * G * 64, vbuf + j * 16 * 64, vf + j * 16, cnt, n, scores + (j * G) * n + i0, GC)
                        KVF_DISPATCH_G(G, KVF_SCORES)
#undef KVF_SCORES
                    }
                }
#endif
            } else {
                /* Pass 1: scores; each key row is read once for all query heads of its group. */
                for (int64_t i = 0; i < n; i++) {
                    if (i + BS < n) /* the next block lies elsewhere in the pool: start fetching it now */
                        for (size_t off = 0; off < k_row; off += 64)
                            __builtin_prefetch((const char *)k_cache + slots[i + BS] * k_row + off, 0, 2);
                    for (int64_t j = 0; j < heads_per_item; j++) {
                        float *st = scores + (j * G) * n + i;
                        if (D == 64) /* the common head size, as a constant: fully unrolled vector code */
                            score_row(qf + j * G * D, kv_row(row, K, slots[i], kv0 + j, 64, BS, dtype_code), G, 64, st, n);
                        else
                            score_row(qf + j * G * D, kv_row(row, K, slots[i], kv0 + j, (int)D, BS, dtype_code), G,
                                      (int)D, st, n);
                    }
                }
            }
            if (fast && !rows_f32) { /* the V rows the score pass did not fetch yet: its last KVF_V_PREFETCH_LAG */
                const int64_t v0 = n > KVF_V_PREFETCH_LAG ? n - KVF_V_PREFETCH_LAG : 0;
                prefetch_rows((const char *)v_cache, slots, v0, n - v0, v_row);
            }
#ifdef KVF_HAVE_AVX2
            if (fast_v) prefetch_rows((const char *)v_cache, slots, 0, n < KVF_AVX2_PREFETCH_ROWS ? n : KVF_AVX2_PREFETCH_ROWS, v_row);
#endif
            /* Softmax per head in fp32 (vectorised exp); scale and soft-cap applied here, in the pass that
             * finds the maximum. The AVX-512 V passes read each probability once (to round it, or to
             * broadcast it), so they multiply by 1 / sum there: the same product, one pass over the scores
             * fewer. The other paths get normalised probabilities here. */
            const int fold_norm = fast || zv;
            for (int64_t h = 0; h < NH; h++) {
                float *sg = scores + h * n;
                float m = -INFINITY;
                if (softcap > 0.f) {
                    const float inv_cap = scale / softcap;
#pragma omp simd reduction(max : m)
                    for (int64_t i = 0; i < n; i++) {
                        sg[i] = tanhf(sg[i] * inv_cap) * softcap;
                        m = sg[i] > m ? sg[i] : m;
                    }
                } else {
#pragma omp simd reduction(max : m)
                    for (int64_t i = 0; i < n; i++) {
                        sg[i] *= scale;
                        m = sg[i] > m ? sg[i] : m;
                    }
                }
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t i = 0; i < n; i++) {
                    sg[i] = expf(sg[i] - m);
                    sum += sg[i];
                }
                pinv[h] = 1.f / sum;
                if (!fold_norm) {
                    const float inv = pinv[h];
#pragma omp simd
                    for (int64_t i = 0; i < n; i++) sg[i] *= inv;
                }
            }
            if (rows_f32) {
#ifdef KVF_HAVE_AVX512
#define KVF_VALUES(GC) values_rows_f32(scores, pinv, (const char *)v_cache, slots, n, v_row, (size_t)kv0 * DV * esz, heads_per_item, acc, GC)
                KVF_DISPATCH_G(G, KVF_VALUES)
#undef KVF_VALUES
#endif
            } else if (fast) {
#ifdef KVF_HAVE_AVX512
                memset(acc, 0, sizeof(float) * NH * DV);
#if defined(__AVX512BF16__)
                const int bf16_pairs = dtype_code == 1;
                const int64_t npad = n + 2 - (n & 1); /* even, with room for the zero after row n - 1 */
                if (bf16_pairs)
                    for (int64_t h = 0; h < NH; h++) probs_to_bf16(scores + h * n, pinv[h], NULL, pb16 + h * npad, n);
#endif
                for (int64_t i0 = 0; i0 < n; i0 += 16) {
                    const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                    for (int64_t j = 0; j < heads_per_item; j++) {
                        const size_t off = (size_t)(kv0 + j) * DV * esz;
#if defined(__AVX512BF16__)
                        if (bf16_pairs) {
#define KVF_VALUES(GC) values_d64_bf16(pb16 + (j * G) * npad, (const char *)v_cache, slots, i0, cnt, n, npad, v_row, off, acc + (j * G) * DV, GC, NULL, 0, 0)
                            KVF_DISPATCH_G(G, KVF_VALUES)
#undef KVF_VALUES
                            continue;
                        }
#endif
#define KVF_VALUES(GC) values_d64(scores + (j * G) * n, pinv + j * G, (const char *)v_cache, slots, i0, cnt, n, v_row, off, dtype_code, acc + (j * G) * DV, GC)
                        KVF_DISPATCH_G(G, KVF_VALUES)
#undef KVF_VALUES
                    }
                }
#if defined(__AVX512BF16__)
                if (bf16_pairs)
                    for (int64_t h = 0; h < NH; h++) unpermute_d64(acc + h * DV);
#endif
#endif
            } else if (zv) {
#ifdef KVF_HAVE_AVX512
                memset(acc, 0, sizeof(float) * NH * DV);
                prefetch_rows(V->data, slots, 0, n < KVF_PREFETCH_ROWS ? n : KVF_PREFETCH_ROWS, v_row);
                for (int64_t j = 0; j < heads_per_item; j++) q8_factors(V, slots, n, kv0 + j, fac + j * n);
#if defined(__AVX512BF16__)
#if defined(__AVX512VNNI__)
                if (dtype_code == 1 && V->code == KVF_INT8) {
                    const int64_t npad = n + 2 - (n & 1);
                    int16_t *pi = (int16_t *)pb16;
                    for (int64_t j = 0; j < heads_per_item; j++) {
                        probs_q8_to_i16(scores + (j * G) * n, pinv + j * G, fac + j * n, n, (int)G, pi + (j * G) * npad, npad, vscale + j * G);
                    }
                    memset(acci, 0, sizeof(int32_t) * NH * DV);
                    for (int64_t i0 = 0; i0 < n; i0 += 16) {
                        const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                        for (int64_t j = 0; j < heads_per_item; j++) {
#define KVF_VALUES(GC) values_i8_vnni(pi + (j * G) * npad, V, slots, i0, cnt, n, npad, kv0 + j, acci + (j * G) * DV, GC)
                            KVF_DISPATCH_G(G, KVF_VALUES)
#undef KVF_VALUES
                        }
                        if ((i0 + 16) % VNNI_FLUSH_ROWS == 0 || i0 + 16 >= n) flush_i32(acc, acci, vscale, NH);
                    }
                    for (int64_t h = 0; h < NH; h++) unpermute_d64(acc + h * DV);
                } else
#endif
                if (dtype_code == 1) {
                    const int64_t npad = n + 2 - (n & 1);
                    /* fp8 rows by table where the CPU has VBMI, their factors on the probabilities */
                    int lut = 0;
#if defined(KVF_HAVE_FP8_LUT)
                    lut = V->code == KVF_E4M3 || V->code == KVF_E5M2;
#endif
                    for (int64_t h = 0; h < NH; h++)
                        probs_to_bf16(scores + h * n, pinv[h], lut ? fac + (h / G) * n : NULL, pb16 + h * npad, n);
                    for (int64_t i0 = 0; i0 < n; i0 += 16) {
                        const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                        for (int64_t j = 0; j < heads_per_item; j++) {
#define KVF_VALUES(GC, LUT) values_d64_bf16(pb16 + (j * G) * npad, V->data, slots, i0, cnt, n, npad, (size_t)V->row_bytes, (size_t)((kv0 + j) * V->head_bytes), acc + (j * G) * DV, GC, fac + j * n, zcode, LUT)
#define KVF_VALUES_LUT(GC) KVF_VALUES(GC, 1)
#define KVF_VALUES_DEQUANT(GC) KVF_VALUES(GC, 0)
                            if (lut) {
                                KVF_DISPATCH_FP8(V->code, KVF_VALUES_LUT)
                            } else {
                                KVF_DISPATCH_Q8(V->code, KVF_VALUES_DEQUANT)
                            }
#undef KVF_VALUES_DEQUANT
#undef KVF_VALUES_LUT
#undef KVF_VALUES
                        }
                    }
                    for (int64_t h = 0; h < NH; h++) (lut ? unpermute_lut_d64 : unpermute_d64)(acc + h * DV);
                } else
#endif
                for (int64_t i0 = 0; i0 < n; i0 += 16) {
                    const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                    for (int64_t j = 0; j < heads_per_item; j++) {
#define KVF_VALUES(GC) values_q8(scores + (j * G) * n, pinv + j * G, V, slots, i0, cnt, n, kv0 + j, fac + j * n, acc + (j * G) * DV, GC, zcode)
                        KVF_DISPATCH_Q8(V->code, KVF_VALUES)
#undef KVF_VALUES
                    }
                }
#endif
            } else if (fast_v) {
#ifdef KVF_HAVE_AVX2
                memset(acc, 0, sizeof(float) * NH * DV);
                for (int64_t i0 = 0; i0 < n; i0 += 16) {
                    const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                    rows_avx2(V, slots, i0, cnt, kv0, heads_per_item, BS, dtype_code, vbuf, vf, n);
                    for (int64_t j = 0; j < heads_per_item; j++) {
#define KVF_VALUES(GC) values_avx2(scores + (j * G) * n + i0, vbuf + j * 16 * 64, vf + j * 16, cnt, n, acc + (j * G) * DV, GC)
                        KVF_DISPATCH_G(G, KVF_VALUES)
#undef KVF_VALUES
                    }
                }
#endif
            } else {
                /* Pass 2: weighted sum of V; each value row is read once for all query heads of its group. */
                memset(acc, 0, sizeof(float) * NH * DV);
                for (int64_t i = 0; i < n; i++) {
                    if (i + BS < n)
                        for (size_t off = 0; off < v_row; off += 64)
                            __builtin_prefetch((const char *)v_cache + slots[i + BS] * v_row + off, 0, 2);
                    for (int64_t j = 0; j < heads_per_item; j++) {
                        const float *pt = scores + (j * G) * n + i;
                        float *aj = acc + (j * G) * DV;
                        if (DV == 64)
                            accumulate_row(aj, kv_row(row, V, slots[i], kv0 + j, 64, BS, dtype_code), G, 64, pt, n);
                        else
                            accumulate_row(aj, kv_row(row, V, slots[i], kv0 + j, (int)DV, BS, dtype_code), G, (int)DV,
                                           pt, n);
                    }
                }
            }
            for (int64_t h = 0; h < NH; h++)
                store_row((char *)out + ((b * H + kv0 * G + h) * DV) * esz, acc + h * DV, (int)DV, dtype_code);
        }
        free(qf);
        free(scores);
        free(acc);
        free(row);
        free(slots);
        free(pb16);
        free(vbuf);
        free(vf);
        free(fac);
        free(qi16);
        free(qlut);
        free(qscale);
        free(vscale);
        free(acci);
        free(pinv);
        KVF_FTZ_END();
    }
    free(order);
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------
 * Paged prefill attention: the chunks of a step's prefilling sequences, each query attending to its
 * cached prefix and the chunk's earlier tokens (causal, optionally windowed), K/V read in place.
 *
 * Why: SDPA's CPU flash kernel runs these at ~60 GFLOP/s on this project's CPUs, and the paged
 * cache must first be gathered into contiguous K/V for it. Here a work item is (chunk, KV head,
 * tile of query tokens); it walks the visible keys 16 at a time, transposes the 16 key rows once
 * (so scores are plain vector FMAs of a broadcast query element against 16 keys, no horizontal
 * sums) and serves all query vectors of the tile (tokens x the G heads of the group) from that,
 * with an online softmax (running max and sum per query vector, fp32).
 *
 * Head size 64 (K and V) and at most 8 query heads per KV head; AVX-512 only (the caller checks
 * `kvf_paged_prefill_supported`). bf16 scores use VDPBF16PS on bf16 query/key pairs, and so does the
 * bf16 P.V product (probabilities rounded to bf16 pairs, V rows interleaved by key pairs; 1.11x on a
 * 1,024-token chunk after 1,024 cached tokens against fp32 FMAs, measured in one process). K and V are
 * `kvf_kv` operands like the decode kernel's: compressed rows (fp8, int8, int4, any scale granularity,
 * K/V split) are decoded in the block loop, once per 16 keys for all the item's query vectors, so a
 * quantized cache's prefill no longer gathers and dequantizes the whole context for SDPA.
 *
 *   q    [T, H, 64] (rows of the whole step; chunk c holds rows row0[c] .. row0[c] + qlen[c] - 1)
 *   out  [T, H, 64] (only the chunks' rows are written)
 *   tables [C, MAXNB] int64; start[c]: tokens already cached before chunk c
 * --------------------------------------------------------------------------------------------- */
#ifdef KVF_HAVE_AVX512
/* Rows r[0..15] (16 floats each) in, columns out: afterwards r[i] lane j holds what r[j] lane i held. */
static inline __attribute__((always_inline)) void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    /* r[4i + c], 128-bit lane L: rows 4i..4i+3 at column 4L + c */
    __m512 o[16];
    for (int c = 0; c < 4; c++) {
        const __m512 a = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
        const __m512 e = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88), f = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
        o[c] = _mm512_shuffle_f32x4(a, e, 0x88);
        o[8 + c] = _mm512_shuffle_f32x4(a, e, 0xDD);
        o[4 + c] = _mm512_shuffle_f32x4(b, f, 0x88);
        o[12 + c] = _mm512_shuffle_f32x4(b, f, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = o[i];
}

typedef struct {
    int64_t chunk, t0, t1, kv_head, cost;
} prefill_item;

static int by_cost_desc(const void *a, const void *b) {
    const int64_t x = ((const prefill_item *)a)->cost, y = ((const prefill_item *)b)->cost;
    return (x < y) - (x > y);
}

/* One item: query tokens [t0, t1) of chunk c against KV head j, all G query heads of the group. */
static inline __attribute__((always_inline)) void prefill_item_run(
    const prefill_item *it, const char *q, const kvf_kv *K, const kvf_kv *V, const int64_t *table,
    int64_t row0, int64_t start, char *out, int64_t H, int64_t BS, int64_t window, float scale,
    float softcap, int code, float *qf, float *acc, float *mrun, float *lrun, __m512 *kt, float *vf, const int G) {
    const size_t esz = code == 0 ? 4 : 2;
    const char *k_cache = K->data, *v_cache = V->data;
    const size_t k_row = (size_t)K->row_bytes, v_row = (size_t)V->row_bytes; /* one token, all KV heads */
    const size_t k_off = (size_t)(it->kv_head * K->head_bytes), v_off = (size_t)(it->kv_head * V->head_bytes);
    /* Rows stored in the compute dtype are read as they lie; compressed rows (any format and scale
     * granularity) are decoded once per 16-key block by `kv_row`, exactly as the decode kernel's portable
     * loops and the reference dequantize them, and then shared by the item's query vectors. */
    const int dense_k = K->code == code && K->gran == KVF_SCALE_NONE, dense_v = V->code == code && V->gran == KVF_SCALE_NONE;
    const int64_t nt = it->t1 - it->t0, nv = nt * G;
    const int use_dp = 0
#if defined(__AVX512BF16__)
        || code == 1
#endif
        ;
    float kdec[64] __attribute__((aligned(64)));
    /* Queries as fp32 (or, for VDPBF16PS, kept as their bf16 pairs in place: 32 dwords a vector). */
    for (int64_t tt = 0; tt < nt; tt++)
        for (int g = 0; g < G; g++) {
            const char *src = q + (((row0 + it->t0 + tt) * H + it->kv_head * G + g) * 64) * esz;
            float *dst = qf + (tt * G + g) * 64;
            if (use_dp)
                memcpy(dst, src, 128);
            else
                load_row(dst, src, 64, code);
        }
    for (int64_t v = 0; v < nv; v++) {
        mrun[v] = -INFINITY;
        lrun[v] = 0.f;
    }
    memset(acc, 0, sizeof(float) * nv * 64);
    const int64_t p_first = start + it->t0, p_last = start + it->t1 - 1;
    const int64_t kmin = window > 0 && p_first - window + 1 > 0 ? p_first - window + 1 : 0;
    float pbuf[16] __attribute__((aligned(64)));
    float sbuf[16] __attribute__((aligned(64)));
    for (int64_t kb = kmin; kb <= p_last; kb += 16) {
        const int cnt = p_last - kb + 1 < 16 ? (int)(p_last - kb + 1) : 16;
        /* The 16 key rows of this head, transposed: kt[d] = 16 keys' element d (fp32 path), or
         * kt[dp] = 16 keys' bf16 pair dp (VDPBF16PS path). V rows widened to fp32 in vf. */
        const char *krow[16], *vrow[16];
        int64_t kslot[16];
        for (int r = 0; r < 16; r++) {
            const int64_t key = kb + (r < cnt ? r : 0);
            const int64_t slot = table[key / BS] * BS + key % BS;
            krow[r] = k_cache + slot * k_row + k_off;
            vrow[r] = v_cache + slot * v_row + v_off;
            kslot[r] = slot;
        }
        if (!dense_k) {
            /* decoded rows hold values of the compute dtype: for bf16 they convert back to bf16 exactly,
             * and take the VDPBF16PS layout of stored bf16 rows (pairs of elements per 32-bit lane) */
            for (int r = 0; r < 16; r++) {
                const float *x = r < cnt ? kv_row(kdec, K, kslot[r], it->kv_head, 64, BS, code) : NULL;
#if defined(__AVX512BF16__)
                if (use_dp) {
                    for (int half = 0; half < 2; half++)
                        kt[half * 16 + r] = x ? (__m512)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 32 * half + 16),
                                                                         _mm512_loadu_ps(x + 32 * half))
                                              : _mm512_setzero_ps();
                    continue;
                }
#endif
                for (int c = 0; c < 4; c++) kt[c * 16 + r] = x ? _mm512_loadu_ps(x + 16 * c) : _mm512_setzero_ps();
            }
            for (int c = 0; c < (use_dp ? 2 : 4); c++) transpose16(kt + c * 16);
        } else if (use_dp) {
            for (int half = 0; half < 2; half++) {
                for (int r = 0; r < 16; r++)
                    kt[half * 16 + r] = r < cnt ? _mm512_loadu_ps((const float *)(krow[r] + 64 * half)) : _mm512_setzero_ps();
                transpose16(kt + half * 16);
            }
        } else {
            for (int c = 0; c < 4; c++) {
                for (int r = 0; r < 16; r++) {
                    if (r >= cnt) {
                        kt[c * 16 + r] = _mm512_setzero_ps();
                    } else if (code == 0) {
                        kt[c * 16 + r] = _mm512_loadu_ps((const float *)krow[r] + 16 * c);
                    } else {
                        __m512 x[4];
                        load64(krow[r], code, x);
                        kt[c * 16 + r] = x[c];
                    }
                }
                transpose16(kt + c * 16);
            }
        }
#if defined(__AVX512BF16__)
        if (use_dp) {
            /* bf16 V rows, keys paired element by element (rows 2j and 2j+1 unpacked), so that one
             * VDPBF16PS adds p_2j * v_2j + p_2j+1 * v_2j+1 for 16 dims, as the decode kernel's bf16 V pass;
             * the accumulators then hold dims in unpack order, restored by `unpermute_d64` at the end. */
            __m512i rows[16][2];
            for (int r = 0; r < 16; r++) {
                if (r >= cnt) {
                    rows[r][0] = rows[r][1] = _mm512_setzero_si512();
                } else if (dense_v) {
                    rows[r][0] = _mm512_loadu_si512(vrow[r]);
                    rows[r][1] = _mm512_loadu_si512(vrow[r] + 64);
                } else { /* decoded values are bf16 values: back to bf16 exactly */
                    const float *x = kv_row(kdec, V, kslot[r], it->kv_head, 64, BS, code);
                    rows[r][0] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
                    rows[r][1] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 48), _mm512_loadu_ps(x + 32));
                }
            }
            __m512i *vx = (__m512i *)vf;
            for (int j = 0; j < 8; j++) {
                vx[4 * j] = _mm512_unpacklo_epi16(rows[2 * j][0], rows[2 * j + 1][0]);
                vx[4 * j + 1] = _mm512_unpackhi_epi16(rows[2 * j][0], rows[2 * j + 1][0]);
                vx[4 * j + 2] = _mm512_unpacklo_epi16(rows[2 * j][1], rows[2 * j + 1][1]);
                vx[4 * j + 3] = _mm512_unpackhi_epi16(rows[2 * j][1], rows[2 * j + 1][1]);
            }
        } else
#endif
        for (int r = 0; r < 16; r++) {
            if (r >= cnt) {
                memset(vf + r * 64, 0, 64 * sizeof(float));
            } else if (dense_v) {
                load_row(vf + r * 64, vrow[r], 64, code);
            } else {
                const float *x = kv_row(vf + r * 64, V, kslot[r], it->kv_head, 64, BS, code);
                if (x != vf + r * 64) memcpy(vf + r * 64, x, 64 * sizeof(float));
            }
        }
        for (int64_t tt = 0; tt < nt; tt++) {
            const int64_t p = p_first + tt; /* this token's position: it sees keys (p - window, p] */
            const int64_t lo = window > 0 ? p - window + 1 : 0;
            if (kb > p || kb + cnt - 1 < lo) continue;
            __mmask16 valid = (__mmask16)((1u << cnt) - 1u);
            if (kb + 15 > p) valid &= (__mmask16)((1u << (p - kb + 1)) - 1u);
            if (kb < lo) valid &= (__mmask16)~((1u << (lo - kb)) - 1u);
            for (int g = 0; g < G; g++) {
                const int64_t v = tt * G + g;
                const float *qv = qf + v * 64;
                __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#if defined(__AVX512BF16__)
                if (use_dp) {
                    const int32_t *qp = (const int32_t *)qv;
                    for (int dp = 0; dp < 32; dp += 4) {
                        s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_set1_epi32(qp[dp]), (__m512bh)kt[dp]);
                        s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_set1_epi32(qp[dp + 1]), (__m512bh)kt[dp + 1]);
                        s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_set1_epi32(qp[dp + 2]), (__m512bh)kt[dp + 2]);
                        s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_set1_epi32(qp[dp + 3]), (__m512bh)kt[dp + 3]);
                    }
                } else
#endif
                {
                    for (int d = 0; d < 64; d += 4) {
                        s0 = _mm512_fmadd_ps(_mm512_set1_ps(qv[d]), kt[d], s0);
                        s1 = _mm512_fmadd_ps(_mm512_set1_ps(qv[d + 1]), kt[d + 1], s1);
                        s2 = _mm512_fmadd_ps(_mm512_set1_ps(qv[d + 2]), kt[d + 2], s2);
                        s3 = _mm512_fmadd_ps(_mm512_set1_ps(qv[d + 3]), kt[d + 3], s3);
                    }
                }
                _mm512_store_ps(sbuf, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
                if (softcap > 0.f) {
                    const float inv_cap = scale / softcap;
#pragma omp simd
                    for (int r = 0; r < 16; r++) sbuf[r] = tanhf(sbuf[r] * inv_cap) * softcap;
                } else {
#pragma omp simd
                    for (int r = 0; r < 16; r++) sbuf[r] *= scale;
                }
                const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), _mm512_load_ps(sbuf));
                const float m_new = fmaxf(mrun[v], _mm512_reduce_max_ps(s));
                const float corr = expf(mrun[v] - m_new); /* 0 on the first block (m was -inf) */
                _mm512_store_ps(sbuf, _mm512_sub_ps(s, _mm512_set1_ps(m_new)));
#pragma omp simd
                for (int r = 0; r < 16; r++) pbuf[r] = expf(sbuf[r]); /* masked keys: exp(-inf) = 0 */
                lrun[v] = lrun[v] * corr + _mm512_reduce_add_ps(_mm512_load_ps(pbuf));
                mrun[v] = m_new;
                float *a = acc + v * 64;
                const __m512 cv = _mm512_set1_ps(corr);
                __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(a), cv), a1 = _mm512_mul_ps(_mm512_loadu_ps(a + 16), cv);
                __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(a + 32), cv), a3 = _mm512_mul_ps(_mm512_loadu_ps(a + 48), cv);
#if defined(__AVX512BF16__)
                if (use_dp) { /* probabilities rounded to bf16 pairs, as the reference rounds them */
                    const __m256bh pb = _mm512_cvtneps_pbh(_mm512_load_ps(pbuf));
                    int32_t pairs[8];
                    memcpy(pairs, &pb, sizeof pairs);
                    const __m512i *vx = (const __m512i *)vf;
                    for (int j = 0; j < (cnt + 1) / 2; j++) {
                        const __m512bh w = (__m512bh)_mm512_set1_epi32(pairs[j]);
                        a0 = _mm512_dpbf16_ps(a0, w, (__m512bh)vx[4 * j]);
                        a1 = _mm512_dpbf16_ps(a1, w, (__m512bh)vx[4 * j + 1]);
                        a2 = _mm512_dpbf16_ps(a2, w, (__m512bh)vx[4 * j + 2]);
                        a3 = _mm512_dpbf16_ps(a3, w, (__m512bh)vx[4 * j + 3]);
                    }
                } else
#endif
                for (int r = 0; r < cnt; r++) {
                    const __m512 w = _mm512_set1_ps(pbuf[r]);
                    const float *vr = vf + r * 64;
                    a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr), a0);
                    a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16), a1);
                    a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 32), a2);
                    a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 48), a3);
                }
                _mm512_storeu_ps(a, a0);
                _mm512_storeu_ps(a + 16, a1);
                _mm512_storeu_ps(a + 32, a2);
                _mm512_storeu_ps(a + 48, a3);
            }
        }
    }
    for (int64_t tt = 0; tt < nt; tt++)
        for (int g = 0; g < G; g++) {
            const int64_t v = tt * G + g;
            const float inv = 1.f / lrun[v];
            float *a = acc + v * 64;
#if defined(__AVX512BF16__)
            if (use_dp) unpermute_d64(a);
#endif
            for (int d = 0; d < 64; d++) a[d] *= inv;
            store_row(out + (((row0 + it->t0 + tt) * H + it->kv_head * G + g) * 64) * esz, a, 64, code);
        }
}
#endif

#if defined(KVF_HAVE_AVX512)
/* ---- bf16 prefill with query vectors in lanes -------------------------------------------------------
 * Why: with keys in lanes (`prefill_item_run`), every query vector pays, per 16 keys, two horizontal
 * reductions (max, sum), a scalar exp for the running-max correction and a reload of its 64
 * accumulators, all on the critical path after its 32 score instructions: measured at ~70-110 GFLOP/s,
 * against ~400 for the matmuls. Here 16 query vectors share the lanes of every register, so a block of
 * 16 keys is
 *   scores:  s[r] (16 vectors' scores against key r) = 32 VDPBF16PS of the queries' transposed bf16
 *            pairs against key r's pairs, broadcast straight from the cache row (16 independent chains);
 *   softmax: the block max is a vertical max over the 16 registers, the running max, sum and correction
 *            are vectors of the 16 lanes (one vector exp for the correction, no horizontal op);
 *   P.V:     the probabilities become bf16 pairs of adjacent keys per lane, and each of the 64 output
 *            dims (a register of 16 lanes, in L1) takes 8 VDPBF16PS against V's pairs for that dim.
 * Same arithmetic as `prefill_item_run`'s bf16 path: exact bf16 products summed in fp32, probabilities
 * rounded to bf16 for P.V, fp32 running sums; results differ from it by summation order and the exp. */
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
    /* Cephes' expf: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial (~1 ulp). Inputs
     * below -104 (and -inf) give 0, as exp would underflow there with FTZ on. */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-104.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

#if defined(__AVX512BF16__)
/* An 8-bit row with one scale per row (`q8_reads`), dequantized and rounded to bf16 as `kv_row` does it
 * (code x scale in fp32, one rounding to nearest even; e4m3's value / 256 times scale x 256 is the same
 * product), 16 codes per instruction pair instead of kv_row's element loops: lo = dims 0-31, hi = 32-63. */
static inline __attribute__((always_inline)) void q8_row_bf16(const kvf_kv *op, int64_t slot, int64_t h, __m512i *lo,
                                                              __m512i *hi) {
    const char *p = op->data + slot * op->row_bytes + h * op->head_bytes;
    const float f = q8_factor(op, slot, h);
    if (op->code == KVF_INT8)
        dequant_row_bf16(p, f, KVF_INT8, lo, hi);
    else if (op->code == KVF_E4M3)
        dequant_row_bf16(p, f, KVF_E4M3, lo, hi);
    else
        dequant_row_bf16(p, f, KVF_E5M2, lo, hi);
}

#endif /* __AVX512BF16__ */

/* One block of 16 keys for 16 query vectors in lanes: s[r] holds the raw scores against key kb + r; they
 * are scaled (or soft-capped), masked per lane (causal at the lane's position P, and its window), and
 * replaced by their exp against the updated running max; the running max and sum advance, and the
 * factor the accumulators owe for the new max is returned. */
static inline __attribute__((always_inline)) __m512 lanes_softmax(__m512 *s, __m512i P, int64_t kb, int64_t window,
                                                                  float scale, float softcap, __m512 *mrun,
                                                                  __m512 *lrun) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < 16; r++) {
        if (softcap > 0.f) {
            float t[16] __attribute__((aligned(64)));
            _mm512_store_ps(t, _mm512_mul_ps(s[r], _mm512_set1_ps(scale / softcap)));
#pragma omp simd
            for (int i = 0; i < 16; i++) t[i] = tanhf(t[i]) * softcap;
            s[r] = _mm512_load_ps(t);
        } else {
            s[r] = _mm512_mul_ps(s[r], _mm512_set1_ps(scale));
        }
        const int32_t key = (int32_t)(kb + r);
        __mmask16 valid = _mm512_cmpge_epi32_mask(P, _mm512_set1_epi32(key));
        if (window > 0) valid &= _mm512_cmplt_epi32_mask(P, _mm512_set1_epi32((int32_t)(key + window)));
        s[r] = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), s[r]);
        mx = _mm512_max_ps(mx, s[r]);
    }
    const __m512 m_new = _mm512_max_ps(*mrun, mx);
    /* a lane with no visible key yet keeps -inf: subtract 0 there, so exp gives 0, not NaN */
    const __m512 m_safe = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                               m_new, _mm512_setzero_ps());
    const __m512 corr = exp512(_mm512_sub_ps(*mrun, m_safe));
    *mrun = m_new;
    __m512 sum = _mm512_setzero_ps();
    for (int r = 0; r < 16; r++) {
        s[r] = exp512(_mm512_sub_ps(s[r], m_safe));
        sum = _mm512_add_ps(sum, s[r]);
    }
    *lrun = _mm512_fmadd_ps(*lrun, corr, sum);
    return corr;
}

/* Queries of an item transposed into lanes: qt[grp][e][lane] = element (or bf16 pair) e of vector
 * grp * 16 + lane (vector v = token v / G, head v % G), `per` 32-bit words a vector (per < 0: bf16
 * queries widened to 64 floats); pos[v] its position (INT32_MIN past nv: such lanes never see a key). */
static void lanes_queries(const prefill_item *it, const char *q, int64_t row0, int64_t start, int64_t H, int64_t G,
                          int per, int32_t *qt, int32_t *pos) {
    const int64_t nt = it->t1 - it->t0, nv = nt * G, ngroups = (nv + 15) / 16;
    const int words = per < 0 ? 64 : per; /* 32-bit words a vector in qt */
    memset(qt, 0, sizeof(int32_t) * ngroups * words * 16);
    for (int64_t v = 0; v < ngroups * 16; v++) pos[v] = INT32_MIN;
    for (int64_t v = 0; v < nv; v++) {
        const int64_t tt = v / G, g = v % G;
        int32_t *dst = qt + (v / 16) * words * 16 + v % 16;
        if (per < 0) { /* bf16 queries widened to fp32: 64 floats a vector */
            const uint16_t *src = (const uint16_t *)q + ((row0 + it->t0 + tt) * H + it->kv_head * G + g) * 64;
            for (int e = 0; e < 64; e++) ((float *)dst)[e * 16] = bf16_to_f32(src[e]);
        } else {
            const int32_t *src = (const int32_t *)q + ((row0 + it->t0 + tt) * H + it->kv_head * G + g) * per;
            for (int e = 0; e < per; e++) dst[e * 16] = src[e];
        }
        pos[v] = (int32_t)(start + it->t0 + tt);
    }
}

/* The lanes layout's output, stored as `code`: vector v's dim is acc_t[grp][idx][lane] / l[lane] (or, with
 * `lane_major`, acc_t[grp][lane][idx]: the AMX loop's C tiles), idx = dim or (`permuted`) the unpack order
 * of `prefill_item_bf16`. */
static void lanes_store(const prefill_item *it, char *out, int64_t row0, int64_t H, int64_t G, const float *acc_t,
                        const __m512 *lrun, int code, int permuted, int lane_major) {
    const int64_t nv = (it->t1 - it->t0) * G, ngroups = (nv + 15) / 16;
    const size_t esz = code == KVF_F32 ? 4 : 2;
    for (int64_t grp = 0; grp < ngroups; grp++) {
        float linv[16] __attribute__((aligned(64)));
        _mm512_store_ps(linv, _mm512_div_ps(_mm512_set1_ps(1.f), lrun[grp]));
        const float *ag = acc_t + grp * 1024;
        for (int lane = 0; lane < 16 && grp * 16 + lane < nv; lane++) {
            const int64_t v = grp * 16 + lane, tt = v / G, g = v % G;
            float row[64];
            for (int d = 0; d < 64; d++) {
                const int c = d / 16, L = d % 16;
                const int dim = !permuted ? d : 32 * (c / 2) + 8 * (L / 4) + 4 * (c % 2) + L % 4;
                row[dim] = ag[lane_major ? lane * 64 + d : d * 16 + lane] * linv[lane];
            }
            store_row(out + (((row0 + it->t0 + tt) * H + it->kv_head * G + g) * 64) * esz, row, 64, code);
        }
    }
}

#if defined(__AVX512BF16__)
/* The lanes groups' running max and sum (empty), and the first and last position of each group's lanes. */
static inline void lanes_groups_init(const int32_t *pos, int64_t nv, int64_t ngroups, __m512 *mrun, __m512 *lrun,
                                     int32_t *gmin, int32_t *gmax) {
    for (int64_t grp = 0; grp < ngroups; grp++) {
        mrun[grp] = _mm512_set1_ps(-INFINITY);
        lrun[grp] = _mm512_setzero_ps();
        gmin[grp] = pos[grp * 16];
        const int64_t last = grp * 16 + 15 < nv - 1 ? grp * 16 + 15 : nv - 1;
        gmax[grp] = pos[last];
    }
}

/* One block of 16 keys (kb .. kb + cnt - 1, the rest zero) as bf16, read in place or decoded. K: kd[r] points
 * at key r's 64 bf16 (pairs as int32): into the cache for dense rows unless `copy_k`, else into kbuf (16 x 64,
 * where decoded or copied rows go; `zero_row` for missing keys). V: the block as pairs of adjacent keys,
 * vx[(4j + c) * 16 + L] = (v_2j, v_2j+1) at dim 32(c/2) + 8(L/4) + 4(c%2) + L%4 (the unpack order). Decoded
 * values are bf16 values, so going back to bf16 is exact. */
static inline __attribute__((always_inline)) void block_rows_bf16(
    const kvf_kv *K, const kvf_kv *V, const int64_t *table, int64_t BS, int64_t kv_head, int64_t kb, int cnt,
    int copy_k, const int32_t **kd, uint16_t *kbuf, const uint16_t *zero_row, int32_t *vx) {
    const size_t k_row = (size_t)K->row_bytes, v_row = (size_t)V->row_bytes;
    const size_t k_off = (size_t)(kv_head * K->head_bytes), v_off = (size_t)(kv_head * V->head_bytes);
    const int dense_k = K->code == KVF_BF16 && K->gran == KVF_SCALE_NONE;
    const int dense_v = V->code == KVF_BF16 && V->gran == KVF_SCALE_NONE;
    const int q8_k = q8_reads(K, KVF_BF16), q8_v = q8_reads(V, KVF_BF16);
    float kdec[64] __attribute__((aligned(64)));
    __m512i rows[16][2];
    for (int r = 0; r < 16; r++) {
        uint16_t *dst = kbuf + r * 64;
        if (r >= cnt) {
            if (copy_k) {
                _mm512_storeu_si512(dst, _mm512_setzero_si512());
                _mm512_storeu_si512(dst + 32, _mm512_setzero_si512());
                kd[r] = (const int32_t *)dst;
            } else {
                kd[r] = (const int32_t *)zero_row;
            }
            rows[r][0] = rows[r][1] = _mm512_setzero_si512();
            continue;
        }
        const int64_t key = kb + r, slot = table[key / BS] * BS + key % BS;
        if (dense_k) {
            const char *kp = K->data + slot * k_row + k_off;
            if (copy_k) {
                _mm512_storeu_si512(dst, _mm512_loadu_si512(kp));
                _mm512_storeu_si512(dst + 32, _mm512_loadu_si512(kp + 64));
                kd[r] = (const int32_t *)dst;
            } else {
                kd[r] = (const int32_t *)kp;
            }
        } else if (q8_k) {
            __m512i lo, hi;
            q8_row_bf16(K, slot, kv_head, &lo, &hi);
            _mm512_storeu_si512(dst, lo);
            _mm512_storeu_si512(dst + 32, hi);
            kd[r] = (const int32_t *)dst;
        } else {
            const float *x = kv_row(kdec, K, slot, kv_head, 64, BS, KVF_BF16);
            _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x)));
            _mm512_storeu_si512(dst + 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 48), _mm512_loadu_ps(x + 32)));
            kd[r] = (const int32_t *)dst;
        }
        if (dense_v) {
            const char *vp = V->data + slot * v_row + v_off;
            rows[r][0] = _mm512_loadu_si512(vp);
            rows[r][1] = _mm512_loadu_si512(vp + 64);
        } else if (q8_v) {
            q8_row_bf16(V, slot, kv_head, &rows[r][0], &rows[r][1]);
        } else {
            const float *x = kv_row(kdec, V, slot, kv_head, 64, BS, KVF_BF16);
            rows[r][0] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
            rows[r][1] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 48), _mm512_loadu_ps(x + 32));
        }
    }
    for (int j = 0; j < 8; j++) {
        _mm512_store_si512(vx + (4 * j) * 16, _mm512_unpacklo_epi16(rows[2 * j][0], rows[2 * j + 1][0]));
        _mm512_store_si512(vx + (4 * j + 1) * 16, _mm512_unpackhi_epi16(rows[2 * j][0], rows[2 * j + 1][0]));
        _mm512_store_si512(vx + (4 * j + 2) * 16, _mm512_unpacklo_epi16(rows[2 * j][1], rows[2 * j + 1][1]));
        _mm512_store_si512(vx + (4 * j + 3) * 16, _mm512_unpackhi_epi16(rows[2 * j][1], rows[2 * j + 1][1]));
    }
}

/* One item (chunk c's query tokens [t0, t1) x the G heads of KV head j) on the lanes layout. Scratch:
 * qt >= 3 x 32 x 16 dwords, acc_t >= 3 x 64 x 16 floats, kbuf 16 x 64 bf16 (+ a zero row), vx 32 x 16
 * dwords, all 64-byte aligned. */
static void prefill_item_bf16(const prefill_item *it, const char *q, const kvf_kv *K, const kvf_kv *V,
                              const int64_t *table, int64_t row0, int64_t start, char *out, int64_t H, int64_t BS,
                              int64_t window, float scale, float softcap, int64_t G, int32_t *qt, float *acc_t,
                              uint16_t *kbuf, int32_t *vx) {
    const int64_t nt = it->t1 - it->t0, nv = nt * G, ngroups = (nv + 15) / 16;
    uint16_t *zero_row = kbuf + 16 * 64; /* what missing keys of a partial block point at */
    memset(zero_row, 0, 64 * sizeof(uint16_t));
    int32_t pos[48] __attribute__((aligned(64)));
    lanes_queries(it, q, row0, start, H, G, 32, qt, pos); /* 32 bf16 pairs a vector */
    memset(acc_t, 0, sizeof(float) * ngroups * 1024);
    __m512 mrun[3], lrun[3];
    int32_t gmin[3], gmax[3];
    lanes_groups_init(pos, nv, ngroups, mrun, lrun, gmin, gmax);
    const int64_t p_first = start + it->t0, p_last = start + it->t1 - 1;
    const int64_t kmin = window > 0 && p_first - window + 1 > 0 ? p_first - window + 1 : 0;
    /* pairs of adjacent keys per lane: (p_2j, p_2j+1) from cvtne2ps_pbh(p_2j+1, p_2j)'s two halves */
    const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t kb = kmin; kb <= p_last; kb += 16) {
        const int cnt = p_last - kb + 1 < 16 ? (int)(p_last - kb + 1) : 16;
        const int32_t *kd[16];
        block_rows_bf16(K, V, table, BS, it->kv_head, kb, cnt, 0, kd, kbuf, zero_row, vx);
        for (int64_t grp = 0; grp < ngroups; grp++) {
            if (kb > gmax[grp]) continue;                                      /* all keys after every lane */
            if (window > 0 && kb + cnt - 1 <= gmin[grp] - window) continue;     /* all before every window */
            const int32_t *qg = qt + grp * 512;
            __m512 s[16];
            for (int r = 0; r < 16; r++) s[r] = _mm512_setzero_ps();
            for (int dp = 0; dp < 32; dp++) {
                const __m512bh qv = (__m512bh)_mm512_load_si512(qg + dp * 16);
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++)
                    s[r] = _mm512_dpbf16_ps(s[r], qv, (__m512bh)_mm512_set1_epi32(kd[r][dp]));
            }
            const __m512 corr = lanes_softmax(s, _mm512_load_si512(pos + grp * 16), kb, window, scale, softcap,
                                              &mrun[grp], &lrun[grp]);
            __m512bh pp[8];
            for (int j = 0; j < 8; j++)
                pp[j] = (__m512bh)_mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(s[2 * j + 1], s[2 * j]));
            float *ag = acc_t + grp * 1024;
            const int jmax = (cnt + 1) / 2;
            for (int d = 0; d < 64; d++) { /* d = c * 16 + L: the vx layout's (c, L) */
                const int c = d / 16, L = d % 16;
                __m512 a = _mm512_mul_ps(_mm512_load_ps(ag + d * 16), corr);
                for (int j = 0; j < jmax; j++)
                    a = _mm512_dpbf16_ps(a, pp[j], (__m512bh)_mm512_set1_epi32(vx[(4 * j + c) * 16 + L]));
                _mm512_store_ps(ag + d * 16, a);
            }
        }
    }
    lanes_store(it, out, row0, H, G, acc_t, lrun, KVF_BF16, 1, 0);
}
#endif

#include "kvf_amx.h"
#if defined(__AVX512BF16__) && KVF_AMX_BUILT
#define KVF_PREFILL_AMX 1
/* bf16 prefill on AMX tiles (Xeons from Sapphire Rapids on). Why: there the tile unit multiplies bf16
 * several times faster than the vector units, and both products of an item map onto tiles with no
 * transposes of the cache: the scores of 16 keys x 16 query vectors are one C tile, K rows (16 x 32 dims,
 * as they lie, 2 tiles) times the lanes layout's queries (qt: 16 lanes of dim pairs, already AMX's B
 * operand, 2 tiles); P.V is P^T (16 query vectors x 16 keys, transposed once in registers) times V as
 * pairs of adjacent keys (vx: already a B operand, 16 dims a tile). The online softmax is the lanes
 * layout's, unchanged; the accumulators are [vector][dim] here (C tiles are rows of vectors), rescaled by
 * the running max's correction only when it moved. Same exact products and bf16-rounded probabilities as
 * `prefill_item_bf16`; fp32 sums in the tile unit's order (denormals flushed, as the kernel's FTZ/DAZ).
 * Tiles: 0 scores, 1-2 K halves, 3-4 query halves, 5 a P.V block, 6 P^T, 7 V pairs. */
static void prefill_amx_configure(void) {
    kvf_amx_config cfg;
    kvf_amx_config_full(&cfg);
    cfg.colsb[6] = 32; /* P^T: 16 vectors x 16 keys bf16 */
    cfg.rows[7] = 8;   /* V: 8 pairs of keys x 16 dims */
    _tile_loadconfig(&cfg);
}

/* Scratch as `prefill_item_bf16`'s, with kbuf 16 x 64 bf16 always filled (the A tiles' rows). */
static void prefill_item_amx(const prefill_item *it, const char *q, const kvf_kv *K, const kvf_kv *V,
                             const int64_t *table, int64_t row0, int64_t start, char *out, int64_t H, int64_t BS,
                             int64_t window, float scale, float softcap, int64_t G, int32_t *qt, float *acc,
                             uint16_t *kbuf, int32_t *vx) {
    const int64_t nt = it->t1 - it->t0, nv = nt * G, ngroups = (nv + 15) / 16;
    float sbuf[256] __attribute__((aligned(64)));
    uint16_t pbuf[256] __attribute__((aligned(64)));
    int32_t pos[48] __attribute__((aligned(64)));
    lanes_queries(it, q, row0, start, H, G, 32, qt, pos); /* 32 bf16 pairs a vector: B tiles as they lie */
    memset(acc, 0, sizeof(float) * ngroups * 1024);
    __m512 mrun[3], lrun[3];
    int32_t gmin[3], gmax[3];
    lanes_groups_init(pos, nv, ngroups, mrun, lrun, gmin, gmax);
    prefill_amx_configure();
    const int64_t p_first = start + it->t0, p_last = start + it->t1 - 1;
    const int64_t kmin = window > 0 && p_first - window + 1 > 0 ? p_first - window + 1 : 0;
    for (int64_t kb = kmin; kb <= p_last; kb += 16) {
        const int cnt = p_last - kb + 1 < 16 ? (int)(p_last - kb + 1) : 16;
        const int32_t *kd[16]; /* all into kbuf: the A tiles' 16 rows, missing keys zero */
        block_rows_bf16(K, V, table, BS, it->kv_head, kb, cnt, 1, kd, kbuf, NULL, vx);
        _tile_loadd(1, kbuf, 128);
        _tile_loadd(2, kbuf + 32, 128);
        for (int64_t grp = 0; grp < ngroups; grp++) {
            if (kb > gmax[grp]) continue;                                      /* all keys after every lane */
            if (window > 0 && kb + cnt - 1 <= gmin[grp] - window) continue;     /* all before every window */
            const int32_t *qg = qt + grp * 512;
            _tile_zero(0);
            _tile_loadd(3, qg, 64);
            _tile_loadd(4, qg + 256, 64);
            _tile_dpbf16ps(0, 1, 3);
            _tile_dpbf16ps(0, 2, 4);
            _tile_stored(0, sbuf, 64);
            __m512 s[16];
            for (int r = 0; r < 16; r++) s[r] = _mm512_load_ps(sbuf + r * 16);
            const __m512 corr = lanes_softmax(s, _mm512_load_si512(pos + grp * 16), kb, window, scale, softcap,
                                              &mrun[grp], &lrun[grp]);
            transpose16(s); /* s[n] lane r: key r's probability for vector n */
            for (int n = 0; n < 16; n++) _mm256_store_si256((__m256i *)(pbuf + n * 16), (__m256i)_mm512_cvtneps_pbh(s[n]));
            float *ag = acc + grp * 1024; /* [vector][dim in vx order] */
            if (_mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.f), _CMP_NEQ_UQ)) {
                float cf[16] __attribute__((aligned(64)));
                _mm512_store_ps(cf, corr);
                for (int n = 0; n < 16; n++) {
                    const __m512 f = _mm512_set1_ps(cf[n]);
                    for (int c = 0; c < 4; c++)
                        _mm512_store_ps(ag + n * 64 + c * 16, _mm512_mul_ps(_mm512_load_ps(ag + n * 64 + c * 16), f));
                }
            }
            _tile_loadd(6, pbuf, 32);
            for (int c = 0; c < 4; c++) {
                _tile_loadd(5, ag + c * 16, 256);
                _tile_loadd(7, vx + c * 16, 256);
                _tile_dpbf16ps(5, 6, 7);
                _tile_stored(5, ag + c * 16, 256);
            }
        }
    }
    _tile_release();
    /* out: C tiles hold each vector's dims lane-major, in the vx (unpack) order */
    lanes_store(it, out, row0, H, G, acc, lrun, KVF_BF16, 1, 1);
}
#else
#define KVF_PREFILL_AMX 0
#endif

/* An 8-bit row with one scale per row (`q8_reads`) as 64 floats, 16 codes per instruction: code x factor
 * in fp32 (one rounding), then rounded to bf16 under bf16 compute, exactly the values `kv_row` gives. */
static inline __attribute__((always_inline)) void q8_row_f32_as(const kvf_kv *op, int64_t slot, int64_t h,
                                                                int compute, float *dst, const int code) {
    const char *p = op->data + slot * op->row_bytes + h * op->head_bytes;
    const __m512 f = _mm512_set1_ps(q8_factor(op, slot, h));
    for (int c = 0; c < 4; c++) {
        __m512 x = _mm512_mul_ps(load16_q8(p, c, code), f);
        if (compute == KVF_BF16) { /* f32_to_bf16's rounding, kept as an fp32 value */
            const __m512i u = _mm512_castps_si512(x);
            const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            x = _mm512_castsi512_ps(_mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                                     _mm512_set1_epi32((int)0xffff0000u)));
        }
        _mm512_store_ps(dst + 16 * c, x);
    }
}

static inline __attribute__((always_inline)) const float *q8_row_f32(const kvf_kv *op, int64_t slot, int64_t h,
                                                                    int compute, float *dst) {
    if (op->code == KVF_INT8)
        q8_row_f32_as(op, slot, h, compute, dst, KVF_INT8);
    else if (op->code == KVF_E4M3)
        q8_row_f32_as(op, slot, h, compute, dst, KVF_E4M3);
    else
        q8_row_f32_as(op, slot, h, compute, dst, KVF_E5M2);
    return dst;
}

/* Scores of the block's 16 keys (kb: rows of 64 floats, one after another) against NG groups of 16 query
 * vectors at once (qg[g]: a group's queries, dim-major), into sb[g * 16 + r] (lane = query vector): 8 keys
 * at a time, so each key element is broadcast once for every group (24 accumulators), where a group at a
 * time broadcast it once per group. Each score is still two 32-term chains (dims 0-31, then 32-63) added
 * at the end, in the order the loop of one group at a time summed them: the same bits. */
static inline __attribute__((always_inline)) void scores_f32_groups(const float *const *qg, const float *kb,
                                                                     __m512 *sb, const int NG) {
    for (int half = 0; half < 16; half += 8)
        for (int d0 = 0; d0 < 64; d0 += 32) {
            __m512 a[3][8];
            for (int g = 0; g < NG; g++)
                for (int r = 0; r < 8; r++) a[g][r] = _mm512_setzero_ps();
            for (int d = d0; d < d0 + 32; d++) {
                __m512 qv[3];
                for (int g = 0; g < NG; g++) qv[g] = _mm512_load_ps(qg[g] + d * 16);
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    const __m512 k = _mm512_set1_ps(kb[(half + r) * 64 + d]);
                    for (int g = 0; g < NG; g++) a[g][r] = _mm512_fmadd_ps(qv[g], k, a[g][r]);
                }
            }
            for (int g = 0; g < NG; g++)
                for (int r = 0; r < 8; r++)
                    sb[g * 16 + half + r] = d0 == 0 ? a[g][r] : _mm512_add_ps(sb[g * 16 + half + r], a[g][r]);
        }
}

/* fp32 on the lanes layout: the same loop as `prefill_item_bf16` with fp32 FMAs (64 a key for the scores,
 * 16 a dim for P.V), rows read as fp32 where they lie or decoded by `kv_row` as the keys-in-lanes loop
 * decodes them. Scratch: qt and acc_t >= 3 x 64 x 16 floats, kbuf 17 x 64 floats (16 rows and zeros),
 * vbuf 16 x 64 floats, all 64-byte aligned.
 * With `compute` bf16 it is the bf16 prefill on CPUs whose fp32 FMAs outrun VDPBF16PS (`kvf_set_bf16_fma`,
 * the panel kernel's measured choice; the Intel Xeons seen here): queries widened from bf16, rows decoded
 * to bf16 values as `prefill_item_bf16` takes them, so every product is the same exact product; the sums
 * stay fp32 and the probabilities are not rounded to bf16 before P.V (closer to the exact result). */
static void prefill_item_f32(const prefill_item *it, const char *q, const kvf_kv *K, const kvf_kv *V,
                             const int64_t *table, int64_t row0, int64_t start, char *out, int64_t H, int64_t BS,
                             int64_t window, float scale, float softcap, int64_t G, float *qt, float *acc_t,
                             float *kbuf, float *vbuf, int compute) {
    const int64_t nv = (it->t1 - it->t0) * G, ngroups = (nv + 15) / 16;
    const int q8_k = q8_reads(K, compute), q8_v = q8_reads(V, compute); /* 8-bit rows: vector decode */
    float *zero_row = kbuf + 16 * 64;
    memset(zero_row, 0, 64 * sizeof(float));
    int32_t pos[48] __attribute__((aligned(64)));
    lanes_queries(it, q, row0, start, H, G, compute == KVF_F32 ? 64 : -1, (int32_t *)qt, pos); /* 64 floats a vector */
    memset(acc_t, 0, sizeof(float) * ngroups * 1024);
    __m512 mrun[3], lrun[3];
    int32_t gmin[3], gmax[3];
    for (int64_t grp = 0; grp < ngroups; grp++) {
        mrun[grp] = _mm512_set1_ps(-INFINITY);
        lrun[grp] = _mm512_setzero_ps();
        gmin[grp] = pos[grp * 16];
        gmax[grp] = pos[grp * 16 + 15 < nv - 1 ? grp * 16 + 15 : nv - 1];
    }
    const int64_t p_first = start + it->t0, p_last = start + it->t1 - 1;
    const int64_t kmin = window > 0 && p_first - window + 1 > 0 ? p_first - window + 1 : 0;
    for (int64_t kb = kmin; kb <= p_last; kb += 16) {
        const int cnt = p_last - kb + 1 < 16 ? (int)(p_last - kb + 1) : 16;
        const float *kd[16], *vd[16];
        for (int r = 0; r < 16; r++) {
            if (r >= cnt) {
                kd[r] = vd[r] = zero_row;
                continue;
            }
            const int64_t key = kb + r, slot = table[key / BS] * BS + key % BS;
            kd[r] = q8_k ? q8_row_f32(K, slot, it->kv_head, compute, kbuf + r * 64)
                         : kv_row(kbuf + r * 64, K, slot, it->kv_head, 64, BS, compute);
            vd[r] = q8_v ? q8_row_f32(V, slot, it->kv_head, compute, vbuf + r * 64)
                         : kv_row(vbuf + r * 64, V, slot, it->kv_head, 64, BS, compute);
        }
        /* rows read in place (and the zero rows past cnt) are copied next to the decoded ones: kbuf and vbuf
         * then hold the block's 16 rows contiguously, which the loops below index with constants */
        for (int r = 0; r < 16; r++) {
            if (kd[r] != kbuf + r * 64) memcpy(kbuf + r * 64, kd[r], 64 * sizeof(float));
            if (vd[r] != vbuf + r * 64) memcpy(vbuf + r * 64, vd[r], 64 * sizeof(float));
        }
        /* the groups this block reaches: their scores all at once (`scores_f32_groups`) */
        int act[3], nact = 0;
        for (int64_t grp = 0; grp < ngroups; grp++) {
            if (kb > gmax[grp]) continue;                                  /* all keys after every lane */
            if (window > 0 && kb + cnt - 1 <= gmin[grp] - window) continue; /* all before every window */
            act[nact++] = (int)grp;
        }
        __m512 sb[48];
        const float *qgs[3] = {NULL, NULL, NULL};
        for (int a = 0; a < nact; a++) qgs[a] = qt + act[a] * 1024;
        switch (nact) { /* the group count as a constant: the accumulators stay in registers */
        case 3: scores_f32_groups(qgs, kbuf, sb, 3); break;
        case 2: scores_f32_groups(qgs, kbuf, sb, 2); break;
        case 1: scores_f32_groups(qgs, kbuf, sb, 1); break;
        default: break;
        }
        for (int a = 0; a < nact; a++) {
            const int64_t grp = act[a];
            /* each score as two 32-term chains added at the end (one 64-term chain lost ~1.5x in accuracy) */
            __m512 s[16];
            for (int r = 0; r < 16; r++) s[r] = sb[a * 16 + r];
            const __m512 corr = lanes_softmax(s, _mm512_load_si512(pos + grp * 16), kb, window, scale, softcap,
                                              &mrun[grp], &lrun[grp]);
            float *ag = acc_t + grp * 1024;
            /* all 16 rows, masked ones too (probability 0 times a zero row adds +0), so the loop has no
             * run-time bound; four dims at a time, four independent FMA chains instead of one */
            for (int d = 0; d < 64; d += 4) {
                __m512 a[4];
                for (int u = 0; u < 4; u++) a[u] = _mm512_mul_ps(_mm512_load_ps(ag + (d + u) * 16), corr);
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++)
                    for (int u = 0; u < 4; u++) a[u] = _mm512_fmadd_ps(s[r], _mm512_set1_ps(vbuf[r * 64 + d + u]), a[u]);
                for (int u = 0; u < 4; u++) _mm512_store_ps(ag + (d + u) * 16, a[u]);
            }
        }
    }
    lanes_store(it, out, row0, H, G, acc_t, lrun, compute, 0, 0);
}
#endif /* KVF_HAVE_AVX512 */

#define KVF_PREFILL_TILE_VECTORS 48 /* query vectors (tokens x heads of a group) per work item */

/* bf16 prefill on fp32 FMAs (`prefill_item_f32` with bf16 compute) instead of VDPBF16PS: set from Python
 * to the bf16 panel kernel's measured choice (KVFORGE_BF16_GEMM), off until then. */
static int bf16_fma = 0;
void kvf_set_bf16_fma(int on) { bf16_fma = on != 0; }

/* bf16 prefill on AMX tiles (`prefill_item_amx`): asked for by the bf16 panel kernel's choice (AMX GEMM
 * tiles), taken only where this build has the AMX path and Linux grants the tile state. Returns whether on. */
static int bf16_amx = 0;
int kvf_set_bf16_amx(int on) {
#if KVF_PREFILL_AMX
    bf16_amx = on != 0 && kvf_amx_permitted();
#else
    (void)on;
    bf16_amx = 0;
#endif
    return bf16_amx;
}

int kvf_paged_prefill_supported(int64_t H, int64_t HKV, int64_t D, int64_t DV, int dtype_code) {
#ifdef KVF_HAVE_AVX512
    return D == 64 && DV == 64 && HKV > 0 && H % HKV == 0 && H / HKV <= 8 && (dtype_code == 0 || dtype_code == 1);
#else
    (void)H, (void)HKV, (void)D, (void)DV, (void)dtype_code;
    return 0;
#endif
}

int kvf_paged_prefill(
    const void *q, const kvf_kv *K, const kvf_kv *V, const int64_t *tables, int64_t MAXNB,
    const int64_t *row0, const int64_t *qlen, const int64_t *start, int64_t C, void *out,
    int64_t H, int64_t HKV, int64_t BS, int64_t window, float scale, float softcap, int dtype_code) {
    if (!kvf_paged_prefill_supported(H, HKV, 64, 64, dtype_code)) return -2;
#ifdef KVF_HAVE_AVX512
    const int64_t G = H / HKV;
    const int64_t tile = KVF_PREFILL_TILE_VECTORS / G > 0 ? KVF_PREFILL_TILE_VECTORS / G : 1;
    int64_t n_items = 0;
    for (int64_t c = 0; c < C; c++) n_items += HKV * ((qlen[c] + tile - 1) / tile);
    prefill_item *items = malloc(sizeof(prefill_item) * (n_items > 0 ? n_items : 1));
    if (!items) return -1;
    int64_t n = 0;
    for (int64_t c = 0; c < C; c++)
        for (int64_t t0 = 0; t0 < qlen[c]; t0 += tile)
            for (int64_t j = 0; j < HKV; j++) {
                const int64_t t1 = t0 + tile < qlen[c] ? t0 + tile : qlen[c];
                const int64_t keys = start[c] + t1; /* what the tile's last token sees */
                items[n++] = (prefill_item){c, t0, t1, j, (t1 - t0) * (window > 0 && keys > window ? window : keys)};
            }
    /* Costliest first: dynamic scheduling then ends with the small tiles, and threads finish together. */
    qsort(items, (size_t)n_items, sizeof(prefill_item), by_cost_desc);
    int failed = 0;
    /* the lanes layout (`prefill_item_f32`, `prefill_item_bf16` on AVX512-BF16); KVFORGE_PREFILL_LANES=0
     * keeps the keys-in-lanes loop (for A/B runs) */
    const char *lanes_env = getenv("KVFORGE_PREFILL_LANES");
    const int lanes = !(lanes_env && lanes_env[0] == '0');
    (void)lanes;
#pragma omp parallel
    {
        KVF_FTZ_BEGIN(); /* as in the decode kernel */
        /* sized for both layouts: the lanes one needs 3 groups of 16 vectors (48 >= tile * G) */
        float *qf = aligned_alloc(64, sizeof(float) * 48 * 64);
        float *acc = aligned_alloc(64, sizeof(float) * 48 * 64);
        float *mrun = malloc(sizeof(float) * tile * G), *lrun = malloc(sizeof(float) * tile * G);
        __m512 *kt = aligned_alloc(64, sizeof(__m512) * 68); /* lanes layouts: 17 rows (16 + zeros) */
        float *vf = aligned_alloc(64, sizeof(float) * 16 * 64);
        const int ok = qf && acc && mrun && lrun && kt && vf;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; i++) {
            if (!ok) continue;
            const prefill_item *it = items + i;
            const int64_t c = it->chunk;
#if KVF_PREFILL_AMX
            if (lanes && dtype_code == 1 && bf16_amx) {
                prefill_item_amx(it, (const char *)q, K, V, tables + c * MAXNB, row0[c], start[c], (char *)out, H, BS,
                                 window, scale, softcap, G, (int32_t *)qf, acc, (uint16_t *)kt, (int32_t *)vf);
                continue;
            }
#endif
            if (lanes && (dtype_code == 0 || (dtype_code == 1 && bf16_fma))) {
                prefill_item_f32(it, (const char *)q, K, V, tables + c * MAXNB, row0[c], start[c], (char *)out, H, BS,
                                 window, scale, softcap, G, qf, acc, (float *)kt, vf, dtype_code == 0 ? KVF_F32 : KVF_BF16);
                continue;
            }
#if defined(__AVX512BF16__)
            if (lanes && dtype_code == 1) {
                prefill_item_bf16(it, (const char *)q, K, V, tables + c * MAXNB, row0[c], start[c], (char *)out, H, BS,
                                  window, scale, softcap, G, (int32_t *)qf, acc, (uint16_t *)kt, (int32_t *)vf);
                continue;
            }
#endif
#define KVF_PREFILL(GC)                                                                                        \
    prefill_item_run(it, (const char *)q, K, V, tables + c * MAXNB, row0[c], \
                     start[c], (char *)out, H, BS, window, scale, softcap, dtype_code, qf, acc, mrun, lrun, kt, vf, GC)
            KVF_DISPATCH_G(G, KVF_PREFILL)
#undef KVF_PREFILL
        }
        free(qf);
        free(acc);
        free(mrun);
        free(lrun);
        free(kt);
        free(vf);
        KVF_FTZ_END();
    }
    free(items);
    return failed ? -1 : 0;
#else
    return -2;
#endif
}
