// Real tiers for a unit test, in a scratch directory of their own: a host pool (small pages, not
// locked) and, where asked, an NVMe tier over a region file in that directory and an emulated GPU
// with its pool. What a test builds over them (a Mover, a ChunkService) must go first; then the
// tiers go, in the order their callbacks need, and the directory with them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/tiers/device/device.h"
#include "daemon/tiers/hop.h"
#include "daemon/tiers/nvme/nvme_tier.h"
#include "daemon/tiers/segment_pool.h"

namespace tierd::testing {

struct ScratchTierOptions {
  uint64_t segment_size = 4 << 20;  // the host's and the device's
  uint64_t host_bytes = 16 << 20;
  // The NVMe tier's region file; 0: no NVMe tier. `nvme` holds its other options (its regions are
  // the rig's; an index_size of 0 is 1 MiB).
  uint64_t nvme_bytes = 0;
  daemon::NvmeOptions nvme;
  // The emulated GPU's memory; 0: no device.
  uint64_t device_bytes = 0;
  double device_gbps = 8.0;
  absl::Duration device_latency = absl::Microseconds(10);
  // Wraps the emulated device (a test that watches its copies); null: none.
  std::function<std::unique_ptr<daemon::Device>(std::unique_ptr<daemon::Device>)> wrap_device;
};

class ScratchTiers {
 public:
  // The error says which tier could not be made.
  static absl::StatusOr<std::unique_ptr<ScratchTiers>> Make(const ScratchTierOptions& options);
  // Drains the tiers, then they and the directory go.
  ~ScratchTiers();
  ScratchTiers(const ScratchTiers&) = delete;
  ScratchTiers& operator=(const ScratchTiers&) = delete;

  // The tiers as the chunk layer is handed them (NodeTiers).
  daemon::Tiers tiers() const;
  daemon::SegmentPool* host() const { return host_.get(); }
  daemon::NvmeTier* nvme() const { return nvme_.get(); }  // null without one
  daemon::Device* device() const { return device_.get(); }
  daemon::SegmentPool* device_pool() const { return device_pool_.get(); }
  const std::string& dir() const { return dir_; }
  // Waits until the device and the NVMe tier have run every callback they were handed, twice: a
  // move can hand over from one to the other.
  void Drain();

 private:
  ScratchTiers() = default;

  std::string dir_;
  std::unique_ptr<daemon::SegmentPool> host_;
  std::unique_ptr<daemon::NvmeTier> nvme_;
  std::unique_ptr<daemon::Device> device_;
  std::unique_ptr<daemon::SegmentPool> device_pool_;
};

}  // namespace tierd::testing
