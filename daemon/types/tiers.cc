#include "daemon/types/tiers.h"

namespace tierd::daemon {

absl::string_view TierName(TierKind tier) {
  switch (tier) {
    case TierKind::kHost:
      return "host";
    case TierKind::kNvme:
      return "nvme";
    case TierKind::kDevice:
      return "device";
  }
  return "unknown";
}

const char* PathName(Path path) {
  switch (path) {
    case Path::kNvmeToHost:
      return "nvme_to_host";
    case Path::kHostToNvme:
      return "host_to_nvme";
    case Path::kHostToDevice:
      return "host_to_device";
    case Path::kDeviceToHost:
      return "device_to_host";
  }
  return "unknown";
}

}  // namespace tierd::daemon
