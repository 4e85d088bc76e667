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
#include <cstring>
#include <type_traits>

namespace keel {

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

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

template <typename T>
inline void store16(T* p, v16 v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // Round to nearest even, as c10::BFloat16(float) does; NaN stays a quiet NaN.
    u32x16 bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const u32x16 rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16;
    const u32x16 nan = u32x16{} + 0x7FC0;
    const u32x16 out = v != v ? nan : rounded;
    const u16x16 h = __builtin_convertvector(out, u16x16);
    std::memcpy(p, &h, sizeof(h));
  } else {
    for (int i = 0; i < 16; ++i) p[i] = static_cast<T>(v[i]);
  }
}

// v rounded to T's precision and back (a no-op for float): where torch would store a T.
template <typename T>
inline v16 round_to(v16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    u32x16 bits;  // store16's rounding, kept in the top half of a float32
    std::memcpy(&bits, &v, sizeof(bits));
    const u32x16 rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000u;
    const u32x16 out = v != v ? u32x16{} + 0x7FC00000u : rounded;
    v16 r;
    std::memcpy(&r, &out, sizeof(r));
    return r;
  } else {
    T tmp[16];
    store16(tmp, v);
    return load16(tmp);
  }
}

// 8 lanes: one AVX2 register. GCC lowers 16-lane code badly on AVX2 where a loop mixes
// vectors with scalars (a scalar times a v16 was broadcast through 16 stack stores), so the
// paged-attention inner loops use v8, which is native on AVX2 and AVX-512 alike.
typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

template <typename T>
inline v8 load8(const T* p) {
  v8 v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    u16x8 h;
    std::memcpy(&h, p, sizeof(h));
    const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    std::memcpy(&v, &w, sizeof(v));
  } else {
    for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  }
  return v;
}

template <typename T>
inline void store8(T* p, v8 v) {  // store16's rounding, 8 lanes
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    u32x8 bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const u32x8 rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16;
    const u32x8 out = v != v ? u32x8{} + 0x7FC0 : rounded;
    const u16x8 h = __builtin_convertvector(out, u16x8);
    std::memcpy(p, &h, sizeof(h));
  } else {
    for (int i = 0; i < 8; ++i) p[i] = static_cast<T>(v[i]);
  }
}

template <typename T>
inline v8 round_to8(v8 v) {  // round_to, 8 lanes
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    u32x8 bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const u32x8 rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000u;
    const u32x8 out = v != v ? u32x8{} + 0x7FC00000u : rounded;
    v8 r;
    std::memcpy(&r, &out, sizeof(r));
    return r;
  } else {
    T tmp[8];
    store8(tmp, v);
    return load8(tmp);
  }
}

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
