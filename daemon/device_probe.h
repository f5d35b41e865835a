// The GPUs this node has, as the CUDA runtime reports them. Devices are named by UUID: ordinals
// differ between processes with different CUDA_VISIBLE_DEVICES.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tierd {

struct GpuDevice {
  std::string uuid;  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
  std::string name;
  uint64_t memory_bytes = 0;
};

struct DeviceProbe {
  std::vector<GpuDevice> devices;
  std::string status;  // why the list is empty, when it is
  std::string cuda_version;
};

DeviceProbe ProbeDevices();

}  // namespace tierd
