#include "testing/scratch_tiers.h"

#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "daemon/tiers/host/host_memory.h"

namespace tierd::testing {

using daemon::TierKind;

absl::StatusOr<std::unique_ptr<ScratchTiers>> ScratchTiers::Make(
    const ScratchTierOptions& options) {
  std::unique_ptr<ScratchTiers> rig(new ScratchTiers());
  char tmpl[] = "/var/tmp/tierd-tiers-XXXXXX";  // not tmpfs: the region file is opened O_DIRECT
  if (mkdtemp(tmpl) == nullptr) {
    return absl::InternalError(absl::StrCat("no scratch directory: ", std::strerror(errno)));
  }
  rig->dir_ = tmpl;
  absl::StatusOr<std::unique_ptr<daemon::SegmentPool>> host =
      daemon::CreateHostPool({.capacity = options.host_bytes,
                              .segment_size = options.segment_size,
                              .huge_pages = daemon::HugePagePolicy::kNever,
                              .lock_memory = false});
  if (!host.ok())
    return absl::Status(host.status().code(), "host tier: " + host.status().ToString());
  rig->host_ = std::move(*host);
  if (options.nvme_bytes > 0) {
    daemon::NvmeOptions o = options.nvme;
    o.regions = {{rig->dir_ + "/r0", options.nvme_bytes}};
    if (o.index_size == 0) o.index_size = 1 << 20;
    auto nvme = daemon::NvmeTier::Open(o, daemon::InstanceId{}, rig->host_.get());
    if (!nvme.ok())
      return absl::Status(nvme.status().code(), "NVMe tier: " + nvme.status().ToString());
    rig->nvme_ = std::move(*nvme);
  }
  if (options.device_bytes > 0) {
    rig->device_ = daemon::MakeEmulatedDevice({.memory_bytes = options.device_bytes,
                                               .gbps = options.device_gbps,
                                               .latency = options.device_latency});
    if (options.wrap_device) rig->device_ = options.wrap_device(std::move(rig->device_));
    auto pool = daemon::SegmentPool::Create(TierKind::kDevice, "device", options.device_bytes,
                                            options.segment_size, rig->device_->MakeBacking());
    if (!pool.ok())
      return absl::Status(pool.status().code(), "device tier: " + pool.status().ToString());
    rig->device_pool_ = std::move(*pool);
  }
  return rig;
}

ScratchTiers::~ScratchTiers() {
  Drain();
  nvme_.reset();
  if (device_ != nullptr) device_->Drain();
  device_pool_.reset();
  device_.reset();
  host_.reset();
  if (!dir_.empty()) std::filesystem::remove_all(dir_);
}

daemon::Tiers ScratchTiers::tiers() const {
  return daemon::NodeTiers(host_.get(), nvme_.get(), device_pool_.get(), device_.get());
}

void ScratchTiers::Drain() {
  for (int round = 0; round < 2; ++round) {
    if (device_ != nullptr) device_->Drain();
    if (nvme_ != nullptr) nvme_->Drain();
  }
}

}  // namespace tierd::testing
