// CUDA-platform handlers of the routed-experts calls (compiled only where the CUDA toolkit's headers
// are found; the driver itself is loaded at run time).
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace hybridjit {

// The staging slot of the single (unsplit) call; split calls use slot >= 0 (one per micro-batch).
inline constexpr int64_t kSingleCallSlot = -1;

// The first error of a CPU job run for the GPU since the last call ("" if none). Jobs cannot fail
// the XLA call that submitted them (it returned long before), so the runtime asks after each step.
std::string TakeGpuHandoffError();

// Since the last call: CPU jobs run for the GPU, the seconds spent in them, and runs of the CUDA
// handlers' bodies (every execution without CUDA graphs, only recordings with them).
struct GpuHandoffStats {
  int64_t jobs;
  double job_seconds;
  int64_t handler_runs;
};
GpuHandoffStats TakeGpuHandoffStats();

// "kernel", "doorbell" or "hostfunc" (HYBRIDJIT_GPU_HANDOFF).
const char* GpuHandoffMode();

}  // namespace hybridjit

XLA_FFI_DECLARE_HANDLER_SYMBOL(HybridjitRoutedExpertsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HybridjitRoutedExpertsSubmitCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HybridjitRoutedExpertsWaitCuda);
