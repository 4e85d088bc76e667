// prefill_attention's causal attention of one long prompt chunk (prefill_attention.cpp: the
// arguments, work items and online softmax are the same) with both of its products on
// AVX512-VNNI's int16 dot products, for dtype="auto" where its GEMMs run on `i16_gemm` (an
// AVX-512 CPU with VNNI and without AMX tiles or AVX512-FP16) or `fp16_gemm`.
//
//   scores   Q K^T: each query vector (times the softmax scale) as int16 scaled to its largest
//            |value| kQ = 11,585, and each key as int16 at the finest step up to kQ at which
//            its |int16| values sum to at most kL1Max = 185,367 (i16_gemm's rule), so that a
//            score's products sum exactly in int32 (kQ x kL1Max < 2^31), then times both
//            scales.
//   values   P V: V as int16 scaled per dimension over each block of kKeys = 64 keys to
//            kV = 32,767; a row's weights p in [0, 1] of the block as int16 steps of 1 / kw,
//            kw = min(32,767, floor((kPSum - 64) / the block's sum of p)), so that the rounded
//            weights sum to at most kPSum = 65,535 and the block's products sum exactly in
//            int32 (kPSum x kV < 2^31); then times the dimension's scale / kw and added to the
//            row's float32 sums. The softmax's sums are the float32 weights' (a rounded
//            weight is within 1 / (2 kw) of its weight either way).
//
// Why: one `vpdpwssd` does 32 products where a float32 FMA does 16. The two products are
// ~80% of the float32 kernel's time (the rest is the online softmax, which stays in float32).
// In the long workload's prompt steps the float32 kernel was 17% of `auto`'s time on an AMD
// EPYC Zen 4 (BENCHMARKS.md, sixty-second round).
//
// Accuracy: queries and keys have ~13.5 bits against the largest |value| of their vector
// (a key of many large values a little fewer: the rule), V 15 bits against the largest |value|
// of its dimension in the block (bfloat16 K and V, as dtype="auto" keeps them in its cache,
// have 8 bits against each value), the weights 15 bits (fewer where many share a block's
// weight: then each counts less). benchmarks/prefill_attention_i16.py measures the kernel on
// the default model's own queries, keys and values against float64. A NaN or an infinity
// in a query or a key makes NaN the outputs of the rows that see it, as float32 arithmetic
// does; in a value, its dimension's outputs over its block of keys.
//
// Layouts, made once per call: K as [Hkv][S / 16][D / 2][16 keys][2] int16 (a 64-byte row
// holds one pair of dimensions of 16 keys; a query's pair is one 32-bit broadcast, and one
// `vpdpwssd` adds both products into each key's lane) with a float32 scale per key; V as
// [Hkv][S / 2][D][2] int16 (a row holds two keys' values of 16 dimensions; a pair of weights
// is one broadcast) with a float32 scale per (block, dimension). S is padded with zero keys to
// a multiple of kKeys, and the blocks start at multiples of kKeys.
#include "ops.h"
#include "prefill_attention_common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

bool prefill_attention_i16_available() { return true; }

namespace {

using namespace keel::prefill;

constexpr float kQ = 11585.0f;  // a query vector's largest |int16| (2^13.5)
// The largest sum of a key's |int16| values: kQ * kL1Max < 2^31 (as in i16_gemm.cpp).
constexpr int64_t kL1Max = 2147483647 / static_cast<int64_t>(kQ);  // 185,367
constexpr float kV = 32767.0f;  // V's largest |int16| of a dimension in a block
// The largest sum of a row's int16 weights over a block: kPSum * kV < 2^31. A row's step kw
// leaves room for the rounding of up to kKeys weights (each up by at most 1/2).
constexpr float kPSum = 65535.0f;
constexpr float kPMax = 32767.0f;  // a weight of 1 (the row's largest) at most

// acc += the pairs' products of a and b, written out (as i16_gemm.cpp does, so that GCC keeps
// the accumulators in registers).
inline void dpwssd(__m512i& acc, __m512i a, __m512i b) {
  __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

inline __m512i broadcast_pair(const int16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, 4);
  return _mm512_set1_epi32(pair);
}

// 16 floats as int16 steps of 1 / inv (round to nearest even, saturated).
inline __m256i to_int16(__m512 v, __m512 inv) {
  return _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)));
}

// s[x][0:32] = the scores of kTile query vectors (q: int16 [kTile][D], scales sq) against the
// 32 keys of two adjacent groups (kp, the next `group` int16 values on; scales sk).
__attribute__((noinline)) void scores_tile(const int16_t* q, int64_t D, const float* sq,
                                           const int16_t* kp, int64_t group, const float* sk,
                                           float* s, int64_t s_stride) {
  __m512i c[kTile][2];
#pragma GCC unroll 6
  for (int x = 0; x < kTile; ++x) c[x][0] = c[x][1] = _mm512_setzero_si512();
  for (int64_t dp = 0; dp < D / 2; ++dp) {
    __m512i k0 = _mm512_loadu_si512(kp + dp * 32), k1 = _mm512_loadu_si512(kp + group + dp * 32);
    __asm__("" : "+v"(k0), "+v"(k1));  // in registers, not folded into each dot product
#pragma GCC unroll 6
    for (int x = 0; x < kTile; ++x) {
      const __m512i a = broadcast_pair(q + x * D + 2 * dp);
      dpwssd(c[x][0], a, k0);
      dpwssd(c[x][1], a, k1);
    }
  }
  const __m512 s0 = _mm512_loadu_ps(sk), s1 = _mm512_loadu_ps(sk + 16);
#pragma GCC unroll 6
  for (int x = 0; x < kTile; ++x) {
    const __m512 qs = _mm512_set1_ps(sq[x]);
    _mm512_storeu_ps(s + x * s_stride, _mm512_mul_ps(_mm512_cvtepi32_ps(c[x][0]),
                                                     _mm512_mul_ps(qs, s0)));
    _mm512_storeu_ps(s + x * s_stride + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(c[x][1]),
                                                          _mm512_mul_ps(qs, s1)));
  }
}

// acc[x][0 : 16 W] += sum_j p[x][j] v[j][0 : 16 W] for kTile query vectors (p: int16 weights,
// row stride p_stride, each row's step 1 / kw in pstep) over np pairs of keys of one block
// (vp: its first pair at these dimensions, a pair every 2 D int16 values; vs: the dimensions'
// scales).
template <int W>
__attribute__((noinline)) void values_tile(const int16_t* p, int64_t p_stride, const float* pstep,
                                           int64_t np, const int16_t* vp, int64_t D,
                                           const float* vs, float* acc, int64_t acc_stride) {
  __m512i c[kTile][W];
#pragma GCC unroll 6
  for (int x = 0; x < kTile; ++x)
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) c[x][w] = _mm512_setzero_si512();
  for (int64_t jp = 0; jp < np; ++jp) {
    __m512i v[W];
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) {
      v[w] = _mm512_loadu_si512(vp + jp * 2 * D + w * 32);
      __asm__("" : "+v"(v[w]));
    }
#pragma GCC unroll 6
    for (int x = 0; x < kTile; ++x) {
      const __m512i a = broadcast_pair(p + x * p_stride + 2 * jp);
#pragma GCC unroll 2
      for (int w = 0; w < W; ++w) dpwssd(c[x][w], a, v[w]);
    }
  }
#pragma GCC unroll 6
  for (int x = 0; x < kTile; ++x) {
    const __m512 step = _mm512_set1_ps(pstep[x]);
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) {
      float* a = acc + x * acc_stride + 16 * w;
      const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(vs + 16 * w), step);
      _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(c[x][w]), scale,
                                          _mm512_loadu_ps(a)));
    }
  }
}

// The call's K and V as the tiles read them (see the header).
struct Packed {
  int64_t s_pad = 0, D = 0;
  std::vector<int16_t> k, v;   // [Hkv][s_pad / 16][D / 2][16][2], [Hkv][s_pad / 2][D][2]
  std::vector<float> ks, vs;   // [Hkv][s_pad], [Hkv][s_pad / kKeys][D]
  const int16_t* keys(int64_t hk) const { return k.data() + hk * s_pad * D; }
  const int16_t* values(int64_t hk) const { return v.data() + hk * s_pad * D; }
};

template <typename T>
Packed pack(const at::Tensor& key, const at::Tensor& value) {
  const int64_t S = key.size(0), Hkv = key.size(1), D = key.size(2);
  Packed pk;
  pk.D = D;
  pk.s_pad = (S + kKeys - 1) / kKeys * kKeys;
  const int64_t s_pad = pk.s_pad, blocks = s_pad / kKeys;
  pk.k.assign(Hkv * s_pad * D, 0);
  pk.v.assign(Hkv * s_pad * D, 0);
  pk.ks.assign(Hkv * s_pad, 0.f);
  pk.vs.assign(Hkv * blocks * D, 0.f);
  const T* k_ptr = key.data_ptr<T>();
  const T* v_ptr = value.data_ptr<T>();
  const int64_t k_stride = key.stride(0), v_stride = value.stride(0);
  // Work units: (KV head, block of kKeys keys), for K and V alike.
  at::parallel_for(0, Hkv * blocks, 1, [&](int64_t b, int64_t e) {
    std::vector<int16_t> row(D);
    for (int64_t u = b; u < e; ++u) {
      const int64_t hk = u / blocks, j0 = u % blocks * kKeys, j1 = std::min(S, j0 + kKeys);
      // K: each key at the finest step the rule allows (see the header), its pairs to their
      // group's rows.
      int16_t* kd = pk.k.data() + hk * s_pad * D;
      for (int64_t j = j0; j < j1; ++j) {
        const T* src = k_ptr + j * k_stride + hk * D;
        __m512 mx = _mm512_setzero_ps(), l1 = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 a = _mm512_abs_ps(reinterpret_cast<__m512>(keel::load16(src + d)));
          mx = _mm512_max_ps(mx, a);
          l1 = _mm512_add_ps(l1, a);
        }
        const float amax = _mm512_reduce_max_ps(mx), sum = _mm512_reduce_add_ps(l1);
        if (!std::isfinite(sum)) {  // a NaN or an infinity: every score with this key is NaN
          pk.ks[hk * s_pad + j] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        if (!(amax > 0.f)) continue;  // a key of zeros
        // Rounding adds at most 1/2 a value to the sum of |int16|: D / 2 of room.
        const float step = std::min(kQ / amax, static_cast<float>(kL1Max - D / 2 - 1) / sum);
        pk.ks[hk * s_pad + j] = 1.f / step;
        const __m512 inv = _mm512_set1_ps(step);
        for (int64_t d = 0; d < D; d += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row.data() + d),
                              to_int16(reinterpret_cast<__m512>(keel::load16(src + d)), inv));
        int16_t* g = kd + (j / 16) * 16 * D + (j % 16) * 2;
        for (int64_t dp = 0; dp < D / 2; ++dp) std::memcpy(g + dp * 32, row.data() + 2 * dp, 4);
      }
      // V: each dimension scaled to its largest |value| over the block; pairs of keys
      // interleaved per dimension (the low half of a 32-bit lane the even key's).
      float* vs = pk.vs.data() + (hk * blocks + j0 / kKeys) * D;
      int16_t* vd = pk.v.data() + hk * s_pad * D;
      for (int64_t d = 0; d < D; d += 16) {
        __m512 mx = _mm512_setzero_ps();
        __mmask16 bad = 0;  // dimensions with a NaN or an infinity in the block
        for (int64_t j = j0; j < j1; ++j) {
          const __m512 x =
              reinterpret_cast<__m512>(keel::load16(v_ptr + j * v_stride + hk * D + d));
          bad |= _mm512_fpclass_ps_mask(x, 0x99);  // quiet NaN, +inf, -inf, signalling NaN
          mx = _mm512_max_ps(mx, _mm512_abs_ps(x));
        }
        const __mmask16 some = _mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_GT_OQ) & ~bad;
        const __m512 inv = _mm512_maskz_div_ps(some, _mm512_set1_ps(kV), mx);
        // Such a dimension's scale is NaN, so that every output it adds to is NaN: the rows
        // that see the value, as in float32 arithmetic, and the others over this block too.
        _mm512_storeu_ps(vs + d, _mm512_mask_blend_ps(
                                     bad, _mm512_maskz_div_ps(some, mx, _mm512_set1_ps(kV)),
                                     _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN())));
        for (int64_t j = j0; j < j1; j += 2) {
          const __m512i even = _mm512_cvtps_epi32(_mm512_mul_ps(
              reinterpret_cast<__m512>(keel::load16(v_ptr + j * v_stride + hk * D + d)), inv));
          const __m512i odd = j + 1 < j1 ? _mm512_cvtps_epi32(_mm512_mul_ps(
              reinterpret_cast<__m512>(keel::load16(v_ptr + (j + 1) * v_stride + hk * D + d)),
              inv)) : _mm512_setzero_si512();
          const __m512i lanes = _mm512_or_si512(
              _mm512_and_si512(even, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(odd, 16));
          _mm512_storeu_si512(vd + (j / 2) * 2 * D + 2 * d, lanes);
        }
      }
    }
  });
  return pk;
}

struct Scratch {
  std::vector<int16_t> q, p;  // [nv4][D], [nv4][kKeys]
  std::vector<float> sq, s, acc, m, l, pstep;
};

template <typename T>
void attend_item(int64_t D, const T* q_ptr, int64_t q_stride, const Packed& pk, T* o_ptr,
                 int64_t o_stride, int64_t hk, int64_t G, int64_t r0, int64_t nr, int64_t offset,
                 int64_t window, float scale, Scratch& w) {
  // Query vector x = r * G + g: row r0 + r, head hk * G + g; padded to a multiple of kTile
  // with zero vectors (scale 0, weights 0) whose results are dropped.
  const int64_t nv = nr * G, nv4 = (nv + kTile - 1) / kTile * kTile;
  w.q.assign(nv4 * D, 0);
  w.sq.assign(nv4, 0.f);
  w.p.assign(nv4 * kKeys, 0);
  w.pstep.assign(nv4, 0.f);
  w.s.resize(nv4 * kKeys);
  w.acc.assign(nv4 * D, 0.f);
  w.m.assign(nv4, -std::numeric_limits<float>::infinity());
  w.l.assign(nv4, 0.f);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q_ptr + (r0 + r) * q_stride + (hk * G + g) * D;
      const int64_t x = r * G + g;
      __m512 mx = _mm512_setzero_ps(), l1 = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_mul_ps(
            reinterpret_cast<__m512>(keel::load16(src + d)), sc));
        mx = _mm512_max_ps(mx, a);
        l1 = _mm512_add_ps(l1, a);
      }
      const float amax = _mm512_reduce_max_ps(mx);
      if (!std::isfinite(_mm512_reduce_add_ps(l1))) {  // a NaN or an infinity: NaN scores
        w.sq[x] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      if (!(amax > 0.f)) continue;
      w.sq[x] = amax / kQ;
      const __m512 inv = _mm512_set1_ps(kQ / amax);
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.q.data() + x * D + d),
                            to_int16(_mm512_mul_ps(reinterpret_cast<__m512>(keel::load16(src + d)),
                                                   sc), inv));
    }
  const int64_t first_pos = offset + r0, last_pos = offset + r0 + nr - 1;
  const int64_t k_begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t k_end = last_pos + 1;
  const int16_t* kp = pk.keys(hk);
  const int16_t* vp = pk.values(hk);
  const float* ks = pk.ks.data() + hk * pk.s_pad;
  const float* vs = pk.vs.data() + hk * (pk.s_pad / kKeys) * D;
  float* s = w.s.data();
  for (int64_t kb = k_begin / kKeys * kKeys; kb < k_end; kb += kKeys) {
    const int64_t n = std::min(kKeys, k_end - kb), n16 = (n + 15) / 16 * 16;
    for (int64_t x = 0; x < nv4; x += kTile)
      for (int64_t j = 0; j < n16; j += 32)  // up to 16 keys past n16 (zeros): unused
        scores_tile(w.q.data() + x * D, D, w.sq.data() + x, kp + (kb + j) * D, 16 * D,
                    ks + kb + j, s + x * kKeys + j, kKeys);
    for (int64_t x = 0; x < nv; ++x) {
      const int64_t pos = first_pos + x / G;
      const int64_t hi = std::min(n16, pos - kb + 1);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1 - kb) : 0;
      float* sx = s + x * kKeys;
      // The weights in float32 first, then as int16 at the row's step for this block.
      const float sum = softmax_row(sx, n16, lo, hi, w.m[x], w.l[x], w.acc.data() + x * D, D,
                                    [sx](int64_t j, Vec p) {
                                      keel::storev(sx + j, p);
                                      return p;
                                    });
      const float kw = sum > 0.f ? std::min(kPMax, std::floor((kPSum - kKeys) / sum)) : kPMax;
      const __m512 kwv = _mm512_set1_ps(kw);
      int16_t* px = w.p.data() + x * kKeys;
      for (int64_t j = 0; j < n16; j += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(px + j),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(
                                _mm512_mul_ps(_mm512_loadu_ps(sx + j), kwv))));
      w.pstep[x] = 1.f / kw;
    }
    const int64_t np = (n + 1) / 2;
    const int16_t* vb = vp + kb * D;  // pair kb / 2: 2 D int16 values a pair
    const float* vsb = vs + kb / kKeys * D;
    for (int64_t x = 0; x < nv4; x += kTile) {
      const int16_t* px = w.p.data() + x * kKeys;
      const float* step = w.pstep.data() + x;
      float* acc = w.acc.data() + x * D;
      int64_t d = 0;
      for (; d + 32 <= D; d += 32)
        values_tile<2>(px, kKeys, step, np, vb + 2 * d, D, vsb + d, acc + d, D);
      for (; d < D; d += 16)
        values_tile<1>(px, kKeys, step, np, vb + 2 * d, D, vsb + d, acc + d, D);
    }
  }
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t x = r * G + g;
      const __m512 inv = _mm512_set1_ps(1.f / w.l[x]);
      const float* a = w.acc.data() + x * D;
      T* dst = o_ptr + (r0 + r) * o_stride + (hk * G + g) * D;
      for (int64_t d = 0; d < D; d += 16)
        keel::storev(dst + d, reinterpret_cast<keel::v16>(_mm512_mul_ps(_mm512_loadu_ps(a + d),
                                                                         inv)));
    }
}

template <typename T>
void prefill_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    at::Tensor& out, float scale, int64_t window) {
  const int64_t L = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t S = key.size(0), Hkv = key.size(1);
  const int64_t G = H / Hkv, offset = S - L;
  const Packed pk = pack<T>(key, value);
  const T* q_ptr = query.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  run_items<Scratch>(L, Hkv, [&](int64_t hk, int64_t r0, int64_t nr, Scratch& w) {
    attend_item<T>(D, q_ptr, query.stride(0), pk, o_ptr, out.stride(0), hk, G, r0, nr, offset,
                   window, scale, w);
  });
}

}  // namespace

void prefill_attention_i16(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor out,
                           double scale, int64_t sliding_window) {
  keel::prefill::check_args("prefill_attention_i16", query, key, value, out,
                            keel::prefill::kMaxGroup);
  const float sc = static_cast<float>(scale);
  if (query.scalar_type() == at::kFloat) {
    prefill_kernel<float>(query, key, value, out, sc, sliding_window);
  } else {
    TORCH_CHECK(query.scalar_type() == at::kBFloat16,
                "prefill_attention_i16: float32 or bfloat16 only");
    prefill_kernel<c10::BFloat16>(query, key, value, out, sc, sliding_window);
  }
}

#else  // no AVX512-VNNI

bool prefill_attention_i16_available() { return false; }
void prefill_attention_i16(at::Tensor, at::Tensor, at::Tensor, at::Tensor, double, int64_t) {
  TORCH_CHECK(false, "prefill_attention_i16 needs AVX512-VNNI (prefill_attention_i16_available() "
                     "is false here)");
}

#endif
