// What keel's AMX kernels (prefill_attention_amx.cpp, amx_gemm.cpp) share: whether this build
// has the tiles (KEEL_AMX: AMX-BF16 and AVX512-BF16 at build time, -march=native on such a
// CPU), and the one tile configuration both use: all 8 tiles 16 rows x 64 bytes.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512F__) && defined(__linux__)
#define KEEL_AMX 1
#include <immintrin.h>

#include <cstdint>

namespace keel {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// On the calling thread (tile configuration is per thread; _tile_release() when done).
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  // GCC 12 does not treat ldtilecfg as reading its operand: without this barrier it may drop
  // the stores above as dead (measured in a small program: the tiles then stay unconfigured
  // and the first tile instruction faults).
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}

}  // namespace keel
#else
#define KEEL_AMX 0
#endif

// Whether this build has the tiles and the kernel lets the process use them (asked once:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)); defined in prefill_attention_amx.cpp.
bool prefill_attention_amx_available();
