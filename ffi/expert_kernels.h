// CPU implementations of the routed-expert MoE operator.
#pragma once

#include <cstdint>

#include "weight_bank.h"

namespace hybridjit {

// y[t] = sum_k weights[t,k] * down_e(silu(gate_e x[t]) * up_e x[t]) with e = ids[t,k], for
// x and y row-major [tokens, hidden], ids and weights row-major [tokens, top_k].
// The caller has checked that every id is in [0, n_experts).
struct RoutedExpertsArgs {
  const float* x = nullptr;
  const int32_t* ids = nullptr;
  const float* weights = nullptr;
  int64_t tokens = 0;
  int64_t top_k = 0;
  float* y = nullptr;
};

// Portable reference: always compiled, single-threaded, float32 accumulation. ISA-specific kernels
// are tested against it.
void RoutedExpertsGeneric(const LayerWeights& layer, const RoutedExpertsArgs& args);

}  // namespace hybridjit
