// Software prefetch of weight rows ahead of the SIMD GEMV tiles (the AVX2 and AVX-512 kernels).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu_features.h"

namespace hybridjit {

// The override if set, else the distance measured best at DeepSeek-V3 expert shapes on a 16-core
// Emerald Rapids (bench/moe_cpu.py --prefetch, bench/RESULTS.md): 2 KB for every format. (For the 1-byte
// and half-byte formats that holds since the prefetches run on into the next tile; before, when they
// stopped at the row's end, 512 bytes was best.)
inline int64_t WeightPrefetchBytes() {
  const int64_t bytes = WeightPrefetchOverride();
  return bytes >= 0 ? bytes : 2048;
}

// The byte offset from a tile row's start that the step at byte `at` prefetches: `distance` ahead along the
// row and, past the row's end, on into the same row of the next tile (`next_tile` = (R - 1) rows further),
// so a tile's first lines are on their way before it starts. Rows of 1-byte weights are short (2 KB in
// the down projection), so without this each tile would begin with a full memory latency. `distance` must
// not exceed row_bytes (TileDistance), or the offset would land in the row after the next tile's.
inline int64_t PrefetchOffset(int64_t at, int64_t distance, int64_t row_bytes, int64_t next_tile) {
  const int64_t ahead = at + distance;
  return ahead < row_bytes ? ahead : ahead + next_tile;
}

// The prefetch distance for a tile of rows of `row_bytes`: at most one row ahead (int4 rows of V3's down
// projection are 1 KB), which then reaches the whole next tile.
inline int64_t TileDistance(int64_t row_bytes) { return std::min(WeightPrefetchBytes(), row_bytes); }

}  // namespace hybridjit
