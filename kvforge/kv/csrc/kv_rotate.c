/* The Hadamard rotation of a rotated KV cache (kvforge/kv/rotation.py), in place, in C.
 *
 * Why: the torch expression (six butterfly stages of views and stacks) costs about 13 ms for one 2048-token
 * chunk's queries of one layer, four calls a layer: about a second of a 2K prefill on the default model.
 * This loop does the same additions in the same order, in fp32, then one multiply by 1/sqrt(n) and one
 * rounding to the compute dtype, so its bits are the torch path's (tests/test_kv_rotation.py). The fused
 * decode-layers call (models/csrc/decode_layers.c) takes this function by pointer, so decode rows rotate
 * through the same code.
 *
 * src -> dst (the same pointer: in place): nvec vectors of D channels, contiguous, fp32 (code 0) or bf16
 * (code 1); each run of n channels (n a power of two dividing D, at most KVF_HADAMARD_MAX) is multiplied by
 * the normalized Sylvester-Hadamard matrix of size n. Returns 0, or -1 for an unsupported dtype or block
 * size (nothing written), or when scratch could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kvf_bf16.h"
#include "kvf_omp.h"

#define KVF_HADAMARD_MAX 1024
#define ROTATE_PARALLEL_MIN 65536 /* elements: a decode step's few rows stay on the calling thread */

/* LANES vectors at once, channel-major (y[c * LANES + lane]): every butterfly stage is whole-vector adds
 * whatever its stride, where one vector at a time leaves strides 1-8 to scalar code. The additions per
 * element and their order are the same, so the bits are too. */
#define LANES 16

static void block_group(const void *src, void *dst, int64_t b0, int64_t nb, int64_t D, int n, int code, float s,
                        float *y) {
    const int64_t per_vec = D / n;
    for (int64_t l = 0; l < nb; l++) { /* block b0 + l of the [nvec * D / n] blocks of n channels */
        const int64_t b = b0 + l, off = (b / per_vec) * D + (b % per_vec) * n;
        if (code == 0)
            for (int c = 0; c < n; c++) y[c * LANES + l] = ((const float *)src)[off + c];
        else
            for (int c = 0; c < n; c++) y[c * LANES + l] = bf16_to_f32(((const uint16_t *)src)[off + c]);
    }
    for (int h = 1; h < n; h *= 2)
        for (int j = 0; j < n; j += 2 * h)
            for (int i = j; i < j + h; i++) {
                float *a = y + i * LANES, *bb = y + (i + h) * LANES;
#pragma omp simd
                for (int l = 0; l < LANES; l++) {
                    const float u = a[l], w = bb[l];
                    a[l] = u + w;
                    bb[l] = u - w;
                }
            }
    for (int64_t l = 0; l < nb; l++) {
        const int64_t b = b0 + l, off = (b / per_vec) * D + (b % per_vec) * n;
        if (code == 0)
            for (int c = 0; c < n; c++) ((float *)dst)[off + c] = y[c * LANES + l] * s;
        else
            for (int c = 0; c < n; c++) ((uint16_t *)dst)[off + c] = f32_to_bf16(y[c * LANES + l] * s);
    }
}

int kvf_hadamard_rows(const void *src, void *dst, int64_t nvec, int64_t D, int n, int code) {
    if ((code != 0 && code != 1) || n < 2 || n > KVF_HADAMARD_MAX || (n & (n - 1)) || D % n) return -1;
    const float s = (float)(1.0 / sqrt((double)n));
    const int64_t blocks = nvec * (D / n), groups = (blocks + LANES - 1) / LANES;
    int failed = 0;
#pragma omp parallel if (blocks * n >= ROTATE_PARALLEL_MIN) reduction(|| : failed)
    {
        float *y = malloc(sizeof(float) * (size_t)n * LANES);
        failed = y == NULL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t b0 = g * LANES, nb = blocks - b0 < LANES ? blocks - b0 : LANES;
            if (y) block_group(src, dst, b0, nb, D, n, code, s, y);
        }
        free(y);
    }
    return failed ? -1 : 0; /* -1: a thread had no scratch, dst is partly written (the caller falls back) */
}
