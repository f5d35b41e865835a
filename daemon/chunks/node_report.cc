#include "daemon/chunks/node_report.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

namespace tierd::daemon {

namespace {

uint32_t PageSize(uint32_t asked) {
  return std::min(asked == 0 ? kDefaultPageSize : asked, kMaxPageSize);
}

}  // namespace

ChunkPage NodeReport::SessionChunks(const Session& session, ChunkId page_token,
                                    uint32_t page_size) const {
  page_size = PageSize(page_size);
  static const std::set<ChunkId> kNone;
  const std::set<ChunkId>* owned = &kNone;
  if (const SessionLedger::State* state = sessions_.Find(session.id)) owned = &state->owned;
  const std::set<ChunkId>* persistent = &chunks_.PersistentOf(session.peer.uid);
  ChunkPage page;
  auto a = owned->lower_bound(page_token);
  auto b = persistent->lower_bound(page_token);
  while (a != owned->end() || b != persistent->end()) {
    ChunkId next;
    if (b == persistent->end() || (a != owned->end() && *a < *b)) {
      next = *a++;
    } else {
      next = *b++;
    }
    if (page.chunks.size() == page_size) {
      page.next_page_token = next;
      break;
    }
    page.chunks.push_back(chunks_.at(next));
  }
  return page;
}

ChunkPage NodeReport::AllChunks(ChunkId page_token, uint32_t page_size) const {
  page_size = PageSize(page_size);
  std::vector<ChunkId> ids;
  for (const auto& [id, chunk] : chunks_) {
    if (id >= page_token) ids.push_back(id);
  }
  ChunkPage page;
  const size_t n = std::min<size_t>(ids.size(), page_size);
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end());
  for (size_t i = 0; i < n; ++i) {
    const ChunkMeta& chunk = chunks_.at(ids[i]);
    page.chunks.push_back(chunk);
    if (chunk.base == 0) continue;
    if (std::string name = bases_.NameOf(chunk.base); !name.empty()) page.bases[chunk.base] = name;
  }
  if (ids.size() > n) page.next_page_token = *std::min_element(ids.begin() + n, ids.end());
  return page;
}

std::map<SessionId, SessionHoldings> NodeReport::Holdings() const {
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

NodeStats NodeReport::Stats() const {
  NodeStats out;
  out.totals = sessions_.totals();
  for (const auto& [id, c] : chunks_) {
    ++(c.state == ChunkState::kMoving ? out.chunks_moving : out.chunks_ready);
    if (c.pins > 0) ++out.chunks_pinned;
    if (c.persistent) ++out.chunks_persistent;
    for (TierKind t : kAllTiers) {
      if (c.pins > 0 && c.allocated.contains(t)) out.pinned_bytes[t] += c.size;
      if (!c.resident.contains(t)) continue;
      ++out.resident_chunks[t];
      out.resident_bytes[t] += c.size;
      if (c.base != 0) out.shared_base_bytes[t] += c.size;
    }
  }
  out.shared_bases = bases_.size();
  out.shared_base_holders = bases_.holders();
  const PathArray<PathLoad> load = meter_.Load();
  for (Path p : kAllPaths) {
    out.in_flight[p] = load[p].in_flight;
    out.queued_bytes[p] = load[p].queued_bytes;
  }
  return out;
}

}  // namespace tierd::daemon
