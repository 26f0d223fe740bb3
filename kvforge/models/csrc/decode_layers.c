/* A decode step's stack of Llama-style decoder layers in one call (kvforge/models/decode_layers.py).
 *
 * Why: with the weights streamed by the panel kernels, a single-stream decode step spends about a third
 * of its time between kernels: per layer, some fifteen Python calls (modules, views, output tensors,
 * ctypes argument checks) that each cost microseconds. This file runs the same kernels in the same
 * order, on the same buffers, from one C loop: RMSNorm, the packed q|k|v panel matmul, rotary on q and
 * k, the K/V write into the paged cache, paged decode attention, o_proj, the residual add, RMSNorm, the
 * packed gate|up matmul, SiLU-and-multiply, down_proj, the residual add. The kernels are the ones the
 * Python path calls (fused ops, panel linears, the CPU decode kernel), reached through function
 * pointers taken from their own libraries, so every intermediate is rounded exactly as there and the
 * output is bitwise the same. The residual adds round to the compute dtype as torch's `x + y` does.
 *
 * Weight-only int8 / int4 models run the same loop with linear_quant.c's kernel for the four matmuls.
 *
 * Scope (checked by the caller): decode rows only (a few rows), fp32 or bf16, caches in the compute dtype
 * or 8-bit (int8, fp8) with per-token, per-head or per-tensor scales (written through kv_quantize.c, as
 * the stores write them), no biases, SiLU gate, no per-head q/k norm; one KV cache layout for all layers.
 * A quantized side stored Hadamard-rotated (kvforge/kv/rotation.py) is rotated here as there, by the same
 * C function (kv_rotate.c's `kvf_hadamard_rows`): K and q after rotary, V before its write, the attention
 * output after the decode kernel.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_bf16.h"

typedef void (*linear_fn)(const void *x, int64_t M, int64_t K, const void *wp, int64_t N, const void *bias, void *y,
                          int nthreads);
/* linear_quant.c's `kvf_qlinear_desc`: weight-only int8 / int4 codes described by a `kvf_qdesc` (its header). */
typedef int (*qlinear_fn)(const void *x, int x_bf16, int64_t M, int64_t K, const void *desc, int64_t N, void *y,
                          int nthreads);
typedef void (*rms_norm_fn)(const void *x, int64_t x_stride, const void *w, void *out, int64_t T, int64_t D,
                            float eps, float offset, int code);
typedef void (*rotary_fn)(const void *x, int64_t x_stride, const void *cos_, const void *sin_, void *out, int64_t T,
                          int64_t H, int64_t D, int code);
typedef void (*silu_mul_fn)(const void *gu, void *out, int64_t T, int64_t I, int code);
typedef int (*quantize_fn)(const void *x, int64_t N, int64_t H, int64_t D, int code, int fmt, int gran,
                           float static_scale, int64_t block_size, const int64_t *slots, uint8_t *codes,
                           float *scales);
typedef int (*hadamard_fn)(const void *src, void *dst, int64_t nvec, int64_t D, int n, int code);
typedef int (*decode_fn)(const void *q, const void *K, const void *V, const int64_t *tables, const int64_t *seq_lens,
                         void *out, int64_t B, int64_t H, int64_t HKV, int64_t D, int64_t DV, int64_t BS,
                         int64_t MAXNB, int64_t window, float scale, float softcap, int dtype_code);

typedef struct {
    linear_fn linear; /* the panel kernel of the compute dtype */
    qlinear_fn qlinear; /* non-NULL: every layer's weights are `kvf_qdesc`s of quantized codes instead */
    rms_norm_fn rms_norm;
    rotary_fn rotary;
    silu_mul_fn silu_mul;
    decode_fn decode;
    quantize_fn quantize; /* kv_quantize.c: 8-bit caches' writes */
    hadamard_fn hadamard; /* kv_rotate.c: a rotated cache's q, K, V and output (NULL: no rotated layer) */
} kvf_layer_fns;

/* How one of K/V is written: fmt 0 copies rows of the compute dtype; 3/4/5 (fp8 e4m3, e5m2, int8) quantize
 * them with `gran` scales (1 tensor with `static_scale`, 2 token, 3 head, 4 channel: int8 K with a running
 * maximum per block) as the store's write does. `hadamard` > 1: the side is stored rotated in blocks of
 * that many channels (K: q is rotated alike; V: the attention output is rotated back). */
typedef struct {
    void *data;
    float *scales;
    int32_t fmt, gran;
    float static_scale;
    int32_t hadamard;
} kvf_write;

typedef struct {
    const void *ln1, *ln2;                /* RMSNorm weights [hidden] */
    const void *wqkv, *wo, *wgu, *wdown;  /* panel-packed weights, or `kvf_qdesc`s with fn->qlinear */
    const void *k_view, *v_view;          /* the decode kernel's `kvf_kv` operands */
    kvf_write k_write, v_write;           /* the same pools, [NB, BS, HKV, D], as the writes see them */
    int64_t window;                       /* sliding window (0: none) */
} kvf_layer;

/* x += y elementwise, rounded to the compute dtype like torch's `x + y`. */
static void residual_add(void *x, const void *y, int64_t n, int code) {
    if (code == 0) {
        float *a = (float *)x;
        const float *b = (const float *)y;
        for (int64_t i = 0; i < n; i++) a[i] = a[i] + b[i];
    } else {
        uint16_t *a = (uint16_t *)x;
        const uint16_t *b = (const uint16_t *)y;
        for (int64_t i = 0; i < n; i++) a[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
    }
}

/* y = x @ W^T through the panel kernel, or the quantized one when the model's weights are codes. */
static int linear(const kvf_layer_fns *fn, const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y,
                  int code, int nthreads) {
    if (fn->qlinear) return fn->qlinear(x, code, M, K, w, N, y, nthreads);
    fn->linear(x, M, K, w, N, NULL, y, nthreads);
    return 0;
}

/* Rows x [M, H, D] (compute dtype) into the pool at their slots, copied or quantized; nonzero: the quantizer
 * could not allocate its scratch. */
static int write_rows(const kvf_layer_fns *fn, const kvf_write *w, const char *x, int64_t M, int64_t H, int64_t D,
                      const int64_t *slots, int64_t BS, int code) {
    const size_t row = (size_t)(H * D) * (code == 0 ? 4 : 2);
    if (w->fmt == 0) {
        for (int64_t r = 0; r < M; r++) memcpy((char *)w->data + slots[r] * row, x + r * row, row);
        return 0;
    }
    return fn->quantize(x, M, H, D, code, w->fmt, w->gran, w->static_scale, BS, slots, (uint8_t *)w->data,
                        w->scales);
}

/* x [M, hidden] (updated in place) through L layers. cos/sin [M, D]; slots [M]: where each row's K/V go;
 * tables [M, MAXNB] / seq_lens [M]: the decode kernel's checked indices. Returns 0, -1 when scratch could
 * not be allocated (here or in the quantized kernel), or the decode kernel's error code. */
int kvf_decode_layers(const kvf_layer_fns *fn, const kvf_layer *layers, int64_t L, void *x, int64_t M,
                      int64_t hidden, int64_t H, int64_t HKV, int64_t D, int64_t inter, const void *cos_,
                      const void *sin_, const int64_t *slots, const int64_t *tables, const int64_t *seq_lens,
                      int64_t BS, int64_t MAXNB, float scale, float eps, int code, int nthreads) {
    const size_t esz = code == 0 ? 4 : 2;
    const int64_t qsz = H * D, kvsz = HKV * D, nqkv = qsz + 2 * kvsz;
    char *h = malloc(esz * M * hidden), *qkv = malloc(esz * M * nqkv), *q = malloc(esz * M * qsz);
    char *k = malloc(esz * M * kvsz), *v = malloc(esz * M * kvsz), *att = malloc(esz * M * qsz), *o = malloc(esz * M * hidden);
    char *gu = malloc(esz * M * 2 * inter), *act = malloc(esz * M * inter);
    int rc = (h && qkv && q && k && v && att && o && gu && act) ? 0 : -1;
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const kvf_layer *ly = layers + l;
        fn->rms_norm(x, hidden, ly->ln1, h, M, hidden, eps, 0.f, code);
        if ((rc = linear(fn, h, M, hidden, ly->wqkv, nqkv, qkv, code, nthreads))) break;
        fn->rotary(qkv, nqkv, cos_, sin_, q, M, H, D, code);
        fn->rotary(qkv + qsz * esz, nqkv, cos_, sin_, k, M, HKV, D, code);
        /* the cache write: rotated K, and V as the matmul left it (gathered into rows for a quantizer) */
        for (int64_t r = 0; r < M; r++) memcpy(v + r * kvsz * esz, qkv + (r * nqkv + qsz + kvsz) * esz, kvsz * esz);
        if (ly->k_write.hadamard > 1 && /* K stored Hadamard-rotated: q.k is unchanged when q turns alike */
            (fn->hadamard(q, q, M * H, D, ly->k_write.hadamard, code) ||
             fn->hadamard(k, k, M * HKV, D, ly->k_write.hadamard, code))) {
            rc = -3;
            break;
        }
        if (ly->v_write.hadamard > 1 && fn->hadamard(v, v, M * HKV, D, ly->v_write.hadamard, code)) {
            rc = -3;
            break;
        }
        if (write_rows(fn, &ly->k_write, k, M, HKV, D, slots, BS, code) ||
            write_rows(fn, &ly->v_write, v, M, HKV, D, slots, BS, code)) {
            rc = -1;
            break;
        }
        rc = fn->decode(q, ly->k_view, ly->v_view, tables, seq_lens, att, M, H, HKV, D, D, BS, MAXNB, ly->window,
                        scale, 0.f, code);
        if (rc) break;
        if (ly->v_write.hadamard > 1 && fn->hadamard(att, att, M * H, D, ly->v_write.hadamard, code)) { /* R o -> o */
            rc = -3;
            break;
        }
        if ((rc = linear(fn, att, M, qsz, ly->wo, hidden, o, code, nthreads))) break;
        residual_add(x, o, M * hidden, code);
        fn->rms_norm(x, hidden, ly->ln2, h, M, hidden, eps, 0.f, code);
        if ((rc = linear(fn, h, M, hidden, ly->wgu, 2 * inter, gu, code, nthreads))) break;
        fn->silu_mul(gu, act, M, inter, code);
        if ((rc = linear(fn, act, M, inter, ly->wdown, hidden, o, code, nthreads))) break;
        residual_add(x, o, M * hidden, code);
    }
    free(h), free(qkv), free(q), free(k), free(v), free(att), free(o), free(gu), free(act);
    return rc;
}
