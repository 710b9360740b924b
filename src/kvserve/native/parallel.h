/* OpenMP where the compiler has it (-fopenmp; native/__init__.py builds without it when the compiler has
 * none, as Apple's clang): then the kernels' parallel regions run once, on the calling thread, and a
 * thread's share of the work is all of it. */
#ifndef KVSERVE_PARALLEL_H
#define KVSERVE_PARALLEL_H
#if defined(_OPENMP)
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif
#endif
