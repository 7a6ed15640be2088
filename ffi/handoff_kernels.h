// The two GPU kernels of the "kernel" hand-off: one stages a job's inputs into pinned host memory and
// rings the CPU worker's doorbell, one waits for the worker's done flag and copies the result back. Two
// launches per submit/wait pair instead of six stream operations (three copies, the doorbell write, the
// wait, the result copy), each of which the GPU front end runs one after another.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>

#include "cuda_driver.h"

namespace hybridjit::cuda {

// The kernels of one context, and the per-slot counters the staging kernel's blocks arrive at.
struct HandoffKernels {
  CUfunction stage = nullptr, unstage = nullptr;
  CUdeviceptr counters = 0;
  int next_counter = 0;

  // A counter of its own for a new staging slot, or the reason there is none ("" on success).
  std::string TakeCounter(CUdeviceptr* counter);
};

// Loads the kernels into the current context; "" on success, else the driver's reason.
std::string LoadHandoffKernels(const Driver& cu, HandoffKernels* kernels);

// One copy of a job's staging; `bytes` must be a multiple of 4.
struct StageCopy {
  CUdeviceptr src, dst;
  uint64_t bytes;
};

// Enqueues: the three inputs to staging, then the release-store of `ring` into the 64-bit doorbell word.
CUresult EnqueueStage(const Driver& cu, const HandoffKernels& kernels, CUstream stream, const StageCopy (&copies)[3],
                      CUdeviceptr counter, CUdeviceptr doorbell, uint64_t ring);

// Enqueues: the wait until the 32-bit word at `done` is 1, then the staged result to device memory.
CUresult EnqueueUnstage(const Driver& cu, const HandoffKernels& kernels, CUstream stream, CUdeviceptr done,
                        StageCopy copy);

}  // namespace hybridjit::cuda
