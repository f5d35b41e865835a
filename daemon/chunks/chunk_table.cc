#include "daemon/chunks/chunk_table.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace tierd::daemon {

std::string ChunkTable::NameKey(uint32_t tenant, absl::string_view name) {
  return absl::StrCat(tenant, "/", name);
}

ChunkMeta& ChunkTable::Insert(uint32_t tenant, const std::string& name, bool persistent) {
  const ChunkId id = next_id_++;
  ChunkMeta& chunk = chunks_[id];
  chunk.id = id;
  chunk.tenant = tenant;
  chunk.name = name;
  chunk.persistent = persistent;
  if (!name.empty()) names_[NameKey(tenant, name)] = id;
  if (persistent) persistent_[tenant].insert(id);
  return chunk;
}

void ChunkTable::Erase(const ChunkMeta& chunk) {
  for (TierKind t : kAllTiers) {
    if (chunk.indexed.contains(t)) recency_[t].erase({chunk.indexed_use, chunk.id});
  }
  if (!chunk.name.empty()) names_.erase(NameKey(chunk.tenant, chunk.name));
  if (chunk.persistent) {
    auto it = persistent_.find(chunk.tenant);
    it->second.erase(chunk.id);
    if (it->second.empty()) persistent_.erase(it);
  }
  chunks_.erase(chunk.id);  // last: `chunk` is gone with it
}

void ChunkTable::Reindex(ChunkMeta& chunk) {
  for (TierKind t : kAllTiers) {
    const bool was = chunk.indexed.contains(t);
    const bool is = chunk.resident.contains(t);
    if (was && is && chunk.indexed_use == chunk.last_use) continue;
    if (was) recency_[t].erase({chunk.indexed_use, chunk.id});
    if (is) {
      recency_[t].insert({chunk.last_use, chunk.id});
      chunk.indexed.insert(t);
    } else {
      chunk.indexed.erase(t);
    }
  }
  chunk.indexed_use = chunk.last_use;
}

void ChunkTable::VisitOldestIn(TierKind tier, absl::FunctionRef<bool(ChunkMeta&)> visit) {
#ifdef TIERD_CHECK_INVARIANTS
  if (absl::Status s = CheckRecency(); !s.ok()) {
    std::fprintf(stderr, "chunk table: %s\n", std::string(s.message()).c_str());
    std::abort();
  }
#endif
  auto& index = recency_[tier];
  for (auto it = index.begin(); it != index.end();) {
    ChunkMeta& chunk = chunks_.at(it->second);
    if (!chunk.resident.contains(tier)) {  // gone since it was filed: forget it
      chunk.indexed.erase(tier);
      it = index.erase(it);
      continue;
    }
    if (!visit(chunk)) return;
    ++it;
  }
}

absl::Status ChunkTable::CheckRecency() const {
  for (const auto& [id, chunk] : chunks_) {
    for (TierKind t : kAllTiers) {
      if (!chunk.resident.contains(t)) continue;
      if (!chunk.indexed.contains(t) || chunk.indexed_use != chunk.last_use ||
          !recency_[t].contains({chunk.last_use, id})) {
        return absl::InternalError(absl::StrCat("chunk ", id, "'s copy in the ", TierName(t),
                                                " tier is not in the recency index at its last "
                                                "use ",
                                                chunk.last_use, ": a Reindex is missing"));
      }
    }
  }
  return absl::OkStatus();
}

ChunkMeta* ChunkTable::FindByName(uint32_t tenant, absl::string_view name) {
  auto it = names_.find(NameKey(tenant, name));
  return it == names_.end() ? nullptr : &chunks_.at(it->second);
}

const std::set<ChunkId>& ChunkTable::PersistentOf(uint32_t tenant) const {
  static const std::set<ChunkId> kNone;
  auto it = persistent_.find(tenant);
  return it == persistent_.end() ? kNone : it->second;
}

}  // namespace tierd::daemon
