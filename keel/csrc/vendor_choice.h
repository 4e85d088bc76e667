// A kernel setting chosen by the CPU's vendor, once a process: the decode attention's prefetch
// into L2 (paged_attention_common.h) and the GEMMs' non-temporal weight prefetch in decode
// passes (gemm_prefetch_nta: i16_gemm.cpp, bf16_dot_gemm.cpp), each on for AMD and off
// elsewhere, unless its environment variable is "0" or "1". Each setting is held in an atomic,
// so that a test may change it while a kernel's threads read it.
#pragma once

#include <atomic>
#include <cstdlib>

namespace keel {

inline bool amd_unless_forced(const char* env) {
  const char* e = std::getenv(env);
  if (e != nullptr && (e[0] == '0' || e[0] == '1') && e[1] == '\0') return e[0] == '1';
#if defined(__x86_64__) || defined(__i386__)
  return static_cast<bool>(__builtin_cpu_is("amd"));
#else
  return false;
#endif
}

// Whether i16_gemm's and bf16_dot_gemm's passes of one block of rows (decode steps) prefetch
// the next item's weights with the non-temporal hint instead of into L2. Each weight line is
// read in one item only, and a decode step streams all of the model's weights (269 MB for the
// default model in int16) through the caches: on AMD (an EPYC Zen 4) the hint let them pass
// without displacing what the rest of the step reads, and `auto`'s decode step at 64 requests
// took 0.964-0.987x the time (BENCHMARKS.md, sixty-sixth round). Elsewhere into L2, as
// before: on Intel the hint fetches into L1 only, and a tile's rows reread the item's panels
// (36-98 KB) past L1's reach. Chosen at first use; KEEL_GEMM_PREFETCH_NTA=0|1 forces it, and
// the binding `gemm_prefetch_nta(set=)` changes it in a running process (the tests). One
// flag for the process: an inline function's static is one object across the kernels' files.
inline std::atomic<bool>& gemm_prefetch_nta() {
  static std::atomic<bool> nta{amd_unless_forced("KEEL_GEMM_PREFETCH_NTA")};
  return nta;
}

}  // namespace keel
