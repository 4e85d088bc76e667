// Paged attention on the CPU, one query token per row: decode rows, and the rows of short
// prompts (each query token of a prompt is a row whose keys end at its own position).
//
// Reads each row's keys and values straight from its request's KV blocks through the block
// table: no gathered copy of the context. Common shapes (head size a multiple of 32, block
// size a multiple of 8) take `decode_row`: one pass over a row's keys in chunks of whole
// blocks, each chunk's K and V of every KV head read together with an online softmax, the
// next chunk prefetched a few lines at a time. At 64 requests over 300-930 keys of the default
// model this reads K and V from memory ~1.1-1.2x faster than a pass over K then one over V per
// (row, KV head) did, which stalled on each 4 KiB run (BENCHMARKS.md, eighth round). A
// bfloat16 cache (under a bfloat16 query, or a float32 one: kv_cache_dtype) is read split into
// even and odd dims (`load_split`, `piece32`). On a CPU with AVX-512 a float32 or bfloat16 cache
// takes `decode_row16`, the same chunks in 16 float lanes (thirty-fourth round), unless the CPU's
// bfloat16 dot products give more products per cycle than its FMAs: then a bfloat16 row takes
// `decode_row_bf16`, scores and values on `vdpbf16ps` (twenty-first round; `bf16_dot_chosen`).
// Other shapes take a plain loop. Work is split over rows (or (row, KV
// head) pairs when rows are few), claimed by torch's threads in runs (claims.h); the
// G = num_heads / num_kv_heads query heads of a group share every key and value they read.
//
//   query        [T, H, D]                 one query token per row (rows may be strided); the
//                                          caches' dtype, or float32 over bfloat16 caches
//   key_cache    [num_blocks, Hkv, block_size, D]   head-major blocks: one KV head's keys of
//   value_cache  [num_blocks, Hkv, block_size, D]   a block are one contiguous run (4 KiB)
//   block_table  [R, max_blocks] int32     one row per request
//   seq_lens     [T] int64                 keys visible to row t: [start, seq_lens[t])
//   rows         [T] int32 or None         row t's request (its block-table row); None: t
//   returns      [T, H, D]
#include "claims.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <optional>
#include <vector>

namespace {

using keel::hsum;
using keel::load16;
using keel::hsum8;
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

struct NextItem {  // the thread's next item: its first chunk is prefetched during this one's last
  const int32_t* row = nullptr;
  int64_t b0 = 0, nb = 0, h0 = 0;  // first block, blocks of the first chunk, first KV head
};

// The next chunk's K and V runs, a few lines at a time, spread over this chunk's work: the
// hardware prefetchers stop at 4 KiB pages and a burst of a whole chunk's prefetches stalled
// the core (measured: 1.1-1.2x on a 64-request decode over 300-930 keys). Locality 2 fetches
// into L2 (decode_row: a float32 chunk's 24 KB into L1 read level, thirty-first round), 3 into
// L1 (decode_row_bf16's 24 KB: 3-10% faster from memory than into L2, twenty-first round).
template <int Locality>
struct Prefetcher {
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
      for (int64_t l = 0; l < n; ++l) __builtin_prefetch(p + l * 64, 0, Locality);
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
                         float* acc, int64_t acc_stride, Prefetcher<3>& pf) {
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
  std::vector<uint16_t> p;        // decode_row_bf16: a chunk's weights in bfloat16
  std::vector<c10::BFloat16> zero;  // decode_row_bf16: a row of D zeros
};

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
  Prefetcher<3> pf;
  pf.bytes = nh * run * static_cast<int64_t>(sizeof(bf16));
  const bf16* kblk[kChunkBlocks];
  const bf16* vblk[kChunkBlocks];
  for (int64_t b = start / bs; b < b_end; b += cb) {
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
        // 0 on the first chunk; 1 (no call: the same bits) while the maximum holds, as it
        // mostly does past the first chunks (the scalar exp was ~2% of a long decode step).
        const float alpha = mx == w.m[x0 + g] ? 1.f : std::exp(w.m[x0 + g] - mx);
        w.m[x0 + g] = mx;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = lo16; j < hi16; j += 16) {
          const __m512 e = _mm512_loadu_ps(sg + j);
          const __mmask16 live = _mm512_cmp_ps_mask(e, _mm512_set1_ps(ninf), _CMP_NEQ_OQ);
          const v16 x = (v16)_mm512_sub_ps(e, _mm512_set1_ps(mx));
          const __m512 pf32 = _mm512_maskz_mov_ps(live, (__m512)keel::expv(x));
          const __m256bh pb = _mm512_cvtneps_pbh(pf32);
          std::memcpy(pp + g * ss + j, &pb, sizeof(pb));
          // The rounded weights, summed: pairs of (p, 1.0) products.
          sum = dp(sum, _mm512_castsi512_ps(_mm512_zextsi256_si512((__m256i)pb)), ones);
        }
        w.l[x0 + g] = w.l[x0 + g] * alpha + _mm512_reduce_add_ps(sum);
        if (alpha != 1.f) {
          float* a = w.acc.data() + (x0 + g) * D;
          const __m512 al = _mm512_set1_ps(alpha);
          for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), al));
        }
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
template <int GT, int NP, typename T>
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
    const float* pb = p + bi * bs;
    for (int64_t t = t0; t < t1; ++t) {
      __m512 x[2 * NP];
#pragma GCC unroll 2
      for (int c = 0; c < NP; ++c) piece32(vb + t * D + 32 * c, x[2 * c], x[2 * c + 1]);
#pragma GCC unroll 4
      for (int g = 0; g < GT; ++g) {
        const __m512 pg = _mm512_set1_ps(pb[g * p_stride + t]);
#pragma GCC unroll 4
        for (int c = 0; c < 2 * NP; ++c) a[g][c] = _mm512_fmadd_ps(pg, x[c], a[g][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < 2 * NP; ++c) _mm512_storeu_ps(acc + g * acc_stride + 16 * c, a[g][c]);
}

// decode_row's chunks, online softmax and prefetch (the next item's first chunk too, as in
// decode_row_bf16), in 16 lanes: scores 8 keys by up to 3 query heads at a time, values up to
// 4 heads by 64 dims. Needs D % 32 == 0 and block_size % 8 == 0.
template <typename TQ, typename T>
void decode_row16(const TQ* q, const T* k_ptr, const T* v_ptr, const int32_t* row, int64_t bs,
                  int64_t block_elems, int64_t start, int64_t len, int64_t h0, int64_t h1,
                  int64_t G, int64_t D, float scale, TQ* out, Scratch& w, const NextItem& nx,
                  const float* k_scale = nullptr, const float* v_scale = nullptr) {
  constexpr bool is_f32 = std::is_same_v<T, float>;
  constexpr bool is_i8 = std::is_same_v<T, int8_t>;  // scales: k_scale, v_scale
  constexpr bool natural = !std::is_same_v<T, c10::BFloat16>;  // lanes in dim order
  const int64_t nh = h1 - h0, nq = nh * G, run = bs * D;  // run: one head's keys of a block
  const int64_t cb = std::max<int64_t>(1, chunk_keys<T>() / bs), span = cb * bs;
  const int64_t ss = (span + 15) / 16 * 16;  // a head's scores in w.s
  const float ninf = -std::numeric_limits<float>::infinity();
  w.q.resize(nq * D);
  w.acc.assign(nq * D, 0.f);
  w.m.assign(nq, ninf);
  w.l.assign(nq, 0.f);
  w.s.resize(G * ss);
  for (int64_t x = 0; x < nq * D; x += 32) {  // the query in lane order, scaled
    for (int i = 0; i < 16; ++i) {
      w.q[x + i] = static_cast<float>(q[x + (natural ? i : 2 * i)]) * scale;
      w.q[x + 16 + i] = static_cast<float>(q[x + (natural ? 16 + i : 2 * i + 1)]) * scale;
    }
  }
  const int64_t b_end = (len + bs - 1) / bs;
  const int64_t np = D % 64 == 0 ? 2 : 1;
  const int64_t steps = nh * ((G + 2) / 3 * (span / 8) + (G + 3) / 4 * (D / (32 * np)));
  float* s = w.s.data();
  Prefetcher<is_f32 ? 2 : 3> pf;
  pf.bytes = nh * run * static_cast<int64_t>(sizeof(T));
  const T* kblk[kChunkBlocks];
  const T* vblk[kChunkBlocks];
  for (int64_t b = start / bs; b < b_end; b += cb) {
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
    for (int64_t h = h0; h < h1; ++h) {
      head_runs(k_ptr, v_ptr, row + b, nb, block_elems, h * run, kblk, vblk);
      const int64_t x0 = (h - h0) * G;
      for (int64_t g = 0; g < G; g += 3) {
        const float* qg = w.q.data() + (x0 + g) * D;
        for (int64_t j = lo8; j < hi8; j += 8) {
          pf.step();
          const T* kj = kblk[j / bs] + (j % bs) * D;  // 8 keys of one block (bs % 8 == 0)
          switch (std::min<int64_t>(G - g, 3)) {
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
        scale_by_block(s, ss, G, ksb, bs, lo8, hi8);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s + g * ss;
        for (int64_t j = lo16; j < lo; ++j) sg[j] = ninf;
        for (int64_t j = hi; j < hi16; ++j) sg[j] = ninf;
        // Online softmax: the running maximum m, sum l, and the accumulator rescaled when
        // the maximum grows.
        __m512 mv = _mm512_set1_ps(w.m[x0 + g]);
        for (int64_t j = lo16; j < hi16; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + j));
        const float mx = _mm512_reduce_max_ps(mv);
        // 0 on the first chunk; 1 (no call: the same bits) while the maximum holds.
        const float alpha = mx == w.m[x0 + g] ? 1.f : std::exp(w.m[x0 + g] - mx);
        w.m[x0 + g] = mx;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = lo16; j < hi16; j += 16) {
          const __m512 e = _mm512_loadu_ps(sg + j);
          const __mmask16 live = _mm512_cmp_ps_mask(e, _mm512_set1_ps(ninf), _CMP_NEQ_OQ);
          const v16 x = (v16)_mm512_sub_ps(e, _mm512_set1_ps(mx));
          const __m512 p = _mm512_maskz_mov_ps(live, (__m512)keel::expv(x));
          _mm512_storeu_ps(sg + j, p);
          sum = _mm512_add_ps(sum, p);
        }
        w.l[x0 + g] = w.l[x0 + g] * alpha + _mm512_reduce_add_ps(sum);
        // (past the sum; values_tile16 reads the weights of keys [lo, hi) only)
        if constexpr (is_i8) scale_by_block(sg, ss, 1, vsb, bs, lo8, hi8);
        if (alpha != 1.f) {
          float* a = w.acc.data() + (x0 + g) * D;
          const __m512 al = _mm512_set1_ps(alpha);
          for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), al));
        }
      }
      float* a = w.acc.data() + x0 * D;
      for (int64_t g = 0; g < G; g += 4)
        for (int64_t d = 0; d < D; d += 32 * np) {
          pf.step();
          const float* pg = s + g * ss;
          float* ag = a + g * D + d;
          with_tile(std::min<int64_t>(G - g, 4), np, [&](auto gt, auto np2) {
            values_tile16<gt, np2>(pg, ss, vblk, bs, D, d, lo, hi, ag, D);
          });
        }
    }
  }
  // Back in order (a bfloat16 piece's even and odd dims interleaved) and divided by the sum.
  const __m512i lo_dims = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi_dims = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                            15, 31);
  for (int64_t x = 0; x < nq; ++x) {
    const __m512 inv = _mm512_set1_ps(1.f / w.l[x]);
    for (int64_t d = 0; d < D; d += 32) {
      const float* a = w.acc.data() + x * D + d;
      __m512 y0 = _mm512_loadu_ps(a), y1 = _mm512_loadu_ps(a + 16);
      if constexpr (!natural) {
        const __m512 e = y0;
        y0 = _mm512_permutex2var_ps(e, lo_dims, y1);
        y1 = _mm512_permutex2var_ps(e, hi_dims, y1);
      }
      keel::store16(out + x * D + d, (v16)_mm512_mul_ps(y0, inv));
      keel::store16(out + x * D + d + 16, (v16)_mm512_mul_ps(y1, inv));
    }
  }
}
#else
#define KEEL_ATTN512 0
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

// One query row against its request's KV heads [h0, h1) (the G query heads of each), in one
// pass over its keys: chunks of chunk_keys<T>() keys (whole blocks), each chunk's keys and values
// of every head read together with an online softmax, so K and V stream from memory once
// and side by side. Needs D % 32 == 0 and block_size % 8 == 0.
template <typename TQ, typename T>
void decode_row(const TQ* q, const T* k_ptr, const T* v_ptr, const int32_t* row, int64_t bs,
                int64_t block_elems, int64_t start, int64_t len, int64_t h0, int64_t h1,
                int64_t G, int64_t D, float scale, TQ* out, Scratch& w,
                const float* k_scale = nullptr, const float* v_scale = nullptr) {
  constexpr bool is_i8 = std::is_same_v<T, int8_t>;  // scales: k_scale, v_scale
  const int64_t nh = h1 - h0, nq = nh * G, run = bs * D;  // run: one head's keys of a block
  const int64_t cb = std::max<int64_t>(1, chunk_keys<T>() / bs), span = cb * bs;
  const float ninf = -std::numeric_limits<float>::infinity();
  constexpr bool split = KEEL_SPLIT_BF16 && std::is_same_v<T, c10::BFloat16>;
  w.q.resize(nq * D);
  w.acc.assign(nq * D, 0.f);
  w.m.assign(nq, ninf);
  w.l.assign(nq, 0.f);
  w.s.resize(G * span);
  if constexpr (split) {  // each 16 dims as [8 even | 8 odd]
    for (int64_t x = 0; x < nq * D; x += 16)
      for (int i = 0; i < 8; ++i) {
        w.q[x + i] = static_cast<float>(q[x + 2 * i]) * scale;
        w.q[x + 8 + i] = static_cast<float>(q[x + 2 * i + 1]) * scale;
      }
  } else {
    for (int64_t x = 0; x < nq * D; x += 8) store8(w.q.data() + x, load8(q + x) * scale);
  }
  const int64_t b_end = (len + bs - 1) / bs;
  const int64_t tiles = (G + 1) / 2;
  const int64_t steps = nh * (G * span / 8 + tiles * D / 32);  // pf.step() per chunk
  float* s = w.s.data();
  Prefetcher<2> pf;
  pf.bytes = nh * run * static_cast<int64_t>(sizeof(T));
  const T* kblk[kChunkBlocks];
  const T* vblk[kChunkBlocks];
  for (int64_t b = start / bs; b < b_end; b += cb) {
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
      const int64_t x0 = (h - h0) * G;
      for (int64_t g = 0; g < G; ++g) {
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
        for (int64_t j = lo8; j < lo; ++j) sg[j] = ninf;
        for (int64_t j = hi; j < hi8; ++j) sg[j] = ninf;
        // Online softmax: the running maximum m, sum l, and the accumulator rescaled when
        // the maximum grows.
        v8 mv = keel::splat8(w.m[x0 + g]);
        for (int64_t j = lo8; j < hi8; j += 8) {
          const v8 e = load8(sg + j);
          mv = e > mv ? e : mv;
        }
        float mx = mv[0];
        for (int i = 1; i < 8; ++i) mx = std::max(mx, mv[i]);
        // 0 on the first chunk; 1 (no call: the same bits) while the maximum holds, as it
        // mostly does past the first chunks (the scalar exp was ~2% of a long decode step).
        const float alpha = mx == w.m[x0 + g] ? 1.f : std::exp(w.m[x0 + g] - mx);
        w.m[x0 + g] = mx;
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
      for (int64_t g = 0; g < G; g += 2)
        for (int64_t d = 0; d < D; d += 32) {
          pf.step();
          if (g + 1 < G)
            values_tile<2, split>(s + g * span, span, vblk, bs, D, d, lo, hi, a + g * D + d, D);
          else
            values_tile<1, split>(s + g * span, span, vblk, bs, D, d, lo, hi, a + g * D + d, D);
        }
    }
  }
  for (int64_t x = 0; x < nq; ++x) {
    const float inv = 1.f / w.l[x];
#if KEEL_SPLIT_BF16
    if constexpr (split) {
      for (int64_t d = 0; d < D; d += 16) unsplit16(w.acc.data() + x * D + d, inv, out + x * D + d);
      continue;
    }
#endif
    for (int64_t d = 0; d < D; d += 8)
      store8(out + x * D + d, load8(w.acc.data() + x * D + d) * inv);
  }
}

template <typename TQ, typename T>
void decode_kernel(const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_table,
                   const at::Tensor& seq_lens, const int32_t* rows, at::Tensor& out,
                   double scale, int64_t sliding_window, const float* k_scale = nullptr,
                   const float* v_scale = nullptr) {
  constexpr bool is_i8 = std::is_same_v<T, int8_t>;  // an int8 cache: k_scale, v_scale
  const int64_t R = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t Hkv = key_cache.size(1), bs = key_cache.size(2);
  const int64_t G = H / Hkv, max_blocks = block_table.size(1);
  const TQ* q_ptr = query.data_ptr<TQ>();
  const int64_t q_stride = query.stride(0);  // rows may be strided (views of a qkv output)
  const T* k_ptr = key_cache.data_ptr<T>();
  const T* v_ptr = value_cache.data_ptr<T>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  TQ* o_ptr = out.data_ptr<TQ>();
  const int64_t block_elems = Hkv * bs * D;  // between blocks; a head's run is bs * D

  // Common shapes take decode_row; an item is one row with all its KV heads where there are
  // rows enough to share out (its K and V then stream as whole blocks), else (row, KV head).
  const bool fast = D % 32 == 0 && bs % 8 == 0;  // any group size G
  const int64_t max_threads = std::min<int64_t>(at::get_num_threads(), R * Hkv);
  const int64_t hpi = fast && R >= 4 * max_threads ? Hkv : 1;  // KV heads per item
  const int64_t per_row = Hkv / hpi;

  // Query row r's first visible key, and its row of the block table.
  auto first_key = [&](int64_t r) {
    return sliding_window > 0 ? std::max<int64_t>(0, sl[r] - sliding_window) : int64_t{0};
  };
  auto table_row = [&](int64_t r) { return bt + (rows != nullptr ? rows[r] : r) * max_blocks; };
#if KEEL_ATTN512  // (KEEL_BF16_DOT needs AVX-512 too)
  // The first chunk of item i (if i < end and it has keys), to prefetch during the last one's.
  auto next_item = [&](int64_t i, int64_t end) {
    NextItem nx;
    if (const int64_t r2 = i / per_row; i < end && sl[r2] > first_key(r2)) {
      nx.row = table_row(r2);
      nx.b0 = first_key(r2) / bs;
      nx.nb = std::min(std::max<int64_t>(1, chunk_keys<T>() / bs), (sl[r2] + bs - 1) / bs - nx.b0);
      nx.h0 = i % per_row * hpi;
    }
    return nx;
  };
#endif
#if KEEL_BF16_DOT
  // Read once per call: the choice's environment override is a getenv.
  const bool bf16_dot = std::is_same_v<T, bf16> && std::is_same_v<TQ, bf16> && bf16_dot_chosen();
#endif
  auto run_items = [&](int64_t begin, int64_t end, Scratch& w, std::vector<float>& qf,
                       std::vector<float>& acc, std::vector<float>& scores) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / per_row, hk = item % per_row * hpi;  // query row, first kv head
      const int64_t len = sl[r], start = first_key(r);
      const int64_t n = len - start;
      if (n <= 0) continue;
      const int32_t* row = table_row(r);
      if (fast) {
#if KEEL_BF16_DOT
        if constexpr (std::is_same_v<T, bf16> && std::is_same_v<TQ, bf16>) {
          if (bf16_dot) {
            const NextItem nx = next_item(item + 1, end);
            decode_row_bf16(q_ptr + r * q_stride + hk * G * D, k_ptr, v_ptr, row, bs,
                            block_elems, start, len, hk, hk + hpi, G, D,
                            static_cast<float>(scale), o_ptr + (r * H + hk * G) * D, w, nx);
            continue;
          }
        }
#endif
#if KEEL_ATTN512
        if constexpr ((std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || is_i8) &&
                      (std::is_same_v<TQ, float> || std::is_same_v<TQ, T> || is_i8)) {
          const NextItem nx = next_item(item + 1, end);
          decode_row16<TQ, T>(q_ptr + r * q_stride + hk * G * D, k_ptr, v_ptr, row, bs,
                              block_elems, start, len, hk, hk + hpi, G, D,
                              static_cast<float>(scale), o_ptr + (r * H + hk * G) * D, w, nx,
                              k_scale, v_scale);
          continue;
        }
#endif
        decode_row<TQ, T>(q_ptr + r * q_stride + hk * G * D, k_ptr, v_ptr, row, bs, block_elems,
                          start, len, hk, hk + hpi, G, D, static_cast<float>(scale),
                          o_ptr + (r * H + hk * G) * D, w, k_scale, v_scale);
        continue;
      }
      const T* k_head = k_ptr + hk * bs * D;  // this KV head's run in block 0
      const T* v_head = v_ptr + hk * bs * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(q_ptr[r * q_stride + (hk * G + g) * D + d]) * scale;

      // Scores: [G, n]
      scores.assign(G * n, 0.f);
      for_each_slot(row, bs, D, block_elems, start, len, [&](int64_t j, int64_t off) {
        const T* k = k_head + off;
        const float ks = is_i8 ? k_scale[(k - k_ptr) / D] : 1.f;
        for (int64_t g = 0; g < G; ++g)
          scores[g * n + (j - start)] = dot(&qf[g * D], k, D) * ks;
      });
      // Softmax per query head (max subtracted for stability).
      for (int64_t g = 0; g < G; ++g) {
        float* s = &scores[g * n];
        const float m = *std::max_element(s, s + n);
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          s[j] = std::exp(s[j] - m);
          sum += s[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < n; ++j) s[j] *= inv;
      }
      // Weighted sum of values: [G, D]
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_slot(row, bs, D, block_elems, start, len, [&](int64_t j, int64_t off) {
        const T* v = v_head + off;
        const float vsc = is_i8 ? v_scale[(v - v_ptr) / D] : 1.f;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + (j - start)] * vsc;
          float* a = &acc[g * D];
          int64_t d = 0;
          for (; d + 16 <= D; d += 16) {
            const v16 sum = load16(a + d) + p * load16(v + d);
            std::memcpy(a + d, &sum, sizeof(sum));
          }
          for (; d < D; ++d) a[d] += p * static_cast<float>(v[d]);
        }
      });
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          o_ptr[(r * H + hk * G + g) * D + d] = static_cast<TQ>(acc[g * D + d]);
    }
  };
  // The threads claim runs of items (claims.h): rows' contexts differ, and so do the cores'
  // speeds on a shared host.
  const int64_t items = R * per_row;
  const int64_t threads = std::min<int64_t>(max_threads, items);
  keel::Claims claims(items, threads, 0);
  keel::on_threads(threads, [&] {
    std::vector<float> qf(G * D), acc(G * D), scores;
    Scratch w;
    int64_t end = 0;
    for (int64_t i = claims.claim(end); i < items; i = claims.claim(end))
      run_items(i, end, w, qf, acc, scores);
  });
}

}  // namespace

at::Tensor paged_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                           at::Tensor block_table, at::Tensor seq_lens,
                           std::optional<at::Tensor> rows, double scale,
                           int64_t sliding_window, std::optional<at::Tensor> key_scale,
                           std::optional<at::Tensor> value_scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "paged_attention: bad ranks");
  if (key_cache.scalar_type() == at::kChar) {
    // An int8 cache: each (block, KV head, slot) row of K and V with its float32 scale.
    TORCH_CHECK(key_scale.has_value() && value_scale.has_value(),
                "paged_attention: an int8 KV cache needs key_scale and value_scale");
    TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
                "paged_attention: an int8 KV cache under a float32 or bfloat16 query");
    const auto want = key_cache.sizes().slice(0, 3);
    for (const at::Tensor* t : {&*key_scale, &*value_scale})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == want,
                  "paged_attention: scales must be contiguous float32 [blocks, kv_heads, "
                  "block_size]");
  } else {
    TORCH_CHECK(!key_scale.has_value() && !value_scale.has_value(),
                "paged_attention: scales are for an int8 KV cache only");
  }
  // The cache holds the query's dtype, or bfloat16 under a float32 query (kv_cache_dtype).
  const bool mixed = query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() || mixed ||
                  key_cache.scalar_type() == at::kChar,
              "paged_attention: a ", key_cache.scalar_type(), " KV cache under a ",
              query.scalar_type(), " query (the cache is the query's dtype, or bfloat16 under "
              "float32)");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_attention: key and value caches differ in dtype");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "paged_attention: heads % kv_heads != 0");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && value_cache.sizes() == key_cache.sizes(),
              "paged_attention: head size or cache shapes differ");
  TORCH_CHECK(seq_lens.numel() == query.size(0), "paged_attention: one seq_len per query row");
  if (query.stride(2) != 1 || query.stride(1) != query.size(2)) query = query.contiguous();
  block_table = block_table.to(at::kInt).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  at::Tensor row_map;
  if (rows.has_value()) {
    row_map = rows->to(at::kInt).contiguous();
    TORCH_CHECK(row_map.numel() == query.size(0), "paged_attention: one row per query row");
  }
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_attention: KV cache must be contiguous");
  auto out = at::empty(query.sizes(), query.options());
  const int32_t* rows_ptr = row_map.defined() ? row_map.data_ptr<int32_t>() : nullptr;
  if (mixed) {
    decode_kernel<float, c10::BFloat16>(query, key_cache, value_cache, block_table, seq_lens,
                                        rows_ptr, out, scale, sliding_window);
    return out;
  }
  if (key_cache.scalar_type() == at::kChar) {
    const float* ks = key_scale->data_ptr<float>();
    const float* vs = value_scale->data_ptr<float>();
    if (query.scalar_type() == at::kFloat)
      decode_kernel<float, int8_t>(query, key_cache, value_cache, block_table, seq_lens,
                                   rows_ptr, out, scale, sliding_window, ks, vs);
    else
      decode_kernel<c10::BFloat16, int8_t>(query, key_cache, value_cache, block_table, seq_lens,
                                           rows_ptr, out, scale, sliding_window, ks, vs);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(),
                                  "paged_attention", [&] {
    decode_kernel<scalar_t, scalar_t>(query, key_cache, value_cache, block_table, seq_lens,
                                      rows_ptr, out, scale, sliding_window);
  });
  return out;
}
