// The planner: given what each session's schedule will touch next, where every chunk is, how much
// room each tier has and how fast each path moves bytes, decides which chunks to bring up now,
// which copies to drop for them and which dirty copies to write back early. A pure function of
// its input (no clock, no locks, no I/O), so its decisions are tested directly.
//
// Policy (docs/schedules.md):
//  * Need times come from the schedule and the measured step durations: the first future use of
//    each chunk in each tier, over one iteration ahead.
//  * Space goes to the demands in order of need (earliest first). A copy is displaced only by a
//    chunk needed sooner than its own next use (Belady's MIN with a known future); unscheduled
//    copies go first, least recently used first. A copy's next use is in its own tier (a host
//    copy also serves a device access while the device holds no copy). Pinned or moving copies
//    are never displaced; dirty ones are written back first and dropped on a later round.
//  * An overwrite needs room where it lands, not a fetch: its victims go ahead of it and the
//    Acquire lands in the room. A copy about to be overwritten is needed by nobody.
//  * Free space in pieces: each fetch comes with spare victims in every tier it needs room in,
//    dropped only if the fetch finds no room in one piece; later fetches wait for it.
//  * Each demand is started as late as is safe: demands sharing a path are laid out backwards
//    from their deadlines at the path's measured bandwidth (with a safety factor) plus its
//    latency, behind the bytes already in flight, and a demand starts once its latest start is
//    within `lead` of now.
//  * Dirty copies not needed for a while are written back early, when the path down is idle: a
//    persistent chunk's always, a scratch chunk's only when its tier is short of clean room.
//  * A session never holds more than its quota of a tier through the planner.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "daemon/types/ids.h"
#include "daemon/types/tiers.h"

namespace tierd::daemon {

struct PlannerChunk {
  ChunkId id = 0;
  uint64_t size = 0;
  SessionId owner = 0;
  TierKind home = TierKind::kHost;
  TierSet resident;
  TierSet dirty;  // copies newer than the home tier's
  bool moving = false;
  TierKind moving_to = TierKind::kHost;
  bool pinned = false;
  // Its contents are wanted briefly: written down for room, never early (ChunkSpec.transient).
  bool transient = false;
  // It outlives its session: an early write-back also brings its durable version up to date.
  bool persistent = false;
  uint64_t last_use = 0;  // larger is more recent
  // Tiers where the copy was placed outside a plan (ChunkMeta::unplanned): while it is the only
  // copy there (a step's gradients, new weights being written), it is its client's, not the
  // plan's to write down for room.
  TierSet unplanned;
  // When a Prefetch asked for the copy in `asked_in` (ChunkMeta::wanted_ns): it is needed then.
  absl::Time asked = absl::InfiniteFuture();
  TierKind asked_in = TierKind::kHost;
  // The version of a pair that no step reads (ChunkMeta::unread_version): of the copies no
  // schedule needs, it goes first.
  bool unread_version = false;
};

struct ScheduledAccess {
  ChunkId id = 0;
  TierKind tier = TierKind::kHost;
  Access access = Access::kRead;
  // A pair (as declared; Schedules resolves it before a plan): the access is to `id` while the
  // session's version bit `version_bit` is clear, to `other` while it is set. 0: no pair.
  ChunkId other = 0;
  uint32_t version_bit = 0;
};

struct SessionPlan {
  SessionId session = 0;
  // One iteration: the steps in order, repeated.
  const std::vector<std::vector<ScheduledAccess>>* steps = nullptr;
  // Steps started so far (the cursor); the step running is cursor - 1, the next is cursor.
  uint64_t cursor = 0;
  // When the running step started, and how long each step (by index) is expected to take.
  absl::Time step_started;
  const std::vector<absl::Duration>* step_time = nullptr;
  // Bytes of each tier the session may hold through the planner (0: no limit).
  TierArray<uint64_t> quota;
};

struct PlanInput {
  absl::Time now;
  std::vector<SessionPlan> sessions;
  // Every chunk the schedules name, and every chunk holding space in the host and device tiers.
  absl::flat_hash_map<ChunkId, PlannerChunk> chunks;
  TierArray<uint64_t> capacity;
  TierArray<uint64_t> free;
  // The largest reservation each tier can take now. Below `free`, the free space is in pieces: a
  // fetch that fits by the count may still find no room, so each fetch comes with spare victims.
  TierArray<uint64_t> largest_free = TierArray<uint64_t>::Filled(UINT64_MAX);
  PathArray<double> bytes_per_second;  // measured
  PathArray<uint64_t> queued_bytes;    // already in flight on each path
  // What one move on each path takes beyond its bytes at the path's bandwidth, on the long side:
  // a transfer is planned to take that much longer than its bytes stream in.
  PathArray<absl::Duration> latency;
  // Room in each tier kept free for copies placed outside a plan (by Acquires and Prefetches: a
  // step's gradients, the new weights an optimizer writes, what a client reads ahead itself):
  // what they held lately beyond what they hold now, which they will want back. The plan's
  // fetches use the rest: taking it, they would be dropped unused for the next such copy and
  // fetched again.
  TierArray<uint64_t> headroom;
  // A demand starts once its latest safe start is this close; a little over one planning round.
  absl::Duration lead = absl::Milliseconds(2);
  // Transfer times are planned this much longer than measured.
  double safety = 1.25;
};

struct PlannedMove {
  enum class Kind : uint8_t {
    kFetch,      // bring the chunk into `tier`
    kDrop,       // drop the (clean, unpinned) copy in `tier` to make room
    kWriteBack,  // write the dirty copy in `tier` one tier down, keeping it
    kSpare,      // after a kFetch: drop this clean copy too if the fetch found no room in pieces
  };
  Kind kind = Kind::kFetch;
  ChunkId id = 0;
  TierKind tier = TierKind::kHost;
  absl::Time deadline = absl::InfiniteFuture();  // kFetch: when the schedule needs it
  SessionId session = 0;                         // kFetch: the session whose step needs it
  bool operator==(const PlannedMove&) const = default;
};

// When a chunk's copy in the host (else the device) is next needed, as Plan ranks its victims.
struct NextUse {
  ChunkId id = 0;
  TierKind tier = TierKind::kHost;
  absl::Time when = absl::InfiniteFuture();  // not needed over the iteration ahead
  bool operator==(const NextUse&) const = default;
};

// The moves to start now, in the order to start them. With `next_uses`, also each chunk's next
// use, from the same ranking: what room made outside a plan ranks copies by until the next round
// (ChunkMeta::wanted_ns).
std::vector<PlannedMove> Plan(const PlanInput& input, std::vector<NextUse>* next_uses = nullptr);

// "nvme_to_host", "host_to_nvme", "host_to_device", "device_to_host".

// The path a fetch of `chunk` into `tier` starts on (the one that limits it).
Path FetchPath(const PlannerChunk& chunk, TierKind tier);

}  // namespace tierd::daemon
