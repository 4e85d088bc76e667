// keel's AVX-512 float32 GEMM register tile alone, on one thread, against the cores' FMA rate
// (benchmarks/fma_peak.c), alternating in one process. The tile (10 rows of x against two
// panels of 16 columns, K steps) runs over a few distinct x tiles and one panel pair that stay
// in L1/L2; nothing else of a GEMM call (threads, claims, prefetch of the next panels, weights
// from memory) is in the loop. If this reads near 1.0 while benchmarks/gemm_efficiency.py reads
// lower, the GEMM's loss is around the tile, not in its instructions (BENCHMARKS.md, 57th round).
//
//   T=.venv/lib/python3.11/site-packages/torch
//   gcc -O2 -march=native -fopenmp -DFMA_PEAK_LIB -c benchmarks/fma_peak.c -o /tmp/fma_peak.o
//   g++ -O3 -march=native -fno-math-errno -fopenmp -std=c++17 -w -I$T/include \
//       -I$T/include/torch/csrc/api/include benchmarks/tile_probe.cpp /tmp/fma_peak.o \
//       -o /tmp/tile_probe -L$T/lib -ltorch_cpu -lc10 -Wl,-rpath,$T/lib
//   /tmp/tile_probe [K=576] [x tiles=4] [rounds=5]
#include "../keel/csrc/gemm.cpp"  // the tile as the engine builds it (same flags as cpu_ops)

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

extern "C" double fma_peak_gflops(int threads, long iters);

// gemm_silu's epilogue lives in fused_ops.cpp; the probe never runs it.
void silu_mul_f32(const float*, const float*, float*, int64_t) {}

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int main(int argc, char** argv) {
  const int K = argc > 1 ? std::atoi(argv[1]) : 576;
  const int tiles = argc > 2 ? std::atoi(argv[2]) : 4;
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 5;
  constexpr int R = kRows512;
  std::vector<float> x(static_cast<size_t>(tiles) * R * K), w(2 * K * kCols),
      out(static_cast<size_t>(tiles) * R * 2 * kCols);
  for (auto& v : x) v = 0.001f * static_cast<float>(std::rand() % 100);
  for (auto& v : w) v = 0.001f * static_cast<float>(std::rand() % 100);
  const long reps = 40000000L / (static_cast<long>(K) * tiles / 4);
  for (int round = 0; round < rounds; ++round) {
    const double before = fma_peak_gflops(1, 50000000);
    const double t0 = now();
    for (long rep = 0; rep < reps; ++rep)
      for (int t = 0; t < tiles; ++t) {
        float* o = out.data() + static_cast<size_t>(t) * R * 2 * kCols;
        tile512<R, 2, float>(x.data() + static_cast<size_t>(t) * R * K, K, w.data(),
                             w.data() + K * kCols, K, o, 2 * kCols, nullptr, nullptr,
                             WriteAhead{o, 2 * kCols});
      }
    const double secs = now() - t0;
    const double after = fma_peak_gflops(1, 50000000);
    const double rate = static_cast<double>(reps) * tiles * R * 2 * kCols * K * 2 / secs / 1e9;
    std::printf("K %d, %d x tiles: FMA probe %.1f / %.1f GFLOP/s, tile %.1f: %.3f of the probe\n",
                K, tiles, before, after, rate, rate * 2 / (before + after));
  }
  std::printf("(checksum %.3f)\n", out[0]);
}
