// Every chunk of the node by id, with the two indexes the chunk service finds chunks by: a user's
// chunk by name, and a user's persistent chunks. Insert and Erase keep the indexes and the table
// in step. Ids are never reused in the daemon's life.
//
// Node-based: a ChunkMeta never moves (pointers to it stay valid until it is erased), and a
// million of them cost their own size plus a pointer slot each rather than a half-empty array of
// 256-byte slots.
//
// Not thread-safe: the chunk service keeps it under its lock, and the Mover, the RoomMaker and
// Schedules use it with that lock held.
#pragma once

#include <cstdint>
#include <set>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/strings/string_view.h"
#include "daemon/chunks/chunk.h"

namespace tierd::daemon {

class ChunkTable {
 public:
  using Map = absl::node_hash_map<ChunkId, ChunkMeta>;

  ChunkTable() = default;
  ChunkTable(const ChunkTable&) = delete;
  ChunkTable& operator=(const ChunkTable&) = delete;

  // A new chunk of `tenant` with the next id, its name (if any) indexed and, when persistent,
  // counted among the user's persistent chunks; the caller fills in the rest.
  // REQUIRES: no chunk of the tenant has the name.
  ChunkMeta& Insert(uint32_t tenant, const std::string& name, bool persistent);
  // Removes the chunk and its index entries. REQUIRES: it is in the table.
  void Erase(const ChunkMeta& chunk);

  // The tenant's chunk named `name`, or null.
  ChunkMeta* FindByName(uint32_t tenant, absl::string_view name);
  // The tenant's persistent chunks, by id (empty when none).
  const std::set<ChunkId>& PersistentOf(uint32_t tenant) const;
  // Every tenant's persistent chunks.
  const absl::flat_hash_map<uint32_t, std::set<ChunkId>>& persistent() const { return persistent_; }

  // The table itself, read as a map.
  Map::iterator find(ChunkId id) { return chunks_.find(id); }
  Map::const_iterator find(ChunkId id) const { return chunks_.find(id); }
  Map::iterator begin() { return chunks_.begin(); }
  Map::iterator end() { return chunks_.end(); }
  Map::const_iterator begin() const { return chunks_.begin(); }
  Map::const_iterator end() const { return chunks_.end(); }
  ChunkMeta& at(ChunkId id) { return chunks_.at(id); }
  const ChunkMeta& at(ChunkId id) const { return chunks_.at(id); }
  bool contains(ChunkId id) const { return chunks_.contains(id); }
  size_t size() const { return chunks_.size(); }

 private:
  static std::string NameKey(uint32_t tenant, absl::string_view name);

  Map chunks_;
  ChunkId next_id_ = 1;
  absl::flat_hash_map<std::string, ChunkId> names_;              // "uid/name" -> id
  absl::flat_hash_map<uint32_t, std::set<ChunkId>> persistent_;  // by tenant
};

}  // namespace tierd::daemon
