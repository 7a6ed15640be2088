#include "membench.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <new>
#include <stdexcept>
#include <vector>

#include "thread_pool.h"

namespace hybridjit {
namespace {

// Wide loads matter here: a 16-byte loop can leave bandwidth unused on a core.
__attribute__((target_clones("avx512f", "avx2", "default"))) float Sum(const float* a, int64_t n) {
  constexpr int kLanes = 64;
  float lanes[kLanes] = {};
  for (int64_t i = 0; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l];
  }
  float s = 0;
  for (float v : lanes) s += v;
  return s;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void Triad(float* a, const float* b, const float* c,
                                                                       float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};

std::unique_ptr<float, FreeDeleter> Allocate(int64_t n) {
  auto* p = static_cast<float*>(std::aligned_alloc(4096, (n * sizeof(float) + 4095) / 4096 * 4096));
  if (!p) throw std::bad_alloc();
  return std::unique_ptr<float, FreeDeleter>(p);
}

// Times `body(chunk, begin, end)` over [0, n) split into chunks taken by the pool's threads; best of repeats.
template <typename Body>
double BestSeconds(ThreadPool& pool, int64_t n, int repeats, Body body) {
  const int64_t chunks = pool.threads() * 8;
  Job job;
  job.tasks.assign(1, std::vector<std::vector<int64_t>>(pool.nodes()));
  for (int64_t c = 0; c < chunks; ++c) job.tasks[0][c * pool.nodes() / chunks].push_back(c);
  // Chunk boundaries on 64 floats, so every chunk but the last is whole vectors.
  job.run = [&](int64_t c) {
    body(c, c * n / chunks / 64 * 64, (c + 1 == chunks) ? n : (c + 1) * n / chunks / 64 * 64);
  };
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    const std::string error = pool.Run(job);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!error.empty()) throw std::runtime_error(error);
    best = std::min(best, seconds);
  }
  return best;
}

}  // namespace

MemoryBandwidth MeasureMemoryBandwidth(int64_t bytes, int repeats, int threads) {
  if (bytes < 4096 || repeats < 1) throw std::invalid_argument("bytes must be >= 4096 and repeats >= 1");
  std::shared_ptr<ThreadPool> pool = threads > 0 ? std::make_shared<ThreadPool>(threads, 0) : ThreadPool::Global();
  const int64_t n = bytes / sizeof(float);
  auto a = Allocate(n), b = Allocate(n), c = Allocate(n);
  float* pa = a.get();
  float* pb = b.get();
  float* pc = c.get();
  // First touch by the pool's threads, so pages land where the threads that read them run.
  BestSeconds(*pool, n, 1, [&](int64_t, int64_t begin, int64_t end) {
    std::fill(pa + begin, pa + end, 1.0f);
    std::fill(pb + begin, pb + end, 2.0f);
    std::fill(pc + begin, pc + end, 0.5f);
  });
  std::vector<float> sink(pool->threads() * 8);  // one per chunk: the sums must not be optimised away
  MemoryBandwidth result;
  result.threads = pool->threads();
  result.bytes = n * static_cast<int64_t>(sizeof(float));
  const double read = BestSeconds(*pool, n, repeats, [&](int64_t chunk, int64_t begin, int64_t end) {
    sink[chunk] += Sum(pa + begin, end - begin);
  });
  result.read_gbps = static_cast<double>(result.bytes) / read / 1e9;
  const double triad = BestSeconds(*pool, n, repeats, [&](int64_t, int64_t begin, int64_t end) {
    Triad(pa + begin, pb + begin, pc + begin, 3.0f, end - begin);
  });
  result.triad_gbps = 3.0 * static_cast<double>(result.bytes) / triad / 1e9;
  float total = 0;
  for (float v : sink) total += v;
  volatile float keep = total;
  (void)keep;
  return result;
}

}  // namespace hybridjit
