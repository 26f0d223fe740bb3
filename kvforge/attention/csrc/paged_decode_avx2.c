/* The decode kernel's AVX2 path: operands the AVX-512 paths do not read (int4, 16-bit rows of another
 * dtype, per-channel scales...) and every 16-bit row on CPUs without AVX-512. Each pass walks one work
 * item's rows 16 at a time (`rows_avx2` decodes them into an L1 scratch, then `scores_avx2` /
 * `values_avx2`, all in paged_common.h), with G fixed per clone of the static pass (KVF_OUTLINED) and
 * an exported entry point that picks the clone. The loops are the ones paged_decode.c used to inline. */
#include "paged_decode_avx2.h"

#if defined(KVF_HAVE_AVX2)
KVF_OUTLINED void scores_avx2_pass(const kvf_kv *K, const int64_t *slots, int64_t n, int64_t kv0,
                                   int64_t heads_per_item, int64_t BS, int dtype_code, const float *qf, float *vbuf,
                                   float *vf, float *scores, const int G) {
    prefetch_rows(K->data, slots, 0, n < KVF_AVX2_PREFETCH_ROWS ? n : KVF_AVX2_PREFETCH_ROWS, (size_t)K->row_bytes);
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
        rows_avx2(K, slots, i0, cnt, kv0, heads_per_item, BS, dtype_code, vbuf, vf, n);
        for (int64_t j = 0; j < heads_per_item; j++)
            scores_avx2(qf + j * G * 64, vbuf + j * 16 * 64, vf + j * 16, cnt, n, scores + (j * G) * n + i0, G);
    }
}

void kvf_scores_avx2(const kvf_kv *K, const int64_t *slots, int64_t n, int64_t kv0, int64_t heads_per_item,
                     int64_t BS, int dtype_code, const float *qf, float *vbuf, float *vf, float *scores, int G) {
    KVF_SWITCH_G(scores_avx2_pass, K, slots, n, kv0, heads_per_item, BS, dtype_code, qf, vbuf, vf, scores)
}

KVF_OUTLINED void values_avx2_pass(const kvf_kv *V, const int64_t *slots, int64_t n, int64_t kv0,
                                   int64_t heads_per_item, int64_t BS, int dtype_code, const float *scores,
                                   float *vbuf, float *vf, float *acc, const int G) {
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
        rows_avx2(V, slots, i0, cnt, kv0, heads_per_item, BS, dtype_code, vbuf, vf, n);
        for (int64_t j = 0; j < heads_per_item; j++)
            values_avx2(scores + (j * G) * n + i0, vbuf + j * 16 * 64, vf + j * 16, cnt, n, acc + (j * G) * 64, G);
    }
}

void kvf_values_avx2(const kvf_kv *V, const int64_t *slots, int64_t n, int64_t kv0, int64_t heads_per_item,
                     int64_t BS, int dtype_code, const float *scores, float *vbuf, float *vf, float *acc, int G) {
    KVF_SWITCH_G(values_avx2_pass, V, slots, n, kv0, heads_per_item, BS, dtype_code, scores, vbuf, vf, acc)
}
#endif
