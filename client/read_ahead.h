// The out-of-core optimizer's budget of host memory, counted in shards: the shard in hand, the
// shards read ahead of their turn (in the order they are expected) and the write-backs in flight
// (oldest first) share its `slots`. Only state at home on NVMe streams through it; state at home
// on the host stays pinned and the window stays empty.
//
// Not thread-safe: the optimizer's worker uses it while a step runs, its driving thread between.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tierd/client.hpp"

namespace tierd::internal {

class ReadAheadWindow {
 public:
  // `streams`: the state is at home on NVMe (else every call is a no-op).
  void Bind(Client* client, bool streams) {
    client_ = client;
    streams_ = streams;
  }
  void set_slots(size_t slots) { slots_ = slots; }
  size_t slots() const { return slots_; }

  // Fills the budget's free room with read-ahead, `in_hand` shards being pinned now:
  // `expected(want)` lists up to `want` shards in the order they will be stepped, and each is
  // asked for with the priority of when the worker reaches it at `pace` a shard.
  absl::Status Fill(size_t in_hand, absl::Duration pace,
                    const std::function<std::vector<ChunkId>(size_t want)>& expected);
  // Whether the shard was read ahead.
  bool Holds(ChunkId id) const;
  // Takes the shard out of the window (it is about to be pinned, or is not wanted); whether it was
  // there. Its prefetch is abandoned: its Acquire or its eviction reports any failure.
  bool Take(ChunkId id);
  // Empties the window, sending the copies it brought up back down.
  absl::Status Drop();
  // Makes room for `in_hand` shards on the host: waits for the oldest write-backs, or gives up
  // the furthest read-ahead when none is in flight. Returns the time waited.
  absl::StatusOr<absl::Duration> MakeRoom(size_t in_hand = 1);
  // Sends a shard's host copy (or the meta chunk's) down to NVMe and drops it there, without
  // waiting: a dirty copy is written, a clean one only dropped.
  absl::Status WriteBack(ChunkId id);
  // Waits until at most `keep` write-backs are in flight. Returns the time waited.
  absl::StatusOr<absl::Duration> WaitWrites(size_t keep);

 private:
  // Collects the write-backs that have finished, without waiting.
  absl::Status ReapWrites();
  size_t used(size_t in_hand) const { return ahead_.size() + writes_.size() + in_hand; }

  struct Ahead {
    ChunkId id;
    CompletionToken prefetch;
  };
  Client* client_ = nullptr;
  bool streams_ = false;
  size_t slots_ = 0;
  std::deque<Ahead> ahead_;
  std::deque<CompletionToken> writes_;
};

}  // namespace tierd::internal
