// A GEMM on AVX512-VNNI's int16 dot products, for CPUs that have them and neither AMX tiles
// nor AVX512-FP16 (an AVX-512 Xeon whose newer units the hypervisor hides; the fiftieth round
// of BENCHMARKS.md ran on one): out [M, N] = x [M, K] @ W^T (+ bias) in float32, with x and W
// as int16 values scaled per block of kBlock values of k, the products of a block summed
// exactly in int32, and the blocks' sums scaled and summed in float32.
//
//   i16_gemm_pack(W [N, K] float32 or bfloat16) -> (packed int16 [ceil(N/16), ceil(K/2), 32],
//                                                   scales float32 [ceil(N/16), blocks, 16])
//   i16_gemm(x [M, K] float32, packed, scales, N, bias, silu_mul) -> [M, N] float32
//
// silu_mul: W's rows are a [gate; up] layer's interleaved by 16 (gate rows 16j.., then up rows
// 16j..; gemm_choice.silu_pair_order), bias alike, and the result is silu(gate) * up [M, N / 2]
// (keel::silu16, as silu_and_mul computes it), as in fp16_gemm.
//
// Why: one `vpdpwssd` does 32 products (two int16 pairs per 32-bit lane, summed into it) where
// a float32 FMA does 16. On the fiftieth round's Xeon a decode step of 64 requests was bound
// by keel's float32 FMAs (bfloat16 weights widened in registers, half the bytes, were
// slower); at the default model's shapes with the weights from memory this GEMM ran 1.73x
// keel's float32 GEMM at 64 rows and 1.92x at 512 (benchmarks/fp16_gemm_rate.py).
//
// Accuracy: each block of kBlock = 128 values of a row of x is scaled so that its largest
// |value| is kQ = 11585 (int16 with 13.5 bits): a value's error is at most the block's largest
// |value| / (2 kQ), against |value| / 512 for a value rounded to bfloat16, as dtype="auto"
// computes a float32 model where the CPU has AMX tiles. A block of W likewise, with the step
// the overflow rule below allows: kQ where it fits, else kq < kQ (the default model's decoder
// weights: a median kq of 5,453, 10% below 4,487).
//
// No int32 sum overflows: a block's sum is at most kQ (x's largest |int16|) times the sum of
// the W block's |int16| values, and the packing keeps that sum at most kL1Max, so below 2^31.
// Blocks of 64 values at 5,792 each (64 kQ^2 < 2^31, the scheme before this one) needed no
// such rule, but cost a float32 epilogue per 64 values of k and steps twice x's: on the default
// model's layers over a real prompt's activations this scheme's mean error is 0.79x that
// scheme's (1/8.1 of bfloat16 arithmetic's, against 1/6.4), and its GEMMs ran 1.03-1.06x
// faster (BENCHMARKS.md, sixty-second round; benchmarks/i16_accuracy.py).
//
// The layout is fp16_gemm's: a panel row holds 16 output columns for two values of k (lane
// 2j: w[k][j], lane 2j + 1: w[k + 1][j]); x's (x[k], x[k + 1]) pairs are read by one 32-bit
// broadcast, and one `vpdpwssd` adds both products of the pair into column j's lane. Rows go
// in blocks of kBlockRows; the threads claim runs of panel pairs (groups of 4 panels in a pass
// of kWideRows rows or more) within a block, and each tile prefetches a share of the next
// item's panels into L2, as fp16_gemm's and gemm.cpp's do (a decode pass on AMD: with the
// non-temporal hint, vendor_choice.h gemm_prefetch_nta).
#include "ops.h"
#include "argmax_lanes.h"
#include "claims.h"
#include "silu.h"
#include "vendor_choice.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {
constexpr int64_t kCols = 16;         // output columns per panel; a panel row is 32 int16 lanes
constexpr int64_t kPairs = 64;        // pairs of k per scaled block
constexpr int64_t kBlock = 2 * kPairs;
constexpr float kQ = 11585.0f;        // the largest |int16| of a block (2^13.5)
// The largest sum of a W block's |int16| values: kQ * kL1Max < 2^31, so that no block's int32
// sum overflows. A block whose sum at kQ is larger is scaled again to kL1Target (rounding adds
// less than 128 to that).
constexpr int64_t kL1Max = 2147483647 / static_cast<int64_t>(kQ);  // 185,367
constexpr double kL1Target = static_cast<double>(kL1Max - 256);
constexpr int64_t kBlockRows = 256;   // rows whose int16 copy the panels pass over in turn

// v's block [0, n) as int16 steps of scale amax / kq (the scale returned; 0 for a block of
// zeros): q = round-half-even(v * (kq / amax)), as the tests compute it in torch. `rint`
// rounds as `nearbyint` does in the default mode, and the compiler makes it one instruction
// (a 16-lane loop) where `nearbyint` was a library call per value.
inline float quantize_block(const float* v, int64_t n, int16_t* q, float kq = kQ) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(v[i]));
  if (!(amax > 0.0f)) {
    std::fill(q, q + n, int16_t{0});
    return 0.0f;
  }
  const float inv = kq / amax;
  for (int64_t i = 0; i < n; ++i)
    q[i] = static_cast<int16_t>(std::clamp(std::rint(v[i] * inv), -kq, kq));
  return amax / kq;
}

// A W block: as quantize_block, then, where the sum of its |int16| values passes kL1Max, again
// with the step kq = floor(kQ * kL1Target / sum) (an integer, as the tests compute it).
inline float quantize_weight_block(const float* v, int64_t n, int16_t* q) {
  float scale = quantize_block(v, n, q);
  int64_t l1 = 0;
  for (int64_t i = 0; i < n; ++i) l1 += std::abs(static_cast<int64_t>(q[i]));
  if (l1 > kL1Max) {
    scale = quantize_block(v, n, q, static_cast<float>(std::floor(kQ * kL1Target / l1)));
    l1 = 0;
    for (int64_t i = 0; i < n; ++i) l1 += std::abs(static_cast<int64_t>(q[i]));
    TORCH_CHECK(l1 <= kL1Max, "i16_gemm_pack: a block's int16 sum ", l1, " passes ", kL1Max);
  }
  return scale;
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> i16_gemm_pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "i16_gemm_pack: weight must be a float32 or bfloat16 [N, K] CPU tensor");
  const at::Tensor w = weight.contiguous().to(at::kFloat);
  TORCH_CHECK(w.numel() == 0 || w.abs().max().item<float>() < INFINITY,
              "i16_gemm_pack: the weight has values that are not finite");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = (n + kCols - 1) / kCols, pairs = (k + 1) / 2;
  const int64_t blocks = (pairs + kPairs - 1) / kPairs;
  at::Tensor packed = at::zeros({panels, pairs, 2 * kCols}, w.options().dtype(at::kShort));
  at::Tensor scales = at::zeros({panels, blocks, kCols}, w.options());
  const float* src = w.data_ptr<float>();
  int16_t* dst = packed.data_ptr<int16_t>();
  float* sc = scales.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
    // One panel's block: its columns' int16 values (an odd k's last pair padded with 0), then
    // laid out pair by pair, each pair of k one 32-bit lane per column.
    int16_t q[kCols][kBlock];
    for (int64_t p = b; p < e; ++p) {
      const int64_t cols = std::min(kCols, n - p * kCols);
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t k0 = blk * kBlock, len = std::min(kBlock, k - k0);
        for (int64_t j = 0; j < cols; ++j) {
          sc[(p * blocks + blk) * kCols + j] =
              quantize_weight_block(src + (p * kCols + j) * k + k0, len, q[j]);
          if (len % 2) q[j][len] = 0;  // an odd k's last pair (len < kBlock then)
        }
        int16_t* d = dst + (p * pairs + k0 / 2) * 2 * kCols;
        for (int64_t i = 0; i < (len + 1) / 2; ++i, d += 2 * kCols)
          for (int64_t j = 0; j < cols; ++j) {
            d[2 * j] = q[j][2 * i];
            d[2 * j + 1] = q[j][2 * i + 1];
          }
      }
    }
  });
  return {packed, scales};
}

bool gemm_prefetch_nta(std::optional<bool> set) {
  if (set.has_value()) keel::gemm_prefetch_nta().store(*set, std::memory_order_relaxed);
  return keel::gemm_prefetch_nta().load(std::memory_order_relaxed);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512F__)
#include <immintrin.h>

bool i16_gemm_available() { return true; }

namespace {

// Panels an item takes, and rows per register tile: a pass of fewer than kWideRows rows (a
// decode step's) in pairs of panels by up to 10 rows (20 int32 accumulators), a longer one in
// groups of 4 panels by up to 6 rows (24 accumulators, half the row broadcasts a product).
// At 2,052 rows the groups of 4 ran the default model's four layer kinds 1.03x faster; at 64
// rows its 120 decode GEMMs ran 1.03x slower than in pairs (BENCHMARKS.md, sixty-second round).
constexpr int64_t kWideRows = 256;

// acc += the pairs' products of a and b (`vpdpwssd`), written out: through the intrinsic GCC
// copied every accumulator to another register, and some through the stack, at each step.
inline void dpwssd(__m512i& acc, __m512i a, __m512i b) {
  __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// One block of k (pairs kb .. ke) of a tile: R rows of xq (pairs per row `ldx`) against P
// adjacent panels (the first at w, the next `pstride` int16 values on; their block scales ws,
// the next `sstride` on: this block's 16 each), summed in int32, then scaled by each row's block
// scale (sx, stride `blocks`) times each column's and added to the float32 sums f [R][P][16]
// (the first block's `first`: stored, so that f needs no zeroing per tile; the same bits),
// prefetching `pf` .. `pf_end` (lines of the next item's panels) one line every two pairs, or
// two (`two`) where the tile's share has more lines than half its pairs (a tile of few rows,
// whose share is the whole next item). Two lines every two pairs for every tile ran the
// default model's 120 decode GEMMs from memory 1.02-1.03x slower at 8 rows and 1.05-1.10x at 64
// (level at 512; BENCHMARKS.md, fifty-first round). Nothing but this in here, so that the
// int32 accumulators live in registers.
template <int R, int P>
__attribute__((noinline)) void block_dot(const int16_t* xq, int64_t ldx, const float* sx,
                                         int64_t blocks, const int16_t* w, int64_t pstride,
                                         const float* ws, int64_t sstride, int64_t kb,
                                         int64_t ke, float* f, const char*& pf,
                                         const char* pf_end, bool two, bool stream,
                                         bool first) {
  __m512i c[P][R];
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 10
    for (int r = 0; r < R; ++r) c[p][r] = _mm512_setzero_si512();
  for (int64_t kp = kb; kp < ke; ++kp) {
    if ((kp & 1) == 0 && pf < pf_end) {  // the next item's weights (prefetch_weights)
      keel::prefetch_weights(pf, stream);
      pf += 64;
      if (two) {
        keel::prefetch_weights(pf, stream);
        pf += 64;
      }
    }
    __m512i wv[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      wv[p] = _mm512_loadu_si512(w + p * pstride + kp * 2 * kCols);
      __asm__("" : "+v"(wv[p]));  // in registers, not folded into each dot product
    }
#pragma GCC unroll 10
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, xq + (r * ldx + kp) * 2, 4);
      const __m512i a = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) dpwssd(c[p][r], a, wv[p]);
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) {
    const __m512 sp = _mm512_loadu_ps(ws + p * sstride);
#pragma GCC unroll 10
    for (int r = 0; r < R; ++r) {
      float* fr = f + (r * P + p) * kCols;
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(sx[r * blocks]), sp);
      const __m512 sum = _mm512_cvtepi32_ps(c[p][r]);
      _mm512_store_ps(fr, first ? _mm512_mul_ps(sum, scale)
                                : _mm512_fmadd_ps(sum, scale, _mm512_load_ps(fr)));
    }
  }
}

// R rows of xq (pairs per row `ldx`, each row's block scales at sx + r * blocks) against P
// adjacent panels (the first at w, each `pairs` * 32 int16 values; their block scales from s,
// `blocks` * 16 each): out[r][j] = the sum over blocks of (int32 sum) * sx * sw, + bias[j], for
// the first `cols` of the P * 16 columns (row stride ldo); with Silu (P even: 16 gate columns,
// then their 16 up columns, for each pair of panels) out[r][j] = silu(gate) * up for 16 columns
// a pair. With `argmax` (i16_gemm_argmax), out[r][j] goes to the thread's argmax lanes as row
// argmax->row + r, column argmax->col + j instead of to `out`.
struct TileArgmax {
  int64_t row, col, n_valid;
};
template <int R, int P, bool Silu = false>
__attribute__((noinline)) void tile(const int16_t* xq, int64_t ldx, const float* sx,
                                    int64_t blocks, const int16_t* w, const float* s,
                                    int64_t pairs, const float* bias, int64_t cols, float* out,
                                    int64_t ldo, const char* pf, const char* pf_end,
                                    bool stream, const TileArgmax* argmax) {
  alignas(64) float f[R][P][kCols];  // the float32 sums, between blocks (the first block's set)
  const bool two = (pf_end - pf + 63) / 64 * 2 > pairs;
  const int64_t pstride = pairs * 2 * kCols, sstride = blocks * kCols;
  if (pairs == 0) std::fill(&f[0][0][0], &f[0][0][0] + R * P * kCols, 0.f);  // K = 0: no block
  // The tile's output lines (16 floats a panel, one a pair with Silu), fetched for writing a
  // few before each block: stored cold at the tile's end, each waited on a read for ownership,
  // with the next tile's loads behind them. Same bits; at 2,052 and 4,096 rows qkv ran
  // 1.20-1.26x faster, o 1.15-1.18x, [gate; up] + SiLU 1.10-1.14x, down 1.04-1.08x, at 64 rows
  // from memory 1.01-1.04x (BENCHMARKS.md, fifty-third round; gemm.cpp's tile does the same).
  constexpr int kOutPanels = Silu ? P / 2 : P;
  const int64_t out_lines = argmax != nullptr ? 0 : R * kOutPanels;
  const int64_t blks = (pairs + kPairs - 1) / kPairs;
  const int64_t per_blk = blks > 0 ? (out_lines + blks - 1) / blks : 0;
  for (int64_t blk = 0, kb = 0; kb < pairs; ++blk, kb += kPairs) {
    for (int64_t j = blk * per_blk; j < std::min(out_lines, (blk + 1) * per_blk); ++j) {
      const int64_t pp = j % kOutPanels;
      if (pp * kCols < (Silu ? cols / 2 : cols))
        _mm_prefetch(reinterpret_cast<const char*>(out + j / kOutPanels * ldo + pp * kCols),
                     _MM_HINT_ET0);
    }
    block_dot<R, P>(xq, ldx, sx + blk, blocks, w, pstride, s + blk * kCols, sstride, kb,
                    std::min(pairs, kb + kPairs), &f[0][0][0], pf, pf_end, two, stream,
                    blk == 0);
  }
  if constexpr (Silu) {
    static_assert(P % 2 == 0, "silu_mul pairs a gate panel with its up panel");
    for (int pp = 0; pp < P / 2; ++pp) {
      const float* bp = bias != nullptr ? bias + 2 * pp * kCols : nullptr;
      const __m512 bg = bp != nullptr ? _mm512_loadu_ps(bp) : _mm512_setzero_ps();
      const __m512 bu = bp != nullptr ? _mm512_loadu_ps(bp + kCols) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const __m512 gate = _mm512_add_ps(_mm512_load_ps(f[r][2 * pp]), bg);
        const __m512 up = _mm512_add_ps(_mm512_load_ps(f[r][2 * pp + 1]), bu);
        _mm512_storeu_ps(out + r * ldo + pp * kCols, _mm512_mul_ps(keel::silu16(gate), up));
      }
    }
    return;
  }
  for (int pp = 0; pp < P; ++pp) {
    const int64_t c = std::min<int64_t>(kCols, cols - pp * kCols);
    if (c <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << c) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + pp * kCols)
                                     : _mm512_setzero_ps();
    if (argmax != nullptr) {  // the values the output would hold (lanes past n_valid skipped)
      keel::ArgmaxLanes& lanes = keel::thread_argmax_lanes();
      for (int r = 0; r < R; ++r)
        lanes.update(argmax->row + r, argmax->col + pp * kCols,
                     _mm512_add_ps(_mm512_load_ps(f[r][pp]), b), argmax->n_valid);
      continue;
    }
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + r * ldo + pp * kCols, mask,
                            _mm512_add_ps(_mm512_load_ps(f[r][pp]), b));
  }
}

template <int P, bool Silu, int MaxR>
void tile_rows(int rows, const int16_t* xq, int64_t ldx, const float* sx, int64_t blocks,
               const int16_t* w, const float* s, int64_t pairs, const float* bias, int64_t cols,
               float* out, int64_t ldo, const char* pf, const char* pf_end, bool stream,
               const TileArgmax* argmax) {
  // (run_panel_groups splits rows into tiles of at most MaxR: a larger one would be skipped)
  TORCH_CHECK(rows >= 1 && rows <= MaxR, "i16_gemm: a tile of ", rows, " rows");
  keel::with_rows<MaxR>(rows, [&](auto r) {
    tile<decltype(r)::value, P, Silu>(xq, ldx, sx, blocks, w, s, pairs, bias, cols, out, ldo, pf,
                                      pf_end, stream, argmax);
  });
}

// One block of a row: the scale, and q = round-half-even(v * (kQ / amax)) as quantize_block
// computes it (the same float32 product, rounded by the vector unit's default mode).
// A block with a NaN or an infinity gets a NaN scale, so that every output it adds to is NaN,
// as float32 arithmetic would make it (its int16 values are then of no account).
inline float quantize_block16(const float* v, int64_t n, int16_t* q) {
  // A whole block in registers: its 8 vectors loaded once, their maxima as a tree (a call of
  // 64 x 576, mostly this, took 0.85x the time on one thread; BENCHMARKS.md, sixty-fourth
  // round). The same values and steps as the loop below.
  if (n == kBlock) {
    __m512 x[8];
    __mmask16 bad = 0;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      x[i] = _mm512_loadu_ps(v + 16 * i);
      bad |= _mm512_fpclass_ps_mask(x[i], 0x99);  // quiet NaN, +inf, -inf, signalling NaN
    }
    const __m512 m01 = _mm512_max_ps(_mm512_abs_ps(x[0]), _mm512_abs_ps(x[1]));
    const __m512 m23 = _mm512_max_ps(_mm512_abs_ps(x[2]), _mm512_abs_ps(x[3]));
    const __m512 m45 = _mm512_max_ps(_mm512_abs_ps(x[4]), _mm512_abs_ps(x[5]));
    const __m512 m67 = _mm512_max_ps(_mm512_abs_ps(x[6]), _mm512_abs_ps(x[7]));
    const float amax =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m01, m23), _mm512_max_ps(m45, m67)));
    if (bad || !(amax > 0.0f)) {
      std::memset(q, 0, n * sizeof(int16_t));
      return bad ? std::nanf("") : 0.0f;
    }
    const __m512 inv = _mm512_set1_ps(kQ / amax);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * i),
                          _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x[i], inv))));
    return amax / kQ;
  }
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(m, v + i);
    bad |= _mm512_fpclass_ps_mask(x, 0x99);  // quiet NaN, +inf, -inf, signalling NaN
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(x));
  }
  if (bad) {
    std::memset(q, 0, n * sizeof(int16_t));
    return std::nanf("");
  }
  const float amax = _mm512_reduce_max_ps(vmax);
  if (!(amax > 0.0f)) {
    std::memset(q, 0, n * sizeof(int16_t));
    return 0.0f;
  }
  const __m512 inv = _mm512_set1_ps(kQ / amax);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, v + i), inv));
    _mm256_mask_storeu_epi16(q + i, m, _mm512_cvtepi32_epi16(qi));
  }
  return amax / kQ;
}

// Every (block of kBlockRows rows, group of G panels) item (claims.h run_panel_groups), each
// block of rows in tiles of up to MaxR rows; with `sink`, each row's argmax merged into it
// instead of the output written (o unused).
template <int64_t G, int MaxR>
void run_groups(int64_t m, int64_t n, int64_t pairs, int64_t blocks, const int16_t* xq,
                const float* sx, const int16_t* w, const float* ws, const float* b,
                bool silu_mul, float* o, int64_t ldo, keel::ArgmaxSink* sink = nullptr) {
  const int64_t panels = (n + kCols - 1) / kCols;
  const int64_t panel_elems = pairs * 2 * kCols, panel_scales = blocks * kCols;
  // One block of rows (a decode pass) reads each weight line in one item only.
  const bool stream =
      m <= kBlockRows && keel::gemm_prefetch_nta().load(std::memory_order_relaxed);
  keel::run_panel_groups<kBlockRows, MaxR, G>(
      m, panels, reinterpret_cast<const char*>(w), panel_elems * 2,
      [&](int64_t p, int np, int64_t r0, int rows, const char* pf0, const char* pf1) {
        const int16_t* wp = w + p * panel_elems;
        const float* sp = ws + p * panel_scales;
        const int64_t c0 = p * kCols, cols = std::min<int64_t>(np * kCols, n - c0);
        const float* bc = b != nullptr ? b + c0 : nullptr;
        const int16_t* xr = xq + r0 * 2 * pairs;
        const float* sr = sx + r0 * blocks;
        float* oc = sink != nullptr ? nullptr : o + (silu_mul ? p / 2 * kCols : c0) + r0 * ldo;
        const TileArgmax argmax{r0, c0, sink != nullptr ? sink->n_valid : 0};
        auto run = [&](auto pc, auto silu) {
          tile_rows<decltype(pc)::value, decltype(silu)::value, MaxR>(
              rows, xr, pairs, sr, blocks, wp, sp, pairs, bc, cols, oc, ldo, pf0, pf1, stream,
              sink != nullptr ? &argmax : nullptr);
        };
        using Plain = std::false_type;
        using Silu = std::true_type;
        if constexpr (G == 4) {
          if (np == 4) {
            if (silu_mul) run(std::integral_constant<int, 4>{}, Silu{});
            else run(std::integral_constant<int, 4>{}, Plain{});
            return;
          }
          if (np == 3) return run(std::integral_constant<int, 3>{}, Plain{});
        }
        if (np == 2) {
          if (silu_mul) run(std::integral_constant<int, 2>{}, Silu{});
          else run(std::integral_constant<int, 2>{}, Plain{});
        } else {
          run(std::integral_constant<int, 1>{}, Plain{});
        }
      },
      [&] {
        if (sink != nullptr) keel::thread_argmax_lanes().reset(m);
      },
      [&] {
        if (sink != nullptr) keel::thread_argmax_lanes().merge(m, *sink);
      });
}

}  // namespace

namespace {

// x's rows in int16 with their blocks' scales (i16_gemm's and i16_gemm_argmax's checks first),
// in buffers kept by the calling thread from one call to the next (a decode step makes ~4
// calls a layer).
struct QuantizedX {
  int64_t m, k, pairs, blocks;
  const int16_t* xq;
  const float* sx;
};

QuantizedX quantize_x(const char* name, const at::Tensor& x, const at::Tensor& packed,
                      const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), name,
              ": x must be a float32 [M, K] CPU tensor");
  const int64_t m = x.size(0), k = x.size(1), pairs = (k + 1) / 2;
  const int64_t panels = (n + kCols - 1) / kCols, blocks = (pairs + kPairs - 1) / kPairs;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kShort && packed.is_contiguous() &&
                  packed.size(0) == panels && packed.size(1) == pairs &&
                  packed.size(2) == 2 * kCols,
              name, ": packed must be i16_gemm_pack's [ceil(N/16), ceil(K/2), 32] for N = ", n,
              " and K = x.size(1) = ", k);
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == panels && scales.size(1) == blocks &&
                  scales.size(2) == kCols,
              name, ": scales must be i16_gemm_pack's [ceil(N/16), blocks, 16]");
  thread_local std::vector<int16_t> xq_buffer;
  thread_local std::vector<float> sx_buffer;
  if (static_cast<int64_t>(xq_buffer.size()) < m * 2 * pairs) xq_buffer.resize(m * 2 * pairs);
  if (static_cast<int64_t>(sx_buffer.size()) < m * blocks) sx_buffer.resize(m * blocks);
  const at::Tensor xc = x.contiguous();
  const float* xs = xc.data_ptr<float>();
  int16_t* xq = xq_buffer.data();
  float* sx = sx_buffer.data();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int16_t* dst = xq + r * 2 * pairs;
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t k0 = blk * kBlock;
        sx[r * blocks + blk] = quantize_block16(xs + r * k + k0, std::min(kBlock, k - k0),
                                                dst + k0);
      }
      if (k % 2) dst[k] = 0;  // an odd K's last pair: its second value is nothing
    }
  });
  return {m, k, pairs, blocks, xq, sx};
}

// Every item of the pass (groups of 4 panels from kWideRows rows on, else pairs).
void run_pass(const QuantizedX& q, const at::Tensor& packed, const at::Tensor& scales,
              int64_t n, const float* b, bool silu_mul, float* o, int64_t ldo,
              keel::ArgmaxSink* sink) {
  const int16_t* w = packed.data_ptr<int16_t>();
  const float* ws = scales.data_ptr<float>();
  if (q.m >= kWideRows)
    run_groups<4, 6>(q.m, n, q.pairs, q.blocks, q.xq, q.sx, w, ws, b, silu_mul, o, ldo, sink);
  else
    run_groups<2, 10>(q.m, n, q.pairs, q.blocks, q.xq, q.sx, w, ws, b, silu_mul, o, ldo, sink);
}

}  // namespace

at::Tensor i16_gemm(at::Tensor x, at::Tensor packed, at::Tensor scales, int64_t n,
                    std::optional<at::Tensor> bias, bool silu_mul) {
  TORCH_CHECK(!silu_mul || n % (2 * kCols) == 0,
              "i16_gemm: silu_mul needs whole pairs of [16 gate | 16 up] columns");
  const float* b = float32_bias(bias, n, "i16_gemm");
  const QuantizedX q = quantize_x("i16_gemm", x, packed, scales, n);
  const int64_t ldo = silu_mul ? n / 2 : n;
  at::Tensor out = at::empty({q.m, ldo}, x.options());
  if (q.m == 0 || n == 0) return out;
  run_pass(q, packed, scales, n, b, silu_mul, out.data_ptr<float>(), ldo, nullptr);
  return out;
}

// Greedy sampling fused into the LM head: each row's argmax over columns [0, n_valid) of
// i16_gemm(x, packed, scales, n, bias)'s output (the same float32 values, compared as torch's
// argmax compares them: argmax_lanes.h), without writing the [M, n] output.
at::Tensor i16_gemm_argmax(at::Tensor x, at::Tensor packed, at::Tensor scales, int64_t n,
                           int64_t n_valid, std::optional<at::Tensor> bias) {
  TORCH_CHECK(n_valid > 0 && n_valid <= n, "i16_gemm_argmax: 0 < n_valid <= N needed");
  const float* b = float32_bias(bias, n, "i16_gemm_argmax");
  const QuantizedX q = quantize_x("i16_gemm_argmax", x, packed, scales, n);
  at::Tensor out = at::empty({q.m}, x.options().dtype(at::kLong));
  if (q.m == 0) return out;
  keel::ArgmaxSink sink;
  sink.n_valid = n_valid;
  sink.value.assign(q.m, 0.f);
  sink.index.assign(q.m, -1);
  run_pass(q, packed, scales, n, b, false, nullptr, 0, &sink);
  std::memcpy(out.data_ptr<int64_t>(), sink.index.data(), q.m * sizeof(int64_t));
  return out;
}

#else  // no AVX512-VNNI

bool i16_gemm_available() { return false; }
at::Tensor i16_gemm(at::Tensor, at::Tensor, at::Tensor, int64_t, std::optional<at::Tensor>,
                    bool) {
  TORCH_CHECK(false, "i16_gemm needs AVX512-VNNI (i16_gemm_available() is false here)");
}
at::Tensor i16_gemm_argmax(at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t,
                           std::optional<at::Tensor>) {
  TORCH_CHECK(false, "i16_gemm_argmax needs AVX512-VNNI (i16_gemm_available() is false here)");
}

#endif
