// What a GEMM tile on AVX512-FP16 could do on a CPU that has it but no AMX tiles (the issue's
// Xeon kind: AVX-512 with BF16 and FP16, AMX hidden), against a tile of the shape keel's
// float32 GEMM runs (keel/csrc/gemm.cpp, `tile512`: 10 rows against two 16-column panels, one
// float32 FMA per weight and row). A probe, not a kernel of keel's: one thread, the weights of
// two panels hot in L2 (K = 576, the default model's hidden size), best of 3 alternated runs.
//
// The fp16 tile: x rounded to float16 (11 significant bits, 8 more than bfloat16's), read as
// (x[k], x[k+1]) pairs by one 32-bit broadcast (a plain load: a 16-bit broadcast from memory
// takes a shuffle on the port an FMA needs); a panel row holds 16 columns for two values of k
// (lane 2j: w[k][j], lane 2j + 1: w[k+1][j]), so one 32-lane FMA does two steps of k for 16
// columns. The float16 sums run over KC pairs of k at most, then are widened and added into
// float32 sums (lane pairs added at the end). So a float16 sum holds at most 2 * KC products.
//
// It prints both tiles' rates, their ratio, and the largest error of the fp16 tile against the
// float32 one, beside the error of bfloat16-rounded inputs with float32 sums (what bfloat16
// arithmetic on AMX or AVX512-BF16 does).
//
//   gcc -O2 -march=native -DKC=64 benchmarks/fp16_tile_rate.c -o /tmp/fp16_tile_rate -lm
//   /tmp/fp16_tile_rate
//
// Needs GCC 12+ and a CPU with AVX512-FP16. BENCHMARKS.md, forty-fifth round.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define R 10
#define K 576
#ifndef KC
#define KC 64
#endif

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// keel's float32 tile: w0, w1 are panels [K][16].
__attribute__((noinline)) static void tile32(const float* x, const float* w0, const float* w1,
                                             float* out) {
  __m512 c0[R], c1[R];
  for (int r = 0; r < R; r++) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int k = 0; k < K; k++) {
    __m512 b0 = _mm512_loadu_ps(w0 + k * 16), b1 = _mm512_loadu_ps(w1 + k * 16);
    __asm__("" : "+v"(b0), "+v"(b1));  // held in registers, as keel::pin does
#pragma GCC unroll 10
    for (int r = 0; r < R; r++) {
      const __m512 a = _mm512_set1_ps(x[r * K + k]);
      c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    _mm512_storeu_ps(out + r * 32, c0[r]);
    _mm512_storeu_ps(out + r * 32 + 16, c1[r]);
  }
}

static __m512 widen_half(__m512h v, int upper) {
  const __m256i half = _mm512_extracti64x4_epi64(_mm512_castph_si512(v), upper);
  return _mm512_cvtxph_ps(_mm256_castsi256_ph(half));
}

// The fp16 tile: x16 [R][K] float16, w0, w1 panels [K / 2][32] float16 (pairs of k per lane pair).
__attribute__((noinline)) static void tile16(const uint16_t* x16, const uint16_t* w0,
                                             const uint16_t* w1, float* out) {
  __m512 f[R][4];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < 4; i++) f[r][i] = _mm512_setzero_ps();
  for (int kb = 0; kb < K / 2; kb += KC) {
    __m512h c0[R], c1[R];
    for (int r = 0; r < R; r++) c0[r] = c1[r] = _mm512_setzero_ph();
    const int ke = kb + KC < K / 2 ? kb + KC : K / 2;
    for (int kp = kb; kp < ke; kp++) {
      __m512h b0 = _mm512_castsi512_ph(_mm512_loadu_si512(w0 + kp * 32));
      __m512h b1 = _mm512_castsi512_ph(_mm512_loadu_si512(w1 + kp * 32));
      __asm__("" : "+v"(b0), "+v"(b1));
#pragma GCC unroll 10
      for (int r = 0; r < R; r++) {
        uint32_t pair;
        memcpy(&pair, x16 + r * K + 2 * kp, 4);
        const __m512h a = _mm512_castsi512_ph(_mm512_set1_epi32((int)pair));
        c0[r] = _mm512_fmadd_ph(a, b0, c0[r]);
        c1[r] = _mm512_fmadd_ph(a, b1, c1[r]);
      }
    }
#pragma GCC unroll 10
    for (int r = 0; r < R; r++) {
      f[r][0] = _mm512_add_ps(f[r][0], widen_half(c0[r], 0));
      f[r][1] = _mm512_add_ps(f[r][1], widen_half(c0[r], 1));
      f[r][2] = _mm512_add_ps(f[r][2], widen_half(c1[r], 0));
      f[r][3] = _mm512_add_ps(f[r][3], widen_half(c1[r], 1));
    }
  }
  for (int r = 0; r < R; r++)
    for (int i = 0; i < 4; i++) {
      float t[16];
      _mm512_storeu_ps(t, f[r][i]);
      for (int j = 0; j < 8; j++) out[r * 32 + i * 8 + j] = t[2 * j] + t[2 * j + 1];
    }
}

static uint16_t to_half(float v) {
  const _Float16 h = (_Float16)v;
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}

static float to_bf16(float v) {  // round to nearest even, as torch does
  uint32_t u;
  memcpy(&u, &v, 4);
  u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
  float o;
  memcpy(&o, &u, 4);
  return o;
}

int main(void) {
  static float x[R * K], w[32 * K], w0[16 * K], w1[16 * K], xb[R * K], wb0[16 * K], wb1[16 * K];
  static uint16_t x16[R * K], p0[16 * K], p1[16 * K];
  float out32[R * 32], out16[R * 32], outb[R * 32];
  srand(1);
  for (int i = 0; i < R * K; i++) {  // activations of a normed hidden state's size
    x[i] = (rand() / (float)RAND_MAX - 0.5f) * 4;
    x16[i] = to_half(x[i]);
    xb[i] = to_bf16(x[i]);
  }
  for (int i = 0; i < 32 * K; i++) w[i] = (rand() / (float)RAND_MAX - 0.5f) * 0.1f;  // w[j][k]
  for (int k = 0; k < K; k++)
    for (int j = 0; j < 16; j++) {
      w0[k * 16 + j] = w[j * K + k];
      w1[k * 16 + j] = w[(16 + j) * K + k];
      wb0[k * 16 + j] = to_bf16(w0[k * 16 + j]);
      wb1[k * 16 + j] = to_bf16(w1[k * 16 + j]);
    }
  for (int kp = 0; kp < K / 2; kp++)
    for (int j = 0; j < 16; j++)
      for (int d = 0; d < 2; d++) {
        p0[kp * 32 + 2 * j + d] = to_half(w[j * K + 2 * kp + d]);
        p1[kp * 32 + 2 * j + d] = to_half(w[(16 + j) * K + 2 * kp + d]);
      }
  tile32(x, w0, w1, out32);
  tile16(x16, p0, p1, out16);
  tile32(xb, wb0, wb1, outb);
  double err16 = 0, errb = 0, top = 0;
  for (int i = 0; i < R * 32; i++) {
    err16 = fmax(err16, fabs(out16[i] - out32[i]));
    errb = fmax(errb, fabs(outb[i] - out32[i]));
    top = fmax(top, fabs(out32[i]));
  }
  const int iters = 400000;
  double best32 = 1e30, best16 = 1e30;
  for (int rep = 0; rep < 3; rep++) {
    double t = now();
    for (int i = 0; i < iters; i++) tile32(x, w0, w1, out32);
    best32 = fmin(best32, now() - t);
    t = now();
    for (int i = 0; i < iters; i++) tile16(x16, p0, p1, out16);
    best16 = fmin(best16, now() - t);
  }
  const double flop = 2.0 * R * 32 * K * iters;
  printf("KC=%d: float32 tile %.1f GFLOP/s, fp16 tile %.1f GFLOP/s (%.2fx); largest error "
         "against float32: fp16 tile %.2e, bfloat16 inputs %.2e (largest output %.2f)\n",
         KC, flop / best32 / 1e9, flop / best16 / 1e9, best32 / best16, err16, errb, top);
  return 0;
}
