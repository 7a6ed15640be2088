// AMX ceilings for the prefill GEMM's tile loop (ffi/expert_kernel_amx.cc, SweepStrip; its multiply step,
// ffi/amx_tile_multiply.h, is the kernel's own): 2 x 2 C tiles,
// two A (weight) and two B (activation) tiles loaded per k-step, four tile multiplies. Each variant runs
// on every CPU of the process at once, one pinned thread per CPU:
//   peak     the four multiplies alone, A and B never reloaded: the instruction rate;
//   l1       A and B reloaded every k-step from one 4 KB set (always in L1);
//   sweep    A and B reloaded from the sweep's own working set: a 128-row x 512-element strip (128 KB of
//            bf16 tiles) against 512 tokens (512 KB), C loaded and stored per 16 k-steps, as SweepStrip
//            does with 512 tokens per expert;
//   sweep_pf the same with the tiles of the k-step 2 ahead prefetched into L1 (64 prefetches per k-step).
// If `sweep` is well under `l1`, the loop is bound by where its tiles come from, not by the multiplies.
// Needs AMX (Sapphire Rapids or later):
//
//     g++ -O2 -march=native bench/amx_tiles.cc -o /tmp/amx_tiles -lpthread && /tmp/amx_tiles
//
// Ends with one JSON line.
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "../ffi/amx_tile_multiply.h"

namespace {

constexpr int kTile = 1024;  // bytes: 16 rows x 64
constexpr int kKSteps = 16;  // a strip's k-steps (512 bf16 input elements)
constexpr int kRowTiles = 8;  // 128 weight rows
constexpr int kTokenTiles = 32;  // 512 tokens

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void ConfigureTiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// Per thread: buffers of the sweep's size; returns the tile multiplies it ran.
struct Buffers {
  std::vector<char> strip = std::vector<char>(kRowTiles * kKSteps * kTile + 64, 1);
  std::vector<char> b = std::vector<char>(kTokenTiles * kKSteps * kTile + 64, 1);
  std::vector<float> c = std::vector<float>(kRowTiles * 16 * kTokenTiles * 16 + 16, 0.0f);
  const char* Strip() const { return Aligned(strip.data()); }
  const char* B() const { return Aligned(b.data()); }
  static const char* Aligned(const char* p) { return p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64; }
};

template <bool kInt8>
int64_t Peak(int64_t rounds) {
  for (int64_t i = 0; i < rounds * kKSteps; ++i) hybridjit::MultiplyTiles2x2<kInt8>();
  return rounds * kKSteps * 4;
}

template <bool kInt8>
int64_t L1(const Buffers& buf, int64_t rounds) {
  const char* a = buf.Strip();
  for (int64_t i = 0; i < rounds * kKSteps; ++i) {
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a + kTile, 64);
    _tile_loadd(6, a + 2 * kTile, 64);
    _tile_loadd(7, a + 3 * kTile, 64);
    hybridjit::MultiplyTiles2x2<kInt8>();
  }
  return rounds * kKSteps * 4;
}

inline void PrefetchTile(const char* tile) {
  for (int line = 0; line < kTile; line += 64) _mm_prefetch(tile + line, _MM_HINT_T0);
}

template <bool kInt8, bool kPrefetch>
int64_t Sweep(Buffers& buf, int64_t rounds) {
  const int64_t out_stride = kTokenTiles * 16;
  int64_t multiplies = 0;
  for (int64_t round = 0; round < rounds; ++round) {
    for (int tb = 0; tb < kTokenTiles; tb += 2) {
      const char* b0 = buf.B() + tb * kKSteps * kTile;
      const char* b1 = b0 + kKSteps * kTile;
      for (int rt = 0; rt < kRowTiles; rt += 2) {
        const char* a0 = buf.Strip() + rt * kKSteps * kTile;
        const char* a1 = a0 + kKSteps * kTile;
        float* c = buf.c.data() + rt * 16 * out_stride + tb * 16;
        _tile_loadd(0, c, out_stride * 4);
        _tile_loadd(1, c + 16, out_stride * 4);
        _tile_loadd(2, c + 16 * out_stride, out_stride * 4);
        _tile_loadd(3, c + 16 * out_stride + 16, out_stride * 4);
        for (int ks = 0; ks < kKSteps; ++ks) {
          if constexpr (kPrefetch) {
            for (const char* tile : {a0, a1, b0, b1}) PrefetchTile(tile + (ks + 2) * kTile);
          }
          _tile_loadd(4, a0 + ks * kTile, 64);
          _tile_loadd(5, a1 + ks * kTile, 64);
          _tile_loadd(6, b0 + ks * kTile, 64);
          _tile_loadd(7, b1 + ks * kTile, 64);
          hybridjit::MultiplyTiles2x2<kInt8>();
        }
        _tile_stored(0, c, out_stride * 4);
        _tile_stored(1, c + 16, out_stride * 4);
        _tile_stored(2, c + 16 * out_stride, out_stride * 4);
        _tile_stored(3, c + 16 * out_stride + 16, out_stride * 4);
        multiplies += kKSteps * 4;
      }
    }
  }
  return multiplies;
}

// Runs `variant` on one pinned thread per CPU of the process, all started together; TFLOP/s of them all.
template <bool kInt8>
double RunAll(const std::string& variant, const std::vector<int>& cpus) {
  const int64_t rounds = variant.rfind("sweep", 0) == 0 ? 40 : 40 * (kTokenTiles / 2) * (kRowTiles / 2);
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::atomic<int64_t> multiplies{0};
  std::vector<std::thread> threads;
  for (int cpu : cpus) {
    threads.emplace_back([&, cpu] {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu, &set);
      pthread_setaffinity_np(pthread_self(), sizeof set, &set);
      Buffers buf;
      ConfigureTiles();
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      _tile_loadd(4, buf.Strip(), 64);
      _tile_loadd(5, buf.Strip(), 64);
      _tile_loadd(6, buf.B(), 64);
      _tile_loadd(7, buf.B(), 64);
      Sweep<kInt8, false>(buf, 1);  // warm the buffers into this core's caches
      ++ready;
      while (!go.load()) {
      }
      int64_t n = variant == "peak"    ? Peak<kInt8>(rounds)
                  : variant == "l1"    ? L1<kInt8>(buf, rounds)
                  : variant == "sweep" ? Sweep<kInt8, false>(buf, rounds)
                                       : Sweep<kInt8, true>(buf, rounds);
      multiplies += n;
      _tile_release();
    });
  }
  while (ready.load() < static_cast<int>(cpus.size())) {
  }
  const auto start = std::chrono::steady_clock::now();
  go = true;
  for (auto& t : threads) t.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double flops_per_multiply = 2.0 * 16 * 16 * (kInt8 ? 64 : 32);
  return multiplies.load() * flops_per_multiply / seconds / 1e12;
}

}  // namespace

int main() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) != 0) {
    std::fprintf(stderr, "AMX tile data not permitted on this host\n");
    return 1;
  }
  cpu_set_t mask;
  sched_getaffinity(0, sizeof mask, &mask);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &mask)) cpus.push_back(c);
  }
  std::string json = "{\"bench\": \"amx_tiles\", \"threads\": " + std::to_string(cpus.size()) + ", \"tflops\": {";
  for (const char* type : {"bf16", "int8"}) {
    for (const char* variant : {"peak", "l1", "sweep", "sweep_pf"}) {
      const bool int8 = std::string(type) == "int8";
      const double tflops = int8 ? RunAll<true>(variant, cpus) : RunAll<false>(variant, cpus);
      std::printf("%-5s %-6s %8.2f TFLOP/s (%zu threads)\n", type, variant, tflops, cpus.size());
      json += std::string(json.back() == '{' ? "" : ", ") + "\"" + type + "_" + variant + "\": " + std::to_string(tflops);
    }
  }
  std::printf("%s}}\n", json.c_str());
  return 0;
}
