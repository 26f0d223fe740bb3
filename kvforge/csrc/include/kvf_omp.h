/* The prologue every threaded kvforge kernel shares: OpenMP, vector math, the FTZ/DAZ guard.
 *
 * - OpenMP: the kernels are built with -fopenmp and link the libgomp.so.1 torch already loaded, so they
 *   share torch's threads.
 * - Vector exp/tanh: `omp simd` loops may call glibc's libmvec versions without -ffast-math (a shared
 *   object built with -ffast-math would switch the whole process to flush-to-zero on load).
 * - KVF_TEAM(tid, nth): this thread's number and its team's size inside an `omp parallel` region (0 and 1
 *   in a build without OpenMP), as int64_t for the kernels' index arithmetic.
 * - KVF_FTZ_BEGIN / KVF_FTZ_END: flush denormals to zero in this thread for a kernel's duration, and put
 *   the mode back after. Why: peaky attention makes many probabilities underflow to denormals, and
 *   arithmetic on them takes slow microcode assists (they are below 1e-38). Use them as a pair in one
 *   block (inside each `omp parallel` region: the mode is per thread).
 */
#ifndef KVF_OMP_H
#define KVF_OMP_H

#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#define KVF_TEAM(tid, nth) const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads()
#else
#define KVF_TEAM(tid, nth) const int64_t tid = 0, nth = 1
#endif

float expf(float) __attribute__((simd("notinbranch")));
float tanhf(float) __attribute__((simd("notinbranch")));

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define KVF_HAVE_MXCSR 1
#define KVF_FTZ_BEGIN() const unsigned int kvf_saved_csr_ = _mm_getcsr(); _mm_setcsr(kvf_saved_csr_ | 0x8040)
#define KVF_FTZ_END() _mm_setcsr(kvf_saved_csr_)
#else
#define KVF_FTZ_BEGIN() ((void)0)
#define KVF_FTZ_END() ((void)0)
#endif

#endif
