#include "daemon/chunks/chunk_table.h"

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
  if (!chunk.name.empty()) names_.erase(NameKey(chunk.tenant, chunk.name));
  if (chunk.persistent) {
    auto it = persistent_.find(chunk.tenant);
    it->second.erase(chunk.id);
    if (it->second.empty()) persistent_.erase(it);
  }
  chunks_.erase(chunk.id);  // last: `chunk` is gone with it
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
