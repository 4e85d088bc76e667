// Causal attention of one long bfloat16 prompt chunk on AMX tiles: the arguments and the
// masking of prefill_attention (prefill_attention.cpp), with both products on the tile unit.
//
//   query   [L, H, D]     this chunk's query rows (rows may be strided)
//   key     [S, Hkv, D]   every key the chunk sees (rows may be strided), S >= L
//   value   [S, Hkv, D]
//   out     [L, H * D]    written in place (rows may be strided)
// Query row i sits at position S - L + i and sees keys j <= S - L + i (and, with a sliding
// window w > 0, j > S - L + i - w).
//
// A work item is one query head and 16 query rows (the rows of an A tile). It walks the keys
// in blocks of 32 with an online softmax:
//   S [16 x 32] = Q K^T          two C tiles, D / 32 steps (K^T in the tile unit's pair layout)
//   P = exp(S * scale - m)       AVX-512, rounded to bfloat16: one A tile [16 x 32 keys]
//   O [16 x D] += P V            D / 16 C tiles (V in the pair layout)
// K and V are put in the pair layout once per call and KV head, for every item of the head.
// With D <= 64 the output stays in tiles (4 of the 8) for the whole walk. A row's maximum is
// raised only when a block's exceeds it by more than kLazy (then O and the sum are scaled
// down): exp(S - m) <= e^kLazy stays far inside float32 and bfloat16, and the result is the
// same softmax. P in bfloat16 is how torch's flash attention computes in bfloat16 too; the
// sums of P are kept in float32.
//
// Needs AMX-BF16 and AVX512-BF16 at build time (-march=native on such a CPU) and the kernel's
// permission to use the tile registers (arch_prctl), checked once; else
// prefill_attention_amx_available() is false and the call raises.
#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <vector>

#include "amx.h"

#if KEEL_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if KEEL_AMX
constexpr int64_t kRows = 16;   // query rows per item: the rows of an A tile
constexpr int64_t kBlock = 32;  // keys per block: the K dimension of the P V product
constexpr float kLazy = 8.0f;   // a row's maximum is raised past this margin only

// KEEL_AMX=0 leaves the tiles alone (keel then runs as on an AVX-512 CPU without them; see
// keel/dtypes.py cpu_has_amx_bfloat16).
bool tiles_permitted() {
  static const bool ok = [] {
    const char* env = std::getenv("KEEL_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // arch/x86/include/uapi/asm/prctl.h
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// K^T of one KV head in the B layout of Q K^T: for each 32-dim chunk c and 16-key tile t, a
// [16 dim pairs][16 keys][2] tile (a row: one dim pair of 16 keys, gathered). Keys past S are
// zero (masked, never weighted).
void pack_keys(const c10::BFloat16* k, int64_t k_stride, int64_t S, int64_t S32, int64_t D,
               uint32_t* dst) {
  const int64_t tiles = S32 / 16;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i rows = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(k_stride / 2)));
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n = std::min<int64_t>(16, S - t * 16);
    const __mmask16 valid = n >= 16 ? 0xffff : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
    const auto* base = reinterpret_cast<const int*>(k + t * 16 * k_stride);
    for (int64_t c = 0; c < D / 32; ++c) {
      uint32_t* tile = dst + (c * tiles + t) * 256;
      for (int64_t p = 0; p < 16; ++p)
        _mm512_storeu_si512(reinterpret_cast<__m512i*>(tile + p * 16),
                           _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, rows,
                                                       base + c * 16 + p, 4));
    }
  }
}

// V of one KV head in the B layout of P V: for each 32-key block b and 16-dim chunk c, a
// [16 key pairs][16 dims][2] tile (a row: two keys' 16 dims, interleaved). Keys past S are
// zero.
void pack_values(const c10::BFloat16* v, int64_t v_stride, int64_t S, int64_t S32, int64_t D,
                 uint16_t* dst) {
  const int64_t chunks = D / 16;
  alignas(64) int16_t order[32];
  for (int i = 0; i < 32; ++i) order[i] = static_cast<int16_t>((i % 2) * 32 + i / 2);
  const __m512i idx = _mm512_load_si512(order);
  for (int64_t b = 0; b < S32 / kBlock; ++b)
    for (int64_t p = 0; p < 16; ++p) {
      const int64_t j = b * kBlock + 2 * p;
      for (int64_t c = 0; c < chunks; ++c) {
        const __m256i zero = _mm256_setzero_si256();
        const __m256i a = j < S ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                      v + j * v_stride + c * 16))
                                : zero;
        const __m256i e = j + 1 < S ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                          v + (j + 1) * v_stride + c * 16))
                                    : zero;
        _mm512_storeu_si512(reinterpret_cast<__m512i*>(dst + ((b * chunks + c) * 16 + p) * 32),
                           _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), idx,
                                                     _mm512_castsi256_si512(e)));
      }
    }
}

struct Scratch {
  alignas(64) c10::BFloat16 q[kRows * 256];  // D <= 256
  alignas(64) float s[kRows * kBlock];
  alignas(64) c10::BFloat16 p[kRows * kBlock];
  alignas(64) float o[kRows * 256];
  alignas(64) float l[kRows * 16];  // each row's sum of P, 16 lanes
  float m[kRows];
};

// 2^t for t <= 0 (-inf gives 0 or NaN: callers mask those lanes): 2^floor(t) * 2^f with
// f = t - floor(t) in [0, 1) (vreduceps, one instruction), 2^f by a degree-4 polynomial fitted
// for relative error (< 3e-6, as the degree-5 Taylor polynomial around the nearest integer
// that it replaced; P is rounded to bfloat16's 2^-9 after it), 2^floor(t) by vscalefps, which
// floors its exponent operand itself: 6 instructions where that took 9.
inline __m512 exp2_16(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(0.013534165918827057f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05201146751642227f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2414427548646927f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6930038332939148f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026226043701f));
  return _mm512_scalef_ps(p, t);
}

// The output's resident tiles (4-7: 16 dims each, D <= 64) to and from o [16][D].
inline void store_output_tiles(float* o, int64_t D) {
  const int64_t stride = D * 4;
  _tile_stored(4, o, stride);
  if (D > 16) _tile_stored(5, o + 16, stride);
  if (D > 32) _tile_stored(6, o + 32, stride);
  if (D > 48) _tile_stored(7, o + 48, stride);
}
inline void load_output_tiles(const float* o, int64_t D) {
  const int64_t stride = D * 4;
  _tile_loadd(4, o, stride);
  if (D > 16) _tile_loadd(5, o + 16, stride);
  if (D > 32) _tile_loadd(6, o + 32, stride);
  if (D > 48) _tile_loadd(7, o + 48, stride);
}

// O's rows scaled by alpha (rows whose maximum was raised); resident tiles are stored, scaled
// and loaded again.
inline void rescale(Scratch& w, const float* alpha, int64_t D, bool resident) {
  if (resident) store_output_tiles(w.o, D);
  for (int64_t r = 0; r < kRows; ++r) {
    if (alpha[r] == 1.f) continue;
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int64_t d = 0; d < D; d += 16)
      _mm512_store_ps(w.o + r * D + d, _mm512_mul_ps(a, _mm512_load_ps(w.o + r * D + d)));
  }
  if (resident) load_output_tiles(w.o, D);
}

void attend_item(const c10::BFloat16* q_ptr, int64_t q_stride, const uint32_t* kt,
                 const uint16_t* vv, c10::BFloat16* o_ptr, int64_t o_stride, int64_t h,
                 int64_t D, int64_t S32, int64_t r0, int64_t nr, int64_t offset, int64_t window,
                 float scale, Scratch& w) {
  const bool resident = D <= 64;
  const int64_t key_tiles = S32 / 16, chunks = D / 16;
  for (int64_t r = 0; r < kRows; ++r) {
    if (r < nr)
      std::memcpy(w.q + r * D, q_ptr + (r0 + r) * q_stride + h * D, D * 2);
    else
      std::memset(w.q + r * D, 0, D * 2);
  }
  const float ninf = -std::numeric_limits<float>::infinity();
  std::fill(w.m, w.m + kRows, ninf);
  std::fill(w.l, w.l + kRows * 16, 0.f);
  std::fill(w.o, w.o + kRows * D, 0.f);
  if (resident)
    for (int t = 0; t < chunks; ++t) switch (t) {
        case 0: _tile_zero(4); break;
        case 1: _tile_zero(5); break;
        case 2: _tile_zero(6); break;
        default: _tile_zero(7);
      }
  // Row r (padded rows repeat the last real row's position).
  const int64_t first_pos = offset + r0, last_pos = offset + r0 + nr - 1;
  const int64_t k_begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  float alpha[kRows];
  const float lazy = kLazy / scale;  // scores stay unscaled: kLazy in their units
  // S = Q K^T for keys kb .. kb + 31, into tiles 0 and 1.
  auto scores = [&](int64_t kb) {
    _tile_zero(0);
    _tile_zero(1);
    const int64_t t0 = kb / 16;
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(2, w.q + c * 32, D * 2);
      _tile_loadd(3, kt + (c * key_tiles + t0) * 256, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_loadd(3, kt + (c * key_tiles + t0 + 1) * 256, 64);
      _tile_dpbf16ps(1, 2, 3);
    }
  };
  // Software-pipelined: the next block's scores are computed between this block's softmax
  // and its P V, so that P's stores have reached the cache when its tile is loaded.
  const int64_t kb_first = k_begin / kBlock * kBlock;
  scores(kb_first);
  for (int64_t kb = kb_first; kb <= last_pos; kb += kBlock) {
    _tile_stored(0, w.s, kBlock * 4);
    _tile_stored(1, w.s + 16, kBlock * 4);
    // Every row sees the whole block: no key past the first row's position, none before the
    // last row's window.
    const bool whole = kb + kBlock - 1 <= first_pos && (window <= 0 || kb > last_pos - window);
    bool any_rescale = false;
    // Scores stay unscaled here (w.m too): P = 2^(s c - m c) with c = scale * log2(e).
    const float c = scale * 1.4426950408889634f;
    const __m512 cv = _mm512_set1_ps(c);
    for (int64_t r = 0; r < kRows; ++r) {
      alpha[r] = 1.f;
      __m512 s0 = _mm512_load_ps(w.s + r * kBlock);
      __m512 s1 = _mm512_load_ps(w.s + r * kBlock + 16);
      __mmask16 v0 = 0xffff, v1 = 0xffff;
      if (!whole) {
        const int64_t pos = offset + r0 + std::min(r, nr - 1);
        const int64_t lo = window > 0 ? pos - window + 1 : 0;
        const __m512i j0 = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(kb)));
        const __m512i j1 = _mm512_add_epi32(j0, _mm512_set1_epi32(16));
        const __m512i hi = _mm512_set1_epi32(static_cast<int>(pos));
        const __m512i lov = _mm512_set1_epi32(static_cast<int>(std::max<int64_t>(lo, 0)));
        v0 = _mm512_cmple_epi32_mask(j0, hi) & _mm512_cmpge_epi32_mask(j0, lov);
        v1 = _mm512_cmple_epi32_mask(j1, hi) & _mm512_cmpge_epi32_mask(j1, lov);
        s0 = _mm512_mask_mov_ps(_mm512_set1_ps(ninf), v0, s0);
        s1 = _mm512_mask_mov_ps(_mm512_set1_ps(ninf), v1, s1);
      }
      c10::BFloat16* pr = w.p + r * kBlock;
      if ((v0 | v1) == 0) {
        std::memset(pr, 0, kBlock * 2);
        continue;
      }
      const __m512 smax = _mm512_max_ps(s0, s1);
      if (w.m[r] == ninf) {
        w.m[r] = _mm512_reduce_max_ps(smax);
      } else if (_mm512_cmp_ps_mask(smax, _mm512_set1_ps(w.m[r] + lazy), _CMP_GT_OQ) != 0) {
        // One compare against the row's threshold m + kLazy / scale, not a horizontal
        // maximum, for every row and block; the maximum only when it is raised.
        const float mb = _mm512_reduce_max_ps(smax);
        alpha[r] = std::exp((w.m[r] - mb) * scale);
        w.m[r] = mb;
        any_rescale = true;
        _mm512_store_ps(w.l + r * 16,
                        _mm512_mul_ps(_mm512_set1_ps(alpha[r]), _mm512_load_ps(w.l + r * 16)));
      }
      const __m512 mc = _mm512_set1_ps(-w.m[r] * c);
      __m512 p0 = exp2_16(_mm512_fmadd_ps(s0, cv, mc));
      __m512 p1 = exp2_16(_mm512_fmadd_ps(s1, cv, mc));
      if (!whole) {
        p0 = _mm512_maskz_mov_ps(v0, p0);
        p1 = _mm512_maskz_mov_ps(v1, p1);
      }
      _mm512_store_ps(w.l + r * 16,
                      _mm512_add_ps(_mm512_load_ps(w.l + r * 16), _mm512_add_ps(p0, p1)));
      _mm512_store_si512(reinterpret_cast<__m512i*>(pr), (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    if (any_rescale) rescale(w, alpha, D, resident);  // before this block's P V is added
    if (kb + kBlock <= last_pos) scores(kb + kBlock);
    // O += P V.
    _tile_loadd(2, w.p, kBlock * 2);
    const uint16_t* vb = vv + (kb / kBlock) * chunks * 512;
    if (resident) {
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(3, vb + c * 512, 64);
        switch (c) {
          case 0: _tile_dpbf16ps(4, 2, 3); break;
          case 1: _tile_dpbf16ps(5, 2, 3); break;
          case 2: _tile_dpbf16ps(6, 2, 3); break;
          default: _tile_dpbf16ps(7, 2, 3);
        }
      }
    } else {
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_zero(4);
        _tile_loadd(3, vb + c * 512, 64);
        _tile_dpbf16ps(4, 2, 3);
        alignas(64) float part[kRows * 16];
        _tile_stored(4, part, 64);
        for (int64_t r = 0; r < kRows; ++r)
          _mm512_store_ps(w.o + r * D + c * 16,
                          _mm512_add_ps(_mm512_load_ps(w.o + r * D + c * 16),
                                        _mm512_load_ps(part + r * 16)));
      }
    }
  }
  if (resident) store_output_tiles(w.o, D);
  for (int64_t r = 0; r < nr; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(w.l + r * 16)));
    c10::BFloat16* dst = o_ptr + (r0 + r) * o_stride + h * D;
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          (__m256i)_mm512_cvtneps_pbh(
                              _mm512_mul_ps(_mm512_load_ps(w.o + r * D + d), inv)));
  }
}
#endif

}  // namespace

bool prefill_attention_amx_available() {
#if KEEL_AMX
  return tiles_permitted();
#else
  return false;
#endif
}

void prefill_attention_amx(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor out,
                           double scale, int64_t sliding_window) {
  TORCH_CHECK(prefill_attention_amx_available(),
              "prefill_attention_amx: this build or CPU has no AMX-BF16 tiles");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && out.dim() == 2,
              "prefill_attention_amx: query/key/value [rows, heads, D], out [rows, heads * D]");
  const int64_t L = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t S = key.size(0), Hkv = key.size(1);
  TORCH_CHECK(value.sizes() == key.sizes() && key.size(2) == D,
              "prefill_attention_amx: shapes");
  TORCH_CHECK(H % Hkv == 0, "prefill_attention_amx: heads per KV head");
  TORCH_CHECK(S >= L && L > 0, "prefill_attention_amx: the chunk sees at least its own keys");
  TORCH_CHECK(out.size(0) == L && out.size(1) == H * D && out.stride(1) == 1,
              "prefill_attention_amx: out must be [rows, heads * D] with dense rows");
  for (const at::Tensor* t : {&query, &key, &value, &out})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "prefill_attention_amx: bfloat16 only");
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D,
                "prefill_attention_amx: each row's heads must be dense");
  TORCH_CHECK(D % 32 == 0 && D <= 256, "prefill_attention_amx: head size a multiple of 32, <= 256");
#if KEEL_AMX
  const int64_t G = H / Hkv, offset = S - L;
  const int64_t S32 = (S + kBlock - 1) / kBlock * kBlock;
  // Packed K and V, in buffers the calling thread keeps (every element is written below).
  static thread_local std::vector<uint32_t> kt;
  static thread_local std::vector<uint16_t> vv;
  // Over-allocated by 64 bytes, the tiles start on a cache line (malloc gives 16-byte
  // alignment: a 64-byte tile row then spans two lines; 1.06x on this kernel, alternated in
  // both orders, twenty-fifth round).
  kt.resize(Hkv * S32 * D / 2 + 16);
  vv.resize(Hkv * S32 * D + 32);
  // The calling thread's: the workers see these pointers.
  uint32_t* const ktp = reinterpret_cast<uint32_t*>(
      (reinterpret_cast<uintptr_t>(kt.data()) + 63) & ~uintptr_t{63});
  uint16_t* const vvp = reinterpret_cast<uint16_t*>(
      (reinterpret_cast<uintptr_t>(vv.data()) + 63) & ~uintptr_t{63});
  const auto* k_ptr = key.data_ptr<c10::BFloat16>();
  const auto* v_ptr = value.data_ptr<c10::BFloat16>();
  at::parallel_for(0, 2 * Hkv, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t hk = i / 2;
      if (i % 2 == 0)
        pack_keys(k_ptr + hk * D, key.stride(0), S, S32, D, ktp + hk * S32 * D / 2);
      else
        pack_values(v_ptr + hk * D, value.stride(0), S, S32, D, vvp + hk * S32 * D);
    }
  });
  const int64_t blocks = (L + kRows - 1) / kRows, items = blocks * H;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  const auto* q_ptr = query.data_ptr<c10::BFloat16>();
  auto* o_ptr = out.data_ptr<c10::BFloat16>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // Tiles: 0-1 the scores of a block (16 x 16 float each), 2 an A operand (Q or P), 3 a B
    // operand (K^T or V pairs), 4-7 the output's 16-dim columns.
    keel::configure_tiles();
    auto w = std::make_unique<Scratch>();
    for (int64_t i = next++; i < items; i = next++) {  // longest first
      const int64_t blk = blocks - 1 - i / H, h = i % H, hk = h / G;
      const int64_t r0 = blk * kRows, nr = std::min(kRows, L - r0);
      attend_item(q_ptr, query.stride(0), ktp + hk * S32 * D / 2,
                  vvp + hk * S32 * D, o_ptr, out.stride(0), h, D, S32, r0, nr, offset,
                  sliding_window, sc, *w);
    }
    _tile_release();
  });
#endif
}
