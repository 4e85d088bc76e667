// The cores' float32 FMA rate: what no float32 GEMM on this CPU can pass. Each thread runs 12
// independent chains of fused multiply-adds on 16-lane (AVX-512) or 8-lane (AVX2) vectors,
// enough chains to keep both FMA ports busy through the instruction's 4-cycle latency, with
// nothing else in the loop. A probe, not a kernel of keel's: it prints the rate on one thread
// and on every thread OpenMP gives it, best of 5 runs each, alternated. Built with
// -DFMA_PEAK_LIB -shared it is a library instead (`fma_peak_gflops`), which
// benchmarks/gemm_efficiency.py times between keel's GEMMs in one process.
//
// The chains start from values the compiler cannot know (a volatile array): from equal
// constants GCC merged the twelve chains into one, and the probe counted 12 times the FMAs
// it ran.
//
//   gcc -O2 -march=native -fopenmp benchmarks/fma_peak.c -o /tmp/fma_peak
//   OMP_NUM_THREADS=2 /tmp/fma_peak
//   gcc -O2 -march=native -fopenmp -fPIC -shared -DFMA_PEAK_LIB -o /tmp/fma_peak.so
//       benchmarks/fma_peak.c     (one line)
//
// BENCHMARKS.md, fifty-third round: keel's float32 GEMMs against this rate.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>

#ifdef __AVX512F__
typedef __m512 vec;
#define LANES 16
#define SPLAT _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define SUM(v) _mm512_reduce_add_ps(v)
#else
typedef __m256 vec;
#define LANES 8
#define SPLAT _mm256_set1_ps
#define FMA _mm256_fmadd_ps
static float SUM(__m256 v) {
  float f[8];
  _mm256_storeu_ps(f, v);
  return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
}
#endif

#define CHAINS 12

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// GFLOP/s of `threads` threads, each running CHAINS chains for `iters` steps.
static double rate(int threads, long iters, float* sink) {
  volatile float seed[CHAINS] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const double t0 = now();
  float total = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    vec a[CHAINS];
    for (int i = 0; i < CHAINS; ++i) a[i] = SPLAT(seed[i]);
    const vec b = SPLAT(0.999999f), c = SPLAT(1e-7f);
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < CHAINS; ++i) a[i] = FMA(a[i], b, c);
    }
    for (int i = 0; i < CHAINS; ++i) total += SUM(a[i]);
  }
  const double t = now() - t0;
  *sink += total;
  return (double)threads * iters * CHAINS * LANES * 2 / t / 1e9;
}

double fma_peak_gflops(int threads, long iters) {
  float sink = 0.f;
  return rate(threads, iters, &sink);
}

#ifndef FMA_PEAK_LIB

int main(void) {
  const int all = omp_get_max_threads();
  double best1 = 0, best_all = 0;
  float sink = 0.f;
  for (int run = 0; run < 5; ++run) {
    const double r1 = rate(1, 50000000L, &sink), ra = rate(all, 50000000L, &sink);
    if (r1 > best1) best1 = r1;
    if (ra > best_all) best_all = ra;
    printf("run %d: 1 thread %.1f GFLOP/s, %d threads %.1f GFLOP/s\n", run, r1, all, ra);
  }
  printf("float32 FMA peak (%d lanes): 1 thread %.1f GFLOP/s, %d threads %.1f GFLOP/s (best of 5)"
         " (checksum %g)\n", LANES, best1, all, best_all, (double)sink);
  return 0;
}
#endif
