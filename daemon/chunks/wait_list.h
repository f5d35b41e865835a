// The requests waiting for chunks: to arrive in a tier, or for a move in the way to settle. The
// chunk service adds a waiter when a request cannot be answered at once and, when the chunk's
// move settles, takes its waiters to serve them (or puts them back to wait for the next move).
// A leaf: it knows batches, not moves.
//
// Not thread-safe: the chunk service keeps it under its lock.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/types/ids.h"
#include "daemon/types/tiers.h"

namespace tierd::daemon {

struct Batch;

// A request waiting for its chunk to arrive in `tier`. An Acquire's waiter holds its pin meanwhile
// and applies its access on arrival; an Evict's waits for the chunk's move to settle, then evicts
// it to `tier`.
struct Waiter {
  std::shared_ptr<Batch> batch;  // counted (Batch::Add) for this waiter
  SessionId session = 0;
  TierKind tier = TierKind::kHost;
  std::optional<Access> pin;
  absl::Time since;
  std::optional<bool> evict_keep_source;
};

class WaitList {
 public:
  void Add(ChunkId id, Waiter waiter);
  // Removes the waiter added last for the chunk (its move could not start) and returns it.
  // REQUIRES: the chunk has one.
  Waiter TakeLast(ChunkId id);
  // Removes and returns every waiter of the chunk, in the order they came.
  std::vector<Waiter> TakeAll(ChunkId id);
  // Whether a request (an eviction aside) waits for the chunk to arrive in `tier`.
  bool Awaited(ChunkId id, TierKind tier) const;
  // Fails, with `status`, the requests (evictions aside) waiting for the chunk in `tier`.
  void Fail(ChunkId id, TierKind tier, const absl::Status& status);
  // Fails every waiter of the chunk.
  void FailAll(ChunkId id, const absl::Status& status);
  // Forgets the session's waiters of the chunk: the session ended, its requests with it.
  void Forget(ChunkId id, SessionId session);

 private:
  // Kept beside the chunk table rather than in ChunkMeta: few chunks have any at a time.
  absl::flat_hash_map<ChunkId, std::vector<Waiter>> waiting_;
};

}  // namespace tierd::daemon
