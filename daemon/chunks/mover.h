// The moves of chunks between tiers. A move marks the chunk moving, reserves its space (through the
// RoomMaker), and hands the copy to its route of hops with a callback. When the route calls back,
// the Mover takes the chunk service's lock and settles the move: the chunk's copies change, the
// path is metered, and the Listener (the chunk service) is told, so that it serves the requests
// waiting for the chunk. A move that goes on from where it settled (device -> host -> NVMe) starts
// its next leg before telling.
//
// Every call is made with the service's lock held, except WaitForIdle; the Mover takes that lock
// itself only to settle.
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
#include "daemon/chunks/room_maker.h"
#include "daemon/tiers/hop.h"
#include "daemon/util/clock.h"

namespace tierd::daemon {

struct Batch;

class Mover {
 public:
  // What the Mover tells the chunk service, with the service's lock held.
  class Listener {
   public:
    virtual ~Listener() = default;
    // A move of the chunk settled with `moved`, its effect on the copies applied.
    virtual void MoveSettled(ChunkMeta& chunk, const absl::Status& moved) = 0;
    // The chunk's bytes crossed `path` (the traffic of whoever holds the chunk).
    virtual void Moved(Path path, const ChunkMeta& chunk) = 0;
    // The chunk was brought in: it counts as used now (for least-recently-used choices).
    virtual void Used(ChunkMeta& chunk) = 0;
    // Where the chunk's NVMe I/O goes in the engine's queue.
    virtual IoOrder OrderFor(const ChunkMeta& chunk, absl::Time deadline) const = 0;
  };

  // `mu` guards `chunks`; the Mover settles under it.
  Mover(absl::Mutex& mu, ChunkTable& chunks, RoomMaker& room, const Tiers& tiers, PathMeter& meter,
        const Clock& clock, Listener& listener)
      : mu_(mu),
        chunks_(chunks),
        room_(room),
        tiers_(tiers),
        meter_(meter),
        clock_(clock),
        listener_(listener) {}
  // WaitForIdle: the last callback's release touches the Mover.
  ~Mover();
  Mover(const Mover&) = delete;
  Mover& operator=(const Mover&) = delete;

  // Each starts one move for `batch` (which completes when it settles) or fails the batch, naming
  // the chunk (no space, a retired chunk, one acquired for write).
  //
  // Copies the chunk to the device: from its host copy, or NVMe -> host -> device streamed.
  // `deadline`: when its NVMe reads are due.
  void StartToDevice(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch, absl::Time deadline);
  // Copies the chunk's device copy to the host; then writes it to NVMe if `then_nvme`, and drops
  // the device copy unless keep_source.
  void StartToHost(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch, bool then_nvme,
                   bool keep_source);
  // Reads the chunk's NVMe copy into (newly reserved) host memory.
  void StartRead(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch, absl::Time deadline);
  // Writes the chunk's host copy to NVMe (unless the NVMe copy is current), then drops the copies
  // above unless keep_source. The write is due at once: it frees room the next fetches wait for. A
  // persistent chunk's durable version stays whole until the new one is: the rewrite goes to
  // fresh space and the index record is its commit point.
  void StartWrite(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch, bool keep_source);
  // Writes the chunk's copy in `tier` one tier down: the device's to the host (StartToHost), the
  // host's to NVMe (StartWrite); drops that copy once written unless keep_source.
  void StartWriteDown(ChunkMeta& chunk, TierKind tier, const std::shared_ptr<Batch>& batch,
                      bool keep_source);
  // Durably records in the index that the chunk's current version is in memory (so that a crash
  // recovers it lost, never older); `batch` completes once that is durable.
  void Mark(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch);
  // Drops the copies above `tier` (device above host above NVMe).
  void DropAbove(ChunkMeta& chunk, TierKind tier);

  uint64_t in_flight() const { return in_flight_; }
  // Waits until every callback handed to a hop or the index has run and been let go. With no
  // session left to start moves, nothing calls into the Mover or the service afterwards.
  void WaitForIdle();

 private:
  Tier* tier(TierKind kind) const { return tiers_.tier[kind]; }
  Hop* hop(Path path) const { return tiers_.hop[path]; }
  // A copy of the chunk from its copy in `from` to its space in `to` (a read of a chunk never
  // written fills zeros).
  HopJob JobFor(const ChunkMeta& chunk, TierKind from, TierKind to) const;
  // Space for the chunk in `tier` unless it has some; on failure the batch fails, naming the
  // chunk, and false is returned.
  bool EnsureSpace(ChunkMeta& chunk, TierKind tier, const std::shared_ptr<Batch>& batch);
  // Marks the chunk moving to `to` as part of the batch. False, failing the batch, for a retired
  // chunk or one acquired for write.
  bool BeginBatchMove(ChunkMeta& chunk, TierKind to, const std::shared_ptr<Batch>& batch);
  // The chunk a settling move belongs to (a moving chunk is never destroyed).
  ChunkMeta& Moving(ChunkId id);
  // The move ended (FinishMove).
  void Settled(ChunkMeta& chunk, bool ok);
  void MoveStarted(Path path, const ChunkMeta& chunk);
  void MoveDone(Path path, const ChunkMeta& chunk);
  void SettleToDevice(ChunkId id, const absl::Status& status, bool host_filled);
  void SettleToHost(ChunkId id, const absl::Status& status, bool then_nvme, bool keep_source,
                    const std::shared_ptr<Batch>& batch);
  void SettleRead(ChunkId id, const absl::Status& status);
  // `previous`: a persistent chunk's durable version, kept until this write's index record commits.
  void SettleWrite(ChunkId id, const absl::StatusOr<uint64_t>& checksum, bool keep_source,
                   const std::optional<Placement>& previous);

  // Wraps a callback handed to a hop or the index so that WaitForIdle waits for it: it counts
  // from here until the hop has run it and let it go (copies included). A route over two hops
  // holds its one callback until the last piece has crossed both; a move that starts another as
  // it settles starts it before its own callback returns, so the count never passes zero between.
  template <typename F>
  auto Tracked(F callback);
  std::shared_ptr<void> BeginOp();

  absl::Mutex& mu_;
  ChunkTable& chunks_;
  RoomMaker& room_;
  const Tiers tiers_;
  PathMeter& meter_;
  const Clock& clock_;
  Listener& listener_;
  uint64_t in_flight_ = 0;  // moves started and not settled
  // Callbacks alive in hops and the index (Tracked); a lock of its own, taken last.
  absl::Mutex ops_mu_;
  uint64_t ops_ ABSL_GUARDED_BY(ops_mu_) = 0;
};

}  // namespace tierd::daemon
