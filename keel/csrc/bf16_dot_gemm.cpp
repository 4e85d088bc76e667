// amx_gemm's dense bfloat16 copy on AVX512-BF16's dot products (`vdpbf16ps`), for CPUs that
// have them and no AMX tiles (an AMD EPYC Zen 4: the sixty-seventh round of BENCHMARKS.md):
// amx_gemm and amx_gemm_argmax (amx_gemm.cpp) call bf16_dot_gemm where the tiles are missing.
//
//   out [M, N] bfloat16 = x [M, K] bfloat16 @ W^T (+ bias), float32 sums rounded once
//
// with amx_gemm's epilogues (amx_gemm_tiles.h): the bias added in float32 before the one
// rounding; silu_mul's gate and up each rounded as the GEMM's output, then silu rounded, times
// up, rounded (silu_and_mul of the bfloat16 output); argmax over the rounded values.
//
// Why: a `dtype="bfloat16"` decode step on oneDNN's `vdpbf16ps` GEMMs sat at 1.40-1.44x its
// GEMM floor on a Zen 4, where `auto`'s on i16_gemm (the same number of products a cycle) sat
// at 1.25x: the GEMMs themselves ran at their floor, the time went to what is around oneDNN's
// calls (the worker thread waiting on its fixed share: 15% of its time; malloc and the calls'
// set-up; BENCHMARKS.md, sixty-sixth round). This kernel is i16_gemm's schedule -- threads
// claiming runs of items (claims.h run_panel_groups), each tile prefetching a share of the
// next item's weights -- with bfloat16 pairs instead of int16 ones: no scales, no blocks of k,
// and x needs no conversion (its rows are read as they are). In the engine the bfloat16
// decode step at 64 requests took 0.90x the time on short contexts and 0.92x on long ones,
// and the 120 decode GEMMs from memory 0.90x at 64 rows (sixty-seventh round).
//
// The layout is amx_gemm_pack's: pairs of 16-column tiles, [N / 32][K / 32][2][16][32]; a
// tile's row p holds (w[k][c], w[k + 1][c]) for its 16 columns c, k = 32 s + 2 p, which is
// `vdpbf16ps`'s second operand as it is; x's (x[k], x[k + 1]) pairs are read by one 32-bit
// broadcast. A panel here is one tile column (16 output columns), and the panels of a pair
// lie interleaved in one stretch of memory, so the items are whole pairs (or two pairs).
#include "ops.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

#include "argmax_lanes.h"
#include "claims.h"
#include "silu.h"
#include "vendor_choice.h"

bool bf16_dot_gemm_available() { return true; }

namespace {

constexpr int64_t kCols = 16;          // output columns per panel (one tile column)
constexpr int64_t kBlockRows = 256;    // rows whose bfloat16 copy the pairs pass over in turn
constexpr int64_t kWideRows = 256;     // from here items of two pairs by up to 6 rows
constexpr int64_t kSliceElems = 1024;  // one slice of K (32 values) of a pair: two tiles

// acc += the pairs' products of a and b, written out as i16_gemm's dpwssd is (through the
// intrinsic GCC may copy each accumulator at every step).
inline void dpbf16(__m512& acc, __m512i a, __m512i b) {
  __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// v rounded to bfloat16 as the GEMM's output holds it, widened back to float32 (exact).
inline __m512 round_bf16(__m512 v, __m256i* bits = nullptr) {
  const __m256bh b = _mm512_cvtneps_pbh(v);
  if (bits != nullptr) *bits = (__m256i)b;
  return _mm512_cvtpbh_ps(b);
}

// The bias, float32 or bfloat16 (or neither), as amx_gemm takes it.
struct Bias {
  const float* f = nullptr;
  const c10::BFloat16* h = nullptr;
  explicit Bias(const std::optional<at::Tensor>& bias) {
    if (!bias.has_value() || !bias->defined()) return;
    if (bias->scalar_type() == at::kFloat)
      f = bias->data_ptr<float>();
    else
      h = bias->data_ptr<c10::BFloat16>();
  }
  // v plus the bias of columns [c, c + 16), as amx_gemm_tiles adds it.
  inline __m512 add(__m512 v, int64_t c) const {
    if (f != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(f + c));
    if (h != nullptr) v = _mm512_add_ps(v, keel::load_ps16(h + c));
    return v;
  }
};

struct TileArgmax {
  int64_t row, n_valid;
};

// The sums of R rows of x (row stride K) against P adjacent panels from panel p0's pair `w`
// (P = 2: one pair; 4: two), all of K, into f [R][P][16]. Prefetches pf .. pf_end (the next
// item's weights) one line every two pairs of k, or two (`two`) where the share is more than
// half the pairs, as i16_gemm's block_dot does. Nothing but this in here, so that the
// accumulators live in registers (with the epilogue in the same function GCC kept half of
// them on the stack: 280 against 400 GFLOP/s).
template <int R, int P>
__attribute__((noinline)) void dot(const c10::BFloat16* x, int64_t K, const c10::BFloat16* w,
                                   int64_t pair_stride, float* f, const char* pf,
                                   const char* pf_end, bool stream) {
  __m512 c[P][R];
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 10
    for (int r = 0; r < R; ++r) c[p][r] = _mm512_setzero_ps();
  const int64_t kpairs = K / 2;
  const bool two = (pf_end - pf + 63) / 64 * 2 > kpairs;
  const char* xb = reinterpret_cast<const char*>(x);
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    if ((kp & 1) == 0 && pf < pf_end) {
      keel::prefetch_weights(pf, stream);
      pf += 64;
      if (two) {
        keel::prefetch_weights(pf, stream);
        pf += 64;
      }
    }
    // Pair kp's row of each panel: slice kp / 16, tile p % 2, row kp % 16.
    const c10::BFloat16* wk = w + (kp >> 4) * kSliceElems + (kp & 15) * 32;
    __m512i wv[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      wv[p] = _mm512_loadu_si512(wk + (p >> 1) * pair_stride + (p & 1) * 512);
      __asm__("" : "+v"(wv[p]));  // in registers, not folded into each dot product
    }
#pragma GCC unroll 10
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, xb + (r * K + 2 * kp) * 2, 4);
      const __m512i a = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) dpbf16(c[p][r], a, wv[p]);
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 10
    for (int r = 0; r < R; ++r) _mm512_store_ps(f + (r * P + p) * kCols, c[p][r]);
}

// R rows' tile: dot's sums, then the epilogue for the first `cols` of the P * 16 columns,
// into out (row stride ldo; with Silu, [gate | up] pairs give 16 columns each, at column
// p0 / 2 * 16 of out, where `out` points) or, with `argmax`, into the thread's lanes as rows
// argmax->row + r, columns c0 + j.
template <int R, int P, bool Silu>
__attribute__((noinline)) void tile(const c10::BFloat16* x, int64_t K, const c10::BFloat16* w,
                                    int64_t pair_stride, Bias bias, int64_t c0, int64_t cols,
                                    c10::BFloat16* out, int64_t ldo, const char* pf,
                                    const char* pf_end, bool stream, const TileArgmax* argmax) {
  alignas(64) float f[R][P][kCols];
  dot<R, P>(x, K, w, pair_stride, &f[0][0][0], pf, pf_end, stream);
  if constexpr (Silu) {
    static_assert(P % 2 == 0, "silu_mul pairs a gate tile with its up tile");
    for (int pp = 0; pp < P / 2; ++pp)
      for (int r = 0; r < R; ++r) {
        const __m512 gate =
            round_bf16(bias.add(_mm512_load_ps(f[r][2 * pp]), c0 + 2 * pp * kCols));
        const __m512 up =
            round_bf16(bias.add(_mm512_load_ps(f[r][2 * pp + 1]), c0 + (2 * pp + 1) * kCols));
        __m256i bits;
        round_bf16(_mm512_mul_ps(round_bf16(keel::silu16(gate)), up), &bits);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + pp * kCols), bits);
      }
    return;
  }
  for (int p = 0; p < P; ++p) {
    if (p * kCols >= cols) break;  // a pair's padding tile (N % 32 == 16)
    for (int r = 0; r < R; ++r) {
      __m256i bits;
      const __m512 v = round_bf16(bias.add(_mm512_load_ps(f[r][p]), c0 + p * kCols), &bits);
      if (argmax != nullptr)
        keel::thread_argmax_lanes().update(argmax->row + r, c0 + p * kCols, v,
                                           argmax->n_valid);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + p * kCols), bits);
    }
  }
}

template <int P, bool Silu, int MaxR>
void tile_rows(int rows, const c10::BFloat16* x, int64_t K, const c10::BFloat16* w,
               int64_t pair_stride, Bias bias, int64_t c0, int64_t cols, c10::BFloat16* out,
               int64_t ldo, const char* pf, const char* pf_end, bool stream,
               const TileArgmax* argmax) {
  TORCH_CHECK(rows >= 1 && rows <= MaxR, "bf16_dot_gemm: a tile of ", rows, " rows");
  keel::with_rows<MaxR>(rows, [&](auto r) {
    tile<decltype(r)::value, P, Silu>(x, K, w, pair_stride, bias, c0, cols, out, ldo, pf, pf_end,
                                      stream, argmax);
  });
}

// Every (block of kBlockRows rows, G panels: one pair, or two) item; see the file's comment.
template <int64_t G, int MaxR>
void run_groups(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w,
                int64_t n, Bias bias, bool silu, c10::BFloat16* out,
                keel::ArgmaxSink* sink) {
  const int64_t pairs = (n + 31) / 32, panels = 2 * pairs;
  const int64_t pair_stride = K / 32 * kSliceElems;  // bfloat16 values per pair
  const int64_t ldo = silu ? n / 2 : n;
  // One block of rows (a decode pass) reads each weight line in one item only.
  const bool stream =
      M <= kBlockRows && keel::gemm_prefetch_nta().load(std::memory_order_relaxed);
  // A panel's bytes as claims.h counts them: half a pair's, pair_stride (the items are whole
  // pairs, so the prefetch ranges it gives are whole pairs too).
  keel::run_panel_groups<kBlockRows, MaxR, G>(
      M, panels, reinterpret_cast<const char*>(w), pair_stride,
      [&](int64_t p, int np, int64_t r0, int rows, const char* pf0, const char* pf1) {
        const int64_t c0 = p * kCols, cols = std::min<int64_t>(np * kCols, n - c0);
        const c10::BFloat16* wp = w + p / 2 * pair_stride;
        const c10::BFloat16* xr = x + r0 * K;
        c10::BFloat16* o =
            sink != nullptr ? nullptr : out + r0 * ldo + (silu ? p / 2 * kCols : c0);
        const TileArgmax argmax{r0, sink != nullptr ? sink->n_valid : 0};
        const TileArgmax* am = sink != nullptr ? &argmax : nullptr;
        auto run = [&](auto pc, auto s) {
          tile_rows<decltype(pc)::value, decltype(s)::value, MaxR>(
              rows, xr, K, wp, pair_stride, bias, c0, cols, o, ldo, pf0, pf1, stream, am);
        };
        if (G == 4 && np == 4) {
          if (silu) run(std::integral_constant<int, 4>{}, std::true_type{});
          else run(std::integral_constant<int, 4>{}, std::false_type{});
        } else if (silu) {
          run(std::integral_constant<int, 2>{}, std::true_type{});
        } else {
          run(std::integral_constant<int, 2>{}, std::false_type{});
        }
      },
      [&] {
        if (sink != nullptr) keel::thread_argmax_lanes().reset(M);
      },
      [&] {
        if (sink != nullptr) keel::thread_argmax_lanes().merge(M, *sink);
      });
}

}  // namespace

void bf16_dot_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                   const std::optional<at::Tensor>& bias_opt, bool silu, c10::BFloat16* out,
                   keel::ArgmaxSink* argmax) {
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  const c10::BFloat16* w = packed.data_ptr<c10::BFloat16>();
  const Bias bias(bias_opt);
  if (M >= kWideRows)
    run_groups<4, 6>(xp, M, K, w, n, bias, silu, out, argmax);
  else
    run_groups<2, 10>(xp, M, K, w, n, bias, silu, out, argmax);
}

#else  // no AVX512-BF16

bool bf16_dot_gemm_available() { return false; }
void bf16_dot_gemm(const at::Tensor&, const at::Tensor&, int64_t,
                   const std::optional<at::Tensor>&, bool, c10::BFloat16*, keel::ArgmaxSink*) {
  TORCH_CHECK(false, "bf16_dot_gemm needs AVX512-BF16 (bf16_dot_gemm_available() is false)");
}

#endif
