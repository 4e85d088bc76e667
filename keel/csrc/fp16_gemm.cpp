// A GEMM on AVX512-FP16's float16 FMAs, for CPUs that have them and no AMX tiles (an Intel Xeon
// whose tiles the hypervisor hides, as on the machine issue 13 was filed from): out [M, N] =
// x [M, K] @ W^T (+ bias) in float32, with float16 products summed in float16 over at most
// 2 * kPairs values of k, then widened and summed in float32.
//
//   fp16_gemm_pack(W [N, K] float32 or bfloat16) -> (packed float16 [ceil(N/16), ceil(K/2), 32],
//                                                    the largest |W|)
//   fp16_gemm(x [M, K] float32, packed, N, w_max, bias, silu_mul) -> [M, N] float32
//
// silu_mul: W's rows are a [gate; up] layer's interleaved by 16 (gate rows 16j.., then up rows
// 16j..; gemm_choice.silu_pair_order), bias alike, and the result is silu(gate) * up [M, N / 2]
// (keel::silu16, as silu_and_mul computes it): the [M, N] product is never written out.
//
// Why: one 32-lane float16 FMA does twice a float32 FMA's products at the same rate; in
// benchmarks/fp16_tile_rate.c such a tile ran ~1.75x keel's float32 tile, and at the default
// model's shapes with the weights from memory this GEMM ran 1.77-1.96x keel's float32 GEMM
// (BENCHMARKS.md, forty-sixth round). Over a bfloat16
// checkpoint's weights its mean error is 0.7x bfloat16 arithmetic's, its largest about the same
// (BENCHMARKS.md, forty-fifth round). dtype="auto" takes it for a float32 model on a CPU with
// AVX512-FP16 and no AMX tiles (layers/gemm_choice.py fp16_gemm_chosen).
//
// The layout: a panel row holds 16 output columns for two values of k (lane 2j: w[k][j], lane
// 2j + 1: w[k + 1][j]); x is rounded to float16 once a call and read as (x[k], x[k + 1]) pairs
// by one 32-bit broadcast (a plain load; a 16-bit broadcast from memory takes a shuffle on the
// port an FMA needs), so one FMA does two steps of k for 16 columns. The even and odd lanes'
// float32 sums are added at the end. Rows go in blocks of kBlockRows (their float16 copy stays
// in L2 while every panel passes over it: a long prompt chunk's x would otherwise stream from
// L3 once per pair of panels); the threads claim runs of panel pairs within a block, and each
// tile prefetches a share of the next item's panels into L2 (without it the panels' first
// reads from memory stalled the tiles: 1.34x keel's float32 GEMM at 64 rows, 1.77x with it).
//
// No float16 sum can overflow: each row of x is multiplied by a power of two (exact, undone
// in float32 at the end) chosen so that 2 * kPairs products of the row's largest |x| and the
// weight's largest |w| stay below 2^14, and no scaled value exceeds 2^14 itself.
#include "ops.h"
#include "claims.h"
#include "silu.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {
constexpr int64_t kCols = 16;   // output columns per panel; a panel row is 32 float16 lanes
constexpr int64_t kPairs = 64;  // pairs of k summed in float16 before the float32 sum
constexpr float kSumBound = 16384.0f;  // 2^14: float16's largest finite value is 65504
constexpr int64_t kBlockRows = 256;    // rows whose float16 copy the panels pass over in turn
}  // namespace

std::tuple<at::Tensor, double> fp16_gemm_pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "fp16_gemm_pack: weight must be a float32 or bfloat16 [N, K] CPU tensor");
  const at::Tensor w = weight.contiguous().to(at::kFloat);
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = (n + kCols - 1) / kCols, pairs = (k + 1) / 2;
  const float w_max = w.numel() > 0 ? w.abs().max().item<float>() : 0.0f;
  TORCH_CHECK(std::isfinite(w_max) && w_max < 65504.0f,
              "fp16_gemm_pack: the weight has values float16 cannot hold (largest |w| = ", w_max,
              ")");
  at::Tensor packed = at::zeros({panels, pairs, 2 * kCols}, w.options().dtype(at::kHalf));
  const float* src = w.data_ptr<float>();
  c10::Half* dst = packed.data_ptr<c10::Half>();
  at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t j = 0; j < std::min(kCols, n - p * kCols); ++j)
        for (int64_t kk = 0; kk < k; ++kk)
          dst[(p * pairs + kk / 2) * 2 * kCols + 2 * j + kk % 2] =
              c10::Half(src[(p * kCols + j) * k + kk]);
  });
  return {packed, static_cast<double>(w_max)};
}

#if defined(__AVX512FP16__) && defined(__AVX512F__)
#include <immintrin.h>

bool fp16_gemm_available() { return true; }

namespace {

constexpr int kRows = 10;  // rows per register tile: 20 float16 accumulators

inline __m512 widen(__m512h v, int upper) {
  const __m256i half = _mm512_extracti64x4_epi64(_mm512_castph_si512(v), upper);
  return _mm512_cvtxph_ps(_mm256_castsi256_ph(half));
}

// R rows of x16 (pairs per row `ldx`) against P adjacent panels (w0, w1 = w0 + pairs * 32),
// prefetching `pf` .. `pf_end` (lines of the next item's panels) two lines every two pairs:
// out[r][j] = sum * inv[r] + bias[j] for the first `cols` of the P * 16 columns (row stride
// ldo); with Silu (P = 2: 16 gate columns, then their 16 up columns) out[r][j] = silu(gate) * up
// for the 16 columns.
template <int R, int P, bool Silu = false>
__attribute__((noinline)) void tile(const uint16_t* x16, int64_t ldx, const uint16_t* w0,
                                    const uint16_t* w1, int64_t pairs, const float* inv,
                                    const float* bias, int64_t cols, float* out, int64_t ldo,
                                    const char* pf, const char* pf_end) {
  __m512 f[R][2 * P];
#pragma GCC unroll 10
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * P; ++i) f[r][i] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < pairs; kb += kPairs) {
    const int64_t ke = std::min(pairs, kb + kPairs);
    __m512h c0[R], c1[R];
#pragma GCC unroll 10
    for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_ph();
    for (int64_t kp = kb; kp < ke; ++kp) {
      if ((kp & 1) == 0 && pf < pf_end) {  // the next item's weights into L2, 2 lines
        _mm_prefetch(pf, _MM_HINT_T1);
        _mm_prefetch(pf + 64, _MM_HINT_T1);
        pf += 128;
      }
      __m512h b0 = _mm512_castsi512_ph(_mm512_loadu_si512(w0 + kp * 2 * kCols));
      __m512h b1 = P > 1 ? _mm512_castsi512_ph(_mm512_loadu_si512(w1 + kp * 2 * kCols)) : b0;
      __asm__("" : "+v"(b0), "+v"(b1));  // in registers, not folded into each FMA
#pragma GCC unroll 10
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, x16 + (r * ldx + kp) * 2, 4);
        const __m512h a = _mm512_castsi512_ph(_mm512_set1_epi32(static_cast<int>(pair)));
        c0[r] = _mm512_fmadd_ph(a, b0, c0[r]);
        if constexpr (P > 1) c1[r] = _mm512_fmadd_ph(a, b1, c1[r]);
      }
    }
#pragma GCC unroll 10
    for (int r = 0; r < R; ++r) {
      f[r][0] = _mm512_add_ps(f[r][0], widen(c0[r], 0));
      f[r][1] = _mm512_add_ps(f[r][1], widen(c0[r], 1));
      if constexpr (P > 1) {
        f[r][2] = _mm512_add_ps(f[r][2], widen(c1[r], 0));
        f[r][3] = _mm512_add_ps(f[r][3], widen(c1[r], 1));
      }
    }
  }
  // Lane 2j of f[r][2p + h] holds column 8h + j of panel p summed over even k, lane 2j + 1 over
  // odd k: the evens and the odds of the pair gathered, then added.
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  auto combined = [&](int r, int pp) {  // column j of panel pp in lane j
    return _mm512_add_ps(_mm512_permutex2var_ps(f[r][2 * pp], even, f[r][2 * pp + 1]),
                         _mm512_permutex2var_ps(f[r][2 * pp], odd, f[r][2 * pp + 1]));
  };
  if constexpr (Silu) {
    static_assert(P == 2, "silu_mul pairs a gate panel with its up panel");
    const __m512 bg = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 bu = bias != nullptr ? _mm512_loadu_ps(bias + kCols) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(inv[r]);
      const __m512 gate = _mm512_fmadd_ps(combined(r, 0), s, bg);
      const __m512 up = _mm512_fmadd_ps(combined(r, 1), s, bu);
      _mm512_storeu_ps(out + r * ldo, _mm512_mul_ps(keel::silu16(gate), up));
    }
    return;
  }
  for (int pp = 0; pp < P; ++pp) {
    const int64_t c = std::min<int64_t>(kCols, cols - pp * kCols);
    if (c <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << c) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + pp * kCols)
                                     : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + r * ldo + pp * kCols, mask,
                            _mm512_fmadd_ps(combined(r, pp), _mm512_set1_ps(inv[r]), b));
  }
}

template <int P, bool Silu = false>
void tile_rows(int rows, const uint16_t* x16, int64_t ldx, const uint16_t* w0,
               const uint16_t* w1, int64_t pairs, const float* inv, const float* bias,
               int64_t cols, float* out, int64_t ldo, const char* pf, const char* pf_end) {
  switch (rows) {
#define KEEL_FP16_TILE(R) \
  case R: tile<R, P, Silu>(x16, ldx, w0, w1, pairs, inv, bias, cols, out, ldo, pf, pf_end); break;
    KEEL_FP16_TILE(10) KEEL_FP16_TILE(9) KEEL_FP16_TILE(8) KEEL_FP16_TILE(7)
    KEEL_FP16_TILE(6) KEEL_FP16_TILE(5) KEEL_FP16_TILE(4) KEEL_FP16_TILE(3) KEEL_FP16_TILE(2)
#undef KEEL_FP16_TILE
    default: tile<1, P, Silu>(x16, ldx, w0, w1, pairs, inv, bias, cols, out, ldo, pf, pf_end);
      break;
  }
}

}  // namespace

at::Tensor fp16_gemm(at::Tensor x, at::Tensor packed, int64_t n, double w_max,
                     std::optional<at::Tensor> bias, bool silu_mul) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "fp16_gemm: x must be a float32 [M, K] CPU tensor");
  const int64_t m = x.size(0), k = x.size(1), pairs = (k + 1) / 2;
  const int64_t panels = (n + kCols - 1) / kCols;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kHalf && packed.is_contiguous() &&
                  packed.size(0) == panels && packed.size(1) == pairs &&
                  packed.size(2) == 2 * kCols,
              "fp16_gemm: packed must be fp16_gemm_pack's [ceil(N/16), ceil(K/2), 32] for N = ",
              n, " and K = x.size(1) = ", k);
  TORCH_CHECK(!silu_mul || n % (2 * kCols) == 0,
              "fp16_gemm: silu_mul needs whole pairs of [16 gate | 16 up] columns");
  const float* b = float32_bias(bias, n, "fp16_gemm");
  const at::Tensor xc = x.contiguous();
  const int64_t ldo = silu_mul ? n / 2 : n;
  at::Tensor out = at::empty({m, ldo}, xc.options());
  if (m == 0 || n == 0) return out;
  // x in float16, each row times its power of two (see the top of the file), in buffers kept
  // by the calling thread from one call to the next (a decode step makes ~4 calls a layer).
  thread_local std::vector<uint16_t> x16_buffer;
  thread_local std::vector<float> inv_buffer;
  if (static_cast<int64_t>(x16_buffer.size()) < m * 2 * pairs) x16_buffer.resize(m * 2 * pairs);
  if (static_cast<int64_t>(inv_buffer.size()) < m) inv_buffer.resize(m);
  const float* xs = xc.data_ptr<float>();
  uint16_t* xh = x16_buffer.data();
  float* inv = inv_buffer.data();
  const float wm = static_cast<float>(w_max);
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xs + r * k;
      __m512 vmax = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j + 16 <= k; j += 16)
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + j)));
      float amax = _mm512_reduce_max_ps(vmax);
      for (; j < k; ++j) amax = std::max(amax, std::fabs(row[j]));
      float scale = 1.0f;
      if (amax > 0.0f && std::isfinite(amax)) {
        const float limit = std::min(kSumBound / (2.0f * kPairs * std::max(wm, 1e-30f) * amax),
                                     std::min(kSumBound / amax, 1e30f));
        scale = std::ldexp(1.0f, std::ilogb(limit));  // the largest power of two <= limit
      }
      inv[r] = 1.0f / scale;
      uint16_t* dst = xh + r * 2 * pairs;
      const __m512 vs = _mm512_set1_ps(scale);
      for (j = 0; j + 16 <= k; j += 16) {  // rounded to nearest even, as c10::Half does
        const __m256h h = _mm512_cvtxps_ph(_mm512_mul_ps(_mm512_loadu_ps(row + j), vs));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), _mm256_castph_si256(h));
      }
      for (; j < k; ++j) {
        const c10::Half h(row[j] * scale);
        std::memcpy(dst + j, &h, 2);
      }
      if (k % 2) dst[k] = 0;  // an odd K's last pair: its second value is nothing
    }
  });
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::Half>());
  const int64_t panel_elems = pairs * 2 * kCols;
  float* o = out.data_ptr<float>();
  // Items: (block of rows, pair of panels), block by block (claims.h run_panel_groups).
  keel::run_panel_groups<kBlockRows, kRows>(
      m, panels, reinterpret_cast<const char*>(w), panel_elems * 2,
      [&](int64_t p, int np, int64_t r0, int rows, const char* pf0, const char* pf1) {
        const uint16_t* w0 = w + p * panel_elems;
        const int64_t c0 = p * kCols, cols = std::min<int64_t>(np * kCols, n - c0);
        const float* bc = b != nullptr ? b + c0 : nullptr;
        const uint16_t* xr = xh + r0 * 2 * pairs;
        float* oc = o + (silu_mul ? p / 2 * kCols : c0) + r0 * ldo;
        if (silu_mul)
          tile_rows<2, true>(rows, xr, pairs, w0, w0 + panel_elems, pairs, inv + r0, bc, cols,
                             oc, ldo, pf0, pf1);
        else if (np == 2)
          tile_rows<2>(rows, xr, pairs, w0, w0 + panel_elems, pairs, inv + r0, bc, cols, oc,
                       ldo, pf0, pf1);
        else
          tile_rows<1>(rows, xr, pairs, w0, w0, pairs, inv + r0, bc, cols, oc, ldo, pf0, pf1);
      });
  return out;
}

#else  // no AVX512-FP16

bool fp16_gemm_available() { return false; }
at::Tensor fp16_gemm(at::Tensor, at::Tensor, int64_t, double, std::optional<at::Tensor>, bool) {
  TORCH_CHECK(false, "fp16_gemm needs AVX512-FP16 (fp16_gemm_available() is false here)");
}

#endif
