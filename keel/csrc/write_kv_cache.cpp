// write_kv_cache: a pass's keys and values into their KV cache slots, as the attention
// layer's Python code would with index_copy_ (copied, rounded to a bfloat16 cache, or
// quantized to an int8 one with a scale per row).
//
//   write_kv_cache(key [T, Hkv, D], value, key_cache [blocks, Hkv, block_size, D], value_cache,
//                  slot_mapping [T], key_scale, value_scale)
//
// Compiled as fused_ops.cpp, whose op it was: without contracting a * b + c into an FMA.
#pragma GCC optimize("fp-contract=off")

#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

// Row t of key/value [T, Hkv, D] (rows may be strided) goes to slot slot_mapping[t] (block *
// block_size + offset) of key_cache/value_cache [num_blocks, Hkv, block_size, D], one head at
// a time. One copy per row and head, where index_copy_ paid ~35 us a call.
namespace {

using keel::load16;
using keel::v16;

// One row of D values -> int8 (round to nearest, ties to even) and its scale amax / 127, so
// that q * scale is the row to within half a scale step; a row of zeros has scale 0.
template <typename T>
inline void quantize_row(const T* src, int64_t D, int8_t* dst, float* scale) {
  v16 amax = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const v16 x = load16(src + d);
    const v16 a = x < 0 ? -x : x;
    amax = a > amax ? a : amax;
  }
  float m = 0.f;
  for (int i = 0; i < 16; ++i) m = std::max(m, amax[i]);
  for (; d < D; ++d) m = std::max(m, std::abs(static_cast<float>(src[d])));
  *scale = m / 127.f;
  const float inv = m > 0.f ? 127.f / m : 0.f;
  d = 0;
#ifdef __AVX512F__
  // The loop below, 16 at a time (the same bits: the product rounded, then to nearest even;
  // max(q, -127) gives -127 for NaN): the scalar loop took 5x the bfloat16 copy's time.
  const __m512 iv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (; d + 16 <= D; d += 16) {
    const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps((__m512)load16(src + d), iv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                     _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(
                         _mm512_min_ps(_mm512_max_ps(q, lo), hi))));
  }
#endif
  for (; d < D; ++d) {  // NaN clamps to -127 (never an undefined conversion)
    const float q = std::nearbyint(static_cast<float>(src[d]) * inv);
    dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
}

}  // namespace

void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                    at::Tensor value_cache, at::Tensor slot_mapping,
                    std::optional<at::Tensor> key_scale, std::optional<at::Tensor> value_scale) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key_cache.dim() == 4,
              "write_kv_cache: bad ranks");
  const bool quant = key_cache.scalar_type() == at::kChar;  // an int8 cache with scales
  // The cache holds the rows' dtype, or bfloat16 for float32 rows (kv_cache_dtype), which
  // are rounded as torch's .to(torch.bfloat16) rounds them.
  const bool narrow = key.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(value.scalar_type() == key.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type() &&
                  (key.scalar_type() == key_cache.scalar_type() || narrow || quant),
              "write_kv_cache: ", key.scalar_type(), " rows into a ", key_cache.scalar_type(),
              " cache (the cache is the rows' dtype, or bfloat16 for float32 rows)");
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
  TORCH_CHECK(quant == (key_scale.has_value() && value_scale.has_value()),
              "write_kv_cache: key_scale and value_scale go with an int8 cache, and only there");
  if (quant) {
    const auto want = key_cache.sizes().slice(0, 3);
    for (const at::Tensor* t : {&*key_scale, &*value_scale})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == want,
                  "write_kv_cache: scales must be contiguous float32 [blocks, kv_heads, "
                  "block_size]");
    int8_t* kc = key_cache.data_ptr<int8_t>();
    int8_t* vc = value_cache.data_ptr<int8_t>();
    float* ksc = key_scale->data_ptr<float>();
    float* vsc = value_scale->data_ptr<float>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(),
                                    "write_kv_cache", [&] {
      const scalar_t* k = key.data_ptr<scalar_t>();
      const scalar_t* v = value.data_ptr<scalar_t>();
      const int64_t ks = key.stride(0), vs = value.stride(0);
      at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t block = slots[t] / bs, off = slots[t] % bs;
          for (int64_t h = 0; h < Hkv; ++h) {
            const int64_t row = (block * Hkv + h) * bs + off;
            quantize_row(k + t * ks + h * D, D, kc + row * D, ksc + row);
            quantize_row(v + t * vs + h * D, D, vc + row * D, vsc + row);
          }
        }
      });
    });
    return;
  }
  if (narrow) {
    const float* k = key.data_ptr<float>();
    const float* v = value.data_ptr<float>();
    c10::BFloat16* kc = key_cache.data_ptr<c10::BFloat16>();
    c10::BFloat16* vc = value_cache.data_ptr<c10::BFloat16>();
    const int64_t ks = key.stride(0), vs = value.stride(0);
    auto round_row = [D](const float* src, c10::BFloat16* dst) {
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) keel::store8(dst + d, keel::load8(src + d));
      for (; d < D; ++d) dst[d] = c10::BFloat16(src[d]);
    };
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t block = slots[t] / bs, off = slots[t] % bs;
        for (int64_t h = 0; h < Hkv; ++h) {
          const int64_t dst = ((block * Hkv + h) * bs + off) * D;
          round_row(k + t * ks + h * D, kc + dst);
          round_row(v + t * vs + h * D, vc + dst);
        }
      }
    });
    return;
  }
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
