// quant_gemm_q8.cpp's row kernels in 512-bit vectors with AVX512-VNNI (`vpdpbusd`), two groups
// of 32 per vector, where the CPU has them; KEEL_Q8_512 says whether they are built. Included
// by quant_gemm_q8.cpp only, inside its translation unit and anonymous namespace: it uses the
// file's helpers (unpack_nibbles, load8, hsum8).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KEEL_Q8_512 1

// int4_rows_q8 with 512-bit vectors and AVX512-VNNI, two groups per vector: 32 bytes of
// nibbles, broadcast to both halves, become [g even | g+1 even | g odd | g+1 odd] (16 weights
// each: low nibbles in the low half, high nibbles in the high half), and `vpdpbusd` sums them
// against the activations laid out alike (`xp`, see pair_groups) in 4 products per lane: lanes
// 0-3 and 8-11 hold group g's partial sums, 4-7 and 12-15 group g+1's, so that a vector of
// per-lane scales weighs each group. The same integer sums as the 256-bit kernel (and the same
// float32 products of them); only the order of the float32 additions differs. About half its
// instructions per weight: at one row that kernel was bound by them (the same time with the
// weights in cache as from memory).
template <int M, int P, typename S>
void int4_rows_q8_512(const uint8_t* q, const S* scale, const S* mins, const int8_t* xq,
                      const int8_t* xp, const float* xs, const float* xsum, int64_t stride,
                      float* out, int64_t n, int64_t k) {
  const int64_t groups = k / 32;
  // lanes of group j: 0-3 and 8-11; of group j + 1: 4-7 and 12-15 (j = 0, 2, 4, 6)
  alignas(64) int32_t idx[4][16];
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 16; ++l) idx[j][l] = 2 * j + (l / 4) % 2;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    alignas(32) float ds[M][8];
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512 w254 = _mm512_set1_ps(254.f);
    for (int64_t row = begin; row < end; ++row) {
      const uint8_t* qn = q + row * (k / 2);
      const S* sn = scale + row * groups;
      const S* mn = mins + row * groups;
      __m512 acc0[M], acc1[M];
      __m256 one[M], zacc[M];
      float tail[M];
      for (int r = 0; r < M; ++r) {
        acc0[r] = acc1[r] = _mm512_setzero_ps();
        one[r] = zacc[r] = _mm256_setzero_ps();
        tail[r] = 0.f;
      }
      for (int64_t g0 = 0; g0 < groups; g0 += 8) {
        const int cnt = static_cast<int>(std::min<int64_t>(8, groups - g0));
        group_scales<M>(sn, mn, xs, xsum, stride, g0, cnt, ds, zacc, tail);
        int j = 0;
        for (; j + 2 <= cnt; j += 2) {
          const int64_t g = g0 + j;
          const __m512i b = _mm512_broadcast_i64x4(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qn + g * 16)));
          const __m512i w = _mm512_and_si512(_mm512_mask_srli_epi16(b, 0xFFFF0000u, b, 4), low4);
          const __m512i sel = _mm512_load_si512(idx[j / 2]);
          for (int r = 0; r < M; ++r) {
            const int8_t* x = xp + (r * groups + g) * 32 * P;
            const __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,
                                                   _mm512_loadu_si512(x));
            __m512 f = _mm512_cvtepi32_ps(i1);
            if constexpr (P == 2) {
              const __m512i i2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,
                                                     _mm512_loadu_si512(x + 64));
              f = _mm512_fmadd_ps(f, w254, _mm512_cvtepi32_ps(i2));  // exact: integers < 2^24
            }
            const __m512 sv = _mm512_permutexvar_ps(sel, _mm512_castps256_ps512(
                                                             _mm256_load_ps(ds[r])));
            if (j % 4 == 0)
              acc0[r] = _mm512_fmadd_ps(f, sv, acc0[r]);
            else
              acc1[r] = _mm512_fmadd_ps(f, sv, acc1[r]);
          }
        }
        if (j < cnt) {  // an odd last group: the 256-bit kernel's step
          const int64_t g = g0 + j;
          const __m256i w0 = unpack_nibbles(qn + g * 16);
          for (int r = 0; r < M; ++r)
            one[r] = q8_group<P>(w0, xq + (r * groups + g) * 32 * P, &ds[r][j], one[r]);
        }
      }
      for (int r = 0; r < M; ++r)
        out[r * n + row] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r])) +
                           hsum8(_mm256_add_ps(one[r], zacc[r])) + tail[r];
    }
  });
}

// xq's activations (per group, P parts of 32 bytes) laid out for the 512-bit kernels, two
// groups a and b per 64 bytes of each part, at the pair's offset in xq: pieces of `piece`
// bytes taken in turn, [a 0-15 | b 0-15 | a 16-31 | b 16-31] for int4 (piece 16: the even,
// then the odd elements of each) and [a | b] for int8 (piece 32). An odd last group is left
// out (xq serves it).
void pair_groups(const int8_t* xq, int64_t m, int64_t groups, int P, int piece, int8_t* xp) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g + 2 <= groups; g += 2)
      for (int part = 0; part < P; ++part) {
        const int8_t* a = xq + (r * groups + g) * 32 * P + part * 32;
        const int8_t* b = a + 32 * P;
        int8_t* dst = xp + (r * groups + g) * 32 * P + part * 64;
        for (int off = 0; off < 32; off += piece, dst += 2 * piece) {
          std::memcpy(dst, a + off, piece);
          std::memcpy(dst + piece, b + off, piece);
        }
      }
}

// int8_rows_q8 with 512-bit vectors, two groups per vector: |w| (unsigned) by x carrying w's
// sign (negated where w < 0: AVX-512 has no vpsignb), summed by `vpdpbusd` (lanes 0-7: group
// g, 8-15: group g + 1), weighed per lane by the group's activation scale. `xp` holds the
// activations of each pair of groups side by side per part (pair_groups). The same integer
// sums as int8_rows_q8; the float32 additions in another order.
template <int M, int P>
void int8_rows_q8_512(const int8_t* q, const float* scale, const int8_t* xq, const int8_t* xp,
                      const float* xs, int64_t stride, float* out, int64_t n, int64_t k) {
  const int64_t groups = k / 32;
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    const __m512i sel = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512 w254 = _mm512_set1_ps(254.f);
    for (int64_t row = begin; row < end; ++row) {
      const int8_t* qn = q + row * k;
      __m512 acc[2][M];
      __m256 one[M];
      for (int r = 0; r < M; ++r) {
        acc[0][r] = acc[1][r] = _mm512_setzero_ps();
        one[r] = _mm256_setzero_ps();
      }
      int64_t g = 0;
      for (; g + 2 <= groups; g += 2) {
        const __m512i w = _mm512_loadu_si512(qn + g * 32);
        const __m512i aw = _mm512_abs_epi8(w);
        const __mmask64 neg = _mm512_movepi8_mask(w);
        for (int r = 0; r < M; ++r) {
          const int8_t* x = xp + (r * groups + g) * 32 * P;
          const __m512i x1 = _mm512_loadu_si512(x);
          const __m512i i1 = _mm512_dpbusd_epi32(
              _mm512_setzero_si512(), aw,
              _mm512_mask_sub_epi8(x1, neg, _mm512_setzero_si512(), x1));
          __m512 f = _mm512_cvtepi32_ps(i1);
          if constexpr (P == 2) {
            const __m512i x2 = _mm512_loadu_si512(x + 64);
            const __m512i i2 = _mm512_dpbusd_epi32(
                _mm512_setzero_si512(), aw,
                _mm512_mask_sub_epi8(x2, neg, _mm512_setzero_si512(), x2));
            f = _mm512_fmadd_ps(f, w254, _mm512_cvtepi32_ps(i2));  // exact: integers < 2^24
          }
          const __m512 sv = _mm512_permutexvar_ps(
              sel, _mm512_castps128_ps512(_mm_castsi128_ps(
                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(xs + r * stride + g)))));
          acc[(g / 2) & 1][r] = _mm512_fmadd_ps(f, sv, acc[(g / 2) & 1][r]);
        }
      }
      if (g < groups) {  // an odd last group: int8_rows_q8's step
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qn + g * 32));
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int r = 0; r < M; ++r) {
          const __m256i dot = q8_dot<P, true>(aw, xq + (r * groups + g) * 32 * P, w);
          one[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                   _mm256_broadcast_ss(xs + r * stride + g), one[r]);
        }
      }
      for (int r = 0; r < M; ++r)
        out[r * n + row] = (_mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r])) +
                            hsum8(one[r])) * scale[row];
    }
  });
}

#endif
