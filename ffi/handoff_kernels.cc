#include "handoff_kernels.h"

#include <algorithm>
#include <mutex>
#include <string>

namespace hybridjit::cuda {
namespace {

// Hand-written PTX (compiled by the driver at load time, so the build needs no CUDA compiler). sm_70 is
// the first architecture with the scoped acquire/release operations used here.
//
// copy_grid: the whole grid copies `bytes` (a multiple of 4) from src to dst, 16 bytes per thread and
// step where both addresses are 16-byte aligned, then 4 bytes at a time for the rest. One side is pinned
// host memory, which the GPU's caches do not keep coherent with the CPU: loads are ld.cv (a cached line of
// system memory is stale, fetch it again: the staging addresses are the same for every job) and stores
// st.wt (write through to system memory).
//
// hj_stage: copies the job's three inputs into pinned host staging, then rings the doorbell. Each thread
// makes its own writes visible to the CPU (fence.sc.sys) before its block arrives at a per-slot counter;
// the last block to arrive resets the counter for the next launch (which starts only after this kernel
// ends) and release-stores the 64-bit word `ring` (layer id in the low half, 0 in the high half, which
// clears the previous job's done flag).
//
// hj_unstage: thread 0 of every block acquire-polls the done flag until the CPU sets it, then the grid
// copies the staged result into device memory. bar.sync orders the block's loads after thread 0's
// acquire.
constexpr char kPtx[] = R"ptx(
.version 7.0
.target sm_70
.address_size 64

.func copy_grid(.param .u64 src, .param .u64 dst, .param .u64 bytes)
{
  .reg .pred %p;
  .reg .b32 %r<8>;
  .reg .b64 %rd<16>;
  ld.param.u64 %rd1, [src];
  ld.param.u64 %rd2, [dst];
  ld.param.u64 %rd3, [bytes];
  mov.u32 %r1, %tid.x;
  mov.u32 %r2, %ntid.x;
  mov.u32 %r3, %ctaid.x;
  mov.u32 %r4, %nctaid.x;
  cvt.u64.u32 %rd4, %r1;
  mad.wide.u32 %rd4, %r3, %r2, %rd4;       // this thread's first unit
  mul.wide.u32 %rd5, %r4, %r2;             // the grid's stride in units
  or.b64 %rd6, %rd1, %rd2;
  and.b64 %rd6, %rd6, 15;
  setp.ne.u64 %p, %rd6, 0;
  shr.u64 %rd7, %rd3, 4;                   // 16-byte units...
  selp.u64 %rd7, 0, %rd7, %p;              // ...none where an address is not 16-byte aligned
  mov.u64 %rd8, %rd4;
V16:
  setp.ge.u64 %p, %rd8, %rd7;
  @%p bra V16_END;
  shl.b64 %rd9, %rd8, 4;
  add.u64 %rd10, %rd1, %rd9;
  add.u64 %rd11, %rd2, %rd9;
  ld.global.cv.v4.u32 {%r1, %r2, %r3, %r5}, [%rd10];
  st.global.wt.v4.u32 [%rd11], {%r1, %r2, %r3, %r5};
  add.u64 %rd8, %rd8, %rd5;
  bra V16;
V16_END:
  shl.b64 %rd8, %rd7, 2;                   // first word after the 16-byte units
  add.u64 %rd8, %rd8, %rd4;
  shr.u64 %rd12, %rd3, 2;                  // words in all
W4:
  setp.ge.u64 %p, %rd8, %rd12;
  @%p bra W4_END;
  shl.b64 %rd9, %rd8, 2;
  add.u64 %rd10, %rd1, %rd9;
  add.u64 %rd11, %rd2, %rd9;
  ld.global.cv.u32 %r6, [%rd10];
  st.global.wt.u32 [%rd11], %r6;
  add.u64 %rd8, %rd8, %rd5;
  bra W4;
W4_END:
  ret;
}

.visible .entry hj_stage(
  .param .u64 x_src, .param .u64 x_dst, .param .u64 x_bytes,
  .param .u64 ids_src, .param .u64 ids_dst, .param .u64 ids_bytes,
  .param .u64 weights_src, .param .u64 weights_dst, .param .u64 weights_bytes,
  .param .u64 counter, .param .u64 doorbell, .param .u64 ring)
{
  .reg .pred %p;
  .reg .b32 %r<4>;
  .reg .b64 %rd<8>;
  .param .u64 a0;
  .param .u64 a1;
  .param .u64 a2;
  ld.param.u64 %rd1, [x_src];
  ld.param.u64 %rd2, [x_dst];
  ld.param.u64 %rd3, [x_bytes];
  st.param.u64 [a0], %rd1;
  st.param.u64 [a1], %rd2;
  st.param.u64 [a2], %rd3;
  call.uni copy_grid, (a0, a1, a2);
  ld.param.u64 %rd1, [ids_src];
  ld.param.u64 %rd2, [ids_dst];
  ld.param.u64 %rd3, [ids_bytes];
  st.param.u64 [a0], %rd1;
  st.param.u64 [a1], %rd2;
  st.param.u64 [a2], %rd3;
  call.uni copy_grid, (a0, a1, a2);
  ld.param.u64 %rd1, [weights_src];
  ld.param.u64 %rd2, [weights_dst];
  ld.param.u64 %rd3, [weights_bytes];
  st.param.u64 [a0], %rd1;
  st.param.u64 [a1], %rd2;
  st.param.u64 [a2], %rd3;
  call.uni copy_grid, (a0, a1, a2);
  fence.sc.sys;
  bar.sync 0;
  mov.u32 %r1, %tid.x;
  setp.ne.u32 %p, %r1, 0;
  @%p bra DONE;
  ld.param.u64 %rd4, [counter];
  atom.acq_rel.gpu.global.add.u32 %r2, [%rd4], 1;
  mov.u32 %r3, %nctaid.x;
  sub.u32 %r3, %r3, 1;
  setp.ne.u32 %p, %r2, %r3;
  @%p bra DONE;
  st.relaxed.gpu.global.u32 [%rd4], 0;
  ld.param.u64 %rd5, [doorbell];
  ld.param.u64 %rd6, [ring];
  fence.sc.sys;
  st.release.sys.global.u64 [%rd5], %rd6;
DONE:
  ret;
}

.visible .entry hj_unstage(.param .u64 done, .param .u64 y_src, .param .u64 y_dst, .param .u64 y_bytes)
{
  .reg .pred %p;
  .reg .b32 %r<4>;
  .reg .b64 %rd<8>;
  .param .u64 a0;
  .param .u64 a1;
  .param .u64 a2;
  mov.u32 %r1, %tid.x;
  setp.ne.u32 %p, %r1, 0;
  @%p bra WAITED;
  ld.param.u64 %rd1, [done];
POLL:
  ld.acquire.sys.global.u32 %r2, [%rd1];
  setp.ne.u32 %p, %r2, 1;
  @%p bra POLL;
WAITED:
  bar.sync 0;
  ld.param.u64 %rd2, [y_src];
  ld.param.u64 %rd3, [y_dst];
  ld.param.u64 %rd4, [y_bytes];
  st.param.u64 [a0], %rd2;
  st.param.u64 [a1], %rd3;
  st.param.u64 [a2], %rd4;
  call.uni copy_grid, (a0, a1, a2);
  ret;
}
)ptx";

// 256 threads a block, two 16-byte units per thread: a batch-1 copy (7168 bf16 or float values) takes 2-4
// blocks. Fewer blocks measured faster at batch 6 than one unit per thread (each block pays a system-scope
// fence, and each polls the done word over PCIe). No block waits for another, so blocks that are not
// resident yet cannot deadlock.
constexpr unsigned kThreads = 256;
constexpr unsigned kMaxBlocks = 32;
constexpr size_t kBytesPerBlock = kThreads * 16 * 2;
// Counters for this many staging slots per context (decode uses 3: the single call and two micro-batches).
constexpr int kMaxCounters = 64;

unsigned BlocksFor(size_t bytes) {
  return static_cast<unsigned>(std::clamp<size_t>((bytes + kBytesPerBlock - 1) / kBytesPerBlock, 1, kMaxBlocks));
}

}  // namespace

std::string LoadHandoffKernels(const Driver& cu, HandoffKernels* kernels) {
  CUmodule module;
  // The counters live in the module's own global memory, zeroed when it is loaded: no allocation and no
  // memset, which a stream being captured into a graph would not allow.
  static const std::string ptx = std::string(kPtx) + ".visible .global .align 4 .u32 hj_counters[" +
                                 std::to_string(kMaxCounters) + "];\n";
  if (std::string e = Describe(cu, cu.ModuleLoadData(&module, ptx.c_str()), "cuModuleLoadData"); !e.empty()) {
    return e;
  }
  size_t counters_bytes = 0;
  std::string error = Describe(cu, cu.ModuleGetFunction(&kernels->stage, module, "hj_stage"), "cuModuleGetFunction");
  if (error.empty()) {
    error = Describe(cu, cu.ModuleGetFunction(&kernels->unstage, module, "hj_unstage"), "cuModuleGetFunction");
  }
  if (error.empty()) {
    error = Describe(cu, cu.ModuleGetGlobal(&kernels->counters, &counters_bytes, module, "hj_counters"),
                     "cuModuleGetGlobal");
  }
  return error;
}

std::string HandoffKernels::TakeCounter(CUdeviceptr* counter) {
  if (next_counter == kMaxCounters) {
    return "more than " + std::to_string(kMaxCounters) + " hand-off staging slots on one GPU";
  }
  *counter = counters + 4 * next_counter++;
  return "";
}

CUresult EnqueueStage(const Driver& cu, const HandoffKernels& kernels, CUstream stream, const StageCopy (&copies)[3],
                      CUdeviceptr counter, CUdeviceptr doorbell, uint64_t ring) {
  const size_t largest = std::max({copies[0].bytes, copies[1].bytes, copies[2].bytes});
  void* params[] = {const_cast<CUdeviceptr*>(&copies[0].src), const_cast<CUdeviceptr*>(&copies[0].dst),
                    const_cast<uint64_t*>(&copies[0].bytes),  const_cast<CUdeviceptr*>(&copies[1].src),
                    const_cast<CUdeviceptr*>(&copies[1].dst), const_cast<uint64_t*>(&copies[1].bytes),
                    const_cast<CUdeviceptr*>(&copies[2].src), const_cast<CUdeviceptr*>(&copies[2].dst),
                    const_cast<uint64_t*>(&copies[2].bytes),  &counter,
                    &doorbell,                                &ring};
  return cu.LaunchKernel(kernels.stage, BlocksFor(largest), 1, 1, kThreads, 1, 1, 0, stream, params, nullptr);
}

CUresult EnqueueUnstage(const Driver& cu, const HandoffKernels& kernels, CUstream stream, CUdeviceptr done,
                        StageCopy copy) {
  void* params[] = {&done, &copy.src, &copy.dst, &copy.bytes};
  return cu.LaunchKernel(kernels.unstage, BlocksFor(copy.bytes), 1, 1, kThreads, 1, 1, 0, stream, params, nullptr);
}

}  // namespace hybridjit::cuda
