// Space for chunks' copies in the tiers. Every reservation and release of a chunk's space goes
// through here, against the tier and the tenant's quota; a reservation in a full tier first drops
// clean copies there (valid in a lower tier too), least recently used first. A leaf under the
// Mover (the space its moves land in) and the RoomMaker (room made by moving copies down).
//
// Not thread-safe: the chunk service keeps it under its lock.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/chunks/chunk.h"
#include "daemon/chunks/chunk_table.h"
#include "daemon/chunks/tenant_ledger.h"
#include "daemon/tiers/hop.h"
#include "daemon/util/clock.h"

namespace tierd::daemon {

class Space {
 public:
  // `chunks` and `ledger` are the service's, read and changed under its lock; `tiers` the node's.
  Space(ChunkTable& chunks, TenantLedger& ledger, const Tiers& tiers, const Clock& clock)
      : chunks_(chunks), ledger_(ledger), tiers_(tiers), clock_(clock) {}
  Space(const Space&) = delete;
  Space& operator=(const Space&) = delete;

  // Space in `tier` for `owner` (its segments', charged to its tenant); RESOURCE_EXHAUSTED naming
  // the quota or the tier when it does not fit. `quota` false: held by the user but not checked
  // against its quota (a rewrite's second copy).
  absl::StatusOr<Placement> Reserve(TierKind tier, SpaceOwner owner, uint64_t size,
                                    bool quota = true);
  void Release(uint32_t tenant, const Placement& placement);
  // Drops the chunk's copy in `tier` and gives its space back.
  void DropCopy(ChunkMeta& chunk, TierKind tier);
  // Reserve, dropping clean copies in the tier while it is full (least recently used first, copies
  // wanted soon by a Prefetch or a schedule last: WantedAt) — only the tenant's own when its
  // quota is what is full. While the planner's moves start (planning), nothing is dropped: the
  // plan made its own room.
  absl::StatusOr<Placement> ReserveIn(TierKind tier, SpaceOwner owner, uint64_t size);
  // ReserveIn for the chunk's copy in `tier` (the space it takes there, SpaceIn), which holds it
  // from then on; outside a plan the copy counts as placed so (ChunkMeta::unplanned).
  absl::Status PlaceIn(ChunkMeta& chunk, TierKind tier);
  // The space a chunk of `size` takes in tier `t`: on NVMe, a persistent chunk takes at least the
  // index's persistent granule, so that the index of persistent chunks cannot fill first.
  uint64_t SpaceIn(TierKind t, uint64_t size, bool persistent) const;
  // The bytes of `tier` the tenant could take now: the tier's free bytes, or less under its quota.
  uint64_t FreeFor(uint32_t tenant, TierKind tier) const;
  // Whether a chunk of `size` could ever be the tenant's in `tier` beside `beside` bytes it
  // keeps there: one reservation can be that large, and both fit the tier's capacity and the
  // tenant's quota, whatever the tier holds now.
  bool CouldHold(uint32_t tenant, TierKind tier, uint64_t size, uint64_t beside) const;
  void set_planning(bool planning) { planning_ = planning; }
  // How many copies a reservation compares before it drops the one wanted last (or the least
  // recently used, where none is a pair's unread version): the walk stays bounded in a tier of
  // many small copies.
  static constexpr size_t kWantedLooked = 64;

 private:
  Tier* tier(TierKind kind) const { return tiers_.tier[kind]; }

  ChunkTable& chunks_;
  TenantLedger& ledger_;
  const Tiers tiers_;
  const Clock& clock_;  // when wants lapse (WantedAt)
  bool planning_ = false;
};

// The tiers a fetch of the chunk into `tier` needs space in: a fetch into the device stages
// through (or copies from) the chunk's host space. An overwrite fetches nothing: it needs room
// only where it lands.
std::vector<TierKind> RoomNeeded(const ChunkMeta& chunk, TierKind tier,
                                 Access access = Access::kRead);

}  // namespace tierd::daemon
