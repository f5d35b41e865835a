// The CUDA driver API, loaded at run time with dlopen("libcuda.so.1"), so that the daemon and the
// client library start (and serve the host and NVMe tiers) on machines without a GPU driver.
// Only compiled when the CUDA toolkit's headers are present (TIERD_HAVE_CUDA).
#pragma once

#ifdef TIERD_HAVE_CUDA
#include <cuda.h>

#include <string>

#include "absl/status/statusor.h"

namespace tierd {

struct CudaDriver {
#define TIERD_CUDA_FN(name) decltype(&::name) name = nullptr;
  // clang-format off
#define TIERD_CUDA_FUNCTIONS(X) \
  X(cuInit) \
  X(cuGetErrorString) \
  X(cuDriverGetVersion) \
  X(cuDeviceGetCount) \
  X(cuDeviceGet) \
  X(cuDeviceGetName) \
  X(cuDeviceGetUuid) \
  X(cuDeviceTotalMem) \
  X(cuDeviceGetAttribute) \
  X(cuDevicePrimaryCtxRetain) \
  X(cuDevicePrimaryCtxRelease) \
  X(cuCtxSetCurrent) \
  X(cuCtxPushCurrent) \
  X(cuCtxPopCurrent) \
  X(cuMemGetAllocationGranularity) \
  X(cuMemCreate) \
  X(cuMemRelease) \
  X(cuMemExportToShareableHandle) \
  X(cuMemImportFromShareableHandle) \
  X(cuMemAddressReserve) \
  X(cuMemAddressFree) \
  X(cuMemMap) \
  X(cuMemUnmap) \
  X(cuMemSetAccess) \
  X(cuMemsetD8) \
  X(cuStreamCreate) \
  X(cuStreamDestroy) \
  X(cuStreamSynchronize) \
  X(cuStreamWaitEvent) \
  X(cuMemcpyHtoDAsync) \
  X(cuMemcpyDtoHAsync) \
  X(cuEventCreate) \
  X(cuEventRecord) \
  X(cuEventSynchronize) \
  X(cuEventDestroy) \
  X(cuMemHostRegister) \
  X(cuMemHostUnregister) \
  X(cuMemHostGetDevicePointer) \
  X(cuStreamWaitValue32) \
  X(cuIpcGetEventHandle) \
  X(cuIpcOpenEventHandle) \
  X(cuIpcGetMemHandle) \
  X(cuIpcOpenMemHandle) \
  X(cuIpcCloseMemHandle) \
  X(cuMemAlloc) \
  X(cuMemFree) \
  X(cuMemsetD32) \
  X(cuMemcpyDtoH) \
  X(cuEventQuery) \
  X(cuCtxSynchronize)
  // clang-format on
  TIERD_CUDA_FUNCTIONS(TIERD_CUDA_FN)
#undef TIERD_CUDA_FN

  // The process-wide driver, loaded and initialized once. UNAVAILABLE (with the reason) when there
  // is no driver or no usable GPU.
  static absl::StatusOr<const CudaDriver*> Get();

  // "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)".
  absl::Status Check(CUresult result, const char* what) const;

  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L prints it.
  static std::string UuidString(const CUuuid& uuid);
};

}  // namespace tierd

#endif  // TIERD_HAVE_CUDA
