#include "expert_job.h"

#include <string>

#include "moe_operator.h"
#include "routed_experts_handler.h"
#include "weight_bank.h"

namespace hybridjit {

namespace ffi = xla::ffi;

ffi::Error RunExpertJob(const ExpertJob& job) {
  const LayerLease lease = WeightBank::Global().Find(job.layer_id);
  if (!lease) {
    return ffi::Error(ffi::ErrorCode::kNotFound, "hybridjit_routed_experts: unknown layer id " +
                                                     std::to_string(job.layer_id) +
                                                     " (closed, or never registered in this process)");
  }
  const LayerWeights& layer = lease.weights();
  if (job.hidden != layer.hidden) {
    return ffi::Error::InvalidArgument("hybridjit_routed_experts (layer " + std::to_string(job.layer_id) +
                                       "): x has hidden size " + std::to_string(job.hidden) +
                                       " but the layer has hidden size " + std::to_string(layer.hidden));
  }
  if (ffi::Error error = CheckExpertIds(job.ids, job.tokens * job.top_k, layer.n_experts(), job.layer_id);
      error.failure()) {
    return error;
  }
  MoeCall call;
  call.x = job.x;
  call.x_bf16 = job.bf16;
  call.ids = job.ids;
  call.weights = job.weights;
  call.tokens = job.tokens;
  call.top_k = job.top_k;
  call.y = job.y;
  call.y_bf16 = job.bf16;
  const std::string error = RunRoutedExperts(layer, call);
  if (!error.empty()) {
    return ffi::Error::Internal("hybridjit_routed_experts (layer " + std::to_string(job.layer_id) + "): " + error);
  }
  return ffi::Error::Success();
}

}  // namespace hybridjit
