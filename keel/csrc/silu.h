// silu(g) = g * sigmoid(g) in 16 AVX-512 lanes: the one definition that silu_and_mul
// (fused_ops.cpp) and the AMX GEMM's silu epilogue (amx_gemm.cpp) share, so that the two give
// the same bits. Explicit intrinsics only (no a * b + c left for the compiler to contract):
// fused_ops.cpp is built without contraction and amx_gemm.cpp with it.
#pragma once

#include <c10/util/BFloat16.h>

#include <type_traits>

#ifdef __AVX512F__
#include <immintrin.h>

namespace keel {

// silu8's numbers (fused_ops.cpp) in 16 AVX-512 lanes at ~2.4x its speed ([2048, 1536]
// bfloat16: 2.2 -> 0.9 ms; BENCHMARKS.md, nineteenth round): FMAs in exp's polynomial, 2^k by
// vscalefps, and 1 / (1 + e) by vrcp14ps and one Newton step instead of a division. Within
// ~3e-7 of silu8 (the test's float32 tolerance is 1e-6).
inline __m512 silu16(__m512 g) {
  const __m512 log2e = _mm512_set1_ps(1.4426950408889634f);
  const __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)),
                                 _mm512_set1_ps(-87.0f));  // -|g|
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // f = (x log2 e - k) ln 2, its product unrounded (one explicit fmsub, nothing to contract)
  const __m512 f = _mm512_mul_ps(_mm512_fmsub_ps(x, log2e, k), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512 ex = _mm512_scalef_ps(p, k);  // exp(-|g|) in (0, 1]
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), ex);
  __m512 r = _mm512_rcp14_ps(den);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(den, r, _mm512_set1_ps(2.0f)));
  // sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below
  const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mul_ps(g, _mm512_mask_mul_ps(r, neg, r, ex));
}

template <typename T>
inline __m512 load_ps16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
}

}  // namespace keel
#endif
