// Paged attention on the CPU, one query token per row: decode rows, and the rows of short
// prompts (each query token of a prompt is a row whose keys end at its own position).
//
// Reads each row's keys and values straight from its request's KV blocks through the block
// table: no gathered copy of the context, one pass over K (scores) and one over V (weighted
// sum). Work is split over (row, kv head) pairs with at::parallel_for (torch's own threads);
// the G = num_heads / num_kv_heads query heads of a group share every key and value they read.
//
//   query        [T, H, D]                 one query token per row (rows may be strided)
//   key_cache    [num_blocks, Hkv, block_size, D]   head-major blocks: one KV head's keys of
//   value_cache  [num_blocks, Hkv, block_size, D]   a block are one contiguous run (4 KiB)
//   block_table  [R, max_blocks] int32     one row per request
//   seq_lens     [T] int64                 keys visible to row t: [start, seq_lens[t])
//   rows         [T] int32 or None         row t's request (its block-table row); None: t
//   returns      [T, H, D]
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace {

using keel::hsum;
using keel::load16;
using keel::hsum8;
using keel::load8;
using keel::v16;
using keel::v8;
constexpr int64_t kMaxGroup = 16;  // query heads per KV head kept in registers
constexpr int64_t kItemCost = 16;  // an item's fixed cost beside its keys, in keys

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
// With `ahead` set (the head's base pointer), it also asks for the next block's run of this
// head (bs * D elements of `elem` bytes, into L2) as it enters a block: walking the blocks is
// latency-bound, one core waits on memory far below its bandwidth unless loads start early.
template <typename F>
inline void for_each_slot(const int32_t* row, int64_t bs, int64_t D, int64_t block_elems,
                          int64_t start, int64_t len, F&& f, const char* ahead = nullptr,
                          int64_t elem = 0) {
  for (int64_t b = start / bs; b * bs < len; ++b) {
    if (ahead != nullptr && (b + 1) * bs < len) {
      const char* next = ahead + static_cast<int64_t>(row[b + 1]) * block_elems * elem;
      for (int64_t off = 0; off < bs * D * elem; off += 64) __builtin_prefetch(next + off, 0, 2);
    }
    const int64_t base = static_cast<int64_t>(row[b]) * block_elems;
    const int64_t t0 = std::max<int64_t>(start - b * bs, 0);
    const int64_t t1 = std::min<int64_t>(len - b * bs, bs);
    for (int64_t t = t0; t < t1; ++t) f(b * bs + t, base + t * D);
  }
}

template <int D, typename T>
void decode_item(const T* q, const T* k_ptr, const T* v_ptr, const int32_t* row, int64_t bs,
                 int64_t block_elems, int64_t start, int64_t len, int64_t G, float scale,
                 float* scores, T* out) {
  constexpr int C = D / 8;  // 8-lane chunks of a head
  const int64_t n = len - start;
  v8 qv[kMaxGroup][C];  // the G query heads of this group, pre-scaled
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load8(q + g * D + c * 8) * scale;
  for_each_slot(row, bs, D, block_elems, start, len, [&](int64_t j, int64_t off) {
    const T* k = k_ptr + off;
    // Ask for the value row now: the value pass below then finds it in cache instead of
    // waiting on memory for each row (it was half of this kernel's time).
    const char* v_row = reinterpret_cast<const char*>(v_ptr + off);
    for (int b = 0; b < D * static_cast<int>(sizeof(T)); b += 64) __builtin_prefetch(v_row + b, 0, 2);
    v8 kk[C];
    for (int c = 0; c < C; ++c) kk[c] = load8(k + c * 8);
    for (int64_t g = 0; g < G; ++g) {
      v8 a = qv[g][0] * kk[0], b = qv[g][1] * kk[1];  // two chains
      for (int c = 2; c < C; c += 2) {
        a += qv[g][c] * kk[c];
        b += qv[g][c + 1] * kk[c + 1];
      }
      scores[g * n + (j - start)] = hsum8(a + b);
    }
  }, reinterpret_cast<const char*>(k_ptr), sizeof(T));
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n;
    float m = s[0];
    for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
    float sum = 0.f;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      v16 e = keel::exp16(load16(s + j) - m);
      std::memcpy(s + j, &e, sizeof(e));
      sum += hsum(e);
    }
    for (; j < n; ++j) {
      s[j] = std::exp(s[j] - m);
      sum += s[j];
    }
    const float inv = 1.f / sum;
    for (j = 0; j < n; ++j) s[j] *= inv;
  }
  for (int64_t g = 0; g < G; ++g) {
    v8 acc[C] = {};
    const float* p = scores + g * n;
    for_each_slot(row, bs, D, block_elems, start, len, [&](int64_t j, int64_t off) {
      const T* v = v_ptr + off;
      const v8 w = keel::splat8(p[j - start]);
      for (int c = 0; c < C; ++c) acc[c] += w * load8(v + c * 8);
    });
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < 8; ++i) out[g * D + c * 8 + i] = static_cast<T>(acc[c][i]);
  }
}

template <typename T>
void decode_kernel(const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_table,
                   const at::Tensor& seq_lens, const int32_t* rows, at::Tensor& out,
                   double scale, int64_t sliding_window) {
  const int64_t R = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t Hkv = key_cache.size(1), bs = key_cache.size(2);
  const int64_t G = H / Hkv, max_blocks = block_table.size(1);
  const T* q_ptr = query.data_ptr<T>();
  const int64_t q_stride = query.stride(0);  // rows may be strided (views of a qkv output)
  const T* k_ptr = key_cache.data_ptr<T>();
  const T* v_ptr = value_cache.data_ptr<T>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t block_elems = Hkv * bs * D;  // between blocks; a head's run is bs * D

  auto run_items = [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / Hkv, hk = item % Hkv;  // query row, kv head
      const int64_t len = sl[r];
      const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - start;
      if (n <= 0) continue;
      const int32_t* row = bt + (rows != nullptr ? rows[r] : r) * max_blocks;
      const T* k_head = k_ptr + hk * bs * D;  // this KV head's run in block 0
      const T* v_head = v_ptr + hk * bs * D;
      if (G <= kMaxGroup && (D == 64 || D == 128)) {
        // Common head sizes: accumulators in registers, vectorised exp.
        scores.resize(G * n);
        const T* q = q_ptr + r * q_stride + hk * G * D;
        T* o = o_ptr + (r * H + hk * G) * D;
        const auto item_fn = D == 64 ? decode_item<64, T> : decode_item<128, T>;
        item_fn(q, k_head, v_head, row, bs, block_elems, start, len, G,
                static_cast<float>(scale), scores.data(), o);
        continue;
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(q_ptr[r * q_stride + (hk * G + g) * D + d]) * scale;

      // Scores: [G, n]
      scores.assign(G * n, 0.f);
      for_each_slot(row, bs, D, block_elems, start, len, [&](int64_t j, int64_t off) {
        const T* k = k_head + off;
        for (int64_t g = 0; g < G; ++g) scores[g * n + (j - start)] = dot(&qf[g * D], k, D);
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
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + (j - start)];
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
          o_ptr[(r * H + hk * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  };
  // Each thread takes a contiguous range of (row, kv head) items holding an equal share of
  // the keys to read (rows' contexts differ: an even split by count left one thread waiting).
  const int64_t items = R * Hkv;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  if (threads <= 1) {
    at::parallel_for(0, items, 1, run_items);
    return;
  }
  std::vector<int64_t> cost(items + 1, 0);  // keys read before item i, plus a fixed cost
  for (int64_t i = 0; i < items; ++i) {
    const int64_t len = sl[i / Hkv];
    const int64_t n = sliding_window > 0 ? std::min(len, sliding_window) : len;
    cost[i + 1] = cost[i] + std::max<int64_t>(n, 0) + kItemCost;
  }
  auto bound = [&](int64_t t) {  // the first item of thread t's share
    return static_cast<int64_t>(
        std::lower_bound(cost.begin(), cost.end(), cost[items] * t / threads) - cost.begin());
  };
  at::parallel_for(0, threads, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) run_items(bound(t), bound(t + 1));
  });
}

}  // namespace

at::Tensor paged_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                           at::Tensor block_table, at::Tensor seq_lens,
                           std::optional<at::Tensor> rows, double scale,
                           int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "paged_attention: bad ranks");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "paged_attention: dtype mismatch");
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(),
                                  "paged_attention", [&] {
    decode_kernel<scalar_t>(query, key_cache, value_cache, block_table, seq_lens, rows_ptr, out,
                            scale, sliding_window);
  });
  return out;
}

// Writes this pass's keys and values into their cache slots: row t of key/value [T, Hkv, D]
// (rows may be strided) goes to slot slot_mapping[t] (block * block_size + offset) of
// key_cache/value_cache [num_blocks, Hkv, block_size, D], one head at a time. One copy per row
// and head, where index_copy_ paid ~35 us a call.
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                    at::Tensor value_cache, at::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key_cache.dim() == 4,
              "write_kv_cache: bad ranks");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
              value.scalar_type() == key_cache.scalar_type(), "write_kv_cache: dtype mismatch");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes(),
              "write_kv_cache: KV caches must be contiguous and alike");
  const int64_t T = key.size(0), Hkv = key_cache.size(1), bs = key_cache.size(2);
  const int64_t D = key_cache.size(3);
  TORCH_CHECK(key.size(1) == Hkv && key.size(2) == D && value.sizes() == key.sizes(),
              "write_kv_cache: rows do not match the cache");
  if (key.stride(2) != 1 || key.stride(1) != D) key = key.contiguous();
  if (value.stride(2) != 1 || value.stride(1) != D) value = value.contiguous();
  slot_mapping = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slot_mapping.numel() >= T, "write_kv_cache: one slot per row");
  const int64_t num_slots = key_cache.size(0) * bs;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv_cache: slot ", slots[t],
                " outside the cache of ", num_slots, " slots");
  const int64_t es = key.element_size(), bytes = D * es;
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t ks = key.stride(0) * es, vs = value.stride(0) * es;
  // On the threads: a decode step's first write to a cache page faults it in (~3-5 us on
  // these VMs, ~700 pages a step at 64 requests), and the threads fault in parallel.
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slots[t] / bs, off = slots[t] % bs;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t dst = ((block * Hkv + h) * bs + off) * bytes;
        std::memcpy(kc + dst, k + t * ks + h * bytes, bytes);
        std::memcpy(vc + dst, v + t * vs + h * bytes, bytes);
      }
    }
  });
}
