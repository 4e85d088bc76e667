// A kernel setting chosen by the CPU's vendor, once a process: the decode attention's prefetch
// into L2 (paged_attention_common.h) and i16_gemm's non-temporal weight prefetch
// (i16_gemm.cpp), each on for AMD and off elsewhere, unless its environment variable is "0" or
// "1". Held in an atomic, so that a test may change it while a kernel's threads read it.
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

}  // namespace keel
