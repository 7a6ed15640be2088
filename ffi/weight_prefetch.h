// Software prefetch of weight rows ahead of the SIMD GEMV tiles (the AVX2 and AVX-512 kernels).
#pragma once

#include <xmmintrin.h>

#include <cstdint>

#include "cpu_features.h"

namespace hybridjit {

// The override if set, else the distance measured best at DeepSeek-V3 expert shapes (bench/moe_cpu.py
// --prefetch, bench/RESULTS.md): 2 KB for every format on a 16-core Emerald Rapids (for the 1-byte and half-byte
// formats that holds since the prefetches run on into the next tile; before, when they stopped at the row's
// end, 512 bytes was best), 1 KB on AMD, measured on a 2-core Zen 5 only (fp8 and int8 2-6% faster there than at
// 2 KB, int4 even; other AMD parts not measured).
inline int64_t WeightPrefetchBytes() {
  const int64_t bytes = WeightPrefetchOverride();
  if (bytes >= 0) return bytes;
  return HostIsAmd() ? 1024 : 2048;
}

// Where each step of a tile row prefetches: `distance` bytes ahead in the stream that the row's position
// in its tile follows from tile to tile, i.e. along the row and, past its end, on into the same row of the
// following tiles (a tile's R rows are consecutive, so the next tile's same row starts R rows further).
// So a tile's first lines are on their way before it starts: rows of 1-byte weights are short (2 KB in the
// down projection, 1 KB for int4), and without this each tile would begin with a full memory latency.
class TilePrefetch {
 public:
  TilePrefetch(int64_t row_bytes, int rows_per_tile, int64_t distance = WeightPrefetchBytes())
      : row_bytes_(row_bytes), next_tile_((rows_per_tile - 1) * row_bytes) {
    remainder_ = distance % row_bytes;
    lead_ = distance + distance / row_bytes * next_tile_;
  }

  // The byte offset from the row's start to prefetch at the step that reads byte `at` (< row_bytes): no
  // division in the loop, since at + (distance % row_bytes) crosses at most one row end.
  int64_t Offset(int64_t at) const { return at + lead_ + (at + remainder_ >= row_bytes_ ? next_tile_ : 0); }

  // Prefetches `lines` cache lines of each of the tile's rows for the step that reads byte `at`, into L1, or
  // into L2 only.
  template <int R, bool kIntoL2 = false>
  void Rows(const unsigned char* const (&rows)[R], int64_t at, int lines = 1) const {
    if (lead_ == 0) return;
    const int64_t offset = Offset(at);
    for (int r = 0; r < R; ++r) {
      for (int l = 0; l < lines; ++l) {
        const char* p = reinterpret_cast<const char*>(rows[r]) + offset + 64 * l;
        if constexpr (kIntoL2) {
          _mm_prefetch(p, _MM_HINT_T1);
        } else {
          _mm_prefetch(p, _MM_HINT_T0);
        }
      }
    }
  }

 private:
  int64_t row_bytes_, next_tile_, remainder_, lead_;
};

}  // namespace hybridjit
