// Room made in a full tier for the fetches that need it, when dropping clean copies (Space) is not
// enough: copies that exist nowhere else are written one tier down (device to host, host to NVMe)
// by the Mover, in RoomOrder as Space drops clean ones, and the fetches that need the room are
// queued until it is free. Above the Mover and Space; it serves the WaitList's requests.
//
// Not thread-safe: the chunk service keeps it under its lock (ABSL_GUARDED_BY), and every call
// runs with that lock held.
#pragma once

#include <cstdint>
#include <deque>
#include <span>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/chunks/chunk.h"
#include "daemon/chunks/chunk_table.h"
#include "daemon/chunks/mover.h"
#include "daemon/chunks/session_ledger.h"
#include "daemon/chunks/space.h"
#include "daemon/chunks/tenant_ledger.h"
#include "daemon/chunks/wait_list.h"
#include "daemon/tiers/hop.h"
#include "daemon/util/clock.h"

namespace tierd::daemon {

class RoomMaker {
 public:
  // All but `clock` are the service's, read and changed under its lock.
  RoomMaker(ChunkTable& chunks, TenantLedger& ledger, const Tiers& tiers, Space& space,
            Mover& mover, WaitList& waiters, const SessionLedger& sessions, const Clock& clock)
      : chunks_(chunks),
        ledger_(ledger),
        tiers_(tiers),
        space_(space),
        mover_(mover),
        waiters_(waiters),
        sessions_(sessions),
        clock_(clock) {}
  RoomMaker(const RoomMaker&) = delete;
  RoomMaker& operator=(const RoomMaker&) = delete;

  // Starts fetching a chunk that requests wait on, its NVMe I/O due by `deadline`; when the tiers
  // it needs room in are full of copies that exist nowhere else, starts writing the first of
  // them in RoomOrder down and queues the fetch until their room is free (OK). Fails only when
  // no room is coming.
  absl::Status FetchOrQueue(ChunkMeta& chunk, TierKind tier, absl::Time deadline);
  // Reserves the space an Acquire's chunks will land in, so that the locations it hands back are
  // final. False when room is being made (write-downs, or moves in flight that will leave copies
  // to drop), or when what fills the tier is pinned by other sessions and the chunk would fit
  // beside `session`'s own pins: try again once a move settles or a pin goes. RESOURCE_EXHAUSTED
  // when no room can come: nothing of another session's to wait for, or the chunk does not fit
  // beside the session's own pins in the tier or its tenant's quota. An overwrite of a chunk not
  // moving needs room only in `tier`.
  absl::StatusOr<bool> ReserveForAcquire(std::span<ChunkMeta* const> chunks, TierKind tier,
                                         Access access, SessionId session);
  // A move of the chunk settled: if it was a write-down for room, that room is no longer coming
  // (it is free, or the move failed).
  void MoveDone(ChunkId id);
  // Room was freed (a move settled, pins or chunks went): starts the queued fetches in arrival
  // order, as far as room allows.
  void RetryQueuedFetches();

 private:
  // Write-downs that will free room for the chunk in the tiers the fetch (or, for an overwrite,
  // the landing) needs space in; true when room is on its way (started now or earlier).
  bool MakeRoomFor(const ChunkMeta& chunk, TierKind tier, Access access = Access::kRead);
  // Starts write-downs that will free `bytes` in `tier` for `tenant`: its own copies when its
  // quota is what is full there. True when room is on its way.
  bool MakeRoomIn(TierKind tier, uint64_t bytes, uint32_t tenant);
  // Bytes the tenant's write-downs in flight will free in `tier`.
  uint64_t RoomComingFor(uint32_t tenant, TierKind tier) const;
  // Whether room for a chunk of `size` of `tenant`'s in `tier` can come free by other sessions
  // letting go of their pins there: another session holds a chunk pinned in the tier, and the
  // chunk fits beside what `session` itself holds pinned there (which it may never let go of
  // while it waits). O(the session's pins, and the others' up to the first in the tier).
  bool PinsOfOthersHoldRoom(SessionId session, uint32_t tenant, TierKind tier, uint64_t size) const;
  // Starts the fetch of a chunk requests wait on (Mover::Fetch, in its holder's I/O order).
  absl::Status Fetch(ChunkMeta& chunk, TierKind tier, absl::Time deadline);

  ChunkTable& chunks_;
  TenantLedger& ledger_;
  const Tiers tiers_;
  Space& space_;
  Mover& mover_;
  WaitList& waiters_;
  const SessionLedger& sessions_;
  const Clock& clock_;
  // Fetches waiting for room that write-downs are making, in arrival order; the write-downs in
  // flight (chunk -> the tier it frees) and the bytes they will free, by tier.
  struct QueuedFetch {
    ChunkId id;
    TierKind tier;
    absl::Time deadline;
  };
  std::deque<QueuedFetch> queued_fetches_;
  absl::flat_hash_map<ChunkId, TierKind> room_moves_;
  TierArray<uint64_t> room_coming_;
};

}  // namespace tierd::daemon
