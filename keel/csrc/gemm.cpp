// keel's float32 GEMM for the CPU: out [M, N] = x [M, K] @ W^T (+ bias), with W packed once at
// load into panels of 16 output columns, each panel K rows of 16 weights in a row:
//
//   gemm_pack(W [N, K] float32 or bfloat16) -> [ceil(N / 16), K, 16] of the same dtype
//   gemm(x [M, K] float32, packed, N, bias) -> [M, N] float32
//   gemm_silu(x, packed [gate; up] of N = 2I rows, N, bias) -> [M, I] = silu(gate) * up
//
// Why not oneDNN: at a decode step's shapes (64 rows against the default model's weights)
// oneDNN's packed GEMM reaches its rate only with the weight hot in cache; a real step reads
// every layer's weights from memory once, and there the same GEMMs ran ~1.2-1.35x slower
// (BENCHMARKS.md, fifth round). Here each panel is streamed once per block of rows and
// reused from L1/L2 by every 6-row tile of the block, and while a panel is being
// used the next one is prefetched into L2, a few lines per tile, so the stream from memory
// overlaps the arithmetic instead of stalling the first tile of every panel.
//
// A bfloat16 weight stays bfloat16 (half the bytes to stream) and is widened exactly in
// registers; each 32-bit word of its panel row holds column j in the low half and column
// j + 8 in the high half, so one load, a shift and a mask give the 16 floats. The arithmetic
// is float32 throughout (as oneDNN's GEMM over the weight's float32 upcast), accumulated over
// k in order for every output.
//
// AVX2 + FMA intrinsics (8 lanes, `Avx2Tile` in gemm_avx2.h), or AVX-512 (16 lanes) where the
// CPU has it: the same panels and the same bits (`Avx512Tile` in gemm_512.h; both headers are
// part of this file's translation unit); `gemm_available()` is false on other CPUs, where keel
// keeps oneDNN. Where AVX-512 is present, keel/model_executor/layers/gemm_choice.py times
// keel's and oneDNN's at load and keeps the faster.
#include "ops.h"
#include "claims.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

bool gemm_available() { return true; }

namespace {

constexpr int64_t kCols = 16;      // output columns per panel (two AVX2 registers)
constexpr int kRows = 6;           // rows per register tile: 12 accumulators
constexpr int64_t kBlockBytes = 384 * 1024;  // a block of x rows that stays in L2

// Where a tile's results will be written (its first row at p, rows ld floats apart, 16 floats
// a panel), for the AVX-512 tile to fetch those lines for writing while it runs: stored cold at
// the tile's end, each store waited on a read for ownership from memory, and the next tile's
// first loads behind them. One line every 16 steps of k: at 2,052 rows qkv and o ran 1.07x and
// 1.10x faster, [gate; up] + SiLU 1.03x, down 1.02x; at 64 rows from memory 1.02-1.05x; the
// same bits (BENCHMARKS.md, fifty-third round). p null: nothing to fetch (the gate half of
// [gate; up], whose sums go to the stack). The AVX2 tile ignores it: level there.
struct WriteAhead {
  float* p = nullptr;
  int64_t ld = 0;
};

}  // namespace

#include "gemm_avx2.h"
#include "gemm_512.h"

namespace {

// The work is every (block of rows, group of Tile::kPanels adjacent panels) pair, block by
// block: a block's x stays in L2 and each of its tiles runs over the group in turn, which is
// streamed from memory once per block. The threads claim runs of groups (claims.h) rather than
// taking fixed halves, so a core slowed by the host does not leave the other waiting. Before
// the last group of its run a thread claims its next run, so that it prefetches the next
// group it will use (one range: a group's panels are adjacent), a few lines per tile, at a
// run's end as inside it.
//
// With `Silu`, the weight is a merged [gate; up] of n = 2 * I rows, I a multiple of 16, and
// out is [M, I] = silu(x Wg^T + bg) * (x Wu^T + bu): an item is a block of rows against gate
// panels p.. and up panels p + I / 16.., each tile computing both into the stack and
// combining them there, so the [M, 2I] product is never written to memory and read back.
template <typename W, bool Silu, typename Tile>
void run_gemm(const float* x, int64_t m, int64_t k, const W* packed, int64_t n,
              const float* bias, float* out) {
  constexpr int kRowsT = Tile::kRows;
  constexpr int64_t kGroup = Tile::kPanels, kWidth = kGroup * kCols;
  const Tile tile;
  const int64_t half = Silu ? n / 2 / kCols : 0;  // up panel of gate panel p: p + half
  const int64_t ldo = Silu ? n / 2 : n;
  const int64_t panels = Silu ? half : (n + kCols - 1) / kCols;
  const int64_t groups = (panels + kGroup - 1) / kGroup;
  const int64_t panel_elems = k * kCols;
  const int64_t panel_bytes = panel_elems * static_cast<int64_t>(sizeof(W));
  // Not rounded down to whole tiles (a block's tiles are as even as can be): at K = 1,536 that
  // made 64 rows a block of 60 and one of 4, which streamed down_proj's weights twice.
  const int64_t block = std::max<int64_t>(kRowsT, kBlockBytes / (k * 4));
  // Item i: block i / groups of rows against group i % groups.
  const int64_t items = (m + block - 1) / block * groups;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), groups);
  keel::Claims claims(items, threads, groups);
  keel::on_threads(threads, [&] {
    int64_t end = 0, i = claims.claim(end);
    while (i < items) {
      const int64_t m0 = i / groups * block, p = i % groups * kGroup;
      const int np = static_cast<int>(std::min<int64_t>(kGroup, panels - p));
      const int64_t mb = std::min(block, m - m0);
      // As few tiles as the tile height allows, as even as can be (64 rows of AVX2's 6-row
      // tiles: 9 x 6 + 2 x 5, not 10 x 6 + 4: a 4-row tile did 1.7x less per row than a
      // 6-row one in a decode step).
      const int64_t tiles = (mb + kRowsT - 1) / kRowsT;
      const int64_t base = mb / tiles, extra = mb % tiles;  // the first `extra` get one more
      int64_t next = i + 1, next_end = end;
      if (next == end) next = claims.claim(next_end);
      // The next item's group, unless there is none (its bytes then prefetch nothing).
      const char* pf = nullptr;
      int64_t pf_bytes = 0;
      if (next < items) {
        const int64_t np0 = next % groups * kGroup;
        pf = reinterpret_cast<const char*>(packed + np0 * panel_elems);
        pf_bytes = std::min<int64_t>(kGroup, panels - np0) * panel_bytes;
      }
      const int64_t share = (pf_bytes + tiles - 1) / tiles;  // bytes prefetched per tile
      const W* w = packed + p * panel_elems;
      const int64_t cols = std::min(np * kCols, n - p * kCols);  // (not Silu)
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r0 = m0 + t * base + std::min(t, extra);
        const int rows = static_cast<int>(base + (t < extra));
        const int64_t pf0 = std::min(pf_bytes, t * share);
        const int64_t pf1 = std::min(pf_bytes, (t + 1) * share);
        if constexpr (Silu) {  // gate then up, each prefetching its next group's share
          float gate[kRowsT * kWidth], up[kRowsT * kWidth];
          const char* pf_up = pf != nullptr ? pf + half * panel_bytes : nullptr;
          tile(np, rows, x + r0 * k, k, w, k, gate, kWidth, pf + pf0, pf + pf1);
          tile(np, rows, x + r0 * k, k, w + half * panel_elems, k, up, kWidth, pf_up + pf0,
               pf_up + pf1, WriteAhead{out + r0 * ldo + p * kCols, ldo});
          const int64_t c = np * kCols;
          for (int r = 0; r < rows; ++r) {
            float* g = gate + r * kWidth;
            float* u = up + r * kWidth;
            if (bias != nullptr) {  // the sums, then + bias, as gemm adds it
              for (int64_t j = 0; j < c; ++j) {
                g[j] += bias[p * kCols + j];
                u[j] += bias[(p + half) * kCols + j];
              }
            }
            silu_mul_f32(g, u, out + (r0 + r) * ldo + p * kCols, c);
          }
        } else if (cols == np * kCols) {
          tile(np, rows, x + r0 * k, k, w, k, out + r0 * n + p * kCols, n, pf + pf0, pf + pf1,
               WriteAhead{out + r0 * n + p * kCols, n});
        } else {  // the last panel of an N that is not a multiple of 16
          float tmp[kRowsT * kWidth];
          tile(np, rows, x + r0 * k, k, w, k, tmp, kWidth, pf + pf0, pf + pf1);
          for (int r = 0; r < rows; ++r)
            std::memcpy(out + (r0 + r) * n + p * kCols, tmp + r * kWidth, cols * sizeof(float));
        }
      }
      if (!Silu && bias != nullptr) {  // the sums, then + bias, as in registers
        const float* b = bias + p * kCols;
        for (int64_t r = m0; r < m0 + mb; ++r) {
          float* o = out + r * n + p * kCols;
          for (int64_t j = 0; j < cols; ++j) o[j] += b[j];
        }
      }
      i = next, end = next_end;
    }
  });
}

// The widest tile this build has.
#if defined(__AVX512F__)
template <typename W> using BestTile = Avx512Tile<W>;
#else
template <typename W> using BestTile = Avx2Tile<W>;
#endif

}  // namespace

at::Tensor gemm_pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "gemm_pack: weight must be a float32 or bfloat16 [N, K] CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kCols - 1) / kCols;
  at::Tensor packed = at::zeros({panels, k, kCols}, w.options());
  if (w.scalar_type() == at::kFloat) {
    const float* src = w.data_ptr<float>();
    float* dst = packed.data_ptr<float>();
    at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p)
        for (int64_t j = 0; j < std::min(kCols, n - p * kCols); ++j)
          for (int64_t kk = 0; kk < k; ++kk)
            dst[(p * k + kk) * kCols + j] = src[(p * kCols + j) * k + kk];
    });
  } else {  // word j of a row: column j (low half), column j + 8 (high half)
    const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
    at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p)
        for (int64_t j = 0; j < std::min(kCols, n - p * kCols); ++j) {
          const int64_t slot = j < 8 ? 2 * j : 2 * (j - 8) + 1;
          for (int64_t kk = 0; kk < k; ++kk)
            dst[(p * k + kk) * kCols + slot] = src[(p * kCols + j) * k + kk];
        }
    });
  }
  return packed;
}

namespace {

// gemm and gemm_silu: the arguments checked (`what` names the caller), then the kernel for the
// packed weight's dtype.
template <bool Silu>
at::Tensor gemm_entry(const char* what, const at::Tensor& x, const at::Tensor& packed,
                      int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), what,
              ": x must be a float32 [M, K] CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.is_contiguous() &&
                  packed.size(0) == (n + kCols - 1) / kCols && packed.size(1) == x.size(1),
              what, ": packed must be gemm_pack's [ceil(N/16), K, 16] for N = ", n,
              " and K = x.size(1) = ", x.size(1));
  const float* b = float32_bias(bias, n, what);
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  at::Tensor out = at::empty({m, Silu ? n / 2 : n}, xc.options());
  if (m == 0) return out;
  if (packed.scalar_type() == at::kFloat)
    run_gemm<float, Silu, BestTile<float>>(xc.data_ptr<float>(), m, k,
                                           packed.data_ptr<float>(), n, b,
                                           out.data_ptr<float>());
  else if (packed.scalar_type() == at::kBFloat16)
    run_gemm<uint16_t, Silu, BestTile<uint16_t>>(
        xc.data_ptr<float>(), m, k,
        reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), n, b,
        out.data_ptr<float>());
  else
    TORCH_CHECK(false, what, ": packed weights are float32 or bfloat16");
  return out;
}

}  // namespace

at::Tensor gemm(at::Tensor x, at::Tensor packed, int64_t n, std::optional<at::Tensor> bias) {
  return gemm_entry<false>("gemm", x, packed, n, bias);
}

at::Tensor gemm_silu(at::Tensor x, at::Tensor packed, int64_t n,
                     std::optional<at::Tensor> bias) {
  TORCH_CHECK(n % (2 * kCols) == 0, "gemm_silu: the merged [gate; up] weight's rows (", n,
              ") must be twice a multiple of 16");
  return gemm_entry<true>("gemm_silu", x, packed, n, bias);
}

#else  // no AVX2 + FMA: keel keeps oneDNN (layers/gemm_choice.py asks gemm_available())

bool gemm_available() { return false; }
at::Tensor gemm_pack(at::Tensor) { TORCH_CHECK(false, "gemm_pack needs AVX2 and FMA"); }
at::Tensor gemm(at::Tensor, at::Tensor, int64_t, std::optional<at::Tensor>) {
  TORCH_CHECK(false, "gemm needs AVX2 and FMA");
}
at::Tensor gemm_silu(at::Tensor, at::Tensor, int64_t, std::optional<at::Tensor>) {
  TORCH_CHECK(false, "gemm_silu needs AVX2 and FMA");
}

#endif
