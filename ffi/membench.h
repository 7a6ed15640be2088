// The machine's memory bandwidth, measured with the same pinned threads the kernels use: the floor
// against which memory-bound kernels (decode GEMV) are judged.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <string>

namespace hybridjit {

class ThreadPool;

// The read patterns tried for the read floor: a kernel that reads more cleverly than a plain sum (it
// prefetches, it reads several rows side by side) must not beat its own floor.
struct ReadPattern {
  const char* name;
  int streams;             // interleaved sub-ranges each thread reads side by side
  int64_t prefetch_bytes;  // software prefetch this far ahead in each stream (0: none)
};
inline constexpr ReadPattern kReadPatterns[] = {
    {"plain", 1, 0}, {"prefetch_2k", 1, 2048}, {"4_streams_prefetch_2k", 4, 2048}, {"4_streams_prefetch_4k", 4, 4096}};

// A resident float32 array that the pool's threads read in one pass per call. Lets a benchmark take the
// read floor next to each of its cases: these machines share memory bandwidth with other tenants, and
// a floor taken minutes apart from a case can differ from the one the case saw by 25% (bench/RESULTS.md).
class MemoryReader {
 public:
  // `threads`: a pool of its own with that many threads; 0: the global pool as it is at each pass, so the
  // passes run on the very threads of the kernels they are compared with (a second pool would spin on the
  // same cores for a while after each pass, into the next timed call).
  MemoryReader(int64_t bytes, int threads);

  int64_t bytes() const { return bytes_; }
  int threads() const;
  // One pass in the named pattern of kReadPatterns: bytes read / second, in GB/s (1e9).
  double ReadGbps(const std::string& pattern);

 private:
  std::shared_ptr<ThreadPool> Pool() const;

  std::shared_ptr<ThreadPool> own_pool_;  // null: the global pool
  int64_t bytes_;
  std::unique_ptr<float, decltype(&std::free)> data_{nullptr, &std::free};
  float sink_ = 0;  // the sums land here, so they are not optimised away
};

struct MemoryBandwidth {
  double read_gbps = 0;  // the best read pattern's (bytes read / s, 1e9)
  const char* read_pattern = "";
  double read_by_pattern_gbps[std::size(kReadPatterns)] = {};
  double triad_gbps = 0;  // STREAM triad a = b + s * c (3 arrays' bytes / s, as STREAM counts)
  int threads = 0;
  int64_t bytes = 0;  // per array
};

// Best of `repeats` passes over arrays of `bytes` each (float32, advised into transparent huge pages),
// on a pool of `threads` threads (0: the global pool's).
MemoryBandwidth MeasureMemoryBandwidth(int64_t bytes, int repeats, int threads);

}  // namespace hybridjit
