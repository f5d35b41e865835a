// The interface every memory tier implements. The chunk service reserves and releases space
// through it and never needs to know whether bytes live in host memory, on NVMe or on a GPU.
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace tierd::daemon {

// Values match tierd.v1.Tier.
enum class TierKind : uint8_t { kHost = 1, kNvme = 2, kDevice = 3 };
inline constexpr int kTierKinds = 4;  // index 0 unused

absl::string_view TierName(TierKind tier);

// A set of tiers as a bit mask indexed by TierKind.
class TierSet {
 public:
  bool contains(TierKind t) const { return bits_ & Bit(t); }
  void insert(TierKind t) { bits_ |= Bit(t); }
  void erase(TierKind t) { bits_ &= ~Bit(t); }
  bool empty() const { return bits_ == 0; }
  uint8_t bits() const { return bits_; }

 private:
  static uint8_t Bit(TierKind t) { return static_cast<uint8_t>(1u << static_cast<int>(t)); }
  uint8_t bits_ = 0;
};

// The ways a chunk's bytes move, each with its own measured bandwidth.
enum class Path : uint8_t { kNvmeToHost = 0, kHostToNvme, kHostToDevice, kDeviceToHost };
inline constexpr int kPaths = 4;
const char* PathName(Path path);

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
