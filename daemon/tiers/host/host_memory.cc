#include "daemon/tiers/host/host_memory.h"

#include <fcntl.h>
#include <linux/memfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/fmt_absl.h"
#include "common/sizes.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {
namespace {

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

absl::Status CheckAvailable(uint64_t bytes, absl::string_view what) {
  std::optional<uint64_t> available = MemInfoBytes("MemAvailable");
  if (available && bytes > *available) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " needs ", FormatSize(bytes), " of RAM but only ", FormatSize(*available),
        " is available (MemAvailable in /proc/meminfo): lower it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SegmentPool>> CreateHostPool(const HostPoolOptions& options) {
  if (options.lock_memory && options.capacity > 0) {
    if (absl::Status s = CheckPinnable(options.capacity); !s.ok()) return s;
  } else if (absl::Status s = CheckAvailable(options.capacity, "host.capacity"); !s.ok()) {
    return s;
  }
  return SegmentPool::Create(
      TierKind::kHost, "host", options.capacity, options.segment_size,
      std::make_unique<MemfdBacking>("tierd-host", options.huge_pages, options.lock_memory));
}

MemfdBacking::MemfdBacking(std::string name, HugePagePolicy huge_pages, bool lock_memory)
    : name_(std::move(name)),
      policy_(huge_pages),
      lock_memory_(lock_memory),
      huge_pages_(huge_pages != HugePagePolicy::kNever) {}

absl::StatusOr<SegmentMemory> MemfdBacking::Create(uint32_t index, uint64_t size) {
  absl::StatusOr<SegmentMemory> memory = Map(index, size);
  if (!memory.ok() && !decided_ && huge_pages_ && policy_ == HugePagePolicy::kAuto) {
    spdlog::info("{}: huge pages unavailable ({}); using normal pages", name_,
                 memory.status().message());
    huge_pages_ = false;
    memory = Map(index, size);
  }
  if (memory.ok()) decided_ = true;
  return memory;
}

absl::StatusOr<SegmentMemory> MemfdBacking::Map(uint32_t index, uint64_t size) {
  std::string name = absl::StrCat(name_, "-", index);
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
                               absl::StrCat("mmap of segment ", index, " (", FormatSize(size),
                                            huge_pages_ ? ", huge pages" : "", ")"));
  }
  // The pages must not be shared copy-on-write with a child (a forked helper would otherwise pin
  // them in both processes and the first write would move them away from the DMA address).
  madvise(base, size, MADV_DONTFORK);
  if (lock_memory_ && mlock(base, size) != 0) {
    int err = errno;
    munmap(base, size);
    return absl::ErrnoToStatus(
        err, absl::StrCat("mlock of segment ", index, " (", FormatSize(size),
                          "): raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity) or lower the capacity"));
  }
  SegmentMemory memory;
  memory.fd = std::move(fd);
  memory.base = base;
  return memory;
}

void MemfdBacking::Destroy(SegmentMemory& memory, uint64_t size) {
  if (memory.base != nullptr) munmap(memory.base, size);
  memory.base = nullptr;
  memory.fd.Reset();
}

std::string MemfdBacking::Describe() const {
  return absl::StrCat("memfd, ", huge_pages_ ? "2 MiB huge pages" : "normal 4 KiB pages",
                      lock_memory_ ? ", locked" : ", NOT locked");
}

}  // namespace tierd::daemon
