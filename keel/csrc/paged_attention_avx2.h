// decode_row: paged_attention.cpp's row kernel in 8 float lanes (AVX2, or GCC's generic
// vectors): every cache dtype on a CPU without AVX-512, and a float16 cache on one with it.
// Included by paged_attention.cpp only.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <limits>

#include "paged_attention_common.h"

namespace {

// Lane i of the result: the sum of a[i]'s 8 lanes (a tree of in-lane shuffles, one add per
// level, where a horizontal sum per key cost ~5 shuffles and adds for each score).
inline v8 pairsum(v8 a, v8 b) {  // [a01 a23 b01 b23 | a45 a67 b45 b67]
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}
inline v8 reduce8(const v8* a) {
  const v8 x = pairsum(pairsum(a[0], a[1]), pairsum(a[2], a[3]));
  const v8 y = pairsum(pairsum(a[4], a[5]), pairsum(a[6], a[7]));
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
}

// Scores of 8 consecutive keys (rows of D elements) against one query head q (float, scaled).
template <typename T>
inline v8 scores8(const float* q, const T* k, int64_t D) {
  v8 a[8] = {};
  for (int64_t c = 0; c < D; c += 8) {
    const v8 qc = load8(q + c);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) a[i] += qc * load8(k + i * D + c);
  }
  return reduce8(a);
}
// A bfloat16 cache without bfloat16 dot products (`decode_row` with T = bfloat16, under a float32
// query or a bfloat16 one): each 32-bit word of a loaded row holds an even dim (low half) and
// the next odd one (high half), and a shift and a mask make them two float vectors, with no
// widening load per 8 values. The query is kept split the same way ([8 even | 8 odd] per 16
// dims) and so are the value accumulators, put back in order at the end (`unsplit16`). Where
// every value was widened on load, this path was compute-bound at about float32's key rate
// (half the bytes, no faster: BENCHMARKS.md, twenty-sixth round).
#if defined(__AVX2__)
#define KEEL_SPLIT_BF16 1
inline void load_split(const c10::BFloat16* p, v8& even, v8& odd) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = (v8)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  odd = (v8)_mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// scores8 over bfloat16 keys, the query split: D % 16 == 0.
inline v8 scores8_split(const float* qs, const c10::BFloat16* k, int64_t D) {
  v8 a[8] = {};
  for (int64_t c = 0; c < D; c += 16) {
    const v8 qe = load8(qs + c), qo = load8(qs + c + 8);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      v8 e, o;
      load_split(k + i * D + c, e, o);
      a[i] += qe * e;
      a[i] += qo * o;
    }
  }
  return reduce8(a);
}

// 16 dims in the split order ([8 even | 8 odd]) back in order, times `scale`.
template <typename TQ>
inline void unsplit16(const float* acc, float scale, TQ* out) {
  const __m256 e = _mm256_loadu_ps(acc), o = _mm256_loadu_ps(acc + 8);
  const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
  const v8 s = keel::splat8(scale);
  store8(out, (v8)_mm256_permute2f128_ps(lo, hi, 0x20) * s);
  store8(out + 8, (v8)_mm256_permute2f128_ps(lo, hi, 0x31) * s);
}
#else
#define KEEL_SPLIT_BF16 0
#endif

// acc[GT query heads][32 dims from d0] += sum over the chunk's keys j in [lo, hi) of
// p[g][j] * v[j], the keys' rows found block by block (vblk, bs keys each). `Split`: the
// values are bfloat16, read split (load_split), and acc is in the split order.
template <int GT, bool Split, typename T>
inline void values_tile(const float* p, int64_t p_stride, const T* const* vblk, int64_t bs,
                        int64_t D, int64_t d0, int64_t lo, int64_t hi, float* acc,
                        int64_t acc_stride) {
  v8 a[GT][4];
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = load8(acc + g * acc_stride + c * 8);
  for (int64_t bi = lo / bs; bi * bs < hi; ++bi) {
    const int64_t t0 = std::max<int64_t>(lo - bi * bs, 0), t1 = std::min(hi - bi * bs, bs);
    const T* vb = vblk[bi] + d0;
    const float* pb = p + bi * bs;
    for (int64_t t = t0; t < t1; ++t) {
      const T* vr = vb + t * D;
      v8 v0, v1, v2, v3;
#if KEEL_SPLIT_BF16
      if constexpr (Split) {
        load_split(vr, v0, v1);
        load_split(vr + 16, v2, v3);
      } else
#endif
      {
        v0 = load8(vr), v1 = load8(vr + 8), v2 = load8(vr + 16), v3 = load8(vr + 24);
      }
#pragma GCC unroll 4
      for (int g = 0; g < GT; ++g) {
        const v8 pg = keel::splat8(pb[g * p_stride + t]);
        a[g][0] += pg * v0;
        a[g][1] += pg * v1;
        a[g][2] += pg * v2;
        a[g][3] += pg * v3;
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < 4; ++c) store8(acc + g * acc_stride + c * 8, a[g][c]);
}

// One query row (or the tokens `tk` of one request, sharing every key and value read: a KV
// head's query vectors are its G query heads of each token in turn) against its request's KV
// heads [h0, h1), in one pass over keys [start, len): chunks of chunk_keys<T>() keys (whole
// blocks), each chunk's keys and values of every head read together with an online softmax,
// so K and V stream from memory once and side by side. Needs D % 32 == 0 and
// block_size % 8 == 0.
template <typename TQ, typename T>
void decode_row(const TQ* q, const T* k_ptr, const T* v_ptr, const int32_t* row, int64_t bs,
                int64_t block_elems, int64_t start, int64_t len, int64_t h0, int64_t h1,
                int64_t G, int64_t D, float scale, TQ* out, Scratch& w, const Tokens& tk,
                const float* k_scale = nullptr, const float* v_scale = nullptr) {
  constexpr bool is_i8 = std::is_same_v<T, int8_t>;  // scales: k_scale, v_scale
  const int64_t nt = tk.n, GQ = G * nt;  // query vectors per KV head
  const int64_t nh = h1 - h0, nq = nh * GQ, run = bs * D;  // run: one head's keys of a block
  const int64_t cb = std::max<int64_t>(1, chunk_keys<T>() / bs), span = cb * bs;
  const float ninf = -std::numeric_limits<float>::infinity();
  constexpr bool split = KEEL_SPLIT_BF16 && std::is_same_v<T, c10::BFloat16>;
  w.q.resize(nq * D);
  w.acc.assign(nq * D, 0.f);
  w.m.assign(nq, ninf);
  w.l.assign(nq, 0.f);
  w.s.resize(GQ * span);
  for (int64_t h = 0; h < nh; ++h)  // the query, scaled: [head][token][G, D]
    for (int64_t t = 0; t < nt; ++t) {
      const TQ* qt = q + t * tk.q_stride + h * G * D;
      float* wq = w.q.data() + (h * nt + t) * G * D;
      if constexpr (split) {  // each 16 dims as [8 even | 8 odd]
        for (int64_t x = 0; x < G * D; x += 16)
          for (int i = 0; i < 8; ++i) {
            wq[x + i] = static_cast<float>(qt[x + 2 * i]) * scale;
            wq[x + 8 + i] = static_cast<float>(qt[x + 2 * i + 1]) * scale;
          }
      } else {
        for (int64_t x = 0; x < G * D; x += 8) store8(wq + x, load8(qt + x) * scale);
      }
    }
  const int64_t b_end = (len + bs - 1) / bs;
  const int64_t tiles = (GQ + 1) / 2;
  const int64_t steps = nh * (GQ * span / 8 + tiles * D / 32);  // pf.step() per chunk
  float* s = w.s.data();
  Prefetcher pf(true);
  pf.bytes = nh * run * static_cast<int64_t>(sizeof(T));
  const T* kblk[kChunkBlocks];
  const T* vblk[kChunkBlocks];
  // Chunks start at multiples of cb blocks, wherever the keys start, so that a token's
  // online softmax steps over the same chunks in a group as alone (with a sliding window, a
  // group's first key is its first token's).
  for (int64_t b = start / bs / cb * cb; b < b_end; b += cb) {
    const Chunk ch = chunk_at(b, cb, b_end, bs, start, len);
    const int64_t nb = ch.nb, next = ch.next, lo = ch.lo, hi = ch.hi;
    pf.aim(k_ptr, v_ptr, row, b + nb, next, block_elems, h0 * run, steps);
    if constexpr (is_i8)
      prefetch_scales(k_scale, v_scale, row + b + nb, next, block_elems / D, h0, h1 - h0, bs);
    // Keys [lo, hi) of the chunk are visible; scores are computed 8 at a time over [lo8, hi8).
    const int64_t lo8 = lo / 8 * 8, hi8 = (hi + 7) / 8 * 8;
    for (int64_t h = h0; h < h1; ++h) {
      head_runs(k_ptr, v_ptr, row + b, nb, block_elems, h * run, kblk, vblk);
      const float* ksb[kChunkBlocks];  // an int8 cache's scales of the chunk's blocks
      const float* vsb[kChunkBlocks];
      if constexpr (is_i8) run_scales(k_scale, v_scale, k_ptr, v_ptr, kblk, vblk, nb, D, ksb, vsb);
      const int64_t x0 = (h - h0) * GQ;
      for (int64_t g = 0; g < GQ; ++g) {
        float* sg = s + g * span;
        for (int64_t j = lo8; j < hi8; j += 8) {
          pf.step();
          const float* qg = w.q.data() + (x0 + g) * D;
          const T* kj = kblk[j / bs] + (j % bs) * D;
#if KEEL_SPLIT_BF16
          if constexpr (split) {
            store8(sg + j, scores8_split(qg, kj, D));
            continue;
          }
#endif
          store8(sg + j, scores8(qg, kj, D));
        }
        if constexpr (is_i8) scale_by_block(sg, span, 1, ksb, bs, lo8, hi8);
        const auto [lo_t, hi_t] = token_keys(tk, g / G, b, nb, bs);  // this token's keys
        for (int64_t j = lo8; j < std::min(lo_t, hi8); ++j) sg[j] = ninf;
        for (int64_t j = std::max(hi_t, lo8); j < hi8; ++j) sg[j] = ninf;
        // Online softmax: the running maximum m, sum l, and the accumulator rescaled when
        // the maximum grows.
        v8 mv = keel::splat8(w.m[x0 + g]);
        for (int64_t j = lo8; j < hi8; j += 8) {
          const v8 e = load8(sg + j);
          mv = e > mv ? e : mv;
        }
        float mx = mv[0];
        for (int i = 1; i < 8; ++i) mx = std::max(mx, mv[i]);
        const float alpha = advance_max(w.m[x0 + g], mx);
        v8 sum = {};
        for (int64_t j = lo8; j < hi8; j += 8) {
          const v8 e = load8(sg + j);
          const v8 p = e == ninf ? v8{} : keel::expv(e - mx);
          store8(sg + j, p);
          sum += p;
        }
        w.l[x0 + g] = w.l[x0 + g] * alpha + keel::hsum8(sum);
        // (past the sum; values_tile reads the weights of keys [lo, hi) only)
        if constexpr (is_i8) scale_by_block(sg, span, 1, vsb, bs, lo8, hi8);
        if (alpha != 1.f) {
          float* a = w.acc.data() + (x0 + g) * D;
          for (int64_t d = 0; d < D; d += 8) store8(a + d, load8(a + d) * alpha);
        }
      }
      float* a = w.acc.data() + x0 * D;
      for (int64_t g = 0; g < GQ; g += 2)
        for (int64_t d = 0; d < D; d += 32) {
          pf.step();
          if (g + 1 < GQ)
            values_tile<2, split>(s + g * span, span, vblk, bs, D, d, lo, hi, a + g * D + d, D);
          else
            values_tile<1, split>(s + g * span, span, vblk, bs, D, d, lo, hi, a + g * D + d, D);
        }
    }
  }
  for (int64_t x = 0; x < nq; ++x) {
    const float inv = 1.f / w.l[x];
    TQ* o = out + x % GQ / G * tk.o_stride + (x / GQ * G + x % G) * D;  // token, head
#if KEEL_SPLIT_BF16
    if constexpr (split) {
      for (int64_t d = 0; d < D; d += 16) unsplit16(w.acc.data() + x * D + d, inv, o + d);
      continue;
    }
#endif
    for (int64_t d = 0; d < D; d += 8) store8(o + d, load8(w.acc.data() + x * D + d) * inv);
  }
}
}  // namespace
