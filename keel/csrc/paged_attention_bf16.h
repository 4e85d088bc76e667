// decode_row_bf16: paged_attention.cpp's row kernel on AVX512-BF16 dot products, and the probe
// that chooses it over the float32 FMAs of decode_row16. Included by paged_attention.cpp only.
#pragma once

#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "paged_attention_common.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define KEEL_BF16_DOT 1
#else
#define KEEL_BF16_DOT 0
#endif

#if KEEL_BF16_DOT
// bfloat16 on a CPU with AVX512-BF16 (`decode_row_bf16`): both products by bfloat16 dot
// products (`vdpbf16ps`: exact products of pairs, summed in float32). The general path
// widens every key and value to float once per query head, 8 at a time: there a bfloat16
// decode step was compute-bound (11 GB/s of K/V read against float32's 18; BENCHMARKS.md,
// seventeenth round), and so was a first form of this one that kept the values in float
// (~13 GB/s from L3 as from memory; twenty-first round).
using bf16 = c10::BFloat16;

inline __m512 loadbh(const bf16* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
inline __m512 dp(__m512 acc, __m512 a, __m512 b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// 16 accumulators, one per key, of 16 partial sums each -> lane i: the sum of a[i]'s lanes.
// In-lane pair sums (vshufps) take 16 vectors to 8 and then 4, where group k of c[m] holds
// lane group k's partial sums of keys 4m..4m+3; two levels over 128-bit groups finish it.
// 45 shuffles and adds for 16 sums, against 80 for two trees over 8.
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xDD));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xDD));
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                  _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                  _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
}

// Scores of 16 keys (rows of D elements, D % 32 == 0: keys 0-7 from k0, 8-15 from k1, which
// may lie in different blocks) against one query head q, unscaled.
inline __m512 scores16_bf16(const bf16* q, const bf16* k0, const bf16* k1, int64_t D) {
  __m512 a[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 32) {
    const __m512 qc = loadbh(q + c);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      a[i] = dp(a[i], qc, loadbh(k0 + i * D + c));
      a[8 + i] = dp(a[8 + i], qc, loadbh(k1 + i * D + c));
    }
  }
  return reduce16(a);
}

// acc[GT query heads][32 * NV dims from d0] += sum over the keys j of p[g][j] * v[j], two
// keys at a time: rows j and j + 1 interleaved by 16-bit lanes (vpunpck{l,h}wd) are the pairs
// that one `vdpbf16ps` with (p[g][j], p[g][j + 1]) broadcast adds in. The accumulators keep
// that interleaved order: of 32 dims at d, the first vector holds dims d + 8k + (0..3) in
// lanes 4k + (0..3), the second dims d + 8k + (4..7) (`unscramble` puts them back). `pp` is
// p in bfloat16, [G][span]; keys j in [lo, hi) are visible, the others weigh 0 and their rows
// (possibly never written) are replaced by `zero`.
template <int GT, int NV>
inline void values_pairs(const uint16_t* pp, int64_t span, const bf16* const* vblk, int64_t bs,
                         int64_t D, int64_t d0, int64_t lo, int64_t hi, const bf16* zero,
                         float* acc, int64_t acc_stride, Prefetcher& pf) {
  __m512 a[GT][2 * NV];
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < 2 * NV; ++c) a[g][c] = _mm512_loadu_ps(acc + g * acc_stride + 16 * c);
  auto pair = [&](const bf16* r0, const bf16* r1, int64_t j) {
    __m512i x[2 * NV];
#pragma GCC unroll 2
    for (int c = 0; c < NV; ++c) {
      const __m512i u = _mm512_loadu_si512(r0 + 32 * c), v = _mm512_loadu_si512(r1 + 32 * c);
      x[2 * c] = _mm512_unpacklo_epi16(u, v);
      x[2 * c + 1] = _mm512_unpackhi_epi16(u, v);
    }
#pragma GCC unroll 4
    for (int g = 0; g < GT; ++g) {
      int32_t w;
      std::memcpy(&w, pp + g * span + j, sizeof(w));
      const __m512 pw = _mm512_castsi512_ps(_mm512_set1_epi32(w));
#pragma GCC unroll 4
      for (int c = 0; c < 2 * NV; ++c) a[g][c] = dp(a[g][c], pw, _mm512_castsi512_ps(x[c]));
    }
  };
  const int64_t lo2 = lo + (lo & 1), hi2 = hi - (hi & 1);  // whole visible pairs [lo2, hi2)
  if (lo & 1) pair(zero, vblk[lo / bs] + (lo % bs) * D + d0, lo - 1);
  for (int64_t bi = lo2 / bs; bi * bs < hi2; ++bi) {
    pf.step();
    const int64_t t0 = std::max<int64_t>(lo2 - bi * bs, 0), t1 = std::min(hi2 - bi * bs, bs);
    const bf16* vb = vblk[bi] + d0;
    for (int64_t t = t0; t < t1; t += 2) pair(vb + t * D, vb + (t + 1) * D, bi * bs + t);
  }
  if (hi & 1) pair(vblk[(hi - 1) / bs] + ((hi - 1) % bs) * D + d0, zero, hi - 1);
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < 2 * NV; ++c) _mm512_storeu_ps(acc + g * acc_stride + 16 * c, a[g][c]);
}

// 32 dims of an accumulator in values_pairs' order, back in order and scaled: out[0..31].
inline void unscramble(const float* acc, float scale, bf16* out) {
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                       30, 31);
  const __m512 lo = _mm512_loadu_ps(acc), hi = _mm512_loadu_ps(acc + 16), s = _mm512_set1_ps(scale);
  const __m512 y0 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, i0, hi), s);
  const __m512 y1 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, i1, hi), s);
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(y1, y0));
}
#endif

#if KEEL_BF16_DOT
// decode_row for bfloat16 on a CPU with AVX512-BF16: the same chunks, online softmax and
// prefetch, with scores 16 keys at a time (scores16_bf16) and values two keys at a time
// (values_pairs). The weights p are rounded to bfloat16 for the value products, as torch's
// CPU flash attention does for a bfloat16 query, and the softmax's sum adds the rounded
// weights, so a row's output is a convex combination of its values. Needs D % 32 == 0 and
// block_size % 8 == 0.
void decode_row_bf16(const bf16* q, const bf16* k_ptr, const bf16* v_ptr, const int32_t* row,
                     int64_t bs, int64_t block_elems, int64_t start, int64_t len, int64_t h0,
                     int64_t h1, int64_t G, int64_t D, float scale, bf16* out, Scratch& w,
                     const NextItem& nx) {
  const int64_t nh = h1 - h0, nq = nh * G, run = bs * D;  // run: one head's keys of a block
  const int64_t cb = std::max<int64_t>(1, kChunkKeys / bs), span = cb * bs;
  // A head's scores and weights: whole 16-key groups (span is 24 with blocks of 24 keys).
  const int64_t ss = (span + 15) / 16 * 16;
  const float ninf = -std::numeric_limits<float>::infinity();
  w.acc.assign(nq * D, 0.f);
  w.m.assign(nq, ninf);
  w.l.assign(nq, 0.f);
  w.s.resize(G * ss);
  w.p.resize(G * ss);
  w.zero.assign(D, bf16(0.f));
  const int64_t b_end = (len + bs - 1) / bs;
  const int64_t nv = D % 64 == 0 ? 2 : 1, tiles = (G + 3) / 4 * (D / (32 * nv));
  const int64_t steps = nh * (G * ss / 16 + tiles * cb);  // pf.step() per chunk
  float* s = w.s.data();
  uint16_t* pp = w.p.data();
  const __m512 ones = _mm512_castsi512_ps(_mm512_set1_epi16(0x3F80));  // bfloat16 1.0
  Prefetcher pf(attention_prefetch_l2());
  pf.bytes = nh * run * static_cast<int64_t>(sizeof(bf16));
  const bf16* kblk[kChunkBlocks];
  const bf16* vblk[kChunkBlocks];
  for (int64_t b = start / bs / cb * cb; b < b_end; b += cb) {  // (as decode_row16's chunks)
    const Chunk ch = chunk_at(b, cb, b_end, bs, start, len);
    const int64_t nb = ch.nb, next = ch.next, lo = ch.lo, hi = ch.hi;
    pf.aim_next(k_ptr, v_ptr, row, b, nb, next, nx, block_elems, run, h0, steps);
    // Keys [lo, hi) of the chunk are visible; scores are computed 16 at a time over [lo16, hi16).
    const int64_t lo16 = lo / 16 * 16, hi16 = (hi + 15) / 16 * 16;
    for (int64_t h = h0; h < h1; ++h) {
      head_runs(k_ptr, v_ptr, row + b, nb, block_elems, h * run, kblk, vblk);
      const int64_t x0 = (h - h0) * G;
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s + g * ss;
        __m512 mv = _mm512_set1_ps(w.m[x0 + g]);
        for (int64_t j = lo16; j < hi16; j += 16) {
          pf.step();
          const bf16* k0 = kblk[j / bs] + (j % bs) * D;
          // Blocks of 8: keys 8-15 of the last group may lie past the row's last block (then
          // masked below); k0's rows stand in for them.
          const bf16* k1 = j + 8 < nb * bs ? kblk[(j + 8) / bs] + ((j + 8) % bs) * D : k0;
          __m512 e = _mm512_mul_ps(scores16_bf16(q + (x0 + g) * D, k0, k1, D),
                                   _mm512_set1_ps(scale));
          // Lanes of keys outside [lo, hi) are -inf (their rows may hold anything).
          const int64_t a = std::clamp<int64_t>(lo - j, 0, 16), z = std::clamp<int64_t>(hi - j, 0, 16);
          const __mmask16 keep = static_cast<__mmask16>(((1u << z) - 1) & ~((1u << a) - 1));
          e = _mm512_mask_mov_ps(_mm512_set1_ps(ninf), keep, e);
          _mm512_storeu_ps(sg + j, e);
          mv = _mm512_max_ps(mv, e);
        }
        // Online softmax: the running maximum m, sum l, and the accumulator rescaled when
        // the maximum grows.
        const float mx = _mm512_reduce_max_ps(mv);
        const float alpha = advance_max(w.m[x0 + g], mx);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = lo16; j < hi16; j += 16) {
          const __m512 pf32 = weights16(_mm512_loadu_ps(sg + j), mx);
          const __m256bh pb = _mm512_cvtneps_pbh(pf32);
          std::memcpy(pp + g * ss + j, &pb, sizeof(pb));
          // The rounded weights, summed: pairs of (p, 1.0) products.
          sum = dp(sum, _mm512_castsi512_ps(_mm512_zextsi256_si512((__m256i)pb)), ones);
        }
        w.l[x0 + g] = w.l[x0 + g] * alpha + _mm512_reduce_add_ps(sum);
        rescale16(w.acc.data() + (x0 + g) * D, D, alpha);
      }
      float* a = w.acc.data() + x0 * D;
      for (int64_t g = 0; g < G; g += 4)  // up to 4 query heads, 32 or 64 dims at a time
        for (int64_t d = 0; d < D; d += 32 * nv) {
          const uint16_t* pg = pp + g * ss;
          float* ag = a + g * D + d;
          with_tile(std::min<int64_t>(G - g, 4), nv, [&](auto gt, auto nv2) {
            values_pairs<gt, nv2>(pg, ss, vblk, bs, D, d, lo, hi, w.zero.data(), ag, D, pf);
          });
        }
    }
  }
  for (int64_t x = 0; x < nq; ++x)
    for (int64_t d = 0; d < D; d += 32)
      unscramble(w.acc.data() + x * D + d, 1.f / w.l[x], out + x * D + d);
}
#endif

#if KEEL_BF16_DOT
// Products per nanosecond of `vdpbf16ps` (32 an instruction) or of float32 FMAs (16), on 12
// independent accumulators: the best of 5 short runs.
template <bool Dot>
double products_per_ns() {
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    __m512 a[12];
    // Normal numbers throughout: denormal products took the FMAs 6x longer (microcode).
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(static_cast<float>(i));
    const __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(1e-3f);
    constexpr int kIters = 512;
    const auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < kIters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = Dot ? dp(a[i], x, y) : _mm512_fmadd_ps(x, y, a[i]);
      __asm__ volatile("" : "+v"(a[0]), "+v"(a[6]));
    }
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    __m512 sum = a[0];
    for (int i = 1; i < 12; ++i) sum = _mm512_add_ps(sum, a[i]);
    volatile float sink = _mm512_reduce_add_ps(sum);
    (void)sink;
    best = std::max(best, (Dot ? 32.0 : 16.0) * 12 * kIters / std::max(ns, 1.0));
  }
  return best;
}

// Whether a bfloat16 decode row takes decode_row_bf16 (bfloat16 dot products) rather than
// decode_row16 (float32 FMAs), where both are built. Measured once: on the Intel Xeon of the
// thirty-fourth round `vdpbf16ps` issued one every other cycle against two FMAs a cycle, half
// the products per cycle, and decode_row16 took 0.77x decode_row_bf16's time with the cache
// in L2 (level from memory). A CPU whose dot products give more products than its FMAs keeps
// decode_row_bf16. KEEL_ATTN_BF16_DOT=0|1 forces it (read per call: tests set it); any other
// value, or none, leaves it to the measurement.
bool bf16_dot_chosen() {
  if (const char* e = std::getenv("KEEL_ATTN_BF16_DOT"); e != nullptr && (e[0] == '0' || e[0] == '1') &&
                                                          e[1] == '\0')
    return e[0] == '1';
  static const bool faster = [] {
    products_per_ns<true>();  // warm-up: the clock and the vector units
    products_per_ns<false>();
    return products_per_ns<true>() > 1.1 * products_per_ns<false>();
  }();
  return faster;
}
#endif
}  // namespace
