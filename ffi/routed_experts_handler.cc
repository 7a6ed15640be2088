#include "routed_experts_handler.h"

#include <string>

#include "expert_job.h"

namespace hybridjit {
namespace {

namespace ffi = xla::ffi;

std::string DtypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::F64:
      return "float64";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    case ffi::DataType::U32:
      return "uint32";
    default:
      return "XLA dtype #" + std::to_string(static_cast<int>(dtype));
  }
}

std::string ShapeText(const ffi::AnyBuffer& buffer) {
  std::string text = "[";
  for (int64_t d : buffer.dimensions()) text += (text.size() > 1 ? ", " : "") + std::to_string(d);
  return text + "]";
}

ffi::Error Invalid(int64_t layer_id, const std::string& what) {
  return ffi::Error::InvalidArgument("hybridjit_routed_experts (layer " + std::to_string(layer_id) +
                                     "): " + what);
}

ffi::Error RoutedExpertsCpu(ffi::AnyBuffer x, ffi::AnyBuffer ids, ffi::AnyBuffer weights,
                            ffi::Result<ffi::AnyBuffer> y, int64_t layer_id) {
  if (ffi::Error error = CheckJobOperands(layer_id, x, ids, weights, *y); error.failure()) return error;
  return RunExpertJob(JobOnHostBuffers(layer_id, x, ids, weights, *y));
}

}  // namespace

ffi::Error CheckRoutedExpertsOperands(const LayerWeights& layer, int64_t layer_id, const ffi::AnyBuffer& x,
                                      const ffi::AnyBuffer& ids, const ffi::AnyBuffer& weights,
                                      const ffi::AnyBuffer& y) {
  if (x.element_type() != ffi::DataType::F32 && x.element_type() != ffi::DataType::BF16) {
    return Invalid(layer_id, "x must be float32 or bfloat16, got " + DtypeName(x.element_type()));
  }
  if (ids.element_type() != ffi::DataType::S32) {
    return Invalid(layer_id, "topk_ids must be int32, got " + DtypeName(ids.element_type()));
  }
  if (weights.element_type() != ffi::DataType::F32) {
    return Invalid(layer_id, "topk_weights must be float32, got " + DtypeName(weights.element_type()));
  }
  if (y.element_type() != x.element_type()) {
    return Invalid(layer_id, "the result must have the dtype of x, got " + DtypeName(y.element_type()));
  }
  if (x.dimensions().size() != 2 || ids.dimensions().size() != 2 || weights.dimensions().size() != 2 ||
      y.dimensions().size() != 2) {
    return Invalid(layer_id, "x, topk_ids, topk_weights and the result must be 2-D, got x " + ShapeText(x) +
                                 ", topk_ids " + ShapeText(ids) + ", topk_weights " + ShapeText(weights) +
                                 ", result " + ShapeText(y));
  }
  if (x.dimensions()[1] != layer.hidden) {
    return Invalid(layer_id, "x has hidden size " + std::to_string(x.dimensions()[1]) +
                                 " but the layer has hidden size " + std::to_string(layer.hidden));
  }
  const int64_t tokens = x.dimensions()[0];
  if (ids.dimensions()[0] != tokens || weights.dimensions()[0] != ids.dimensions()[0] ||
      weights.dimensions()[1] != ids.dimensions()[1] || y.dimensions()[0] != tokens ||
      y.dimensions()[1] != layer.hidden) {
    return Invalid(layer_id, "shapes disagree: x " + ShapeText(x) + ", topk_ids " + ShapeText(ids) +
                                 ", topk_weights " + ShapeText(weights) + ", result " + ShapeText(y));
  }
  return ffi::Error::Success();
}

ffi::Error CheckExpertIds(const int32_t* ids, int64_t count, int64_t n_experts, int64_t layer_id) {
  for (int64_t i = 0; i < count; ++i) {
    if (ids[i] < 0 || ids[i] >= n_experts) {
      return ffi::Error(ffi::ErrorCode::kOutOfRange,
                        "hybridjit_routed_experts (layer " + std::to_string(layer_id) + "): expert id " +
                            std::to_string(ids[i]) + " out of range [0, " + std::to_string(n_experts) +
                            ") at topk_ids flat index " + std::to_string(i));
    }
  }
  return ffi::Error::Success();
}

}  // namespace hybridjit

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridjitRoutedExpertsCpu, hybridjit::RoutedExpertsCpu,
                              hybridjit::BindRoutedExperts(xla::ffi::Ffi::Bind()));
