// What GetNodeInfo says about the node's GPUs: the device the daemon serves (real or emulated), or
// why there is none.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tierd {

struct GpuDevice {
  std::string uuid;  // "GPU-xxxxxxxx-…"; devices are named by UUID, never by ordinal
  std::string name;
  uint64_t memory_bytes = 0;
  bool emulated = false;
};

struct DeviceProbe {
  std::vector<GpuDevice> devices;
  std::string status;  // why the list is empty, when it is
  std::string cuda_version;
};

}  // namespace tierd
