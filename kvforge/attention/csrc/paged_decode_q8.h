/* The decode kernels of paged_decode_q8.c, as paged_decode.c calls them: one function per storage code
 * and query mode, taking the head-group size G (1..8) at run time and dispatching inside to a copy
 * specialised for it. Why a unit of their own: they are half of the decode kernel's compile time, and
 * two units compile side by side (kvforge/native builds a library's units at once, then links them). */
#ifndef KVF_PAGED_DECODE_Q8_H
#define KVF_PAGED_DECODE_Q8_H

#include "paged_common.h"

#if defined(KVF_HAVE_AVX512)
#define KVF_SCORES_Q8_DECL(NAME)                                                                             \
    void NAME(const float *qs, const char *qp, const int16_t *qi, const float *qscale, const kvf_kv *K,      \
              const int64_t *slots, int64_t i0, int cnt, int64_t n, int64_t h, float *st, int G)
#define KVF_VALUES_Q8_DECL(NAME)                                                                             \
    void NAME(const float *e, const float *inv, const kvf_kv *V, const int64_t *slots, int64_t i0, int cnt,  \
              int64_t n, int64_t h, const float *fac, float *acc_mem, int G)
KVF_SCORES_Q8_DECL(scores_q8_int8_f32);
KVF_SCORES_Q8_DECL(scores_q8_e4m3_f32);
KVF_SCORES_Q8_DECL(scores_q8_e5m2_f32);
KVF_VALUES_Q8_DECL(values_q8_int8);
KVF_VALUES_Q8_DECL(values_q8_e4m3);
KVF_VALUES_Q8_DECL(values_q8_e5m2);
#if defined(__AVX512BF16__)
KVF_SCORES_Q8_DECL(scores_q8_int8_bf16);
KVF_SCORES_Q8_DECL(scores_q8_e4m3_bf16);
KVF_SCORES_Q8_DECL(scores_q8_e5m2_bf16);
#define KVF_VALUES_BF16_DECL(NAME)                                                                           \
    void NAME(const uint16_t *pb, const char *v_cache, const int64_t *slots, int64_t i0, int cnt, int64_t n,  \
              int64_t npad, size_t v_row, size_t head_off, float *acc_mem, int G, const float *fac)
KVF_VALUES_BF16_DECL(values_bf16_rows);
KVF_VALUES_BF16_DECL(values_bf16_int8);
KVF_VALUES_BF16_DECL(values_bf16_e4m3);
KVF_VALUES_BF16_DECL(values_bf16_e5m2);
KVF_VALUES_BF16_DECL(values_bf16_e4m3_lut);
KVF_VALUES_BF16_DECL(values_bf16_e5m2_lut);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
KVF_SCORES_Q8_DECL(scores_q8_int8_i16);
void kvf_values_i8_vnni(const int16_t *pi, const kvf_kv *V, const int64_t *slots, int64_t i0, int cnt, int64_t n,
                        int64_t npad, int64_t h, int32_t *acc_mem, int G);
#endif
#if defined(KVF_HAVE_FP8_LUT)
KVF_SCORES_Q8_DECL(scores_q8_e4m3_lut);
KVF_SCORES_Q8_DECL(scores_q8_e5m2_lut);
#endif
#endif

#endif
