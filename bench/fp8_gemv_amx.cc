// What bounds one-token FP8 decode on a core: the GEMV loop of ffi/expert_kernel_avx512.cc (FP8 expanded to
// bfloat16 by the kernel's own shifts, ffi/fp8_shift_expansion.h; two vdpbf16ps per 64 codes per row; scale
// per 128 columns) outside the operator, with 4, 8 or 16 rows streamed at once, against an AMX variant that
// takes the multiply-adds off the vector ports: 16 rows x 64 codes expanded into two bf16 A tiles in a
// double-buffered L1 staging area, TDPBF16PS against one-column B tiles of the packed activations, C tiles
// stored and scaled once per 128 columns. Each runs with its rows in L2 (32 rows of 7168, repeated: the
// arithmetic ceiling) on one thread and on all, and from memory on all threads (2 KB software prefetch), next
// to a plain read of the same buffers. Needs AVX-512 BF16 and AMX (Sapphire Rapids or later):
//
//     g++ -O2 -std=c++17 bench/fp8_gemv_amx.cc -o /tmp/fp8_gemv_amx -lpthread && /tmp/fp8_gemv_amx
//
// Ends with one JSON line: the best of two rounds per case, and each all-thread L2 rate over the memory
// read rate of the same run (above 1: the arithmetic could keep up with memory if it overlapped perfectly).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "../ffi/fp8_shift_expansion.h"

using hybridjit::ExpandFp8ByShifts;

#define T __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// AVX-512: R rows per tile, one accumulator per row, scale per 128 columns (fmadd), like the real kernel.
template <int R>
T __attribute__((noinline)) float avx(const uint8_t* w, long rows, long cols, const uint16_t* x, const float* sc, long pf) {
  __m512 tot = _mm512_setzero_ps();
  for (long r0 = 0; r0 < rows; r0 += R) {
    const uint8_t* rp[R];
    for (int r = 0; r < R; r++) rp[r] = w + (r0 + r) * cols;
    __m512 total[R];
    for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
    for (long b = 0; b < cols; b += 128) {
      __m512 acc[R];
      for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
      for (long c = b; c < b + 128; c += 64) {
        if (pf) for (int r = 0; r < R; r++) _mm_prefetch((const char*)rp[r] + c + pf, _MM_HINT_T0);
        __m512i xf = _mm512_load_si512(x + c), xs = _mm512_load_si512(x + c + 32);
        for (int r = 0; r < R; r++) {
          __m512i f, s;
          ExpandFp8ByShifts(_mm512_load_si512(rp[r] + c), &f, &s);
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)f, (__m512bh)xf);
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)s, (__m512bh)xs);
        }
      }
      const __m512 scale = _mm512_set1_ps(sc[b / 128]);
      for (int r = 0; r < R; r++) total[r] = _mm512_fmadd_ps(acc[r], scale, total[r]);
    }
    for (int r = 0; r < R; r++) tot = _mm512_add_ps(tot, total[r]);
  }
  return _mm512_reduce_add_ps(tot);
}

// The read floor of the same buffers: a plain sum.
T __attribute__((noinline)) float plain(const uint8_t* w, long rows, long cols, const uint16_t*, const float*, long) {
  __m512i a = _mm512_setzero_si512(), b = a;
  for (long i = 0; i < rows * cols; i += 128) {
    a = _mm512_add_epi32(a, _mm512_load_si512(w + i));
    b = _mm512_add_epi32(b, _mm512_load_si512(w + i + 64));
  }
  return (float)_mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (16 rows x 1 float; 0/1 for even blocks, 2/3 for odd), 4-5: A (16 x 32 bf16), 6-7: B (16 x 2 bf16).
T static void configure() {
  TileConfig c;
  for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = (t >= 4 && t < 6) ? 64 : 4; }
  _tile_loadconfig(&c);
}

// One 128-column scale block of 16 rows into C tiles 2 * Blk and 2 * Blk + 1, then total += scale * C. The C
// tiles are zeroed once stored (ldtilecfg zeroes every tile before the first block).
template <int Blk>
T static inline __attribute__((always_inline)) void amx_block(const uint8_t* const* rp, long b, const uint16_t* x, long pf,
                                                             uint16_t (*stage)[2][16][32], long& step, float scale,
                                                             __m512* total) {
  alignas(64) float cbuf[32];
  for (long c = b; c < b + 128; c += 64) {
    uint16_t (*st)[16][32] = stage[step++ & 1];
    for (int m = 0; m < 16; m++) {
      if (pf) _mm_prefetch((const char*)rp[m] + c + pf, _MM_HINT_T0);
      __m512i f, s;
      ExpandFp8ByShifts(_mm512_load_si512(rp[m] + c), &f, &s);
      _mm512_store_si512(st[0][m], f);
      _mm512_store_si512(st[1][m], s);
    }
    _tile_loadd(4, st[0], 64);
    _tile_loadd(5, st[1], 64);
    _tile_loadd(6, x + c, 4);
    _tile_loadd(7, x + c + 32, 4);
    if constexpr (Blk == 0) {  // the tile macros take literal register numbers
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 7);
    } else {
      _tile_dpbf16ps(2, 4, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  if constexpr (Blk == 0) {
    _tile_stored(0, cbuf, 4);
    _tile_stored(1, cbuf + 16, 4);
    _tile_zero(0);
    _tile_zero(1);
  } else {
    _tile_stored(2, cbuf, 4);
    _tile_stored(3, cbuf + 16, 4);
    _tile_zero(2);
    _tile_zero(3);
  }
  *total = _mm512_fmadd_ps(_mm512_add_ps(_mm512_load_ps(cbuf), _mm512_load_ps(cbuf + 16)), _mm512_set1_ps(scale), *total);
}

T __attribute__((noinline)) float amx(const uint8_t* w, long rows, long cols, const uint16_t* x, const float* sc, long pf) {
  alignas(64) static thread_local uint16_t stage[2][2][16][32];
  configure();
  __m512 tot = _mm512_setzero_ps();
  long step = 0;
  for (long r0 = 0; r0 < rows; r0 += 16) {
    const uint8_t* rp[16];
    for (int r = 0; r < 16; r++) rp[r] = w + (r0 + r) * cols;
    for (long b = 0; b < cols; b += 256) {  // two 128-column blocks: C tiles 0/1, then 2/3
      amx_block<0>(rp, b, x, pf, stage, step, sc[b / 128], &tot);
      amx_block<1>(rp, b + 128, x, pf, stage, step, sc[b / 128 + 1], &tot);
    }
  }
  _tile_release();
  return _mm512_reduce_add_ps(tot);
}

typedef float (*Fn)(const uint8_t*, long, long, const uint16_t*, const float*, long);

int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    printf("no AMX on this CPU (or the kernel refused its state)\n");
    return 1;
  }
  const long cols = 7168;
  uint16_t* x = (uint16_t*)aligned_alloc(64, cols * 2);
  float* sc = (float*)aligned_alloc(64, cols / 128 * 4);
  srand(1);
  for (long i = 0; i < cols; i++) {
    const float v = (rand() % 2001 - 1000) / 1000.0f;
    uint32_t u;
    memcpy(&u, &v, 4);
    x[i] = u >> 16;
  }
  for (long i = 0; i < cols / 128; i++) sc[i] = 1.0f + (i % 7) * 0.25f;
  double check;
  {  // the AVX-512 and AMX loops compute the same sums
    const long rows = 64;
    uint8_t* w = (uint8_t*)aligned_alloc(64, rows * cols);
    for (long i = 0; i < rows * cols; i++) w[i] = (uint8_t)(rand() % 256) | 8;  // a normal exponent
    const float a = avx<4>(w, rows, cols, x, sc, 0), b = amx(w, rows, cols, x, sc, 0);
    check = std::fabs(a - b) / std::fabs(a);
    printf("AVX-512 and AMX sums agree to %.1e (relative)\n", check);
    free(w);
    if (check > 1e-4) return 1;
  }
  struct Variant { const char* name; Fn fn; } variants[] = {
      {"read", plain}, {"avx512_4row", avx<4>}, {"avx512_8row", avx<8>}, {"avx512_16row", avx<16>}, {"amx_16row", amx}};
  const char* modes[] = {"l2_1thread", "l2_all", "memory_all"};
  const int nt = std::thread::hardware_concurrency();
  std::map<std::string, double> best;  // "variant mode" -> GB/s
  for (int mode = 0; mode < 3; mode++) {
    const int threads = mode == 0 ? 1 : nt;
    const long rows = mode < 2 ? 32 : (256L << 20) / cols / 32 * 32, reps = mode < 2 ? 20000 : 4;
    std::vector<uint8_t*> bufs(threads);
    for (int t = 0; t < threads; t++) {
      bufs[t] = (uint8_t*)aligned_alloc(64, rows * cols);
      for (long i = 0; i < rows * cols; i++) bufs[t][i] = (uint8_t)((i * 37) % 255) | 8;
    }
    for (int round = 0; round < 2; round++) {
      for (const Variant& v : variants) {
        std::atomic<int> go{0};
        std::vector<std::thread> pool;
        std::vector<double> secs(threads);
        for (int t = 0; t < threads; t++) {
          pool.emplace_back([&, t] {
            cpu_set_t cs;
            CPU_ZERO(&cs);
            CPU_SET(t, &cs);
            sched_setaffinity(0, sizeof cs, &cs);
            syscall(SYS_arch_prctl, 0x1023, 18);
            while (!go.load()) {}
            const double start = now();
            float sink = 0;
            for (long k = 0; k < reps; k++) sink += v.fn(bufs[t], rows, cols, x, sc, mode == 2 ? 2048 : 0);
            secs[t] = now() - start;
            if (sink == 1.5f) printf(" ");  // keeps the calls
          });
        }
        go = 1;
        for (auto& h : pool) h.join();
        double slowest = 0;
        for (double s : secs) slowest = std::max(slowest, s);
        const double gbps = (double)threads * reps * rows * cols / slowest / 1e9;
        printf("%-13s %-10s threads %2d: %7.1f GB/s\n", v.name, modes[mode], threads, gbps);
        double& b = best[std::string(v.name) + " " + modes[mode]];
        b = std::max(b, gbps);
      }
    }
    for (auto b : bufs) free(b);
  }
  const auto at = [&](const char* variant, const char* mode) { return best[std::string(variant) + " " + mode]; };
  const double floor = at("read", "memory_all");
  std::string json = "{\"bench\": \"fp8_gemv_amx\", \"cols\": 7168, \"threads\": " + std::to_string(nt) +
                     ", \"read_gbps\": " + std::to_string(floor) + ", \"results\": [";
  for (const Variant& v : variants) {
    if (std::string(v.name) == "read") continue;
    char item[400];
    snprintf(item, sizeof item,
             "%s{\"variant\": \"%s\", \"l2_1thread_gbps\": %.1f, \"l2_all_gbps\": %.1f, \"memory_all_gbps\": %.1f, "
             "\"l2_all_over_read\": %.3f, \"memory_all_over_read\": %.3f}",
             json.back() == '[' ? "" : ", ", v.name, at(v.name, "l2_1thread"), at(v.name, "l2_all"),
             at(v.name, "memory_all"), at(v.name, "l2_all") / floor, at(v.name, "memory_all") / floor);
    json += item;
  }
  printf("%s]}\n", json.c_str());
}
