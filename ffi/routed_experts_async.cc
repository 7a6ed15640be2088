#include "routed_experts_async.h"

#include <string>

#include "expert_job.h"
#include "routed_experts_handler.h"
#include "weight_bank.h"

namespace hybridjit {
namespace {

namespace ffi = xla::ffi;

ffi::Error SubmitCpu(ffi::AnyBuffer x, ffi::AnyBuffer ids, ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> pending,
                     ffi::Result<ffi::AnyBuffer> /*x_pass: aliases x*/, int64_t layer_id, int64_t /*slot*/) {
  {
    const LayerLease lease = WeightBank::Global().Find(layer_id);
    if (!lease) {
      return ffi::Error(ffi::ErrorCode::kNotFound,
                        "hybridjit_routed_experts: unknown layer id " + std::to_string(layer_id));
    }
    if (ffi::Error error = CheckRoutedExpertsOperands(lease.weights(), layer_id, x, ids, weights, *pending);
        error.failure()) {
      return error;
    }
  }
  ExpertJob job;
  job.layer_id = layer_id;
  job.bf16 = x.element_type() == ffi::DataType::BF16;
  job.x = x.untyped_data();
  job.ids = static_cast<const int32_t*>(ids.untyped_data());
  job.weights = static_cast<const float*>(weights.untyped_data());
  job.tokens = x.dimensions()[0];
  job.top_k = ids.dimensions()[1];
  job.hidden = x.dimensions()[1];
  job.y = pending->untyped_data();
  return RunExpertJob(job);
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
