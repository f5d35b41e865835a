// Every chunk of the node by id, with the indexes the chunk service finds chunks by: a user's
// chunk by name, a user's persistent chunks, and each tier's copies least recently used first.
// Insert and Erase keep the indexes and the table in step. Ids are never reused in the daemon's
// life.
//
// The recency index is what room is made from: a full tier's victim is found among the copies in
// that tier, oldest first, without reading the rest of the table. Whoever gives a chunk a copy in
// a tier or a new `last_use` calls Reindex(chunk) before room is next looked for; a copy that has
// gone (dropped, overwritten) is found stale on the next visit and forgotten, so a missed Reindex
// after a drop costs nothing but a step. A missed one after a copy arrives would hide it from
// eviction: builds with TIERD_CHECK_INVARIANTS (the sanitized test build) check for that on every
// visit.
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

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
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

  // Files the chunk in the recency index under its `resident` tiers and its `last_use`.
  void Reindex(ChunkMeta& chunk);
  // Calls visit(chunk) for each chunk with a copy in `tier`, least recently used first (ties by
  // id), until it returns false. `visit` must not change the table; it may change the chunk after
  // it returns false.
  void VisitOldestIn(TierKind tier, absl::FunctionRef<bool(ChunkMeta&)> visit);
  // OK when every copy of every chunk is in the recency index under the chunk's last use;
  // otherwise names the first that is not. O(chunks): for tests and checked builds.
  absl::Status CheckRecency() const;

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
  absl::flat_hash_map<std::string, ChunkId> names_;                   // "uid/name" -> id
  absl::flat_hash_map<uint32_t, std::set<ChunkId>> persistent_;       // by tenant
  TierArray<absl::btree_set<std::pair<uint64_t, ChunkId>>> recency_;  // (last_use, id) by tier
};

}  // namespace tierd::daemon
