// XLA FFI custom call "hybridjit_routed_experts": y = routed_experts(x, topk_ids, topk_weights)
// over the weight-bank layer named by the int64 attribute `layer`.
#pragma once

#include <cstdint>
#include <utility>

#include "weight_bank.h"
#include "xla/ffi/api/ffi.h"

namespace hybridjit {

// Operands and attributes shared by the handler of every platform; a device handler prepends its
// context (e.g. the platform stream) to the same binding.
template <typename Binding>
auto BindRoutedExperts(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()   // x [T, H] f32 or bf16
      .template Arg<ffi::AnyBuffer>()   // topk_ids [T, K] s32
      .template Arg<ffi::AnyBuffer>()   // topk_weights [T, K] f32
      .template Ret<ffi::AnyBuffer>()   // y [T, H], dtype of x
      .template Attr<int64_t>("layer");
}

// Checks operand dtypes and shapes against the layer (metadata only, no data is read).
xla::ffi::Error CheckRoutedExpertsOperands(const LayerWeights& layer, int64_t layer_id,
                                           const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& ids,
                                           const xla::ffi::AnyBuffer& weights, const xla::ffi::AnyBuffer& y);

// Checks that every routed expert id is in [0, n_experts); reads host memory.
xla::ffi::Error CheckExpertIds(const int32_t* ids, int64_t count, int64_t n_experts, int64_t layer_id);

}  // namespace hybridjit

// Host (XLA:CPU) handler: computes synchronously; the calling thread works with the CPU thread pool
// (moe_operator.h) and returns when y is complete.
XLA_FFI_DECLARE_HANDLER_SYMBOL(HybridjitRoutedExpertsCpu);
