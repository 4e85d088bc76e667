// amx_gemm.cpp's tile kernel: amx_gemm_tiles, the loop of AMX tile products every amx_gemm,
// amx_gemm_argmax and amx_gemm_f32 call runs on, with the epilogues (bias, SiLU, greedy argmax)
// it runs beside the next block's products. Included by amx_gemm.cpp only, between its
// anonymous namespace's blocks: the file and this header are one translation unit, compiled
// as the single file was.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "argmax_lanes.h"
#include "claims.h"
#include "silu.h"

#if KEEL_AMX
namespace {

constexpr int64_t kAhead = 2;  // slices of the weight prefetched ahead of the first rows

// x [M, K] bfloat16 @ W^T -> out [M, n], one pair of 16 columns at a time; `pair_weight(j)`
// gives pair j's bfloat16 tiles ([K / 32][2][16][32]), called on the thread that computes it.
// Rows [0, M / 16 * 16) are read from xp, the last partial tile's (if M % 16) from `tail`:
// 16 rows, those past M zero.
//
// Rows go in panels of kPanelRows (kPanelRowsL1 where a pair fits in L1, see amx_gemm_tiles;
// the dense copy only; a widened copy keeps one panel): the threads claim (panel, pair) items
// panel by panel, so a prompt chunk's panel of x (147 KB at K = 576) stays in L2 while the
// pairs stream past it. Over all of a 2,048-row pass at once,
// each pair re-read x's 2.4 MB from L3 and the GEMM ran at 0.77x oneDNN's; in panels, 1.02-1.1x
// over the default model's four shapes, and 1.2-1.5x on its MLP with gate_up's SiLU in the
// epilogue (BENCHMARKS.md, twenty-fourth round). A decode pass (up to 128 rows) is one panel.
//
// A block of 32 rows x 32 columns ends with its four accumulator tiles stored to a buffer; its
// rows are rounded to bfloat16 (with the bias, or the SiLU) and written out while the tile unit
// computes the next block, a share of the rows after each slice of K (the last block of a
// thread's items at the end). Rounding them before the next block's products had the tile unit
// wait: at K = 576 the epilogue took ~20% of the GEMM, and the MLP of a 2,048-row pass went
// 6.8 -> 5.6 ms (BENCHMARKS.md, thirty-seventh round). The same bits either way.
//
// silu: the weight's pairs are [16 gate columns | their 16 up columns] (a [gate; up] layer
// packed with its rows interleaved by 16), and the output is [M, n / 2]: silu(gate) * up,
// each of gate and up first rounded to bfloat16 (with the bias) as the GEMM's output would
// be, then as silu_and_mul computes it (keel::silu16, rounded, times up, rounded).
//
// pair_weight(j, s0, ns) gives the bfloat16 tiles of slices [s0, s0 + ns) of pair j
// ([ns][2][16][32]), called on the thread that computes them, `chunk` slices at a time: a
// chunk's tiles serve every 32 rows of x before the next chunk's are asked for, and the
// accumulators of each 32 rows wait in memory (L1) in between. A widened copy is asked for a
// few slices at a time so that they stay in L1 for all of x's rows (K = 576 at 64 rows: the
// whole pair's 36 KB beside x's 73 KB had the tile loads waiting on L2).
constexpr int64_t kPanelRows = 128, kPanelRowsL1 = 512;

// Greedy sampling in the epilogue (amx_gemm_argmax): argmax_lanes.h.
using keel::ArgmaxLanes;
using keel::ArgmaxSink;
using keel::thread_argmax_lanes;

constexpr int64_t kL1Slices = 20;  // a pair of 20 slices is 40 KB of tiles (L1 holds 48)


template <int Terms = 1, typename TOut = c10::BFloat16, bool Argmax = false, typename PairWeight>
void amx_gemm_tiles(const c10::BFloat16* xp, const c10::BFloat16* tail, int64_t M, int64_t K,
                    int64_t n, const float* bf, const c10::BFloat16* bh, TOut* op,
                    bool stream_ahead, bool silu, int64_t chunk, const PairWeight& pair_weight,
                    int64_t term_stride = 0, ArgmaxSink* argmax = nullptr) {
  static_assert(!Argmax || (Terms == 1 && std::is_same_v<TOut, c10::BFloat16>),
                "the argmax epilogue is amx_gemm's (bfloat16 output)");
  constexpr bool f32_out = std::is_same_v<TOut, float>;
  const int64_t M16 = (M + 15) / 16 * 16, full = M / 16 * 16;
  const int64_t pairs = (n + 31) / 32, slices = K / 32;
  const int64_t blocks32 = (M16 + 31) / 32;
  if (blocks32 == 1) chunk = slices;  // one block of rows: nothing to keep between chunks
  // A pair's tiles that fit in L1 beside the tile loads of x (K <= kL1Slices * 32) stay there
  // while a prompt chunk's rows stream past them: x's tiles are loaded with the hint not to
  // keep them in L1 (they serve one block), and a panel is kPanelRowsL1 rows (590 KB of x at
  // K = 576, in L2), so that each pair is read from L3 once per 512 rows instead of 128.
  const bool pair_in_l1 = chunk == slices && K <= kL1Slices * 32 && M16 > kPanelRows;
  // x in three parts (amx_gemm_f32) keeps panels of kPanelRows: three parts of 512 rows are
  // 1.7 MB at K = 576, and 2 layers' GEMMs at 2,048 rows took 46.5-50.6 ms that way against
  // 43.7-46.5 in panels of 128 (BENCHMARKS.md, thirty-eighth round).
  const int64_t panel = chunk != slices           ? (M16 + 31) / 32 * 32
                        : pair_in_l1 && Terms == 1 ? kPanelRowsL1
                                                   : kPanelRows;
  const int64_t items = (M16 + panel - 1) / panel * pairs;  // (panel, pair), panel-major
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  // Row r's first element at slice s0 (r a multiple of 16: a tile's rows lie on one side).
  auto rows_at = [&](int64_t r, int64_t s0) {
    return (r < full ? xp + r * K : tail + (r - full) * K) + s0 * 32;
  };
  keel::Claims claims(items, threads, 0);
  keel::on_threads(threads, [&] {
    // Tiles 0-1: A (16 rows of x, 32 k each); 2-3: B (the pair's two tiles for a slice of
    // K); 4-7: the accumulators [rows 0-15 | 16-31] x [columns of tile 0 | tile 1].
    keel::configure_tiles();
    // The last block's sums: its rows are rounded and written (finish) while the tile unit
    // works on the next block's products, and are all written before that block's are stored.
    alignas(64) float acc[32 * 32];
    // amx_gemm_argmax: this thread's lanes (a buffer it keeps; 64 rows: 8 KB). A separate
    // instantiation: amx_gemm's own loop is compiled as it was without it.
    ArgmaxLanes* lanes = nullptr;
    if constexpr (Argmax) {
      lanes = &thread_argmax_lanes();
      lanes->reset(M);
    }
    struct Pending {
      int64_t r0 = 0, rows = 0, done = 0, c0 = 0, j = 0, cols = 0;
    } pending;
    auto finish = [&](Pending& p, int64_t upto) {
      const int64_t c0 = p.c0;
      if constexpr (f32_out) {  // float32 sums as they are (amx_gemm_f32): no rounding
        for (int64_t r = p.done; r < upto; ++r) {
          __m512 v[2];
          for (int h = 0; h < 2; ++h) {
            v[h] = _mm512_load_ps(acc + r * 32 + h * 16);
            if (bf != nullptr && (silu || h * 16 < p.cols))
              v[h] = _mm512_add_ps(v[h], _mm512_loadu_ps(bf + c0 + h * 16));
          }
          if (silu) {
            _mm512_storeu_ps(op + (p.r0 + r) * (n / 2) + p.j * 16,
                             _mm512_mul_ps(keel::silu16(v[0]), v[1]));
          } else {
            float* dst = op + (p.r0 + r) * n + c0;
            for (int64_t h = 0; h < p.cols; h += 16) _mm512_storeu_ps(dst + h, v[h / 16]);
          }
        }
      } else {
      for (int64_t r = p.done; silu && r < upto; ++r) {
        __m512 gu[2];
        for (int h = 0; h < 2; ++h) {  // gate, then up: as the GEMM's bfloat16 output
          __m512 v = _mm512_load_ps(acc + r * 32 + h * 16);
          if (bf != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bf + c0 + h * 16));
          if (bh != nullptr) v = _mm512_add_ps(v, keel::load_ps16(bh + c0 + h * 16));
          const __m256bh b = _mm512_cvtneps_pbh(v);
          gu[h] = keel::load_ps16(reinterpret_cast<const c10::BFloat16*>(&b));
        }
        const __m256bh sb = _mm512_cvtneps_pbh(keel::silu16(gu[0]));
        const __m512 sr = keel::load_ps16(reinterpret_cast<const c10::BFloat16*>(&sb));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + (p.r0 + r) * (n / 2) + p.j * 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sr, gu[1])));
      }
      for (int64_t r = p.done; !silu && r < upto; ++r) {
        c10::BFloat16* dst = Argmax ? nullptr : op + (p.r0 + r) * n + c0;
        for (int64_t h = 0; h < p.cols; h += 16) {
          __m512 v = _mm512_load_ps(acc + r * 32 + h);
          if (bf != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bf + c0 + h));
          if (bh != nullptr)  // bfloat16 widened exactly: its bits in the high half
            v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(bh + c0 + h))),
                                     16)));
          const __m256bh b = _mm512_cvtneps_pbh(v);
          if constexpr (Argmax)  // the output's value, compared instead of written
            lanes->update(p.r0 + r, c0 + h, _mm512_cvtpbh_ps(b), argmax->n_valid);
          else
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + h), (__m256i)b);
        }
      }
      }
      if (upto > p.done) p.done = upto;
    };
    // Each block of 32 rows' accumulators between chunks (4 tiles of 1 KB).
    static thread_local std::vector<float> held;
    if (chunk < slices) held.resize(blocks32 * 4 * 256 + 16);
    float* hp = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(held.data()) + 63) & ~uintptr_t{63});
    int64_t end = 0;
    for (int64_t item = claims.claim(end); item < items; item = claims.claim(end)) {
      for (; item < end; ++item) {
       const int64_t j = item % pairs, c0 = j * 32, cols = std::min<int64_t>(32, n - c0);
       const int64_t p0 = item / pairs * panel, p1 = std::min(M16, p0 + panel);
       for (int64_t s0 = 0; s0 < slices; s0 += chunk) {
        const int64_t ns = std::min(chunk, slices - s0);
        const bool last = s0 + ns == slices;
        const c10::BFloat16* wj = pair_weight(j, s0, ns);
        // The dense copy (stream_ahead: pair_weight is a lookup): the thread's next item's
        // pair into L2, a few lines per slice over this pair's work, so that its first rows
        // find it there. At 64 rows from memory 1.035x (29 of 40 alternated rounds; in cache
        // 0.98x, which a decode step's weights never are; twenty-fourth round).
        const char* next = nullptr;
        int64_t next_lines = 0, per_slice = 0, line = 0;
        if (stream_ahead && item + 1 < end && (item + 1) % pairs != j) {
          next = reinterpret_cast<const char*>(pair_weight((item + 1) % pairs, 0, slices));
          next_lines = slices * 2048 / 64;
          const int64_t steps = (p1 - p0 + 31) / 32 * ns;
          per_slice = (next_lines + steps - 1) / steps;
        }
        for (int64_t r0 = p0; r0 < p1; r0 += 32) {
          const bool two = r0 + 16 < M16;
          const bool first = r0 == p0 && stream_ahead;
          const c10::BFloat16* x0 = rows_at(r0, s0);
          const c10::BFloat16* x1 = two ? rows_at(r0 + 16, s0) : nullptr;
          float* h = hp + r0 / 32 * 1024;
          if (s0 == 0) {
            _tile_zero(4);
            _tile_zero(5);
            if (two) {
              _tile_zero(6);
              _tile_zero(7);
            }
          } else {
            _tile_loadd(4, h, 64);
            _tile_loadd(5, h + 256, 64);
            if (two) {
              _tile_loadd(6, h + 512, 64);
              _tile_loadd(7, h + 768, 64);
            }
          }
          for (int64_t s = 0; s < ns; ++s) {
            const c10::BFloat16* ws = wj + s * 1024;
            if (first) {  // the weight's stream, two slices ahead (~10% at 64 rows, cold)
              const char* p = reinterpret_cast<const char*>(ws + kAhead * 1024);
              for (int l = 0; l < 2048; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
            }
            for (int64_t l = 0; l < per_slice && line < next_lines; ++l, ++line)
              _mm_prefetch(next + line * 64, _MM_HINT_T1);
            _tile_loadd(2, ws, 64);
            _tile_loadd(3, ws + 512, 64);
            // Terms > 1: x is float32 split into that many bfloat16 parts, term_stride apart,
            // each multiplied by the same weight tiles into the same sums (amx_gemm_f32).
            for (int t = 0; t < Terms; ++t) {
              const c10::BFloat16* xt0 = x0 + t * term_stride + s * 32;
              if (pair_in_l1)
                _tile_stream_loadd(0, xt0, K * 2);
              else
                _tile_loadd(0, xt0, K * 2);
              _tile_dpbf16ps(4, 0, 2);
              _tile_dpbf16ps(5, 0, 3);
              if (two) {
                const c10::BFloat16* xt1 = x1 + t * term_stride + s * 32;
                if (pair_in_l1)
                  _tile_stream_loadd(1, xt1, K * 2);
                else
                  _tile_loadd(1, xt1, K * 2);
                _tile_dpbf16ps(6, 1, 2);
                _tile_dpbf16ps(7, 1, 3);
              }
            }
            // The previous block's rows, a share per slice, beside these products.
            if (pending.done < pending.rows)
              finish(pending, std::min(pending.rows, (s + 1) * ((pending.rows + ns - 1) / ns)));
          }
          finish(pending, pending.rows);
          if (!last) {  // the sums so far, until the next chunk
            _tile_stored(4, h, 64);
            _tile_stored(5, h + 256, 64);
            if (two) {
              _tile_stored(6, h + 512, 64);
              _tile_stored(7, h + 768, 64);
            }
            continue;
          }
          _tile_stored(4, acc, 128);
          _tile_stored(5, acc + 16, 128);
          if (two) {
            _tile_stored(6, acc + 16 * 32, 128);
            _tile_stored(7, acc + 16 * 32 + 16, 128);
          }
          pending = {r0, std::min<int64_t>(two ? 32 : 16, M - r0), 0, c0, j, cols};
        }
       }
      }
    }
    finish(pending, pending.rows);
    _tile_release();
    if constexpr (Argmax) lanes->merge(M, *argmax);
  });
}

}  // namespace
#endif  // KEEL_AMX
