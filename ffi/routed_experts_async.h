// The routed-experts call split in two, so XLA can schedule GPU work (the shared experts, the other
// micro-batch's attention) between handing the job to the CPU and taking its result back:
//
//   (pending, x_pass)    = hybridjit_routed_experts_submit(x, topk_ids, topk_weights)   x_pass aliases x
//   (y, other_pass)      = hybridjit_routed_experts_wait(pending, other)                y aliases pending
//
// The aliased pass-through operands are what order the program: whatever consumes x_pass runs after
// the submit, whatever produces `other` runs before the wait. On XLA:CPU the submit computes the
// result into `pending` and the wait does nothing; on CUDA the submit enqueues the copy to pinned
// staging and the doorbell, the wait enqueues the wait for the CPU and the copy back into `pending`.
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace hybridjit {

template <typename Binding>
auto BindRoutedExpertsSubmit(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()   // x [T, H] f32 or bf16
      .template Arg<ffi::AnyBuffer>()   // topk_ids [T, K] s32
      .template Arg<ffi::AnyBuffer>()   // topk_weights [T, K] f32
      .template Ret<ffi::AnyBuffer>()   // pending [T, H], dtype of x: the result, once waited for
      .template Ret<ffi::AnyBuffer>()   // x_pass, aliases x
      .template Attr<int64_t>("layer")
      .template Attr<int64_t>("slot");  // which in-flight job this is (one per micro-batch)
}

template <typename Binding>
auto BindRoutedExpertsWait(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()   // pending, from the submit
      .template Arg<ffi::AnyBuffer>()   // other: any buffer that must be computed before the wait
      .template Ret<ffi::AnyBuffer>()   // y, aliases pending
      .template Ret<ffi::AnyBuffer>()   // other_pass, aliases other
      .template Attr<int64_t>("slot")
      .template Attr<int64_t>("top_k");
}

}  // namespace hybridjit

XLA_FFI_DECLARE_HANDLER_SYMBOL(HybridjitRoutedExpertsSubmitCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HybridjitRoutedExpertsWaitCpu);
