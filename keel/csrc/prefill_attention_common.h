// What keel's two causal prefill kernels share: prefill_attention.cpp (float32 FMAs over the
// chunk's own dtype) and prefill_attention_i16.cpp (int16 dot products, dtype="auto"'s where the
// CPU has AVX512-VNNI). Both run work items of (KV head, block of kRows query rows) over their
// keys in blocks of kKeys with an online softmax, in the vector lanes here.
#pragma once

#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>

namespace keel::prefill {

constexpr int64_t kRows = 16;  // query rows per work item
constexpr int64_t kKeys = 64;  // keys per block of the online softmax
constexpr int64_t kMaxGroup = 16;
// Register tiles: kTile query vectors x kSpan keys (scores) or x kSpan dims (values).
constexpr int kTile = 6;

// The tiles' vectors: 16 lanes where the CPU has AVX-512 (a tile then covers 32 keys or 32
// dims: two registers a query vector, twice the AVX2 tile's work per instruction), else 8.
// Each output is the same chain of FMAs in the same order either way, so the bits agree.
#ifdef __AVX512F__
using Vec = keel::v16;
#else
using Vec = keel::v8;
#endif
constexpr int64_t kLanes = sizeof(Vec) / sizeof(float);

// x in every lane of a v8 or a v16.
template <typename V>
inline V splat(float x) {
  if constexpr (sizeof(V) == 64) return V{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
  else return keel::splat8(x);
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

// One query vector's step of the online softmax over a block's scores sx [0, n16), of which
// [lo, hi) are visible to it (keys past its row's position, or too far behind it in a sliding
// window, get weight 0, lane by lane, with no pass of their own): its running maximum m and
// sum l move on, what it accumulated so far (acc, D floats) is rescaled where the maximum grew,
// and each kLanes lanes of weights go to store(j, p), which keeps them as the kernel's values
// tile reads them and returns the weights it kept (the sum l adds). Returns that block sum.
template <typename Store>
inline float softmax_row(const float* sx, int64_t n16, int64_t lo, int64_t hi, float& m,
                         float& l, float* acc, int64_t D, Store store) {
  if (hi <= lo) {  // nothing of the block is visible to this row
    for (int64_t j = 0; j < n16; j += kLanes) store(j, Vec{});
    return 0.f;
  }
  const bool whole = lo == 0 && hi == n16;
  const float ninf = -std::numeric_limits<float>::infinity();
  Vec mv = splat<Vec>(ninf);
  for (int64_t j = 0; j < n16; j += kLanes) {
    Vec e = keel::loadv<Vec>(sx + j);
    if (!whole) e = visible(j, lo, hi) ? e : splat<Vec>(ninf);
    mv = e > mv ? e : mv;
  }
  const float mx = std::max(hmax(mv), m);
  // Rescale what was accumulated when the row's maximum grows (0 on its first block).
  const float alpha = mx == m ? 1.f : std::exp(m - mx);
  m = mx;
  Vec sum = {};
  const Vec mxv = splat<Vec>(mx);
  for (int64_t j = 0; j < n16; j += kLanes) {
    Vec p = keel::expv(keel::loadv<Vec>(sx + j) - mxv);
    if (!whole) p = visible(j, lo, hi) ? p : Vec{};
    sum += store(j, p);
  }
  const float block = hsum_lanes(sum);
  l = l * alpha + block;
  if (alpha != 1.f)
    for (int64_t d = 0; d < D; d += kLanes)
      keel::storev(acc + d, keel::loadv<Vec>(acc + d) * splat<Vec>(alpha));
  return block;
}

// Every work item (KV head hk, rows r0 .. r0 + nr of the chunk's L, in blocks of kRows) to
// item(hk, r0, nr, scratch), handed out longest first from an atomic counter (causal items
// differ in length by up to L: the last row blocks see the most keys), each thread with its
// own Scratch.
template <typename Scratch, typename Item>
void run_items(int64_t L, int64_t Hkv, Item item) {
  const int64_t blocks = (L + kRows - 1) / kRows, items = blocks * Hkv;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch w;
    for (int64_t i = next++; i < items; i = next++) {
      const int64_t blk = blocks - 1 - i / Hkv, hk = i % Hkv, r0 = blk * kRows;
      item(hk, r0, std::min(kRows, L - r0), w);
    }
  });
}

// The arguments both kernels take (`name` heads the errors): query [L, H, D], key and value
// [S, Hkv, D] with dense heads, S >= L, out [L, H * D] with dense rows, one dtype.
inline void check_args(const char* name, const at::Tensor& query, const at::Tensor& key,
                       const at::Tensor& value, const at::Tensor& out, int64_t max_group) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && out.dim() == 2, name,
              ": query/key/value [rows, heads, D], out [rows, heads * D]");
  const int64_t L = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t S = key.size(0), Hkv = key.size(1);
  TORCH_CHECK(value.sizes() == key.sizes() && key.size(2) == D, name, ": shapes");
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= max_group, name, ": heads per KV head");
  TORCH_CHECK(S >= L && L > 0, name, ": the chunk sees at least its own keys");
  TORCH_CHECK(out.size(0) == L && out.size(1) == H * D && out.stride(1) == 1, name,
              ": out must be [rows, heads * D] with dense rows");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() &&
                  value.scalar_type() == key.scalar_type() &&
                  out.scalar_type() == key.scalar_type(),
              name, ": dtype mismatch");
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D, name, ": each row's heads must be dense");
  TORCH_CHECK(D % 16 == 0, name, ": head size a multiple of 16");
}

}  // namespace keel::prefill
