#include "daemon/device_probe.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#ifdef TIERD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tierd {

#ifdef TIERD_HAVE_CUDA
namespace {

std::string FormatUuid(const cudaUUID_t& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                         b[12], b[13], b[14], b[15]);
}

}  // namespace

DeviceProbe ProbeDevices() {
  DeviceProbe probe;
  probe.cuda_version = absl::StrCat(CUDART_VERSION / 1000, ".", (CUDART_VERSION % 1000) / 10);
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    probe.status = absl::StrCat("no usable GPU: ", cudaGetErrorString(err));
    return probe;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    probe.devices.push_back({FormatUuid(prop.uuid), prop.name, prop.totalGlobalMem});
  }
  if (probe.devices.empty()) probe.status = "no GPU found";
  return probe;
}
#else
DeviceProbe ProbeDevices() {
  DeviceProbe probe;
  probe.status = "built without CUDA (TIERD_CUDA=OFF or no toolkit at build time)";
  return probe;
}
#endif

}  // namespace tierd
