/* Paged decode attention for CPUs: one query per sequence, K/V read in place from the block pool.
 *
 * Why a kernel: the torch path gathers every decode row's blocks into a contiguous workspace
 * before attending, so each KV byte is read, written and read again. Here each sequence (or,
 * for small batches, each of its KV heads) walks its block table once, scores the G query heads
 * of each group against each key row (GQA by head index, K/V never repeated), and accumulates V
 * weighted by the softmax. 16-bit rows are widened to fp32 once per row; scores and the softmax
 * run in fp32 whatever the storage dtype.
 *
 * Head size 64 with at most 8 query heads per KV head (SmolLM2, Llama 3, Mistral, Qwen2) takes an
 * AVX-512 path where the compiler targets it: blocks of 16 rows, the per-row dot products reduced
 * 16 at a time by a transpose tree, V accumulators held in registers, and bf16 scores by
 * VDPBF16PS (bf16 pairs multiplied exactly, summed in fp32), bf16 V rows two at a time by
 * VDPBF16PS on probabilities rounded to bf16 (as the reference rounds them), and rows prefetched
 * into L2 a few blocks ahead. Per layer out of DRAM (32 sequences, ~400 tokens): bf16 0.95 -> 0.67
 * ms, fp32 1.2 -> 1.0 ms against the scalar loop (`benchmarks/attention_backends.py` times them).
 *
 * Compressed caches are read in place too (`kvf_kv` below): fp8 e4m3/e5m2, int8 and packed int4
 * codes with their scales (per tensor, token, token x head, or block x head x channel), and 16-bit
 * or fp32 rows of another dtype than the compute dtype. Each row is decoded into fp32 registers
 * (code * scale in fp32, then rounded to the compute dtype when that is 16-bit, exactly as
 * `kvforge.kv.quant.dequantize(...).to(dtype)` does), so greedy output is the reference's; no copy of
 * the cache is made. At head size 64 such operands take the AVX2 path below (the AVX-512 paths read
 * dense rows), which is also what CPUs without AVX-512 run for 16-bit rows; other shapes, and fp32
 * rows with fp32 compute on those CPUs, take the portable loops.
 * K and V may alias one tensor with different widths: the MLA latent cache (K = [c_kv, k_rope],
 * V = c_kv) is one operand pair over one pool.
 *
 * Layouts (all contiguous):
 *   q        [B, H, D]              compute dtype
 *   k        [NB, BS, HKV, D]       any `kvf_kv` storage; rows of k->row_bytes bytes
 *   v        [NB, BS, HKV, DV]
 *   tables   [B, MAXNB] int64
 *   seq_lens [B] int64 (context length including the new token, >= 1)
 *   out      [B, H, DV]
 * dtype codes: 0 float32, 1 bfloat16, 2 float16.
 */
#include "paged_common.h"

/* One row decoded the kernels' way, for tests of every code of every format (same FTZ/DAZ mode). */
int kvf_dequant_row(const kvf_kv *op, int64_t slot, int64_t h, int64_t n, int64_t BS, int compute, float *out) {
    KVF_FTZ_BEGIN();
    const float *r = kv_row(out, op, slot, h, (int)n, BS, compute);
    if (r != out) memcpy(out, r, sizeof(float) * (size_t)n);
    KVF_FTZ_END();
    return 0;
}

/* Insertion sort of sequence indices by decreasing length: B is a batch size, and the usual input
 * is small. */
static void sort_by_length_desc(int64_t *order, const int64_t *lens, int64_t B) {
    for (int64_t i = 1; i < B; i++) {
        const int64_t x = order[i];
        int64_t j = i - 1;
        while (j >= 0 && lens[order[j]] < lens[x]) {
            order[j + 1] = order[j];
            j--;
        }
        order[j + 1] = x;
    }
}

/* True when op holds plain rows of the compute dtype in the dense [NB, BS, HKV, dim] layout. */
static int dense_rows(const kvf_kv *op, int code, int64_t HKV, int64_t dim) {
    const int64_t esz = code == 0 ? 4 : 2;
    return op->code == code && op->gran == KVF_SCALE_NONE && op->head_bytes == dim * esz && op->row_bytes == HKV * dim * esz;
}

/* The 8-bit kernels (and bf16 V rows) live in paged_decode_q8.c and the AVX2 path in paged_decode_avx2.c,
 * units of their own that compile beside this one; their headers declare them. */
#include "paged_decode_avx2.h"
#include "paged_decode_q8.h"

/* zcode is a constant in each branch of KVF_DISPATCH_Q8 / _FP8, so these choices fold away */
#define KVF_BY_CODE(PREFIX, SUFFIX) \
    (zcode == KVF_INT8 ? PREFIX##int8##SUFFIX : zcode == KVF_E4M3 ? PREFIX##e4m3##SUFFIX : PREFIX##e5m2##SUFFIX)
#define KVF_BY_FP8(PREFIX, SUFFIX) (zcode == KVF_E4M3 ? PREFIX##e4m3##SUFFIX : PREFIX##e5m2##SUFFIX)

int kvf_paged_decode(
    const void *q, const kvf_kv *K, const kvf_kv *V, const int64_t *tables, const int64_t *seq_lens,
    void *out, int64_t B, int64_t H, int64_t HKV, int64_t D, int64_t DV, int64_t BS, int64_t MAXNB,
    int64_t window, float scale, float softcap, int dtype_code) {
    const int64_t G = H / HKV;
    const size_t esz = dtype_code == 0 ? 4 : 2;
    const void *k_cache = K->data, *v_cache = V->data;
    const size_t k_row = (size_t)K->row_bytes, v_row = (size_t)V->row_bytes; /* one token, all KV heads */
    /* The AVX-512 paths read dense rows of the compute dtype; compressed rows take the portable loops. */
    const int dense = dense_rows(K, dtype_code, HKV, D) && dense_rows(V, dtype_code, HKV, DV);
    (void)dense;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    /* Work items are sequences, so each token's K/V row (all KV heads) is read whole and in order:
     * a block is one contiguous run the prefetchers can follow. With fewer sequences than threads
     * to keep busy, items split a sequence's KV heads instead. */
    const int64_t splits = B >= 2 * omp_get_max_threads() ? 1 : HKV;
    const int64_t heads_per_item = HKV / splits;
    /* Longest contexts first: with dynamic scheduling the threads then finish together. */
    int64_t *order = malloc(sizeof(int64_t) * (B > 0 ? B : 1));
    if (!order) return -1;
    for (int64_t b = 0; b < B; b++) order[b] = b;
    sort_by_length_desc(order, seq_lens, B);
    int failed = 0;

#pragma omp parallel
    {
        KVF_FTZ_BEGIN(); /* denormals flushed in this thread (kvf_omp.h says why) */
        const int64_t n_max = max_len > 0 ? max_len : 1;
        float *qf = malloc(sizeof(float) * heads_per_item * G * D);
        float *scores = malloc(sizeof(float) * heads_per_item * G * n_max);
        float *acc = malloc(sizeof(float) * heads_per_item * G * DV);
        float *row = malloc(sizeof(float) * (D > DV ? D : DV));
        int64_t *slots = malloc(sizeof(int64_t) * n_max);
        uint16_t *pb16 = malloc(sizeof(uint16_t) * heads_per_item * G * (n_max + 2));
        /* the AVX2 path's decoded rows (16 per head of the item) and their owed factors */
        float *vbuf = malloc(sizeof(float) * heads_per_item * 16 * 64), *vf = malloc(sizeof(float) * heads_per_item * 16);
        float *fac = malloc(sizeof(float) * heads_per_item * n_max); /* 8-bit V: each row's factor, per KV head */
        int16_t *qi16 = malloc(sizeof(int16_t) * heads_per_item * G * 64); /* int8 K under bf16: int16 queries */
        uint16_t *qlut = malloc(sizeof(uint16_t) * heads_per_item * G * 64); /* fp8 K under bf16: permuted queries */
        float *qscale = malloc(sizeof(float) * heads_per_item * G);
        float *vscale = malloc(sizeof(float) * heads_per_item * G); /* int8 V under bf16: int16 probability steps */
        int32_t *acci = malloc(sizeof(int32_t) * heads_per_item * G * 64);
        float *pinv = malloc(sizeof(float) * heads_per_item * G); /* 1 / each head's softmax sum */
        const int ok = qf && scores && acc && row && slots && pb16 && vbuf && vf && fac && qi16 && qlut && qscale && vscale && acci && pinv;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* Every thread reaches the worksharing loop, even one whose scratch failed. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * splits; item++) {
            if (!ok) continue;
            const int64_t b = order[item / splits], kv0 = (item % splits) * heads_per_item;
            const int64_t NH = heads_per_item * G; /* query heads this item serves, from head kv0 * G */
            const int64_t len = seq_lens[b];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            const int64_t n = len - start;
            const int64_t *table = tables + b * MAXNB;
            for (int64_t h = 0; h < NH; h++)
                load_row(qf + h * D, (const char *)q + ((b * H + kv0 * G + h) * D) * esz, (int)D, dtype_code);

            /* The context's slots, walked block by block once (no per-token division). */
            for (int64_t t = start, blk = start / BS; t < len; blk++)
                for (int64_t off = t - blk * BS; off < BS && t < len; off++, t++) slots[t - start] = table[blk] * BS + off;

            /* Head size 64 with up to 8 query heads per KV head, fp32 or bf16: the AVX-512 path. */
#ifdef KVF_HAVE_AVX512
            const int fast = dense && D == 64 && DV == 64 && KVF_HAS_G(G) && dtype_code != 2;
            /* 8-bit rows with one scale per row: the AVX-512 8-bit path, K and V each on its own */
            const int zk = !fast && D == 64 && DV == 64 && KVF_HAS_G(G) && q8_reads(K, dtype_code);
            const int zv = !fast && D == 64 && DV == 64 && KVF_HAS_G(G) && q8_reads(V, dtype_code);
#else
            const int fast = 0, zk = 0, zv = 0;
#endif
            /* What AVX-512 does not take (everything without it; compressed operands with it), AVX2
             * does at head size 64, K and V each as its storage allows. */
#ifdef KVF_HAVE_AVX2
            const int avx2 = !fast && D == 64 && DV == 64 && KVF_HAS_G(G);
            const int fast_k = avx2 && !zk && avx2_reads(K, dtype_code), fast_v = avx2 && !zv && avx2_reads(V, dtype_code);
#else
            const int fast_k = 0, fast_v = 0;
#endif
            /* fp32 rows of several KV heads: walked whole, row by row (`scores_rows_f32`) */
            const int rows_f32 = fast && KVF_ROW_MAJOR_F32 && dtype_code == 0 && heads_per_item > 1 && heads_per_item * G <= 16;
            if (rows_f32) {
#ifdef KVF_HAVE_AVX512
                __m512 part[KVF_ROW_STREAMS * 16 * 16];
                const size_t off0 = (size_t)kv0 * D * esz;
                for (int64_t i = 0; i < n && i < 16 * KVF_ROW_STREAMS; i++)
                    prefetch_run_starts((const char *)k_cache, slots, i, k_row, off0, (size_t)heads_per_item * 256);
                for (int64_t i0 = 0; i0 < n; i0 += 16 * KVF_ROW_STREAMS) {
#define KVF_SCORES(GC) scores_rows_f32(qf, (const char *)k_cache, slots, i0, n, k_row, off0, heads_per_item, scores, part, GC)
                    KVF_DISPATCH_G(G, KVF_SCORES)
#undef KVF_SCORES
                }
#endif
            } else if (fast) {
#ifdef KVF_HAVE_AVX512
                /* Block by block: a block's rows (all the item's KV heads) are fetched from memory
                 * once and reused from L1 by each head, while the rows KVF_PREFETCH_ROWS ahead are
                 * prefetched (the first ones now, and V's first ones before the softmax). */
                prefetch_rows((const char *)k_cache, slots, 0, n < KVF_PREFETCH_ROWS ? n : KVF_PREFETCH_ROWS, k_row);
                for (int64_t i0 = 0; i0 < n; i0 += 16) {
                    const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                    for (int64_t j = 0; j < heads_per_item; j++) {
                        const char *qp = (const char *)q + ((b * H + (kv0 + j) * G) * D) * esz;
                        const size_t off = (size_t)(kv0 + j) * D * esz;
#define KVF_SCORES(GC) scores_d64(qp, (const char *)k_cache, slots, i0, cnt, n, k_row, off, dtype_code, scores + (j * G) * n, (const char *)v_cache, v_row, GC)
                        KVF_DISPATCH_G(G, KVF_SCORES)
#undef KVF_SCORES
                    }
                }
#endif
            } else if (zk) {
#ifdef KVF_HAVE_AVX512
                /* int8 keys under bf16 compute: VPDPWSSD against the item's queries scaled to int16 once */
                int i8_k = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
                i8_k = dtype_code == 1 && K->code == KVF_INT8;
                if (i8_k) quantize_query_i16(qf, NH, qi16, qscale);
#endif
                (void)i8_k;
                /* fp8 keys under bf16 compute: table lookups against the item's queries permuted once */
                int lut_k = 0;
#if defined(KVF_HAVE_FP8_LUT)
                lut_k = dtype_code == 1 && (K->code == KVF_E4M3 || K->code == KVF_E5M2);
                if (lut_k) lut_queries((const uint16_t *)q + (b * H + kv0 * G) * 64, NH, qlut);
#endif
                (void)lut_k;
                prefetch_rows(K->data, slots, 0, n < KVF_PREFETCH_ROWS ? n : KVF_PREFETCH_ROWS, k_row);
                for (int64_t i0 = 0; i0 < n; i0 += 16) {
                    const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                    for (int64_t j = 0; j < heads_per_item; j++) {
                        const char *qp = (const char *)q + ((b * H + (kv0 + j) * G) * D) * esz;
                        const int16_t *qij = qi16 + j * G * 64;
                        const float *qsj = qscale + j * G;
                        (void)qp, (void)qij, (void)qsj; /* each build uses the ones its paths take */
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
                        if (i8_k) {
#define KVF_SCORES(GC) scores_q8_int8_i16(NULL, NULL, qij, qsj, K, slots, i0, cnt, n, kv0 + j, scores + (j * G) * n, GC)
                            KVF_DISPATCH_G(G, KVF_SCORES)
#undef KVF_SCORES
                            continue;
                        }
#endif
#if defined(KVF_HAVE_FP8_LUT)
                        if (lut_k) {
#define KVF_SCORES(GC) KVF_BY_FP8(scores_q8_, _lut)(NULL, (const char *)(qlut + j * G * 64), NULL, NULL, K, slots, i0, cnt, n, kv0 + j, scores + (j * G) * n, GC)
                            KVF_DISPATCH_FP8(K->code, KVF_SCORES)
#undef KVF_SCORES
                            continue;
                        }
#endif
#if defined(__AVX512BF16__)
                        if (dtype_code == 1) {
#define KVF_SCORES(GC) KVF_BY_CODE(scores_q8_, _bf16)(NULL, qp, NULL, NULL, K, slots, i0, cnt, n, kv0 + j, scores + (j * G) * n, GC)
                            KVF_DISPATCH_Q8(K->code, KVF_SCORES)
#undef KVF_SCORES
                            continue;
                        }
#endif
#define KVF_SCORES(GC) KVF_BY_CODE(scores_q8_, _f32)(qf + j * G * 64, NULL, NULL, NULL, K, slots, i0, cnt, n, kv0 + j, scores + (j * G) * n, GC)
                        KVF_DISPATCH_Q8(K->code, KVF_SCORES)
#undef KVF_SCORES
                    }
                }
#endif
            } else if (fast_k) {
#ifdef KVF_HAVE_AVX2
                kvf_scores_avx2(K, slots, n, kv0, heads_per_item, BS, dtype_code, qf, vbuf, vf, scores, (int)G);
#endif
            } else {
                /* Pass 1: scores; each key row is read once for all query heads of its group. */
                for (int64_t i = 0; i < n; i++) {
                    if (i + BS < n) /* the next block lies elsewhere in the pool: start fetching it now */
                        for (size_t off = 0; off < k_row; off += 64)
                            __builtin_prefetch((const char *)k_cache + slots[i + BS] * k_row + off, 0, 2);
                    for (int64_t j = 0; j < heads_per_item; j++) {
                        float *st = scores + (j * G) * n + i;
                        if (D == 64) /* the common head size, as a constant: fully unrolled vector code */
                            score_row(qf + j * G * D, kv_row(row, K, slots[i], kv0 + j, 64, BS, dtype_code), G, 64, st, n);
                        else
                            score_row(qf + j * G * D, kv_row(row, K, slots[i], kv0 + j, (int)D, BS, dtype_code), G,
                                      (int)D, st, n);
                    }
                }
            }
            if (fast && !rows_f32) { /* the V rows the score pass did not fetch yet: its last KVF_V_PREFETCH_LAG */
                const int64_t v0 = n > KVF_V_PREFETCH_LAG ? n - KVF_V_PREFETCH_LAG : 0;
                prefetch_rows((const char *)v_cache, slots, v0, n - v0, v_row);
            }
#ifdef KVF_HAVE_AVX2
            if (fast_v) prefetch_rows((const char *)v_cache, slots, 0, n < KVF_AVX2_PREFETCH_ROWS ? n : KVF_AVX2_PREFETCH_ROWS, v_row);
#endif
            /* Softmax per head in fp32 (vectorised exp); scale and soft-cap applied here, in the pass that
             * finds the maximum. The AVX-512 V passes read each probability once (to round it, or to
             * broadcast it), so they multiply by 1 / sum there: the same product, one pass over the scores
             * fewer. The other paths get normalised probabilities here. */
            const int fold_norm = fast || zv;
            for (int64_t h = 0; h < NH; h++) {
                float *sg = scores + h * n;
                float m = -INFINITY;
                if (softcap > 0.f) {
                    const float inv_cap = scale / softcap;
#pragma omp simd reduction(max : m)
                    for (int64_t i = 0; i < n; i++) {
                        sg[i] = tanhf(sg[i] * inv_cap) * softcap;
                        m = sg[i] > m ? sg[i] : m;
                    }
                } else {
#pragma omp simd reduction(max : m)
                    for (int64_t i = 0; i < n; i++) {
                        sg[i] *= scale;
                        m = sg[i] > m ? sg[i] : m;
                    }
                }
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t i = 0; i < n; i++) {
                    sg[i] = expf(sg[i] - m);
                    sum += sg[i];
                }
                pinv[h] = 1.f / sum;
                if (!fold_norm) {
                    const float inv = pinv[h];
#pragma omp simd
                    for (int64_t i = 0; i < n; i++) sg[i] *= inv;
                }
            }
            if (rows_f32) {
#ifdef KVF_HAVE_AVX512
#define KVF_VALUES(GC) values_rows_f32(scores, pinv, (const char *)v_cache, slots, n, v_row, (size_t)kv0 * DV * esz, heads_per_item, acc, GC)
                KVF_DISPATCH_G(G, KVF_VALUES)
#undef KVF_VALUES
#endif
            } else if (fast) {
#ifdef KVF_HAVE_AVX512
                memset(acc, 0, sizeof(float) * NH * DV);
#if defined(__AVX512BF16__)
                const int bf16_pairs = dtype_code == 1;
                const int64_t npad = n + 2 - (n & 1); /* even, with room for the zero after row n - 1 */
                if (bf16_pairs)
                    for (int64_t h = 0; h < NH; h++) probs_to_bf16(scores + h * n, pinv[h], NULL, pb16 + h * npad, n);
#endif
                for (int64_t i0 = 0; i0 < n; i0 += 16) {
                    const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                    for (int64_t j = 0; j < heads_per_item; j++) {
                        const size_t off = (size_t)(kv0 + j) * DV * esz;
#if defined(__AVX512BF16__)
                        if (bf16_pairs) {
#define KVF_VALUES(GC) values_bf16_rows(pb16 + (j * G) * npad, (const char *)v_cache, slots, i0, cnt, n, npad, v_row, off, acc + (j * G) * DV, GC, NULL)
                            KVF_DISPATCH_G(G, KVF_VALUES)
#undef KVF_VALUES
                            continue;
                        }
#endif
#define KVF_VALUES(GC) values_d64(scores + (j * G) * n, pinv + j * G, (const char *)v_cache, slots, i0, cnt, n, v_row, off, dtype_code, acc + (j * G) * DV, GC)
                        KVF_DISPATCH_G(G, KVF_VALUES)
#undef KVF_VALUES
                    }
                }
#if defined(__AVX512BF16__)
                if (bf16_pairs)
                    for (int64_t h = 0; h < NH; h++) unpermute_d64(acc + h * DV);
#endif
#endif
            } else if (zv) {
#ifdef KVF_HAVE_AVX512
                memset(acc, 0, sizeof(float) * NH * DV);
                prefetch_rows(V->data, slots, 0, n < KVF_PREFETCH_ROWS ? n : KVF_PREFETCH_ROWS, v_row);
                for (int64_t j = 0; j < heads_per_item; j++) q8_factors(V, slots, n, kv0 + j, fac + j * n);
#if defined(__AVX512BF16__)
#if defined(__AVX512VNNI__)
                if (dtype_code == 1 && V->code == KVF_INT8) {
                    const int64_t npad = n + 2 - (n & 1);
                    int16_t *pi = (int16_t *)pb16;
                    for (int64_t j = 0; j < heads_per_item; j++) {
                        probs_q8_to_i16(scores + (j * G) * n, pinv + j * G, fac + j * n, n, (int)G, pi + (j * G) * npad, npad, vscale + j * G);
                    }
                    memset(acci, 0, sizeof(int32_t) * NH * DV);
                    for (int64_t i0 = 0; i0 < n; i0 += 16) {
                        const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                        for (int64_t j = 0; j < heads_per_item; j++) {
kvf_values_i8_vnni(pi + (j * G) * npad, V, slots, i0, cnt, n, npad, kv0 + j, acci + (j * G) * DV, (int)G);
                        }
                        if ((i0 + 16) % VNNI_FLUSH_ROWS == 0 || i0 + 16 >= n) flush_i32(acc, acci, vscale, NH);
                    }
                    for (int64_t h = 0; h < NH; h++) unpermute_d64(acc + h * DV);
                } else
#endif
                if (dtype_code == 1) {
                    const int64_t npad = n + 2 - (n & 1);
                    /* fp8 rows by table where the CPU has VBMI, their factors on the probabilities */
                    int lut = 0;
#if defined(KVF_HAVE_FP8_LUT)
                    lut = V->code == KVF_E4M3 || V->code == KVF_E5M2;
#endif
                    for (int64_t h = 0; h < NH; h++)
                        probs_to_bf16(scores + h * n, pinv[h], lut ? fac + (h / G) * n : NULL, pb16 + h * npad, n);
                    for (int64_t i0 = 0; i0 < n; i0 += 16) {
                        const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                        for (int64_t j = 0; j < heads_per_item; j++) {
#define KVF_VALUES(FN, GC) FN(pb16 + (j * G) * npad, V->data, slots, i0, cnt, n, npad, (size_t)V->row_bytes, (size_t)((kv0 + j) * V->head_bytes), acc + (j * G) * DV, GC, fac + j * n)
#define KVF_VALUES_LUT(GC) KVF_VALUES(KVF_BY_FP8(values_bf16_, _lut), GC)
#define KVF_VALUES_DEQUANT(GC) KVF_VALUES(KVF_BY_CODE(values_bf16_, ), GC)
                            if (lut) {
                                KVF_DISPATCH_FP8(V->code, KVF_VALUES_LUT)
                            } else {
                                KVF_DISPATCH_Q8(V->code, KVF_VALUES_DEQUANT)
                            }
#undef KVF_VALUES_DEQUANT
#undef KVF_VALUES_LUT
#undef KVF_VALUES
                        }
                    }
                    for (int64_t h = 0; h < NH; h++) (lut ? unpermute_lut_d64 : unpermute_d64)(acc + h * DV);
                } else
#endif
                for (int64_t i0 = 0; i0 < n; i0 += 16) {
                    const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
                    for (int64_t j = 0; j < heads_per_item; j++) {
#define KVF_VALUES(GC) KVF_BY_CODE(values_q8_, )(scores + (j * G) * n, pinv + j * G, V, slots, i0, cnt, n, kv0 + j, fac + j * n, acc + (j * G) * DV, GC)
                        KVF_DISPATCH_Q8(V->code, KVF_VALUES)
#undef KVF_VALUES
                    }
                }
#endif
            } else if (fast_v) {
#ifdef KVF_HAVE_AVX2
                memset(acc, 0, sizeof(float) * NH * DV);
                kvf_values_avx2(V, slots, n, kv0, heads_per_item, BS, dtype_code, scores, vbuf, vf, acc, (int)G);
#endif
            } else {
                /* Pass 2: weighted sum of V; each value row is read once for all query heads of its group. */
                memset(acc, 0, sizeof(float) * NH * DV);
                for (int64_t i = 0; i < n; i++) {
                    if (i + BS < n)
                        for (size_t off = 0; off < v_row; off += 64)
                            __builtin_prefetch((const char *)v_cache + slots[i + BS] * v_row + off, 0, 2);
                    for (int64_t j = 0; j < heads_per_item; j++) {
                        const float *pt = scores + (j * G) * n + i;
                        float *aj = acc + (j * G) * DV;
                        if (DV == 64)
                            accumulate_row(aj, kv_row(row, V, slots[i], kv0 + j, 64, BS, dtype_code), G, 64, pt, n);
                        else
                            accumulate_row(aj, kv_row(row, V, slots[i], kv0 + j, (int)DV, BS, dtype_code), G, (int)DV,
                                           pt, n);
                    }
                }
            }
            for (int64_t h = 0; h < NH; h++)
                store_row((char *)out + ((b * H + kv0 * G + h) * DV) * esz, acc + h * DV, (int)DV, dtype_code);
        }
        free(qf);
        free(scores);
        free(acc);
        free(row);
        free(slots);
        free(pb16);
        free(vbuf);
        free(vf);
        free(fac);
        free(qi16);
        free(qlut);
        free(qscale);
        free(vscale);
        free(acci);
        free(pinv);
        KVF_FTZ_END();
    }
    free(order);
    return failed ? -1 : 0;
}

