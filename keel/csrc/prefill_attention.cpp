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
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

namespace {

using keel::load8;
using keel::pin;
using keel::splat8;
using keel::store8;
using keel::v8;

constexpr int64_t kRows = 16;  // query rows per work item
constexpr int64_t kKeys = 64;  // keys per block of the online softmax
constexpr int64_t kMaxGroup = 16;

// Register tiles: kTile query vectors x kSpan keys (scores) or x kSpan dims (values), 12
// accumulators; the two loads each step are pinned in registers (`keel::pin`) so that
// GCC does not fold them into every FMA, which made the loops wait on loads instead of FMAs.
constexpr int kTile = 6;

// The tiles' vectors: 16 lanes where the CPU has AVX-512 (a tile then covers 32 keys or 32
// dims: two registers a query vector, twice the AVX2 tile's work per instruction), else 8.
// Each output is the same chain of FMAs in the same order either way, so the bits agree.
#ifdef __AVX512F__
using Vec = keel::v16;
#else
using Vec = v8;
#endif
constexpr int64_t kLanes = sizeof(Vec) / sizeof(float);

// x in every lane of a v8 or a v16.
template <typename V>
inline V splat(float x) {
  if constexpr (sizeof(V) == 64) return V{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
  else return splat8(x);
}
constexpr int64_t kSpan = 2 * kLanes;  // keys of a score tile, dims of a value tile

// The online softmax runs in the tiles' lanes too: in 8 lanes on AVX-512 it was ~30% of the
// kernel's time (5 prompts of 310-790 tokens, float32), and in 16 lanes, with a tree for the
// horizontal maximum (`_mm512_reduce_max_ps`) instead of 15 dependent scalar ones, the kernel
// ran 1.13-1.17x faster (benchmarks/kernel_ab.py --cases prefill; BENCHMARKS.md, fifty-second
// round).

// Lanes j .. j + kLanes - 1 of a block: is each in [lo, hi)? (all-ones or all-zeros per lane)
inline auto visible(int64_t j, int64_t lo, int64_t hi) {
  Vec lane;  // 0, 1, ..., a constant
  for (int i = 0; i < static_cast<int>(kLanes); ++i) lane[i] = static_cast<float>(i);
  lane += splat<Vec>(static_cast<float>(j));
  return (lane >= splat<Vec>(static_cast<float>(lo))) & (lane < splat<Vec>(static_cast<float>(hi)));
}

// The largest lane and the sum of the lanes.
inline float hmax(Vec v) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int i = 1; i < static_cast<int>(kLanes); ++i) m = std::max(m, v[i]);
  return m;
#endif
}

inline float hsum_lanes(Vec v) {
#ifdef __AVX512F__
  return keel::hsum(v);
#else
  return keel::hsum8(v);
#endif
}

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
  const float ninf = -std::numeric_limits<float>::infinity();
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
      if (hi <= lo) {  // nothing of the block is visible to this row
        for (int64_t j = 0; j < n16; j += 8) store8(sx + j, v8{});
        continue;
      }
      const bool whole = lo == 0 && hi == n16;
      Vec mv = splat<Vec>(ninf);
      for (int64_t j = 0; j < n16; j += kLanes) {
        Vec e = keel::loadv<Vec>(sx + j);
        if (!whole) e = visible(j, lo, hi) ? e : splat<Vec>(ninf);
        mv = e > mv ? e : mv;
      }
      const float mx = std::max(hmax(mv), w.m[x]);
      // Rescale what was accumulated when the row's maximum grows (0 on its first block).
      const float alpha = mx == w.m[x] ? 1.f : std::exp(w.m[x] - mx);
      w.m[x] = mx;
      Vec sum = {};
      const Vec mxv = splat<Vec>(mx);
      for (int64_t j = 0; j < n16; j += kLanes) {
        Vec p = keel::expv(keel::loadv<Vec>(sx + j) - mxv);
        if (!whole) p = visible(j, lo, hi) ? p : Vec{};
        keel::storev(sx + j, p);
        sum += p;
      }
      w.l[x] = w.l[x] * alpha + hsum_lanes(sum);
      if (alpha != 1.f) {
        float* a = w.acc.data() + x * D;
        for (int d = 0; d < D; d += kLanes)
          keel::storev(a + d, keel::loadv<Vec>(a + d) * splat<Vec>(alpha));
      }
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
  const int64_t blocks = (L + kRows - 1) / kRows, items = blocks * Hkv;
  // Longest first: the last row blocks see the most keys.
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  const T* q_ptr = query.data_ptr<T>();
  const T* v_ptr = value.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch w;
    for (int64_t i = next++; i < items; i = next++) {
      const int64_t blk = blocks - 1 - i / Hkv, hk = i % Hkv;
      const int64_t r0 = blk * kRows, nr = std::min(kRows, L - r0);
      attend_item<T>(D, q_ptr, query.stride(0), kt.data() + hk * D * s_pad, s_pad, v_ptr,
                        value.stride(0), o_ptr, out.stride(0), hk, G, r0, nr, offset, window,
                        scale, w);
    }
  });
}

}  // namespace

void prefill_attention(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor out,
                       double scale, int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && out.dim() == 2,
              "prefill_attention: query/key/value [rows, heads, D], out [rows, heads * D]");
  const int64_t L = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t S = key.size(0), Hkv = key.size(1);
  TORCH_CHECK(value.sizes() == key.sizes() && key.size(2) == D, "prefill_attention: shapes");
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= kMaxGroup, "prefill_attention: heads per KV head");
  TORCH_CHECK(S >= L && L > 0, "prefill_attention: the chunk sees at least its own keys");
  TORCH_CHECK(out.size(0) == L && out.size(1) == H * D && out.stride(1) == 1,
              "prefill_attention: out must be [rows, heads * D] with dense rows");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() &&
                  value.scalar_type() == key.scalar_type() &&
                  out.scalar_type() == key.scalar_type(),
              "prefill_attention: dtype mismatch");
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D,
                "prefill_attention: each row's heads must be dense");
  TORCH_CHECK(D % 16 == 0, "prefill_attention: head size a multiple of 16");
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
