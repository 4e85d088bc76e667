// Can a core hide a memory stream under FMA work? Each thread alternates a block of FMAs (12
// independent chains, ITERS steps: compute-bound, like a GEMM tile) with a sum over a chunk of
// LINES cache lines of a 1 GiB buffer (memory-bound, like decode attention over K/V). Four
// modes, each timed over the whole buffer on every OpenMP thread, alternated, 3 rounds:
//   fma      the FMA blocks alone
//   stream   the sums alone
//   serial   FMA block, then the sum over its chunk from memory
//   fed      the same, but each FMA block prefetches (into L2) the lines of the next chunk,
//            spread over its steps, so the sum reads its chunk from cache
// `fed` at max(fma, stream) means the two overlap in one core; at fma + stream, not at all.
// ORDER 0 takes the chunks' lines in address order, 1 in 4 KiB runs in a random order (a paged
// K/V cache's blocks); LINES is then a multiple of 64. A probe, not a kernel of keel's.
//
//   gcc -O2 -march=native -fopenmp benchmarks/overlap_probe.c -o /tmp/overlap_probe
//   OMP_NUM_THREADS=2 /tmp/overlap_probe ITERS LINES ORDER      (e.g. 400 384 1)
//
// BENCHMARKS.md, fifty-fourth round: why keel does not overlap a decode step's attention with
// its GEMMs although this probe says one core can.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef __AVX512F__
#error "overlap_probe needs AVX-512"
#endif

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

volatile float start[12];  // the chains' first values, unknown to the compiler
static int iters, lines, random_order;
static size_t *page;  // ORDER 1: the 4 KiB runs of a thread's part, shuffled

// Line f of chunk c of a thread's part at base.
static const char *line_at(const char *base, size_t c, size_t f) {
  if (!random_order) return base + (c * lines + f) * 64;
  return base + page[c * (lines / 64) + f / 64] * 4096 + (f % 64) * 64;
}

// ITERS steps of 12 FMAs; with `base`, chunk c's lines prefetched into L2 along the way.
static void fma_block(__m512 *acc, const char *base, size_t c) {
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  const int every = base ? (iters / lines > 0 ? iters / lines : 1) : 0;
  int f = 0;
  for (int i = 0; i < iters; ++i) {
    for (int j = 0; j < 12; ++j) acc[j] = _mm512_fmadd_ps(acc[j], a, b);
    if (base && f < lines && i % every == 0) _mm_prefetch(line_at(base, c, f++), _MM_HINT_T1);
  }
  while (base && f < lines) _mm_prefetch(line_at(base, c, f++), _MM_HINT_T1);
}

static __m512 sum_chunk(const char *base, size_t c) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  for (int f = 0; f + 1 < lines; f += 2) {
    s0 = _mm512_add_ps(s0, _mm512_load_ps(line_at(base, c, f)));
    s1 = _mm512_add_ps(s1, _mm512_load_ps(line_at(base, c, f + 1)));
  }
  return _mm512_add_ps(s0, s1);
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: overlap_probe ITERS LINES ORDER(0|1)\n");
    return 2;
  }
  iters = atoi(argv[1]), lines = atoi(argv[2]), random_order = atoi(argv[3]);
  if (iters < 1 || lines < 2 || (random_order && lines % 64)) {
    fprintf(stderr, "overlap_probe: ITERS >= 1, LINES >= 2 (a multiple of 64 with ORDER 1)\n");
    return 2;
  }
  const int threads = omp_get_max_threads();
  const size_t bytes = (size_t)1 << 30, part = bytes / threads, pages = part / 4096;
  const size_t chunks = part / ((size_t)lines * 64) - 1;  // the last one is only prefetched
  char *buf = aligned_alloc(4096, bytes);
  page = malloc(pages * sizeof(size_t));
  if (!buf || !page) return 1;
  memset(buf, 1, bytes);
  for (size_t i = 0; i < pages; ++i) page[i] = i;
  srand(1);
  for (size_t i = pages - 1; i > 0; --i) {
    const size_t j = (size_t)rand() % (i + 1), t = page[i];
    page[i] = page[j], page[j] = t;
  }
  const char *names[] = {"fma", "stream", "serial", "fed"};
  printf("%d threads, %d FMA steps and %d lines (%s) a chunk\n", threads, iters, lines,
         random_order ? "4 KiB runs, random order" : "address order");
  for (int round = 0; round < 3; ++round) {
    for (int mode = 0; mode < 4; ++mode) {
      float check = 0;
      const double t0 = now();
#pragma omp parallel reduction(+ : check)
      {
        const char *base = buf + omp_get_thread_num() * part;
        __m512 acc[12], s = _mm512_setzero_ps();
        for (int j = 0; j < 12; ++j) acc[j] = _mm512_set1_ps(start[j]);
        for (size_t c = 0; c < chunks; ++c) {
          if (mode != 1) fma_block(acc, mode == 3 ? base : NULL, c + 1);
          if (mode != 0) s = _mm512_add_ps(s, sum_chunk(base, c));
        }
        for (int j = 0; j < 12; ++j) s = _mm512_add_ps(s, acc[j]);
        check += _mm512_reduce_add_ps(s);
      }
      const double dt = now() - t0;
      printf("round %d  %-7s %7.1f ms", round, names[mode], dt * 1e3);
      if (mode) printf("  %5.1f GB/s", (double)chunks * lines * 64 * threads / dt / 1e9);
      printf("  (checksum %.3g)\n", check);
    }
  }
  return 0;
}
