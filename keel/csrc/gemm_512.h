// gemm.cpp's AVX-512 register tile (16 lanes: up to 10 rows against two panels of 16
// columns), taken where the CPU has AVX-512. Included by gemm.cpp only, inside its
// translation unit: it uses gemm.cpp's kCols and WriteAhead.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "claims.h"
#include "vec.h"

#if defined(__AVX512F__)
namespace {

// -- The AVX-512 kernel (16 lanes), taken where the CPU has it --------------------------------
// The same panels and the same sums (each output accumulated over k in order, one FMA per
// step: the bits of the AVX2 kernel), but a panel row is one 16-lane register, and a register
// tile is up to 10 rows against two panels side by side (20 accumulators of the 32 registers):
// per step of k two weight loads and 10 broadcasts feed 20 FMAs, where the AVX2 tile's 6 rows
// against one panel gave 12. An item of run_gemm is a block of rows against such a pair. On an
// Intel Xeon (AMX host; BENCHMARKS.md, thirty-second round) tiles of up to 8 rows ran as fast,
// up to 12 rows 1.07-1.10x slower at 2,052 rows, and 14 rows (28 accumulators) spilled them to
// the stack, ~3x slower.
constexpr int kRows512 = 10;

inline __m512 load_panel_row(const float* w) { return _mm512_loadu_ps(w); }

inline __m512 load_panel_row(const uint16_t* w) {
  // Word j of the row holds column j (low half) and column j + 8 (high half).
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
  const __m256 hi =
      _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(int(0xFFFF0000u))));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)),
                                             _mm256_castps_pd(hi), 1));
}

// Step k of a tile: row k of each of the P panels times each of the R rows' x[k].
template <int R, int P, typename W>
__attribute__((always_inline)) inline void fma_step512(const float* x, int64_t ldx,
                                                       const W* w0, const W* w1, int64_t k,
                                                       __m512* c0, __m512* c1) {
  __m512 b0 = load_panel_row(w0 + k * kCols);
  __m512 b1 = P > 1 ? load_panel_row(w1 + k * kCols) : b0;
  keel::pin(b0, b1);  // in registers, not folded into each FMA (see fma_step)
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
    c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
    if constexpr (P > 1) c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
  }
}

// One register tile: R rows of x against panels w0 (and w1 when P == 2), over all of K, stored
// to out (row stride ldo; columns 0-15 from w0, 16-31 from w1). `pf` .. `pf_end` are lines of
// the next item's panels to prefetch: a float32 weight's spread over the steps of 4 values of
// k (keel::spread_prefetch), a bfloat16 weight's two lines a step until they are done (spread,
// its GEMMs read 0.94-1.00x). As in `tile`: nothing but the loop in here, so that the
// accumulators live in registers only.
template <int R, int P, typename W>
__attribute__((always_inline)) inline void tile512(const float* x, int64_t ldx, const W* w0,
                                                   const W* w1, int64_t k_len, float* out,
                                                   int64_t ldo, const char* pf,
                                                   const char* pf_end, WriteAhead wa) {
  __m512 c0[R], c1[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  int64_t k = 0, acc = 0;
  const int64_t steps = k_len / 4, lines = (pf_end - pf + 63) / 64;
  // The R * P output lines (one per row and panel), one every 16 steps of k from the first, so
  // that their reads for ownership are done long before the stores. Spread evenly over all the
  // steps instead, the last ones came too late: qkv and o 1.01-1.03x instead of 1.07-1.10x.
  const int64_t out_lines = wa.p != nullptr ? R * P : 0;
  int64_t out_next = 0;
  for (; k + 4 <= k_len; k += 4) {
    if constexpr (std::is_same_v<W, float>) {
      keel::spread_prefetch(pf, acc, lines, steps);
    } else if (pf < pf_end) {
      _mm_prefetch(pf, _MM_HINT_T1);
      _mm_prefetch(pf + 64, _MM_HINT_T1);
      pf += 128;
    }
    if ((k & 15) == 0 && out_next < out_lines) {
      const int64_t r = out_next / P, q = out_next % P;
      _mm_prefetch(reinterpret_cast<const char*>(wa.p + r * wa.ld + q * kCols), _MM_HINT_ET0);
      ++out_next;
    }
#pragma GCC unroll 4
    for (int64_t kk = k; kk < k + 4; ++kk) fma_step512<R, P>(x, ldx, w0, w1, kk, c0, c1);
  }
  for (; k < k_len; ++k) fma_step512<R, P>(x, ldx, w0, w1, k, c0, c1);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * ldo, c0[r]);
    if constexpr (P > 1) _mm512_storeu_ps(out + r * ldo + kCols, c1[r]);
  }
}

template <int P, typename W>
__attribute__((always_inline)) inline void tile512_rows(int rows, const float* x, int64_t ldx,
                                                        const W* w0, const W* w1,
                                                        int64_t k_len, float* out, int64_t ldo,
                                                        const char* pf, const char* pf_end,
                                                        WriteAhead wa) {
  // Rows past kRows512 never come; without their cases the tiles measured 2-4% slower at
  // 2,052 rows (the same bits: GCC placed or inlined the code differently), so they stay.
  switch (rows) {
    case 14: tile512<14, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
    case 13: tile512<13, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
    case 12: tile512<12, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
    case 11: tile512<11, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
    case 10: tile512<10, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
    case 9: tile512<9, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
    case 8: tile512<8, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
    case 7: tile512<7, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
    case 6: tile512<6, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
    case 5: tile512<5, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
    case 4: tile512<4, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
    case 3: tile512<3, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
    case 2: tile512<2, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
    default: tile512<1, P>(x, ldx, w0, w1, k_len, out, ldo, pf, pf_end, wa); break;
  }
}

// A tile against one panel (the last of an odd count) or two.
template <typename W>
__attribute__((always_inline)) inline void tile512_any(int panels, int rows, const float* x,
                                                       int64_t ldx, const W* w, int64_t k_len,
                                                       float* out, int64_t ldo, const char* pf,
                                                       const char* pf_end, WriteAhead wa) {
  if (panels == 2)
    tile512_rows<2, W>(rows, x, ldx, w, w + k_len * kCols, k_len, out, ldo, pf, pf_end, wa);
  else
    tile512_rows<1, W>(rows, x, ldx, w, w, k_len, out, ldo, pf, pf_end, wa);
}

// The AVX-512 tile as run_gemm takes it (two panels an item).
template <typename W>
struct Avx512Tile {
  static constexpr int kRows = kRows512;
  static constexpr int kPanels = 2;
  __attribute__((always_inline)) void operator()(int panels, int rows, const float* x,
                                                 int64_t ldx, const W* w, int64_t k_len,
                                                 float* out, int64_t ldo, const char* pf,
                                                 const char* pf_end, WriteAhead wa = {}) const {
    tile512_any<W>(panels, rows, x, ldx, w, k_len, out, ldo, pf, pf_end, wa);
  }
};

}  // namespace
#endif  // __AVX512F__
