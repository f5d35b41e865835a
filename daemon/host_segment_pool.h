// The host tier: pinned, shared memory in memfd segments that clients map. The pool pins all of
// its memory once at start-up and sub-allocates chunks inside segments with an ExtentAllocator.
//
// A segment belongs to one tenant (uid) while it holds that tenant's chunks; clients get fds only
// for segments of their own tenant. Before a segment passes to a different tenant it is replaced
// by a fresh memfd (new, zeroed pages, a new generation): mappings the previous tenant still holds
// keep pointing at the old pages and never see the new tenant's data.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/unique_fd.h"
#include "daemon/extent_allocator.h"
#include "daemon/tier.h"

namespace tierd {

inline constexpr uint32_t kNoTenant = UINT32_MAX;
inline constexpr uint64_t kHostAlignment = 4096;  // O_DIRECT and DMA need page alignment

enum class HugePagePolicy { kAuto, kNever, kRequire };

struct HostPoolOptions {
  uint64_t capacity = 0;      // bytes; a multiple of segment_size
  uint64_t segment_size = 0;  // bytes; also the largest chunk; a multiple of 2 MiB
  HugePagePolicy huge_pages = HugePagePolicy::kAuto;
  bool lock_memory = true;  // mlock the segments (pinning); tests of error paths may disable it
};

// A segment as a client sees it.
struct SegmentInfo {
  uint32_t segment = 0;
  uint64_t generation = 0;
  uint64_t size = 0;
};

class HostSegmentPool final : public Tier {
 public:
  // Checks RLIMIT_MEMLOCK and available memory, then creates, maps, populates and locks every
  // segment. The error says which limit to raise.
  static absl::StatusOr<std::unique_ptr<HostSegmentPool>> Create(const HostPoolOptions& options);
  ~HostSegmentPool() override;

  TierKind kind() const override { return TierKind::kHost; }
  uint64_t max_reservation() const override { return options_.segment_size; }
  absl::StatusOr<Placement> Reserve(uint32_t tenant, uint64_t size) override;
  void Unreserve(const Placement& placement) override;
  TierUsage Usage() const override;
  std::string Describe() const override;

  // A duplicate of the segment's fd, if the segment currently belongs to `tenant`.
  absl::StatusOr<UniqueFd> SegmentFd(uint32_t segment, uint32_t tenant, SegmentInfo* info) const;
  // The segments that currently belong to `tenant`.
  std::vector<SegmentInfo> SegmentsOf(uint32_t tenant) const;
  // The daemon's own mapping of a placement (for the I/O engines of later tiers).
  void* Address(const Placement& placement) const;

  // Calls `observer` now for every segment, and again whenever a segment gets new pages (a
  // recycle for another tenant), so that an I/O engine can keep them registered.
  using RemapObserver = std::function<void(uint32_t segment, void* base, size_t size)>;
  void SetRemapObserver(RemapObserver observer);

  bool huge_pages() const { return huge_pages_; }
  uint32_t segment_count() const { return static_cast<uint32_t>(segments_.size()); }

 private:
  struct Segment {
    UniqueFd fd;
    void* base = nullptr;
    uint64_t generation = 0;
    uint32_t owner = kNoTenant;       // tenant whose chunks it holds; kNoTenant when empty
    uint32_t last_owner = kNoTenant;  // tenant whose data the pages may still contain
    std::unique_ptr<ExtentAllocator> allocator;
  };

  explicit HostSegmentPool(const HostPoolOptions& options);
  absl::Status MapFresh(Segment& segment, uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unmap(Segment& segment);
  TierUsage UsageLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t LargestFreeLocked(uint32_t tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string DescribeLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const HostPoolOptions options_;
  bool huge_pages_ = false;
  mutable absl::Mutex mu_;
  std::vector<Segment> segments_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  RemapObserver observer_ ABSL_GUARDED_BY(mu_);
};

// Checks that `bytes` can be locked and are available; the error names the limit to raise.
absl::Status CheckPinnable(uint64_t bytes);

}  // namespace tierd
