#include "membench.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <vector>

#include "thread_pool.h"

namespace hybridjit {
namespace {

// Sums `streams` equal sub-ranges of a[0, n) side by side, 64 floats (4 cache lines) of each per step,
// prefetching `prefetch` floats ahead in each (0: none). Wide loads matter: a 16-byte loop can leave
// bandwidth unused on a core.
__attribute__((target_clones("avx512f", "avx2", "default"))) float Sum(const float* a, int64_t n, int streams,
                                                                      int64_t prefetch) {
  constexpr int kLanes = 64;
  float lanes[kLanes] = {};
  const int64_t len = n / streams / kLanes * kLanes;
  for (int64_t i = 0; i < len; i += kLanes) {
    for (int s = 0; s < streams; ++s) {
      const float* p = a + s * len + i;
      if (prefetch > 0) {
        for (int line = 0; line < kLanes; line += 16) __builtin_prefetch(p + prefetch + line);
      }
      for (int l = 0; l < kLanes; ++l) lanes[l] += p[l];
    }
  }
  float s = 0;
  for (int64_t i = streams * len; i < n; ++i) s += a[i];
  for (float v : lanes) s += v;
  return s;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void Triad(float* a, const float* b, const float* c,
                                                                       float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

// On 2 MB boundaries and advised into huge pages (where transparent huge pages are "madvise" only), so
// the floor is not held down by TLB misses. Advice only: without THP the pages stay small.
std::unique_ptr<float, decltype(&std::free)> Allocate(int64_t n) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = (n * sizeof(float) + kHuge - 1) / kHuge * kHuge;
  auto* p = static_cast<float*>(std::aligned_alloc(kHuge, bytes));
  if (!p) throw std::bad_alloc();
  madvise(p, bytes, MADV_HUGEPAGE);
  return {p, &std::free};
}

// Seconds of one run of `body(chunk, begin, end)` over [0, n) split into chunks taken by the pool's threads.
template <typename Body>
double PassSeconds(ThreadPool& pool, int64_t n, Body body) {
  const int64_t chunks = pool.threads() * 8;
  Job job;
  job.tasks.assign(1, std::vector<std::vector<int64_t>>(pool.nodes()));
  for (int64_t c = 0; c < chunks; ++c) job.tasks[0][c * pool.nodes() / chunks].push_back(c);
  // Chunk boundaries on 64 floats, so every chunk but the last is whole vectors.
  job.run = [&](int64_t c) {
    body(c, c * n / chunks / 64 * 64, (c + 1 == chunks) ? n : (c + 1) * n / chunks / 64 * 64);
  };
  const auto start = std::chrono::steady_clock::now();
  const std::string error = pool.Run(job);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!error.empty()) throw std::runtime_error(error);
  return seconds;
}

// First touch by the pool's threads, so pages land where the threads that read them run.
void Fill(ThreadPool& pool, float* a, int64_t n, float value) {
  PassSeconds(pool, n, [&](int64_t, int64_t begin, int64_t end) { std::fill(a + begin, a + end, value); });
}

const ReadPattern& PatternNamed(const std::string& name) {
  for (const ReadPattern& p : kReadPatterns) {
    if (name == p.name) return p;
  }
  std::string known;
  for (const ReadPattern& p : kReadPatterns) known += std::string(known.empty() ? "" : ", ") + p.name;
  throw std::invalid_argument("unknown read pattern '" + name + "' (known: " + known + ")");
}

}  // namespace

MemoryReader::MemoryReader(int64_t bytes, int threads)
    : own_pool_(threads > 0 ? std::make_shared<ThreadPool>(threads, 0) : nullptr) {
  if (bytes < 4096) throw std::invalid_argument("bytes must be >= 4096");
  const int64_t n = bytes / sizeof(float);
  bytes_ = n * static_cast<int64_t>(sizeof(float));
  data_ = Allocate(n);
  Fill(*Pool(), data_.get(), n, 1.0f);
}

std::shared_ptr<ThreadPool> MemoryReader::Pool() const { return own_pool_ ? own_pool_ : ThreadPool::Global(); }

int MemoryReader::threads() const { return Pool()->threads(); }

double MemoryReader::ReadGbps(const std::string& name) {
  const ReadPattern& pattern = PatternNamed(name);
  const int64_t n = bytes_ / sizeof(float);
  const std::shared_ptr<ThreadPool> pool = Pool();
  std::vector<float> sums(pool->threads() * 8);
  const double seconds = PassSeconds(*pool, n, [&](int64_t chunk, int64_t begin, int64_t end) {
    sums[chunk] = Sum(data_.get() + begin, end - begin, pattern.streams, pattern.prefetch_bytes / sizeof(float));
  });
  for (float s : sums) sink_ += s;
  return static_cast<double>(bytes_) / seconds / 1e9;
}

MemoryBandwidth MeasureMemoryBandwidth(int64_t bytes, int repeats, int threads) {
  if (repeats < 1) throw std::invalid_argument("repeats must be >= 1");
  MemoryBandwidth result;
  {
    MemoryReader reader(bytes, threads);
    result.threads = reader.threads();
    result.bytes = reader.bytes();
    for (size_t i = 0; i < std::size(kReadPatterns); ++i) {
      double& gbps = result.read_by_pattern_gbps[i];
      for (int r = 0; r < repeats; ++r) gbps = std::max(gbps, reader.ReadGbps(kReadPatterns[i].name));
      if (gbps > result.read_gbps) {
        result.read_gbps = gbps;
        result.read_pattern = kReadPatterns[i].name;
      }
    }
  }
  std::shared_ptr<ThreadPool> pool = threads > 0 ? std::make_shared<ThreadPool>(threads, 0) : ThreadPool::Global();
  const int64_t n = result.bytes / sizeof(float);
  auto a = Allocate(n), b = Allocate(n), c = Allocate(n);
  Fill(*pool, a.get(), n, 1.0f);
  Fill(*pool, b.get(), n, 2.0f);
  Fill(*pool, c.get(), n, 0.5f);
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    best = std::min(best, PassSeconds(*pool, n, [&](int64_t, int64_t begin, int64_t end) {
      Triad(a.get() + begin, b.get() + begin, c.get() + begin, 3.0f, end - begin);
    }));
  }
  result.triad_gbps = 3.0 * static_cast<double>(result.bytes) / best / 1e9;
  return result;
}

}  // namespace hybridjit
