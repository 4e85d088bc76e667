// How fast this CPU's AMX tile unit multiplies bfloat16, and what a GEMM's loads and stores
// leave of it: the walk of keel's AMX GEMM (keel/csrc/amx_gemm.cpp) over the default model's
// gate_up shape (K = 576, 96 pairs of 32 columns), each OpenMP thread on buffers of its own,
// the best of 7 runs of 40 passes, in TFLOP/s over all threads (the slowest thread's time).
//
//   gcc -O2 -march=native -fopenmp benchmarks/amx_tile_rate.c -o /tmp/amx_tile_rate
//   OMP_NUM_THREADS=2 /tmp/amx_tile_rate MODE PANEL_ROWS X_HINT OUTPUT
//
// MODE 3: the products alone, one long chain per accumulator (the tile unit's own rate);
//      0: the products alone, in blocks of 32 x 32 that begin (tilezero) and end (tilestored);
//      1: tile loads from 4 KiB that stay in L1;
//      2: the GEMM's walk: for each pair, PANEL_ROWS rows of x against the pair's 18 slices.
//      4: the same walk with three B tiles to an A tile (1 A, 3 B, 3 accumulators: 4 tile
//         loads for 3 products, against 2 for 2 with two A tiles) over 48 columns, K split in
//         halves of 9 slices so that their 27 KiB of B stay in L1; each 16 rows' sums wait in
//         memory between the halves. BENCHMARKS.md, forty-second round.
// X_HINT 1 loads x's tiles with the hint not to keep them in L1 (tileloaddt1), so that the
// pair's 36 KiB stay there; OUTPUT 1 writes each block's 32 rows as bfloat16 into a
// [PANEL_ROWS, 3072] output, as the GEMM does. BENCHMARKS.md, thirty-seventh round.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { K = 576, SLICES = K / 32, PAIRS = 96, N = PAIRS * 32, PASSES = 40 };

typedef struct __attribute__((aligned(64))) {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void configure(void) {
  static __thread TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  __asm__ volatile("" ::: "memory");  // GCC 12 may drop the stores above otherwise
  _tile_loadconfig(&cfg);
}

// One thread's passes (timed from after its buffers are filled); returns the products it
// did, and its time in *seconds.
static double walk(int mode, int rows, int hint, int output, double* seconds) {
  uint16_t* x = aligned_alloc(64, (size_t)rows * K * 2);
  uint16_t* w = aligned_alloc(64, (size_t)PAIRS * SLICES * 2048);
  uint16_t* out = aligned_alloc(64, (size_t)rows * N * 2);
  memset(x, 0, (size_t)rows * K * 2);
  memset(w, 0, (size_t)PAIRS * SLICES * 2048);
  memset(out, 0, (size_t)rows * N * 2);
  float acc[32 * 32] __attribute__((aligned(64)));
  configure();
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  // MODE 4: each 16 rows' three accumulators between the halves of K (outside the timing).
  float* held = aligned_alloc(64, (size_t)rows / 16 * 768 * 4);
  memset(held, 0, (size_t)rows / 16 * 768 * 4);
#pragma omp barrier
  const double t0 = now();
  for (int pass = 0; mode == 4 && pass < PASSES; ++pass)
    for (int j = 0; j < N / 48; ++j)
      for (int half = 0; half < 2; ++half) {
        const uint16_t* wj = w + ((size_t)j * 2 + half) * 9 * 3 * 512;
        for (int r0 = 0; r0 < rows; r0 += 16) {
          const uint16_t* x0 = x + (size_t)r0 * K + half * 9 * 32;
          float* h = held + (size_t)r0 / 16 * 768;
          if (half == 0) {
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
          } else {
            _tile_loadd(4, h, 64);
            _tile_loadd(5, h + 256, 64);
            _tile_loadd(6, h + 512, 64);
          }
          for (int s = 0; s < 9; ++s) {
            const uint16_t* ws = wj + s * 3 * 512;
            if (hint)
              _tile_stream_loadd(0, x0 + s * 32, K * 2);
            else
              _tile_loadd(0, x0 + s * 32, K * 2);
            _tile_loadd(1, ws, 64);
            _tile_dpbf16ps(4, 0, 1);
            _tile_loadd(2, ws + 512, 64);
            _tile_dpbf16ps(5, 0, 2);
            _tile_loadd(3, ws + 1024, 64);
            _tile_dpbf16ps(6, 0, 3);
          }
          if (half == 0) {
            _tile_stored(4, h, 64);
            _tile_stored(5, h + 256, 64);
            _tile_stored(6, h + 512, 64);
            continue;
          }
          _tile_stored(4, acc, 192);
          _tile_stored(5, acc + 16, 192);
          _tile_stored(6, acc + 32, 192);
          for (int r = 0; output && r < 16; ++r)
            for (int c = 0; c < 48; c += 32)  // 48 columns: 32, then 16 (the upper half unused)
              _mm512_mask_storeu_epi16(out + (size_t)(r0 + r) * N + j * 48 + c,
                                       c == 0 ? 0xFFFFFFFFu : 0xFFFFu,
                                       (__m512i)_mm512_cvtne2ps_pbh(
                                           _mm512_loadu_ps(acc + r * 48 + c + 16),
                                           _mm512_loadu_ps(acc + r * 48 + c)));
        }
      }
  for (int pass = 0; mode != 4 && pass < PASSES; ++pass)
    for (int j = 0; j < PAIRS; ++j) {
      const uint16_t* wj = w + (size_t)j * SLICES * 1024;
      for (int r0 = 0; r0 < rows; r0 += 32) {
        const uint16_t* x0 = x + (size_t)r0 * K;
        const uint16_t* x1 = x0 + 16 * K;
        if (mode != 3) {
          _tile_zero(4);
          _tile_zero(5);
          _tile_zero(6);
          _tile_zero(7);
        }
        for (int s = 0; s < SLICES; ++s) {
          if (mode == 1) {
            _tile_loadd(2, w, 64);
            _tile_loadd(3, w + 512, 64);
            _tile_loadd(0, x, 64);
            _tile_loadd(1, x + 512, 64);
          } else if (mode == 2) {
            _tile_loadd(2, wj + s * 1024, 64);
            _tile_loadd(3, wj + s * 1024 + 512, 64);
            if (hint) {
              _tile_stream_loadd(0, x0 + s * 32, K * 2);
              _tile_stream_loadd(1, x1 + s * 32, K * 2);
            } else {
              _tile_loadd(0, x0 + s * 32, K * 2);
              _tile_loadd(1, x1 + s * 32, K * 2);
            }
          }
          _tile_dpbf16ps(4, 0, 2);
          _tile_dpbf16ps(5, 0, 3);
          _tile_dpbf16ps(6, 1, 2);
          _tile_dpbf16ps(7, 1, 3);
        }
        if (mode == 3) continue;
        _tile_stored(4, acc, 128);
        _tile_stored(5, acc + 16, 128);
        _tile_stored(6, acc + 512, 128);
        _tile_stored(7, acc + 528, 128);
        for (int r = 0; output && r < 32; ++r)
          _mm512_storeu_si512(out + (size_t)(r0 + r) * N + j * 32,
                              (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(acc + r * 32 + 16),
                                                           _mm512_load_ps(acc + r * 32)));
      }
    }
  *seconds = now() - t0;
  _tile_release();
  free(x);
  free(w);
  free(out);
  free(held);
  // MODE 4 does as many: N / 48 x rows / 16 x SLICES x 3 = PAIRS x rows / 32 x SLICES x 4.
  return (double)PASSES * PAIRS * (rows / 32) * SLICES * 4;
}

int main(int argc, char** argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: amx_tile_rate MODE(0-4) PANEL_ROWS X_HINT(0|1) OUTPUT(0|1)\n");
    return 2;
  }
  const int mode = atoi(argv[1]), rows = atoi(argv[2]) / 32 * 32, hint = atoi(argv[3]),
            output = atoi(argv[4]);
  if (rows < 32) {
    fprintf(stderr, "PANEL_ROWS: at least 32\n");
    return 2;
  }
  // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): the kernel's permission for the tiles.
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    fprintf(stderr, "no AMX tiles on this CPU or kernel\n");
    return 1;
  }
  double best = 0;
  for (int rep = 0; rep < 7; ++rep) {
    double products = 0, slowest = 0;
#pragma omp parallel reduction(+ : products) reduction(max : slowest)
    {
      double seconds = 0;
      products += walk(mode, rows, hint, output, &seconds);
      slowest = seconds;
    }
    const double rate = products * 16 * 16 * 32 * 2 / slowest / 1e12;
    if (rate > best) best = rate;
  }
  printf("mode %d, panel %d rows, x hint %d, output %d, %d threads: %.2f TFLOP/s\n", mode, rows,
         hint, output, omp_get_max_threads(), best);
  return 0;
}
