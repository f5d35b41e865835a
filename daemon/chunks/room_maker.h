// Space for chunks in the tiers, and room made when a tier is full. Every reservation and release
// of a chunk's space goes through here, against the tier and the tenant's quota. A full tier first
// drops clean copies (valid in a lower tier too), least recently used first; when only copies that
// exist nowhere else are left, it has the least recently used written one tier down (device to
// host, host to NVMe) and queues the fetches that need the room until it is free.
//
// Not thread-safe: the chunk service keeps it under its lock (ABSL_GUARDED_BY), and every call,
// those to Moves included, runs with that lock held.
#pragma once

#include <cstdint>
#include <deque>
#include <span>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/chunks/chunk.h"
#include "daemon/chunks/chunk_table.h"
#include "daemon/chunks/tenant_ledger.h"
#include "daemon/tiers/hop.h"

namespace tierd::daemon {

class RoomMaker {
 public:
  // What room making needs of the moves (the chunk service).
  class Moves {
   public:
    virtual ~Moves() = default;
    // Starts bringing a ready chunk into `tier`, its NVMe I/O due by `deadline`;
    // RESOURCE_EXHAUSTED when there is no room for it now.
    virtual absl::Status StartFetch(ChunkMeta& chunk, TierKind tier, absl::Time deadline) = 0;
    // Starts writing the chunk's copy in `tier` one tier down, dropping that copy once written.
    // The chunk is moving afterwards unless nothing could start.
    virtual void StartWriteDown(ChunkMeta& chunk, TierKind tier) = 0;
    // Whether a request is waiting for the chunk to arrive in `tier`.
    virtual bool Awaited(ChunkId id, TierKind tier) const = 0;
    // Fails the requests waiting for the chunk in `tier`.
    virtual void FailWaiters(ChunkId id, TierKind tier, const absl::Status& status) = 0;
    virtual uint64_t moves_in_flight() const = 0;
  };

  // `chunks` and `ledger` are the service's, read and changed under its lock; `tiers` the node's.
  RoomMaker(ChunkTable& chunks, TenantLedger& ledger, const Tiers& tiers, Moves& moves)
      : chunks_(chunks), ledger_(ledger), tiers_(tiers), moves_(moves) {}
  RoomMaker(const RoomMaker&) = delete;
  RoomMaker& operator=(const RoomMaker&) = delete;

  // Space in `tier` for `tenant`; RESOURCE_EXHAUSTED naming the quota or the tier when it does not
  // fit. `quota` false: held by the user but not checked against its quota (a rewrite's second
  // copy).
  absl::StatusOr<Placement> ReserveSpace(TierKind tier, uint32_t tenant, uint64_t size,
                                         bool quota = true);
  void ReleaseSpace(uint32_t tenant, const Placement& placement);
  // Drops the chunk's copy in `tier` and gives its space back.
  void DropCopy(ChunkMeta& chunk, TierKind tier);
  // ReserveSpace, dropping clean copies in the tier (least recently used first) while it is full
  // — only the tenant's own when its quota is what is full. While the planner's moves start
  // (planning), nothing is dropped: the plan made its own room.
  absl::StatusOr<Placement> ReserveIn(TierKind tier, uint32_t tenant, uint64_t size);
  // The space a chunk of `size` takes in tier `t`: on NVMe, a persistent chunk takes at least the
  // index's persistent granule, so that the index of persistent chunks cannot fill first.
  uint64_t SpaceIn(TierKind t, uint64_t size, bool persistent) const;

  // StartFetch for a chunk that requests wait on: when the tiers it needs room in are full of
  // copies that exist nowhere else, starts writing the least recently used of them down and
  // queues the fetch until their room is free (OK). Fails only when no room is coming.
  absl::Status FetchOrQueue(ChunkMeta& chunk, TierKind tier, absl::Time deadline);
  // Reserves the space an Acquire's chunks will land in, so that the locations it hands back are
  // final. False when room is being made (write-downs, or moves in flight that will leave copies
  // to drop): try again once a move settles. RESOURCE_EXHAUSTED when no room can come. An
  // overwrite of a chunk not moving needs room only in `tier`.
  absl::StatusOr<bool> ReserveForAcquire(std::span<ChunkMeta* const> chunks, TierKind tier,
                                         Access access);
  // A move of the chunk settled: if it was a write-down for room, that room is no longer coming
  // (it is free, or the move failed).
  void MoveDone(ChunkId id);
  // Room was freed (a move settled, pins or chunks went): starts the queued fetches in arrival
  // order, as far as room allows.
  void RetryQueuedFetches();
  void set_planning(bool planning) { planning_ = planning; }

 private:
  Tier* tier(TierKind kind) const { return tiers_.tier[kind]; }
  // Write-downs that will free room for the chunk in the tiers the fetch (or, for an overwrite,
  // the landing) needs space in; true when room is on its way (started now or earlier).
  bool MakeRoomFor(const ChunkMeta& chunk, TierKind tier, Access access = Access::kRead);
  // Starts write-downs that will free `bytes` in `tier` for `tenant`: its own copies when its
  // quota is what is full there. True when room is on its way.
  bool MakeRoomIn(TierKind tier, uint64_t bytes, uint32_t tenant);
  // Bytes the tenant's write-downs in flight will free in `tier`.
  uint64_t RoomComingFor(uint32_t tenant, TierKind tier) const;
  // The bytes of `tier` the tenant could take now: the tier's free bytes, or less under its quota.
  uint64_t FreeFor(uint32_t tenant, TierKind tier) const;

  ChunkTable& chunks_;
  TenantLedger& ledger_;
  const Tiers tiers_;
  Moves& moves_;
  bool planning_ = false;
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
