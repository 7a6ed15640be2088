#include "expert_job.h"

#include <string>
#include <vector>

#include "expert_kernels.h"
#include "numeric_formats.h"
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
  // The kernels work in float32; bf16 activations are widened exactly and the result rounded once.
  const size_t count = static_cast<size_t>(job.tokens * job.hidden);
  std::vector<float> x_wide, y_wide;
  RoutedExpertsArgs args;
  args.ids = job.ids;
  args.weights = job.weights;
  args.tokens = job.tokens;
  args.top_k = job.top_k;
  if (job.bf16) {
    const auto* x_bits = static_cast<const uint16_t*>(job.x);
    x_wide.resize(count);
    for (size_t i = 0; i < count; ++i) x_wide[i] = Bf16BitsToFloat(x_bits[i]);
    y_wide.resize(count);
    args.x = x_wide.data();
    args.y = y_wide.data();
  } else {
    args.x = static_cast<const float*>(job.x);
    args.y = static_cast<float*>(job.y);
  }
  RoutedExpertsGeneric(layer, args);
  if (job.bf16) {
    auto* y_bits = static_cast<uint16_t*>(job.y);
    for (size_t i = 0; i < count; ++i) y_bits[i] = FloatToBf16Bits(y_wide[i]);
  }
  return ffi::Error::Success();
}

}  // namespace hybridjit
