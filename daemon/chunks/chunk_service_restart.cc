// The chunk service's side of a daemon's restart: the persistent chunks the NVMe index holds,
// re-created at start-up, and those whose current version is only in memory, written down at a
// clean stop (docs/architecture.md, "The NVMe tier").
#include "daemon/chunks/chunk_service.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/fmt_absl.h"
#include "common/sizes.h"
#include "daemon/chunks/batch.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {

size_t ChunkService::Recover(const std::vector<IndexEntry>& entries) {
  absl::MutexLock lock(&mu_);
  size_t recovered = 0;
  for (const IndexEntry& e : entries) {
    Placement p{TierKind::kNvme, 0, 0, e.offset, e.reserved};
    const bool has_copy = e.reserved != 0;
    if (has_copy && (tiers_.index == nullptr || !tiers_.index->Claim(p))) {
      spdlog::error("NVMe index: persistent chunk '{}' of uid {} overlaps another; not recovered",
                    e.name, e.tenant);
      continue;
    }
    // Counted against the user's quota and chunk limit, which they may now exceed: that blocks new
    // allocations, never the recovery of what was stored.
    if (has_copy) ledger_.AddBytes(e.tenant, TierKind::kNvme, p.size);
    ledger_.AddChunks(e.tenant, 1);
    ChunkMeta& chunk = Insert(e.tenant, /*owner=*/0, e.chunk_size, p, e.name, /*persistent=*/true);
    chunk.memory_home = e.memory_home;
    chunk.checksum = e.checksum;
    chunk.written = has_copy;
    if (!has_copy) chunk.allocated = TierSet();
    if (e.in_memory || !has_copy) {
      // Its current version was in memory when the daemon stopped without writing it down: what
      // NVMe holds (if anything) is older. Kept, named, until its owner frees it.
      chunk.lost = true;
      chunk.marked = true;
      chunk.resident = TierSet();
      chunks_.Reindex(chunk);
      spdlog::error(
          "persistent chunk '{}' of uid {} was lost: its current version was in memory when the "
          "daemon stopped without a clean shutdown; opening it fails with DATA_LOSS until it is "
          "freed",
          e.name, e.tenant);
      continue;
    }
    ++recovered;
  }
  return recovered;
}

size_t ChunkService::WriteDownForStop() {
  constexpr size_t kNamed = 16;  // chunks named in the log; the rest are counted
  auto batch = std::make_shared<Batch>();
  absl::Notification written;
  batch->on_done = [&written](const absl::Status&) { written.Notify(); };
  std::vector<ChunkId> ids;
  uint64_t bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [tenant, set] : chunks_.persistent()) {
      for (ChunkId id : set) {
        ChunkMeta& chunk = chunks_.at(id);
        const bool in_memory =
            chunk.state == ChunkState::kMoving ||
            (!chunk.resident.empty() && !chunk.resident.contains(TierKind::kNvme));
        if (chunk.lost || !in_memory) continue;
        ids.push_back(id);
        bytes += chunk.size;
        if (hop(Path::kHostToNvme) == nullptr) continue;
        if (absl::Status s = CheckEvictable(chunk, TierKind::kNvme); !s.ok()) {
          batch->Add();
          batch->Done(s);
          continue;
        }
        EvictOne(chunk, TierKind::kNvme, /*keep_source=*/false, batch, /*session=*/0);
      }
    }
  }
  if (ids.empty()) {
    batch->Done(absl::OkStatus());
    return 0;
  }
  if (hop(Path::kHostToNvme) == nullptr) {
    spdlog::warn(
        "{} persistent chunks ({}) lived in host memory only (no NVMe tier): lost with "
        "this stop",
        ids.size(), FormatSize(bytes));
    batch->Done(absl::OkStatus());
    return ids.size();
  }
  spdlog::info(
      "stopping: writing {} persistent chunks ({}) whose current version is in memory "
      "to NVMe",
      ids.size(), FormatSize(bytes));
  const absl::Time start = clock_.Now();
  batch->Done(absl::OkStatus());
  written.WaitForNotification();
  absl::MutexLock lock(&mu_);
  size_t failed = 0;
  for (ChunkId id : ids) {
    auto it = chunks_.find(id);
    if (it == chunks_.end() || it->second.resident.contains(TierKind::kNvme)) continue;
    if (++failed <= kNamed) {
      spdlog::error("persistent chunk '{}' of uid {} could not be written to NVMe: {}",
                    it->second.name, it->second.tenant,
                    it->second.marked ? "the next start reports it lost"
                                      : "the next start finds its last copy there, if any");
    }
  }
  if (failed > 0) {
    spdlog::error("{} of {} persistent chunks could not be written to NVMe ({} named above): {}",
                  failed, ids.size(), std::min(failed, kNamed), batch->Status().message());
  } else {
    spdlog::info("stopping: {} persistent chunks written to NVMe in {:.2f} s", ids.size(),
                 absl::ToDoubleSeconds(clock_.Now() - start));
  }
  return failed;
}

}  // namespace tierd::daemon
