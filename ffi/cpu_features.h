// What the host CPU can run, and which kernel family the routed experts use.
//
// The families are ordered: generic (portable C++, always there) < avx2 (AVX2 + FMA + F16C) < avx512
// (F, BW, VL, DQ, BF16, VNNI, VBMI: Sapphire Rapids and Zen 4 on; VBMI for the AMX kernels' FP8 table) <
// amx (AMX-TILE, BF16, INT8 on top of avx512). The best family the host supports is chosen once, from
// CPUID and XCR0; HYBRIDJIT_CPU_KERNEL overrides it at first use and SetCpuKernel at any time (tests).
// Choosing amx asks the kernel for the AMX tile state with arch_prctl(ARCH_REQ_XCOMP_PERM) first: without
// that permission the first tile instruction is SIGILL.
#pragma once

#include <cstdint>
#include <string>

namespace hybridjit {

enum class CpuKernel { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

const char* CpuKernelName(CpuKernel kernel);
// Throws std::invalid_argument naming the accepted values.
CpuKernel ParseCpuKernel(const std::string& name);

// Whether the host (CPU and OS) can run the family; for amx, also whether the OS granted the tile
// state to this process.
bool CpuKernelSupported(CpuKernel kernel);
CpuKernel BestCpuKernel();
// The vendor, where a tuning default differs by it (weight_prefetch.h).
bool HostIsAmd();

// The family in use: HYBRIDJIT_CPU_KERNEL if set, else the best. Throws std::invalid_argument (at the
// first call) if the variable names an unknown family or one the host cannot run.
CpuKernel SelectedCpuKernel();
// Throws std::invalid_argument if the host cannot run `kernel`.
void SetCpuKernel(CpuKernel kernel);

// With the amx family, experts with at least AmxMinTokens(layer) (expert_kernels.h) tokens in a call
// use the AMX kernels and the others the AVX-512 ones. HYBRIDJIT_AMX_MIN_TOKENS or SetAmxMinTokens
// sets one threshold for every layer; 0 (the default) leaves each layer the crossover measured for
// its kind of AMX kernel (bench/RESULTS.md).
int64_t AmxMinTokensOverride();
void SetAmxMinTokens(int64_t tokens);
// Likewise for the avx512 family's GGUF tile kernel (GgufTileMinTokens): HYBRIDJIT_GGUF_TILE_MIN_TOKENS or
// SetGgufTileMinTokens; 0 (the default) leaves the measured crossover.
int64_t GgufTileMinTokensOverride();
void SetGgufTileMinTokens(int64_t tokens);

// How far ahead (bytes, along each weight row) the AVX2 and AVX-512 kernels prefetch weights, for every format:
// HYBRIDJIT_PREFETCH_BYTES (read at first use) or SetWeightPrefetchOverride (0: no software prefetch);
// -1 (the default) leaves the distance measured best (weight_prefetch.h).
int64_t WeightPrefetchOverride();
void SetWeightPrefetchOverride(int64_t bytes);

}  // namespace hybridjit
