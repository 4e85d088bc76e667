// How fast this machine reads memory in runs of a given length taken in random order: the
// pattern of a paged K/V cache, whose blocks a decode step reads one run at a time. A plain C
// loop on OpenMP threads, no arithmetic but the sum; the best of 5 passes over 1.75 GB.
//
//   gcc -O3 -march=native -fopenmp benchmarks/read_runs.c -o /tmp/read_runs
//   OMP_NUM_THREADS=2 /tmp/read_runs ORDER RUN_KIB PREFETCH_AHEAD
//
// ORDER 0 reads the runs in address order, 1 in a random order; PREFETCH_AHEAD n > 0
// prefetches (into L2) the run n places ahead, two lines per two lines read, 0 none.
// BENCHMARKS.md, thirty-first round: 4 KiB runs read at half the sequential rate on a 2-core
// AMD EPYC Zen 3, with or without the prefetch.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: read_runs ORDER(0|1) RUN_KIB PREFETCH_AHEAD\n");
    return 2;
  }
  const int random_order = atoi(argv[1]);
  const size_t run = (size_t)atol(argv[2]) << 10;
  const int ahead = atoi(argv[3]);
  const size_t bytes = (size_t)1792 << 20, nruns = bytes / run, lines = run / 64;
  if (run < 128 || run % 128) {
    fprintf(stderr, "read_runs: RUN_KIB must be at least 1\n");
    return 2;
  }
  char* buf = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (buf == MAP_FAILED) return 1;
  memset(buf, 1, bytes);
  size_t* order = malloc(nruns * sizeof(size_t));
  for (size_t i = 0; i < nruns; i++) order[i] = i;
  if (random_order) {
    srand(1);
    for (size_t i = nruns - 1; i > 0; i--) {
      const size_t j = (size_t)rand() % (i + 1), t = order[i];
      order[i] = order[j], order[j] = t;
    }
  }
  double best = 1e30;
  float total = 0;
  for (int rep = 0; rep < 5; rep++) {
    const double t0 = now();
#pragma omp parallel reduction(+ : total)
    {
      const size_t th = omp_get_thread_num(), nt = omp_get_num_threads();
      const size_t lo = nruns * th / nt, hi = nruns * (th + 1) / nt;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (size_t r = lo; r < hi; r++) {
        const char* p = buf + order[r] * run;
        const char* pf = ahead > 0 && r + ahead < hi ? buf + order[r + ahead] * run : NULL;
        for (size_t l = 0; l < lines; l += 2) {
          if (pf) {
            _mm_prefetch(pf + l * 64, _MM_HINT_T1);
            _mm_prefetch(pf + l * 64 + 64, _MM_HINT_T1);
          }
          const float* f = (const float*)(p + l * 64);
          a0 = _mm256_add_ps(a0, _mm256_loadu_ps(f));
          a1 = _mm256_add_ps(a1, _mm256_loadu_ps(f + 8));
          a2 = _mm256_add_ps(a2, _mm256_loadu_ps(f + 16));
          a3 = _mm256_add_ps(a3, _mm256_loadu_ps(f + 24));
        }
      }
      float o[8];
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
      for (int i = 0; i < 8; i++) total += o[i];
    }
    const double dt = now() - t0;
    if (dt < best) best = dt;
  }
  printf("%s order, runs of %zu KiB, prefetch %d ahead: %.1f GB/s (sum %g)\n",
         random_order ? "random" : "address", run >> 10, ahead, bytes / best / 1e9, total);
  return 0;
}
