#include "daemon/host_segment_pool.h"

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

namespace tierd {

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

namespace {

constexpr uint64_t kHugePageSize = 2 * kMiB;
constexpr int kCapIpcLock = 14;

// Reads a "Key:   value kB" line of /proc/meminfo.
std::optional<uint64_t> MemInfoBytes(absl::string_view key) {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (!absl::StartsWith(line, key) || line.size() <= key.size() || line[key.size()] != ':') {
      continue;
    }
    uint64_t kib = 0;
    std::string value = line.substr(key.size() + 1);
    value = value.substr(0, value.find("kB"));
    if (absl::SimpleAtoi(value, &kib)) return kib * kKiB;
  }
  return std::nullopt;
}

bool HasCapIpcLock() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapEff:", 0) == 0) {
      uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
      return (caps >> kCapIpcLock) & 1;
    }
  }
  return false;
}

}  // namespace

absl::Status CheckPinnable(uint64_t bytes) {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) {
    return absl::ErrnoToStatus(errno, "getrlimit(RLIMIT_MEMLOCK)");
  }
  if (limit.rlim_cur != RLIM_INFINITY && limit.rlim_cur < bytes && !HasCapIpcLock()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the host tier needs to pin ", FormatSize(bytes), " but RLIMIT_MEMLOCK is ",
        FormatSize(limit.rlim_cur),
        ": set LimitMEMLOCK=infinity in the systemd unit, run 'ulimit -l unlimited' before "
        "starting tierd, or lower host.capacity"));
  }
  std::optional<uint64_t> available = MemInfoBytes("MemAvailable");
  if (available && bytes > *available) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the host tier needs to pin ", FormatSize(bytes), " but only ", FormatSize(*available),
        " of RAM is available (MemAvailable in /proc/meminfo): lower host.capacity"));
  }
  return absl::OkStatus();
}

HostSegmentPool::HostSegmentPool(const HostPoolOptions& options) : options_(options) {}

HostSegmentPool::~HostSegmentPool() {
  absl::MutexLock lock(&mu_);
  for (Segment& segment : segments_) Unmap(segment);
}

absl::StatusOr<std::unique_ptr<HostSegmentPool>> HostSegmentPool::Create(
    const HostPoolOptions& options) {
  if (options.segment_size == 0 || options.segment_size % kHugePageSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat("host.segment_size (",
                                                   FormatSize(options.segment_size),
                                                   ") must be a non-zero multiple of 2 MiB"));
  }
  if (options.capacity == 0 || options.capacity % options.segment_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host.capacity (", FormatSize(options.capacity), ") must be a non-zero multiple of ",
        "host.segment_size (", FormatSize(options.segment_size), ")"));
  }
  if (options.lock_memory) {
    if (absl::Status s = CheckPinnable(options.capacity); !s.ok()) return s;
  }

  std::unique_ptr<HostSegmentPool> pool(new HostSegmentPool(options));
  absl::MutexLock lock(&pool->mu_);
  const uint32_t count = static_cast<uint32_t>(options.capacity / options.segment_size);
  pool->huge_pages_ = options.huge_pages != HugePagePolicy::kNever;
  pool->segments_.resize(count);
  for (uint32_t i = 0; i < count; ++i) {
    absl::Status s = pool->MapFresh(pool->segments_[i], i);
    if (!s.ok() && i == 0 && pool->huge_pages_ && options.huge_pages == HugePagePolicy::kAuto) {
      spdlog::info("host tier: huge pages unavailable ({}); using normal pages", s.message());
      pool->huge_pages_ = false;
      s = pool->MapFresh(pool->segments_[i], i);
    }
    if (!s.ok()) return s;
  }
  spdlog::info("host tier: {}", pool->DescribeLocked());
  return pool;
}

absl::Status HostSegmentPool::MapFresh(Segment& segment, uint32_t index) {
  const uint64_t size = options_.segment_size;
  std::string name = absl::StrCat("tierd-host-", index);
  unsigned flags = MFD_CLOEXEC | (huge_pages_ ? (MFD_HUGETLB | MFD_HUGE_2MB) : 0);
  UniqueFd fd(memfd_create(name.c_str(), flags));
  if (!fd) return absl::ErrnoToStatus(errno, absl::StrCat("memfd_create(", name, ")"));
  if (ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("ftruncate(", name, ", ", size, ")"));
  }
  // MFD_HUGETLB creation and ftruncate succeed even with no huge pages reserved; the mapping is
  // where a shortage shows, so map (and populate) before trusting the segment.
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
  if (base == MAP_FAILED) {
    return absl::ErrnoToStatus(errno,
                               absl::StrCat("mmap of host segment ", index, " (", FormatSize(size),
                                            huge_pages_ ? ", huge pages" : "", ")"));
  }
  // The pages must not be shared copy-on-write with a child (a forked helper would otherwise pin
  // them in both processes and the first write would move them away from the DMA address).
  madvise(base, size, MADV_DONTFORK);
  if (options_.lock_memory && mlock(base, size) != 0) {
    int err = errno;
    munmap(base, size);
    return absl::ErrnoToStatus(
        err,
        absl::StrCat("mlock of host segment ", index, " (", FormatSize(size),
                     "): raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity) or lower host.capacity"));
  }
  Unmap(segment);
  segment.fd = std::move(fd);
  segment.base = base;
  segment.generation += 1;
  segment.allocator = std::make_unique<ExtentAllocator>(size, kHostAlignment);
  if (observer_) observer_(index, base, size);
  return absl::OkStatus();
}

void HostSegmentPool::SetRemapObserver(RemapObserver observer) {
  absl::MutexLock lock(&mu_);
  observer_ = std::move(observer);
  for (uint32_t i = 0; i < segments_.size(); ++i) {
    if (observer_) observer_(i, segments_[i].base, options_.segment_size);
  }
}

void HostSegmentPool::Unmap(Segment& segment) {
  if (segment.base != nullptr) munmap(segment.base, options_.segment_size);
  segment.base = nullptr;
  segment.fd.Reset();
}

absl::StatusOr<Placement> HostSegmentPool::Reserve(uint32_t tenant, uint64_t size) {
  if (size == 0 || size > options_.segment_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("host tier cannot hold a chunk of ", size, " bytes: chunks must be 1 byte to ",
                     FormatSize(options_.segment_size), " (host.segment_size)"));
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
      if (best->last_owner != kNoTenant && best->last_owner != tenant) {
        if (absl::Status s = MapFresh(*best, best_index); !s.ok()) return s;
      }
      best->owner = tenant;
      best->last_owner = tenant;
    }
  }
  if (best == nullptr) {
    TierUsage usage = UsageLocked();
    return absl::ResourceExhaustedError(absl::StrCat(
        "host tier full: no room for ", FormatSize(size), " for uid ", tenant, ": ",
        FormatSize(usage.used_bytes), " of ", FormatSize(usage.capacity_bytes), " in use (",
        segments_.size(), " segments of ", FormatSize(options_.segment_size),
        "), largest free extent of this tenant ", FormatSize(LargestFreeLocked(tenant)),
        "; free chunks or raise host.capacity"));
  }
  std::optional<uint64_t> offset = best->allocator->Allocate(size);
  assert(offset.has_value());
  const uint64_t reserved = best->allocator->RoundUp(size);
  used_bytes_ += reserved;
  return Placement{TierKind::kHost, best_index, best->generation, *offset, reserved};
}

void HostSegmentPool::Unreserve(const Placement& placement) {
  absl::MutexLock lock(&mu_);
  assert(placement.segment < segments_.size());
  Segment& s = segments_[placement.segment];
  assert(s.generation == placement.generation);
  s.allocator->Free(placement.offset, placement.size);
  used_bytes_ -= placement.size;
  if (s.allocator->used_bytes() == 0) s.owner = kNoTenant;
}

TierUsage HostSegmentPool::Usage() const {
  absl::MutexLock lock(&mu_);
  return UsageLocked();
}

TierUsage HostSegmentPool::UsageLocked() const {
  TierUsage usage;
  usage.capacity_bytes = options_.capacity;
  usage.used_bytes = used_bytes_;
  for (const Segment& s : segments_) {
    uint64_t largest = s.owner == kNoTenant ? options_.segment_size : s.allocator->largest_free();
    usage.largest_free_bytes = std::max(usage.largest_free_bytes, largest);
  }
  return usage;
}

uint64_t HostSegmentPool::LargestFreeLocked(uint32_t tenant) const {
  uint64_t largest = 0;
  for (const Segment& s : segments_) {
    if (s.owner == tenant) largest = std::max(largest, s.allocator->largest_free());
  }
  return largest;
}

std::string HostSegmentPool::Describe() const {
  absl::MutexLock lock(&mu_);
  return DescribeLocked();
}

std::string HostSegmentPool::DescribeLocked() const {
  return absl::StrCat(segments_.size(), " memfd segments of ", FormatSize(options_.segment_size),
                      " (", FormatSize(options_.capacity), "), ",
                      huge_pages_ ? "2 MiB huge pages" : "normal 4 KiB pages",
                      options_.lock_memory ? ", locked" : ", NOT locked");
}

absl::StatusOr<UniqueFd> HostSegmentPool::SegmentFd(uint32_t segment, uint32_t tenant,
                                                    SegmentInfo* info) const {
  absl::MutexLock lock(&mu_);
  if (segment >= segments_.size()) {
    return absl::NotFoundError(absl::StrCat(
        "host segment ", segment, " does not exist (the pool has ", segments_.size(), ")"));
  }
  const Segment& s = segments_[segment];
  if (s.owner != tenant) {
    return absl::PermissionDeniedError(
        absl::StrCat("host segment ", segment, " does not hold chunks of uid ", tenant));
  }
  UniqueFd fd(fcntl(s.fd.get(), F_DUPFD_CLOEXEC, 0));
  if (!fd) return absl::ErrnoToStatus(errno, "dup of a host segment fd");
  if (info != nullptr) *info = SegmentInfo{segment, s.generation, options_.segment_size};
  return fd;
}

std::vector<SegmentInfo> HostSegmentPool::SegmentsOf(uint32_t tenant) const {
  absl::MutexLock lock(&mu_);
  std::vector<SegmentInfo> out;
  for (uint32_t i = 0; i < segments_.size(); ++i) {
    if (segments_[i].owner == tenant) {
      out.push_back({i, segments_[i].generation, options_.segment_size});
    }
  }
  return out;
}

void* HostSegmentPool::Address(const Placement& placement) const {
  absl::MutexLock lock(&mu_);
  const Segment& s = segments_[placement.segment];
  assert(s.generation == placement.generation);
  return static_cast<char*>(s.base) + placement.offset;
}

}  // namespace tierd
