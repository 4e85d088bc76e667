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
// Where a pass has several tokens of one request (a speculative step's drafts, a short prompt),
// `decode_row` and `decode_row16` take up to 16 of them as one item (`Tokens`): each key and
// value is read once for all their query heads, each token's scores past its own keys weighted
// 0, and each token's output has the bits it would have alone. On AVX-512 a group whose query
// vectors (G heads times its tokens) fill 16 lanes 12 or more at a time puts 16 of them in the
// lanes instead of a key's dims (`lanes_chunk`, paged_attention_512.h).
// This file holds that dispatch and the plain loop; the row kernels are in
// paged_attention_avx2.h (`decode_row`), paged_attention_512.h (`decode_row16`) and
// paged_attention_bf16.h (`decode_row_bf16`), their chunks and prefetch in
// paged_attention_common.h.
//
//   query        [T, H, D]                 one query token per row (rows may be strided); the
//                                          caches' dtype, or float32 over bfloat16 caches
//   key_cache    [num_blocks, Hkv, block_size, D]   head-major blocks: one KV head's keys of
//   value_cache  [num_blocks, Hkv, block_size, D]   a block are one contiguous run (4 KiB)
//   block_table  [R, max_blocks] int32     one row per request
//   seq_lens     [T] int64                 keys visible to row t: [start, seq_lens[t])
//   rows         [T] int32 or None         row t's request (its block-table row); None: t.
//                                          Consecutive tokens of a request are read together
//   returns      [T, H, D]
#include "claims.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

// The row kernels, by instruction set: shared pieces, then 8 lanes, AVX512-BF16, 16 lanes.
#include "paged_attention_common.h"
#include "paged_attention_avx2.h"
#include "paged_attention_bf16.h"
#include "paged_attention_512.h"

namespace {

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

  const bool fast = D % 32 == 0 && bs % 8 == 0;  // any group size G
#if KEEL_BF16_DOT
  // Read once per call: the choice's environment override is a getenv.
  const bool bf16_dot = std::is_same_v<T, bf16> && std::is_same_v<TQ, bf16> && bf16_dot_chosen();
#else
  constexpr bool bf16_dot = false;
#endif
  // A pass with several query tokens of a request (rows given) groups them where the row
  // kernels take groups (decode_row, decode_row16): up to kGroupTokens consecutive tokens of
  // one request, whose keys and values are read once for the group. At 64 requests of 5
  // tokens (a speculative step) over ~600 keys each, the tokens one by one read K/V five times.
  // First token of each group, then R; kept between calls (no allocation per layer once
  // grown). A reference, so that the claiming threads' lambdas see this thread's buffer.
  static thread_local std::vector<int64_t> group_buffer;
  std::vector<int64_t>& groups = group_buffer;
  groups.clear();
  if (rows != nullptr && fast && !bf16_dot) {
    for (int64_t t = 0; t < R; ++t)
      if (t == 0 || rows[t] != rows[t - 1] || t - groups.back() == kGroupTokens)
        groups.push_back(t);
    groups.push_back(R);
  }
  const int64_t NG = groups.empty() ? R : static_cast<int64_t>(groups.size()) - 1;
  auto group_first = [&](int64_t gi) { return groups.empty() ? gi : groups[gi]; };
  // Group gi's tokens: their rows of the query and output, their keys.
  auto group_tokens = [&](int64_t gi) {
    const int64_t t0 = group_first(gi);
    return Tokens{groups.empty() ? 1 : groups[gi + 1] - t0, q_stride, H * D, sl + t0,
                  sliding_window};
  };

  // Common shapes take decode_row; an item is one group (a row) with all its KV heads where
  // there are groups enough to share out (its K and V then stream as whole blocks), else
  // (group, KV head).
  const int64_t max_threads = std::min<int64_t>(at::get_num_threads(), NG * Hkv);
  const int64_t hpi = fast && NG >= 4 * max_threads ? Hkv : 1;  // KV heads per item
  const int64_t per_row = Hkv / hpi;

  // Query row r's row of the block table.
  auto table_row = [&](int64_t r) { return bt + (rows != nullptr ? rows[r] : r) * max_blocks; };
#if KEEL_ATTN512  // (KEEL_BF16_DOT needs AVX-512 too)
  // The first chunk of item i (if i < end and it has keys), to prefetch during the last one's.
  auto next_item = [&](int64_t i, int64_t end) {
    NextItem nx;
    if (i >= end) return nx;
    const int64_t g2 = i / per_row;
    if (const auto [start2, len2] = group_tokens(g2).keys(); len2 > start2) {
      const int64_t cb = std::max<int64_t>(1, chunk_keys<T>() / bs);  // as the row kernels
      nx.row = table_row(group_first(g2));
      nx.b0 = start2 / bs / cb * cb;
      nx.nb = std::min(cb, (len2 + bs - 1) / bs - nx.b0);
      nx.h0 = i % per_row * hpi;
    }
    return nx;
  };
#endif
  const int64_t items = NG * per_row;
  const int64_t threads = std::min<int64_t>(max_threads, items);
  keel::Claims claims(items, threads, 0);
  // Item `item`; `following` is the item this thread takes next (items: none), whose first
  // chunk the row kernels prefetch during this one's last.
  auto run_item = [&](int64_t item, int64_t following, Scratch& w, std::vector<float>& qf,
                      std::vector<float>& acc, std::vector<float>& scores) {
    const int64_t gi = item / per_row, hk = item % per_row * hpi;  // group, first kv head
    const int64_t r = group_first(gi);  // its first query row
    const Tokens tk = group_tokens(gi);
    const auto [start, len] = tk.keys();
    const int64_t n = len - start;
    if (n <= 0) return;
    const int32_t* row = table_row(r);
    if (fast) {
#if KEEL_BF16_DOT
      if constexpr (std::is_same_v<T, bf16> && std::is_same_v<TQ, bf16>) {
        if (bf16_dot) {
          const NextItem nx = next_item(following, items);
          decode_row_bf16(q_ptr + r * q_stride + hk * G * D, k_ptr, v_ptr, row, bs,
                          block_elems, start, len, hk, hk + hpi, G, D,
                          static_cast<float>(scale), o_ptr + (r * H + hk * G) * D, w, nx);
          return;
        }
      }
#endif
#if KEEL_ATTN512
      if constexpr ((std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || is_i8) &&
                    (std::is_same_v<TQ, float> || std::is_same_v<TQ, T> || is_i8)) {
        const NextItem nx = next_item(following, items);
        decode_row16<TQ, T>(q_ptr + r * q_stride + hk * G * D, k_ptr, v_ptr, row, bs,
                            block_elems, start, len, hk, hk + hpi, G, D,
                            static_cast<float>(scale), o_ptr + (r * H + hk * G) * D, w, nx,
                            tk, k_scale, v_scale);
        return;
      }
#endif
      decode_row<TQ, T>(q_ptr + r * q_stride + hk * G * D, k_ptr, v_ptr, row, bs, block_elems,
                        start, len, hk, hk + hpi, G, D, static_cast<float>(scale),
                        o_ptr + (r * H + hk * G) * D, w, tk, k_scale, v_scale);
      return;
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
  };
  // The threads claim runs of items (claims.h): rows' contexts differ, and so do the cores'
  // speeds on a shared host. Before the last item of its run a thread claims its next run, so
  // that the item prefetches the next run's first one (as claims.h run_panel_groups does for a
  // GEMM's panels). Prefetched only within a run, the first row of each run (~13 of a layer's
  // 64 at 2 threads) waited on memory: 64 rows of 40-60 keys over 30 layers' bfloat16 caches
  // ran 1.06x faster this way, of 50-179 keys 1.03x (BENCHMARKS.md, sixty-fourth round).
  keel::on_threads(threads, [&] {
    std::vector<float> qf(G * D), acc(G * D), scores;
    Scratch w;
    int64_t end = 0;
    for (int64_t item = claims.claim(end); item < items;) {
      int64_t following = item + 1, following_end = end;
      if (following == end) following = claims.claim(following_end);
      run_item(item, following, w, qf, acc, scores);
      item = following;
      end = following_end;
    }
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

bool attention_prefetch_into_l2(std::optional<bool> set) {
  if (set.has_value()) attention_prefetch_l2_flag().store(*set, std::memory_order_relaxed);
  return attention_prefetch_l2();
}
