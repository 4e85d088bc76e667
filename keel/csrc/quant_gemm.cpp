// Weight-only quantized matmul for the few rows of a decode pass: each weight byte is read
// once per pass and widened in registers; float32 activations and scales throughout.
//
//   int4_gemm(x [M, K] f32, q u8 [N, K/2], d [N, K/32], m [N, K/32]) -> [M, N] f32
//       W[n, k] = q[n, k] * d[n, k / 32] + m[n, k / 32] (GGUF's Q4_1 form), where q[n, 2j]
//       is byte j's low nibble and q[n, 2j + 1] its high nibble; d and m both float32, or
//       both float16 (half the bytes: what a Q4_0 / Q4_1 file stores).
//   int8_gemm(x [M, K] f32, q i8 [N, K], scale [N] f32) -> [M, N]:  W[n, k] = q[n, k] scale[n]
//
// M <= 4 (the caller splits larger passes). Work is split over output rows n: each task
// streams its rows of q once. Per group of 32 the int4 dot product is
//   d * sum_i q_i x_i + m * sum_i x_i,
// with sum_i x_i computed once per pass, and x deinterleaved per group (16 even elements,
// then 16 odd) so that the low and high nibbles of 16 bytes meet their inputs in order.
// AVX2 (+FMA, F16C) intrinsics: GCC's generic vectors widened bytes to floats one lane at a
// time. quant_gemm_q8.cpp has the same products with integer activations, and
// `quant_linear` (the end of this file) picks between the two for a pass.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "quant_common.h"

bool quant_gemm_available() { return true; }

namespace {

using keel::quant::check_int4;
using keel::quant::check_x;
using keel::quant::hsum8;
using keel::quant::to_f32;
using keel::quant::widen_i8;
using keel::quant::widen_u8;

template <int M, typename S>
void int4_rows(const uint8_t* q, const S* scale, const S* mins, const float* xd,
               const float* xsum, float* out, int64_t n, int64_t k) {
  const int64_t groups = k / 32;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const uint8_t* qn = q + row * (k / 2);
      const S* sn = scale + row * groups;
      const S* mn = mins + row * groups;
      __m256 acc[M];
      float acc_zero[M];
      for (int r = 0; r < M; ++r) {
        acc[r] = _mm256_setzero_ps();
        acc_zero[r] = 0.f;
      }
      for (int64_t g = 0; g < groups; ++g) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + g * 16));
        const __m128i lo = _mm_and_si128(bytes, low4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        const __m256 s = _mm256_set1_ps(to_f32(sn[g]));
        // q of the group: even elements 0-7, 8-15; odd 0-7, 8-15. The scale is applied
        // once to the group's dot product, not to each weight.
        const __m256 w0 = widen_u8(lo);
        const __m256 w1 = widen_u8(_mm_unpackhi_epi64(lo, lo));
        const __m256 w2 = widen_u8(hi);
        const __m256 w3 = widen_u8(_mm_unpackhi_epi64(hi, hi));
        const float offset = to_f32(mn[g]);
        for (int r = 0; r < M; ++r) {
          const float* xg = xd + (r * groups + g) * 32;
          __m256 d = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
          d = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), d);
          d = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), d);
          d = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), d);
          acc[r] = _mm256_fmadd_ps(d, s, acc[r]);
          acc_zero[r] += offset * xsum[r * groups + g];
        }
      }
      for (int r = 0; r < M; ++r) out[r * n + row] = hsum8(acc[r]) + acc_zero[r];
    }
  });
}

template <int M>
void int8_rows(const int8_t* q, const float* scale, const float* x, float* out, int64_t n,
               int64_t k) {
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int8_t* qn = q + row * k;
      __m256 acc[M];
      float tail[M];
      for (int r = 0; r < M; ++r) {
        acc[r] = _mm256_setzero_ps();
        tail[r] = 0.f;
      }
      int64_t i = 0;
      for (; i + 16 <= k; i += 16) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + i));
        const __m256 w0 = widen_i8(b);
        const __m256 w1 = widen_i8(_mm_unpackhi_epi64(b, b));
        for (int r = 0; r < M; ++r) {
          const float* xr = x + r * k + i;
          acc[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8),
                                   _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r]));
        }
      }
      for (; i < k; ++i)
        for (int r = 0; r < M; ++r) tail[r] += qn[i] * x[r * k + i];
      for (int r = 0; r < M; ++r) out[r * n + row] = (hsum8(acc[r]) + tail[r]) * scale[row];
    }
  });
}

}  // namespace

template <typename S>
void int4_dispatch(int64_t m, const uint8_t* q, const S* d, const S* mins, const float* xd,
                   const float* xsum, float* out, int64_t n, int64_t k) {
  switch (m) {  // the row count as a template argument: accumulators stay in registers
    case 1: int4_rows<1>(q, d, mins, xd, xsum, out, n, k); break;
    case 2: int4_rows<2>(q, d, mins, xd, xsum, out, n, k); break;
    case 3: int4_rows<3>(q, d, mins, xd, xsum, out, n, k); break;
    default: int4_rows<4>(q, d, mins, xd, xsum, out, n, k); break;
  }
}

at::Tensor int4_gemm(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor mins) {
  const int64_t n = q.size(0), k = q.size(1) * 2, groups = k / 32, m = x.size(0);
  check_int4("int4_gemm", q, d, mins);
  const auto st = d.scalar_type();
  check_x(x, k);
  std::vector<float> xd(m * k), xsum(m * groups);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* src = xp + r * k + g * 32;
      float* dst = xd.data() + (r * groups + g) * 32;
      float s = 0.f;
      for (int i = 0; i < 16; ++i) {
        dst[i] = src[2 * i];
        dst[16 + i] = src[2 * i + 1];
        s += src[2 * i] + src[2 * i + 1];
      }
      xsum[r * groups + g] = s;
    }
  auto out = at::empty({m, n}, x.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (st == at::kFloat)
    int4_dispatch(m, qp, d.data_ptr<float>(), mins.data_ptr<float>(), xd.data(), xsum.data(),
                  op, n, k);
  else
    int4_dispatch(m, qp, reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
                  reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()), xd.data(),
                  xsum.data(), op, n, k);
  return out;
}

at::Tensor int8_gemm(at::Tensor x, at::Tensor q, at::Tensor scale) {
  const int64_t n = q.size(0), k = q.size(1), m = x.size(0);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(),
              "int8_gemm: q must be contiguous int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "int8_gemm: scale must be contiguous float32 [N]");
  check_x(x, k);
  auto out = at::empty({m, n}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (m) {
    case 1: int8_rows<1>(qp, sp, xp, op, n, k); break;
    case 2: int8_rows<2>(qp, sp, xp, op, n, k); break;
    case 3: int8_rows<3>(qp, sp, xp, op, n, k); break;
    default: int8_rows<4>(qp, sp, xp, op, n, k); break;
  }
  return out;
}

// The kernel for a pass: activations in `act_parts` int8 parts (0: float32). int4 weights
// take them at any row count (1.2-1.7x faster than float here); int8 weights (the LM head)
// at one row only, where they measured 1.5x faster (at 2 and 4 rows the float kernel won).
at::Tensor quant_linear(at::Tensor x, at::Tensor q, at::Tensor d, std::optional<at::Tensor> m,
                        int64_t act_parts) {
  if (m.has_value())
    return act_parts > 0 ? int4_gemm_q8(x, q, d, *m, act_parts) : int4_gemm(x, q, d, *m);
  if (act_parts > 0 && x.size(0) == 1 && q.size(1) % 32 == 0)
    return int8_gemm_q8(x, q, d, act_parts);
  return int8_gemm(x, q, d);
}

#else  // no AVX2: keel/model_executor/layers/quantization.py uses torch's kernels instead

bool quant_gemm_available() { return false; }

at::Tensor int4_gemm(at::Tensor, at::Tensor, at::Tensor, at::Tensor) {
  TORCH_CHECK(false, "int4_gemm needs AVX2 and FMA");
}

at::Tensor int8_gemm(at::Tensor, at::Tensor, at::Tensor) {
  TORCH_CHECK(false, "int8_gemm needs AVX2 and FMA");
}

at::Tensor quant_linear(at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>,
                        int64_t) {
  TORCH_CHECK(false, "quant_linear needs AVX2 and FMA");
}

#endif
