// ChunkService: a chunk's birth and end (created, recovered from the index, freed, retired with
// its session), and the daemon's stop (writing persistent chunks down, waiting for the tiers).

#include "daemon/chunks/chunk_service.h"

#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cmath>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "common/fmt_absl.h"
#include "common/sizes.h"
#include "daemon/chunks/chunk_service_internal.h"
#include "daemon/util/log_limiter.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {

ChunkService::~ChunkService() { WaitForIdle(); }

void ChunkService::WaitForIdle() { mover_.WaitForIdle(); }

ChunkMeta& ChunkService::Insert(uint32_t tenant, SessionId owner, uint64_t size,
                                const Placement& home, const std::string& name, bool persistent) {
  ChunkMeta& chunk = chunks_.Insert(tenant, name, persistent);
  chunk.size = size;
  chunk.owner = owner;
  chunk.home = home.tier;
  chunk.allocated.insert(home.tier);
  chunk.resident.insert(home.tier);
  chunk.placement[home.tier] = home;
  chunk.memory_home = persistent && home.tier != TierKind::kNvme;
  return chunk;
}

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

void ChunkService::Retire(ChunkMeta& chunk) {
  if (chunk.state == ChunkState::kMoving) {
    chunk.doomed = true;  // AfterMove destroys it
    return;
  }
  waiters_.FailAll(chunk.id, Retired(chunk));
  Destroy(chunk);
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

void ChunkService::Destroy(ChunkMeta& chunk) {
  assert(chunk.state != ChunkState::kMoving);  // Retire defers it to the move's end
  for (TierKind t : kAllTiers) {
    if (chunk.allocated.contains(t)) space_.Release(chunk.tenant, chunk.placement[t]);
  }
  ledger_.AddChunks(chunk.tenant, -1);
  // A chunk at home in memory may have a record without a copy (or one being written): forgetting
  // a name the index does not hold costs nothing.
  if (chunk.persistent && tiers_.index != nullptr && (chunk.written || chunk.memory_home))
    tiers_.index->Forget(chunk.tenant, chunk.name);
  if (!chunk.persistent) {
    if (Sessions::State* owner = sessions_.Find(chunk.owner)) owner->owned.erase(chunk.id);
  }
  sessions_.ForgetLease(chunk.id);
  chunks_.Erase(chunk);
}

size_t ChunkService::CloseSession(const Session& session) {
  absl::MutexLock lock(&mu_);
  session.ended = true;
  std::optional<Sessions::State> state = sessions_.End(session.id);
  if (!state) return 0;
  schedules_.End(session);
  for (const auto& [id, pins] : state->pins) {
    waiters_.Forget(id, session.id);
    ChunkMeta& chunk = chunks_.at(id);
    for (uint32_t i = 0; i < pins.count; ++i) Unpin(chunk);
    chunk.writers -= pins.writes;
  }
  size_t freed = 0;
  for (ChunkId id : state->owned) {
    ChunkMeta& chunk = chunks_.at(id);
    assert(chunk.pins == 0);  // only its owner can pin a scratch chunk
    ++freed;
    Retire(chunk);
  }
  for (ChunkId id : chunks_.PersistentOf(session.peer.uid)) {
    if (std::optional<SessionId> holder = sessions_.Leave(id, session.id)) {
      chunks_.at(id).owner = *holder;
    }
  }
  room_.RetryQueuedFetches();
  room_freed_.SignalAll();
  return freed;
}

}  // namespace tierd::daemon
