/* Paged prefill attention for CPUs (the decode kernel is paged_decode.c; what they share is paged_common.h).
 * Built with paged_decode.c into one library (kvforge/attention/cpu_kernel.py), each unit compiled apart. */
#include "paged_common.h"

/* ---------------------------------------------------------------------------------------------
 * Paged prefill attention: the chunks of a step's prefilling sequences, each query attending to its
 * cached prefix and the chunk's earlier tokens (causal, optionally windowed), K/V read in place.
 *
 * Why: SDPA's CPU flash kernel runs these at ~60 GFLOP/s on this project's CPUs, and the paged
 * cache must first be gathered into contiguous K/V for it. Here a work item is (chunk, KV head,
 * tile of query tokens); it walks the visible keys 16 at a time, transposes the 16 key rows once
 * (so scores are plain vector FMAs of a broadcast query element against 16 keys, no horizontal
 * sums) and serves all query vectors of the tile (tokens x the G heads of the group) from that,
 * with an online softmax (running max and sum per query vector, fp32).
 *
 * Head size 64 (K and V) and at most 8 query heads per KV head; AVX-512 only (the caller checks
 * `kvf_paged_prefill_supported`). bf16 scores use VDPBF16PS on bf16 query/key pairs, and so does the
 * bf16 P.V product (probabilities rounded to bf16 pairs, V rows interleaved by key pairs; 1.11x on a
 * 1,024-token chunk after 1,024 cached tokens against fp32 FMAs, measured in one process). K and V are
 * `kvf_kv` operands like the decode kernel's: compressed rows (fp8, int8, int4, any scale granularity,
 * K/V split) are decoded in the block loop, once per 16 keys for all the item's query vectors, so a
 * quantized cache's prefill no longer gathers and dequantizes the whole context for SDPA.
 *
 *   q    [T, H, 64] (rows of the whole step; chunk c holds rows row0[c] .. row0[c] + qlen[c] - 1)
 *   out  [T, H, 64] (only the chunks' rows are written)
 *   tables [C, MAXNB] int64; start[c]: tokens already cached before chunk c
 * --------------------------------------------------------------------------------------------- */
#ifdef KVF_HAVE_AVX512
/* Rows r[0..15] (16 floats each) in, columns out: afterwards r[i] lane j holds what r[j] lane i held. */
static inline __attribute__((always_inline)) void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    /* r[4i + c], 128-bit lane L: rows 4i..4i+3 at column 4L + c */
    __m512 o[16];
    for (int c = 0; c < 4; c++) {
        const __m512 a = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
        const __m512 e = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88), f = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
        o[c] = _mm512_shuffle_f32x4(a, e, 0x88);
        o[8 + c] = _mm512_shuffle_f32x4(a, e, 0xDD);
        o[4 + c] = _mm512_shuffle_f32x4(b, f, 0x88);
        o[12 + c] = _mm512_shuffle_f32x4(b, f, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = o[i];
}

typedef struct {
    int64_t chunk, t0, t1, kv_head, cost;
} prefill_item;

static int by_cost_desc(const void *a, const void *b) {
    const int64_t x = ((const prefill_item *)a)->cost, y = ((const prefill_item *)b)->cost;
    return (x < y) - (x > y);
}

/* One item: query tokens [t0, t1) of chunk c against KV head j, all G query heads of the group. */
static inline __attribute__((always_inline)) void prefill_item_run(
    const prefill_item *it, const char *q, const kvf_kv *K, const kvf_kv *V, const int64_t *table,
    int64_t row0, int64_t start, char *out, int64_t H, int64_t BS, int64_t window, float scale,
    float softcap, int code, float *qf, float *acc, float *mrun, float *lrun, __m512 *kt, float *vf, const int G) {
    const size_t esz = code == 0 ? 4 : 2;
    const char *k_cache = K->data, *v_cache = V->data;
    const size_t k_row = (size_t)K->row_bytes, v_row = (size_t)V->row_bytes; /* one token, all KV heads */
    const size_t k_off = (size_t)(it->kv_head * K->head_bytes), v_off = (size_t)(it->kv_head * V->head_bytes);
    /* Rows stored in the compute dtype are read as they lie; compressed rows (any format and scale
     * granularity) are decoded once per 16-key block by `kv_row`, exactly as the decode kernel's portable
     * loops and the reference dequantize them, and then shared by the item's query vectors. */
    const int dense_k = K->code == code && K->gran == KVF_SCALE_NONE, dense_v = V->code == code && V->gran == KVF_SCALE_NONE;
    const int64_t nt = it->t1 - it->t0, nv = nt * G;
    const int use_dp = 0
#if defined(__AVX512BF16__)
        || code == 1
#endif
        ;
    float kdec[64] __attribute__((aligned(64)));
    /* Queries as fp32 (or, for VDPBF16PS, kept as their bf16 pairs in place: 32 dwords a vector). */
    for (int64_t tt = 0; tt < nt; tt++)
        for (int g = 0; g < G; g++) {
            const char *src = q + (((row0 + it->t0 + tt) * H + it->kv_head * G + g) * 64) * esz;
            float *dst = qf + (tt * G + g) * 64;
            if (use_dp)
                memcpy(dst, src, 128);
            else
                load_row(dst, src, 64, code);
        }
    for (int64_t v = 0; v < nv; v++) {
        mrun[v] = -INFINITY;
        lrun[v] = 0.f;
    }
    memset(acc, 0, sizeof(float) * nv * 64);
    const int64_t p_first = start + it->t0, p_last = start + it->t1 - 1;
    const int64_t kmin = window > 0 && p_first - window + 1 > 0 ? p_first - window + 1 : 0;
    float pbuf[16] __attribute__((aligned(64)));
    float sbuf[16] __attribute__((aligned(64)));
    for (int64_t kb = kmin; kb <= p_last; kb += 16) {
        const int cnt = p_last - kb + 1 < 16 ? (int)(p_last - kb + 1) : 16;
        /* The 16 key rows of this head, transposed: kt[d] = 16 keys' element d (fp32 path), or
         * kt[dp] = 16 keys' bf16 pair dp (VDPBF16PS path). V rows widened to fp32 in vf. */
        const char *krow[16], *vrow[16];
        int64_t kslot[16];
        for (int r = 0; r < 16; r++) {
            const int64_t key = kb + (r < cnt ? r : 0);
            const int64_t slot = table[key / BS] * BS + key % BS;
            krow[r] = k_cache + slot * k_row + k_off;
            vrow[r] = v_cache + slot * v_row + v_off;
            kslot[r] = slot;
        }
        if (!dense_k) {
            /* decoded rows hold values of the compute dtype: for bf16 they convert back to bf16 exactly,
             * and take the VDPBF16PS layout of stored bf16 rows (pairs of elements per 32-bit lane) */
            for (int r = 0; r < 16; r++) {
                const float *x = r < cnt ? kv_row(kdec, K, kslot[r], it->kv_head, 64, BS, code) : NULL;
#if defined(__AVX512BF16__)
                if (use_dp) {
                    for (int half = 0; half < 2; half++)
                        kt[half * 16 + r] = x ? (__m512)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 32 * half + 16),
                                                                         _mm512_loadu_ps(x + 32 * half))
                                              : _mm512_setzero_ps();
                    continue;
                }
#endif
                for (int c = 0; c < 4; c++) kt[c * 16 + r] = x ? _mm512_loadu_ps(x + 16 * c) : _mm512_setzero_ps();
            }
            for (int c = 0; c < (use_dp ? 2 : 4); c++) transpose16(kt + c * 16);
        } else if (use_dp) {
            for (int half = 0; half < 2; half++) {
                for (int r = 0; r < 16; r++)
                    kt[half * 16 + r] = r < cnt ? _mm512_loadu_ps((const float *)(krow[r] + 64 * half)) : _mm512_setzero_ps();
                transpose16(kt + half * 16);
            }
        } else {
            for (int c = 0; c < 4; c++) {
                for (int r = 0; r < 16; r++) {
                    if (r >= cnt) {
                        kt[c * 16 + r] = _mm512_setzero_ps();
                    } else if (code == 0) {
                        kt[c * 16 + r] = _mm512_loadu_ps((const float *)krow[r] + 16 * c);
                    } else {
                        __m512 x[4];
                        load64(krow[r], code, x);
                        kt[c * 16 + r] = x[c];
                    }
                }
                transpose16(kt + c * 16);
            }
        }
#if defined(__AVX512BF16__)
        if (use_dp) {
            /* bf16 V rows, keys paired element by element (rows 2j and 2j+1 unpacked), so that one
             * VDPBF16PS adds p_2j * v_2j + p_2j+1 * v_2j+1 for 16 dims, as the decode kernel's bf16 V pass;
             * the accumulators then hold dims in unpack order, restored by `unpermute_d64` at the end. */
            __m512i rows[16][2];
            for (int r = 0; r < 16; r++) {
                if (r >= cnt) {
                    rows[r][0] = rows[r][1] = _mm512_setzero_si512();
                } else if (dense_v) {
                    rows[r][0] = _mm512_loadu_si512(vrow[r]);
                    rows[r][1] = _mm512_loadu_si512(vrow[r] + 64);
                } else { /* decoded values are bf16 values: back to bf16 exactly */
                    const float *x = kv_row(kdec, V, kslot[r], it->kv_head, 64, BS, code);
                    rows[r][0] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
                    rows[r][1] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 48), _mm512_loadu_ps(x + 32));
                }
            }
            __m512i *vx = (__m512i *)vf;
            for (int j = 0; j < 8; j++) {
                vx[4 * j] = _mm512_unpacklo_epi16(rows[2 * j][0], rows[2 * j + 1][0]);
                vx[4 * j + 1] = _mm512_unpackhi_epi16(rows[2 * j][0], rows[2 * j + 1][0]);
                vx[4 * j + 2] = _mm512_unpacklo_epi16(rows[2 * j][1], rows[2 * j + 1][1]);
                vx[4 * j + 3] = _mm512_unpackhi_epi16(rows[2 * j][1], rows[2 * j + 1][1]);
            }
        } else
#endif
        for (int r = 0; r < 16; r++) {
            if (r >= cnt) {
                memset(vf + r * 64, 0, 64 * sizeof(float));
            } else if (dense_v) {
                load_row(vf + r * 64, vrow[r], 64, code);
            } else {
                const float *x = kv_row(vf + r * 64, V, kslot[r], it->kv_head, 64, BS, code);
                if (x != vf + r * 64) memcpy(vf + r * 64, x, 64 * sizeof(float));
            }
        }
        for (int64_t tt = 0; tt < nt; tt++) {
            const int64_t p = p_first + tt; /* this token's position: it sees keys (p - window, p] */
            const int64_t lo = window > 0 ? p - window + 1 : 0;
            if (kb > p || kb + cnt - 1 < lo) continue;
            __mmask16 valid = (__mmask16)((1u << cnt) - 1u);
            if (kb + 15 > p) valid &= (__mmask16)((1u << (p - kb + 1)) - 1u);
            if (kb < lo) valid &= (__mmask16)~((1u << (lo - kb)) - 1u);
            for (int g = 0; g < G; g++) {
                const int64_t v = tt * G + g;
                const float *qv = qf + v * 64;
                __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#if defined(__AVX512BF16__)
                if (use_dp) {
                    const int32_t *qp = (const int32_t *)qv;
                    for (int dp = 0; dp < 32; dp += 4) {
                        s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_set1_epi32(qp[dp]), (__m512bh)kt[dp]);
                        s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_set1_epi32(qp[dp + 1]), (__m512bh)kt[dp + 1]);
                        s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_set1_epi32(qp[dp + 2]), (__m512bh)kt[dp + 2]);
                        s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_set1_epi32(qp[dp + 3]), (__m512bh)kt[dp + 3]);
                    }
                } else
#endif
                {
                    for (int d = 0; d < 64; d += 4) {
                        s0 = _mm512_fmadd_ps(_mm512_set1_ps(qv[d]), kt[d], s0);
                        s1 = _mm512_fmadd_ps(_mm512_set1_ps(qv[d + 1]), kt[d + 1], s1);
                        s2 = _mm512_fmadd_ps(_mm512_set1_ps(qv[d + 2]), kt[d + 2], s2);
                        s3 = _mm512_fmadd_ps(_mm512_set1_ps(qv[d + 3]), kt[d + 3], s3);
                    }
                }
                _mm512_store_ps(sbuf, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
                if (softcap > 0.f) {
                    const float inv_cap = scale / softcap;
#pragma omp simd
                    for (int r = 0; r < 16; r++) sbuf[r] = tanhf(sbuf[r] * inv_cap) * softcap;
                } else {
#pragma omp simd
                    for (int r = 0; r < 16; r++) sbuf[r] *= scale;
                }
                const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), _mm512_load_ps(sbuf));
                const float m_new = fmaxf(mrun[v], _mm512_reduce_max_ps(s));
                const float corr = expf(mrun[v] - m_new); /* 0 on the first block (m was -inf) */
                _mm512_store_ps(sbuf, _mm512_sub_ps(s, _mm512_set1_ps(m_new)));
#pragma omp simd
                for (int r = 0; r < 16; r++) pbuf[r] = expf(sbuf[r]); /* masked keys: exp(-inf) = 0 */
                lrun[v] = lrun[v] * corr + _mm512_reduce_add_ps(_mm512_load_ps(pbuf));
                mrun[v] = m_new;
                float *a = acc + v * 64;
                const __m512 cv = _mm512_set1_ps(corr);
                __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(a), cv), a1 = _mm512_mul_ps(_mm512_loadu_ps(a + 16), cv);
                __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(a + 32), cv), a3 = _mm512_mul_ps(_mm512_loadu_ps(a + 48), cv);
#if defined(__AVX512BF16__)
                if (use_dp) { /* probabilities rounded to bf16 pairs, as the reference rounds them */
                    const __m256bh pb = _mm512_cvtneps_pbh(_mm512_load_ps(pbuf));
                    int32_t pairs[8];
                    memcpy(pairs, &pb, sizeof pairs);
                    const __m512i *vx = (const __m512i *)vf;
                    for (int j = 0; j < (cnt + 1) / 2; j++) {
                        const __m512bh w = (__m512bh)_mm512_set1_epi32(pairs[j]);
                        a0 = _mm512_dpbf16_ps(a0, w, (__m512bh)vx[4 * j]);
                        a1 = _mm512_dpbf16_ps(a1, w, (__m512bh)vx[4 * j + 1]);
                        a2 = _mm512_dpbf16_ps(a2, w, (__m512bh)vx[4 * j + 2]);
                        a3 = _mm512_dpbf16_ps(a3, w, (__m512bh)vx[4 * j + 3]);
                    }
                } else
#endif
                for (int r = 0; r < cnt; r++) {
                    const __m512 w = _mm512_set1_ps(pbuf[r]);
                    const float *vr = vf + r * 64;
                    a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr), a0);
                    a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16), a1);
                    a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 32), a2);
                    a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 48), a3);
                }
                _mm512_storeu_ps(a, a0);
                _mm512_storeu_ps(a + 16, a1);
                _mm512_storeu_ps(a + 32, a2);
                _mm512_storeu_ps(a + 48, a3);
            }
        }
    }
    for (int64_t tt = 0; tt < nt; tt++)
        for (int g = 0; g < G; g++) {
            const int64_t v = tt * G + g;
            const float inv = 1.f / lrun[v];
            float *a = acc + v * 64;
#if defined(__AVX512BF16__)
            if (use_dp) unpermute_d64(a);
#endif
            for (int d = 0; d < 64; d++) a[d] *= inv;
            store_row(out + (((row0 + it->t0 + tt) * H + it->kv_head * G + g) * 64) * esz, a, 64, code);
        }
}
#endif

#if defined(KVF_HAVE_AVX512)
/* ---- bf16 prefill with query vectors in lanes -------------------------------------------------------
 * Why: with keys in lanes (`prefill_item_run`), every query vector pays, per 16 keys, two horizontal
 * reductions (max, sum), a scalar exp for the running-max correction and a reload of its 64
 * accumulators, all on the critical path after its 32 score instructions: measured at ~70-110 GFLOP/s,
 * against ~400 for the matmuls. Here 16 query vectors share the lanes of every register, so a block of
 * 16 keys is
 *   scores:  s[r] (16 vectors' scores against key r) = 32 VDPBF16PS of the queries' transposed bf16
 *            pairs against key r's pairs, broadcast straight from the cache row (16 independent chains);
 *   softmax: the block max is a vertical max over the 16 registers, the running max, sum and correction
 *            are vectors of the 16 lanes (one vector exp for the correction, no horizontal op);
 *   P.V:     the probabilities become bf16 pairs of adjacent keys per lane, and each of the 64 output
 *            dims (a register of 16 lanes, in L1) takes 8 VDPBF16PS against V's pairs for that dim.
 * Same arithmetic as `prefill_item_run`'s bf16 path: exact bf16 products summed in fp32, probabilities
 * rounded to bf16 for P.V, fp32 running sums; results differ from it by summation order and the exp. */
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
    /* Cephes' expf: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial (~1 ulp). Inputs
     * below -104 (and -inf) give 0, as exp would underflow there with FTZ on. */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-104.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

#if defined(__AVX512BF16__)
/* An 8-bit row with one scale per row (`q8_reads`), dequantized and rounded to bf16 as `kv_row` does it
 * (code x scale in fp32, one rounding to nearest even; e4m3's value / 256 times scale x 256 is the same
 * product), 16 codes per instruction pair instead of kv_row's element loops: lo = dims 0-31, hi = 32-63. */
static inline __attribute__((always_inline)) void q8_row_bf16(const kvf_kv *op, int64_t slot, int64_t h, __m512i *lo,
                                                              __m512i *hi) {
    const char *p = op->data + slot * op->row_bytes + h * op->head_bytes;
    const float f = q8_factor(op, slot, h);
    if (op->code == KVF_INT8)
        dequant_row_bf16(p, f, KVF_INT8, lo, hi);
    else if (op->code == KVF_E4M3)
        dequant_row_bf16(p, f, KVF_E4M3, lo, hi);
    else
        dequant_row_bf16(p, f, KVF_E5M2, lo, hi);
}

#endif /* __AVX512BF16__ */

/* One block of 16 keys for 16 query vectors in lanes: s[r] holds the raw scores against key kb + r; they
 * are scaled (or soft-capped), masked per lane (causal at the lane's position P, and its window), and
 * replaced by their exp against the updated running max; the running max and sum advance, and the
 * factor the accumulators owe for the new max is returned. */
static inline __attribute__((always_inline)) __m512 lanes_softmax(__m512 *s, __m512i P, int64_t kb, int64_t window,
                                                                  float scale, float softcap, __m512 *mrun,
                                                                  __m512 *lrun) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < 16; r++) {
        if (softcap > 0.f) {
            float t[16] __attribute__((aligned(64)));
            _mm512_store_ps(t, _mm512_mul_ps(s[r], _mm512_set1_ps(scale / softcap)));
#pragma omp simd
            for (int i = 0; i < 16; i++) t[i] = tanhf(t[i]) * softcap;
            s[r] = _mm512_load_ps(t);
        } else {
            s[r] = _mm512_mul_ps(s[r], _mm512_set1_ps(scale));
        }
        const int32_t key = (int32_t)(kb + r);
        __mmask16 valid = _mm512_cmpge_epi32_mask(P, _mm512_set1_epi32(key));
        if (window > 0) valid &= _mm512_cmplt_epi32_mask(P, _mm512_set1_epi32((int32_t)(key + window)));
        s[r] = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), s[r]);
        mx = _mm512_max_ps(mx, s[r]);
    }
    const __m512 m_new = _mm512_max_ps(*mrun, mx);
    /* a lane with no visible key yet keeps -inf: subtract 0 there, so exp gives 0, not NaN */
    const __m512 m_safe = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                               m_new, _mm512_setzero_ps());
    const __m512 corr = exp512(_mm512_sub_ps(*mrun, m_safe));
    *mrun = m_new;
    __m512 sum = _mm512_setzero_ps();
    for (int r = 0; r < 16; r++) {
        s[r] = exp512(_mm512_sub_ps(s[r], m_safe));
        sum = _mm512_add_ps(sum, s[r]);
    }
    *lrun = _mm512_fmadd_ps(*lrun, corr, sum);
    return corr;
}

/* Queries of an item transposed into lanes: qt[grp][e][lane] = element (or bf16 pair) e of vector
 * grp * 16 + lane (vector v = token v / G, head v % G), `per` 32-bit words a vector (per < 0: bf16
 * queries widened to 64 floats); pos[v] its position (INT32_MIN past nv: such lanes never see a key). */
static void lanes_queries(const prefill_item *it, const char *q, int64_t row0, int64_t start, int64_t H, int64_t G,
                          int per, int32_t *qt, int32_t *pos) {
    const int64_t nt = it->t1 - it->t0, nv = nt * G, ngroups = (nv + 15) / 16;
    const int words = per < 0 ? 64 : per; /* 32-bit words a vector in qt */
    memset(qt, 0, sizeof(int32_t) * ngroups * words * 16);
    for (int64_t v = 0; v < ngroups * 16; v++) pos[v] = INT32_MIN;
    for (int64_t v = 0; v < nv; v++) {
        const int64_t tt = v / G, g = v % G;
        int32_t *dst = qt + (v / 16) * words * 16 + v % 16;
        if (per < 0) { /* bf16 queries widened to fp32: 64 floats a vector */
            const uint16_t *src = (const uint16_t *)q + ((row0 + it->t0 + tt) * H + it->kv_head * G + g) * 64;
            for (int e = 0; e < 64; e++) ((float *)dst)[e * 16] = bf16_to_f32(src[e]);
        } else {
            const int32_t *src = (const int32_t *)q + ((row0 + it->t0 + tt) * H + it->kv_head * G + g) * per;
            for (int e = 0; e < per; e++) dst[e * 16] = src[e];
        }
        pos[v] = (int32_t)(start + it->t0 + tt);
    }
}

/* The lanes layout's output, stored as `code`: vector v's dim is acc_t[grp][idx][lane] / l[lane] (or, with
 * `lane_major`, acc_t[grp][lane][idx]: the AMX loop's C tiles), idx = dim or (`permuted`) the unpack order
 * of `prefill_item_bf16`. */
static void lanes_store(const prefill_item *it, char *out, int64_t row0, int64_t H, int64_t G, const float *acc_t,
                        const __m512 *lrun, int code, int permuted, int lane_major) {
    const int64_t nv = (it->t1 - it->t0) * G, ngroups = (nv + 15) / 16;
    const size_t esz = code == KVF_F32 ? 4 : 2;
    for (int64_t grp = 0; grp < ngroups; grp++) {
        float linv[16] __attribute__((aligned(64)));
        _mm512_store_ps(linv, _mm512_div_ps(_mm512_set1_ps(1.f), lrun[grp]));
        const float *ag = acc_t + grp * 1024;
        for (int lane = 0; lane < 16 && grp * 16 + lane < nv; lane++) {
            const int64_t v = grp * 16 + lane, tt = v / G, g = v % G;
            float row[64];
            for (int d = 0; d < 64; d++) {
                const int c = d / 16, L = d % 16;
                const int dim = !permuted ? d : 32 * (c / 2) + 8 * (L / 4) + 4 * (c % 2) + L % 4;
                row[dim] = ag[lane_major ? lane * 64 + d : d * 16 + lane] * linv[lane];
            }
            store_row(out + (((row0 + it->t0 + tt) * H + it->kv_head * G + g) * 64) * esz, row, 64, code);
        }
    }
}

#if defined(__AVX512BF16__)
/* The lanes groups' running max and sum (empty), and the first and last position of each group's lanes. */
static inline void lanes_groups_init(const int32_t *pos, int64_t nv, int64_t ngroups, __m512 *mrun, __m512 *lrun,
                                     int32_t *gmin, int32_t *gmax) {
    for (int64_t grp = 0; grp < ngroups; grp++) {
        mrun[grp] = _mm512_set1_ps(-INFINITY);
        lrun[grp] = _mm512_setzero_ps();
        gmin[grp] = pos[grp * 16];
        const int64_t last = grp * 16 + 15 < nv - 1 ? grp * 16 + 15 : nv - 1;
        gmax[grp] = pos[last];
    }
}

/* One block of 16 keys (kb .. kb + cnt - 1, the rest zero) as bf16, read in place or decoded. K: kd[r] points
 * at key r's 64 bf16 (pairs as int32): into the cache for dense rows unless `copy_k`, else into kbuf (16 x 64,
 * where decoded or copied rows go; `zero_row` for missing keys). V: the block as pairs of adjacent keys,
 * vx[(4j + c) * 16 + L] = (v_2j, v_2j+1) at dim 32(c/2) + 8(L/4) + 4(c%2) + L%4 (the unpack order). Decoded
 * values are bf16 values, so going back to bf16 is exact. */
static inline __attribute__((always_inline)) void block_rows_bf16(
    const kvf_kv *K, const kvf_kv *V, const int64_t *table, int64_t BS, int64_t kv_head, int64_t kb, int cnt,
    int copy_k, const int32_t **kd, uint16_t *kbuf, const uint16_t *zero_row, int32_t *vx) {
    const size_t k_row = (size_t)K->row_bytes, v_row = (size_t)V->row_bytes;
    const size_t k_off = (size_t)(kv_head * K->head_bytes), v_off = (size_t)(kv_head * V->head_bytes);
    const int dense_k = K->code == KVF_BF16 && K->gran == KVF_SCALE_NONE;
    const int dense_v = V->code == KVF_BF16 && V->gran == KVF_SCALE_NONE;
    const int q8_k = q8_reads(K, KVF_BF16), q8_v = q8_reads(V, KVF_BF16);
    float kdec[64] __attribute__((aligned(64)));
    __m512i rows[16][2];
    for (int r = 0; r < 16; r++) {
        uint16_t *dst = kbuf + r * 64;
        if (r >= cnt) {
            if (copy_k) {
                _mm512_storeu_si512(dst, _mm512_setzero_si512());
                _mm512_storeu_si512(dst + 32, _mm512_setzero_si512());
                kd[r] = (const int32_t *)dst;
            } else {
                kd[r] = (const int32_t *)zero_row;
            }
            rows[r][0] = rows[r][1] = _mm512_setzero_si512();
            continue;
        }
        const int64_t key = kb + r, slot = table[key / BS] * BS + key % BS;
        if (dense_k) {
            const char *kp = K->data + slot * k_row + k_off;
            if (copy_k) {
                _mm512_storeu_si512(dst, _mm512_loadu_si512(kp));
                _mm512_storeu_si512(dst + 32, _mm512_loadu_si512(kp + 64));
                kd[r] = (const int32_t *)dst;
            } else {
                kd[r] = (const int32_t *)kp;
            }
        } else if (q8_k) {
            __m512i lo, hi;
            q8_row_bf16(K, slot, kv_head, &lo, &hi);
            _mm512_storeu_si512(dst, lo);
            _mm512_storeu_si512(dst + 32, hi);
            kd[r] = (const int32_t *)dst;
        } else {
            const float *x = kv_row(kdec, K, slot, kv_head, 64, BS, KVF_BF16);
            _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x)));
            _mm512_storeu_si512(dst + 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 48), _mm512_loadu_ps(x + 32)));
            kd[r] = (const int32_t *)dst;
        }
        if (dense_v) {
            const char *vp = V->data + slot * v_row + v_off;
            rows[r][0] = _mm512_loadu_si512(vp);
            rows[r][1] = _mm512_loadu_si512(vp + 64);
        } else if (q8_v) {
            q8_row_bf16(V, slot, kv_head, &rows[r][0], &rows[r][1]);
        } else {
            const float *x = kv_row(kdec, V, slot, kv_head, 64, BS, KVF_BF16);
            rows[r][0] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
            rows[r][1] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 48), _mm512_loadu_ps(x + 32));
        }
    }
    for (int j = 0; j < 8; j++) {
        _mm512_store_si512(vx + (4 * j) * 16, _mm512_unpacklo_epi16(rows[2 * j][0], rows[2 * j + 1][0]));
        _mm512_store_si512(vx + (4 * j + 1) * 16, _mm512_unpackhi_epi16(rows[2 * j][0], rows[2 * j + 1][0]));
        _mm512_store_si512(vx + (4 * j + 2) * 16, _mm512_unpacklo_epi16(rows[2 * j][1], rows[2 * j + 1][1]));
        _mm512_store_si512(vx + (4 * j + 3) * 16, _mm512_unpackhi_epi16(rows[2 * j][1], rows[2 * j + 1][1]));
    }
}

/* One item (chunk c's query tokens [t0, t1) x the G heads of KV head j) on the lanes layout. Scratch:
 * qt >= 3 x 32 x 16 dwords, acc_t >= 3 x 64 x 16 floats, kbuf 16 x 64 bf16 (+ a zero row), vx 32 x 16
 * dwords, all 64-byte aligned. */
static void prefill_item_bf16(const prefill_item *it, const char *q, const kvf_kv *K, const kvf_kv *V,
                              const int64_t *table, int64_t row0, int64_t start, char *out, int64_t H, int64_t BS,
                              int64_t window, float scale, float softcap, int64_t G, int32_t *qt, float *acc_t,
                              uint16_t *kbuf, int32_t *vx) {
    const int64_t nt = it->t1 - it->t0, nv = nt * G, ngroups = (nv + 15) / 16;
    uint16_t *zero_row = kbuf + 16 * 64; /* what missing keys of a partial block point at */
    memset(zero_row, 0, 64 * sizeof(uint16_t));
    int32_t pos[48] __attribute__((aligned(64)));
    lanes_queries(it, q, row0, start, H, G, 32, qt, pos); /* 32 bf16 pairs a vector */
    memset(acc_t, 0, sizeof(float) * ngroups * 1024);
    __m512 mrun[3], lrun[3];
    int32_t gmin[3], gmax[3];
    lanes_groups_init(pos, nv, ngroups, mrun, lrun, gmin, gmax);
    const int64_t p_first = start + it->t0, p_last = start + it->t1 - 1;
    const int64_t kmin = window > 0 && p_first - window + 1 > 0 ? p_first - window + 1 : 0;
    /* pairs of adjacent keys per lane: (p_2j, p_2j+1) from cvtne2ps_pbh(p_2j+1, p_2j)'s two halves */
    const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t kb = kmin; kb <= p_last; kb += 16) {
        const int cnt = p_last - kb + 1 < 16 ? (int)(p_last - kb + 1) : 16;
        const int32_t *kd[16];
        block_rows_bf16(K, V, table, BS, it->kv_head, kb, cnt, 0, kd, kbuf, zero_row, vx);
        for (int64_t grp = 0; grp < ngroups; grp++) {
            if (kb > gmax[grp]) continue;                                      /* all keys after every lane */
            if (window > 0 && kb + cnt - 1 <= gmin[grp] - window) continue;     /* all before every window */
            const int32_t *qg = qt + grp * 512;
            __m512 s[16];
            for (int r = 0; r < 16; r++) s[r] = _mm512_setzero_ps();
            for (int dp = 0; dp < 32; dp++) {
                const __m512bh qv = (__m512bh)_mm512_load_si512(qg + dp * 16);
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++)
                    s[r] = _mm512_dpbf16_ps(s[r], qv, (__m512bh)_mm512_set1_epi32(kd[r][dp]));
            }
            const __m512 corr = lanes_softmax(s, _mm512_load_si512(pos + grp * 16), kb, window, scale, softcap,
                                              &mrun[grp], &lrun[grp]);
            __m512bh pp[8];
            for (int j = 0; j < 8; j++)
                pp[j] = (__m512bh)_mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(s[2 * j + 1], s[2 * j]));
            float *ag = acc_t + grp * 1024;
            const int jmax = (cnt + 1) / 2;
            for (int d = 0; d < 64; d++) { /* d = c * 16 + L: the vx layout's (c, L) */
                const int c = d / 16, L = d % 16;
                __m512 a = _mm512_mul_ps(_mm512_load_ps(ag + d * 16), corr);
                for (int j = 0; j < jmax; j++)
                    a = _mm512_dpbf16_ps(a, pp[j], (__m512bh)_mm512_set1_epi32(vx[(4 * j + c) * 16 + L]));
                _mm512_store_ps(ag + d * 16, a);
            }
        }
    }
    lanes_store(it, out, row0, H, G, acc_t, lrun, KVF_BF16, 1, 0);
}
#endif

#include "kvf_amx.h"
#if defined(__AVX512BF16__) && KVF_AMX_BUILT
#define KVF_PREFILL_AMX 1
/* bf16 prefill on AMX tiles (Xeons from Sapphire Rapids on). Why: there the tile unit multiplies bf16
 * several times faster than the vector units, and both products of an item map onto tiles with no
 * transposes of the cache: the scores of 16 keys x 16 query vectors are one C tile, K rows (16 x 32 dims,
 * as they lie, 2 tiles) times the lanes layout's queries (qt: 16 lanes of dim pairs, already AMX's B
 * operand, 2 tiles); P.V is P^T (16 query vectors x 16 keys, transposed once in registers) times V as
 * pairs of adjacent keys (vx: already a B operand, 16 dims a tile). The online softmax is the lanes
 * layout's, unchanged; the accumulators are [vector][dim] here (C tiles are rows of vectors), rescaled by
 * the running max's correction only when it moved. Same exact products and bf16-rounded probabilities as
 * `prefill_item_bf16`; fp32 sums in the tile unit's order (denormals flushed, as the kernel's FTZ/DAZ).
 * Tiles: 0 scores, 1-2 K halves, 3-4 query halves, 5 a P.V block, 6 P^T, 7 V pairs. */
static void prefill_amx_configure(void) {
    kvf_amx_config cfg;
    kvf_amx_config_full(&cfg);
    cfg.colsb[6] = 32; /* P^T: 16 vectors x 16 keys bf16 */
    cfg.rows[7] = 8;   /* V: 8 pairs of keys x 16 dims */
    _tile_loadconfig(&cfg);
}

/* Scratch as `prefill_item_bf16`'s, with kbuf 16 x 64 bf16 always filled (the A tiles' rows). */
static void prefill_item_amx(const prefill_item *it, const char *q, const kvf_kv *K, const kvf_kv *V,
                             const int64_t *table, int64_t row0, int64_t start, char *out, int64_t H, int64_t BS,
                             int64_t window, float scale, float softcap, int64_t G, int32_t *qt, float *acc,
                             uint16_t *kbuf, int32_t *vx) {
    const int64_t nt = it->t1 - it->t0, nv = nt * G, ngroups = (nv + 15) / 16;
    float sbuf[256] __attribute__((aligned(64)));
    uint16_t pbuf[256] __attribute__((aligned(64)));
    int32_t pos[48] __attribute__((aligned(64)));
    lanes_queries(it, q, row0, start, H, G, 32, qt, pos); /* 32 bf16 pairs a vector: B tiles as they lie */
    memset(acc, 0, sizeof(float) * ngroups * 1024);
    __m512 mrun[3], lrun[3];
    int32_t gmin[3], gmax[3];
    lanes_groups_init(pos, nv, ngroups, mrun, lrun, gmin, gmax);
    prefill_amx_configure();
    const int64_t p_first = start + it->t0, p_last = start + it->t1 - 1;
    const int64_t kmin = window > 0 && p_first - window + 1 > 0 ? p_first - window + 1 : 0;
    for (int64_t kb = kmin; kb <= p_last; kb += 16) {
        const int cnt = p_last - kb + 1 < 16 ? (int)(p_last - kb + 1) : 16;
        const int32_t *kd[16]; /* all into kbuf: the A tiles' 16 rows, missing keys zero */
        block_rows_bf16(K, V, table, BS, it->kv_head, kb, cnt, 1, kd, kbuf, NULL, vx);
        _tile_loadd(1, kbuf, 128);
        _tile_loadd(2, kbuf + 32, 128);
        for (int64_t grp = 0; grp < ngroups; grp++) {
            if (kb > gmax[grp]) continue;                                      /* all keys after every lane */
            if (window > 0 && kb + cnt - 1 <= gmin[grp] - window) continue;     /* all before every window */
            const int32_t *qg = qt + grp * 512;
            _tile_zero(0);
            _tile_loadd(3, qg, 64);
            _tile_loadd(4, qg + 256, 64);
            _tile_dpbf16ps(0, 1, 3);
            _tile_dpbf16ps(0, 2, 4);
            _tile_stored(0, sbuf, 64);
            __m512 s[16];
            for (int r = 0; r < 16; r++) s[r] = _mm512_load_ps(sbuf + r * 16);
            const __m512 corr = lanes_softmax(s, _mm512_load_si512(pos + grp * 16), kb, window, scale, softcap,
                                              &mrun[grp], &lrun[grp]);
            transpose16(s); /* s[n] lane r: key r's probability for vector n */
            for (int n = 0; n < 16; n++) _mm256_store_si256((__m256i *)(pbuf + n * 16), (__m256i)_mm512_cvtneps_pbh(s[n]));
            float *ag = acc + grp * 1024; /* [vector][dim in vx order] */
            if (_mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.f), _CMP_NEQ_UQ)) {
                float cf[16] __attribute__((aligned(64)));
                _mm512_store_ps(cf, corr);
                for (int n = 0; n < 16; n++) {
                    const __m512 f = _mm512_set1_ps(cf[n]);
                    for (int c = 0; c < 4; c++)
                        _mm512_store_ps(ag + n * 64 + c * 16, _mm512_mul_ps(_mm512_load_ps(ag + n * 64 + c * 16), f));
                }
            }
            _tile_loadd(6, pbuf, 32);
            for (int c = 0; c < 4; c++) {
                _tile_loadd(5, ag + c * 16, 256);
                _tile_loadd(7, vx + c * 16, 256);
                _tile_dpbf16ps(5, 6, 7);
                _tile_stored(5, ag + c * 16, 256);
            }
        }
    }
    _tile_release();
    /* out: C tiles hold each vector's dims lane-major, in the vx (unpack) order */
    lanes_store(it, out, row0, H, G, acc, lrun, KVF_BF16, 1, 1);
}
#else
#define KVF_PREFILL_AMX 0
#endif

/* An 8-bit row with one scale per row (`q8_reads`) as 64 floats, 16 codes per instruction: code x factor
 * in fp32 (one rounding), then rounded to bf16 under bf16 compute, exactly the values `kv_row` gives. */
static inline __attribute__((always_inline)) void q8_row_f32_as(const kvf_kv *op, int64_t slot, int64_t h,
                                                                int compute, float *dst, const int code) {
    const char *p = op->data + slot * op->row_bytes + h * op->head_bytes;
    const __m512 f = _mm512_set1_ps(q8_factor(op, slot, h));
    for (int c = 0; c < 4; c++) {
        __m512 x = _mm512_mul_ps(load16_q8(p, c, code), f);
        if (compute == KVF_BF16) { /* f32_to_bf16's rounding, kept as an fp32 value */
            const __m512i u = _mm512_castps_si512(x);
            const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            x = _mm512_castsi512_ps(_mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                                     _mm512_set1_epi32((int)0xffff0000u)));
        }
        _mm512_store_ps(dst + 16 * c, x);
    }
}

static inline __attribute__((always_inline)) const float *q8_row_f32(const kvf_kv *op, int64_t slot, int64_t h,
                                                                    int compute, float *dst) {
    if (op->code == KVF_INT8)
        q8_row_f32_as(op, slot, h, compute, dst, KVF_INT8);
    else if (op->code == KVF_E4M3)
        q8_row_f32_as(op, slot, h, compute, dst, KVF_E4M3);
    else
        q8_row_f32_as(op, slot, h, compute, dst, KVF_E5M2);
    return dst;
}

/* Scores of the block's 16 keys (kb: rows of 64 floats, one after another) against NG groups of 16 query
 * vectors at once (qg[g]: a group's queries, dim-major), into sb[g * 16 + r] (lane = query vector): 8 keys
 * at a time, so each key element is broadcast once for every group (24 accumulators), where a group at a
 * time broadcast it once per group. Each score is still two 32-term chains (dims 0-31, then 32-63) added
 * at the end, in the order the loop of one group at a time summed them: the same bits. */
static inline __attribute__((always_inline)) void scores_f32_groups(const float *const *qg, const float *kb,
                                                                     __m512 *sb, const int NG) {
    for (int half = 0; half < 16; half += 8)
        for (int d0 = 0; d0 < 64; d0 += 32) {
            __m512 a[3][8];
            for (int g = 0; g < NG; g++)
                for (int r = 0; r < 8; r++) a[g][r] = _mm512_setzero_ps();
            for (int d = d0; d < d0 + 32; d++) {
                __m512 qv[3];
                for (int g = 0; g < NG; g++) qv[g] = _mm512_load_ps(qg[g] + d * 16);
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    const __m512 k = _mm512_set1_ps(kb[(half + r) * 64 + d]);
                    for (int g = 0; g < NG; g++) a[g][r] = _mm512_fmadd_ps(qv[g], k, a[g][r]);
                }
            }
            for (int g = 0; g < NG; g++)
                for (int r = 0; r < 8; r++)
                    sb[g * 16 + half + r] = d0 == 0 ? a[g][r] : _mm512_add_ps(sb[g * 16 + half + r], a[g][r]);
        }
}

/* fp32 on the lanes layout: the same loop as `prefill_item_bf16` with fp32 FMAs (64 a key for the scores,
 * 16 a dim for P.V), rows read as fp32 where they lie or decoded by `kv_row` as the keys-in-lanes loop
 * decodes them. Scratch: qt and acc_t >= 3 x 64 x 16 floats, kbuf 17 x 64 floats (16 rows and zeros),
 * vbuf 16 x 64 floats, all 64-byte aligned.
 * With `compute` bf16 it is the bf16 prefill on CPUs whose fp32 FMAs outrun VDPBF16PS (`kvf_set_bf16_fma`,
 * the panel kernel's measured choice; the Intel Xeons seen here): queries widened from bf16, rows decoded
 * to bf16 values as `prefill_item_bf16` takes them, so every product is the same exact product; the sums
 * stay fp32 and the probabilities are not rounded to bf16 before P.V (closer to the exact result). */
static void prefill_item_f32(const prefill_item *it, const char *q, const kvf_kv *K, const kvf_kv *V,
                             const int64_t *table, int64_t row0, int64_t start, char *out, int64_t H, int64_t BS,
                             int64_t window, float scale, float softcap, int64_t G, float *qt, float *acc_t,
                             float *kbuf, float *vbuf, int compute) {
    const int64_t nv = (it->t1 - it->t0) * G, ngroups = (nv + 15) / 16;
    const int q8_k = q8_reads(K, compute), q8_v = q8_reads(V, compute); /* 8-bit rows: vector decode */
    float *zero_row = kbuf + 16 * 64;
    memset(zero_row, 0, 64 * sizeof(float));
    int32_t pos[48] __attribute__((aligned(64)));
    lanes_queries(it, q, row0, start, H, G, compute == KVF_F32 ? 64 : -1, (int32_t *)qt, pos); /* 64 floats a vector */
    memset(acc_t, 0, sizeof(float) * ngroups * 1024);
    __m512 mrun[3], lrun[3];
    int32_t gmin[3], gmax[3];
    for (int64_t grp = 0; grp < ngroups; grp++) {
        mrun[grp] = _mm512_set1_ps(-INFINITY);
        lrun[grp] = _mm512_setzero_ps();
        gmin[grp] = pos[grp * 16];
        gmax[grp] = pos[grp * 16 + 15 < nv - 1 ? grp * 16 + 15 : nv - 1];
    }
    const int64_t p_first = start + it->t0, p_last = start + it->t1 - 1;
    const int64_t kmin = window > 0 && p_first - window + 1 > 0 ? p_first - window + 1 : 0;
    for (int64_t kb = kmin; kb <= p_last; kb += 16) {
        const int cnt = p_last - kb + 1 < 16 ? (int)(p_last - kb + 1) : 16;
        const float *kd[16], *vd[16];
        for (int r = 0; r < 16; r++) {
            if (r >= cnt) {
                kd[r] = vd[r] = zero_row;
                continue;
            }
            const int64_t key = kb + r, slot = table[key / BS] * BS + key % BS;
            kd[r] = q8_k ? q8_row_f32(K, slot, it->kv_head, compute, kbuf + r * 64)
                         : kv_row(kbuf + r * 64, K, slot, it->kv_head, 64, BS, compute);
            vd[r] = q8_v ? q8_row_f32(V, slot, it->kv_head, compute, vbuf + r * 64)
                         : kv_row(vbuf + r * 64, V, slot, it->kv_head, 64, BS, compute);
        }
        /* rows read in place (and the zero rows past cnt) are copied next to the decoded ones: kbuf and vbuf
         * then hold the block's 16 rows contiguously, which the loops below index with constants */
        for (int r = 0; r < 16; r++) {
            if (kd[r] != kbuf + r * 64) memcpy(kbuf + r * 64, kd[r], 64 * sizeof(float));
            if (vd[r] != vbuf + r * 64) memcpy(vbuf + r * 64, vd[r], 64 * sizeof(float));
        }
        /* the groups this block reaches: their scores all at once (`scores_f32_groups`) */
        int act[3], nact = 0;
        for (int64_t grp = 0; grp < ngroups; grp++) {
            if (kb > gmax[grp]) continue;                                  /* all keys after every lane */
            if (window > 0 && kb + cnt - 1 <= gmin[grp] - window) continue; /* all before every window */
            act[nact++] = (int)grp;
        }
        __m512 sb[48];
        const float *qgs[3] = {NULL, NULL, NULL};
        for (int a = 0; a < nact; a++) qgs[a] = qt + act[a] * 1024;
        switch (nact) { /* the group count as a constant: the accumulators stay in registers */
        case 3: scores_f32_groups(qgs, kbuf, sb, 3); break;
        case 2: scores_f32_groups(qgs, kbuf, sb, 2); break;
        case 1: scores_f32_groups(qgs, kbuf, sb, 1); break;
        default: break;
        }
        for (int a = 0; a < nact; a++) {
            const int64_t grp = act[a];
            /* each score as two 32-term chains added at the end (one 64-term chain lost ~1.5x in accuracy) */
            __m512 s[16];
            for (int r = 0; r < 16; r++) s[r] = sb[a * 16 + r];
            const __m512 corr = lanes_softmax(s, _mm512_load_si512(pos + grp * 16), kb, window, scale, softcap,
                                              &mrun[grp], &lrun[grp]);
            float *ag = acc_t + grp * 1024;
            /* all 16 rows, masked ones too (probability 0 times a zero row adds +0), so the loop has no
             * run-time bound; four dims at a time, four independent FMA chains instead of one */
            for (int d = 0; d < 64; d += 4) {
                __m512 a[4];
                for (int u = 0; u < 4; u++) a[u] = _mm512_mul_ps(_mm512_load_ps(ag + (d + u) * 16), corr);
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++)
                    for (int u = 0; u < 4; u++) a[u] = _mm512_fmadd_ps(s[r], _mm512_set1_ps(vbuf[r * 64 + d + u]), a[u]);
                for (int u = 0; u < 4; u++) _mm512_store_ps(ag + (d + u) * 16, a[u]);
            }
        }
    }
    lanes_store(it, out, row0, H, G, acc_t, lrun, compute, 0, 0);
}
#endif /* KVF_HAVE_AVX512 */

#define KVF_PREFILL_TILE_VECTORS 48 /* query vectors (tokens x heads of a group) per work item */

/* bf16 prefill on fp32 FMAs (`prefill_item_f32` with bf16 compute) instead of VDPBF16PS: set from Python
 * to the bf16 panel kernel's measured choice (KVFORGE_BF16_GEMM), off until then. */
static int bf16_fma = 0;
void kvf_set_bf16_fma(int on) { bf16_fma = on != 0; }

/* The lanes layout (`prefill_item_f32`, `prefill_item_bf16` on AVX512-BF16), on by default; off, every item
 * takes the keys-in-lanes loop (`prefill_item_run`) that bf16 runs on AVX-512 CPUs without AVX512-BF16.
 * Why a setter: the tests run that loop on every AVX-512 CPU (cpu_kernel.set_prefill_lanes). */
static int prefill_lanes = 1;
void kvf_set_prefill_lanes(int on) { prefill_lanes = on != 0; }

/* bf16 prefill on AMX tiles (`prefill_item_amx`): asked for by the bf16 panel kernel's choice (AMX GEMM
 * tiles), taken only where this build has the AMX path and Linux grants the tile state. Returns whether on. */
static int bf16_amx = 0;
int kvf_set_bf16_amx(int on) {
#if KVF_PREFILL_AMX
    bf16_amx = on != 0 && kvf_amx_permitted();
#else
    (void)on;
    bf16_amx = 0;
#endif
    return bf16_amx;
}

int kvf_paged_prefill_supported(int64_t H, int64_t HKV, int64_t D, int64_t DV, int dtype_code) {
#ifdef KVF_HAVE_AVX512
    return D == 64 && DV == 64 && HKV > 0 && H % HKV == 0 && KVF_HAS_G(H / HKV) && (dtype_code == 0 || dtype_code == 1);
#else
    (void)H, (void)HKV, (void)D, (void)DV, (void)dtype_code;
    return 0;
#endif
}

int kvf_paged_prefill(
    const void *q, const kvf_kv *K, const kvf_kv *V, const int64_t *tables, int64_t MAXNB,
    const int64_t *row0, const int64_t *qlen, const int64_t *start, int64_t C, void *out,
    int64_t H, int64_t HKV, int64_t BS, int64_t window, float scale, float softcap, int dtype_code) {
    if (!kvf_paged_prefill_supported(H, HKV, 64, 64, dtype_code)) return -2;
#ifdef KVF_HAVE_AVX512
    const int64_t G = H / HKV;
    const int64_t tile = KVF_PREFILL_TILE_VECTORS / G > 0 ? KVF_PREFILL_TILE_VECTORS / G : 1;
    int64_t n_items = 0;
    for (int64_t c = 0; c < C; c++) n_items += HKV * ((qlen[c] + tile - 1) / tile);
    prefill_item *items = malloc(sizeof(prefill_item) * (n_items > 0 ? n_items : 1));
    if (!items) return -1;
    int64_t n = 0;
    for (int64_t c = 0; c < C; c++)
        for (int64_t t0 = 0; t0 < qlen[c]; t0 += tile)
            for (int64_t j = 0; j < HKV; j++) {
                const int64_t t1 = t0 + tile < qlen[c] ? t0 + tile : qlen[c];
                const int64_t keys = start[c] + t1; /* what the tile's last token sees */
                items[n++] = (prefill_item){c, t0, t1, j, (t1 - t0) * (window > 0 && keys > window ? window : keys)};
            }
    /* Costliest first: dynamic scheduling then ends with the small tiles, and threads finish together. */
    qsort(items, (size_t)n_items, sizeof(prefill_item), by_cost_desc);
    int failed = 0;
    const int lanes = prefill_lanes; /* read once per call: every item of a call takes the same loop */
    (void)lanes;
#pragma omp parallel
    {
        KVF_FTZ_BEGIN(); /* as in the decode kernel */
        /* sized for both layouts: the lanes one needs 3 groups of 16 vectors (48 >= tile * G) */
        float *qf = aligned_alloc(64, sizeof(float) * 48 * 64);
        float *acc = aligned_alloc(64, sizeof(float) * 48 * 64);
        float *mrun = malloc(sizeof(float) * tile * G), *lrun = malloc(sizeof(float) * tile * G);
        __m512 *kt = aligned_alloc(64, sizeof(__m512) * 68); /* lanes layouts: 17 rows (16 + zeros) */
        float *vf = aligned_alloc(64, sizeof(float) * 16 * 64);
        const int ok = qf && acc && mrun && lrun && kt && vf;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; i++) {
            if (!ok) continue;
            const prefill_item *it = items + i;
            const int64_t c = it->chunk;
#if KVF_PREFILL_AMX
            if (lanes && dtype_code == 1 && bf16_amx) {
                prefill_item_amx(it, (const char *)q, K, V, tables + c * MAXNB, row0[c], start[c], (char *)out, H, BS,
                                 window, scale, softcap, G, (int32_t *)qf, acc, (uint16_t *)kt, (int32_t *)vf);
                continue;
            }
#endif
            if (lanes && (dtype_code == 0 || (dtype_code == 1 && bf16_fma))) {
                prefill_item_f32(it, (const char *)q, K, V, tables + c * MAXNB, row0[c], start[c], (char *)out, H, BS,
                                 window, scale, softcap, G, qf, acc, (float *)kt, vf, dtype_code == 0 ? KVF_F32 : KVF_BF16);
                continue;
            }
#if defined(__AVX512BF16__)
            if (lanes && dtype_code == 1) {
                prefill_item_bf16(it, (const char *)q, K, V, tables + c * MAXNB, row0[c], start[c], (char *)out, H, BS,
                                  window, scale, softcap, G, (int32_t *)qf, acc, (uint16_t *)kt, (int32_t *)vf);
                continue;
            }
#endif
#define KVF_PREFILL(GC)                                                                                        \
    prefill_item_run(it, (const char *)q, K, V, tables + c * MAXNB, row0[c], \
                     start[c], (char *)out, H, BS, window, scale, softcap, dtype_code, qf, acc, mrun, lrun, kt, vf, GC)
            KVF_DISPATCH_G(G, KVF_PREFILL)
#undef KVF_PREFILL
        }
        free(qf);
        free(acc);
        free(mrun);
        free(lrun);
        free(kt);
        free(vf);
        KVF_FTZ_END();
    }
    free(items);
    return failed ? -1 : 0;
#else
    return -2;
#endif
}
