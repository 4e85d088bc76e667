// Shared by keel's quantized matmul kernels (quant_gemm.cpp: float32 activations;
// quant_gemm_q8.cpp: integer activations). AVX2 + FMA + F16C only.
#pragma once

#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cstdint>

namespace keel::quant {

inline constexpr int64_t kMaxRows = 4;

inline void check_x(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "quantized gemm: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "quantized gemm: 1 to ", kMaxRows,
              " rows per call");
  TORCH_CHECK(x.size(1) == k, "quantized gemm: x has ", x.size(1), " columns, weight ", k);
}

// The int4 weight's arguments: q uint8 [N, K/2] with K a multiple of 32, d and m contiguous
// float32 or float16 [N, K/32] of one type. `what` names the kernel in the error.
inline void check_int4(const char* what, const at::Tensor& q, const at::Tensor& d,
                       const at::Tensor& mins) {
  const int64_t n = q.size(0), k = q.size(1) * 2, groups = k / 32;
  TORCH_CHECK(k % 32 == 0 && q.scalar_type() == at::kByte && q.is_contiguous(), what,
              ": q must be contiguous uint8 [N, K/2] with K a multiple of 32");
  const auto st = d.scalar_type();
  TORCH_CHECK(d.is_contiguous() && mins.is_contiguous() && mins.scalar_type() == st &&
              (st == at::kFloat || st == at::kHalf) && d.numel() == n * groups &&
              mins.numel() == n * groups,
              what, ": d and m must be contiguous float32 or float16 [N, K/32]");
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 bytes (unsigned / signed) -> 8 floats
inline __m256 widen_u8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
inline __m256 widen_i8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }

inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t h) { return _cvtsh_ss(h); }  // F16C

}  // namespace keel::quant
