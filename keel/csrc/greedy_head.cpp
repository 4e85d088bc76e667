// A greedy LM head that screens the vocabulary with int8 dot products and computes exactly only
// the columns it cannot rule out: each row's argmax of x @ W^T over columns [0, n_valid), the
// same token as the argmax of the float32 logits (bfloat16 ones with round_bf16), without
// computing them all.
//
//   greedy_head_pack(W [N, K] float32 or bfloat16) -> (packed uint8 [ceil(N/16), K/4, 64],
//                                                      scales float32 [ceil(N/16), K/32, 16],
//                                                      norms float32 [2, 16 ceil(N/16)])
//   greedy_head(x [M, K] float32 or bfloat16, packed, scales, norms, W, n_valid, round_bf16,
//               cap) -> (token ids int64 [M], columns computed exactly int32 [M]: -1 where
//                        the row's every column was)
//
// Why: one `vpdpbusd` does 64 products (four int8 pairs per 32-bit lane) where `vpdpwssd`
// (i16_gemm) and `vdpbf16ps` (bf16_dot_gemm) do 32, at the same rate on the CPUs measured, and
// the LM head is ~20% of a decode step's products on the default model (49,152 x 576).
//
// Screening: x's rows and W's rows are int8 per block of 32 values of k (a block's largest
// |value| at 127), the blocks' products summed exactly in int32, scaled and summed in float32:
// an approximate logit a[r][c]. Its distance to the exact one is bounded by Cauchy-Schwarz,
//   |x.w - x'.w'| <= |x - x'| |w| + |x'| |w - w'|
// (x', w' the int8 values times their scales; the norms per row of x, per column of W), widened
// by the float32 rounding of the screening and of the exact dot products. With b[r][c] that
// bound, the row's largest exact logit is at least LB = max_c (a - b), and a column can only be
// the argmax if a + b >= LB. Each thread keeps its rows' running LB and the columns that pass
// against it (at most `cap` a row; past that the row is marked and every column of it is computed
// exactly); then every candidate of a row is computed exactly in float32 (bfloat16-rounded with
// round_bf16, where the threshold is widened by two bfloat16 steps, so that a column whose
// rounded logit ties the largest is among them) and the first of the largest wins, as torch's
// argmax orders them. A row with a value that is not finite is computed whole.
//
// Per-block int8 scales are what make the bound tight: x's outlier channels make one scale per
// row useless (a median of ~3,600 candidate columns a row on the default model's hidden
// states), while blocks of 32 on both sides leave a median of 2 (BENCHMARKS.md, sixty-eighth
// round).
//
// The layout: a panel row holds 16 columns for four values of k (lane j: w[k..k+3][j] as
// unsigned bytes, the int8 value + 128), the `vpdpbusd` operand; x's four values are one 32-bit
// broadcast, signed. Each block's int32 sums start at -128 times the sum of x's block (the +128
// taken back). Tiles of up to 6 rows x 2 panels keep 12 int32 and 12 float32 accumulators in
// registers. The schedule is i16_gemm's (claims.h run_panel_groups).
#include "ops.h"
#include "argmax_lanes.h"
#include "claims.h"
#include "vendor_choice.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {
constexpr int64_t kCols = 16;   // output columns per panel
constexpr int64_t kBlock = 32;  // values of k per int8 scale
constexpr int64_t kQuads = kBlock / 4;
constexpr float kQ8 = 127.0f;
// Relative slack for float32 rounding: 2^-24 per operation, counted generously.
constexpr double kU = 1.0 / 16777216.0;

// Rounds a non-negative double up to the next float32 (a bound stays a bound).
inline float up(double v) {
  const float f = static_cast<float>(v);
  return static_cast<double>(f) >= v ? f : std::nextafter(f, std::numeric_limits<float>::infinity());
}
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> greedy_head_pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "greedy_head_pack: weight must be a float32 or bfloat16 [N, K] CPU tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k > 0 && k % kBlock == 0, "greedy_head_pack: K = ", k, " must be a multiple of ",
              kBlock);
  const at::Tensor w = weight.contiguous().to(at::kFloat);
  TORCH_CHECK(w.numel() == 0 || w.abs().max().item<float>() < INFINITY,
              "greedy_head_pack: the weight has values that are not finite");
  const int64_t panels = (n + kCols - 1) / kCols, quads = k / 4, blocks = k / kBlock;
  // Padding columns: int8 0 (byte 128), scale 0, norms 0; never candidates (n_valid <= N).
  at::Tensor packed = at::empty({panels, quads, 4 * kCols}, w.options().dtype(at::kByte));
  packed.fill_(128);
  at::Tensor scales = at::zeros({panels, blocks, kCols}, w.options());
  at::Tensor norms = at::zeros({2, panels * kCols}, w.options());
  const float* src = w.data_ptr<float>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  float* wn = norms.data_ptr<float>();
  float* dwn = wn + panels * kCols;
  const double slack = 4.0 * (2.0 * static_cast<double>(blocks) + 4.0) * kU;
  at::parallel_for(0, n, 64, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const float* row = src + c * k;
      const int64_t p = c / kCols, j = c % kCols;
      double w2 = 0.0, d2 = 0.0;
      for (int64_t b = 0; b < blocks; ++b) {
        float amax = 0.0f;
        for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(row[b * kBlock + i]));
        const float s = amax / kQ8;
        sc[(p * blocks + b) * kCols + j] = s;
        for (int64_t i = 0; i < kBlock; ++i) {
          const int64_t kk = b * kBlock + i;
          const float v = row[kk];
          const float q = s > 0.0f ? std::clamp(std::rint(v / s), -kQ8, kQ8) : 0.0f;
          dst[(p * quads + kk / 4) * 4 * kCols + 4 * j + kk % 4] =
              static_cast<uint8_t>(static_cast<int>(q) + 128);
          const double d = static_cast<double>(v) - static_cast<double>(q) * s;
          w2 += static_cast<double>(v) * v;
          d2 += d * d;
        }
      }
      const double nw = std::sqrt(w2), nd = std::sqrt(d2);
      wn[c] = up(nw * (1.0 + 1e-6));
      // |w - w'| widened by the screening's float32 rounding, which is at most ~(2 blocks + 4)
      // roundings of sum |x'_i w'_i| <= |x'| |w'| <= |x'| (|w| + |w - w'|).
      dwn[c] = up((nd + slack * (nw + nd)) * (1.0 + 1e-6));
    }
  });
  return {packed, scales, norms};
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512F__)
#include <immintrin.h>

bool greedy_head_available() { return true; }

namespace {

constexpr int64_t kBlockRows = 256;
constexpr int kMaxRows = 6;

// acc += w's unsigned bytes times the four signed bytes at x (one 32-bit broadcast, embedded
// in the instruction: a load, not a separate broadcast).
inline void dpbusd(__m512i& acc, __m512i w, const int8_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0"
          : "+v"(acc)
          : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
}

// x's rows as the screening takes them, with what the bound needs: kept by the calling thread
// from one call to the next.
struct ScreenX {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> scale;  // [M, blocks]
  std::vector<int32_t> init;  // [M, blocks]: -128 x the block's int8 sum
  std::vector<float> dx;     // [M] |x - x'| widened by the exact dot products' rounding
  std::vector<float> xn;     // [M] |x'|
  std::vector<uint8_t> whole;  // [M] 1: a value that is not finite; computed whole
};

// One thread's candidates: per row the running LB (16 lanes), its scalar as last taken, the
// columns that passed and their a + b, and whether it overflowed.
struct Candidates {
  int64_t cap = 0;
  std::vector<float> lanes;   // [M, 16]
  std::vector<float> lb;      // [M]
  std::vector<int32_t> count;  // [M]
  std::vector<uint8_t> full;  // [M]
  // Per row, grown as its candidates need (16 past the count, for a whole-vector store) and
  // kept from one call to the next: most rows hold a few dozen, and a verify step with drafts
  // has (1 + k) rows per request, so room for `cap` on every row (32 KB) would cost tens of MB.
  std::vector<std::vector<float>> hi;
  std::vector<std::vector<int32_t>> col;
  void reset(int64_t m, int64_t c) {
    cap = c;
    lanes.assign(m * kCols, -INFINITY);
    lb.assign(m, -INFINITY);
    count.assign(m, 0);
    full.assign(m, 0);
    if (static_cast<int64_t>(hi.size()) < m) {
      hi.resize(m);
      col.resize(m);
    }
  }
};

inline Candidates& thread_candidates() {
  static thread_local Candidates c;
  return c;
}

// Whether a column whose a + b is `hi` can still be the argmax against LB `lb`: hi >= lb, or
// with round_bf16 within two bfloat16 steps of the larger of |hi| and |lb| (a step is at most
// 2^-7 of a value), so that a column whose rounded logit could tie the largest passes.
inline float widened(float hi, float lb, bool round_bf16) {
  return round_bf16 ? hi + std::max(std::fabs(hi), std::fabs(lb)) * (1.0f / 64.0f) : hi;
}
inline __mmask16 passing(__m512 hi, float lb, bool round_bf16, __mmask16 valid) {
  const __m512 l = _mm512_set1_ps(lb);
  if (round_bf16)
    hi = _mm512_fmadd_ps(_mm512_max_ps(_mm512_abs_ps(hi), _mm512_abs_ps(l)),
                         _mm512_set1_ps(1.0f / 64.0f), hi);
  return valid & _mm512_cmp_ps_mask(hi, l, _CMP_GE_OQ);
}

// What the screening's tail needs of a tile: its columns' norms (at its first column), its
// rows' bound factors and the thread's LB lanes and scalars (at its first row), and which
// columns of each panel are below n_valid.
struct TileBound {
  const float* wn;
  const float* dwn;
  const float* dx;
  const float* xn;
  float* lanes;
  const float* lb;
  __mmask16 valid[2];
  bool round_bf16;
};

// The screening logits a of R rows (x int8, `k` values a row; each block's scale sx and starting
// sum xi, `blocks` a row) against P panels (the first at w, the next `pstride` bytes on; their
// scales ws, the next `sstride` floats on); then, with their bound b, each row's LB lanes take
// a - b, and a + b goes to hi [R][P][16] with the columns that pass the row's LB as it was in
// pass [R][P] (take() looks again at those). Nothing but this in here, so that the
// accumulators live in registers.
template <int R, int P>
__attribute__((noinline)) void screen(const int8_t* xq, int64_t k, const float* sx,
                                      const int32_t* xi, int64_t blocks, const uint8_t* w,
                                      int64_t pstride, const float* ws, int64_t sstride,
                                      const TileBound& tb, float (*hi)[2][kCols],
                                      __mmask16 (*pass)[2], const char* pf,
                                      const char* pf_end, bool stream) {
  // The tile's share of the next item's weights, a line or two every four values of k.
  const int64_t steps = blocks * kQuads;
  const int per_step = (pf_end - pf + 63) / 64 > steps ? 2 : 1;
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i c[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) c[r][p] = _mm512_set1_epi32(xi[r * blocks + b]);
    const uint8_t* wb = w + b * kQuads * 4 * kCols;
    const int8_t* xb = xq + b * kBlock;
#pragma GCC unroll 8
    for (int64_t q = 0; q < kQuads; ++q) {
      for (int i = 0; i < per_step && pf < pf_end; ++i, pf += 64)
        keel::prefetch_weights(pf, stream);
      __m512i wv[P];
      for (int p = 0; p < P; ++p)
        wv[p] = _mm512_load_si512(wb + p * pstride + q * 4 * kCols);
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) dpbusd(c[r][p], wv[p], xb + r * k + 4 * q);
    }
    for (int p = 0; p < P; ++p) {
      const __m512 s = _mm512_loadu_ps(ws + p * sstride + b * kCols);
      for (int r = 0; r < R; ++r)
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c[r][p]),
                                    _mm512_mul_ps(s, _mm512_set1_ps(sx[r * blocks + b])),
                                    acc[r][p]);
    }
  }
  for (int p = 0; p < P; ++p) {
    const __m512 wn = _mm512_loadu_ps(tb.wn + p * kCols), dwn = _mm512_loadu_ps(tb.dwn + p * kCols);
    for (int r = 0; r < R; ++r) {
      const __m512 bound = _mm512_fmadd_ps(_mm512_set1_ps(tb.dx[r]), wn,
                                           _mm512_mul_ps(_mm512_set1_ps(tb.xn[r]), dwn));
      float* lanes = tb.lanes + r * kCols;
      const __m512 l = _mm512_loadu_ps(lanes);
      _mm512_storeu_ps(lanes, _mm512_mask_max_ps(l, tb.valid[p], l, _mm512_sub_ps(acc[r][p], bound)));
      const __m512 h = _mm512_add_ps(acc[r][p], bound);
      _mm512_storeu_ps(hi[r][p], h);
      pass[r][p] = passing(h, tb.lb[r], tb.round_bf16, tb.valid[p]);
    }
  }
}

// Row r's columns [c, c + 16) whose a + b (`hi`) passed the row's LB as the screening last saw
// it: against the LB as it is now (its lanes have this panel's a - b), into the row's
// candidates.
inline void take(Candidates& st, int64_t r, int64_t c, __m512 hi, __mmask16 valid,
                 bool round_bf16) {
  if (st.full[r]) return;
  const float lb = st.lb[r] = _mm512_reduce_max_ps(_mm512_loadu_ps(st.lanes.data() + r * kCols));
  const __mmask16 pass = passing(hi, lb, round_bf16, valid);
  if (!pass) return;
  int32_t& n = st.count[r];
  std::vector<float>& row_hi = st.hi[r];
  std::vector<int32_t>& row_col = st.col[r];
  float* rh = row_hi.data();
  int32_t* rc = row_col.data();
  if (n + kCols > st.cap) {  // drop what the current LB rules out
    int32_t kept = 0;
    for (int32_t i = 0; i < n; ++i)
      if (widened(rh[i], lb, round_bf16) >= lb) {
        rh[kept] = rh[i];
        rc[kept++] = rc[i];
      }
    n = kept;
    if (n + kCols > st.cap) {
      st.full[r] = 1;
      return;
    }
  }
  const __m512i cols = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(c)),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                          12, 13, 14, 15));
  if (static_cast<int64_t>(row_hi.size()) < n + kCols) {
    const size_t size = std::max<size_t>(2 * row_hi.size(), static_cast<size_t>(n + kCols));
    row_hi.resize(size);
    row_col.resize(size);
    rh = row_hi.data();
    rc = row_col.data();
  }
  // Compressed in registers and stored whole (room for 16 is kept): a compressing store to
  // memory is microcoded on Zen 4, and it cost a fifth of the call.
  _mm512_storeu_ps(rh + n, _mm512_maskz_compress_ps(pass, hi));
  _mm512_storeu_si512(rc + n, _mm512_maskz_compress_epi32(pass, cols));
  n += __builtin_popcount(pass);
}

// The exact logit: x . w in float32, 16 lanes then summed in a fixed order; rounded to
// bfloat16 with round_bf16.
template <typename W>
inline float exact(const float* x, const W* w, int64_t k, bool round_bf16) {
  __m512 s = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    __m512 wv;
    if constexpr (std::is_same_v<W, float>) {
      wv = _mm512_loadu_ps(w + i);
    } else {
      wv = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i))),
          16));
    }
    s = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), wv, s);
  }
  const float v = _mm512_reduce_add_ps(s);
  return round_bf16 ? static_cast<float>(c10::BFloat16(v)) : v;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> greedy_head(at::Tensor x, at::Tensor packed,
                                               at::Tensor scales, at::Tensor norms,
                                               at::Tensor weight, int64_t n_valid,
                                               bool round_bf16, int64_t cap) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "greedy_head: x must be a float32 or bfloat16 [M, K] CPU tensor");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "greedy_head: K = ", k, " must be a multiple of ", kBlock);
  const int64_t quads = k / 4, blocks = k / kBlock;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == quads && packed.size(2) == 4 * kCols,
              "greedy_head: packed must be greedy_head_pack's [ceil(N/16), K/4, 64] for K = ", k);
  const int64_t panels = packed.size(0), n = panels * kCols;
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == panels && scales.size(1) == blocks &&
                  scales.size(2) == kCols,
              "greedy_head: scales must be greedy_head_pack's [ceil(N/16), K/32, 16]");
  TORCH_CHECK(norms.dim() == 2 && norms.scalar_type() == at::kFloat && norms.is_contiguous() &&
                  norms.size(0) == 2 && norms.size(1) == n,
              "greedy_head: norms must be greedy_head_pack's [2, 16 ceil(N/16)]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == k &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "greedy_head: weight must be the contiguous float32 or bfloat16 [N, K] W");
  TORCH_CHECK(n_valid > 0 && n_valid <= std::min(n, weight.size(0)),
              "greedy_head: 0 < n_valid <= N needed");
  TORCH_CHECK(cap >= kCols, "greedy_head: cap must be at least ", kCols);
  at::Tensor tokens = at::empty({m}, x.options().dtype(at::kLong));
  at::Tensor computed = at::empty({m}, x.options().dtype(at::kInt));
  if (m == 0) return {tokens, computed};
  const at::Tensor xf = x.contiguous().to(at::kFloat);
  const float* xs = xf.data_ptr<float>();

  // x in int8 per block, with the bound's norms.
  static thread_local ScreenX buffers;
  ScreenX& sxq = buffers;  // a reference: the lambdas below must see this thread's buffers
  sxq.q.resize(m * k);
  sxq.scale.resize(m * blocks);
  sxq.init.resize(m * blocks);
  sxq.dx.resize(m);
  sxq.xn.resize(m);
  sxq.whole.resize(m);
  // The exact dot products' rounding, for both the row's best column and any other (each at
  // most K 2^-24 sum |x_i w_i| <= K 2^-24 |x| |w|), counted twice over.
  const double exact_slack = 4.0 * static_cast<double>(k) * kU;
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xs + r * k;
      int8_t* q = sxq.q.data() + r * k;
      double x2 = 0.0, d2 = 0.0, t2 = 0.0;
      bool finite = true;
      for (int64_t b = 0; b < blocks; ++b) {
        float amax = 0.0f;
        for (int64_t i = 0; i < kBlock; ++i) {
          const float v = row[b * kBlock + i];
          finite = finite && std::isfinite(v);
          amax = std::max(amax, std::fabs(v));
        }
        const float s = finite ? amax / kQ8 : 0.0f;
        int32_t sum = 0;
        for (int64_t i = 0; i < kBlock; ++i) {
          const float v = row[b * kBlock + i];
          const float qv = s > 0.0f ? std::clamp(std::rint(v / s), -kQ8, kQ8) : 0.0f;
          q[b * kBlock + i] = static_cast<int8_t>(qv);
          sum += static_cast<int32_t>(qv);
          const double t = static_cast<double>(qv) * s, d = static_cast<double>(v) - t;
          x2 += static_cast<double>(v) * v;
          d2 += d * d;
          t2 += t * t;
        }
        sxq.scale[r * blocks + b] = s;
        sxq.init[r * blocks + b] = -128 * sum;
      }
      sxq.whole[r] = finite ? 0 : 1;
      sxq.dx[r] = finite ? up((std::sqrt(d2) + exact_slack * std::sqrt(x2)) * (1.0 + 1e-6)) : 0.f;
      sxq.xn[r] = finite ? up(std::sqrt(t2) * (1.0 + 1e-6)) : 0.f;
    }
  });

  // Screening, each thread keeping its rows' candidates.
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* ws = scales.data_ptr<float>();
  const float* wn = norms.data_ptr<float>();
  const float* dwn = wn + n;
  const int64_t panel_bytes = quads * 4 * kCols, panel_scales = blocks * kCols;
  // One block of rows reads each weight line once: prefetched as i16_gemm's decode passes are.
  const bool stream =
      m <= kBlockRows && keel::gemm_prefetch_nta().load(std::memory_order_relaxed);
  std::mutex lock;
  std::vector<Candidates*> states;
  keel::run_panel_groups<kBlockRows, kMaxRows, 2>(
      m, panels, reinterpret_cast<const char*>(w), panel_bytes,
      [&](int64_t p, int np, int64_t r0, int rows, const char* pf0, const char* pf1) {
        const int64_t c0 = p * kCols;
        if (c0 >= n_valid) return;
        Candidates& st = thread_candidates();
        auto valid = [&](int pp) -> __mmask16 {
          const int64_t left = n_valid - (c0 + pp * kCols);
          return left >= kCols ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
        };
        const TileBound tb{wn + c0, dwn + c0, sxq.dx.data() + r0, sxq.xn.data() + r0,
                           st.lanes.data() + r0 * kCols, st.lb.data() + r0, {valid(0), valid(1)},
                           round_bf16};
        float hi[kMaxRows][2][kCols];
        __mmask16 pass[kMaxRows][2];
        const int8_t* xr = sxq.q.data() + r0 * k;
        const float* sr = sxq.scale.data() + r0 * blocks;
        const int32_t* ir = sxq.init.data() + r0 * blocks;
        const uint8_t* wp = w + p * panel_bytes;
        const float* sp = ws + p * panel_scales;
        keel::with_rows<kMaxRows>(rows, [&](auto r) {
          constexpr int R = decltype(r)::value;
          if (np == 2)
            screen<R, 2>(xr, k, sr, ir, blocks, wp, panel_bytes, sp, panel_scales, tb, hi, pass,
                         pf0, pf1, stream);
          else
            screen<R, 1>(xr, k, sr, ir, blocks, wp, panel_bytes, sp, panel_scales, tb, hi, pass,
                         pf0, pf1, stream);
        });
        for (int r = 0; r < rows; ++r) {
          if (sxq.whole[r0 + r]) continue;
          for (int pp = 0; pp < np; ++pp)
            if (pass[r][pp])
              take(st, r0 + r, c0 + pp * kCols, _mm512_loadu_ps(hi[r][pp]), valid(pp),
                   round_bf16);
        }
      },
      [&] {
        Candidates& st = thread_candidates();
        st.reset(m, cap);
        std::lock_guard<std::mutex> guard(lock);
        states.push_back(&st);
      });

  // Each row's candidates over the threads, computed exactly.
  int64_t* out = tokens.data_ptr<int64_t>();
  int32_t* done = computed.data_ptr<int32_t>();
  const bool bf16_w = weight.scalar_type() == at::kBFloat16;
  const char* wbase = static_cast<const char*>(weight.data_ptr());
  const int64_t wrow = k * weight.element_size();
  at::parallel_for(0, m, 4, [&](int64_t r0, int64_t r1) {
    static thread_local std::vector<int32_t> cols;  // kept from one call to the next
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xs + r * k;
      auto logit = [&](int64_t c) {
        const char* wc = wbase + c * wrow;
        return bf16_w ? exact(xr, reinterpret_cast<const c10::BFloat16*>(wc), k, round_bf16)
                      : exact(xr, reinterpret_cast<const float*>(wc), k, round_bf16);
      };
      bool whole = sxq.whole[r] != 0;
      float lb = -INFINITY;
      for (const Candidates* st : states) {
        whole = whole || st->full[r];
        lb = std::max(lb, _mm512_reduce_max_ps(_mm512_loadu_ps(st->lanes.data() + r * kCols)));
      }
      float best = 0.0f;
      int64_t bi = -1;
      if (whole) {
        for (int64_t c = 0; c < n_valid; ++c) {
          const float v = logit(c);
          if (keel::ArgmaxSink::better(v, c, best, bi)) {
            best = v;
            bi = c;
          }
        }
        out[r] = bi;
        done[r] = -1;
        continue;
      }
      cols.clear();
      for (const Candidates* st : states) {
        const float* rh = st->hi[r].data();
        const int32_t* rc = st->col[r].data();
        for (int32_t i = 0; i < st->count[r]; ++i)
          if (widened(rh[i], lb, round_bf16) >= lb) cols.push_back(rc[i]);
      }
      for (const int32_t c : cols) {
        const float v = logit(c);
        if (keel::ArgmaxSink::better(v, c, best, bi)) {
          best = v;
          bi = c;
        }
      }
      out[r] = bi;
      done[r] = static_cast<int32_t>(cols.size());
    }
  });
  return {tokens, computed};
}

#else  // no AVX512-VNNI

bool greedy_head_available() { return false; }
std::tuple<at::Tensor, at::Tensor> greedy_head(at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                               at::Tensor, int64_t, bool, int64_t) {
  TORCH_CHECK(false, "greedy_head needs AVX512-VNNI (greedy_head_available() is false here)");
}

#endif
