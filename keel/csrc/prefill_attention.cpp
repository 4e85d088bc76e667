// Causal attention of one long prompt chunk over its request's keys (a flash-attention loop on
// the CPU): the pass's long chunks go here one by one instead of to torch's SDPA, whose CPU
// kernel reached ~56 GFLOP/s (causal half counted) at 600 tokens on an AVX2 EPYC.
//
//   query   [L, H, D]     this chunk's query rows (rows may be strided: views of a qkv output)
//   key     [S, Hkv, D]   every key the chunk sees (rows may be strided), S >= L
//   value   [S, Hkv, D]
//   out     [L, H * D]    written in place (rows may be strided)
// Query row i sits at position S - L + i and sees keys j <= S - L + i (and, with a sliding
// window w > 0, j > S - L + i - w).
//
// Work items are (KV head, block of kRows query rows): the G = H / Hkv query heads of a group
// share every key and value the item reads, so an item computes G * kRows query vectors at
// once with register-tiled loops (6 query vectors x 16 keys for the scores, 6 x 16 dims for the
// weighted values; 32 keys and 32 dims with AVX-512), one pass over its keys in blocks of kKeys
// with an online softmax. Keys are transposed once per call ([Hkv, D, S]) so the score loop
// reads 8 or 16 keys per load. Items are handed out longest first from an atomic counter:
// causal items differ in length by up to L.
#include "prefill_attention_common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace {

using keel::load8;
using keel::pin;
using keel::store8;
using keel::v8;
using namespace keel::prefill;

// Register tiles of kTile query vectors (prefill_attention_common.h) by kSpan keys or dims,
// 12 accumulators; the two loads each step are pinned in registers (`keel::pin`) so that GCC
// does not fold them into every FMA, which made the loops wait on loads instead of FMAs.

// s[x][j] = sum_d q[x][d] * kt[d][j] for kTile query vectors and kSpan keys.
inline void scores_tile(const float* q, int64_t D, const float* kt, int64_t kt_stride, float* s,
                        int64_t s_stride) {
  Vec a[kTile][2] = {};
  for (int64_t d = 0; d < D; ++d) {
    Vec k0 = keel::loadv<Vec>(kt + d * kt_stride);
    Vec k1 = keel::loadv<Vec>(kt + d * kt_stride + kLanes);
    pin(k0);
    pin(k1);
#pragma GCC unroll 6
    for (int x = 0; x < kTile; ++x) {
      const Vec qx = splat<Vec>(q[x * D + d]);
      a[x][0] += qx * k0;
      a[x][1] += qx * k1;
    }
  }
#pragma GCC unroll 6
  for (int x = 0; x < kTile; ++x) {
    keel::storev(s + x * s_stride, a[x][0]);
    keel::storev(s + x * s_stride + kLanes, a[x][1]);
  }
}

// acc[x][0:span] += sum_j p[x][j] * val[j][0:span] for kTile query vectors, j < n, where span
// is 2 * lanes of V (16 or 32 dims).
template <typename V, typename T>
inline void values_tile(const float* p, int64_t p_stride, const T* val, int64_t val_stride,
                        int64_t n, float* acc, int64_t acc_stride) {
  constexpr int64_t lanes = sizeof(V) / sizeof(float);
  V a[kTile][2];
#pragma GCC unroll 6
  for (int x = 0; x < kTile; ++x) {
    a[x][0] = keel::loadv<V>(acc + x * acc_stride);
    a[x][1] = keel::loadv<V>(acc + x * acc_stride + lanes);
  }
  for (int64_t j = 0; j < n; ++j) {
    V v0 = keel::loadv<V>(val + j * val_stride);
    V v1 = keel::loadv<V>(val + j * val_stride + lanes);
    pin(v0);
    pin(v1);
#pragma GCC unroll 6
    for (int x = 0; x < kTile; ++x) {
      const V px = splat<V>(p[x * p_stride + j]);
      a[x][0] += px * v0;
      a[x][1] += px * v1;
    }
  }
#pragma GCC unroll 6
  for (int x = 0; x < kTile; ++x) {
    keel::storev(acc + x * acc_stride, a[x][0]);
    keel::storev(acc + x * acc_stride + lanes, a[x][1]);
  }
}

struct Scratch {
  std::vector<float> q, s, acc, m, l;
};

template <typename T>
void attend_item(int64_t D, const T* q_ptr, int64_t q_stride, const float* kt, int64_t kt_stride,
                 const T* v_ptr, int64_t v_stride, T* o_ptr, int64_t o_stride, int64_t hk,
                 int64_t G, int64_t r0, int64_t nr, int64_t offset, int64_t window, float scale,
                 Scratch& w) {
  // Query vector x = r * G + g: row r0 + r, head hk * G + g. Padded to a multiple of kTile
  // with zero vectors whose results are dropped.
  const int64_t nv = nr * G, nv4 = (nv + kTile - 1) / kTile * kTile;
  w.q.assign(nv4 * D, 0.f);
  w.s.resize(nv4 * kKeys);
  w.acc.assign(nv4 * D, 0.f);
  w.m.assign(nv4, -std::numeric_limits<float>::infinity());
  w.l.assign(nv4, 0.f);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q_ptr + (r0 + r) * q_stride + (hk * G + g) * D;
      float* dst = w.q.data() + (r * G + g) * D;
      for (int d = 0; d < D; d += 8) store8(dst + d, load8(src + d) * scale);
    }
  const int64_t first_pos = offset + r0, last_pos = offset + r0 + nr - 1;
  const int64_t k_begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t k_end = last_pos + 1;
  float* s = w.s.data();
  for (int64_t kb = k_begin; kb < k_end; kb += kKeys) {
    const int64_t n = std::min(kKeys, k_end - kb), n16 = (n + 15) / 16 * 16;
    for (int64_t x = 0; x < nv4; x += kTile)
      for (int64_t j = 0; j < n16; j += kSpan)  // up to kSpan - 16 keys past n16: unused
        scores_tile(w.q.data() + x * D, D, kt + kb + j, kt_stride, s + x * kKeys + j, kKeys);
    // Online softmax over each vector's visible keys of the block, [lo, hi): keys past its
    // row's position (the causal edge) or too far behind it (a sliding window) are given
    // weight 0, lane by lane in the vector loops, with no pass of their own. A block without
    // either edge is visible whole to every row (n16 == n there).
    for (int64_t x = 0; x < nv; ++x) {
      const int64_t pos = first_pos + x / G;
      const int64_t hi = std::min(n16, pos - kb + 1);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1 - kb) : 0;
      float* sx = s + x * kKeys;
      softmax_row(sx, n16, lo, hi, w.m[x], w.l[x], w.acc.data() + x * D, D,
                  [sx](int64_t j, Vec p) {  // the weights over their scores
                    keel::storev(sx + j, p);
                    return p;
                  });
    }
    const T* vb = v_ptr + kb * v_stride + hk * D;
    for (int64_t x = 0; x < nv4; x += kTile) {
      int64_t d = 0;
      if constexpr (kSpan == 32)
        for (; d + 32 <= D; d += 32)
          values_tile<Vec>(s + x * kKeys, kKeys, vb + d, v_stride, n, w.acc.data() + x * D + d,
                           D);
      for (; d < D; d += 16)
        values_tile<v8>(s + x * kKeys, kKeys, vb + d, v_stride, n, w.acc.data() + x * D + d, D);
    }
  }
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t x = r * G + g;
      const float inv = 1.f / w.l[x];
      const float* a = w.acc.data() + x * D;
      T* dst = o_ptr + (r0 + r) * o_stride + (hk * G + g) * D;
      for (int d = 0; d < D; d += kLanes)
        keel::storev(dst + d, keel::loadv<Vec>(a + d) * splat<Vec>(inv));
    }
}

template <typename T>
void prefill_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    at::Tensor& out, float scale, int64_t window) {
  const int64_t L = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t S = key.size(0), Hkv = key.size(1);
  const int64_t G = H / Hkv, offset = S - L;
  // A score tile may read up to kSpan keys past the last.
  const int64_t s_pad = (S + 15) / 16 * 16 + kSpan;
  // Keys transposed to [Hkv, D, s_pad] (zeros past S: masked, never weighted).
  std::vector<float> kt(Hkv * D * s_pad, 0.f);
  const T* k_ptr = key.data_ptr<T>();
  const int64_t k_stride = key.stride(0);
  at::parallel_for(0, Hkv * D, 8, [&](int64_t b, int64_t e) {
    for (int64_t hd = b; hd < e; ++hd) {
      float* dst = kt.data() + hd * s_pad;
      const T* src = k_ptr + hd;  // key j's (head hd / D, dim hd % D): each row is dense
      for (int64_t j = 0; j < S; ++j) dst[j] = static_cast<float>(src[j * k_stride]);
    }
  });
  const T* q_ptr = query.data_ptr<T>();
  const T* v_ptr = value.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  run_items<Scratch>(L, Hkv, [&](int64_t hk, int64_t r0, int64_t nr, Scratch& w) {
    attend_item<T>(D, q_ptr, query.stride(0), kt.data() + hk * D * s_pad, s_pad, v_ptr,
                   value.stride(0), o_ptr, out.stride(0), hk, G, r0, nr, offset, window, scale,
                   w);
  });
}

}  // namespace

void prefill_attention(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor out,
                       double scale, int64_t sliding_window) {
  check_args("prefill_attention", query, key, value, out, kMaxGroup);
  const float sc = static_cast<float>(scale);
  if (query.scalar_type() == at::kFloat) {
    prefill_kernel<float>(query, key, value, out, sc, sliding_window);
  } else if (query.scalar_type() == at::kBFloat16) {
    prefill_kernel<c10::BFloat16>(query, key, value, out, sc, sliding_window);
  } else {
    TORCH_CHECK(query.scalar_type() == at::kHalf,
                "prefill_attention: float32, bfloat16 or float16 only");
    prefill_kernel<c10::Half>(query, key, value, out, sc, sliding_window);
  }
}
