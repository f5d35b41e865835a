// A tier made of shared segments: fixed-size blocks of memory, each exportable to clients as a
// file descriptor, sub-allocated into chunks with an ExtentAllocator. The host tier is a pool of
// pinned memfd segments; the device tier is a pool of GPU allocations (or emulated ones). What a
// segment is made of is the pool's SegmentBacking.
//
// A segment belongs to one tenant (uid) while it holds that tenant's chunks; clients get fds only
// for segments of their own tenant. Before a segment passes to a different tenant it is replaced
// by fresh memory (zeroed, a new generation): mappings the previous tenant still holds keep
// pointing at the old memory and never see the new tenant's data.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/unique_fd.h"
#include "daemon/tiers/extent_allocator.h"
#include "daemon/tiers/tier.h"

namespace tierd::daemon {

inline constexpr uint32_t kNoTenant = UINT32_MAX;
inline constexpr uint64_t kSegmentAlignment = 4096;  // O_DIRECT and DMA need page alignment

// One segment's memory: the fd clients import, and the daemon's own address of it (a host
// pointer, or a device pointer for GPU memory).
struct SegmentMemory {
  UniqueFd fd;
  void* base = nullptr;
  uint64_t handle = 0;  // backing-specific
};

// Whether the memory is there (a mapping, an fd or a backing's handle).
inline bool HasMemory(const SegmentMemory& m) {
  return m.base != nullptr || static_cast<bool>(m.fd) || m.handle != 0;
}

class SegmentBacking {
 public:
  virtual ~SegmentBacking() = default;
  // New, zeroed memory for segment `index`. The first call may adapt the backing (e.g. fall back
  // from huge pages) and is the one whose errors stop the daemon.
  virtual absl::StatusOr<SegmentMemory> Create(uint32_t index, uint64_t size) = 0;
  virtual void Destroy(SegmentMemory& memory, uint64_t size) = 0;
  // "normal 4 KiB pages, locked", "emulated device, 12 GB/s".
  virtual std::string Describe() const = 0;
};

// A segment as a client sees it.
struct SegmentInfo {
  uint32_t segment = 0;
  uint64_t generation = 0;
  uint64_t size = 0;
};

class SegmentPool final : public Tier {
 public:
  // `config` names the config section in messages ("host", "device").
  static absl::StatusOr<std::unique_ptr<SegmentPool>> Create(
      TierKind kind, absl::string_view config, uint64_t capacity, uint64_t segment_size,
      std::unique_ptr<SegmentBacking> backing);
  ~SegmentPool() override;

  TierKind kind() const override { return kind_; }
  uint64_t max_reservation() const override { return segment_size_; }
  absl::StatusOr<Placement> Reserve(uint32_t tenant, uint64_t size) override;
  void Unreserve(const Placement& placement) override;
  TierUsage Usage() const override;
  std::string Describe() const override;

  // A duplicate of the segment's fd, if the segment currently belongs to `tenant`; with
  // `read_only`, the memory opened anew for reading only, so that whoever maps it cannot write
  // it (a shared base's segment passed to a session that only reads it).
  absl::StatusOr<UniqueFd> SegmentFd(uint32_t segment, uint32_t tenant, SegmentInfo* info,
                                     bool read_only = false) const;
  // The tenant the segment belongs to now; kNoTenant when empty or out of range.
  uint32_t OwnerOf(uint32_t segment) const;
  // The segments that currently belong to `tenant`.
  std::vector<SegmentInfo> SegmentsOf(uint32_t tenant) const;
  // The daemon's own address of a placement (host pointer, or device pointer).
  void* Address(const Placement& placement) const override;

  // Calls `observer` now for every segment (`old_base` null), again whenever a segment gets new
  // memory (a recycle for another tenant: before the old memory is unmapped), and once more for
  // every segment when the observer is removed (`new_base` null), so that I/O engines and GPUs can
  // keep exactly the current memory registered. Returns an id for RemoveRemapObserver.
  using RemapObserver =
      std::function<void(uint32_t segment, void* old_base, void* new_base, size_t size)>;
  int AddRemapObserver(RemapObserver observer);
  void RemoveRemapObserver(int id);

  uint32_t segment_count() const { return segment_count_; }
  uint64_t segment_size() const { return segment_size_; }
  SegmentBacking* backing() const { return backing_.get(); }

 private:
  struct Segment {
    SegmentMemory memory;
    uint64_t generation = 0;
    uint32_t owner = kNoTenant;       // tenant whose chunks it holds; kNoTenant when empty
    uint32_t last_owner = kNoTenant;  // tenant whose data the memory may still contain
    std::unique_ptr<ExtentAllocator> allocator;
  };

  SegmentPool(TierKind kind, absl::string_view config, uint64_t capacity, uint64_t segment_size,
              std::unique_ptr<SegmentBacking> backing);
  absl::Status MapFresh(Segment& segment, uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  TierUsage UsageLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t LargestFreeLocked(uint32_t tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string DescribeLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TierKind kind_;
  const std::string config_;
  const uint64_t capacity_;
  const uint64_t segment_size_;
  const std::unique_ptr<SegmentBacking> backing_;
  // capacity / segment_size, set at creation: the segments are remapped, never added or removed.
  const uint32_t segment_count_;
  mutable absl::Mutex mu_;
  std::vector<Segment> segments_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::pair<int, RemapObserver>> observers_ ABSL_GUARDED_BY(mu_);
  int next_observer_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace tierd::daemon
