// The moves of chunks between tiers. A move marks the chunk moving, reserves its space (Space), and
// hands the copy to its route of hops with a callback. When the route calls back,
// the Mover takes the chunk service's lock and settles the move: the chunk's copies change, the
// path is metered, and the Listener (the chunk service) is told, so that it serves the requests
// waiting for the chunk. A move that goes on from where it settled (device -> host -> NVMe) starts
// its next leg before telling.
//
// The Mover borrows the service's lock. Every call but RouteFor and WaitForIdle is made with it
// held: the service keeps the Mover ABSL_GUARDED_BY it, so the clang build checks its calls, and
// the entries that touch what it guards assert it at run time (the analysis cannot see that the
// borrowed reference is the service's lock). Inside, the methods and members are annotated
// against the borrowed lock, so the settling callbacks, which run on the tiers' threads and take
// it themselves, are checked too.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/chunks/chunk.h"
#include "daemon/chunks/chunk_table.h"
#include "daemon/chunks/path_meter.h"
#include "daemon/chunks/space.h"
#include "daemon/tiers/hop.h"
#include "daemon/util/clock.h"

namespace tierd::daemon {

struct Batch;

class Mover {
 public:
  // What a move did when it settled, its effect on the chunk's copies applied.
  struct Settlement {
    absl::Status status;
    PathArray<uint64_t> crossed;  // the chunk's bytes over each path (its holder's traffic)
    bool brought_in = false;      // a fetch: the chunk counts as used now
  };
  // The Mover's one word up to the chunk service, with the service's lock held: a move settled.
  class Listener {
   public:
    virtual ~Listener() = default;
    virtual void MoveSettled(ChunkMeta& chunk, const Settlement& settled) = 0;
  };

  // `mu` guards `chunks`; the Mover settles under it.
  Mover(absl::Mutex& mu, ChunkTable& chunks, Space& space, const Tiers& tiers, PathMeter& meter,
        const Clock& clock, Listener& listener)
      : mu_(mu),
        chunks_(chunks),
        space_(space),
        tiers_(tiers),
        meter_(meter),
        clock_(clock),
        listener_(listener) {}
  // WaitForIdle: the last callback's release touches the Mover.
  ~Mover();
  Mover(const Mover&) = delete;
  Mover& operator=(const Mover&) = delete;

  // The ways a move goes, each over its route of hops.
  enum class Route : uint8_t {
    kHostToDevice,  // the host copy up to the device
    kNvmeToDevice,  // NVMe -> host -> device, each piece on to the GPU as soon as it is read
    kNvmeToHost,    // a read into (newly reserved) host memory
    kDeviceToHost,  // the device copy down to the host
    kDeviceToNvme,  // device -> host, then host -> NVMe
    kHostToNvme,    // a write (unless the NVMe copy is current)
  };
  // Up brings a copy into a tier from the copies below it (into the host: from the device's when
  // NVMe has none); down writes the copy above down into a tier (into NVMe: the device's through
  // the host when the host has none).
  enum class Direction : uint8_t { kUp, kDown };
  // The one place a route is chosen: how the chunk gets a valid copy in `to`, going `direction`,
  // from the copies it has now; nullopt when no move is needed (a copy is there, or going down to
  // the host there is no device copy above it).
  static std::optional<Route> RouteFor(const ChunkMeta& chunk, TierKind to, Direction direction);

  // Why the chunk cannot be brought into `tier`: no valid copy, acquired for write, acquired on
  // the device it would be copied from, or no data path into the tier.
  absl::Status CheckFetchable(const ChunkMeta& chunk, TierKind tier) const;
  // Starts one move along `route`, reserving the space it needs; `batch` (may be null) completes
  // when it settles. An error, and no move, when it cannot start: no space (naming the chunk), a
  // retired chunk, one acquired for write. A move down drops the copies above once written unless
  // `keep_source`; `order` places its NVMe I/O in the engine's queue (when it is due, whose). A
  // persistent chunk's durable version stays whole until the new one is: a rewrite goes to fresh
  // space and the index record is its commit point.
  absl::Status Start(ChunkMeta& chunk, Route route, const std::shared_ptr<Batch>& batch,
                     bool keep_source, const IoOrder& order);
  // A copy of the chunk into `tier`, from the copies it has (RouteFor up, then Start).
  absl::Status Fetch(ChunkMeta& chunk, TierKind tier, const std::shared_ptr<Batch>& batch,
                     const IoOrder& order);
  // Writes the chunk's copy in `tier` one tier down: the device's to the host, the host's to
  // NVMe; drops that copy once written unless keep_source. Due at once: it frees room the next
  // fetches wait for.
  absl::Status WriteDown(ChunkMeta& chunk, TierKind tier, const std::shared_ptr<Batch>& batch,
                         bool keep_source, const IoOrder& order);
  // Durably records in the index that the chunk's current version is in memory (so that a crash
  // recovers it lost, never older); `batch` completes once that is durable.
  void Mark(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch);
  // Drops the copies above `tier` (device above host above NVMe).
  void DropAbove(ChunkMeta& chunk, TierKind tier);

  uint64_t in_flight() const {
    mu_.AssertHeld();
    return in_flight_;
  }
  // Waits until every callback handed to a hop or the index has run and been let go. With no
  // session left to start moves, nothing calls into the Mover or the service afterwards.
  void WaitForIdle();

 private:
  Tier* tier(TierKind kind) const { return tiers_.tier[kind]; }
  Hop* hop(Path path) const { return tiers_.hop[path]; }
  // A copy of the chunk from its copy in `from` to its space in `to` (a read of a chunk never
  // written fills zeros).
  HopJob JobFor(const ChunkMeta& chunk, TierKind from, TierKind to) const;
  // Space for the chunk in `tier` unless it has some; the error names the chunk.
  absl::Status EnsureSpace(ChunkMeta& chunk, TierKind tier) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the chunk moving to `to`; an error for a retired chunk or one acquired for write.
  absl::Status BeginMoving(ChunkMeta& chunk, TierKind to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StartToDevice(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                             const IoOrder& order) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Then writes it to NVMe if `then_nvme` (in `order`'s place, due when it starts).
  absl::Status StartToHost(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch, bool then_nvme,
                           bool keep_source, const IoOrder& order)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StartRead(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                         const IoOrder& order) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StartWrite(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch, bool keep_source,
                          const IoOrder& order) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The chunk a settling move belongs to (a moving chunk is never destroyed).
  ChunkMeta& Moving(ChunkId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The move ended (FinishMove).
  void Settled(ChunkMeta& chunk, bool ok) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MoveStarted(Path path, const ChunkMeta& chunk);
  void MoveDone(Path path, const ChunkMeta& chunk, Settlement& settled);
  // The Settle* run on a tier's thread and take the lock.
  void SettleToDevice(ChunkId id, const absl::Status& status, bool host_filled)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The move's status, or that of the write it chains (then_nvme) when that cannot start.
  absl::Status SettleToHost(ChunkId id, const absl::Status& status, bool then_nvme,
                            bool keep_source, const std::shared_ptr<Batch>& batch,
                            const IoOrder& order) ABSL_LOCKS_EXCLUDED(mu_);
  void SettleRead(ChunkId id, const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  // `previous`: a persistent chunk's durable version, kept until this write's index record commits.
  void SettleWrite(ChunkId id, const absl::StatusOr<uint64_t>& checksum, bool keep_source,
                   const std::optional<Placement>& previous) ABSL_LOCKS_EXCLUDED(mu_);

  // Wraps a callback handed to a hop or the index so that WaitForIdle waits for it: it counts
  // from here until the hop has run it and let it go (copies included). A route over two hops
  // holds its one callback until the last piece has crossed both; a move that starts another as
  // it settles starts it before its own callback returns, so the count never passes zero between.
  template <typename F>
  auto Tracked(F callback);
  std::shared_ptr<void> BeginOp();

  absl::Mutex& mu_;  // the chunk service's
  ChunkTable& chunks_ ABSL_GUARDED_BY(mu_);
  Space& space_ ABSL_GUARDED_BY(mu_);
  const Tiers tiers_;
  PathMeter& meter_;  // thread-safe
  const Clock& clock_;
  Listener& listener_ ABSL_GUARDED_BY(mu_);
  uint64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // moves started and not settled
  // Callbacks alive in hops and the index (Tracked); a lock of its own, taken last.
  absl::Mutex ops_mu_;
  uint64_t ops_ ABSL_GUARDED_BY(ops_mu_) = 0;
};

}  // namespace tierd::daemon
