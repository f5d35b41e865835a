// The index of persistent chunks on NVMe: an append-only log of checksummed one-block records in
// an area of region 0, split in two halves that take turns. Each record is made durable
// (fdatasync) before the call returns; when the active half fills, the live entries are written to
// the other half under a higher generation, and only then is that half's header written, so a
// crash at any point leaves one complete, valid half. On open, torn or corrupt records are logged
// and skipped, never trusted. Format: docs/architecture.md, "The NVMe tier on disk".
//
// Not thread-safe: the NVMe tier calls it from its one worker thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "daemon/tiers/index_entry.h"
#include "daemon/tiers/nvme/nvme_region.h"

namespace tierd::daemon {

class NvmeIndex {
 public:
  // `fresh`: the area is new (formatted now); otherwise the log is replayed.
  static absl::StatusOr<std::unique_ptr<NvmeIndex>> Open(const NvmeRegion* region, uint64_t offset,
                                                         uint64_t bytes, bool fresh);

  // Live entries by "tenant/name".
  const absl::flat_hash_map<std::string, IndexEntry>& entries() const { return entries_; }
  static std::string Key(uint32_t tenant, const std::string& name);

  // Durably records `entry`, replacing any entry of the same tenant and name.
  absl::Status Put(const IndexEntry& entry);
  // Durably removes the entry, if there is one.
  absl::Status Remove(uint32_t tenant, const std::string& name);

  size_t skipped_records() const { return skipped_; }
  uint64_t generation() const { return generation_; }
  size_t capacity_records() const { return half_blocks_ - 1; }

 private:
  NvmeIndex(const NvmeRegion* region, uint64_t offset, uint64_t bytes);
  absl::Status Replay();
  absl::Status Append(int type, const IndexEntry& entry);
  absl::Status Compact();
  absl::Status WriteHeader(int half, uint64_t generation);
  void Encode(int type, const IndexEntry& entry, uint64_t generation, char* block);
  void Apply(int type, IndexEntry entry);
  uint64_t HalfOffset(int half) const { return offset_ + half * half_blocks_ * block_; }

  const NvmeRegion* region_;
  const uint64_t offset_;
  const uint32_t block_;
  const uint64_t half_blocks_;
  int active_ = 0;
  uint64_t generation_ = 0;
  uint64_t tail_ = 1;  // next block of the active half (block 0 is the header)
  uint64_t sequence_ = 0;
  size_t skipped_ = 0;
  absl::flat_hash_map<std::string, IndexEntry> entries_;
  std::map<uint64_t, std::string> by_offset_;  // logical offset -> key, to find stale overlaps
};

}  // namespace tierd::daemon
