// The fused routed-experts MoE operator on the CPU thread pool.
//
// y[t] = sum_k weights[t,k] * down_e(act(gate_e x[t], up_e x[t])), e = ids[t,k], with the layer's biases added to
// each projection and its activation (silu(g) * u, or the clamped SwiGLU: weight_bank.h), computed expert by
// expert (each weight row is read once per call whatever the number of tokens) in four phases of
// tasks (a thread starts a phase's tasks once every task of the previous phase has been taken):
//   1. per expert: pack the expert's tokens for its kernel (gather + convert/quantize, once); zero
//      the float32 accumulator.
//   2. gate and up of a slice of rows of one expert together (one matrix of twice the rows where the layer
//      interleaves them), biases and the activation fused. The task that
//      finishes an expert's last slice packs its activations for the down projection and releases
//      that expert: a per-expert barrier, no global one between gate/up and down.
//   3. down projection of a slice of hidden rows of one expert, times the routing weights, added
//      into y under a lock per row slice (experts sharing a token meet there).
//   4. for bfloat16 outputs, the float32 accumulator rounded to bfloat16.
// Experts run largest first and threads take tasks dynamically, so skewed prefill loads balance.
// With several NUMA nodes every expert's rows are split into one contiguous part per node, and a
// node's threads take its parts first: each node keeps reading (and, by first touch of memory-mapped
// checkpoints, holding) the same part of every expert.
#pragma once

#include <cstdint>
#include <string>

#include "weight_bank.h"

namespace hybridjit {

struct MoeCall {
  const void* x = nullptr;  // [tokens, hidden], float32 or bfloat16
  bool x_bf16 = false;
  const int32_t* ids = nullptr;       // [tokens, top_k], each in [0, n_experts) (checked by the caller)
  const float* weights = nullptr;     // [tokens, top_k]
  int64_t tokens = 0;
  int64_t top_k = 0;
  void* y = nullptr;  // [tokens, hidden], float32 or bfloat16
  bool y_bf16 = false;
};

// Runs on the global thread pool with the selected kernel family; returns "" or the error.
std::string RunRoutedExperts(const LayerWeights& layer, const MoeCall& call);

}  // namespace hybridjit
