// keel's quantized matmul (see quant_gemm.cpp) with the activations taken as integers per
// group of 32 (scale amax / 127), as llama.cpp does for one user: the dot products of a
// group are integer (maddubs: 32 u8 x i8 products summed in pairs to i16, madd to 8 x i32),
// about half the instructions of widening each weight to float. The weights are not
// changed; the inputs round by at most half their group's scale each (one int8 part), or by
// s / 508 (two parts, keel's default).
//
//   int4_gemm_q8(x, q, d, m, parts), int8_gemm_q8(x, q, scale, parts): int4_gemm's and
//   int8_gemm's arguments and results, parts = 1 or 2.
//
// The row kernels in 256-bit vectors are here; those in 512-bit vectors with AVX512-VNNI, taken
// where the CPU has it, are in quant_gemm_q8_512.h (part of this translation unit).
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "quant_common.h"

namespace {

using keel::quant::check_int4;
using keel::quant::check_x;
using keel::quant::hsum8;
using keel::quant::to_f32;

// 8 consecutive per-group scales, float32 or float16.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One group's integer dot product, scaled: acc += float(sum_i w_i x_i) * scale. With P = 2
// the group's activations come in two int8 parts, x = s (254 x1 + x2) (see quantize_groups),
// and the products of x1 are weighted by 254 in madd: i32 lanes hold at most
// 254 * 4 * 127 * 127 (int8 weights), well inside int32.
// `sign`: int8 weights' signs, carried by x (maddubs takes the weights unsigned, as |w|).
template <int P, bool Signed = false>
inline __m256i q8_dot(__m256i w, const int8_t* x, __m256i sign = __m256i()) {
  __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  if constexpr (Signed) x1 = _mm256_sign_epi8(x1, sign);
  if constexpr (P == 1) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x1), _mm256_set1_epi16(1));
  } else {
    __m256i x2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
    if constexpr (Signed) x2 = _mm256_sign_epi8(x2, sign);
    return _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x1), _mm256_set1_epi16(254)),
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x2), _mm256_set1_epi16(1)));
  }
}

template <int P>
inline __m256 q8_group(__m256i w, const int8_t* x, const float* scale, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_dot<P>(w, x)), _mm256_broadcast_ss(scale), acc);
}

inline __m256i unpack_nibbles(const uint8_t* p) {  // [16 even q | 16 odd q]
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4),
                          _mm_and_si128(bytes, low4));
}

// Groups g0 .. g0 + cnt (cnt <= 8) of a row's int4 weight, for M rows of activations:
// ds[r][j] = d of group g0 + j times row r's activation scale, and the m * sum(x) terms added
// to zacc (8 groups at once) or to tail (one at a time: the row's last groups, no read past
// the row). Always inlined: as a call, its arrays kept the kernels' accumulators in memory
// (the 512-bit kernel lost its whole gain).
template <int M, typename S>
[[gnu::always_inline]] inline void group_scales(const S* sn, const S* mn, const float* xs,
                                                const float* xsum, int64_t stride, int64_t g0,
                                                int cnt, float (*ds)[8], __m256* zacc,
                                                float* tail) {
  if (cnt == 8) {
    const __m256 dv = load8(sn + g0), mv = load8(mn + g0);
    for (int r = 0; r < M; ++r) {
      _mm256_store_ps(ds[r], _mm256_mul_ps(dv, _mm256_loadu_ps(xs + r * stride + g0)));
      zacc[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsum + r * stride + g0), zacc[r]);
    }
    return;
  }
  for (int j = 0; j < cnt; ++j) {
    const float d = to_f32(sn[g0 + j]), m = to_f32(mn[g0 + j]);
    for (int r = 0; r < M; ++r) {
      ds[r][j] = d * xs[r * stride + g0 + j];
      tail[r] += m * xsum[r * stride + g0 + j];
    }
  }
}

// Groups are taken 8 at a time: their d x (activation scale) products and the m x sum(x)
// terms are vector ops, and two accumulators per row alternate so that consecutive groups'
// FMAs do not wait on each other. xs and xsum hold `stride` (groups rounded up to 8)
// entries per row.
template <int M, int P, typename S>
void int4_rows_q8(const uint8_t* q, const S* scale, const S* mins, const int8_t* xq,
                  const float* xs, const float* xsum, int64_t stride, float* out, int64_t n,
                  int64_t k) {
  const int64_t groups = k / 32;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    alignas(32) float ds[M][8];
    for (int64_t row = begin; row < end; ++row) {
      const uint8_t* qn = q + row * (k / 2);
      const S* sn = scale + row * groups;
      const S* mn = mins + row * groups;
      __m256 acc0[M], acc1[M], zacc[M];
      float tail[M];
      for (int r = 0; r < M; ++r) {
        acc0[r] = acc1[r] = zacc[r] = _mm256_setzero_ps();
        tail[r] = 0.f;
      }
      for (int64_t g0 = 0; g0 < groups; g0 += 8) {
        const int cnt = static_cast<int>(std::min<int64_t>(8, groups - g0));
        group_scales<M>(sn, mn, xs, xsum, stride, g0, cnt, ds, zacc, tail);
        int j = 0;
        for (; j + 2 <= cnt; j += 2) {
          const int64_t g = g0 + j;
          const __m256i w0 = unpack_nibbles(qn + g * 16), w1 = unpack_nibbles(qn + g * 16 + 16);
          for (int r = 0; r < M; ++r) {
            const int8_t* x = xq + (r * groups + g) * 32 * P;
            acc0[r] = q8_group<P>(w0, x, &ds[r][j], acc0[r]);
            acc1[r] = q8_group<P>(w1, x + 32 * P, &ds[r][j + 1], acc1[r]);
          }
        }
        if (j < cnt) {
          const int64_t g = g0 + j;
          const __m256i w0 = unpack_nibbles(qn + g * 16);
          for (int r = 0; r < M; ++r)
            acc0[r] = q8_group<P>(w0, xq + (r * groups + g) * 32 * P, &ds[r][j], acc0[r]);
        }
      }
      for (int r = 0; r < M; ++r)
        out[r * n + row] = hsum8(_mm256_add_ps(acc0[r], _mm256_add_ps(acc1[r], zacc[r]))) +
                           tail[r];
    }
  });
}

// int8 weights (one scale per row) by int8 activations (one scale per group of 32):
// maddubs takes unsigned x signed, so |w| meets x carrying w's sign (w is in [-127, 127]).
template <int M, int P>
void int8_rows_q8(const int8_t* q, const float* scale, const int8_t* xq, const float* xs,
                  int64_t stride, float* out, int64_t n, int64_t k) {
  const int64_t groups = k / 32;
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int8_t* qn = q + row * k;
      __m256 acc[2][M];
      for (int r = 0; r < M; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qn + g * 32));
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int r = 0; r < M; ++r) {
          // x carries w's sign: maddubs takes |w| unsigned (w is in [-127, 127]).
          const __m256i dot = q8_dot<P, true>(aw, xq + (r * groups + g) * 32 * P, w);
          acc[g & 1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                          _mm256_broadcast_ss(xs + r * stride + g), acc[g & 1][r]);
        }
      }
      for (int r = 0; r < M; ++r)
        out[r * n + row] = hsum8(_mm256_add_ps(acc[0][r], acc[1][r])) * scale[row];
    }
  });
}

#include "quant_gemm_q8_512.h"

// Row r's 32-element groups (deinterleaved: the 16 even then the 16 odd elements when
// `deinterleave`) to int8 with one scale per group, s = amax / 127. P = 1: x1 = round(x / s)
// (llama.cpp's Q8 activations; each input rounds by up to s / 2). P = 2: also the rounding
// left over, x2 = round((x / s - x1) * 254), so x = s / 254 (254 x1 + x2) to within s / 508:
// about 15 bits per group, for twice the integer work. xs gets s (P = 1) or s / 254.
template <int P>
void quantize_groups(const float* x, int64_t m, int64_t k, bool deinterleave, int8_t* xq,
                     float* xs, float* xsum, int64_t stride) {
  const int64_t groups = k / 32;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* src = x + r * k + g * 32;
      float v[32];
      for (int i = 0; i < 16 && deinterleave; ++i) {
        v[i] = src[2 * i];
        v[16 + i] = src[2 * i + 1];
      }
      if (!deinterleave) std::memcpy(v, src, sizeof(v));
      float amax = 0.f, sum = 0.f;
      for (int i = 0; i < 32; ++i) {
        amax = std::max(amax, std::fabs(v[i]));
        sum += v[i];
      }
      const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* dst = xq + (r * groups + g) * 32 * P;
      for (int i = 0; i < 32; ++i) {
        const float t = v[i] * inv, x1 = std::nearbyint(t);
        dst[i] = static_cast<int8_t>(x1);
        if constexpr (P == 2) dst[32 + i] = static_cast<int8_t>(std::nearbyint((t - x1) * 254.f));
      }
      xs[r * stride + g] = P == 1 ? s : s / 254.f;
      if (xsum != nullptr) xsum[r * stride + g] = sum;
    }
}

}  // namespace

// The quantized activations, and with the 512-bit kernels their paired copy after them (one
// buffer per call).
#if KEEL_Q8_512
constexpr int64_t kActivationCopies = 2;
#else
constexpr int64_t kActivationCopies = 1;
#endif

template <int P>
at::Tensor int4_q8(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor mins) {
  const int64_t n = q.size(0), k = q.size(1) * 2, groups = k / 32, m = x.size(0);
  check_int4("int4_gemm_q8", q, d, mins);
  const auto st = d.scalar_type();
  check_x(x, k);
  const int64_t stride = (groups + 7) / 8 * 8;
  std::vector<int8_t> xq(m * k * P * kActivationCopies);
  std::vector<float> xs(m * stride, 0.f), xsum(m * stride, 0.f);
  quantize_groups<P>(x.data_ptr<float>(), m, k, true, xq.data(), xs.data(), xsum.data(), stride);
  auto out = at::empty({m, n}, x.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
#if KEEL_Q8_512
  int8_t* const paired = xq.data() + m * k * P;  // xq's second half
  pair_groups(xq.data(), m, groups, P, 16, paired);
  const int8_t *x1 = xq.data(), *x2 = paired;
  auto run = [&](auto* dp, auto* mp) {
    const float *s = xs.data(), *sum = xsum.data();
    switch (m) {
      case 1: int4_rows_q8_512<1, P>(qp, dp, mp, x1, x2, s, sum, stride, op, n, k); break;
      case 2: int4_rows_q8_512<2, P>(qp, dp, mp, x1, x2, s, sum, stride, op, n, k); break;
      case 3: int4_rows_q8_512<3, P>(qp, dp, mp, x1, x2, s, sum, stride, op, n, k); break;
      default: int4_rows_q8_512<4, P>(qp, dp, mp, x1, x2, s, sum, stride, op, n, k); break;
    }
  };
#else
  auto run = [&](auto* dp, auto* mp) {
    switch (m) {
      case 1: int4_rows_q8<1, P>(qp, dp, mp, xq.data(), xs.data(), xsum.data(), stride, op, n, k); break;
      case 2: int4_rows_q8<2, P>(qp, dp, mp, xq.data(), xs.data(), xsum.data(), stride, op, n, k); break;
      case 3: int4_rows_q8<3, P>(qp, dp, mp, xq.data(), xs.data(), xsum.data(), stride, op, n, k); break;
      default: int4_rows_q8<4, P>(qp, dp, mp, xq.data(), xs.data(), xsum.data(), stride, op, n, k); break;
    }
  };
#endif
  if (st == at::kFloat)
    run(d.data_ptr<float>(), mins.data_ptr<float>());
  else
    run(reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
        reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()));
  return out;
}

template <int P>
at::Tensor int8_q8(at::Tensor x, at::Tensor q, at::Tensor scale) {
  const int64_t n = q.size(0), k = q.size(1), m = x.size(0);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && k % 32 == 0,
              "int8_gemm_q8: q must be contiguous int8 [N, K] with K a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "int8_gemm_q8: scale must be contiguous float32 [N]");
  check_x(x, k);
  std::vector<int8_t> xq(m * k * P * kActivationCopies);
  std::vector<float> xs(m * (k / 32));
  quantize_groups<P>(x.data_ptr<float>(), m, k, false, xq.data(), xs.data(), nullptr, k / 32);
  auto out = at::empty({m, n}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
#if KEEL_Q8_512
  int8_t* const paired = xq.data() + m * k * P;  // xq's second half
  pair_groups(xq.data(), m, k / 32, P, 32, paired);
  const int8_t *x1 = xq.data(), *x2 = paired;
  const float* s = xs.data();
  switch (m) {
    case 1: int8_rows_q8_512<1, P>(qp, sp, x1, x2, s, k / 32, op, n, k); break;
    case 2: int8_rows_q8_512<2, P>(qp, sp, x1, x2, s, k / 32, op, n, k); break;
    case 3: int8_rows_q8_512<3, P>(qp, sp, x1, x2, s, k / 32, op, n, k); break;
    default: int8_rows_q8_512<4, P>(qp, sp, x1, x2, s, k / 32, op, n, k); break;
  }
#else
  switch (m) {
    case 1: int8_rows_q8<1, P>(qp, sp, xq.data(), xs.data(), k / 32, op, n, k); break;
    case 2: int8_rows_q8<2, P>(qp, sp, xq.data(), xs.data(), k / 32, op, n, k); break;
    case 3: int8_rows_q8<3, P>(qp, sp, xq.data(), xs.data(), k / 32, op, n, k); break;
    default: int8_rows_q8<4, P>(qp, sp, xq.data(), xs.data(), k / 32, op, n, k); break;
  }
#endif
  return out;
}

at::Tensor int4_gemm_q8(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor mins,
                        int64_t parts) {
  TORCH_CHECK(parts == 1 || parts == 2, "int4_gemm_q8: parts must be 1 or 2");
  return parts == 1 ? int4_q8<1>(x, q, d, mins) : int4_q8<2>(x, q, d, mins);
}

at::Tensor int8_gemm_q8(at::Tensor x, at::Tensor q, at::Tensor scale, int64_t parts) {
  TORCH_CHECK(parts == 1 || parts == 2, "int8_gemm_q8: parts must be 1 or 2");
  return parts == 1 ? int8_q8<1>(x, q, scale) : int8_q8<2>(x, q, scale);
}

#else  // no AVX2: keel/model_executor/layers/quantization.py uses torch's kernels instead

at::Tensor int4_gemm_q8(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t) {
  TORCH_CHECK(false, "int4_gemm_q8 needs AVX2 and FMA");
}

at::Tensor int8_gemm_q8(at::Tensor, at::Tensor, at::Tensor, int64_t) {
  TORCH_CHECK(false, "int8_gemm_q8 needs AVX2 and FMA");
}

#endif
