// 16-lane float vectors for keel's CPU kernels. GCC/Clang lower `v16` to AVX-512, AVX2 or SSE
// as the machine allows (the kernels are built with -march=native on the machine that runs
// them). Loads widen float / bfloat16 / half to float; stores round back the way torch does
// (bfloat16: round to nearest even), so a kernel that rounds where torch's ops round gives
// torch's numbers.
#pragma once

// ATen's core only (not torch/extension.h, which bindings.cpp alone needs): parsing the whole
// torch API took ~15 s per source file of the first-use build.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cstring>
#include <type_traits>

namespace keel {

typedef float v16 __attribute__((vector_size(64)));

// 8 lanes: one AVX2 register. GCC lowers 16-lane code badly on AVX2 where a loop mixes
// vectors with scalars (a scalar times a v16 was broadcast through 16 stack stores), so the
// hot inner loops use v8, which is native on AVX2 and AVX-512 alike.
typedef float v8 __attribute__((vector_size(32)));

// The 16- and 32-bit integer vectors of N lanes (named per N: GCC does not treat a
// vector_size that depends on a template parameter as a vector in __builtin_convertvector).
template <int N> struct lanes;
template <> struct lanes<16> {
  typedef uint16_t h __attribute__((vector_size(32)));
  typedef uint32_t u __attribute__((vector_size(64)));
  typedef int8_t b __attribute__((vector_size(16)));
};
template <> struct lanes<8> {
  typedef uint16_t h __attribute__((vector_size(16)));
  typedef uint32_t u __attribute__((vector_size(32)));
  typedef int8_t b __attribute__((vector_size(8)));
};

// Loads widen float / bfloat16 / half (and int8) to float lanes; stores round back the way
// torch does.
// V is v16 or v8 (N lanes).
template <typename V, typename T>
inline V loadv(const T* p) {
  constexpr int N = sizeof(V) / sizeof(float);
  using H = typename lanes<N>::h;
  using U = typename lanes<N>::u;
  V v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // bfloat16 is the top half of a float32: widen and shift, N at a time. One widening load
    // where the ISA has it: GCC's generic conversion of 16 lanes took four instructions.
#if defined(__AVX512F__)
    if constexpr (N == 16) {
      const __m512i w = _mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
      std::memcpy(&v, &w, sizeof(v));
      return v;
    }
#endif
#if defined(__AVX2__)
    if constexpr (N == 8) {
      const __m256i w = _mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
      std::memcpy(&v, &w, sizeof(v));
      return v;
    }
#endif
    H h;
    std::memcpy(&h, p, sizeof(h));
    const U w = __builtin_convertvector(h, U) << 16;
    std::memcpy(&v, &w, sizeof(v));
  } else if constexpr (std::is_same_v<T, int8_t>) {  // an int8 K/V cache's values, unscaled
#if defined(__AVX2__)
    // One widening load and a conversion (GCC's generic conversion of an 8-byte vector went
    // lane by lane on AVX2: 8x slower decode attention over an int8 cache).
    if constexpr (N == 8) {
      const __m256 f = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
      std::memcpy(&v, &f, sizeof(v));
      return v;
    }
#endif
    typename lanes<N>::b b;
    std::memcpy(&b, p, sizeof(b));
    v = __builtin_convertvector(b, V);
  } else {
    for (int i = 0; i < N; ++i) v[i] = static_cast<float>(p[i]);
  }
  return v;
}

// V's lanes as bfloat16 bits (N 16-bit lanes), rounded to nearest even as
// c10::BFloat16(float) rounds them; a NaN becomes the quiet NaN 0x7FC0.
template <typename V>
inline typename lanes<sizeof(V) / sizeof(float)>::h bf16_bits(V v) {
  constexpr int N = sizeof(V) / sizeof(float);
  using H = typename lanes<N>::h;
  using U = typename lanes<N>::u;
  H h;
#if defined(__AVX512BF16__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
  // One vcvtneps2bf16 rounds as c10 does, except that it reads a denormal input as zero and
  // keeps a NaN's payload: a vector with a lane of either class (vfpclassps: QNaN 0x01,
  // denormal 0x20, SNaN 0x80; none in a model's activations) takes the integer rounding
  // below. ~3 instructions per vector where that takes ~9 (bfloat16 RMSNorm and RoPE were
  // bound by it; BENCHMARKS.md, forty-eighth round).
  constexpr int kOdd = 0x01 | 0x20 | 0x80;
  if constexpr (N == 16) {
    const __m512 f = reinterpret_cast<const __m512&>(v);
    if (__builtin_expect(_mm512_fpclass_ps_mask(f, kOdd) == 0, 1)) {
      const __m256bh r = _mm512_cvtneps_pbh(f);
      std::memcpy(&h, &r, sizeof(h));
      return h;
    }
  } else if constexpr (N == 8) {
    const __m256 f = reinterpret_cast<const __m256&>(v);
    if (__builtin_expect(_mm256_fpclass_ps_mask(f, kOdd) == 0, 1)) {
      const __m128bh r = _mm256_cvtneps_pbh(f);
      std::memcpy(&h, &r, sizeof(h));
      return h;
    }
  }
#endif
  U bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const U rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16;
  return __builtin_convertvector(v != v ? U{} + 0x7FC0 : rounded, H);
}

template <typename T, typename V>
inline void storev(T* p, V v) {
  constexpr int N = sizeof(V) / sizeof(float);
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const auto h = bf16_bits(v);
    std::memcpy(p, &h, sizeof(h));
  } else {
    for (int i = 0; i < N; ++i) p[i] = static_cast<T>(v[i]);
  }
}

// v rounded to T's precision and back (a no-op for float): where torch would store a T.
template <typename T, typename V>
inline V round_tov(V v) {
  constexpr int N = sizeof(V) / sizeof(float);
  using U = typename lanes<N>::u;
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const U out = __builtin_convertvector(bf16_bits(v), U) << 16;  // storev's bits, widened
    V r;
    std::memcpy(&r, &out, sizeof(r));
    return r;
  } else {
    T tmp[N];
    storev(tmp, v);
    return loadv<V>(tmp);
  }
}

template <typename T> inline v16 load16(const T* p) { return loadv<v16>(p); }
template <typename T> inline void store16(T* p, v16 v) { storev(p, v); }
template <typename T> inline v16 round_to(v16 v) { return round_tov<T>(v); }
template <typename T> inline v8 load8(const T* p) { return loadv<v8>(p); }
template <typename T> inline void store8(T* p, v8 v) { storev(p, v); }
template <typename T> inline v8 round_to8(v8 v) { return round_tov<T>(v); }

// Keeps a loaded vector in a register (an empty asm that "changes" it): left to itself GCC
// folds a loop's vector loads into every FMA that uses them as memory operands, loading the
// same data again for each, so the loop waits on the load ports instead of the FMAs (the GEMM
// tile and prefill attention's tiles; BENCHMARKS.md, twelfth round). For a vector that fits
// one register (v8 or __m256 on AVX2; v16 needs AVX-512).
template <typename V>
__attribute__((always_inline)) inline void pin(V& v) {
  asm volatile("" : "+x"(v));
}
// Two vectors in one asm: the GEMM tile pins its two weight vectors this way; two separate
// pins changed GCC's code for the whole tile (more folded loads), unmeasured, so kept as is.
template <typename V>
__attribute__((always_inline)) inline void pin(V& a, V& b) {
  asm volatile("" : "+x"(a), "+x"(b));
}

// x in every lane. (`v8{} + x` costs a scalar add of zero before the broadcast: GCC may not
// drop it, since 0.0f + -0.0f is +0.0f.)
inline v8 splat8(float x) { return v8{x, x, x, x, x, x, x, x}; }

inline float hsum8(v8 v) {
  typedef float v4 __attribute__((vector_size(16)));
  const v4 a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  const v4 b = a + __builtin_shufflevector(a, a, 2, 3, 0, 1);
  return b[0] + b[1];
}

inline float hsum(v16 v) {  // tree reduction: 4 shuffles + adds instead of 15 scalar adds
  v = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v + __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// exp(x) for x <= 0, lane-wise (V: v16 or v8): 2^(x log2 e) split into 2^k * 2^f,
// f in [-0.5, 0.5], with a degree-6 polynomial for 2^f (relative error ~2e-7, like expf).
template <typename V>
inline V expv(V x) {
  typedef int32_t I __attribute__((vector_size(sizeof(V))));
  const V lo = V{} - 87.0f;
  x = x < lo ? lo : x;
  const V t = x * 1.4426950408889634f;
  // Round to nearest even without a per-lane call: adding and subtracting 1.5 * 2^23 leaves
  // the integer part (exact for |t| < 2^22; here t >= -126). Needs IEEE arithmetic: keel's
  // kernels are never built with -ffast-math.
  const V magic = V{} + 12582912.0f;
  const V k = (t + magic) - magic;
  const V f = (t - k) * 0.6931471805599453f;  // f = (t - k) ln 2
  V p = V{} + 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;  // e^f
  const I ki = __builtin_convertvector(k, I);
  I bits;
  std::memcpy(&bits, &p, sizeof(p));
  bits += ki << 23;  // times 2^k
  V out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline v16 exp16(v16 x) { return expv(x); }

}  // namespace keel
