// Fused elementwise ops of the decoder layers on the CPU: one pass over memory and one op call
// where the torch expressions take 5-15 ops each (at 64 decode rows the per-op overhead, not
// the arithmetic, is what those cost).
//
// Each op rounds where the torch expression it replaces rounds (to the model's dtype after each
// step), and is compiled without contracting a * b + c into an FMA, so float32 results match
// the torch expressions up to the order of the variance sum (a few ulp).
//
//   rms_norm(x [T, N], weight [N], eps) -> [T, N]
//   fused_add_rms_norm_(x [T, N], residual [T, N], weight [N], eps)
//       residual <- x + residual;  x <- rms_norm(residual)           (in place, both)
//   rotary_neox_(positions [T], q [T, Hq * D], k [T, Hk * D], cos [P, rot], sin [P, rot], D)
//       rotate-half RoPE on the first `rot` dims of every head, in place (rows may be strided)
//   silu_and_mul(x [T, 2I]) -> [T, I]  =  silu(x[:, :I]) * x[:, I:]
//   argmax_rows(x [T, N]) -> [T]  (a greedy step's tokens)
// (write_kv_cache, a pass's K/V to its slots, is in write_kv_cache.cpp.)
// Its own translation unit, so this applies to every function in it (the helpers of vec.h
// included).
#pragma GCC optimize("fp-contract=off")

#include "ops.h"
#include "silu.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using keel::load16;
using keel::round_to;
using keel::store16;
using keel::v16;

inline int64_t grain_rows(int64_t row_elems) {  // ~16k elements per task
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1));
}

// The normalisation of one row, in float32 as transformers' RMSNorm computes it:
// y = x * rsqrt(mean(x^2) + eps) rounded to T, then weight * y rounded to T.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
#ifndef __AVX512F__  // with AVX-512 the 16-lane code below is native (and gives these bits)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    // 8-lane vectors (see vec.h), summed in the 16-lane order below: the same bits.
    keel::v8 lo = {}, hi = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const keel::v8 a = keel::load8(x + i), b = keel::load8(x + i + 8);
      lo += a * a;
      hi += b * b;
    }
    float ss = keel::hsum8(lo + hi);
    for (; i < n; ++i) ss += static_cast<float>(x[i]) * static_cast<float>(x[i]);
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    const keel::v8 rv = keel::v8{} + r;
    for (i = 0; i + 8 <= n; i += 8)
      keel::store8(out + i, keel::load8(w + i) * keel::round_to8<T>(keel::load8(x + i) * rv));
    for (; i < n; ++i)
      out[i] = static_cast<T>(static_cast<float>(w[i]) *
                              static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * r)));
    return;
  }
#endif
  v16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 v = load16(x + i);
    acc += v * v;
  }
  float ss = keel::hsum(acc);
  for (; i < n; ++i) ss += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (i = 0; i + 16 <= n; i += 16)
    store16(out + i, load16(w + i) * round_to<T>(load16(x + i) * r));
  for (; i < n; ++i)
    out[i] = static_cast<T>(static_cast<float>(w[i]) *
                            static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * r)));
}

template <typename T>
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * n, wp, op + r * n, n, eps);
  });
}

template <typename T>
void fused_add_rms_norm_kernel(at::Tensor& x, at::Tensor& res, const at::Tensor& w, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = res.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* xr = xp + r * n;
      T* rr = rp + r * n;
      int64_t i = 0;
#ifndef __AVX512F__
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
        for (; i + 8 <= n; i += 8) keel::store8(rr + i, keel::load8(xr + i) + keel::load8(rr + i));
      }
#endif
      for (; i + 16 <= n; i += 16) store16(rr + i, load16(xr + i) + load16(rr + i));
      for (; i < n; ++i)
        rr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
      norm_row(rr, wp, xr, n, eps);
    }
  });
}

// One head: x1 = x[:h], x2 = x[h:2h] (h = rot / 2);
// x1 <- x1 * cos[:h] + (-x2) * sin[:h];  x2 <- x2 * cos[h:] + x1 * sin[h:]   (rounded as torch)
template <typename T>
inline void rotate_head(T* x, const T* c, const T* s, int64_t half) {
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const v16 x1 = load16(x + i), x2 = load16(x + half + i);
    const v16 a = round_to<T>(x1 * load16(c + i)) + round_to<T>(-x2 * load16(s + i));
    const v16 b = round_to<T>(x2 * load16(c + half + i)) + round_to<T>(x1 * load16(s + half + i));
    store16(x + i, a);
    store16(x + half + i, b);
  }
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
    const float a = static_cast<float>(static_cast<T>(x1 * static_cast<float>(c[i]))) +
                    static_cast<float>(static_cast<T>(-x2 * static_cast<float>(s[i])));
    const float b = static_cast<float>(static_cast<T>(x2 * static_cast<float>(c[half + i]))) +
                    static_cast<float>(static_cast<T>(x1 * static_cast<float>(s[half + i])));
    x[i] = static_cast<T>(a);
    x[half + i] = static_cast<T>(b);
  }
}

template <typename T>
void rotary_kernel(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                   const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim) {
  const int64_t tokens = q.size(0), rot = cos.size(1), half = rot / 2;
  const int64_t hq = q.size(1) / head_dim, hk = k.size(1) / head_dim;
  const int64_t qs = q.stride(0), ks = k.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows((hq + hk) * head_dim), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* c = cp + pos[t] * rot;
      const T* s = sp + pos[t] * rot;
      for (int64_t h = 0; h < hq; ++h) rotate_head(qp + t * qs + h * head_dim, c, s, half);
      for (int64_t h = 0; h < hk; ++h) rotate_head(kp + t * ks + h * head_dim, c, s, half);
    }
  });
}

// silu(g) = g * sigmoid(g) in 8 lanes, sigmoid from exp(-|g|) in (0, 1] (no overflow).
inline keel::v8 silu8(keel::v8 gv) {
  const keel::v8 ax = gv < 0 ? -gv : gv;
  const keel::v8 ex = keel::expv(-ax);
  const keel::v8 num = gv < 0 ? ex : keel::v8{} + 1.0f;
  return gv * (num / (1.0f + ex));
}


// silu(g) = g * sigmoid(g), with sigmoid from exp(-|g|) (no overflow); rounded to T, then
// times up, rounded to T: torch's `act(gate) * up` in T.
template <typename T>
void silu_and_mul_kernel(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), inter = out.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(inter), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = xp + r * xs;
      const T* u = g + inter;
      T* o = op + r * inter;
      int64_t i = 0;
#ifndef __AVX512F__  // with AVX-512 the 16-lane loop below is native and ~1.5x faster
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
        for (; i + 8 <= inter; i += 8) {  // 8 lanes: native on AVX2 (see vec.h)
          keel::store8(o + i, keel::round_to8<T>(silu8(keel::load8(g + i))) *
                                  keel::load8(u + i));
        }
      }
#endif
#ifdef __AVX512F__
#ifdef __AVX512BF16__
      constexpr bool fast = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#else
      constexpr bool fast = std::is_same_v<T, float>;
#endif
      if constexpr (fast) {
        for (; i + 16 <= inter; i += 16) {
          const __m512 sv = keel::silu16(keel::load_ps16(g + i));
          if constexpr (std::is_same_v<T, float>) {
            _mm512_storeu_ps(o + i, _mm512_mul_ps(sv, _mm512_loadu_ps(u + i)));
          } else {  // silu rounded to bfloat16 (RNE, as torch), times up, rounded again
#ifdef __AVX512BF16__
            const __m256bh sh = _mm512_cvtneps_pbh(sv);
            const __m512 sr = keel::load_ps16(reinterpret_cast<const c10::BFloat16*>(&sh));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sr, keel::load_ps16(u + i))));
#endif
          }
        }
      }
#endif
      for (; i + 16 <= inter; i += 16) {
        const v16 gv = load16(g + i);
        const v16 ax = gv < 0 ? -gv : gv;
        const v16 ex = keel::exp16(-ax);  // exp(-|g|) in (0, 1]
        const v16 num = gv < 0 ? ex : v16{} + 1.0f;
        const v16 silu = gv * (num / (1.0f + ex));
        store16(o + i, round_to<T>(silu) * load16(u + i));
      }
      for (; i < inter; ++i) {
        const float gf = static_cast<float>(g[i]);
        const float silu = gf / (1.0f + std::exp(-gf));
        o[i] = static_cast<T>(static_cast<float>(static_cast<T>(silu)) *
                              static_cast<float>(u[i]));
      }
    }
  });
}

}  // namespace

void silu_mul_f32(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16)  // silu_and_mul_kernel<float>'s loop
    _mm512_storeu_ps(o + i, _mm512_mul_ps(keel::silu16(_mm512_loadu_ps(g + i)),
                                          _mm512_loadu_ps(u + i)));
#endif
  for (; i < n; i += 8) {  // silu_and_mul_kernel<float>'s loop
    keel::store8(o + i, silu8(keel::load8(g + i)) * keel::load8(u + i));
  }
}

namespace {

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, ": expected [rows, n] with unit stride");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  x = x.contiguous();
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: dtype mismatch");
  weight = weight.contiguous();
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x, weight, out, static_cast<float>(eps));
  });
  return out;
}

void fused_add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.dim() == 2,
              "fused_add_rms_norm_: contiguous [rows, n] tensors expected");
  TORCH_CHECK(x.sizes() == residual.sizes(), "fused_add_rms_norm_: shape mismatch");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() &&
              residual.scalar_type() == x.scalar_type(), "fused_add_rms_norm_: dtype mismatch");
  weight = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(),
                                  "fused_add_rms_norm_", [&] {
    fused_add_rms_norm_kernel<scalar_t>(x, residual, weight, static_cast<float>(eps));
  });
}

void rotary_neox_(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos,
                  at::Tensor sin, int64_t head_dim) {
  check_rows(q, "rotary_neox_ q");
  check_rows(k, "rotary_neox_ k");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
              sin.scalar_type() == q.scalar_type(), "rotary_neox_: dtype mismatch");
  TORCH_CHECK(cos.size(1) % 2 == 0 && cos.size(1) <= head_dim, "rotary_neox_: bad rot dim");
  TORCH_CHECK(q.size(1) % head_dim == 0 && k.size(1) % head_dim == 0,
              "rotary_neox_: width not a multiple of head_dim");
  positions = positions.to(at::kLong).contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_neox_: position ", pos[t],
                " is outside the RoPE cache of ", cos.size(0), " positions");
  TORCH_CHECK(positions.numel() == q.size(0) && k.size(0) == q.size(0),
              "rotary_neox_: one position per row of q and k");
  cos = cos.contiguous();
  sin = sin.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_neox_",
                                  [&] { rotary_kernel<scalar_t>(positions, q, k, cos, sin,
                                                                head_dim); });
}

at::Tensor silu_and_mul(at::Tensor x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: odd width");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_kernel<scalar_t>(x, out); });
  return out;
}

namespace {

template <typename T>
void argmax_rows_kernel(const T* xp, int64_t rows, int64_t n, int64_t* op) {
  typedef int32_t i32x16 __attribute__((vector_size(64)));
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* row = xp + r * n;
      // One pass in 16 lanes: each lane's largest value and where it first occurs (strictly
      // larger replaces), then the largest of the lanes and, of the lanes holding it, the
      // first index; the tail past the last whole 16 after them.
      float best = -std::numeric_limits<float>::infinity();
      int64_t idx = 0;
      bool nan = false;
      int64_t i = 0;
      if (n >= 16) {
        v16 m = keel::load16(row);
        i32x16 at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        i32x16 nans = m != m;
        i32x16 pos = at;
        for (i = 16; i + 16 <= n; i += 16) {
          const v16 v = keel::load16(row + i);
          pos += 16;
          nans |= v != v;
          const i32x16 gt = v > m;
          m = gt ? v : m;
          at = gt ? pos : at;
        }
        best = m[0];
        for (int l = 1; l < 16; ++l) best = std::max(best, m[l]);
        idx = n;
        for (int l = 0; l < 16; ++l) {
          nan |= nans[l] != 0;
          if (m[l] == best) idx = std::min<int64_t>(idx, at[l]);
        }
      } else {
        best = static_cast<float>(row[0]);
        nan = best != best;
        i = 1;
      }
      for (int64_t j = i; j < n; ++j) {
        const float v = static_cast<float>(row[j]);
        nan |= v != v;
        if (v > best) best = v, idx = j;
      }
      if (nan) {  // a NaN is larger than anything: the first one
        idx = 0;
        while (static_cast<float>(row[idx]) == static_cast<float>(row[idx])) ++idx;
      }
      op[r] = idx;
    }
  });
}

}  // namespace

// The index of each row's largest value, as torch's argmax picks it: the first of equal
// maxima, and a NaN counts as larger than anything (the first NaN wins). One pass in 16 lanes
// keeps each lane's maximum and its first index (a second, scalar pass to find where the
// maximum first occurs was ~half the kernel's time); rows split over threads. torch's
// argmax read [64, 49152] logits at ~4 GB/s here, on one thread. bfloat16 rows are widened
// exactly, so their argmax is their float32 upcast's (a greedy step reads the LM head's
// bfloat16 logits without the float32 copy).
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat ||
                               x.scalar_type() == at::kBFloat16) &&
                  x.is_contiguous() && x.size(1) > 0,
              "argmax_rows: a contiguous float32 or bfloat16 [rows, n] tensor expected");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat)
    argmax_rows_kernel(x.data_ptr<float>(), rows, n, out.data_ptr<int64_t>());
  else
    argmax_rows_kernel(x.data_ptr<c10::BFloat16>(), rows, n, out.data_ptr<int64_t>());
  return out;
}
