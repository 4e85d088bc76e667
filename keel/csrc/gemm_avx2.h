// gemm.cpp's AVX2 register tile (8 lanes: 6 rows against one panel of 16 columns), taken
// where the CPU has no AVX-512. Included by gemm.cpp only, inside its translation unit: it
// uses gemm.cpp's kCols, kRows and WriteAhead.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "vec.h"

namespace {

inline void load_cols(const float* w, __m256& b0, __m256& b1) {
  b0 = _mm256_loadu_ps(w);
  b1 = _mm256_loadu_ps(w + 8);
}

inline void load_cols(const uint16_t* w, __m256& b0, __m256& b1) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  b0 = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
  b1 = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// Step k of a tile: the panel's 16 weights of row k times each of the R rows' x[k].
template <int R, typename W>
__attribute__((always_inline)) inline void fma_step(const float* x, int64_t ldx, const W* w,
                                                    int64_t k, __m256* c0, __m256* c1) {
  __m256 b0, b1;
  load_cols(w + k * kCols, b0, b1);
  // Into registers, and kept there: left to itself GCC (-march=znver3) folded the float32
  // loads into the FMAs as memory operands, loading each weight vector again for each row
  // (up to 14 loads per 12 FMAs, which the load ports cannot issue in 6 cycles); held in
  // registers the GEMM ran 1.05-1.08x faster on two Zen 3 cores, 1.10-1.15x on one, with the
  // same bits (BENCHMARKS.md, twelfth round; benchmarks/gemm_ab.py).
  keel::pin(b0, b1);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
    c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
    c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
  }
}

// One register tile: R rows of x against one panel, over all of K, stored to `out` (row
// stride `ldo`, 16 columns). `pf` .. `pf_end` are lines of the next panel to prefetch, one
// every 8 steps of k. The accumulators must live in registers only: when GCC gave the
// arrays a home on the stack (a bias or partial-panel store in here, or the zeroing loop
// turned into a memset), it stored all 12 of them on every trip of the k loop, 25-30% slower
// on a Zen 3. Hence nothing but the loop in here, every loop over rows unrolled, and the
// tile inlined into its caller's loop (as a function of its own, GCC spilled one again).
template <int R, typename W>
__attribute__((always_inline)) inline void tile(const float* x, int64_t ldx, const W* w,
                                                int64_t k_len, float* out, int64_t ldo,
                                                const char* pf, const char* pf_end) {
  __m256 c0[R], c1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= k_len; k += 8) {
    if (pf < pf_end) {
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
    }
#pragma GCC unroll 8
    for (int64_t kk = k; kk < k + 8; ++kk) fma_step<R>(x, ldx, w, kk, c0, c1);
  }
  for (; k < k_len; ++k) fma_step<R>(x, ldx, w, k, c0, c1);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * ldo, c0[r]);
    _mm256_storeu_ps(out + r * ldo + 8, c1[r]);
  }
}

template <typename W>
__attribute__((always_inline)) inline void tile_rows(int rows, const float* x, int64_t ldx,
                                                     const W* w, int64_t k_len, float* out,
                                                     int64_t ldo, const char* pf,
                                                     const char* pf_end) {
  switch (rows) {
    case 6: tile<6>(x, ldx, w, k_len, out, ldo, pf, pf_end); break;
    case 5: tile<5>(x, ldx, w, k_len, out, ldo, pf, pf_end); break;
    case 4: tile<4>(x, ldx, w, k_len, out, ldo, pf, pf_end); break;
    case 3: tile<3>(x, ldx, w, k_len, out, ldo, pf, pf_end); break;
    case 2: tile<2>(x, ldx, w, k_len, out, ldo, pf, pf_end); break;
    default: tile<1>(x, ldx, w, k_len, out, ldo, pf, pf_end); break;
  }
}

// The AVX2 tile as run_gemm takes it (one panel an item).
template <typename W>
struct Avx2Tile {
  static constexpr int kRows = ::kRows;
  static constexpr int kPanels = 1;
  __attribute__((always_inline)) void operator()(int, int rows, const float* x, int64_t ldx,
                                                 const W* w, int64_t k_len, float* out,
                                                 int64_t ldo, const char* pf,
                                                 const char* pf_end, WriteAhead = {}) const {
    tile_rows<W>(rows, x, ldx, w, k_len, out, ldo, pf, pf_end);
  }
};

}  // namespace
