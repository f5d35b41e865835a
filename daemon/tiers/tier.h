// The interface every memory tier implements. The chunk service reserves and releases space
// through it and never needs to know whether bytes live in host memory, on NVMe or on a GPU.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/types/tiers.h"

namespace tierd::daemon {

// Where a chunk's copy lives in a tier: a segment (host), region (NVMe) or device pool, the
// generation of that container, and the byte offset in it.
struct Placement {
  TierKind tier = TierKind::kHost;
  uint32_t segment = 0;
  uint64_t generation = 0;
  uint64_t offset = 0;
  uint64_t size = 0;  // bytes reserved (the request rounded up to the tier's alignment)
};

struct TierUsage {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t largest_free_bytes = 0;  // the largest reservation that can succeed now
};

class Tier {
 public:
  virtual ~Tier() = default;
  virtual TierKind kind() const = 0;
  // Largest single reservation the tier can ever hold.
  virtual uint64_t max_reservation() const = 0;
  // Reserves `size` bytes for `tenant` (a uid). RESOURCE_EXHAUSTED, saying how full the tier is,
  // when it does not fit.
  virtual absl::StatusOr<Placement> Reserve(uint32_t tenant, uint64_t size) = 0;
  // REQUIRES: `placement` came from Reserve and was not released.
  virtual void Unreserve(const Placement& placement) = 0;
  virtual TierUsage Usage() const = 0;
  // The daemon's address of a placement in a memory tier (a host or device pointer); null for
  // tiers that are not memory (NVMe).
  virtual void* Address(const Placement& placement) const {
    (void)placement;
    return nullptr;
  }
  // One line for logs and GetNodeInfo.
  virtual std::string Describe() const = 0;
};

}  // namespace tierd::daemon
