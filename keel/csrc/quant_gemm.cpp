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
// time.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

bool quant_gemm_available() { return true; }

namespace {

constexpr int64_t kMaxRows = 4;

void check_x(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "quantized gemm: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "quantized gemm: 1 to ", kMaxRows,
              " rows per call");
  TORCH_CHECK(x.size(1) == k, "quantized gemm: x has ", x.size(1), " columns, weight ", k);
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

// The same products with the activations quantized to int8 per group of 32 (scale
// amax / 127), as llama.cpp does for one user: the dot products of a group are integer
// (maddubs: 32 u8 x i8 products summed in pairs to i16, madd to 8 x i32), about half the
// instructions of widening each weight to float. The weights are not changed; the inputs
// round by at most half their group's scale each.
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
        if (cnt == 8) {
          const __m256 dv = load8(sn + g0), mv = load8(mn + g0);
          for (int r = 0; r < M; ++r) {
            _mm256_store_ps(ds[r], _mm256_mul_ps(dv, _mm256_loadu_ps(xs + r * stride + g0)));
            zacc[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsum + r * stride + g0), zacc[r]);
          }
        } else {  // the row's last groups, one at a time (no read past the row)
          for (int j = 0; j < cnt; ++j) {
            const float d = to_f32(sn[g0 + j]), m = to_f32(mn[g0 + j]);
            for (int r = 0; r < M; ++r) {
              ds[r][j] = d * xs[r * stride + g0 + j];
              tail[r] += m * xsum[r * stride + g0 + j];
            }
          }
        }
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
  TORCH_CHECK(k % 32 == 0 && q.scalar_type() == at::kByte && q.is_contiguous(),
              "int4_gemm: q must be contiguous uint8 [N, K/2] with K a multiple of 32");
  const auto st = d.scalar_type();
  TORCH_CHECK(d.is_contiguous() && mins.is_contiguous() && mins.scalar_type() == st &&
              (st == at::kFloat || st == at::kHalf) && d.numel() == n * groups &&
              mins.numel() == n * groups,
              "int4_gemm: d and m must be contiguous float32 or float16 [N, K/32]");
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

template <int P>
at::Tensor int4_q8(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor mins) {
  const int64_t n = q.size(0), k = q.size(1) * 2, groups = k / 32, m = x.size(0);
  TORCH_CHECK(k % 32 == 0 && q.scalar_type() == at::kByte && q.is_contiguous(),
              "int4_gemm_q8: q must be contiguous uint8 [N, K/2] with K a multiple of 32");
  const auto st = d.scalar_type();
  TORCH_CHECK(d.is_contiguous() && mins.is_contiguous() && mins.scalar_type() == st &&
              (st == at::kFloat || st == at::kHalf) && d.numel() == n * groups &&
              mins.numel() == n * groups,
              "int4_gemm_q8: d and m must be contiguous float32 or float16 [N, K/32]");
  check_x(x, k);
  const int64_t stride = (groups + 7) / 8 * 8;
  std::vector<int8_t> xq(m * k * P);
  std::vector<float> xs(m * stride, 0.f), xsum(m * stride, 0.f);
  quantize_groups<P>(x.data_ptr<float>(), m, k, true, xq.data(), xs.data(), xsum.data(), stride);
  auto out = at::empty({m, n}, x.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  auto run = [&](auto* dp, auto* mp) {
    switch (m) {
      case 1: int4_rows_q8<1, P>(qp, dp, mp, xq.data(), xs.data(), xsum.data(), stride, op, n, k); break;
      case 2: int4_rows_q8<2, P>(qp, dp, mp, xq.data(), xs.data(), xsum.data(), stride, op, n, k); break;
      case 3: int4_rows_q8<3, P>(qp, dp, mp, xq.data(), xs.data(), xsum.data(), stride, op, n, k); break;
      default: int4_rows_q8<4, P>(qp, dp, mp, xq.data(), xs.data(), xsum.data(), stride, op, n, k); break;
    }
  };
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
  std::vector<int8_t> xq(m * k * P);
  std::vector<float> xs(m * (k / 32));
  quantize_groups<P>(x.data_ptr<float>(), m, k, false, xq.data(), xs.data(), nullptr, k / 32);
  auto out = at::empty({m, n}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (m) {
    case 1: int8_rows_q8<1, P>(qp, sp, xq.data(), xs.data(), k / 32, op, n, k); break;
    case 2: int8_rows_q8<2, P>(qp, sp, xq.data(), xs.data(), k / 32, op, n, k); break;
    case 3: int8_rows_q8<3, P>(qp, sp, xq.data(), xs.data(), k / 32, op, n, k); break;
    default: int8_rows_q8<4, P>(qp, sp, xq.data(), xs.data(), k / 32, op, n, k); break;
  }
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

at::Tensor int4_gemm_q8(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t) {
  TORCH_CHECK(false, "int4_gemm_q8 needs AVX2 and FMA");
}

at::Tensor int8_gemm_q8(at::Tensor, at::Tensor, at::Tensor, int64_t) {
  TORCH_CHECK(false, "int8_gemm_q8 needs AVX2 and FMA");
}

at::Tensor quant_linear(at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>,
                        int64_t) {
  TORCH_CHECK(false, "quant_linear needs AVX2 and FMA");
}

#endif
