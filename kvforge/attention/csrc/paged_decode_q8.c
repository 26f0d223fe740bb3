/* The decode kernels for 8-bit K/V rows (int8, fp8 e4m3/e5m2: scores and values) and for bf16 V rows,
 * one per storage code and query mode; paged_decode.c calls them per 16-token chunk.
 *
 * Each is a static outlined kernel with its code and mode fixed (cloned once per G by gcc's
 * interprocedural constant propagation: paged_common.h, KVF_OUTLINED, says why) behind an exported
 * entry point that picks the clone for G. The entry point is the only call that crosses units: one
 * switch per chunk, and the kernels are the same code they were when they lived in paged_decode.c. */
#include "paged_decode_q8.h"

#if defined(KVF_HAVE_AVX512)
#define KVF_SCORES_Q8_AS(NAME, CODE, KIND)                                                                   \
    KVF_OUTLINED void NAME##_g(const float *qs, const char *qp, const int16_t *qi, const float *qscale,      \
                               const kvf_kv *K, const int64_t *slots, int64_t i0, int cnt, int64_t n,        \
                               int64_t h, float *st, const int G) {                                          \
        scores_q8(qs, qp, qi, qscale, K, slots, i0, cnt, n, h, st, G, CODE, KIND);                           \
    }                                                                                                        \
    KVF_SCORES_Q8_DECL(NAME) { KVF_SWITCH_G(NAME##_g, qs, qp, qi, qscale, K, slots, i0, cnt, n, h, st) }
#define KVF_VALUES_Q8_AS(NAME, CODE)                                                                         \
    KVF_OUTLINED void NAME##_g(const float *e, const float *inv, const kvf_kv *V, const int64_t *slots,      \
                               int64_t i0, int cnt, int64_t n, int64_t h, const float *fac, float *acc_mem,  \
                               const int G) {                                                                \
        values_q8(e, inv, V, slots, i0, cnt, n, h, fac, acc_mem, G, CODE);                                   \
    }                                                                                                        \
    KVF_VALUES_Q8_DECL(NAME) { KVF_SWITCH_G(NAME##_g, e, inv, V, slots, i0, cnt, n, h, fac, acc_mem) }
KVF_SCORES_Q8_AS(scores_q8_int8_f32, KVF_INT8, SQ_F32)
KVF_SCORES_Q8_AS(scores_q8_e4m3_f32, KVF_E4M3, SQ_F32)
KVF_SCORES_Q8_AS(scores_q8_e5m2_f32, KVF_E5M2, SQ_F32)
KVF_VALUES_Q8_AS(values_q8_int8, KVF_INT8)
KVF_VALUES_Q8_AS(values_q8_e4m3, KVF_E4M3)
KVF_VALUES_Q8_AS(values_q8_e5m2, KVF_E5M2)
#if defined(__AVX512BF16__)
KVF_SCORES_Q8_AS(scores_q8_int8_bf16, KVF_INT8, SQ_BF16)
KVF_SCORES_Q8_AS(scores_q8_e4m3_bf16, KVF_E4M3, SQ_BF16)
KVF_SCORES_Q8_AS(scores_q8_e5m2_bf16, KVF_E5M2, SQ_BF16)
#define KVF_VALUES_BF16_AS(NAME, CODE, LUT)                                                                  \
    KVF_OUTLINED void NAME##_g(const uint16_t *pb, const char *v_cache, const int64_t *slots, int64_t i0,    \
                               int cnt, int64_t n, int64_t npad, size_t v_row, size_t head_off,              \
                               float *acc_mem, const float *fac, const int G) {                              \
        values_d64_bf16(pb, v_cache, slots, i0, cnt, n, npad, v_row, head_off, acc_mem, G, fac, CODE, LUT); \
    }                                                                                                        \
    KVF_VALUES_BF16_DECL(NAME) {                                                                             \
        KVF_SWITCH_G(NAME##_g, pb, v_cache, slots, i0, cnt, n, npad, v_row, head_off, acc_mem, fac)          \
    }
KVF_VALUES_BF16_AS(values_bf16_rows, 0, 0)
KVF_VALUES_BF16_AS(values_bf16_int8, KVF_INT8, 0)
KVF_VALUES_BF16_AS(values_bf16_e4m3, KVF_E4M3, 0)
KVF_VALUES_BF16_AS(values_bf16_e5m2, KVF_E5M2, 0)
KVF_VALUES_BF16_AS(values_bf16_e4m3_lut, KVF_E4M3, 1)
KVF_VALUES_BF16_AS(values_bf16_e5m2_lut, KVF_E5M2, 1)
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
KVF_SCORES_Q8_AS(scores_q8_int8_i16, KVF_INT8, SQ_I16)
void kvf_values_i8_vnni(const int16_t *pi, const kvf_kv *V, const int64_t *slots, int64_t i0, int cnt, int64_t n,
                        int64_t npad, int64_t h, int32_t *acc_mem, int G) {
    KVF_SWITCH_G(values_i8_vnni, pi, V, slots, i0, cnt, n, npad, h, acc_mem)
}
#endif
#if defined(KVF_HAVE_FP8_LUT)
KVF_SCORES_Q8_AS(scores_q8_e4m3_lut, KVF_E4M3, SQ_LUT)
KVF_SCORES_Q8_AS(scores_q8_e5m2_lut, KVF_E5M2, SQ_LUT)
#endif
#endif
