/* The CPU's bf16 multiply peak: independent VDPBF16PS chains on registers, no memory traffic.
 *
 * Why: a batch's floor is its linear FLOPs over the rate the multiply can reach. `batch_steps.py` takes
 * that rate from the bf16 panel kernel itself (its best case, 1,024 rows); this is the bound above the
 * kernel: what the instruction retires per second on every thread at once, in this process and this
 * minute (a shared VM's clock and neighbours move it). 12 chains per thread cover the instruction's
 * latency on the CPUs measured here (Zen 4: about one 512-bit VDPBF16PS a cycle a core).
 *
 * Returns GFLOP/s (2 FLOPs per bf16 product, 32 products per instruction), the best of `rounds`, or -1
 * where the compiler does not target AVX512-BF16. */
#include <stdint.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

double kvf_bf16_peak_gflops(int threads, int64_t iters, int rounds) {
    double best = 0.0;
    volatile float sink = 0.f;
    for (int round = 0; round < rounds; round++) {
        const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
        {
            __m512 acc[12];
            for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps((float)i * 1e-9f);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3f813f80);
            for (int64_t it = 0; it < iters; it++)
                for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
            float s = 0.f;
            for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(acc[i]);
#pragma omp atomic
            sink += s;
        }
        const double dt = omp_get_wtime() - t0;
        const double gflops = (double)threads * (double)iters * 12.0 * 32.0 * 2.0 / dt / 1e9;
        if (gflops > best) best = gflops;
    }
    (void)sink;
    return best;
}
#else
double kvf_bf16_peak_gflops(int threads, int64_t iters, int rounds) {
    (void)threads, (void)iters, (void)rounds;
    return -1.0;
}
#endif
