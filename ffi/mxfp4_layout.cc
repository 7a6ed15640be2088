#include "mxfp4_layout.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "thread_pool.h"

namespace hybridjit {
namespace {

// Blocks per task: ~1 MiB of input, enough to amortise a task and small enough to spread a layer over the pool.
constexpr int64_t kBlocksPerTask = 1 << 16;

// One block's 16 nibble bytes. Output byte j < 8 pairs elements 2j and 2j + 1, the low nibbles of input bytes 2j and
// 2j + 1; byte j >= 8 pairs elements 2j and 2j + 1 from 16 on, their high nibbles. Taken as the 8 little-endian
// 16-bit pairs (p = byte 2j | byte 2j + 1 << 8): low output (p & 0xf) | (p >> 4 & 0xf0), high (p >> 4 & 0xf) |
// (p >> 8 & 0xf0), done four pairs at a time in 64-bit words.
void Nibbles(const uint8_t* in, uint8_t* out) {
  for (int half = 0; half < 2; ++half) {
    uint64_t p;
    std::memcpy(&p, in + 8 * half, 8);
    const uint64_t lo = (p & 0x000f000f000f000full) | (p >> 4 & 0x00f000f000f000f0ull);
    const uint64_t hi = (p >> 4 & 0x000f000f000f000full) | (p >> 8 & 0x00f000f000f000f0ull);
    for (int k = 0; k < 4; ++k) {  // each 16-bit lane holds one output byte in its low 8 bits
      out[4 * half + k] = static_cast<uint8_t>(lo >> (16 * k));
      out[8 + 4 * half + k] = static_cast<uint8_t>(hi >> (16 * k));
    }
  }
}

}  // namespace

void Mxfp4FromGgml(const uint8_t* src, int64_t n, uint8_t* blocks, uint8_t* scales) {
  const std::shared_ptr<ThreadPool> pool = ThreadPool::Global();
  Job job;
  job.tasks.assign(1, std::vector<std::vector<int64_t>>(pool->nodes()));
  const int64_t tasks = (n + kBlocksPerTask - 1) / kBlocksPerTask;
  for (int64_t task = 0; task < tasks; ++task) job.tasks[0][task % pool->nodes()].push_back(task);
  job.run = [&](int64_t task) {
    const int64_t end = std::min(n, (task + 1) * kBlocksPerTask);
    for (int64_t b = task * kBlocksPerTask; b < end; ++b) {
      scales[b] = src[17 * b];
      Nibbles(src + 17 * b + 1, blocks + 16 * b);
    }
  };
  const std::string error = pool->Run(job);
  if (!error.empty()) throw std::runtime_error("rebuilding MXFP4 blocks: " + error);
}

}  // namespace hybridjit
