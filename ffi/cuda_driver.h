// The CUDA driver entry points of the GPU hand-off, loaded from libcuda.so.1 at first use, so that the
// extension imports (and its CPU handlers run) on machines with no GPU driver.
#pragma once

#include <cuda.h>

#include <string>

namespace hybridjit::cuda {

struct Driver {
  decltype(&::cuGetErrorString) GetErrorString;
  decltype(&::cuStreamGetCtx) StreamGetCtx;
  decltype(&::cuCtxPushCurrent) CtxPushCurrent;
  decltype(&::cuCtxPopCurrent) CtxPopCurrent;
  decltype(&::cuMemHostAlloc) MemHostAlloc;
  decltype(&::cuMemHostGetDevicePointer) MemHostGetDevicePointer;
  decltype(&::cuMemcpyDtoHAsync) MemcpyDtoHAsync;
  decltype(&::cuMemcpyHtoDAsync) MemcpyHtoDAsync;
  decltype(&::cuStreamWriteValue32) StreamWriteValue32;
  decltype(&::cuStreamWriteValue64) StreamWriteValue64;
  decltype(&::cuCtxGetDevice) CtxGetDevice;
  decltype(&::cuDeviceGetAttribute) DeviceGetAttribute;
  decltype(&::cuStreamWaitValue32) StreamWaitValue32;
  decltype(&::cuLaunchHostFunc) LaunchHostFunc;
  decltype(&::cuModuleLoadData) ModuleLoadData;
  decltype(&::cuModuleGetFunction) ModuleGetFunction;
  decltype(&::cuModuleGetGlobal) ModuleGetGlobal;
  decltype(&::cuLaunchKernel) LaunchKernel;
};

// The loaded driver, or nullptr with the reason in *error (no libcuda, or a driver too old).
const Driver* LoadDriver(std::string* error);

// "cuXxx failed: <driver's text>", or "" for CUDA_SUCCESS.
std::string Describe(const Driver& driver, CUresult result, const char* call);

}  // namespace hybridjit::cuda
