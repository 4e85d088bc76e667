// The greedy-argmax epilogue two of keel's GEMMs share (amx_gemm.cpp via amx_gemm_tiles.h,
// i16_gemm.cpp): per-thread lanes of each row's best value so far, merged into one sink.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace keel {

// Greedy sampling in a GEMM's epilogue (amx_gemm_argmax, i16_gemm_argmax): each row's index
// of its largest output value, the output never written. A value is compared as the GEMM's
// output would hold it (amx_gemm's: rounded to bfloat16 once, after the bias; i16_gemm's: its
// float32 value, bias added), so the index is torch's argmax over that output: the first
// index of the row's largest value, a NaN counting as larger than any number (the first NaN
// wins), -0 equal to +0. Columns from n_valid on are not candidates.
//
// Each thread keeps, per row and per lane (column % 16), the best value and its column among
// the columns it has seen: a thread claims its items in ascending order, so a row's columns
// reach a lane in ascending order and only a strictly better value replaces the kept one.
// When the thread is done, each row's lanes are reduced and merged into the sink's (value,
// index) under its lock, by value and then by the lower index: the result does not depend on
// the order in which the threads finish.
struct ArgmaxSink {
  int64_t n_valid = 0;
  std::vector<float> value;  // [M] the best so far over the threads merged
  std::vector<int64_t> index;  // [M] -1: none yet
  std::mutex lock;

  // (v, i) better than (bv, bi) as torch's argmax orders them (bi < 0: none yet).
  static bool better(float v, int64_t i, float bv, int64_t bi) {
    if (bi < 0) return true;
    const bool vn = v != v, bn = bv != bv;
    if (vn || bn) return vn && (!bn || i < bi);
    return v > bv || (v == bv && i < bi);
  }
};

// One thread's lanes for rows [0, M): value and column per lane, column -1 where none yet.
struct ArgmaxLanes {
  std::vector<float> value;
  std::vector<int32_t> column;
  void reset(int64_t M) {
    value.assign(M * 16, 0.f);
    column.assign(M * 16, -1);
  }
  // Row r's 16 values of columns [c, c + 16), as the GEMM's output holds them.
  inline void update(int64_t r, int64_t c, __m512 v, int64_t n_valid) {
    float* bv = value.data() + r * 16;
    int32_t* bc = column.data() + r * 16;
    const __m512 b = _mm512_loadu_ps(bv);
    const __m512i bi = _mm512_loadu_si512(bc);
    const __m512i ci = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(c)),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                          12, 13, 14, 15));
    const __mmask16 valid = _mm512_cmplt_epi32_mask(ci, _mm512_set1_epi32(
                                                            static_cast<int32_t>(n_valid)));
    const __mmask16 none = _mm512_cmplt_epi32_mask(bi, _mm512_setzero_si512());
    const __mmask16 gt = _mm512_cmp_ps_mask(v, b, _CMP_GT_OQ);
    const __mmask16 vnan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 bnan = _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    const __mmask16 take = valid & (none | gt | (vnan & static_cast<__mmask16>(~bnan)));
    _mm512_storeu_ps(bv, _mm512_mask_mov_ps(b, take, v));
    _mm512_storeu_si512(bc, _mm512_mask_mov_epi32(bi, take, ci));
  }
  // Rows [0, M)'s lanes reduced and merged into the sink.
  void merge(int64_t M, ArgmaxSink& sink) const {
    std::lock_guard<std::mutex> guard(sink.lock);
    for (int64_t r = 0; r < M; ++r)
      for (int l = 0; l < 16; ++l) {
        const int64_t c = column[r * 16 + l];
        if (c >= 0 && ArgmaxSink::better(value[r * 16 + l], c, sink.value[r], sink.index[r])) {
          sink.value[r] = value[r * 16 + l];
          sink.index[r] = c;
        }
      }
  }
};

// A thread's ArgmaxLanes (the pool's threads live as long as the process).
inline ArgmaxLanes& thread_argmax_lanes() {
  static thread_local ArgmaxLanes lanes;
  return lanes;
}

}  // namespace keel
#endif  // __AVX512F__
