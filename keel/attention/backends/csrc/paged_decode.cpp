// Paged attention for decode rows (one query token per request) on the CPU.
//
// Reads each request's keys and values straight from its KV blocks through the block table:
// no gathered copy of the context, one pass over K (scores) and one over V (weighted sum).
// Work is split over (request, kv head) pairs with at::parallel_for (torch's own threads); the
// G = num_heads / num_kv_heads query heads of a group share every key and value they read.
//
//   query        [R, H, D]                 this pass's query of each request
//   key_cache    [num_blocks, block_size, Hkv, D]
//   value_cache  [num_blocks, block_size, Hkv, D]
//   block_table  [R, max_blocks] int32
//   seq_lens     [R] int64                 keys visible to request r: [start, seq_lens[r])
//   returns      [R, H, D]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// 16 floats as one value: GCC/Clang lower it to AVX-512, AVX2 or SSE as the machine allows.
typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t kMaxGroup = 16;  // query heads per KV head kept in registers

typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

template <typename T>
inline v16 load16(const T* p) {
  v16 v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // bfloat16 is the top half of a float32: widen and shift, 16 at a time.
    u16x16 h;
    std::memcpy(&h, p, sizeof(h));
    const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    std::memcpy(&v, &w, sizeof(v));
  } else {
    for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  }
  return v;
}

inline float hsum(v16 v) {  // tree reduction: 4 shuffles + adds instead of 15 scalar adds
  v = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v + __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
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

// Visits the cache slots of keys [start, len) of one request, block by block through its row
// of the block table: f(j, slot) for key position j. One table read per block and no division
// per token (block_size is only known at run time).
template <typename F>
inline void for_each_slot(const int32_t* row, int64_t bs, int64_t start, int64_t len, F&& f) {
  for (int64_t b = start / bs; b * bs < len; ++b) {
    const int64_t base = static_cast<int64_t>(row[b]) * bs;
    const int64_t t0 = std::max<int64_t>(start - b * bs, 0);
    const int64_t t1 = std::min<int64_t>(len - b * bs, bs);
    for (int64_t t = t0; t < t1; ++t) f(b * bs + t, base + t);
  }
}

// exp(x) for x <= 0 on 16 lanes: 2^(x log2 e) split into 2^k * 2^f, f in [-0.5, 0.5],
// with a degree-6 polynomial for 2^f (relative error ~2e-7, like expf).
inline v16 exp16(v16 x) {
  const v16 lo = v16{} - 87.0f;
  x = x < lo ? lo : x;
  v16 t = x * 1.4426950408889634f;
  v16 k;
  for (int i = 0; i < 16; ++i) k[i] = __builtin_roundevenf(t[i]);
  const v16 f = (t - k) * 0.6931471805599453f;  // f = (t - k) ln 2
  v16 p = v16{} + 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;  // e^f
  typedef int32_t i32x16 __attribute__((vector_size(64)));
  const i32x16 ki = __builtin_convertvector(k, i32x16);
  i32x16 bits;
  std::memcpy(&bits, &p, sizeof(p));
  bits += ki << 23;  // times 2^k
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <int D, typename T>
void decode_item(const T* q, const T* k_ptr, const T* v_ptr, const int32_t* row, int64_t bs,
                 int64_t tok_stride, int64_t start, int64_t len, int64_t G, float scale,
                 float* scores, T* out) {
  constexpr int C = D / 16;
  const int64_t n = len - start;
  v16 qv[kMaxGroup][C];  // the G query heads of this group, pre-scaled
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load16(q + g * D + c * 16) * scale;
  for_each_slot(row, bs, start, len, [&](int64_t j, int64_t slot) {
    const T* k = k_ptr + slot * tok_stride;
    v16 kk[C];
    for (int c = 0; c < C; ++c) kk[c] = load16(k + c * 16);
    for (int64_t g = 0; g < G; ++g) {
      v16 a = qv[g][0] * kk[0];
      for (int c = 1; c < C; ++c) a += qv[g][c] * kk[c];
      scores[g * n + (j - start)] = hsum(a);
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n;
    float m = s[0];
    for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
    float sum = 0.f;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      v16 e = exp16(load16(s + j) - m);
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
    v16 acc[C] = {};
    const float* p = scores + g * n;
    for_each_slot(row, bs, start, len, [&](int64_t j, int64_t slot) {
      const T* v = v_ptr + slot * tok_stride;
      const float w = p[j - start];
      for (int c = 0; c < C; ++c) acc[c] += w * load16(v + c * 16);
    });
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < 16; ++i) out[g * D + c * 16 + i] = static_cast<T>(acc[c][i]);
  }
}

template <typename T>
void decode_kernel(const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_table,
                   const at::Tensor& seq_lens, at::Tensor& out, double scale,
                   int64_t sliding_window) {
  const int64_t R = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = key_cache.size(1), Hkv = key_cache.size(2);
  const int64_t G = H / Hkv, max_blocks = block_table.size(1);
  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = key_cache.data_ptr<T>();
  const T* v_ptr = value_cache.data_ptr<T>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t tok_stride = Hkv * D;  // between consecutive tokens of a block

  at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / Hkv, hk = item % Hkv;
      const int64_t len = sl[r];
      const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - start;
      if (n <= 0) continue;
      const int32_t* row = bt + r * max_blocks;
      if (G <= kMaxGroup && (D == 64 || D == 128)) {
        // Common head sizes: accumulators in registers, vectorised exp.
        scores.resize(G * n);
        const T* q = q_ptr + (r * H + hk * G) * D;
        T* o = o_ptr + (r * H + hk * G) * D;
        const auto item_fn = D == 64 ? decode_item<64, T> : decode_item<128, T>;
        item_fn(q, k_ptr + hk * D, v_ptr + hk * D, row, bs, tok_stride, start, len, G,
                static_cast<float>(scale), scores.data(), o);
        continue;
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(q_ptr[(r * H + hk * G + g) * D + d]) * scale;

      // Scores: [G, n]
      scores.assign(G * n, 0.f);
      for_each_slot(row, bs, start, len, [&](int64_t j, int64_t slot) {
        const T* k = k_ptr + slot * tok_stride + hk * D;
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
      for_each_slot(row, bs, start, len, [&](int64_t j, int64_t slot) {
        const T* v = v_ptr + slot * tok_stride + hk * D;
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
  });
}

}  // namespace

at::Tensor paged_decode(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                        at::Tensor block_table, at::Tensor seq_lens, double scale,
                        int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "paged_decode: bad ranks");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "paged_decode: dtype mismatch");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "paged_decode: heads % kv_heads != 0");
  query = query.contiguous();
  block_table = block_table.to(at::kInt).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_decode: KV cache must be contiguous");
  auto out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(),
                                  "paged_decode", [&] {
    decode_kernel<scalar_t>(query, key_cache, value_cache, block_table, seq_lens, out, scale,
                            sliding_window);
  });
  return out;
}
