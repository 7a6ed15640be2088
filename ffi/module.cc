// Python module hybridjit._ffi: the weight bank and the FFI handler capsules. Private: it trusts
// hybridjit.ops.routed_experts to validate shapes and dtypes and to keep the weights alive.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "routed_experts_async.h"
#include "routed_experts_handler.h"
#include "weight_bank.h"
#ifdef HYBRIDJIT_WITH_CUDA
#include "gpu_handoff.h"
#endif

namespace nb = nanobind;

namespace hybridjit {
namespace {

WeightFormat ParseFormat(const std::string& name) {
  if (name == "f32") return WeightFormat::kF32;
  if (name == "bf16") return WeightFormat::kBf16;
  if (name == "fp8") return WeightFormat::kFp8E4M3Fn;
  throw std::invalid_argument("unknown weight format '" + name + "' (expected f32, bf16 or fp8)");
}

template <typename T>
const T* AsPointer(uintptr_t address) {
  return reinterpret_cast<const T*>(address);
}

// Addresses arrive as integers (numpy's ctypes.data) so that any host memory can be registered,
// whatever its dtype or owner; the scale lists are empty unless the format is fp8.
using Addresses = std::vector<uintptr_t>;

int64_t RegisterLayer(const std::string& format, int64_t hidden, int64_t inter, int64_t block_rows,
                      int64_t block_cols, const Addresses& gate, const Addresses& up, const Addresses& down,
                      const Addresses& gate_scale, const Addresses& up_scale, const Addresses& down_scale) {
  LayerWeights layer;
  layer.format = ParseFormat(format);
  layer.hidden = hidden;
  layer.inter = inter;
  layer.block_rows = block_rows;
  layer.block_cols = block_cols;
  const size_t n = gate.size();
  const bool fp8 = layer.format == WeightFormat::kFp8E4M3Fn;
  const size_t n_scales = fp8 ? n : 0;
  if (up.size() != n || down.size() != n || gate_scale.size() != n_scales || up_scale.size() != n_scales ||
      down_scale.size() != n_scales) {
    throw std::invalid_argument("pointer lists disagree in length");
  }
  layer.experts.resize(n);
  for (size_t e = 0; e < n; ++e) {
    ExpertWeights& w = layer.experts[e];
    w.gate = AsPointer<void>(gate[e]);
    w.up = AsPointer<void>(up[e]);
    w.down = AsPointer<void>(down[e]);
    if (fp8) {
      w.gate_scale = AsPointer<float>(gate_scale[e]);
      w.up_scale = AsPointer<float>(up_scale[e]);
      w.down_scale = AsPointer<float>(down_scale[e]);
    }
  }
  return WeightBank::Global().Add(std::move(layer));
}

bool UnregisterLayer(int64_t id) {
  // Waits for running kernels on this layer, which do not need the GIL.
  nb::gil_scoped_release release;
  return WeightBank::Global().Remove(id);
}

nb::dict KernelInfo() {
  nb::dict info;
  info["kernel"] = "generic";
  info["threads"] = 1;
  return info;
}

}  // namespace
}  // namespace hybridjit

NB_MODULE(_ffi, m) {
  using namespace hybridjit;
  m.doc() = "hybridjit C++ extension: routed-expert weight bank and XLA FFI handlers (private API).";
  m.def("register_layer", &RegisterLayer, nb::arg("format"), nb::arg("hidden"), nb::arg("inter"),
        nb::arg("block_rows"), nb::arg("block_cols"), nb::arg("gate"), nb::arg("up"), nb::arg("down"),
        nb::arg("gate_scale"), nb::arg("up_scale"), nb::arg("down_scale"),
        "Registers a layer from weight addresses; returns its id (never reused).");
  m.def("unregister_layer", &UnregisterLayer, nb::arg("id"),
        "Removes a layer once its running calls finish; False if the id is unknown.");
  m.def("registered_layer_ids", [] { return WeightBank::Global().Ids(); });
  m.def("kernel_info", &KernelInfo);
  m.def("routed_experts_cpu", [] { return nb::capsule(reinterpret_cast<void*>(&HybridjitRoutedExpertsCpu)); },
        "FFI handler capsule for platform 'cpu'.");
  m.def("routed_experts_submit_cpu",
        [] { return nb::capsule(reinterpret_cast<void*>(&HybridjitRoutedExpertsSubmitCpu)); });
  m.def("routed_experts_wait_cpu", [] { return nb::capsule(reinterpret_cast<void*>(&HybridjitRoutedExpertsWaitCpu)); });
#ifdef HYBRIDJIT_WITH_CUDA
  m.attr("has_cuda") = true;
  m.def("routed_experts_cuda", [] { return nb::capsule(reinterpret_cast<void*>(&HybridjitRoutedExpertsCuda)); });
  m.def("routed_experts_submit_cuda",
        [] { return nb::capsule(reinterpret_cast<void*>(&HybridjitRoutedExpertsSubmitCuda)); });
  m.def("routed_experts_wait_cuda",
        [] { return nb::capsule(reinterpret_cast<void*>(&HybridjitRoutedExpertsWaitCuda)); });
  m.def("take_gpu_error", &TakeGpuHandoffError,
        "The first error of a CPU job run for the GPU since the last call, or ''.");
  m.def("gpu_handoff_mode", [] { return std::string(GpuHandoffMode()); });
  m.def("take_gpu_handoff_stats", [] {
    const GpuHandoffStats stats = TakeGpuHandoffStats();
    return nb::make_tuple(stats.jobs, stats.job_seconds);
  }, "(jobs, seconds in them) of CPU jobs run for the GPU since the last call.");
#else
  m.attr("has_cuda") = false;
#endif
}
