// ChunkService: operators' requests over every session's chunks (drain a tier, list the node,
// what each session and job holds) and the node-wide figures the metrics endpoint reads.

#include "daemon/chunks/chunk_service.h"

#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <optional>

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

bool IsOperator(const Session& session) {
  return session.peer.uid == 0 || session.peer.uid == geteuid();
}
namespace {

absl::Status CheckOperator(const Session& session, absl::string_view what) {
  if (IsOperator(session)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      what, " acts on every session's chunks: only root or the daemon's own user (uid ", geteuid(),
      ") may; ", session.Describe(), " is neither"));
}

}  // namespace

absl::StatusOr<DrainResult> ChunkService::Drain(const Session& session, TierKind tier,
                                                std::span<const ChunkId> ids) {
  if (absl::Status s = CheckOperator(session, "Drain"); !s.ok()) return s;
  if (absl::Status s = CheckTier(tier, "Drain"); !s.ok()) return s;
  const std::optional<TierKind> down = Below(tier);
  if (!down) {
    return absl::InvalidArgumentError(
        "Drain: the NVMe tier is the bottom tier; its chunks leave it only when freed");
  }
  const TierKind below = *down;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  if (hop(PathDown(tier)) == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("Drain: this daemon has no ", TierName(below),
                                                      " tier to move the ", TierName(tier),
                                                      " tier's chunks into"));
  }
  auto in_tier = [tier](const ChunkMeta& chunk) {
    return chunk.resident.contains(tier) ||
           (chunk.state == ChunkState::kMoving && chunk.moving_to == tier);
  };
  std::vector<ChunkMeta*> chunks;
  if (ids.empty()) {
    for (auto& [id, chunk] : chunks_) {
      if (in_tier(chunk)) chunks.push_back(&chunk);
    }
  } else {
    if (absl::Status s = CheckBatch(ids.size(), "Drain"); !s.ok()) return s;
    for (ChunkId id : ids) {
      auto it = chunks_.find(id);
      if (it == chunks_.end()) {
        return absl::NotFoundError(absl::StrCat("chunk ", id, " does not exist"));
      }
      if (in_tier(it->second)) chunks.push_back(&it->second);
    }
  }
  absl::StatusOr<std::shared_ptr<Batch>> batch = NewBatch(session);
  if (!batch.ok()) return batch.status();
  DrainResult result{.token = (*batch)->token};
  for (ChunkMeta* chunk : chunks) {
    if (chunk->pins > 0) {
      ++result.pinned;
      continue;
    }
    if (!CheckEvictable(*chunk, below).ok()) continue;  // no copy above `below`: nothing to move
    ++result.chunks;
    result.bytes += chunk->size;
    EvictOne(*chunk, below, /*keep_source=*/false, *batch, session.id);
  }
  spdlog::info("{} drains the {} tier: {} chunks ({}) moving to the {} tier, {} acquired left",
               session.Describe(), TierName(tier), result.chunks, FormatSize(result.bytes),
               TierName(below), result.pinned);
  (*batch)->Done(absl::OkStatus());
  return result;
}

absl::StatusOr<ChunkPage> ChunkService::ListAll(const Session& session, ChunkId page_token,
                                                uint32_t page_size) const {
  if (absl::Status s = CheckOperator(session, "ListChunks(all_sessions)"); !s.ok()) return s;
  if (page_size == 0) page_size = kDefaultPageSize;
  page_size = std::min(page_size, kMaxPageSize);
  absl::MutexLock lock(&mu_);
  std::vector<ChunkId> ids;
  for (const auto& [id, chunk] : chunks_) {
    if (id >= page_token) ids.push_back(id);
  }
  ChunkPage page;
  const size_t n = std::min<size_t>(ids.size(), page_size);
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end());
  for (size_t i = 0; i < n; ++i) page.chunks.push_back(chunks_.at(ids[i]));
  if (ids.size() > n) page.next_page_token = *std::min_element(ids.begin() + n, ids.end());
  return page;
}

std::map<SessionId, SessionHoldings> ChunkService::Holdings() const {
  absl::MutexLock lock(&mu_);
  std::map<SessionId, SessionHoldings> out;
  for (const auto& [id, state] : sessions_.all()) {
    SessionHoldings& h = out[id];
    h.chunks = state.owned.size();
    for (ChunkId c : state.owned) h.bytes += chunks_.at(c).size;
    h.pinned = state.pins.size();
    for (uint64_t b : state.moved) h.moved_bytes += b;
  }
  // Persistent chunks are the tenant's, but held by the live sessions with a lease on them.
  for (const auto& [id, lease] : sessions_.leases()) {
    for (SessionId holder : lease.holders) {
      auto it = out.find(holder);
      if (it == out.end()) continue;
      ++it->second.chunks;
      it->second.bytes += chunks_.at(id).size;
    }
  }
  return out;
}

std::map<std::string, PathArray<uint64_t>> ChunkService::JobTraffic() const {
  absl::MutexLock lock(&mu_);
  return sessions_.JobTraffic();
}

size_t ChunkService::chunk_count() const {
  absl::MutexLock lock(&mu_);
  return chunks_.size();
}

NodeStats ChunkService::node_stats() const {
  absl::MutexLock lock(&mu_);
  NodeStats out;
  out.totals = sessions_.totals();
  for (const auto& [id, c] : chunks_) {
    ++(c.state == ChunkState::kMoving ? out.chunks_moving : out.chunks_ready);
    if (c.pins > 0) ++out.chunks_pinned;
    if (c.persistent) ++out.chunks_persistent;
    for (TierKind t : {TierKind::kDevice, TierKind::kHost, TierKind::kNvme}) {
      if (c.pins > 0 && c.allocated.contains(t)) out.pinned_bytes[t] += c.size;
      if (!c.resident.contains(t)) continue;
      ++out.resident_chunks[t];
      out.resident_bytes[t] += c.size;
    }
  }
  const PathArray<PathLoad> load = meter_.Load();
  for (Path p : kAllPaths) {
    out.in_flight[p] = load[p].in_flight;
    out.queued_bytes[p] = load[p].queued_bytes;
  }
  return out;
}

}  // namespace tierd::daemon
