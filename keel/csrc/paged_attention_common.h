// paged_attention.cpp's shared pieces: the chunks a decode row's keys are read in, the prefetch
// of the next chunk's K and V runs, an int8 cache's scales, and the scratch a thread keeps.
// Included by paged_attention.cpp only (one translation unit with the row kernels).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"
#include "vendor_choice.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Internal linkage, as when these were one file: the headers are parts of paged_attention.cpp.
namespace {

using keel::hsum;
using keel::hsum8;
using keel::load16;
using keel::load8;
using keel::store8;
using keel::v16;
using keel::v8;

constexpr int64_t kChunkKeys = 32;  // keys per online-softmax step (a float32 cache: chunk_keys)
constexpr int64_t kChunkBlocks = 4;  // blocks of a chunk at most (block_size >= 8)
static_assert(kChunkKeys / 8 <= kChunkBlocks, "a chunk of 8-key blocks must fit kChunkBlocks");

// decode_row's keys per chunk, by the cache's dtype. A float32 cache goes 16 keys (one block of
// the default size) at a time, with the next 16 keys' K and V prefetched: over 64 rows and 30
// layers' caches from memory, 0.90-0.91x the time of 32-key chunks at 364-864 keys and 0.93x
// at 50-90 (64-key chunks: 1.11-1.17x). A bfloat16 cache keeps 32: 16 read 0.93x at 50-90 keys
// but 1.085x at 364-864 (BENCHMARKS.md, thirty-first round).
template <typename T>
constexpr int64_t chunk_keys() {
  return std::is_same_v<T, float> ? 16 : kChunkKeys;
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  v16 acc = {0};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) acc += load16(q + i) * load16(k + i);
  float s = hsum(acc);
  for (; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

// Visits keys [start, len) of one request and one KV head, block by block through its row of
// the block table: f(j, off) for key position j, whose D elements start at element `off` of
// the head's base pointer (block * block_elems + t * D). One table read per block and no
// division per token (block_size is only known at run time).
template <typename F>
inline void for_each_slot(const int32_t* row, int64_t bs, int64_t D, int64_t block_elems,
                          int64_t start, int64_t len, F&& f) {
  for (int64_t b = start / bs; b * bs < len; ++b) {
    const int64_t base = static_cast<int64_t>(row[b]) * block_elems;
    const int64_t t0 = std::max<int64_t>(start - b * bs, 0);
    const int64_t t1 = std::min<int64_t>(len - b * bs, bs);
    for (int64_t t = t0; t < t1; ++t) f(b * bs + t, base + t * D);
  }
}

// A chunk of a row's blocks from block b: its blocks (nb, at most cb, the row ending at block
// b_end), the next chunk's, and its visible keys [lo, hi) counted from its first key (the
// row's keys [start, len) are visible).
struct Chunk {
  int64_t nb, next, lo, hi;
};
inline Chunk chunk_at(int64_t b, int64_t cb, int64_t b_end, int64_t bs, int64_t start,
                      int64_t len) {
  const int64_t nb = std::min(cb, b_end - b);
  return {nb, std::min(cb, b_end - b - nb), std::max(start, b * bs) - b * bs,
          std::min(len, (b + nb) * bs) - b * bs};
}

// An int8 cache (kv_cache_dtype="int8"): s[g * ss + j] *= the scale of the chunk's key j
// (block j / bs, slot j % bs: scales[j / bs] + j % bs) for keys [lo8, hi8) of GT heads, 8 at
// a time (bs % 8 == 0). A score times its key's scale; a weight times its value's.
inline void scale_by_block(float* s, int64_t ss, int64_t GT, const float* const* scales,
                           int64_t bs, int64_t lo8, int64_t hi8) {
  for (int64_t b0 = lo8 / bs * bs, i = lo8 / bs; b0 < hi8; b0 += bs, ++i) {
    const int64_t j0 = std::max(lo8, b0), j1 = std::min(hi8, b0 + bs);
    for (int64_t g = 0; g < GT; ++g)
      for (int64_t j = j0; j < j1; j += 8)
        store8(s + g * ss + j, load8(s + g * ss + j) * load8(scales[i] + (j - b0)));
  }
}

// An int8 cache: the scales of the chunk's runs kblk / vblk (one per row, at the row's index).
template <typename T>
inline void run_scales(const float* k_scale, const float* v_scale, const T* k_ptr, const T* v_ptr,
                       const T* const* kblk, const T* const* vblk, int64_t nb, int64_t D,
                       const float** ksb, const float** vsb) {
  for (int64_t i = 0; i < nb; ++i) {
    ksb[i] = k_scale + (kblk[i] - k_ptr) / D;
    vsb[i] = v_scale + (vblk[i] - v_ptr) / D;
  }
}

// The scales of blocks row[0 .. n) from KV head h0 (nh heads of bs rows each) into L1: an int8
// cache's next chunk, beside its rows.
inline void prefetch_scales(const float* k_scale, const float* v_scale, const int32_t* row,
                            int64_t n, int64_t block_rows, int64_t h0, int64_t nh, int64_t bs) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t l = 0; l < nh * bs * 4; l += 64) {
      const int64_t o = static_cast<int64_t>(row[i]) * block_rows + h0 * bs;
      __builtin_prefetch(reinterpret_cast<const char*>(k_scale + o) + l, 0, 3);
      __builtin_prefetch(reinterpret_cast<const char*>(v_scale + o) + l, 0, 3);
    }
}

// The query tokens one item takes together: a decode row (n = 1), or up to kGroupTokens
// consecutive tokens of one request (a speculative step's drafts with the token before them, a
// short prompt chunk), whose keys and values are then read once for all of them instead of
// once per token. Token i's query row is q + i * q_stride (elements), its output
// out + i * o_stride, and it sees keys [first(i), len[i]): the row kernels walk the union of
// the tokens' keys and give each token's scores outside its own keys weight 0.
struct Tokens {
  int64_t n = 1, q_stride = 0, o_stride = 0;
  const int64_t* len = nullptr;  // n entries
  int64_t window = 0;            // sliding window (0: none)
  int64_t first(int64_t i) const {
    return window > 0 ? std::max<int64_t>(0, len[i] - window) : int64_t{0};
  }
  // The union of the tokens' keys: [start, end).
  std::pair<int64_t, int64_t> keys() const {
    int64_t start = first(0), end = len[0];
    for (int64_t i = 1; i < n; ++i) start = std::min(start, first(i)), end = std::max(end, len[i]);
    return {start, end};
  }
};
constexpr int64_t kGroupTokens = 16;  // tokens of one request an item takes at most

// Token i's visible keys of the chunk of blocks [b, b + nb) (bs keys each), counted from the
// chunk's first key: [lo, hi), empty where hi <= lo.
inline std::pair<int64_t, int64_t> token_keys(const Tokens& tk, int64_t i, int64_t b,
                                              int64_t nb, int64_t bs) {
  return {std::max(tk.first(i), b * bs) - b * bs, std::min(tk.len[i], (b + nb) * bs) - b * bs};
}

struct NextItem {  // the thread's next item: its first chunk is prefetched during this one's last
  const int32_t* row = nullptr;
  int64_t b0 = 0, nb = 0, h0 = 0;  // first block, blocks of the first chunk, first KV head
};

// Where the AVX-512 kernels (decode_row16, decode_row_bf16) prefetch the next chunk of a
// bfloat16 or int8 cache. A float32 cache's always goes into L2 (a float32 chunk's 24 KB into
// L1 read level, thirty-first round), and so does every chunk of the AVX2 kernel.
// Into L1 on Intel: decode_row_bf16's 24 KB ran 3-10% faster from memory than into L2
// (twenty-first round). Into L2 on AMD: on an EPYC Zen 4 with AVX512-BF16 the prefetches into
// L1 stalled the core (20% of decode_row16's samples on the prefetch loop, its L1 misses all
// outstanding), and into L2 a decode step's attention over 364-864 keys of 30 layers' bfloat16
// caches ran 1.76x faster with float32 queries and 1.57x with bfloat16 ones, over int8 caches
// 1.10x (the same bits; BENCHMARKS.md, sixty-first round). Chosen at first use;
// KEEL_ATTN_PREFETCH_L2=0|1 forces it, and `attention_prefetch_into_l2(set=)` changes it in a
// running process (the tests). Atomic: a kernel's threads read it while a test may set it.
inline std::atomic<bool>& attention_prefetch_l2_flag() {
  static std::atomic<bool> l2{keel::amd_unless_forced("KEEL_ATTN_PREFETCH_L2")};
  return l2;
}

inline bool attention_prefetch_l2() {
  return attention_prefetch_l2_flag().load(std::memory_order_relaxed);
}

// The next chunk's K and V runs, a few lines at a time, spread over this chunk's work: the
// hardware prefetchers stop at 4 KiB pages and a burst of a whole chunk's prefetches stalled
// the core (measured: 1.1-1.2x on a 64-request decode over 300-930 keys). Into L2 (`l2`) or
// L1: attention_prefetch_l2 says which for a 16-bit or int8 cache.
struct Prefetcher {
  explicit Prefetcher(bool into_l2) : l2(into_l2) {}
  const bool l2;
  const char* run[2 * kChunkBlocks];
  int runs = 0, i = 0, lines = 0;
  int64_t off = 0, bytes = 0;
  // Aims at blocks row[b0 .. b0 + n) (their K and V runs from element `head_off` of each
  // block), spread over `steps` calls of step().
  template <typename T>
  inline void aim(const T* k, const T* v, const int32_t* row, int64_t b0, int64_t n,
                  int64_t block_elems, int64_t head_off, int64_t steps) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t o = static_cast<int64_t>(row[b0 + j]) * block_elems + head_off;
      run[2 * j] = reinterpret_cast<const char*>(k + o);
      run[2 * j + 1] = reinterpret_cast<const char*>(v + o);
    }
    runs = static_cast<int>(2 * n), i = 0, off = 0;
    lines = static_cast<int>((runs * bytes / 64 + steps - 1) / steps);
  }
  // Aims at the chunk after blocks row[b .. b + nb), the `next` blocks from b + nb, or where
  // there are none at the next item's first chunk (nx); a block's KV heads from h0 (runs of
  // `run` elements).
  template <typename T>
  inline void aim_next(const T* k, const T* v, const int32_t* row, int64_t b, int64_t nb,
                       int64_t next, const NextItem& nx, int64_t block_elems, int64_t run,
                       int64_t h0, int64_t steps) {
    if (next == 0 && nx.row != nullptr)
      aim(k, v, nx.row, nx.b0, nx.nb, block_elems, nx.h0 * run, steps);
    else
      aim(k, v, row, b + nb, next, block_elems, h0 * run, steps);
  }
  // The same lines as one at a time with a check per line, a run's stretch per loop: at 8
  // prefetches per key and KV head (float32) the per-line loop was ~12% of the kernel's
  // samples with K/V hot in cache. A bfloat16 cache's decode rows ran 1.05-1.48x faster
  // (hot) and 1.18-1.42x (from memory); float32's within the noise (twenty-sixth round).
  inline void step() {
    int64_t left = lines;
    while (left > 0 && i < runs) {
      const char* p = run[i] + off;
      const int64_t n = std::min<int64_t>(left, (bytes - off + 63) / 64);
      if (l2)
        for (int64_t l = 0; l < n; ++l) __builtin_prefetch(p + l * 64, 0, 2);
      else
        for (int64_t l = 0; l < n; ++l) __builtin_prefetch(p + l * 64, 0, 3);
      left -= n;
      if ((off += n * 64) >= bytes) off = 0, ++i;
    }
  }
};

// One KV head's K and V runs (from element `head_off` of each block) in blocks row[0 .. n).
template <typename T>
inline void head_runs(const T* k, const T* v, const int32_t* row, int64_t n, int64_t block_elems,
                      int64_t head_off, const T** kblk, const T** vblk) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t o = static_cast<int64_t>(row[i]) * block_elems + head_off;
    kblk[i] = k + o;
    vblk[i] = v + o;
  }
}

// The online softmax's step for one query head, whose chunk's largest score is mx: the running
// maximum m becomes mx, and the result is the factor its sum and accumulator are rescaled by.
// 0 on the first chunk (m is -inf); 1, with no call (the same bits), while the maximum holds,
// as it mostly does past the first chunks (the scalar exp was ~2% of a long decode step).
inline float advance_max(float& m, float mx) {
  const float alpha = mx == m ? 1.f : std::exp(m - mx);
  m = mx;
  return alpha;
}

#if defined(__AVX512F__)
// acc[0 .. D) *= alpha, 16 lanes at a time (D % 16 == 0), unless alpha is 1.
inline void rescale16(float* acc, int64_t D, float alpha) {
  if (alpha == 1.f) return;
  const __m512 al = _mm512_set1_ps(alpha);
  for (int64_t d = 0; d < D; d += 16)
    _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), al));
}

// The softmax weights exp(e - mx) of 16 scores, 0 for the lanes that are -inf (keys outside
// the row's range).
// (weights16v: each lane its own maximum; decode_row16's lanes of query vectors.)
inline __m512 weights16v(__m512 e, __m512 mx) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __mmask16 live = _mm512_cmp_ps_mask(e, ninf, _CMP_NEQ_OQ);
  const v16 x = (v16)_mm512_sub_ps(e, mx);
  return _mm512_maskz_mov_ps(live, (__m512)keel::expv(x));
}
inline __m512 weights16(__m512 e, float mx) { return weights16v(e, _mm512_set1_ps(mx)); }
#endif

// f(GT, NP) with GT = gt in 1..4 and NP = np in 1..2 as compile-time constants: the value
// tiles' shapes (up to 4 query heads by 32 or 64 dims).
template <typename F>
inline void with_tile(int64_t gt, int64_t np, F&& f) {
  auto heads = [&](auto n) {
    switch (gt) {
      case 4: f(std::integral_constant<int, 4>{}, n); break;
      case 3: f(std::integral_constant<int, 3>{}, n); break;
      case 2: f(std::integral_constant<int, 2>{}, n); break;
      default: f(std::integral_constant<int, 1>{}, n);
    }
  };
  if (np == 2)
    heads(std::integral_constant<int, 2>{});
  else
    heads(std::integral_constant<int, 1>{});
}

struct Scratch {
  std::vector<float> q, acc, m, l, s;
  std::vector<float> mx, alpha;  // decode_row16: each query vector's chunk maximum and rescale
  // decode_row16 in lanes of query vectors: the queries transposed, the running maxima and
  // sums by lane, a bfloat16 chunk's keys as floats, each lane's visible keys of the chunk.
  std::vector<float> qt, lm, ll, kf;
  std::vector<const float*> kr;  // the chunk's key rows as floats
  std::vector<int32_t> lane_lo, lane_hi;
  std::vector<uint16_t> p;        // decode_row_bf16: a chunk's weights in bfloat16
  std::vector<c10::BFloat16> zero;  // decode_row_bf16: a row of D zeros
};

}  // namespace
