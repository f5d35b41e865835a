// A chunk's metadata and the rules of its state machine (docs/architecture.md, "Chunk states").
// The functions here only check and apply transitions; the caller holds the chunk table's lock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/tiers/tier.h"
#include "daemon/types/ids.h"

namespace tierd::daemon {

enum class ChunkState : uint8_t {
  kReady = 1,   // no transfer in flight
  kMoving = 2,  // a transfer to `moving_to` is in flight
};

struct ChunkMeta {
  ChunkId id = 0;
  uint64_t size = 0;
  SessionId owner = 0;  // the session that allocated or opened it; 0 for a detached persistent one
  uint32_t tenant = 0;  // uid of the owner (of a shared base's chunk: the base's creator)
  BaseId base = 0;      // the shared base it belongs to (read-only once sealed); 0: none
  // A base's chunk in segments of the base's own (every base but a job's, whose readers are
  // its creator's sessions: in the creator's segments).
  bool base_segments = false;
  uint32_t pins = 0;  // Acquire count over all sessions
  // Acquisitions for write whose effect has applied (the client may be writing now): no copy is
  // made from the chunk until they are released, or the copy would miss what is being written.
  uint32_t writers = 0;
  ChunkState state = ChunkState::kReady;
  TierKind home = TierKind::kHost;
  TierKind moving_to = TierKind::kHost;
  TierKind wanted_in = TierKind::kHost;
  TierSet allocated;  // tiers where space is reserved (placement valid)
  TierSet resident;   // tiers holding a valid copy (a subset of allocated)
  TierSet dirty;      // tiers whose copy is newer than the home tier's
  bool persistent = false;
  bool transient = false;  // written down only for room (ChunkRequest::transient)
  bool written = false;    // the NVMe space has held data (else reading it yields zeros)
  bool doomed = false;     // freed while moving: destroyed when the move settles
  // Persistent and at home in memory (created with a host or device home): written to NVMe at a
  // clean stop; while its current version is only in memory the NVMe index says so (`marked`),
  // and a daemon that restarts without having written it down recovers it `lost`.
  bool memory_home = false;
  bool marked = false;          // the index records that the current version is in memory
  bool lost = false;            // recovered without its current version: opening it is DATA_LOSS
  bool wanted_by_plan = false;  // wanted_ns is the schedules' word, not a Prefetch's
  // A schedule names it as one version of a pair and no step reads it, as the last planning
  // round saw the version bits: its contents wait to be overwritten by the next step's new
  // weights, so its copies are the first to go for room (PlanRound writes it).
  bool unread_version = false;
  // Tiers where the copy's room was made outside a plan, for an Acquire or a Prefetch (the
  // planner keeps such room free for them: PlanInput::headroom). Cleared as the copy goes.
  TierSet unplanned;
  uint64_t checksum = 0;  // XXH3-64 of the bytes of the NVMe copy, when written
  uint64_t last_use = 0;  // Acquire clock, for least-recently-used eviction
  // When the copy in `wanted_in` (the host or the device) is next wanted, in Unix nanoseconds (0:
  // not known): by a Prefetch, until the copy is acquired there, or by the schedules, as the last
  // planning round saw them (`wanted_by_plan`). Room made outside a plan drops copies wanted soon
  // last (Want, WantedAt).
  int64_t wanted_ns = 0;
  // Where the chunk table's recency index holds the chunk, and under which use (ChunkTable::
  // Reindex keeps these; nobody else writes them).
  uint64_t indexed_use = 0;
  TierSet indexed;
  TierArray<Placement> placement;  // valid where resident (or reserved)
  std::string name;
  std::vector<std::string> tags;
};

// The budget the issue sets: the table is built for millions of chunks.
static_assert(sizeof(ChunkMeta) <= 256, "ChunkMeta must stay within 256 bytes per chunk");

// Whose a chunk's space is: the user charged for it (quotas and limits), and the owner of the
// segments it may share (its user, or a shared base's own: see kFirstBaseOwner).
struct SpaceOwner {
  uint32_t tenant = 0;
  uint32_t segments = 0;
};
inline SpaceOwner OwnerOf(const ChunkMeta& chunk) {
  return {chunk.tenant, chunk.base_segments ? SegmentOwnerOfBase(chunk.base) : chunk.tenant};
}
inline SpaceOwner UserOwner(uint32_t uid) { return {uid, uid}; }

// Acquire(tier, access): the chunk must be resident there and not being moved.
absl::Status CheckPin(const ChunkMeta& chunk, TierKind tier);
// Counts a pin: the chunk is neither freed nor dropped from a tier nor moved out from under it.
// A pin taken while the chunk is still on its way to the tier holds it there once it arrives.
void Hold(ChunkMeta& chunk);
// REQUIRES: the chunk is resident in `tier` and ready. A write makes that copy the only valid one
// (the others become stale the moment the client may write).
void ApplyAccess(ChunkMeta& chunk, TierKind tier, Access access);
// Release: REQUIRES pins > 0.
void Unpin(ChunkMeta& chunk);
// Free: only a chunk nobody has acquired (one being moved ends when the move settles).
absl::Status CheckFreeable(const ChunkMeta& chunk);
// Starts a transfer into `to`; the chunk must be ready and have a valid copy to read from.
absl::Status BeginMove(ChunkMeta& chunk, TierKind to);
// What a request about a retired chunk learns: freed while it moved (its session ended).
absl::Status Retired(const ChunkMeta& chunk);
// The chunk's copy in `tier` (the host or the device) is wanted at `when`: asked for by a
// Prefetch (until an Acquire takes it or it is sent down) or named by the schedules
// (`by_plan`, renewed each planning round). It lapses kWantedGrace after `when`, so a client
// that never acquires what it asked for keeps nothing above others' needs for long.
inline constexpr absl::Duration kWantedGrace = absl::Seconds(2);
void Want(ChunkMeta& chunk, TierKind tier, absl::Time when, bool by_plan);
// Nobody wants the chunk's copy any more (it was sent down, or the plan no longer needs it).
void Unwant(ChunkMeta& chunk);
// When the chunk's copy in `tier` is wanted, as of `now`; InfiniteFuture when it is not (or the
// tier holds no copy).
absl::Time WantedAt(const ChunkMeta& chunk, TierKind tier, absl::Time now);
// How soon room made outside a plan takes the chunk's copy in `tier` (Space drops clean copies,
// the RoomMaker writes dirty ones down): a pair's version no schedule reads first, then a copy
// nobody wants, then a wanted one, the one wanted last first. Copies that compare equal go least
// recently used first.
struct RoomOrder {
  enum Group { kUnreadVersion, kUnwanted, kWanted };
  Group group = kUnwanted;
  absl::Time wanted = absl::InfiniteFuture();  // WantedAt, for kWanted

  friend bool operator<(const RoomOrder& a, const RoomOrder& b) {
    return a.group != b.group ? a.group < b.group : a.wanted > b.wanted;
  }
};
RoomOrder RoomOrderOf(const ChunkMeta& chunk, TierKind tier, absl::Time now);
// Discard: the caller says the chunk's contents are dead until it next writes them (a buffer
// about to be overwritten). Every copy the chunk has becomes clean: the lowest tier it has space
// in counts as holding it (NVMe's reads zeros, as if never written), so the copies above it go
// for room without a write. Returns that tier. REQUIRES: ready, not acquired for write.
TierKind DiscardContents(ChunkMeta& chunk);
// Finishes the transfer BeginMove started: on success `to` holds a valid, clean-with-respect-to-
// its-source copy; on failure the chunk is as it was before.
void FinishMove(ChunkMeta& chunk, bool ok);

}  // namespace tierd::daemon
