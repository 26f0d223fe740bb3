/* Quantize-on-write for the KV cache (kvforge/kv/quant_kernel.py): rows of new K or V in the compute
 * dtype -> 8-bit codes (int8, fp8 e4m3, fp8 e5m2) and their scales, written at their slots in the pool.
 *
 * Why: the torch expression (`quant.absmax_scales` + `quant.quantize` + two index_copy_) is some ten
 * small ops per K or V per layer, about 0.1 ms each call on a decode step's few rows: 1-2 s of a
 * 20 s batch benchmark. This is the same arithmetic in one pass, element by element as torch does it:
 * absmax in fp32, scale = max(absmax, 1e-12) / qmax (fp32 division), y = clamp(x / scale, -qmax, qmax)
 * (fp32 division), then int8 by round-half-to-even, or fp8 by round-to-nearest-even with torch's
 * float8_e4m3fn / float8_e5m2 bit layouts. So the codes and scales are bitwise torch's (the tests
 * compare them). The loops are specialised per (input dtype, format), so the int8 ones vectorize, and a
 * prefill chunk's rows are split over the threads (benchmarks/kv_quantize_ab.py: 6.9x int8, 2.5x fp8 on
 * 1,024 bf16 rows; 2.0x / 1.2x on a 32-row decode step).
 *
 *   x      [N, H, D] compute dtype (0 fp32, 1 bf16, 2 fp16), contiguous
 *   codes  the pool's codes, [slots, H, D] uint8; row n goes to slots[n]
 *   scales token: [slots] float32; head: [slots, H] float32; tensor: NULL (static_scale used);
 *          channel: [blocks, H, D] float32, one per (head, channel) per block of `block_size` slots
 * fmt: 3 fp8 e4m3, 4 fp8 e5m2, 5 int8 (the decode kernel's format codes); gran: 1 tensor, 2 token, 3 head,
 * 4 channel (int8 only: `channel_rows` below, the store's `_write_channel` in C).
 * NaN inputs are the one difference from torch: its amax propagates them, the absmax here skips them.
 */
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "kvf_bf16.h"
#include "kvf_omp.h"

static inline __attribute__((always_inline)) float load(const void *p, int64_t i, int code) {
    if (code == 0) return ((const float *)p)[i];
    if (code == 1) return bf16_to_f32(((const uint16_t *)p)[i]);
    return (float)((const _Float16 *)p)[i];
}

/* |f| <= the format's max (the caller clamps), round to nearest even, as c10's fp8 conversions. */
static inline uint8_t to_fp8(float f, int mbits, int bias) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7f); /* NaN (e4m3fn 0x7f; e5m2 0x7f is a NaN too) */
    if (a == 0) return sign;
    const int emin = 1 - bias; /* smallest normal exponent */
    const int e = (int)(a >> 23) - 127;
    if (e >= emin) {
        const int shift = 23 - mbits;
        const uint32_t r = a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u); /* RNE on the magnitude */
        const int e2 = (int)(r >> 23) - 127;
        const uint32_t m = (r >> shift) & ((1u << mbits) - 1u);
        return (uint8_t)(sign | (uint32_t)((e2 + bias) << mbits) | m);
    }
    /* subnormal: value = m * 2^(emin - mbits); exact power-of-two scaling, then RNE to an integer */
    const float q = ldexpf(fabsf(f), mbits - emin);
    const uint32_t m = (uint32_t)nearbyintf(q); /* may reach 1 << mbits: the smallest normal, same bits */
    return (uint8_t)(sign | m);
}

/* max(m, |v|) for m >= 0: as fmaxf here (a NaN |v| leaves m, as fmaxf skips it), but a comparison the
 * compiler keeps in vector registers, where fmaxf is a libm call per element. */
static inline float absmax_step(float m, float v) {
    const float a = fabsf(v);
    return a > m ? a : m;
}

/* One row n: its scale(s), then its codes. `code` and `fmt` are constants where inlined, so each
 * (dtype, format) pair gets its own straight-line loops (the int8 ones vectorize). */
static inline __attribute__((always_inline)) void quantize_row(const void *x, int64_t n, int64_t H, int64_t D,
                                                               const int code, const int fmt, int gran,
                                                               float static_scale, const int64_t *slots,
                                                               uint8_t *codes, float *scales) {
    const float qmax = fmt == 5 ? 127.f : fmt == 3 ? 448.f : 57344.f;
    const int64_t base = n * H * D;
    float tok_scale = static_scale;
    if (gran == 2) {
        float m = 0.f;
        for (int64_t i = 0; i < H * D; i++) m = absmax_step(m, load(x, base + i, code));
        tok_scale = (m > 1e-12f ? m : 1e-12f) / qmax;
        scales[slots[n]] = tok_scale;
    }
    uint8_t *out = codes + slots[n] * H * D;
    for (int64_t h = 0; h < H; h++) {
        float s = tok_scale;
        if (gran == 3) {
            float m = 0.f;
            for (int64_t d = 0; d < D; d++) m = absmax_step(m, load(x, base + h * D + d, code));
            s = (m > 1e-12f ? m : 1e-12f) / qmax;
            scales[slots[n] * H + h] = s;
        }
        for (int64_t d = 0; d < D; d++) {
            float y = load(x, base + h * D + d, code) / s;
            y = y < -qmax ? -qmax : y > qmax ? qmax : y; /* NaN stays NaN */
            uint8_t c;
            if (fmt == 5)
                c = (uint8_t)(int8_t)nearbyintf(y);
            else
                c = fmt == 3 ? to_fp8(y, 3, 7) : to_fp8(y, 2, 15);
            out[h * D + d] = c;
        }
    }
}

static inline int8_t int8_code(float v, float s) {
    float y = v / s;
    y = y < -127.f ? -127.f : y > 127.f ? 127.f : y;
    return (int8_t)nearbyintf(y);
}

/* Per-channel (KIVI) int8 scales, a running maximum per block, as `QuantStore._write_channel` computes it in
 * torch, bit for bit: a row at a block's first slot resets that block's scales; each block's new scale per
 * (head, channel) is max(old, max(absmax of its rows here, 1e-12) / 127); a block whose nonzero scale grew
 * in any channel has every code requantized from the old scales to the new ones (so nothing is ever clipped);
 * then the rows are quantized with their block's scales. Why in C: the torch expression is some twenty ops
 * (unique, scatter-reduce, index copies) a call, 0.2-0.3 ms on a decode step, once per layer for
 * K: a per-channel cache decoded at 0.44x per-token's speed. One thread: a decode step has few rows, and a
 * block's rows must see the scales the block's earlier rows set. Returns -1 if scratch cannot be allocated. */
static int channel_rows(const void *x, int64_t N, int64_t H, int64_t D, int code, int64_t BS,
                        const int64_t *slots, uint8_t *codes, float *scales) {
    const int64_t HD = H * D;
    if (N == 0) return 0;
    int64_t *blk = malloc(sizeof(int64_t) * N), *inv = malloc(sizeof(int64_t) * N);
    float *need = calloc((size_t)(N * HD), sizeof(float));
    if (!blk || !inv || !need) {
        free(blk), free(inv), free(need);
        return -1;
    }
    for (int64_t n = 0; n < N; n++)
        if (slots[n] % BS == 0) memset(scales + slots[n] / BS * HD, 0, sizeof(float) * HD);
    int64_t U = 0; /* distinct blocks in order of first appearance; rows of one block are usually adjacent */
    for (int64_t n = 0; n < N; n++) {
        const int64_t b = slots[n] / BS;
        int64_t j = U - 1;
        while (j >= 0 && blk[j] != b) j--;
        if (j < 0) blk[j = U++] = b;
        inv[n] = j;
        float *m = need + j * HD;
        for (int64_t i = 0; i < HD; i++) m[i] = absmax_step(m[i], load(x, n * HD + i, code));
    }
    for (int64_t j = 0; j < U; j++) {
        float *old = scales + blk[j] * HD, *nw = need + j * HD;
        int grown = 0;
        for (int64_t i = 0; i < HD; i++) {
            const float want = (nw[i] > 1e-12f ? nw[i] : 1e-12f) / 127.f;
            nw[i] = old[i] > want ? old[i] : want;
            grown |= nw[i] > old[i] && old[i] > 0.f;
        }
        if (grown) {
            int8_t *c = (int8_t *)codes + blk[j] * BS * HD;
            for (int64_t r = 0; r < BS; r++)
                for (int64_t i = 0; i < HD; i++) c[r * HD + i] = int8_code((float)c[r * HD + i] * old[i], nw[i]);
        }
        memcpy(old, nw, sizeof(float) * HD);
    }
    for (int64_t n = 0; n < N; n++) {
        const float *s = scales + blk[inv[n]] * HD;
        int8_t *out = (int8_t *)codes + slots[n] * HD;
        for (int64_t i = 0; i < HD; i++) out[i] = int8_code(load(x, n * HD + i, code), s[i]);
    }
    free(blk), free(inv), free(need);
    return 0;
}

#define KVF_QUANT_ROW(CODE, FMT) quantize_row(x, n, H, D, CODE, FMT, gran, static_scale, slots, codes, scales)
#define KVF_QUANT_FMT(CODE)                        \
    if (fmt == 5)                                  \
        KVF_QUANT_ROW(CODE, 5);                    \
    else if (fmt == 3)                             \
        KVF_QUANT_ROW(CODE, 3);                    \
    else                                           \
        KVF_QUANT_ROW(CODE, 4)

/* Rows are independent (each its own slot), so a prefill chunk's many rows split over the threads; a
 * decode step's few rows (under QUANT_PARALLEL_MIN elements) stay on the calling thread, which may be
 * the fused decode layers' loop. */
#define QUANT_PARALLEL_MIN 65536
int kvf_quantize_rows(const void *x, int64_t N, int64_t H, int64_t D, int code, int fmt, int gran,
                      float static_scale, int64_t block_size, const int64_t *slots, uint8_t *codes, float *scales) {
    if (gran == 4) return fmt == 5 ? channel_rows(x, N, H, D, code, block_size, slots, codes, scales) : -2;
#pragma omp parallel for schedule(static) if (N * H * D >= QUANT_PARALLEL_MIN)
    for (int64_t n = 0; n < N; n++) {
        if (code == 0) {
            KVF_QUANT_FMT(0);
        } else if (code == 1) {
            KVF_QUANT_FMT(1);
        } else {
            KVF_QUANT_FMT(2);
        }
    }
    return 0;
}
