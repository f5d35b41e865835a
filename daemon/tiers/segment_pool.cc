#include "daemon/tiers/segment_pool.h"

#include <fcntl.h>
#include <linux/memfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/fmt_absl.h"
#include "common/sizes.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {

SegmentPool::SegmentPool(TierKind kind, absl::string_view config, uint64_t capacity,
                         uint64_t segment_size, std::unique_ptr<SegmentBacking> backing)
    : kind_(kind),
      config_(config),
      capacity_(capacity),
      segment_size_(segment_size),
      backing_(std::move(backing)),
      segment_count_(static_cast<uint32_t>(capacity / segment_size)) {}

SegmentPool::~SegmentPool() {
  absl::MutexLock lock(&mu_);
  for (Segment& segment : segments_) {
    if (segment.memory.base != nullptr || segment.memory.fd) {
      backing_->Destroy(segment.memory, segment_size_);
    }
  }
}

absl::StatusOr<std::unique_ptr<SegmentPool>> SegmentPool::Create(
    TierKind kind, absl::string_view config, uint64_t capacity, uint64_t segment_size,
    std::unique_ptr<SegmentBacking> backing) {
  constexpr uint64_t kTwoMiB = 2 * kMiB;
  if (segment_size == 0 || segment_size % kTwoMiB != 0) {
    return absl::InvalidArgumentError(absl::StrCat(config, ".segment_size (",
                                                   FormatSize(segment_size),
                                                   ") must be a non-zero multiple of 2 MiB"));
  }
  if (capacity == 0 || capacity % segment_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        config, ".capacity (", FormatSize(capacity), ") must be a non-zero multiple of ", config,
        ".segment_size (", FormatSize(segment_size), ")"));
  }
  std::unique_ptr<SegmentPool> pool(
      new SegmentPool(kind, config, capacity, segment_size, std::move(backing)));
  absl::MutexLock lock(&pool->mu_);
  const uint32_t count = pool->segment_count_;
  pool->segments_.resize(count);
  for (uint32_t i = 0; i < count; ++i) {
    if (absl::Status s = pool->MapFresh(pool->segments_[i], i); !s.ok()) return s;
  }
  spdlog::info("{} tier: {}", TierName(kind), pool->DescribeLocked());
  return pool;
}

absl::Status SegmentPool::MapFresh(Segment& segment, uint32_t index) {
  // The old memory goes before the new is made (populated, and locked where the pool locks), so
  // that the pool never holds more than its capacity, not even for a moment: observers let go of
  // it (unregister it) while it is still mapped, then it is unmapped. A segment whose new memory
  // cannot be made is left without any (HasMemory) and made again when next picked.
  if (HasMemory(segment.memory)) {
    for (const auto& [id, observer] : observers_) {
      observer(index, segment.memory.base, nullptr, segment_size_);
    }
    backing_->Destroy(segment.memory, segment_size_);
    segment.memory = SegmentMemory();
  }
  absl::StatusOr<SegmentMemory> memory = backing_->Create(index, segment_size_);
  if (!memory.ok()) return memory.status();
  for (const auto& [id, observer] : observers_) {
    observer(index, nullptr, memory->base, segment_size_);
  }
  segment.memory = std::move(*memory);
  segment.generation += 1;
  segment.allocator = std::make_unique<ExtentAllocator>(segment_size_, kSegmentAlignment);
  return absl::OkStatus();
}

int SegmentPool::AddRemapObserver(RemapObserver observer) {
  absl::MutexLock lock(&mu_);
  for (uint32_t i = 0; i < segments_.size(); ++i) {
    observer(i, nullptr, segments_[i].memory.base, segment_size_);
  }
  observers_.emplace_back(next_observer_, std::move(observer));
  return next_observer_++;
}

void SegmentPool::RemoveRemapObserver(int id) {
  absl::MutexLock lock(&mu_);
  for (const auto& [observer_id, observer] : observers_) {
    if (observer_id != id) continue;
    for (uint32_t i = 0; i < segments_.size(); ++i) {
      observer(i, segments_[i].memory.base, nullptr, segment_size_);
    }
  }
  std::erase_if(observers_, [id](const auto& o) { return o.first == id; });
}

absl::StatusOr<Placement> SegmentPool::Reserve(uint32_t tenant, uint64_t size) {
  if (size == 0 || size > segment_size_) {
    return absl::InvalidArgumentError(absl::StrCat(
        TierName(kind_), " tier cannot hold a chunk of ", size, " bytes: chunks must be 1 byte to ",
        FormatSize(segment_size_), " (", config_, ".segment_size)"));
  }
  absl::MutexLock lock(&mu_);
  // Prefer the fullest of the tenant's segments that fits, to keep whole segments free for other
  // tenants and for large chunks.
  Segment* best = nullptr;
  uint32_t best_index = 0;
  for (uint32_t i = 0; i < segments_.size(); ++i) {
    Segment& s = segments_[i];
    if (s.owner != tenant || s.allocator->largest_free() < s.allocator->RoundUp(size)) continue;
    if (best == nullptr || s.allocator->free_bytes() < best->allocator->free_bytes()) {
      best = &s;
      best_index = i;
    }
  }
  if (best == nullptr) {
    // An empty segment: one that last held this tenant's data needs no recycling.
    for (uint32_t i = 0; i < segments_.size(); ++i) {
      Segment& s = segments_[i];
      if (s.owner != kNoTenant) continue;
      if (best == nullptr || (s.last_owner == tenant && best->last_owner != tenant)) {
        best = &s;
        best_index = i;
      }
    }
    if (best != nullptr) {
      if (!HasMemory(best->memory) ||
          (best->last_owner != kNoTenant && best->last_owner != tenant)) {
        if (absl::Status s = MapFresh(*best, best_index); !s.ok()) return s;
      }
      best->owner = tenant;
      best->last_owner = tenant;
    }
  }
  if (best == nullptr) {
    TierUsage usage = UsageLocked();
    return absl::ResourceExhaustedError(absl::StrCat(
        TierName(kind_), " tier full: no room for ", FormatSize(size), " for uid ", tenant, ": ",
        FormatSize(usage.used_bytes), " of ", FormatSize(usage.capacity_bytes), " in use (",
        segments_.size(), " segments of ", FormatSize(segment_size_),
        "), largest free extent of this tenant ", FormatSize(LargestFreeLocked(tenant)),
        "; free chunks or raise ", config_, ".capacity"));
  }
  std::optional<uint64_t> offset = best->allocator->Allocate(size);
  assert(offset.has_value());
  const uint64_t reserved = best->allocator->RoundUp(size);
  used_bytes_ += reserved;
  return Placement{kind_, best_index, best->generation, *offset, reserved};
}

void SegmentPool::Unreserve(const Placement& placement) {
  absl::MutexLock lock(&mu_);
  assert(placement.segment < segments_.size());
  Segment& s = segments_[placement.segment];
  assert(s.generation == placement.generation);
  s.allocator->Free(placement.offset, placement.size);
  used_bytes_ -= placement.size;
  if (s.allocator->used_bytes() == 0) s.owner = kNoTenant;
}

TierUsage SegmentPool::Usage() const {
  absl::MutexLock lock(&mu_);
  return UsageLocked();
}

TierUsage SegmentPool::UsageLocked() const {
  TierUsage usage;
  usage.capacity_bytes = capacity_;
  usage.used_bytes = used_bytes_;
  for (const Segment& s : segments_) {
    uint64_t largest = s.owner == kNoTenant ? segment_size_ : s.allocator->largest_free();
    usage.largest_free_bytes = std::max(usage.largest_free_bytes, largest);
  }
  return usage;
}

uint64_t SegmentPool::LargestFreeLocked(uint32_t tenant) const {
  uint64_t largest = 0;
  for (const Segment& s : segments_) {
    if (s.owner == tenant) largest = std::max(largest, s.allocator->largest_free());
  }
  return largest;
}

std::string SegmentPool::Describe() const {
  absl::MutexLock lock(&mu_);
  return DescribeLocked();
}

std::string SegmentPool::DescribeLocked() const {
  return absl::StrCat(segments_.size(), " segments of ", FormatSize(segment_size_), " (",
                      FormatSize(capacity_), "), ", backing_->Describe());
}

uint32_t SegmentPool::OwnerOf(uint32_t segment) const {
  absl::MutexLock lock(&mu_);
  return segment < segments_.size() ? segments_[segment].owner : kNoTenant;
}

absl::StatusOr<UniqueFd> SegmentPool::SegmentFd(uint32_t segment, uint32_t tenant,
                                                SegmentInfo* info, bool read_only) const {
  absl::MutexLock lock(&mu_);
  if (segment >= segments_.size()) {
    return absl::NotFoundError(absl::StrCat(
        "host segment ", segment, " does not exist (the pool has ", segments_.size(), ")"));
  }
  const Segment& s = segments_[segment];
  if (s.owner != tenant) {
    return absl::PermissionDeniedError(absl::StrCat(TierName(kind_), " segment ", segment,
                                                    " does not hold chunks of uid ", tenant));
  }
  UniqueFd fd;
  if (read_only) {
    // A new open file description, read-only: mmap with PROT_WRITE and MAP_SHARED fails on it.
    const std::string path = absl::StrCat("/proc/self/fd/", s.memory.fd.get());
    fd = UniqueFd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return absl::ErrnoToStatus(errno, "reopening a host segment read-only");
  } else {
    fd = UniqueFd(fcntl(s.memory.fd.get(), F_DUPFD_CLOEXEC, 0));
    if (!fd) return absl::ErrnoToStatus(errno, "dup of a host segment fd");
  }
  if (info != nullptr) *info = SegmentInfo{segment, s.generation, segment_size_};
  return fd;
}

std::vector<SegmentInfo> SegmentPool::SegmentsOf(uint32_t tenant) const {
  absl::MutexLock lock(&mu_);
  std::vector<SegmentInfo> out;
  for (uint32_t i = 0; i < segments_.size(); ++i) {
    if (segments_[i].owner == tenant) {
      out.push_back({i, segments_[i].generation, segment_size_});
    }
  }
  return out;
}

void* SegmentPool::Address(const Placement& placement) const {
  absl::MutexLock lock(&mu_);
  const Segment& s = segments_[placement.segment];
  assert(s.generation == placement.generation);
  return static_cast<char*>(s.memory.base) + placement.offset;
}

}  // namespace tierd::daemon
