/* The decode kernel's AVX2 path (paged_decode_avx2.c) as paged_decode.c calls it: one work item's score
 * pass and value pass, G (1..8) given at run time. A unit of its own because the two passes, specialised
 * per G, were close to half of paged_decode.c's compile time; units compile side by side. */
#ifndef KVF_PAGED_DECODE_AVX2_H
#define KVF_PAGED_DECODE_AVX2_H

#include "paged_common.h"

#if defined(KVF_HAVE_AVX2)
/* scores[(j * G + g) * n + i] = q_(j, g) . K row i for the item's heads_per_item KV heads from kv0, rows
 * [0, n) decoded 16 at a time into vbuf/vf (KVF_AVX2_PREFETCH_ROWS ahead). */
void kvf_scores_avx2(const kvf_kv *K, const int64_t *slots, int64_t n, int64_t kv0, int64_t heads_per_item,
                     int64_t BS, int dtype_code, const float *qf, float *vbuf, float *vf, float *scores, int G);
/* acc[(j * G + g) * 64 + d] += sum over rows i of scores[(j * G + g) * n + i] * V row i (acc zeroed by the caller). */
void kvf_values_avx2(const kvf_kv *V, const int64_t *slots, int64_t n, int64_t kv0, int64_t heads_per_item,
                     int64_t BS, int dtype_code, const float *scores, float *vbuf, float *vf, float *acc, int G);
#endif

#endif
