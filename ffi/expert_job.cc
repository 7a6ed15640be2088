#include "expert_job.h"

#include <string>

#include "moe_operator.h"
#include "routed_experts_handler.h"
#include "weight_bank.h"

namespace hybridjit {

namespace ffi = xla::ffi;

namespace {

ffi::Error UnknownLayer(int64_t layer_id) {
  return ffi::Error(ffi::ErrorCode::kNotFound, "hybridjit_routed_experts: unknown layer id " +
                                                   std::to_string(layer_id) +
                                                   " (closed, or never registered in this process)");
}

}  // namespace

ffi::Error CheckJobOperands(int64_t layer_id, const ffi::AnyBuffer& x, const ffi::AnyBuffer& ids,
                            const ffi::AnyBuffer& weights, const ffi::AnyBuffer& result) {
  const LayerLease lease = WeightBank::Global().Find(layer_id);
  if (!lease) return UnknownLayer(layer_id);
  return CheckRoutedExpertsOperands(lease.weights(), layer_id, x, ids, weights, result);
}

ExpertJob JobOnHostBuffers(int64_t layer_id, const ffi::AnyBuffer& x, const ffi::AnyBuffer& ids,
                           const ffi::AnyBuffer& weights, ffi::AnyBuffer& result) {
  ExpertJob job;
  job.layer_id = layer_id;
  job.bf16 = x.element_type() == ffi::DataType::BF16;
  job.x = x.untyped_data();
  job.ids = static_cast<const int32_t*>(ids.untyped_data());
  job.weights = static_cast<const float*>(weights.untyped_data());
  job.tokens = x.dimensions()[0];
  job.top_k = ids.dimensions()[1];
  job.hidden = x.dimensions()[1];
  job.y = result.untyped_data();
  return job;
}

ffi::Error RunExpertJob(const ExpertJob& job) {
  const LayerLease lease = WeightBank::Global().Find(job.layer_id);
  if (!lease) return UnknownLayer(job.layer_id);
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
