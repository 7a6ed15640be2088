#include "cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>

namespace hybridjit {
namespace {

constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtileData = 18;

struct Cpuid {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};

Cpuid Query(unsigned leaf, unsigned subleaf) {
  Cpuid r;
  if (!__get_cpuid_count(leaf, subleaf, &r.eax, &r.ebx, &r.ecx, &r.edx)) return Cpuid{};
  return r;
}

bool Bit(unsigned word, int bit) { return (word >> bit) & 1u; }

uint64_t Xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t{hi} << 32) | lo;
}

struct Features {
  bool avx2 = false;
  bool avx512 = false;
  bool amx_cpu = false;  // the instructions exist and the OS saves the tile state
  bool amd = false;
};

Features Detect() {
  Features f;
  const Cpuid l0 = Query(0, 0);
  f.amd = l0.ebx == 0x68747541 && l0.edx == 0x69746e65 && l0.ecx == 0x444d4163;  // "AuthenticAMD"
  const Cpuid l1 = Query(1, 0);
  if (!Bit(l1.ecx, 27)) return f;  // OSXSAVE: without it XGETBV faults and nothing wide is enabled
  const uint64_t xcr0 = Xcr0();
  const bool os_avx = (xcr0 & 0x6) == 0x6;            // SSE and AVX state
  const bool os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;    // XTILECFG, XTILEDATA
  const Cpuid l7 = Query(7, 0);
  const Cpuid l7s1 = Query(7, 1);
  f.avx2 = os_avx && Bit(l1.ecx, 12) /*FMA*/ && Bit(l1.ecx, 29) /*F16C*/ && Bit(l7.ebx, 5) /*AVX2*/;
  f.avx512 = f.avx2 && os_avx512 && Bit(l7.ebx, 16) /*F*/ && Bit(l7.ebx, 30) /*BW*/ && Bit(l7.ebx, 31) /*VL*/ &&
             Bit(l7.ebx, 17) /*DQ*/ && Bit(l7.ecx, 11) /*VNNI*/ && Bit(l7.ecx, 1) /*VBMI*/ &&
             Bit(l7s1.eax, 5) /*BF16*/;
  f.amx_cpu = f.avx512 && os_amx && Bit(l7.edx, 24) /*AMX-TILE*/ && Bit(l7.edx, 22) /*AMX-BF16*/ &&
              Bit(l7.edx, 25) /*AMX-INT8*/;
  return f;
}

const Features& Host() {
  static const Features features = Detect();
  return features;
}

// Asked once per process; the grant is process-wide and covers threads started before it.
bool AmxPermission() {
  static const bool granted = [] {
    if (!Host().amx_cpu) return false;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) != 0) return false;
    unsigned long mask = 0;
    return syscall(SYS_arch_prctl, kArchGetXcompPerm, &mask) == 0 && (mask >> kXfeatureXtileData) & 1u;
  }();
  return granted;
}

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (*end != '\0' || value < 0) {
    throw std::invalid_argument(std::string(name) + "='" + text + "' is not a non-negative integer");
  }
  return value;
}

std::atomic<int> selected{-1};
std::atomic<int64_t> amx_min_tokens{-1};  // -1: HYBRIDJIT_AMX_MIN_TOKENS not read yet
std::atomic<int64_t> gguf_tile_min_tokens{-1};  // -1: HYBRIDJIT_GGUF_TILE_MIN_TOKENS not read yet
constexpr int64_t kPrefetchUnset = -2;  // no SetWeightPrefetchOverride call: HYBRIDJIT_PREFETCH_BYTES decides
std::atomic<int64_t> prefetch_bytes{kPrefetchUnset};
std::mutex init_mutex;

void Check(CpuKernel kernel) {
  if (!CpuKernelSupported(kernel)) {
    throw std::invalid_argument(std::string("CPU kernel '") + CpuKernelName(kernel) +
                                "' is not supported by this host (best: " + CpuKernelName(BestCpuKernel()) + ")");
  }
}

}  // namespace

bool HostIsAmd() { return Host().amd; }

const char* CpuKernelName(CpuKernel kernel) {
  switch (kernel) {
    case CpuKernel::kGeneric:
      return "generic";
    case CpuKernel::kAvx2:
      return "avx2";
    case CpuKernel::kAvx512:
      return "avx512";
    case CpuKernel::kAmx:
      return "amx";
  }
  return "unknown";
}

CpuKernel ParseCpuKernel(const std::string& name) {
  for (CpuKernel k : {CpuKernel::kGeneric, CpuKernel::kAvx2, CpuKernel::kAvx512, CpuKernel::kAmx}) {
    if (name == CpuKernelName(k)) return k;
  }
  throw std::invalid_argument("unknown CPU kernel '" + name + "' (expected generic, avx2, avx512 or amx)");
}

bool CpuKernelSupported(CpuKernel kernel) {
  switch (kernel) {
    case CpuKernel::kGeneric:
      return true;
    case CpuKernel::kAvx2:
      return Host().avx2;
    case CpuKernel::kAvx512:
      return Host().avx512;
    case CpuKernel::kAmx:
      return AmxPermission();
  }
  return false;
}

CpuKernel BestCpuKernel() {
  for (CpuKernel k : {CpuKernel::kAmx, CpuKernel::kAvx512, CpuKernel::kAvx2}) {
    if (CpuKernelSupported(k)) return k;
  }
  return CpuKernel::kGeneric;
}

CpuKernel SelectedCpuKernel() {
  int value = selected.load(std::memory_order_acquire);
  if (value >= 0) return static_cast<CpuKernel>(value);
  std::lock_guard<std::mutex> guard(init_mutex);
  value = selected.load(std::memory_order_relaxed);
  if (value >= 0) return static_cast<CpuKernel>(value);
  const char* env = std::getenv("HYBRIDJIT_CPU_KERNEL");
  CpuKernel kernel = BestCpuKernel();
  if (env && *env) {
    kernel = ParseCpuKernel(env);
    Check(kernel);
  }
  selected.store(static_cast<int>(kernel), std::memory_order_release);
  return kernel;
}

void SetCpuKernel(CpuKernel kernel) {
  Check(kernel);
  std::lock_guard<std::mutex> guard(init_mutex);
  selected.store(static_cast<int>(kernel), std::memory_order_release);
}

namespace {

// A tokens-per-expert threshold override: set, or else read once from `variable` (0 when unset).
int64_t MinTokensOverride(std::atomic<int64_t>& slot, const char* variable) {
  int64_t value = slot.load(std::memory_order_relaxed);
  if (value >= 0) return value;
  value = EnvInt(variable, 0);
  int64_t expected = -1;
  slot.compare_exchange_strong(expected, value);
  return slot.load(std::memory_order_relaxed);
}

void SetMinTokens(std::atomic<int64_t>& slot, int64_t tokens, const char* name) {
  if (tokens < 0) throw std::invalid_argument(std::string(name) + " must be >= 0 (0: the measured defaults)");
  slot.store(tokens, std::memory_order_relaxed);
}

}  // namespace

int64_t AmxMinTokensOverride() { return MinTokensOverride(amx_min_tokens, "HYBRIDJIT_AMX_MIN_TOKENS"); }

int64_t GgufTileMinTokensOverride() {
  return MinTokensOverride(gguf_tile_min_tokens, "HYBRIDJIT_GGUF_TILE_MIN_TOKENS");
}

int64_t WeightPrefetchOverride() {
  static const int64_t from_env = EnvInt("HYBRIDJIT_PREFETCH_BYTES", -1);
  const int64_t value = prefetch_bytes.load(std::memory_order_relaxed);
  return value == kPrefetchUnset ? from_env : value;
}

void SetWeightPrefetchOverride(int64_t bytes) {
  if (bytes < -1) throw std::invalid_argument("prefetch bytes must be >= 0, or -1 for the default");
  prefetch_bytes.store(bytes, std::memory_order_relaxed);
}

void SetAmxMinTokens(int64_t tokens) { SetMinTokens(amx_min_tokens, tokens, "amx_min_tokens"); }

void SetGgufTileMinTokens(int64_t tokens) { SetMinTokens(gguf_tile_min_tokens, tokens, "gguf_tile_min_tokens"); }

}  // namespace hybridjit
