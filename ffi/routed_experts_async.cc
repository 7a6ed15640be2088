#include "routed_experts_async.h"

#include <string>

#include "expert_job.h"

namespace hybridjit {
namespace {

namespace ffi = xla::ffi;

ffi::Error SubmitCpu(ffi::AnyBuffer x, ffi::AnyBuffer ids, ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> pending,
                     ffi::Result<ffi::AnyBuffer> /*x_pass: aliases x*/, int64_t layer_id, int64_t /*slot*/) {
  if (ffi::Error error = CheckJobOperands(layer_id, x, ids, weights, *pending); error.failure()) return error;
  return RunExpertJob(JobOnHostBuffers(layer_id, x, ids, weights, *pending));
}

// On the host the result is already in `pending`, which the result aliases.
ffi::Error WaitCpu(ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>, ffi::Result<ffi::AnyBuffer>, int64_t,
                   int64_t) {
  return ffi::Error::Success();
}

}  // namespace
}  // namespace hybridjit

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridjitRoutedExpertsSubmitCpu, hybridjit::SubmitCpu,
                              hybridjit::BindRoutedExpertsSubmit(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridjitRoutedExpertsWaitCpu, hybridjit::WaitCpu,
                              hybridjit::BindRoutedExpertsWait(xla::ffi::Ffi::Bind()));
