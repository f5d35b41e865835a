// The host tier's memory: pinned memfd segments, on 2 MiB huge pages when the system has them
// reserved. The pool pins all of it once at start-up.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/tiers/segment_pool.h"

namespace tierd::daemon {

enum class HugePagePolicy { kAuto, kNever, kRequire };

struct HostPoolOptions {
  uint64_t capacity = 0;      // bytes; a multiple of segment_size
  uint64_t segment_size = 0;  // bytes; also the largest chunk; a multiple of 2 MiB
  HugePagePolicy huge_pages = HugePagePolicy::kAuto;
  bool lock_memory = true;  // mlock the segments (pinning); tests of error paths may disable it
};

// Checks RLIMIT_MEMLOCK and available memory, then creates, maps, populates and locks every
// segment. The error says which limit to raise.
absl::StatusOr<std::unique_ptr<SegmentPool>> CreateHostPool(const HostPoolOptions& options);

// Checks that `bytes` can be locked and are available; the error names the limit to raise.
absl::Status CheckPinnable(uint64_t bytes);
// Checks that `bytes` of RAM are available (MemAvailable) for `what`, which the error names.
absl::Status CheckAvailable(uint64_t bytes, absl::string_view what);

// Shared memory in memfd segments, optionally locked and on huge pages. Also the emulated device's
// memory.
class MemfdBacking final : public SegmentBacking {
 public:
  MemfdBacking(std::string name, HugePagePolicy huge_pages, bool lock_memory);
  absl::StatusOr<SegmentMemory> Create(uint32_t index, uint64_t size) override;
  void Destroy(SegmentMemory& memory, uint64_t size) override;
  std::string Describe() const override;
  bool huge_pages() const { return huge_pages_; }

 private:
  absl::StatusOr<SegmentMemory> Map(uint32_t index, uint64_t size);

  const std::string name_;
  const HugePagePolicy policy_;
  const bool lock_memory_;
  bool huge_pages_;
  bool decided_ = false;  // the first segment decides between huge and normal pages
};

}  // namespace tierd::daemon
