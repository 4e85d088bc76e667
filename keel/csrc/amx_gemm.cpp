// bfloat16 x @ W^T on AMX tiles, for the row counts of decode steps (keel sends it passes of
// up to 64 rows), where oneDNN's brgemm reached ~1.1 TFLOP/s with the weights in cache and ~13 GB/s
// of weights streamed from memory at 64 rows (eighteenth round, BENCHMARKS.md).
//
// The weight [N, K] is packed once (amx_gemm_pack) into the tile unit's B layout, two 16-column
// tiles side by side for each 32-wide slice of K, pairs of tiles one after another:
//   [N / 32 pairs][K / 32 slices][2 tiles][16 k pairs][16 columns][2]
// so that a thread's share of the weight (whole pairs) is one sequential stream. A pass
// computes 32 rows x 32 columns at a time in four accumulator tiles (two A tiles of x, two B
// tiles of W per slice of K); the pair's B tiles stay in cache for the pass's next 32 rows.
// Sums are float32; the output is rounded to bfloat16 once, after the bias (as oneDNN does).
//
// Needs K % 32 == 0 and N % 16 == 0 (N is padded to a whole pair with zero columns), and
// AMX-BF16 at build time with the tile permission (prefill_attention_amx.cpp asks for it).
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "claims.h"

namespace {

#if KEEL_AMX
constexpr int64_t kAhead = 2;  // slices of the weight prefetched ahead of the first rows
#endif

}  // namespace

bool amx_gemm_available() {
#if KEEL_AMX
  return prefill_attention_amx_available();
#else
  return false;
#endif
}

at::Tensor amx_gemm_pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "amx_gemm_pack: a bfloat16 weight [N, K] expected");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0, "amx_gemm_pack: K % 32 == 0 and N % 16 == 0 needed");
  const at::Tensor w = weight.contiguous();
  const int64_t pairs = (N + 31) / 32, slices = K / 32;
  at::Tensor packed = at::zeros({pairs * slices * 1024}, weight.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const int64_t pair = n / 32, t = (n / 16) % 2, col = n % 16;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t sl = k / 32, p = (k % 32) / 2, x = k % 2;
        dst[(((pair * slices + sl) * 2 + t) * 16 + p) * 32 + col * 2 + x] = src[n * K + k];
      }
    }
  });
  return packed;
}

at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, int64_t n, std::optional<at::Tensor> bias) {
  TORCH_CHECK(amx_gemm_available(), "amx_gemm: this build or CPU has no AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
                  packed.scalar_type() == at::kBFloat16,
              "amx_gemm: bfloat16 x [M, K] and packed weight expected");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0 && n % 16 == 0 && n > 0, "amx_gemm: K % 32 == 0 and N % 16 == 0");
  const int64_t pairs = (n + 31) / 32, slices = K / 32;
  TORCH_CHECK(packed.numel() == pairs * slices * 1024, "amx_gemm: packed weight of another shape");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->numel() == n && bias->is_contiguous() &&
                    (bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat),
                "amx_gemm: one bias per output column, contiguous, bfloat16 or float32");
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;
#if KEEL_AMX
  // Rows padded to a whole tile (zeros) where M is not a multiple of 16, in a buffer each
  // calling thread keeps (no allocation per pass once it has grown).
  const int64_t M16 = (M + 15) / 16 * 16;
  const at::Tensor xc = x.contiguous();
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  if (M16 != M) {
    static thread_local std::vector<c10::BFloat16> padded;
    padded.resize(M16 * K);
    std::memcpy(padded.data(), xp, M * K * sizeof(c10::BFloat16));
    std::memset(padded.data() + M * K, 0, (M16 - M) * K * sizeof(c10::BFloat16));
    xp = padded.data();
  }
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const float* bf = has_bias && bias->scalar_type() == at::kFloat ? bias->data_ptr<float>()
                                                                   : nullptr;
  const c10::BFloat16* bh = has_bias && bias->scalar_type() == at::kBFloat16
                                ? bias->data_ptr<c10::BFloat16>()
                                : nullptr;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), pairs);
  keel::Claims claims(pairs, threads, 0);
  keel::on_threads(threads, [&] {
    // Tiles 0-1: A (16 rows of x, 32 k each); 2-3: B (the pair's two tiles for a slice of
    // K); 4-7: the accumulators [rows 0-15 | 16-31] x [columns of tile 0 | tile 1].
    keel::configure_tiles();
    alignas(64) float acc[32 * 32];
    int64_t end = 0;
    for (int64_t j = claims.claim(end); j < pairs; j = claims.claim(end)) {
      for (; j < end; ++j) {
        const c10::BFloat16* wj = wp + j * slices * 1024;
        const int64_t c0 = j * 32, cols = std::min<int64_t>(32, n - c0);
        for (int64_t r0 = 0; r0 < M16; r0 += 32) {
          const bool two = r0 + 16 < M16;
          const bool first = r0 == 0;
          const c10::BFloat16* x0 = xp + r0 * K;
          _tile_zero(4);
          _tile_zero(5);
          if (two) {
            _tile_zero(6);
            _tile_zero(7);
          }
          for (int64_t s = 0; s < slices; ++s) {
            const c10::BFloat16* ws = wj + s * 1024;
            if (first) {  // the weight's stream, two slices ahead (~10% at 64 rows, cold)
              const char* p = reinterpret_cast<const char*>(ws + kAhead * 1024);
              for (int l = 0; l < 2048; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
            }
            _tile_loadd(2, ws, 64);
            _tile_loadd(3, ws + 512, 64);
            _tile_loadd(0, x0 + s * 32, K * 2);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            if (two) {
              _tile_loadd(1, x0 + 16 * K + s * 32, K * 2);
              _tile_dpbf16ps(6, 1, 2);
              _tile_dpbf16ps(7, 1, 3);
            }
          }
          _tile_stored(4, acc, 128);
          _tile_stored(5, acc + 16, 128);
          if (two) {
            _tile_stored(6, acc + 16 * 32, 128);
            _tile_stored(7, acc + 16 * 32 + 16, 128);
          }
          const int64_t rows = std::min<int64_t>(two ? 32 : 16, M - r0);
          for (int64_t r = 0; r < rows; ++r) {
            c10::BFloat16* dst = op + (r0 + r) * n + c0;
            for (int64_t h = 0; h < cols; h += 16) {
              __m512 v = _mm512_load_ps(acc + r * 32 + h);
              if (bf != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bf + c0 + h));
              if (bh != nullptr)  // bfloat16 widened exactly: its bits in the high half
                v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                         _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                             reinterpret_cast<const __m256i*>(bh + c0 + h))),
                                         16)));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + h),
                                  (__m256i)_mm512_cvtneps_pbh(v));
            }
          }
        }
      }
    }
    _tile_release();
  });
#endif
  return out;
}
