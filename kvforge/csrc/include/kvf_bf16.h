/* bf16 <-> fp32 conversions, shared by every kvforge kernel.
 *
 * Why one definition: the kernels must round exactly as torch does (round to nearest even, a NaN stays a
 * NaN), so the attention, linear, fused-op and decode-layer kernels give the bits the reference gives.
 * Unions, not memcpy: GCC's vectoriser gives up on `omp simd` loops that contain memcpy, and these are
 * called inside such loops. Include it as `#include "kvf_bf16.h"` (kvforge/native passes -I for this
 * directory, and its cache key covers every header a source includes).
 */
#ifndef KVF_BF16_H
#define KVF_BF16_H

#include <stdint.h>

typedef union {
    uint32_t u;
    float f;
} kvf_bits32;

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t x) {
    kvf_bits32 b;
    b.u = (uint32_t)x << 16;
    return b.f;
}

static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    kvf_bits32 b;
    b.f = f;
    const uint32_t rounded = (b.u + 0x7FFFu + ((b.u >> 16) & 1u)) >> 16; /* nearest even, as torch rounds */
    const uint32_t nan = (b.u >> 16) | 0x40u;                            /* a NaN stays a (quiet) NaN */
    return (uint16_t)((b.u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

/* fp32 rounded to bf16 and back: the value a bf16 tensor holds for `f`. */
static inline __attribute__((always_inline)) float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 fp32 lanes to 16 bf16, rounded as f32_to_bf16 rounds (a kernel's bf16 output rows). */
static inline __attribute__((always_inline)) __m256i f32x16_to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}
#endif

#endif
