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
//
// A layer whose weight is also kept as int4 in groups of 32 (W = q d + m, a GGUF file's own
// numbers) can instead give the kernel an int4 copy (amx_gemm_pack_int4), in the same order:
//   [N / 32 pairs][K / 32 slices][2 tiles]{16 k pairs x 16 bytes of nibbles, d[16], m[16]}
// 384 bytes per tile instead of 1,024. Byte b of k pair p holds the bfloat16 tile row's lane b
// in its low nibble and lane 16 + b in its high one (lane 2c + x: column c, k = 2p + x); d and
// m are float32 per column of the tile (one group of 32 is one slice). The kernel widens a
// pair's whole K into the bfloat16 tile layout in a buffer its thread keeps (36-96 KB for
// these models, in L2), then runs the same tile loop over it: the weight stream from memory is
// 2.7x smaller. The packing keeps the copy only where every widened value (q d + m in float32,
// rounded to bfloat16) is bit-identical to amx_gemm_pack of the dense weight, so both copies
// give the same output bits. An int8 copy (amx_gemm_pack_int8: W = q d per group of 32, a
// GGUF Q8_0 tensor's numbers; the default model's LM head) is the same with 512 bytes of q
// per tile (byte 32 p + lane) and d[16]: 576 bytes per tile instead of 1,024.
//
// The tile kernel (amx_gemm_tiles, with its epilogues) is in amx_gemm_tiles.h, part of this
// translation unit; this file has the packing and the entry points.
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

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

bool amx_gemm_available() {
#if KEEL_AMX
  return prefill_attention_amx_available();
#else
  return false;
#endif
}

bool amx_gemm_dense_available() { return amx_gemm_available() || bf16_dot_gemm_available(); }

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

namespace {

#if KEEL_AMX
constexpr int64_t kInt4Tile = 256 + 2 * 16 * 4;  // nibbles, then d[16] and m[16] float32

// One int4 tile (kInt4Tile bytes) -> its bfloat16 tile (16 rows x 32 lanes), q d + m rounded
// once in float32 (the explicit-rounding intrinsics: never contracted into an FMA).
inline void widen_int4_tile(const uint8_t* src, uint16_t* dst) {
  const float* dm = reinterpret_cast<const float*>(src + 256);
  const __m512i lo_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
  const __m512 d = _mm512_loadu_ps(dm), m = _mm512_loadu_ps(dm + 16);
  const __m512 d_lo = _mm512_permutexvar_ps(lo_cols, d), d_hi = _mm512_permutexvar_ps(hi_cols, d);
  const __m512 m_lo = _mm512_permutexvar_ps(lo_cols, m), m_hi = _mm512_permutexvar_ps(hi_cols, m);
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int p = 0; p < 16; ++p) {
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + p * 16)));
    const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low4));
    const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    const __m512 w_lo = _mm512_add_round_ps(_mm512_mul_round_ps(q_lo, d_lo, kRound), m_lo, kRound);
    const __m512 w_hi = _mm512_add_round_ps(_mm512_mul_round_ps(q_hi, d_hi, kRound), m_hi, kRound);
    _mm512_storeu_si512(dst + p * 32, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
  }
}

#endif

}  // namespace

// The tile kernel, amx_gemm_tiles (part of this translation unit).
#include "amx_gemm_tiles.h"

namespace {

#if KEEL_AMX
// Widening (widen_pair below): each tile's bytes are prefetched four tiles ahead (into the
// next pair's, which follows in memory): 64 rows from memory 15.1 -> 13.3 ms for the default
// model's 120 layers, where prefetching a whole pair at once stalled (17% of the GEMM's
// samples on the prefetches).
constexpr int64_t kInt4Ahead = 4;
// Slices of a pair widened at a time (6 KB of tiles, with x's 6 KB per 32 rows: L1): the
// default model's 120 layers at 64 rows, weights in cache 12.1 -> 9.6 ms (2 slices: 10.3-10.4,
// 4: 10.2, 6: 10.1, 9: 11.1; the bfloat16 copy, streamed from memory, gained nothing from it).
constexpr int64_t kWidenChunk = 3;


constexpr int64_t kInt8Tile = 512 + 16 * 4;  // q (byte 32 p + lane), then d[16] float32

// One int8 tile -> its bfloat16 tile, q d rounded once.
inline void widen_int8_tile(const uint8_t* src, uint16_t* dst) {
  const __m512i lo_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
  const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(src + 512));
  const __m512 d_lo = _mm512_permutexvar_ps(lo_cols, d), d_hi = _mm512_permutexvar_ps(hi_cols, d);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int p = 0; p < 16; ++p) {
    const __m128i* row = reinterpret_cast<const __m128i*>(src + p * 32);
    const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row)));
    const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1)));
    _mm512_storeu_si512(dst + p * 32,
                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_round_ps(q_hi, d_hi, kRound),
                                                     _mm512_mul_round_ps(q_lo, d_lo, kRound)));
  }
}

// The two quantized copies: bytes per tile, and the widening of one tile.
struct Int4Copy {
  static constexpr int64_t kTile = kInt4Tile;
  static void widen(const uint8_t* src, uint16_t* dst) { widen_int4_tile(src, dst); }
};
struct Int8Copy {
  static constexpr int64_t kTile = kInt8Tile;
  static void widen(const uint8_t* src, uint16_t* dst) { widen_int8_tile(src, dst); }
};

// `slices` slices of a pair (2 tiles each) widened from its copy into `buf`.
template <typename Copy>
inline void widen_pair(const uint8_t* src, int64_t slices, uint16_t* buf) {
  for (int64_t t = 0; t < slices * 2; ++t) {
    const char* p = reinterpret_cast<const char*>(src + (t + kInt4Ahead) * Copy::kTile);
    for (int l = 0; l < Copy::kTile; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
    Copy::widen(src + t * Copy::kTile, buf + t * 512);
  }
}

// Fills the copy `packed` pair by pair on torch's threads -- fill(n, sl, tile, c): weight row
// n's slice sl of K into `tile`, where it is column c of 16 -- and keeps it only where every
// pair widens to exactly amx_gemm_pack(dense)'s bfloat16 tiles (else an empty tensor).
template <typename Copy, typename Fill>
at::Tensor keep_if_exact(at::Tensor packed, const at::Tensor& dense, int64_t pairs,
                         int64_t slices, const Fill& fill) {
  const int64_t N = dense.size(0);
  const at::Tensor ref = amx_gemm_pack(dense);
  const auto* rp = reinterpret_cast<const uint16_t*>(ref.data_ptr<c10::BFloat16>());
  auto* dst = static_cast<uint8_t*>(packed.data_ptr());
  std::atomic<bool> exact{true};
  at::parallel_for(0, pairs, 1, [&](int64_t b, int64_t e) {
    std::vector<uint16_t> buf(slices * 1024);
    for (int64_t pair = b; pair < e; ++pair) {
      uint8_t* bytes = dst + pair * slices * 2 * Copy::kTile;
      for (int64_t n = pair * 32; n < std::min(N, pair * 32 + 32); ++n)
        for (int64_t sl = 0; sl < slices; ++sl)
          fill(n, sl, bytes + (sl * 2 + (n / 16) % 2) * Copy::kTile, n % 16);
      widen_pair<Copy>(bytes, slices, buf.data());
      if (std::memcmp(buf.data(), rp + pair * slices * 1024, buf.size() * 2) != 0)
        exact = false;
    }
  });
  return exact ? packed : at::empty({0}, packed.options());
}
#endif

}  // namespace

at::Tensor amx_gemm_pack_int4(at::Tensor q, at::Tensor d, at::Tensor m, at::Tensor dense) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && d.dim() == 2 &&
                  m.sizes() == d.sizes() && dense.dim() == 2 &&
                  dense.scalar_type() == at::kBFloat16,
              "amx_gemm_pack_int4: q uint8 [N, K / 2], d and m [N, K / 32], dense bfloat16 "
              "[N, K] expected");
  const int64_t N = dense.size(0), K = dense.size(1);
  TORCH_CHECK(q.size(0) == N && q.size(1) * 2 == K && d.size(0) == N && d.size(1) * 32 == K,
              "amx_gemm_pack_int4: q, d, m and the dense weight disagree on [N, K]");
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0, "amx_gemm_pack_int4: K % 32 == 0 and N % 16 == 0");
  const int64_t pairs = (N + 31) / 32, slices = K / 32;
  at::Tensor packed = at::zeros({pairs * slices * 2 * 384}, q.options());
#if KEEL_AMX
  static_assert(kInt4Tile == 384);
  const at::Tensor qc = q.contiguous(), df = d.to(at::kFloat).contiguous(),
                   mf = m.to(at::kFloat).contiguous();
  const uint8_t* qp = qc.data_ptr<uint8_t>();
  const float* dp = df.data_ptr<float>();
  const float* mp = mf.data_ptr<float>();
  return keep_if_exact<Int4Copy>(
      packed, dense, pairs, slices, [&](int64_t n, int64_t sl, uint8_t* tile, int64_t c) {
        float* tdm = reinterpret_cast<float*>(tile + 256);
        tdm[c] = dp[n * slices + sl];
        tdm[16 + c] = mp[n * slices + sl];
        for (int64_t kk = 0; kk < 32; ++kk) {
          const int64_t k = sl * 32 + kk, byte = qp[n * (K / 2) + k / 2];
          const uint8_t v = k % 2 ? byte >> 4 : byte & 0x0F;
          const int64_t lane = c * 2 + kk % 2, p = kk / 2;
          tile[p * 16 + lane % 16] |= lane < 16 ? v : static_cast<uint8_t>(v << 4);
        }
      });
#else
  TORCH_CHECK(false, "amx_gemm_pack_int4: this build has no AMX-BF16 tiles");
  return packed;
#endif
}

at::Tensor amx_gemm_pack_int8(at::Tensor q, at::Tensor d, at::Tensor dense) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && d.dim() == 2 &&
                  dense.dim() == 2 && dense.scalar_type() == at::kBFloat16,
              "amx_gemm_pack_int8: q int8 [N, K], d [N, K / 32], dense bfloat16 [N, K] "
              "expected");
  const int64_t N = dense.size(0), K = dense.size(1);
  TORCH_CHECK(q.sizes() == dense.sizes() && d.size(0) == N && d.size(1) * 32 == K,
              "amx_gemm_pack_int8: q, d and the dense weight disagree on [N, K]");
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0, "amx_gemm_pack_int8: K % 32 == 0 and N % 16 == 0");
  const int64_t pairs = (N + 31) / 32, slices = K / 32;
  at::Tensor packed = at::zeros({pairs * slices * 2 * 576}, q.options());
#if KEEL_AMX
  static_assert(kInt8Tile == 576);
  const at::Tensor qc = q.contiguous(), df = d.to(at::kFloat).contiguous();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* dp = df.data_ptr<float>();
  return keep_if_exact<Int8Copy>(
      packed, dense, pairs, slices, [&](int64_t n, int64_t sl, uint8_t* tile, int64_t c) {
        reinterpret_cast<float*>(tile + 512)[c] = dp[n * slices + sl];
        for (int64_t kk = 0; kk < 32; ++kk)  // row kk / 2, lane 2 c + kk % 2
          tile[kk / 2 * 32 + c * 2 + kk % 2] = static_cast<uint8_t>(qp[n * K + sl * 32 + kk]);
      });
#else
  TORCH_CHECK(false, "amx_gemm_pack_int8: this build has no AMX-BF16 tiles");
  return packed;
#endif
}

namespace {

// amx_gemm's checks; whether `bias` is given.
bool check_amx_gemm(const char* name, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                    const std::optional<at::Tensor>& bias, bool silu_mul) {
  const bool int4 = packed.scalar_type() == at::kByte, int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(amx_gemm_available() || (!int4 && !int8 && bf16_dot_gemm_available()), name,
              ": this build or CPU has no AMX-BF16 tiles",
              int4 || int8 ? " (an int4 or int8 copy needs them)" : " nor AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
                  (packed.scalar_type() == at::kBFloat16 || int4 || int8),
              name, ": bfloat16 x [M, K] and a packed weight (amx_gemm_pack, "
              "amx_gemm_pack_int4 or amx_gemm_pack_int8) expected");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 32 == 0 && n % 16 == 0 && n > 0, name, ": K % 32 == 0 and N % 16 == 0");
  const int64_t pairs = (n + 31) / 32, slices = K / 32;
  TORCH_CHECK(packed.numel() == pairs * slices * (int4 ? 768 : int8 ? 1152 : 1024),
              name, ": packed weight of another shape");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->numel() == n && bias->is_contiguous() &&
                    (bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat),
                name, ": one bias per output column, contiguous, bfloat16 or float32");
  TORCH_CHECK(!silu_mul || n % 32 == 0,
              name, ": silu_mul needs whole pairs of [16 gate | 16 up] columns");
  return has_bias;
}

#if KEEL_AMX
// x @ W^T over any of the three copies into op [M, n] (or [M, n / 2] with silu_mul), or, with
// `argmax` (Argmax), each row's argmax into it instead. M > 0.
template <bool Argmax>
void run_amx_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const std::optional<at::Tensor>& bias, bool has_bias, bool silu_mul,
                  c10::BFloat16* op, ArgmaxSink* argmax) {
  const bool int4 = packed.scalar_type() == at::kByte, int8 = packed.scalar_type() == at::kChar;
  const int64_t M = x.size(0), K = x.size(1), slices = K / 32;
  // The last rows padded to a whole tile (zeros) where M is not a multiple of 16, in a buffer
  // each calling thread keeps (no allocation per pass once it has grown).
  const int64_t full = M / 16 * 16;
  const at::Tensor xc = x.contiguous();
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  static thread_local std::vector<c10::BFloat16> padded;
  if (full != M) {
    padded.resize(16 * K);
    std::memcpy(padded.data(), xp + full * K, (M - full) * K * sizeof(c10::BFloat16));
    std::memset(padded.data() + (M - full) * K, 0, (16 - (M - full)) * K * sizeof(c10::BFloat16));
  }
  const c10::BFloat16* tail = padded.data();
  const float* bf = has_bias && bias->scalar_type() == at::kFloat ? bias->data_ptr<float>()
                                                                   : nullptr;
  const c10::BFloat16* bh = has_bias && bias->scalar_type() == at::kBFloat16
                                ? bias->data_ptr<c10::BFloat16>()
                                : nullptr;
  if (int4 || int8) {
    const auto* wq = static_cast<const uint8_t*>(packed.data_ptr());
    const int64_t tile_bytes = int4 ? kInt4Tile : kInt8Tile;
    amx_gemm_tiles<1, c10::BFloat16, Argmax>(xp, tail, M, K, n, bf, bh, op, false, silu_mul,
                                             kWidenChunk,
                   [&](int64_t j, int64_t s0, int64_t ns) {
      // Each worker thread's widened slices (the pool's threads live as long as the
      // process). Over-allocated by 64 bytes: the tiles start on a cache line.
      static thread_local std::vector<uint16_t> buf;
      buf.resize(slices * 1024 + 32);
      const auto at = reinterpret_cast<uintptr_t>(buf.data());
      auto* tiles = reinterpret_cast<uint16_t*>((at + 63) & ~uintptr_t{63});
      if (int4)
        widen_pair<Int4Copy>(wq + (j * slices + s0) * 2 * tile_bytes, ns, tiles);
      else
        widen_pair<Int8Copy>(wq + (j * slices + s0) * 2 * tile_bytes, ns, tiles);
      return reinterpret_cast<const c10::BFloat16*>(tiles);
    }, 0, argmax);
  } else {
    const auto* wp = packed.data_ptr<c10::BFloat16>();
    amx_gemm_tiles<1, c10::BFloat16, Argmax>(xp, tail, M, K, n, bf, bh, op, true, silu_mul,
                                             slices,
                   [&](int64_t j, int64_t s0, int64_t) { return wp + (j * slices + s0) * 1024; },
                   0, argmax);
  }
}
#endif

}  // namespace

at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, int64_t n, std::optional<at::Tensor> bias,
                    bool silu_mul) {
  const bool has_bias = check_amx_gemm("amx_gemm", x, packed, n, bias, silu_mul);
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, silu_mul ? n / 2 : n}, x.options());
  if (M == 0) return out;
  if (!amx_gemm_available()) {  // the dense copy on AVX512-BF16's dot products
    bf16_dot_gemm(x, packed, n, bias, silu_mul, out.data_ptr<c10::BFloat16>(), nullptr);
    return out;
  }
#if KEEL_AMX
  run_amx_gemm<false>(x, packed, n, bias, has_bias, silu_mul, out.data_ptr<c10::BFloat16>(),
                      nullptr);
#endif
  return out;
}

// Greedy sampling fused into the LM head: for each row of x @ W^T (+ bias), the index of its
// largest value among columns [0, n_valid), as torch's argmax of amx_gemm's bfloat16 output
// would give it (see ArgmaxSink), without writing the [M, n] output.
at::Tensor amx_gemm_argmax(at::Tensor x, at::Tensor packed, int64_t n, int64_t n_valid,
                           std::optional<at::Tensor> bias) {
  const bool has_bias = check_amx_gemm("amx_gemm_argmax", x, packed, n, bias, false);
  TORCH_CHECK(n_valid > 0 && n_valid <= n, "amx_gemm_argmax: 0 < n_valid <= N needed");
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return out;
#ifdef __AVX512F__  // (check_amx_gemm has refused a build without it: no tiles, no BF16)
  keel::ArgmaxSink sink;
  sink.n_valid = n_valid;
  sink.value.assign(M, 0.f);
  sink.index.assign(M, -1);
  if (!amx_gemm_available()) {  // the dense copy on AVX512-BF16's dot products
    bf16_dot_gemm(x, packed, n, bias, false, nullptr, &sink);
  } else {
#if KEEL_AMX
    run_amx_gemm<true>(x, packed, n, bias, has_bias, false, nullptr, &sink);
#endif
  }
  std::memcpy(out.data_ptr<int64_t>(), sink.index.data(), M * sizeof(int64_t));
#endif
  return out;
}

// float32 x @ W^T on the tile unit, for a weight whose values are all bfloat16 (a bfloat16
// checkpoint run in float32): x is split into three bfloat16 parts, x = x1 + x2 + x3 with
// x1 = bf16(x), x2 = bf16(x - x1), x3 = bf16(x - x1 - x2) (each difference exact in float32),
// which carry x's 24 significant bits; every product of a part and a weight is exact in
// float32, and the tile unit sums them in float32. The result is a float32 GEMM's to float32
// rounding, in another order of summation (the three parts of each k together), as keel's
// and oneDNN's float32 GEMMs differ from each other. Three tile products per weight tile, but
// the tile unit's products run ~10x float32 FMAs'.
at::Tensor amx_gemm_f32(at::Tensor x, at::Tensor packed, int64_t n, std::optional<at::Tensor> bias,
                        bool silu_mul) {
  TORCH_CHECK(amx_gemm_available(), "amx_gemm_f32: this build or CPU has no AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat &&
                  packed.scalar_type() == at::kBFloat16,
              "amx_gemm_f32: float32 x [M, K] and amx_gemm_pack's bfloat16 weight expected");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0 && n % 16 == 0 && n > 0, "amx_gemm_f32: K % 32 == 0 and N % 16 == 0");
  const int64_t pairs = (n + 31) / 32, slices = K / 32;
  TORCH_CHECK(packed.numel() == pairs * slices * 1024, "amx_gemm_f32: packed weight of another shape");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->numel() == n && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "amx_gemm_f32: one float32 bias per output column, contiguous");
  TORCH_CHECK(!silu_mul || n % 32 == 0,
              "amx_gemm_f32: silu_mul needs whole pairs of [16 gate | 16 up] columns");
  at::Tensor out = at::empty({M, silu_mul ? n / 2 : n}, x.options());
  if (M == 0) return out;
#if KEEL_AMX
  const int64_t M16 = (M + 15) / 16 * 16;
  const at::Tensor xc = x.contiguous();
  const float* xf = xc.data_ptr<float>();
  // The three parts, [3][M16][K], rows past M zero, in a buffer the calling thread keeps.
  static thread_local std::vector<c10::BFloat16> parts;
  parts.resize(3 * M16 * K + 32);
  auto* base = reinterpret_cast<c10::BFloat16*>(
      (reinterpret_cast<uintptr_t>(parts.data()) + 63) & ~uintptr_t{63});
  const int64_t stride = M16 * K;
  at::parallel_for(0, M16, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      auto* p0 = reinterpret_cast<__m256i*>(base + r * K);
      auto* p1 = reinterpret_cast<__m256i*>(base + stride + r * K);
      auto* p2 = reinterpret_cast<__m256i*>(base + 2 * stride + r * K);
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = r < M ? _mm512_loadu_ps(xf + r * K + k) : _mm512_setzero_ps();
        const __m256bh a = _mm512_cvtneps_pbh(v);
        const __m512 r1 = _mm512_sub_ps(v, _mm512_cvtpbh_ps(a));
        const __m256bh c = _mm512_cvtneps_pbh(r1);
        const __m256bh d = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, _mm512_cvtpbh_ps(c)));
        _mm256_storeu_si256(p0 + k / 16, (__m256i)a);
        _mm256_storeu_si256(p1 + k / 16, (__m256i)c);
        _mm256_storeu_si256(p2 + k / 16, (__m256i)d);
      }
    }
  });
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  amx_gemm_tiles<3, float>(base, base + M / 16 * 16 * K, M, K, n,
                           has_bias ? bias->data_ptr<float>() : nullptr, nullptr,
                           out.data_ptr<float>(), true, silu_mul, slices,
                           [&](int64_t j, int64_t s0, int64_t) { return wp + (j * slices + s0) * 1024; },
                           stride);
#endif
  return out;
}
