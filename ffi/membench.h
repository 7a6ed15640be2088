// The machine's memory bandwidth, measured with the same pinned threads the kernels use: the floor
// against which memory-bound kernels (decode GEMV) are judged.
#pragma once

#include <cstdint>

namespace hybridjit {

struct MemoryBandwidth {
  double read_gbps = 0;   // sum of one array (bytes read / s, 1e9)
  double triad_gbps = 0;  // STREAM triad a = b + s * c (3 arrays' bytes / s, as STREAM counts)
  int threads = 0;
  int64_t bytes = 0;  // per array
};

// Best of `repeats` runs over arrays of `bytes` each (float32), on a pool of `threads` threads
// (0: the global pool's).
MemoryBandwidth MeasureMemoryBandwidth(int64_t bytes, int repeats, int threads);

}  // namespace hybridjit
