// Work shared out by claims, for kernels whose threads would otherwise take fixed shares.
//
// On the shared hosts keel is measured on, one core often runs 10-15% slower than the other
// for a while (another tenant, the hypervisor). With fixed shares the faster thread then
// waits at the end of every parallel region: in a 64-request decode step each thread sat idle
// in OpenMP's barrier ~8% of the step. Here each thread claims its next run of items from a
// shared counter as it finishes the last; a run is half a thread's fair share of what is left
// (at least one item), so the runs shrink towards the end and the threads finish together
// (idle ~3-4% of the step; BENCHMARKS.md, ninth round). A run never crosses a multiple of
// `group` (a GEMM's runs stay within one block of rows).
#pragma once

#include <ATen/Parallel.h>
#include <xmmintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

namespace keel {

class Claims {
 public:
  Claims(int64_t items, int64_t threads, int64_t group)
      : items_(items), threads_(std::max<int64_t>(1, threads)),
        group_(group > 0 ? group : std::max<int64_t>(1, items)) {}

  // The calling thread's next run [first, end); first == items when nothing is left.
  int64_t claim(int64_t& end) {
    int64_t first = next_.load(std::memory_order_relaxed), last;
    do {
      if (first >= items_) return end = items_;
      const int64_t group_end = std::min(items_, (first / group_ + 1) * group_);
      const int64_t share = (group_end - first) / (2 * threads_);
      last = std::min(group_end, first + std::max<int64_t>(1, share));
    } while (!next_.compare_exchange_weak(first, last, std::memory_order_relaxed));
    end = last;
    return first;
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t items_, threads_, group_;
};

// A GEMM tile's share of the next item's weights, prefetched into L2 spread evenly over the
// tile's `steps` steps of k: at each step, the lines (from `pf`) that bring the count to its
// share of the steps so far, `lines` in all (`acc` starts at 0). gemm.cpp's AVX-512 tile over
// a float32 weight prefetched two lines every step until its share was done; spread, the
// default model's 120 decode GEMMs from memory ran 1.04-1.10x faster at 64 rows (an AVX-512
// Xeon without AMX; BENCHMARKS.md, fifty-first round). Its tile over a bfloat16 weight, spread
// the same way, read level or slower within the host's noise and keeps its two lines a step;
// i16_gemm's read 0.96-0.98x spread and prefetches one line every two pairs instead.
__attribute__((always_inline)) inline void spread_prefetch(const char*& pf, int64_t& acc,
                                                          int64_t lines, int64_t steps) {
  acc += lines;
  while (acc >= steps) {
    _mm_prefetch(pf, _MM_HINT_T1);
    pf += 64;
    acc -= steps;
  }
}

// A line of a GEMM's next item's weights: into L2, or with the non-temporal hint (`stream`:
// i16_gemm's and bf16_dot_gemm's decode passes where keel::gemm_prefetch_nta, vendor_choice.h).
inline void prefetch_weights(const char* p, bool stream) {
  if (stream)
    _mm_prefetch(p, _MM_HINT_NTA);
  else
    _mm_prefetch(p, _MM_HINT_T1);
}

// f() once on each of `threads` of torch's threads (inline when threads <= 1 or when already
// inside a parallel region); each call claims runs until none is left.
template <typename F>
void on_threads(int64_t threads, const F& f) {
  if (threads <= 1) {
    f();
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { f(); });
}

// The schedule fp16_gemm and i16_gemm share: every (block of kBlockRows rows, group of kGroup
// adjacent panels: a pair unless said) item, block by block, the threads claiming runs of
// items within a block (x's copy of the block stays in L2 while every group passes over it).
// Before the last item of its run a thread claims its next run, so that the item's tiles can
// prefetch the next item's panels into L2, an even share each (gemm.cpp does the same). An
// item's tiles are as few as kMaxRows allows and as even as can be (64 rows of 10-row tiles:
// 10 + 6 x 9, not 6 x 10 + 4). tile(p, np, r0, rows, pf, pf_end) runs rows r0 .. r0 + rows
// against the np (up to kGroup) panels from p, prefetching the lines pf .. pf_end; `weights`
// is the first panel, each `panel_bytes` long. Each thread calls begin() before its first item
// and end() after its last (i16_gemm_argmax's lanes).
struct NoHook {
  void operator()() const {}
};
template <int64_t kBlockRows, int64_t kMaxRows, int64_t kGroup = 2, typename Tile,
          typename Begin = NoHook, typename End = NoHook>
__attribute__((always_inline)) inline void run_panel_groups(int64_t m, int64_t panels,
                                                           const char* weights,
                                                           int64_t panel_bytes, const Tile& tile,
                                                           const Begin& begin = Begin{},
                                                           const End& end_hook = End{}) {
  const int64_t groups = (panels + kGroup - 1) / kGroup;
  const int64_t blocks = (m + kBlockRows - 1) / kBlockRows;
  const int64_t items = blocks * groups;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  Claims claims(items, threads, groups);
  on_threads(threads, [&] {
    begin();
    int64_t end = 0, item = claims.claim(end);
    while (item < items) {
      const int64_t m0 = item / groups * kBlockRows, mb = std::min(kBlockRows, m - m0);
      const int64_t p = item % groups * kGroup;
      const int np = static_cast<int>(std::min<int64_t>(kGroup, panels - p));
      int64_t next = item + 1, next_end = end;
      if (next == end) next = claims.claim(next_end);
      const char* pf = nullptr;  // the next item's panels, unless there is none
      int64_t pf_bytes = 0;
      if (next < items) {
        const int64_t np0 = next % groups * kGroup;
        pf = weights + np0 * panel_bytes;
        pf_bytes = std::min<int64_t>(kGroup, panels - np0) * panel_bytes;
      }
      const int64_t tiles = (mb + kMaxRows - 1) / kMaxRows, base = mb / tiles, extra = mb % tiles;
      const int64_t share = (pf_bytes + tiles - 1) / tiles;  // bytes prefetched per tile
      for (int64_t t = 0, r0 = m0; t < tiles; ++t) {
        const int rows = static_cast<int>(base + (t < extra));
        tile(p, np, r0, rows, pf + std::min(pf_bytes, t * share),
             pf + std::min(pf_bytes, (t + 1) * share));
        r0 += rows;
      }
      item = next;
      end = next_end;
    }
    end_hook();
  });
}

// f(std::integral_constant<int, R>{}) for R = rows, a runtime count in [1, MaxR]: a GEMM's
// register tiles are templates on their rows (i16_gemm, bf16_dot_gemm, greedy_head), and
// run_panel_groups hands each tile its row count at run time. The caller checks the range.
template <int MaxR, typename F>
__attribute__((always_inline)) inline void with_rows(int rows, const F& f) {
  if constexpr (MaxR > 1) {
    if (rows == MaxR) return f(std::integral_constant<int, MaxR>{});
    with_rows<MaxR - 1>(rows, f);
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

}  // namespace keel
