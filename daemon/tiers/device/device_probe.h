// What GetNodeInfo says about the node's GPUs: the device the daemon serves (real or emulated), or
// why there is none.
#pragma once

#include <string>
#include <vector>

#include "daemon/tiers/device/device.h"

namespace tierd::daemon {

struct DeviceProbe {
  std::vector<DeviceDescription> devices;
  std::string status;  // why the list is empty, when it is
};

}  // namespace tierd::daemon
