// One routed-experts job on host memory: the work behind every handler (XLA:CPU runs it in the handler,
// the CUDA handlers run it on a CPU worker fed through pinned staging).
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace hybridjit {

struct ExpertJob {
  int64_t layer_id = 0;
  bool bf16 = false;  // dtype of x and y: bfloat16 bits, else float32
  const void* x = nullptr;  // [tokens, hidden]
  const int32_t* ids = nullptr;  // [tokens, top_k]
  const float* weights = nullptr;  // [tokens, top_k]
  int64_t tokens = 0;
  int64_t top_k = 0;
  int64_t hidden = 0;
  void* y = nullptr;  // [tokens, hidden]
};

// Checks the operands of a routed-experts call against its layer (dtypes, shapes, hidden size; no data
// is read): the trace-time half of every handler. Fails with kNotFound for an unknown layer.
xla::ffi::Error CheckJobOperands(int64_t layer_id, const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& ids,
                                 const xla::ffi::AnyBuffer& weights, const xla::ffi::AnyBuffer& result);

// The job of a call whose operands are in host memory (XLA:CPU), writing into `result`.
ExpertJob JobOnHostBuffers(int64_t layer_id, const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& ids,
                           const xla::ffi::AnyBuffer& weights, xla::ffi::AnyBuffer& result);

// Runs the job synchronously on the calling thread. Fails, naming the layer, on an unknown layer, a
// hidden size that is not the layer's, or an expert id out of range.
xla::ffi::Error RunExpertJob(const ExpertJob& job);

}  // namespace hybridjit
