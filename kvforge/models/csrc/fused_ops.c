/* Fused elementwise ops for CPU inference: RMSNorm, rotary embedding, SiLU-and-multiply.
 *
 * Why: at decode batch sizes each of these is a handful of tiny torch ops (RMSNorm alone is eight:
 * cast, pow, mean, add, rsqrt, mul, cast, mul), each a dispatch, an allocation and a pass over
 * memory; per decode step of a 30-layer model that is hundreds of calls costing more than the math.
 * Each function here is one pass with one call.
 *
 * Rounding follows the torch expressions they replace, op by op: a 16-bit result of each torch op
 * is rounded (nearest even) before the next one uses it, so bf16/fp16 outputs equal torch's bit for
 * bit up to the order of one fp32 sum (the RMS). Built with -ffp-contract=off so that no a*b+c is
 * fused into one rounding where torch rounds twice.
 *
 * dtype codes: 0 float32, 1 bfloat16, 2 float16. Rows may be strided (views into packed qkv or
 * gate_up outputs); the last dimension is contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvf_bf16.h"
#include "kvf_omp.h"

static inline __attribute__((always_inline)) float load(const void *p, int64_t i, int code) {
    if (code == 0) return ((const float *)p)[i];
    if (code == 1) return bf16_to_f32(((const uint16_t *)p)[i]);
    return (float)((const _Float16 *)p)[i];
}

/* Round to the storage dtype and back: what a torch op in that dtype hands to the next op. */
static inline __attribute__((always_inline)) float round_to(float x, int code) {
    if (code == 0) return x;
    if (code == 1) return bf16_to_f32(f32_to_bf16(x));
    return (float)(_Float16)x;
}

static inline __attribute__((always_inline)) void store(void *p, int64_t i, float x, int code) {
    if (code == 0)
        ((float *)p)[i] = x;
    else if (code == 1)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else
        ((_Float16 *)p)[i] = (_Float16)x;
}

/* Below these sizes, waking the second thread costs more than it saves (exp makes SiLU dearer). */
#define PARALLEL_ELEMENTS 65536
#define PARALLEL_ELEMENTS_SILU 16384

/* out[t] = RMSNorm(x[t]) with weight w, as kvforge.models.layers.RMSNorm computes it:
 *   offset == 0: w * to_dtype(x * rsqrt(mean(x^2) + eps))        (Llama: cast, then weight in dtype)
 *   offset != 0: to_dtype(x * rsqrt(mean(x^2) + eps) * (offset + w))  (Gemma: all in fp32) */
static inline __attribute__((always_inline)) void rms_norm_row(const char *xr, const void *w, char *orow, int64_t D,
                                                                float eps, float offset, const int code) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < D; i++) {
        const float v = load(xr, i, code);
        ss += v * v;
    }
    const float r = 1.f / sqrtf(ss / (float)D + eps);
    if (offset != 0.f) {
#pragma omp simd
        for (int64_t i = 0; i < D; i++) store(orow, i, (load(xr, i, code) * r) * (offset + load(w, i, code)), code);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < D; i++) store(orow, i, load(w, i, code) * round_to(load(xr, i, code) * r, code), code);
    }
}

void kvf_rms_norm(const void *x, int64_t x_stride, const void *w, void *out, int64_t T, int64_t D, float eps,
                  float offset, int code) {
    const size_t esz = code == 0 ? 4 : 2;
#pragma omp parallel for if (T * D >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const char *xr = (const char *)x + t * x_stride * esz;
        char *orow = (char *)out + t * D * esz;
        /* One instantiation per dtype: a dtype branch inside the loops would stop vectorisation. */
        if (code == 0)
            rms_norm_row(xr, w, orow, D, eps, offset, 0);
        else if (code == 1)
            rms_norm_row(xr, w, orow, D, eps, offset, 1);
        else
            rms_norm_row(xr, w, orow, D, eps, offset, 2);
    }
}

/* Rotary embedding, HF's rotate_half convention: out = x * cos + cat(-x2, x1) * sin, per head.
 * x [T, H, D] with token stride x_stride (elements) and head stride D; cos, sin [T, D]; out [T, H, D]. */
static inline __attribute__((always_inline)) void rotary_row(const char *xr, const char *c, const char *s, char *orow,
                                                              int64_t half, const int code) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = load(xr, i, code), b = load(xr, i + half, code);
        const float lo = round_to(a * load(c, i, code), code) + round_to(-b * load(s, i, code), code);
        const float hi = round_to(b * load(c, i + half, code), code) + round_to(a * load(s, i + half, code), code);
        store(orow, i, lo, code);
        store(orow, i + half, hi, code);
    }
}

void kvf_rotary(const void *x, int64_t x_stride, const void *cos_, const void *sin_, void *out, int64_t T, int64_t H,
                int64_t D, int code) {
    const int64_t half = D / 2;
    const size_t esz = code == 0 ? 4 : 2;
#pragma omp parallel for if (T * H * D >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const char *c = (const char *)cos_ + t * D * esz, *s = (const char *)sin_ + t * D * esz;
        for (int64_t h = 0; h < H; h++) {
            const char *xr = (const char *)x + (t * x_stride + h * D) * esz;
            char *orow = (char *)out + ((t * H + h) * D) * esz;
            if (code == 0)
                rotary_row(xr, c, s, orow, half, 0);
            else if (code == 1)
                rotary_row(xr, c, s, orow, half, 1);
            else
                rotary_row(xr, c, s, orow, half, 2);
        }
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i]: the gated MLP's activation on its packed gate|up output. */
static inline __attribute__((always_inline)) void silu_mul_row(const char *g, const char *u, char *orow, int64_t I,
                                                                const int code) {
#pragma omp simd
    for (int64_t i = 0; i < I; i++) {
        const float x = load(g, i, code);
        store(orow, i, round_to(x / (1.f + expf(-x)), code) * load(u, i, code), code);
    }
}

void kvf_silu_mul(const void *gu, void *out, int64_t T, int64_t I, int code) {
    const size_t esz = code == 0 ? 4 : 2;
#pragma omp parallel for if (T * I >= PARALLEL_ELEMENTS_SILU) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const char *g = (const char *)gu + t * 2 * I * esz;
        char *orow = (char *)out + t * I * esz;
        if (code == 0)
            silu_mul_row(g, g + I * esz, orow, I, 0);
        else if (code == 1)
            silu_mul_row(g, g + I * esz, orow, I, 1);
        else
            silu_mul_row(g, g + I * esz, orow, I, 2);
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Index of the first maximum of row[0 .. N), or -1 when the row holds a NaN. One pass: each lane
 * keeps its running maximum and where it first saw it (strict > keeps the first). */
static int64_t argmax_row(const float *row, int64_t N) {
    int64_t i = 0, best = 0;
    float m = -INFINITY;
#if defined(__AVX512F__)
    if (N >= 16) {
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        __m512i vidx = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 nan = 0;
        for (; i + 16 <= N; i += 16, idx = _mm512_add_epi32(idx, step)) {
            const __m512 v = _mm512_loadu_ps(row + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
            vmax = _mm512_mask_mov_ps(vmax, gt, v);
            vidx = _mm512_mask_mov_epi32(vidx, gt, idx);
        }
        if (nan) return -1;
        m = _mm512_reduce_max_ps(vmax);
        /* the smallest index among the lanes holding the maximum (N < 2^31 for any vocabulary) */
        const __mmask16 at = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(m), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(at, vidx);
        if (m == -INFINITY) best = 0; /* all -inf so far: index 0, as torch */
    }
#endif
    for (; i < N; i++) {
        if (row[i] != row[i]) return -1;
        if (row[i] > m) {
            m = row[i];
            best = i;
        }
    }
    return best;
}

/* out[r] = index of the first maximum of row r of x [R, N] (fp32), or of its first NaN if it has
 * one: torch.argmax's answer. torch's own last-dim argmax takes ~1 ms on a 32 x 49152 batch of
 * logits here; this is one vectorised pass. */
void kvf_argmax_rows(const float *x, int64_t R, int64_t N, int64_t *out) {
#pragma omp parallel for if (R * N >= 4 * PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * N;
        int64_t idx = argmax_row(row, N);
        if (idx < 0) /* a NaN: torch answers the first one */
            for (idx = 0; idx < N && row[idx] == row[idx]; idx++) {
            }
        out[r] = idx;
    }
}
