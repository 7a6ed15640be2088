#include "cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

namespace hybridjit::cuda {
namespace {

// The driver version whose entry points we ask for (the _v2 memcpy/stream-memop ABIs of CUDA 12+).
constexpr int kApiVersion = 12000;

template <typename Fn>
bool Resolve(decltype(&::cuGetProcAddress) get_proc, const char* name, Fn* fn, std::string* error) {
  void* address = nullptr;
  CUdriverProcAddressQueryResult status;
  if (get_proc(name, &address, kApiVersion, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS ||
      address == nullptr) {
    *error = std::string("the CUDA driver has no ") + name;
    return false;
  }
  *fn = reinterpret_cast<Fn>(address);
  return true;
}

const Driver* Load(std::string* error) {
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    *error = std::string("cannot load libcuda.so.1: ") + dlerror();
    return nullptr;
  }
  auto get_proc = reinterpret_cast<decltype(&::cuGetProcAddress)>(dlsym(library, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    *error = "libcuda.so.1 has no cuGetProcAddress_v2 (driver older than CUDA 12)";
    return nullptr;
  }
  static Driver driver;
  const bool ok = Resolve(get_proc, "cuGetErrorString", &driver.GetErrorString, error) &&
                  Resolve(get_proc, "cuStreamGetCtx", &driver.StreamGetCtx, error) &&
                  Resolve(get_proc, "cuCtxPushCurrent", &driver.CtxPushCurrent, error) &&
                  Resolve(get_proc, "cuCtxPopCurrent", &driver.CtxPopCurrent, error) &&
                  Resolve(get_proc, "cuMemHostAlloc", &driver.MemHostAlloc, error) &&
                  Resolve(get_proc, "cuMemHostGetDevicePointer", &driver.MemHostGetDevicePointer, error) &&
                  Resolve(get_proc, "cuMemcpyDtoHAsync", &driver.MemcpyDtoHAsync, error) &&
                  Resolve(get_proc, "cuMemcpyHtoDAsync", &driver.MemcpyHtoDAsync, error) &&
                  Resolve(get_proc, "cuStreamWriteValue32", &driver.StreamWriteValue32, error) &&
                  Resolve(get_proc, "cuStreamWriteValue64", &driver.StreamWriteValue64, error) &&
                  Resolve(get_proc, "cuCtxGetDevice", &driver.CtxGetDevice, error) &&
                  Resolve(get_proc, "cuDeviceGetAttribute", &driver.DeviceGetAttribute, error) &&
                  Resolve(get_proc, "cuStreamWaitValue32", &driver.StreamWaitValue32, error) &&
                  Resolve(get_proc, "cuLaunchHostFunc", &driver.LaunchHostFunc, error) &&
                  Resolve(get_proc, "cuModuleLoadData", &driver.ModuleLoadData, error) &&
                  Resolve(get_proc, "cuModuleGetFunction", &driver.ModuleGetFunction, error) &&
                  Resolve(get_proc, "cuModuleGetGlobal", &driver.ModuleGetGlobal, error) &&
                  Resolve(get_proc, "cuLaunchKernel", &driver.LaunchKernel, error);
  return ok ? &driver : nullptr;
}

}  // namespace

const Driver* LoadDriver(std::string* error) {
  static std::once_flag once;
  static const Driver* driver = nullptr;
  static std::string load_error;
  std::call_once(once, [] { driver = Load(&load_error); });
  if (driver == nullptr) *error = load_error;
  return driver;
}

std::string Describe(const Driver& driver, CUresult result, const char* call) {
  if (result == CUDA_SUCCESS) return "";
  const char* text = nullptr;
  driver.GetErrorString(result, &text);
  return std::string(call) + " failed: " + (text ? text : "unknown CUDA error " + std::to_string(result));
}

}  // namespace hybridjit::cuda
