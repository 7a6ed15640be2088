// CUDA-platform handlers of the routed-experts calls: XLA's stream hands each job to a CPU worker
// through pinned, device-mapped staging and takes the result back, all by work enqueued on the stream.
// The handlers only enqueue (kernels, copies, stream memory operations or a host function) and keep every
// address fixed, so XLA can record them into a command buffer (CUDA graph): the handler body then runs
// once, when the graph is recorded, and the recorded nodes run at every replay.
//
// Three hand-off mechanisms (HYBRIDJIT_GPU_HANDOFF); the CPU side is the same for the first two: a worker
// polls a pinned doorbell word, runs the job, and sets a done word.
//   kernel (default): two small kernels (handoff_kernels.h). One writes the inputs into the staging and
//     rings the doorbell; one polls the done word from the GPU and copies the result back. Two launches
//     per submit/wait pair.
//   doorbell: copy engines and stream memory operations. Three copies of the inputs, one
//     cuStreamWriteValue64 that rings the doorbell and clears the done word of the previous job (the two
//     words share one aligned 64-bit word; two 32-bit writes where the device lacks 64-bit stream memory
//     operations), cuStreamWaitValue32 on the done word, one copy of the result: six operations a pair.
//   hostfunc: the job runs inside a cuLaunchHostFunc callback. Slower per hand-off, and the stream is
//     blocked while it runs, but it needs no stream memory operations and no kernels.
// In the first two the stream stays free between submit and wait for other GPU work. A failing job still
// releases the stream (the worker always signals); its error is kept for take_gpu_error() and surfaces as
// a Python exception after the step.
#include <cuda.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cuda_driver.h"
#include "expert_job.h"
#include "gpu_handoff.h"
#include "handoff_kernels.h"
#include "routed_experts_async.h"
#include "routed_experts_handler.h"
#include "thread_pool.h"
#include "weight_bank.h"
#include "xla/ffi/api/ffi.h"

namespace hybridjit {
namespace {

namespace ffi = xla::ffi;

enum class Mode { kKernel, kDoorbell, kHostFunc };

Mode HandoffMode() {
  static const Mode mode = [] {
    const char* value = std::getenv("HYBRIDJIT_GPU_HANDOFF");
    if (value != nullptr && std::strcmp(value, "doorbell") == 0) return Mode::kDoorbell;
    if (value != nullptr && std::strcmp(value, "hostfunc") == 0) return Mode::kHostFunc;
    return Mode::kKernel;
  }();
  return mode;
}

// One in-flight job's staging: which stream context, which micro-batch slot, which shapes.
struct SlotKey {
  CUcontext context;
  int64_t slot, tokens, top_k, hidden;
  bool bf16;
  bool operator<(const SlotKey& o) const {
    return std::tie(context, slot, tokens, top_k, hidden, bf16) <
           std::tie(o.context, o.slot, o.tokens, o.top_k, o.hidden, o.bf16);
  }
};

struct Slot {
  SlotKey key;
  // The low half of one aligned 64-bit word: written by the stream (the layer id of a job), reset to 0
  // by the worker when it takes the job.
  uint32_t* doorbell = nullptr;
  // The high half: set to 1 by the worker when the result is staged, cleared by the stream together with
  // the next job's doorbell (before the worker can see that job, so never after its result).
  uint32_t* done = nullptr;
  CUdeviceptr doorbell_device = 0, done_device = 0;
  bool write64 = false;  // the device takes 64-bit stream memory operations
  // Kernel hand-off: the context's kernels and this slot's arrival counter (null: copies and stream
  // memory operations).
  const cuda::HandoffKernels* kernels = nullptr;
  CUdeviceptr counter = 0;
  unsigned char* x = nullptr;
  int32_t* ids = nullptr;
  float* weights = nullptr;
  unsigned char* y = nullptr;
  size_t activation_bytes = 0, routing_bytes = 0;

  // The device address of a staging buffer (all in the one mapped allocation that starts at the doorbell).
  CUdeviceptr Mapped(const void* host) const {
    return doorbell_device + (static_cast<const unsigned char*>(host) - reinterpret_cast<unsigned char*>(doorbell));
  }
};

// A host-function job: which slot and which layer. Kept alive for the process, since recorded graphs
// hold its address.
struct HostFuncJob {
  Slot* slot;
  int64_t layer_id;
};

ExpertJob JobOf(const Slot& slot, int64_t layer_id) {
  ExpertJob job;
  job.layer_id = layer_id;
  job.bf16 = slot.key.bf16;
  job.x = slot.x;
  job.ids = slot.ids;
  job.weights = slot.weights;
  job.tokens = slot.key.tokens;
  job.top_k = slot.key.top_k;
  job.hidden = slot.key.hidden;
  job.y = slot.y;
  return job;
}

class Handoff {
 public:
  static Handoff& Global() {
    static Handoff* handoff = new Handoff();  // never destroyed: its worker polls until the process ends
    return *handoff;
  }

  // The slot for `key`, created on first use at addresses that never change.
  ffi::ErrorOr<Slot*> GetSlot(const cuda::Driver& cu, const SlotKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = slots_.find(key);
    if (found != slots_.end()) return found->second.get();
    auto slot = std::make_unique<Slot>();
    slot->key = key;
    slot->activation_bytes = static_cast<size_t>(key.tokens * key.hidden) * (key.bf16 ? 2 : 4);
    slot->routing_bytes = static_cast<size_t>(key.tokens * key.top_k) * 4;
    // Control words first, in a cache line of their own, then the staging buffers.
    const size_t bytes = 128 + 2 * slot->activation_bytes + 2 * slot->routing_bytes;
    void* host = nullptr;
    std::string error = cuda::Describe(cu, cu.CtxPushCurrent(key.context), "cuCtxPushCurrent");
    if (error.empty()) {
      CUdevice device;
      int write64 = 0;
      error = cuda::Describe(cu, cu.CtxGetDevice(&device), "cuCtxGetDevice");
      if (error.empty()) {
        error = cuda::Describe(
            cu, cu.DeviceGetAttribute(&write64, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device),
            "cuDeviceGetAttribute");
      }
      slot->write64 = write64 != 0;
      if (error.empty() && HandoffMode() == Mode::kKernel) error = KernelsFor(cu, *slot);
      if (error.empty()) {  // last, so that no failure after it leaks the allocation
        error = cuda::Describe(
            cu, cu.MemHostAlloc(&host, bytes, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc");
      }
      CUcontext popped;
      cu.CtxPopCurrent(&popped);
    }
    if (!error.empty()) return ffi::Error::Internal("hybridjit GPU hand-off staging: " + error);
    std::memset(host, 0, 128);
    auto* base = static_cast<unsigned char*>(host);
    slot->doorbell = reinterpret_cast<uint32_t*>(base);
    slot->done = reinterpret_cast<uint32_t*>(base + 4);
    slot->x = base + 128;
    slot->y = slot->x + slot->activation_bytes;
    slot->ids = reinterpret_cast<int32_t*>(slot->y + slot->activation_bytes);
    slot->weights = reinterpret_cast<float*>(slot->ids + key.tokens * key.top_k);
    if (std::string e = cuda::Describe(cu, cu.MemHostGetDevicePointer(&slot->doorbell_device, slot->doorbell, 0),
                                       "cuMemHostGetDevicePointer");
        !e.empty()) {
      return ffi::Error::Internal("hybridjit GPU hand-off: " + e);
    }
    slot->done_device = slot->doorbell_device + 4;
    Slot* result = slot.get();
    slots_.emplace(key, std::move(slot));
    generation_.fetch_add(1, std::memory_order_release);
    if (!worker_started_) {
      worker_started_ = true;
      std::thread([this] { Poll(); }).detach();
    }
    return result;
  }

  // The context's kernels (loaded on its first slot) and a counter of the slot's own; the context is
  // current. Shapes whose copies are not whole 4-byte words keep the copy-engine hand-off.
  std::string KernelsFor(const cuda::Driver& cu, Slot& slot) {
    if (slot.activation_bytes % 4 != 0) return "";
    auto [entry, loaded] = kernels_.try_emplace(slot.key.context);
    if (loaded) {
      if (std::string e = cuda::LoadHandoffKernels(cu, &entry->second); !e.empty()) {
        kernels_.erase(entry);
        return e;
      }
    }
    if (std::string e = entry->second.TakeCounter(&slot.counter); !e.empty()) return e;
    slot.kernels = &entry->second;
    return "";
  }

  HostFuncJob* HostJob(Slot* slot, int64_t layer_id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& job = host_jobs_[{slot, layer_id}];
    if (!job) job = std::make_unique<HostFuncJob>(HostFuncJob{slot, layer_id});
    return job.get();
  }

  void Run(Slot& slot, uint32_t layer_id) {
    const auto start = std::chrono::steady_clock::now();
    ffi::Error error = RunExpertJob(JobOf(slot, layer_id));
    job_nanoseconds_.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count(),
        std::memory_order_relaxed);
    jobs_.fetch_add(1, std::memory_order_relaxed);
    if (error.failure()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.empty()) error_ = error.message();
    }
  }

  std::string TakeError() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(error_, "");
  }

  GpuHandoffStats TakeStats() {
    return {jobs_.exchange(0), 1e-9 * static_cast<double>(job_nanoseconds_.exchange(0)), enqueues_.exchange(0)};
  }

  // Counts runs of a handler body: once per execution without CUDA graphs, once per recording with.
  void CountEnqueue() { enqueues_.fetch_add(1, std::memory_order_relaxed); }

 private:
  // The worker: polls every slot's doorbell; spins while jobs come often (decode steps), sleeps
  // briefly once idle so an idle process does not hold a core. It takes part in each job as the
  // expert pool's submitting thread, so it pins itself to the CPU the pool's workers leave free:
  // left to the OS, it shared a worker's CPU for seconds after the first jobs, and those jobs ran
  // ~30% slower (bench/RESULTS.md, the first case of a process).
  void Poll() {
    std::vector<Slot*> slots;
    uint64_t seen = ~uint64_t{0};
    auto last_job = std::chrono::steady_clock::now();
    std::weak_ptr<ThreadPool> pinned_for;  // the pool whose free CPU this thread is pinned to
    cpu_set_t unpinned;                    // this thread's CPUs before it pinned itself
    pthread_getaffinity_np(pthread_self(), sizeof unpinned, &unpinned);
    for (;;) {
      if (const uint64_t generation = generation_.load(std::memory_order_acquire); generation != seen) {
        std::lock_guard<std::mutex> lock(mu_);
        slots.clear();
        for (auto& entry : slots_) slots.push_back(entry.second.get());
        seen = generation;
      }
      bool worked = false;
      for (Slot* slot : slots) {
        const uint32_t layer_id = __atomic_load_n(slot->doorbell, __ATOMIC_ACQUIRE);
        if (layer_id == 0) continue;
        __atomic_store_n(slot->doorbell, 0u, __ATOMIC_RELAXED);
        if (std::shared_ptr<ThreadPool> pool = ThreadPool::Global(); pool != pinned_for.lock()) {
          if (pool->submitter_cpu() >= 0) {
            PinCurrentThread(pool->submitter_cpu());
          } else {  // every CPU has a worker: no place is better than another
            pthread_setaffinity_np(pthread_self(), sizeof unpinned, &unpinned);
          }
          pinned_for = pool;
        }
        Run(*slot, layer_id);
        __atomic_store_n(slot->done, 1u, __ATOMIC_RELEASE);
        worked = true;
      }
      const auto now = std::chrono::steady_clock::now();
      if (worked) {
        last_job = now;
      } else if (now - last_job > std::chrono::milliseconds(200)) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      } else {
        __builtin_ia32_pause();
      }
    }
  }

  std::mutex mu_;
  std::map<SlotKey, std::unique_ptr<Slot>> slots_;
  std::map<std::pair<Slot*, int64_t>, std::unique_ptr<HostFuncJob>> host_jobs_;
  std::map<CUcontext, cuda::HandoffKernels> kernels_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> jobs_{0}, job_nanoseconds_{0}, enqueues_{0};
  bool worker_started_ = false;
  std::string error_;
};

void CUDA_CB RunHostFuncJob(void* data) {
  auto* job = static_cast<HostFuncJob*>(data);
  Handoff::Global().Run(*job->slot, job->layer_id);
}

ffi::ErrorOr<const cuda::Driver*> Driver() {
  std::string error;
  const cuda::Driver* cu = cuda::LoadDriver(&error);
  if (cu == nullptr) return ffi::Error::Internal("hybridjit GPU hand-off: " + error);
  return cu;
}

ffi::Error Check(const cuda::Driver& cu, CUresult result, const char* call) {
  std::string error = cuda::Describe(cu, result, call);
  return error.empty() ? ffi::Error::Success() : ffi::Error::Internal("hybridjit GPU hand-off: " + error);
}

#define HYBRIDJIT_RETURN_IF_ERROR(expr)   \
  if (ffi::Error e = (expr); e.failure()) \
  return e

ffi::ErrorOr<Slot*> SlotFor(const cuda::Driver& cu, CUstream stream, int64_t slot_index, const ffi::AnyBuffer& result,
                            int64_t top_k) {
  SlotKey key;
  std::string error = cuda::Describe(cu, cu.StreamGetCtx(stream, &key.context), "cuStreamGetCtx");
  if (!error.empty()) return ffi::Error::Internal("hybridjit GPU hand-off: " + error);
  key.slot = slot_index;
  key.tokens = result.dimensions()[0];
  key.hidden = result.dimensions()[1];
  key.top_k = top_k;
  key.bf16 = result.element_type() == ffi::DataType::BF16;
  return Handoff::Global().GetSlot(cu, key);
}

// Enqueues: inputs to staging, then the hand-off of the job to the CPU.
ffi::Error EnqueueSubmit(const cuda::Driver& cu, CUstream stream, Slot& slot, int64_t layer_id, const ffi::AnyBuffer& x,
                         const ffi::AnyBuffer& ids, const ffi::AnyBuffer& weights) {
  if (slot.key.tokens == 0) return ffi::Error::Success();
  auto device = [](const ffi::AnyBuffer& b) { return reinterpret_cast<CUdeviceptr>(b.untyped_data()); };
  if (slot.kernels != nullptr) {  // little-endian: the layer id into the doorbell, 0 into done
    const cuda::StageCopy copies[3] = {
        {device(x), slot.Mapped(slot.x), slot.activation_bytes},
        {device(ids), slot.Mapped(slot.ids), slot.routing_bytes},
        {device(weights), slot.Mapped(slot.weights), slot.routing_bytes}};
    return Check(cu,
                 cuda::EnqueueStage(cu, *slot.kernels, stream, copies, slot.counter, slot.doorbell_device,
                                    static_cast<uint64_t>(layer_id)),
                 "cuLaunchKernel (hand-off staging)");
  }
  HYBRIDJIT_RETURN_IF_ERROR(
      Check(cu, cu.MemcpyDtoHAsync(slot.x, device(x), slot.activation_bytes, stream), "cuMemcpyDtoHAsync"));
  HYBRIDJIT_RETURN_IF_ERROR(
      Check(cu, cu.MemcpyDtoHAsync(slot.ids, device(ids), slot.routing_bytes, stream), "cuMemcpyDtoHAsync"));
  HYBRIDJIT_RETURN_IF_ERROR(
      Check(cu, cu.MemcpyDtoHAsync(slot.weights, device(weights), slot.routing_bytes, stream), "cuMemcpyDtoHAsync"));
  if (HandoffMode() == Mode::kHostFunc) {
    return Check(cu, cu.LaunchHostFunc(stream, RunHostFuncJob, Handoff::Global().HostJob(&slot, layer_id)),
                 "cuLaunchHostFunc");
  }
  if (slot.write64) {  // little-endian: the layer id into the doorbell, 0 into done
    return Check(cu, cu.StreamWriteValue64(stream, slot.doorbell_device, static_cast<cuuint64_t>(layer_id), 0),
                 "cuStreamWriteValue64");
  }
  HYBRIDJIT_RETURN_IF_ERROR(Check(cu, cu.StreamWriteValue32(stream, slot.done_device, 0, 0), "cuStreamWriteValue32"));
  return Check(cu, cu.StreamWriteValue32(stream, slot.doorbell_device, static_cast<cuuint32_t>(layer_id), 0),
               "cuStreamWriteValue32");
}

// Enqueues: the wait for the CPU (doorbell mode), then the staged result to `result`.
ffi::Error EnqueueWait(const cuda::Driver& cu, CUstream stream, Slot& slot, ffi::AnyBuffer& result) {
  if (slot.key.tokens == 0) return ffi::Error::Success();
  if (slot.kernels != nullptr) {
    const cuda::StageCopy copy{slot.Mapped(slot.y), reinterpret_cast<CUdeviceptr>(result.untyped_data()),
                               slot.activation_bytes};
    return Check(cu, cuda::EnqueueUnstage(cu, *slot.kernels, stream, slot.done_device, copy),
                 "cuLaunchKernel (hand-off result)");
  }
  if (HandoffMode() == Mode::kDoorbell) {
    HYBRIDJIT_RETURN_IF_ERROR(
        Check(cu, cu.StreamWaitValue32(stream, slot.done_device, 1, CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32"));
  }
  return Check(cu,
               cu.MemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(result.untyped_data()), slot.y,
                                  slot.activation_bytes, stream),
               "cuMemcpyHtoDAsync");
}

// The single call: submit and wait back to back (no GPU work in between).
ffi::Error RoutedExpertsCuda(CUstream stream, ffi::AnyBuffer x, ffi::AnyBuffer ids, ffi::AnyBuffer weights,
                             ffi::Result<ffi::AnyBuffer> y, int64_t layer_id) {
  Handoff::Global().CountEnqueue();
  HYBRIDJIT_RETURN_IF_ERROR(CheckJobOperands(layer_id, x, ids, weights, *y));
  auto cu = Driver();
  if (cu.has_error()) return cu.error();
  auto slot = SlotFor(**cu, stream, kSingleCallSlot, *y, ids.dimensions()[1]);
  if (slot.has_error()) return slot.error();
  HYBRIDJIT_RETURN_IF_ERROR(EnqueueSubmit(**cu, stream, **slot, layer_id, x, ids, weights));
  return EnqueueWait(**cu, stream, **slot, *y);
}

ffi::Error SubmitCuda(CUstream stream, ffi::AnyBuffer x, ffi::AnyBuffer ids, ffi::AnyBuffer weights,
                      ffi::Result<ffi::AnyBuffer> pending, ffi::Result<ffi::AnyBuffer> /*x_pass: aliases x*/,
                      int64_t layer_id, int64_t slot_index) {
  Handoff::Global().CountEnqueue();
  HYBRIDJIT_RETURN_IF_ERROR(CheckJobOperands(layer_id, x, ids, weights, *pending));
  auto cu = Driver();
  if (cu.has_error()) return cu.error();
  auto slot = SlotFor(**cu, stream, slot_index, *pending, ids.dimensions()[1]);
  if (slot.has_error()) return slot.error();
  return EnqueueSubmit(**cu, stream, **slot, layer_id, x, ids, weights);
}

ffi::Error WaitCuda(CUstream stream, ffi::AnyBuffer /*pending: aliased by y*/, ffi::AnyBuffer /*other*/,
                    ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> /*other_pass*/, int64_t slot_index,
                    int64_t top_k) {
  Handoff::Global().CountEnqueue();
  auto cu = Driver();
  if (cu.has_error()) return cu.error();
  auto slot = SlotFor(**cu, stream, slot_index, *y, top_k);
  if (slot.has_error()) return slot.error();
  return EnqueueWait(**cu, stream, **slot, *y);
}

}  // namespace

std::string TakeGpuHandoffError() { return Handoff::Global().TakeError(); }

GpuHandoffStats TakeGpuHandoffStats() { return Handoff::Global().TakeStats(); }

const char* GpuHandoffMode() {
  switch (HandoffMode()) {
    case Mode::kKernel:
      return "kernel";
    case Mode::kDoorbell:
      return "doorbell";
    case Mode::kHostFunc:
      return "hostfunc";
  }
  return "";
}

}  // namespace hybridjit

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridjitRoutedExpertsCuda, hybridjit::RoutedExpertsCuda,
                              hybridjit::BindRoutedExperts(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<CUstream>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridjitRoutedExpertsSubmitCuda, hybridjit::SubmitCuda,
                              hybridjit::BindRoutedExpertsSubmit(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<CUstream>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridjitRoutedExpertsWaitCuda, hybridjit::WaitCuda,
                              hybridjit::BindRoutedExpertsWait(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<CUstream>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
