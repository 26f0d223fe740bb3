/* Paged decode attention for CPUs: one query per sequence, K/V read in place from the block pool.
 *
 * Why a kernel: the torch path gathers every decode row's blocks into a contiguous workspace
 * before attending, so each KV byte is read, written and read again. On CPU a batched decode
 * step is bound by that memory traffic, not by arithmetic. Here each (sequence, KV head) work
 * item walks its block table, scores the G query heads of its group against each key once
 * (GQA by head index, K/V never repeated), and accumulates V weighted by the softmax.
 * Scores and the softmax run in fp32 whatever the storage dtype.
 *
 * Layouts (all contiguous):
 *   q        [B, H, D]              compute dtype
 *   k_cache  [NB, BS, HKV, D]       storage dtype == compute dtype
 *   v_cache  [NB, BS, HKV, DV]
 *   tables   [B, MAXNB] int64
 *   seq_lens [B] int64 (context length including the new token, >= 1)
 *   out      [B, H, DV]
 * dtype codes: 0 float32, 1 bfloat16, 2 float16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Let `omp simd` loops call glibc's vector exp/tanh (libmvec) without -ffast-math: a shared object
 * built with -ffast-math would flush denormals to zero for the whole process on load. */
float expf(float) __attribute__((simd("notinbranch")));
float tanhf(float) __attribute__((simd("notinbranch")));

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* Load n elements of dtype `code` starting at p into dst as fp32. */
static inline void load_row(float *restrict dst, const void *p, int n, int code) {
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

static inline float dot_f32(const float *restrict a, const float *restrict b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float dot_bf16(const float *restrict a, const uint16_t *restrict b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * bf16_to_f32(b[i]);
    return s;
}

static inline void axpy_f32(float *restrict y, float w, const float *restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += w * x[i];
}

static inline void axpy_bf16(float *restrict y, float w, const uint16_t *restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += w * bf16_to_f32(x[i]);
}

int kvf_paged_decode(
    const void *q, const void *k_cache, const void *v_cache, const int64_t *tables, const int64_t *seq_lens,
    void *out, int64_t B, int64_t H, int64_t HKV, int64_t D, int64_t DV, int64_t BS, int64_t MAXNB,
    int64_t window, float scale, float softcap, int dtype_code) {
    const int64_t G = H / HKV;
    const size_t esz = dtype_code == 0 ? 4 : 2;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int failed = 0;

#pragma omp parallel
    {
        /* Per-thread scratch: the group's queries, scores over the context, accumulators, a row. */
        float *qf = malloc(sizeof(float) * G * D);
        float *scores = malloc(sizeof(float) * G * (max_len > 0 ? max_len : 1));
        float *acc = malloc(sizeof(float) * G * DV);
        float *row = malloc(sizeof(float) * (D > DV ? D : DV));
        int64_t *slots = malloc(sizeof(int64_t) * (max_len > 0 ? max_len : 1));
        const int ok = qf && scores && acc && row && slots;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* Every thread reaches the worksharing loop, even one whose scratch failed. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * HKV; item++) {
            if (!ok) continue;
            {
                const int64_t b = item / HKV, kvh = item % HKV;
                const int64_t len = seq_lens[b];
                const int64_t start = (window > 0 && len > window) ? len - window : 0;
                const int64_t n = len - start;
                const int64_t *table = tables + b * MAXNB;
                for (int64_t g = 0; g < G; g++)
                    load_row(qf + g * D, (const char *)q + ((b * H + kvh * G + g) * D) * esz, (int)D, dtype_code);

                /* The context's slots, walked block by block once (no per-token division). */
                for (int64_t t = start, blk = start / BS; t < len; blk++)
                    for (int64_t off = t - blk * BS; off < BS && t < len; off++, t++) slots[t - start] = table[blk] * BS + off;

                /* Pass 1: scores, each key row read once for all G heads of the group. */
                for (int64_t i = 0; i < n; i++) {
                    const char *kp = (const char *)k_cache + ((slots[i] * HKV + kvh) * D) * esz;
                    float *st = scores + i;
                    if (dtype_code == 0) {
                        for (int64_t g = 0; g < G; g++) st[g * n] = dot_f32(qf + g * D, (const float *)kp, (int)D);
                    } else if (dtype_code == 1) {
                        for (int64_t g = 0; g < G; g++) st[g * n] = dot_bf16(qf + g * D, (const uint16_t *)kp, (int)D);
                    } else {
                        load_row(row, kp, (int)D, dtype_code);
                        for (int64_t g = 0; g < G; g++) st[g * n] = dot_f32(qf + g * D, row, (int)D);
                    }
                }
                /* Softmax per head in fp32 (vectorised exp); scale and soft-cap applied here. */
                for (int64_t g = 0; g < G; g++) {
                    float *sg = scores + g * n;
                    if (softcap > 0.f) {
                        const float inv_cap = scale / softcap;
#pragma omp simd
                        for (int64_t i = 0; i < n; i++) sg[i] = tanhf(sg[i] * inv_cap) * softcap;
                    } else {
#pragma omp simd
                        for (int64_t i = 0; i < n; i++) sg[i] *= scale;
                    }
                    float m = sg[0];
#pragma omp simd reduction(max : m)
                    for (int64_t i = 0; i < n; i++) m = sg[i] > m ? sg[i] : m;
                    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t i = 0; i < n; i++) {
                        sg[i] = expf(sg[i] - m);
                        sum += sg[i];
                    }
                    const float inv = 1.f / sum;
#pragma omp simd
                    for (int64_t i = 0; i < n; i++) sg[i] *= inv;
                }
                /* Pass 2: weighted sum of V, each value row read once for all G heads. */
                memset(acc, 0, sizeof(float) * G * DV);
                for (int64_t i = 0; i < n; i++) {
                    const char *vp = (const char *)v_cache + ((slots[i] * HKV + kvh) * DV) * esz;
                    const float *pt = scores + i;
                    if (dtype_code == 0) {
                        for (int64_t g = 0; g < G; g++) axpy_f32(acc + g * DV, pt[g * n], (const float *)vp, (int)DV);
                    } else if (dtype_code == 1) {
                        for (int64_t g = 0; g < G; g++) axpy_bf16(acc + g * DV, pt[g * n], (const uint16_t *)vp, (int)DV);
                    } else {
                        load_row(row, vp, (int)DV, dtype_code);
                        for (int64_t g = 0; g < G; g++) axpy_f32(acc + g * DV, pt[g * n], row, (int)DV);
                    }
                }
                for (int64_t g = 0; g < G; g++)
                    store_row((char *)out + ((b * H + kvh * G + g) * DV) * esz, acc + g * DV, (int)DV, dtype_code);
            }
        }
        free(qf);
        free(scores);
        free(acc);
        free(row);
        free(slots);
    }
    return failed ? -1 : 0;
}
