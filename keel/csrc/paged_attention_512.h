// decode_row16: paged_attention.cpp's row kernel in 16 float lanes, on any CPU with AVX-512.
// Included by paged_attention.cpp only.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <limits>

#include "paged_attention_common.h"

namespace {

#if defined(__AVX512F__)
#define KEEL_ATTN512 1
// decode_row in 16 float lanes (`decode_row16`), for a float32 or bfloat16 cache under a float32
// query, or a bfloat16 cache under a bfloat16 query, on any CPU with AVX-512: every product is a
// float32 FMA. A 32-dim piece of a row is two float vectors in "lane order": a float32 piece in
// order, a bfloat16 one as its 16 even dims, then its 16 odd ones (a shift and a mask per 32
// values, no widening load). The query and the value accumulators are kept in the same order.
template <typename T>
inline void piece32(const T* p, __m512& a, __m512& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = _mm512_loadu_ps(p);
    b = _mm512_loadu_ps(p + 16);
  } else if constexpr (std::is_same_v<T, int8_t>) {  // in order, unscaled
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(w)));
    b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(w, 1)));
  } else {
    const __m512i w = _mm512_loadu_si512(p);
    a = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
}

// Lane i < 8 of the result: the sum of a[i]'s 16 lanes (24 shuffles and adds for 8 sums).
inline __m256 reduce8x16(const __m512* a) {
  __m512 b[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // 128-bit group k: pair sums of a[2i]'s and a[2i+1]'s group k
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xDD));
  // Group k of c0 (c1): group k's sums of a[0..3] (a[4..7]).
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_ps(b[0], b[1], 0x88), _mm512_shuffle_ps(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_ps(b[2], b[3], 0x88), _mm512_shuffle_ps(b[2], b[3], 0xDD));
  // [c0 g0+g1, c0 g2+g3, c1 g0+g1, c1 g2+g3], then groups 0 and 1 of y: keys 0-3 and 4-7.
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(x, x, 0x88), _mm512_shuffle_f32x4(x, x, 0xDD));
  return _mm512_castps512_ps256(y);
}

// Scores of 8 consecutive keys (rows of D elements from k, D % 32 == 0) against GT query heads
// (q: GT rows of D floats in lane order, scaled): s[g * s_stride + i]. Each key's row is
// loaded once for the GT heads.
template <int GT, typename T>
inline void scores_tile(const float* q, int64_t D, const T* k, float* s, int64_t s_stride) {
  __m512 a[GT][8];
#pragma GCC unroll 3
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) a[g][i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 32) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      __m512 x0, x1;
      piece32(k + i * D + c, x0, x1);
#pragma GCC unroll 3
      for (int g = 0; g < GT; ++g) {
        a[g][i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + c), x0, a[g][i]);
        a[g][i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + c + 16), x1, a[g][i]);
      }
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < GT; ++g) _mm256_storeu_ps(s + g * s_stride, reduce8x16(a[g]));
}

// acc[GT query heads][32 * NP dims from d0, lane order] += sum over the chunk's keys j in
// [lo, hi) of p[g][j] * v[j], the keys' rows found block by block (vblk, bs keys each).
// Weight of key j for head g: p[g * p_stride + j * KS] (KS = 16: the weights in lanes of
// query vectors, key by key).
template <int GT, int NP, typename T, int KS = 1>
inline void values_tile16(const float* p, int64_t p_stride, const T* const* vblk, int64_t bs,
                          int64_t D, int64_t d0, int64_t lo, int64_t hi, float* acc,
                          int64_t acc_stride) {
  __m512 a[GT][2 * NP];
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < 2 * NP; ++c) a[g][c] = _mm512_loadu_ps(acc + g * acc_stride + 16 * c);
  for (int64_t bi = lo / bs; bi * bs < hi; ++bi) {
    const int64_t t0 = std::max<int64_t>(lo - bi * bs, 0), t1 = std::min(hi - bi * bs, bs);
    const T* vb = vblk[bi] + d0;
    const float* pb = p + bi * bs * KS;
    for (int64_t t = t0; t < t1; ++t) {
      __m512 x[2 * NP];
#pragma GCC unroll 2
      for (int c = 0; c < NP; ++c) piece32(vb + t * D + 32 * c, x[2 * c], x[2 * c + 1]);
#pragma GCC unroll 4
      for (int g = 0; g < GT; ++g) {
        const __m512 pg = _mm512_set1_ps(pb[g * p_stride + t * KS]);
#pragma GCC unroll 4
        for (int c = 0; c < 2 * NP; ++c) a[g][c] = _mm512_fmadd_ps(pg, x[c], a[g][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < 2 * NP; ++c) _mm512_storeu_ps(acc + g * acc_stride + 16 * c, a[g][c]);
}

// -- Lanes of query vectors -------------------------------------------------------------------
// Where an item has many query vectors (a speculative step's tokens, a short prompt's: G query
// heads times the tokens), decode_row16 puts 16 of them in the lanes, key by key, instead of a
// key's dims: the scores need no sums across lanes and the online softmax runs for 16 vectors
// at once (no horizontal maximum or sum per vector and chunk). Each vector's arithmetic is
// kept that of the dims-in-lanes path, so a token's bits do not depend on the path: its score
// is the same 16 chains of FMAs (chain l over dims {c + l, c + 16 + l : c = 0, 32, ...}, the
// lane order of piece32) summed in reduce8x16's tree, and a chunk's sum of weights keeps
// _mm512_reduce_add_ps's tree over the chunk's keys.
// Vectors per group of 16 lanes from which it pays: a speculative step's 5 tokens of 3 query
// heads (15 vectors) took 0.81-0.84x the time of dims in lanes, 4 tokens (12) 0.85x, 3 (9)
// 1.04-1.17x, with K/V in L2 (BENCHMARKS.md, sixtieth round). Vectors past the last full
// enough group keep dims in lanes.
constexpr int64_t kLanesMin = 12;

// The sum over chains l in [L0, L0 + W) of NK keys' scores in reduce8x16's tree (balanced,
// adjacent pairs): chain l is the FMAs over dims c + l and c + 16 + l for c = 0, 32, ... (the
// lane order of piece32). The left half is summed before the right one is begun, so that
// only a path of the tree is live at a time.
template <int L0, int W, int NK>
inline void chain_tree(const float* qt, int64_t D, const float* const* kr, __m512* out) {
  if constexpr (W == 1) {
#pragma GCC unroll 4
    for (int k = 0; k < NK; ++k) out[k] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 32) {
      const __m512 q0 = _mm512_loadu_ps(qt + (c + L0) * 16);
      const __m512 q1 = _mm512_loadu_ps(qt + (c + 16 + L0) * 16);
#pragma GCC unroll 4
      for (int k = 0; k < NK; ++k) {
        out[k] = _mm512_fmadd_ps(q0, _mm512_set1_ps(kr[k][c + L0]), out[k]);
        out[k] = _mm512_fmadd_ps(q1, _mm512_set1_ps(kr[k][c + 16 + L0]), out[k]);
      }
    }
  } else {
    __m512 right[NK];
    chain_tree<L0, W / 2, NK>(qt, D, kr, out);
    chain_tree<L0 + W / 2, W / 2, NK>(qt, D, kr, right);
#pragma GCC unroll 4
    for (int k = 0; k < NK; ++k) out[k] = _mm512_add_ps(out[k], right[k]);
  }
}

// Scores of NK keys (rows kr[i] of D floats in lane order) against 16 query vectors (qt: [D]
// rows of 16 lanes, the vectors' dims in lane order, scaled): sT[i * 16 + x].
template <int NK>
inline void scores_lanes(const float* qt, int64_t D, const float* const* kr, float* sT) {
  __m512 total[NK];
  chain_tree<0, 16, NK>(qt, D, kr, total);
#pragma GCC unroll 4
  for (int k = 0; k < NK; ++k) _mm512_storeu_ps(sT + k * 16, total[k]);
}

// _mm512_reduce_add_ps's tree, lane by lane: out lane x = the tree over a[0..15]'s lane x.
inline __m512 reduce_add_tree(const __m512* a) {
  __m512 t3[8], t6[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) t3[i] = _mm512_add_ps(a[i + 8], a[i]);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) t6[i] = _mm512_add_ps(t3[i + 4], t3[i]);
  return _mm512_add_ps(_mm512_add_ps(t6[0], t6[2]), _mm512_add_ps(t6[1], t6[3]));
}

// One chunk's online softmax for 16 query vectors in lanes: the scores sT[j * 16 + x] of keys
// j in [lo16, hi16) (those outside lane x's keys [lane_lo[x], lane_hi[x]) may be anything) become
// weights, 0 outside; the running maxima m and sums l advance; alpha: each lane's rescale.
inline void softmax_lanes(float* sT, int64_t lo16, int64_t hi16, const int32_t* lane_lo,
                          const int32_t* lane_hi, float* m, float* l, float* alpha) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lo_v = _mm512_loadu_si512(lane_lo), hi_v = _mm512_loadu_si512(lane_hi);
  const __m512 m0 = _mm512_loadu_ps(m);
  __m512 mv = m0;
  for (int64_t j = lo16; j < hi16; ++j) {
    const __m512i jv = _mm512_set1_epi32(static_cast<int32_t>(j));
    const __mmask16 vis = _mm512_cmpge_epi32_mask(jv, lo_v) & _mm512_cmplt_epi32_mask(jv, hi_v);
    const __m512 e = _mm512_mask_mov_ps(ninf, vis, _mm512_loadu_ps(sT + j * 16));
    _mm512_storeu_ps(sT + j * 16, e);
    mv = _mm512_max_ps(mv, e);
  }
  // advance_max lane by lane: 1 where the maximum holds, else exp(m - mx) (the same std::exp).
  _mm512_storeu_ps(m, mv);
  _mm512_storeu_ps(alpha, _mm512_set1_ps(1.f));
  const unsigned grew = _mm512_cmp_ps_mask(mv, m0, _CMP_NEQ_OQ);
  if (grew != 0) {
    float old[16];
    _mm512_storeu_ps(old, m0);
    for (unsigned left = grew; left != 0; left &= left - 1) {
      const int x = __builtin_ctz(left);
      alpha[x] = std::exp(old[x] - m[x]);
    }
  }
  // Weights, and their sum as _mm512_reduce_add_ps sums a 16-key vector of them: chain k
  // over the chunk's keys j = k (mod 16), then the tree over k.
  __m512 sums[16];
#pragma GCC unroll 16
  for (int k = 0; k < 16; ++k) sums[k] = _mm512_setzero_ps();
  for (int64_t j0 = lo16; j0 < hi16; j0 += 16) {
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) {
      const __m512 p = weights16v(_mm512_loadu_ps(sT + (j0 + k) * 16), mv);
      _mm512_storeu_ps(sT + (j0 + k) * 16, p);
      sums[k] = _mm512_add_ps(sums[k], p);
    }
  }
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), _mm512_loadu_ps(alpha),
                                      reduce_add_tree(sums)));
}

// One KV head's chunk in lanes of query vectors: the keys [lo, hi) of the chunk's runs kblk /
// vblk, for head hh (its nlg groups of 16 lanes in w.qt, w.lm, w.ll) and its first nv query
// vectors, from x0 in w.acc.
template <typename T, typename PF>
inline void lanes_chunk(Scratch& w, const T* const* kblk, const T* const* vblk, int64_t bs,
                        int64_t D, int64_t np, int64_t lo, int64_t hi, int64_t lo16, int64_t hi16,
                        int64_t hh, int64_t nlg, int64_t nv, int64_t x0, PF& pf) {
  // The keys' rows as floats in lane order: a float32 cache's in place, a bfloat16 one's
  // converted once for the head's lane groups.
  const float** kr = w.kr.data();
  for (int64_t bi = lo / bs; bi * bs < hi; ++bi)
    for (int64_t j = std::max(lo, bi * bs); j < std::min(hi, (bi + 1) * bs); ++j) {
      const T* k = kblk[bi] + (j - bi * bs) * D;
      if constexpr (std::is_same_v<T, float>) {
        kr[j] = k;
      } else {
        float* f = w.kf.data() + j * D;
        for (int64_t c = 0; c < D; c += 32) {
          __m512 a, b;
          piece32(k + c, a, b);
          _mm512_storeu_ps(f + c, a);
          _mm512_storeu_ps(f + c + 16, b);
        }
        kr[j] = f;
      }
    }
  float* sT = w.s.data();
  for (int64_t lg = 0; lg < nlg; ++lg) {
    const float* qt = w.qt.data() + (hh * nlg + lg) * D * 16;
    int64_t j = lo;
    for (; j + 4 <= hi; j += 4) {
      pf.step();  // twice per 4 keys: the next chunk's lines in smaller bursts
      pf.step();
      scores_lanes<4>(qt, D, kr + j, sT + j * 16);
    }
    switch (hi - j) {
      case 3: scores_lanes<3>(qt, D, kr + j, sT + j * 16); break;
      case 2: scores_lanes<2>(qt, D, kr + j, sT + j * 16); break;
      case 1: scores_lanes<1>(qt, D, kr + j, sT + j * 16); break;
      default: break;
    }
    float* m = w.lm.data() + (hh * nlg + lg) * 16;
    float* l = w.ll.data() + (hh * nlg + lg) * 16;
    float alpha[16];
    softmax_lanes(sT, lo16, hi16, w.lane_lo.data() + lg * 16, w.lane_hi.data() + lg * 16, m, l,
                  alpha);
    const int64_t xb = lg * 16, n = std::min<int64_t>(16, nv - xb);
    float* a = w.acc.data() + (x0 + xb) * D;
    for (int64_t x = 0; x < n; ++x) rescale16(a + x * D, D, alpha[x]);
    for (int64_t g = 0; g < n; g += 4)
      for (int64_t d = 0; d < D; d += 32 * np) {
        pf.step();
        with_tile(std::min<int64_t>(n - g, 4), np, [&](auto gt, auto np2) {
          values_tile16<gt, np2, T, 16>(sT + g, 1, vblk, bs, D, d, lo, hi, a + g * D + d, D);
        });
      }
  }
}

// decode_row's chunks, online softmax and prefetch (the next item's first chunk too, as in
// decode_row_bf16), in 16 lanes: scores 8 keys by up to 3 query vectors at a time, values up
// to 4 vectors by 64 dims. The tokens `tk` (one, or several of one request) share every key
// and value read: a KV head's query vectors are its G query heads of each token in turn, keys
// [start, len) their union. Where they fill groups of 16 lanes (kLanesMin), those groups take
// lanes_chunk instead, key by key. Needs D % 32 == 0 and block_size % 8 == 0.
template <typename TQ, typename T>
void decode_row16(const TQ* q, const T* k_ptr, const T* v_ptr, const int32_t* row, int64_t bs,
                  int64_t block_elems, int64_t start, int64_t len, int64_t h0, int64_t h1,
                  int64_t G, int64_t D, float scale, TQ* out, Scratch& w, const NextItem& nx,
                  const Tokens& tk, const float* k_scale = nullptr,
                  const float* v_scale = nullptr) {
  constexpr bool is_f32 = std::is_same_v<T, float>;
  constexpr bool is_i8 = std::is_same_v<T, int8_t>;  // scales: k_scale, v_scale
  constexpr bool natural = !std::is_same_v<T, c10::BFloat16>;  // lanes in dim order
  const int64_t nt = tk.n, GQ = G * nt;  // query vectors per KV head
  const int64_t nh = h1 - h0, nq = nh * GQ, run = bs * D;  // run: one head's keys of a block
  const int64_t cb = std::max<int64_t>(1, chunk_keys<T>() / bs), span = cb * bs;
  const int64_t ss = (span + 15) / 16 * 16;  // a head's scores in w.s
  const float ninf = -std::numeric_limits<float>::infinity();
  w.q.resize(nq * D);
  w.acc.assign(nq * D, 0.f);
  w.m.assign(nq, ninf);
  w.l.assign(nq, 0.f);
  w.s.resize(GQ * ss);
  w.mx.resize(GQ);
  w.alpha.resize(GQ);
  for (int64_t h = 0; h < nh; ++h)  // the query in lane order, scaled: [head][token][G, D]
    for (int64_t t = 0; t < nt; ++t) {
      const TQ* qt = q + t * tk.q_stride + h * G * D;
      float* wq = w.q.data() + (h * nt + t) * G * D;
      for (int64_t x = 0; x < G * D; x += 32)
        for (int i = 0; i < 16; ++i) {
          wq[x + i] = static_cast<float>(qt[x + (natural ? i : 2 * i)]) * scale;
          wq[x + 16 + i] = static_cast<float>(qt[x + (natural ? 16 + i : 2 * i + 1)]) * scale;
        }
    }
  const int64_t b_end = (len + bs - 1) / bs;
  const int64_t np = D % 64 == 0 ? 2 : 1;
  // Query vectors [0, xs) of each KV head in lanes (nlg groups of 16), the others [xs, GQ)
  // with dims in lanes. An int8 cache keeps dims in lanes (its scores are scaled by key).
  const int64_t nlg = is_i8 ? 0 : GQ / 16 + (GQ % 16 >= kLanesMin ? 1 : 0);
  const int64_t xs = std::min(GQ, 16 * nlg);
  const bool lanes = nlg > 0;
  if (lanes) {
    w.qt.assign(nh * nlg * D * 16, 0.f);  // [head][lane group][D][16], unused lanes 0
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t x = 0; x < xs; ++x) {
        const float* src = w.q.data() + (h * GQ + x) * D;
        float* dst = w.qt.data() + (h * nlg + x / 16) * D * 16 + x % 16;
        for (int64_t d = 0; d < D; ++d) dst[d * 16] = src[d];
      }
    w.lm.assign(nh * nlg * 16, ninf);
    w.ll.assign(nh * nlg * 16, 0.f);
    w.s.resize(std::max(GQ, int64_t{16}) * ss);
    w.kr.resize(span);
    if constexpr (!is_f32) w.kf.resize(span * D);
    w.lane_lo.resize(nlg * 16);
    w.lane_hi.resize(nlg * 16);
  }
  const int64_t steps = nh * (nlg * ((span + 3) / 4) * 2 + (xs + 3) / 4 * (D / (32 * np)) +
                              (GQ - xs + 2) / 3 * (span / 8) + (GQ - xs + 3) / 4 * (D / (32 * np)));
  float* s = w.s.data();
  Prefetcher pf(is_f32 || attention_prefetch_l2());
  pf.bytes = nh * run * static_cast<int64_t>(sizeof(T));
  const T* kblk[kChunkBlocks];
  const T* vblk[kChunkBlocks];
  // Chunks start at multiples of cb blocks, wherever the keys start, so that a token's
  // online softmax steps over the same chunks in a group as alone (with a sliding window, a
  // group's first key is its first token's).
  for (int64_t b = start / bs / cb * cb; b < b_end; b += cb) {
    const Chunk ch = chunk_at(b, cb, b_end, bs, start, len);
    const int64_t nb = ch.nb, next = ch.next, lo = ch.lo, hi = ch.hi;
    pf.aim_next(k_ptr, v_ptr, row, b, nb, next, nx, block_elems, run, h0, steps);
    if constexpr (is_i8) {  // the next chunk's scales
      if (next == 0 && nx.row != nullptr)
        prefetch_scales(k_scale, v_scale, nx.row + nx.b0, nx.nb, block_elems / D, nx.h0, nh, bs);
      else
        prefetch_scales(k_scale, v_scale, row + b + nb, next, block_elems / D, h0, nh, bs);
    }
    // Keys [lo, hi) of the chunk are visible; scores are computed 8 at a time over [lo8, hi8)
    // and the softmax goes 16 at a time over [lo16, hi16), the other keys' scores -inf.
    const int64_t lo8 = lo / 8 * 8, hi8 = (hi + 7) / 8 * 8;
    const int64_t lo16 = lo / 16 * 16, hi16 = (hi + 15) / 16 * 16;
    if (lanes)  // each lane's keys of the chunk (its vector's token's); none for unused lanes
      for (int64_t x = 0; x < nlg * 16; ++x) {
        const auto [lo_t, hi_t] = x < xs ? token_keys(tk, x / G, b, nb, bs)
                                         : std::pair<int64_t, int64_t>{0, 0};
        w.lane_lo[x] = static_cast<int32_t>(lo_t);
        w.lane_hi[x] = static_cast<int32_t>(hi_t);
      }
    for (int64_t h = h0; h < h1; ++h) {
      head_runs(k_ptr, v_ptr, row + b, nb, block_elems, h * run, kblk, vblk);
      const int64_t x0 = (h - h0) * GQ;
      if constexpr (!is_i8) {
        if (lanes) {
          lanes_chunk<T>(w, kblk, vblk, bs, D, np, lo, hi, lo16, hi16, h - h0, nlg, xs, x0, pf);
          if (xs == GQ) continue;
        }
      }
      for (int64_t g = xs; g < GQ; g += 3) {
        const float* qg = w.q.data() + (x0 + g) * D;
        for (int64_t j = lo8; j < hi8; j += 8) {
          pf.step();
          const T* kj = kblk[j / bs] + (j % bs) * D;  // 8 keys of one block (bs % 8 == 0)
          switch (std::min<int64_t>(GQ - g, 3)) {
            case 3: scores_tile<3>(qg, D, kj, s + g * ss + j, ss); break;
            case 2: scores_tile<2>(qg, D, kj, s + g * ss + j, ss); break;
            default: scores_tile<1>(qg, D, kj, s + g * ss + j, ss);
          }
        }
      }
      // An int8 cache: each key's score times its scale, each value's weight (below) times
      // its own; the keys outside [lo, hi), whose scales may be anything, are -inf.
      const float* ksb[kChunkBlocks];
      const float* vsb[kChunkBlocks];
      if constexpr (is_i8) {
        run_scales(k_scale, v_scale, k_ptr, v_ptr, kblk, vblk, nb, D, ksb, vsb);
        scale_by_block(s, ss, GQ, ksb, bs, lo8, hi8);
      }
      // Online softmax: the running maximum m, sum l, and the accumulator rescaled when the
      // maximum grows. In two passes over the query vectors (each vector's arithmetic as in
      // one), so that one vector's chain of maximum, exponentials and sums does not wait on
      // the previous one's.
      float* mxs = w.mx.data();
      float* alphas = w.alpha.data();
      for (int64_t g = xs; g < GQ; ++g) {
        float* sg = s + g * ss;
        const auto [lo_t, hi_t] = token_keys(tk, g / G, b, nb, bs);  // this token's keys
        for (int64_t j = lo16; j < std::min(lo_t, hi16); ++j) sg[j] = ninf;
        for (int64_t j = std::max(hi_t, lo16); j < hi16; ++j) sg[j] = ninf;
        __m512 mv = _mm512_set1_ps(w.m[x0 + g]);
        for (int64_t j = lo16; j < hi16; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + j));
        mxs[g] = _mm512_reduce_max_ps(mv);
        alphas[g] = advance_max(w.m[x0 + g], mxs[g]);
      }
      for (int64_t g = xs; g < GQ; ++g) {
        float* sg = s + g * ss;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = lo16; j < hi16; j += 16) {
          const __m512 p = weights16(_mm512_loadu_ps(sg + j), mxs[g]);
          _mm512_storeu_ps(sg + j, p);
          sum = _mm512_add_ps(sum, p);
        }
        // (one rounding, as the lanes' _mm512_fmadd_ps in softmax_lanes)
        w.l[x0 + g] = std::fma(w.l[x0 + g], alphas[g], _mm512_reduce_add_ps(sum));
        // (past the sum; values_tile16 reads the weights of keys [lo, hi) only)
        if constexpr (is_i8) scale_by_block(sg, ss, 1, vsb, bs, lo8, hi8);
        rescale16(w.acc.data() + (x0 + g) * D, D, alphas[g]);
      }
      float* a = w.acc.data() + x0 * D;
      for (int64_t g = xs; g < GQ; g += 4)
        for (int64_t d = 0; d < D; d += 32 * np) {
          pf.step();
          const float* pg = s + g * ss;
          float* ag = a + g * D + d;
          with_tile(std::min<int64_t>(GQ - g, 4), np, [&](auto gt, auto np2) {
            values_tile16<gt, np2>(pg, ss, vblk, bs, D, d, lo, hi, ag, D);
          });
        }
    }
  }
  if (lanes)  // the sums by lane, back by vector
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t x = 0; x < xs; ++x) w.l[h * GQ + x] = w.ll[(h * nlg + x / 16) * 16 + x % 16];
  // Back in order (a bfloat16 piece's even and odd dims interleaved) and divided by the sum.
  const __m512i lo_dims = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi_dims = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                            15, 31);
  for (int64_t x = 0; x < nq; ++x) {
    const __m512 inv = _mm512_set1_ps(1.f / w.l[x]);
    TQ* o = out + x % GQ / G * tk.o_stride + (x / GQ * G + x % G) * D;  // token, head
    for (int64_t d = 0; d < D; d += 32) {
      const float* a = w.acc.data() + x * D + d;
      __m512 y0 = _mm512_loadu_ps(a), y1 = _mm512_loadu_ps(a + 16);
      if constexpr (!natural) {
        const __m512 e = y0;
        y0 = _mm512_permutex2var_ps(e, lo_dims, y1);
        y1 = _mm512_permutex2var_ps(e, hi_dims, y1);
      }
      keel::store16(o + d, (v16)_mm512_mul_ps(y0, inv));
      keel::store16(o + d + 16, (v16)_mm512_mul_ps(y1, inv));
    }
  }
}
#else
#define KEEL_ATTN512 0
#endif
}  // namespace
