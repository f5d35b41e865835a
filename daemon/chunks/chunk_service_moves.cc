// ChunkService: the requests that wait on moves. A fetch or an eviction that cannot be answered
// at once leaves a Waiter on the chunk and has the Mover start the move; when the Mover reports a
// move settled (MoveSettled), the waiters are served, sent after the chunk again, or failed.

#include "daemon/chunks/chunk_service.h"

#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cmath>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "common/fmt_absl.h"
#include "common/sizes.h"
#include "daemon/chunks/chunk_service_internal.h"
#include "daemon/util/log_limiter.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {

absl::Status ChunkService::CheckFetchable(const ChunkMeta& chunk, TierKind tier) const {
  if (chunk.resident.empty()) {
    return absl::DataLossError(absl::StrCat("chunk ", chunk.id, " has no valid copy in any tier"));
  }
  if (chunk.writers > 0 && !chunk.resident.contains(tier)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "chunk ", chunk.id, " is acquired for write; release it before copying it to the ",
        TierName(tier), " tier"));
  }
  const bool from_device =
      !chunk.resident.contains(TierKind::kHost) && chunk.resident.contains(TierKind::kDevice);
  if (from_device && chunk.pins > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "chunk ", chunk.id, " is acquired on the device; release it before copying it out"));
  }
  if (!from_device && !chunk.resident.contains(TierKind::kHost) &&
      hop(Path::kNvmeToHost) == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "chunk ", chunk.id, ": this daemon has no data path into the ", TierName(tier), " tier"));
  }
  return absl::OkStatus();
}

IoOrder ChunkService::OrderFor(const ChunkMeta& chunk, absl::Time deadline) const {
  return sessions_.OrderFor(chunk.owner, deadline);
}

absl::Status ChunkService::StartFetch(ChunkMeta& chunk, TierKind tier, absl::Time deadline) {
  // Whoever waits for the chunk is a Waiter, woken when the move settles.
  return mover_.Fetch(chunk, tier, /*batch=*/nullptr, OrderFor(chunk, deadline));
}

absl::Status ChunkService::CheckAcquirable(const ChunkMeta& chunk, TierKind tier) const {
  if (chunk.resident.contains(tier)) return absl::OkStatus();  // the pin keeps this copy
  if (chunk.state == ChunkState::kMoving && chunk.moving_to == tier) return absl::OkStatus();
  // Not there (or on its way elsewhere: fetched once that move settles).
  return CheckFetchable(chunk, tier);
}

void ChunkService::BringIn(ChunkMeta& chunk, TierKind tier, const std::shared_ptr<Batch>& batch,
                           SessionId session, std::optional<Access> pin, absl::Time deadline) {
  if (chunk.state == ChunkState::kReady && chunk.resident.contains(tier)) {
    if (pin) Apply(chunk, tier, *pin, session, batch);
    return;
  }
  batch->Add();
  waiters_.Add(chunk.id, Waiter{batch, session, tier, pin, clock_.Now()});
  if (chunk.state == ChunkState::kMoving) return;  // woken when the move settles
  // An Acquire's space was reserved up front (its location is final); other requests may queue
  // for room.
  if (absl::Status s =
          pin ? StartFetch(chunk, tier, deadline) : room_.FetchOrQueue(chunk, tier, deadline);
      !s.ok()) {
    // Nothing will settle: fail the waiter now (an Acquire's pin stays until Release).
    waiters_.TakeLast(chunk.id).batch->Done(s);
  }
}

void ChunkService::WakeWaiters(ChunkMeta& chunk, const absl::Status& moved) {
  if (chunk.state != ChunkState::kReady) return;  // a chained move is still on its way
  std::vector<Waiter> waiting = waiters_.TakeAll(chunk.id);
  const absl::Time now = clock_.Now();
  for (Waiter& w : waiting) {
    if (w.evict_keep_source) {
      if (chunk.state == ChunkState::kMoving) {  // an earlier waiter started a move
        waiters_.Add(chunk.id, std::move(w));
      } else if (absl::Status s = CheckEvictable(chunk, w.tier); !s.ok()) {
        w.batch->Done(s);
      } else {
        EvictSettled(chunk, w.tier, *w.evict_keep_source, w.batch);
        w.batch->Done(absl::OkStatus());
      }
      continue;
    }
    if (chunk.resident.contains(w.tier) && w.pin && chunk.state == ChunkState::kMoving) {
      // An earlier waiter started a move of the chunk: the access applies once it settles.
      waiters_.Add(chunk.id, std::move(w));
    } else if (chunk.resident.contains(w.tier)) {
      if (w.pin) {
        Apply(chunk, w.tier, *w.pin, w.session, w.batch);
        sessions_.AddStall(w.session, w.tier, now - w.since);
        acquire_wait_seconds_[w.tier].Observe(absl::ToDoubleSeconds(now - w.since));
      }
      w.batch->Done(absl::OkStatus());
    } else if (!moved.ok()) {
      w.batch->Done(absl::Status(moved.code(),
                                 absl::StrCat("chunk ", chunk.id, " could not be brought into the ",
                                              TierName(w.tier), " tier: ", moved.message())));
    } else if (absl::Status s = CheckFetchable(chunk, w.tier); !s.ok()) {
      w.batch->Done(s);
    } else if (chunk.state == ChunkState::kMoving) {
      // An earlier waiter's fetch has just started: wait for it too.
      waiters_.Add(chunk.id, std::move(w));
    } else {
      // The move that ended went elsewhere (or dropped the copy): fetch for this waiter now.
      if (absl::Status f = room_.FetchOrQueue(chunk, w.tier, now); !f.ok()) {
        w.batch->Done(f);
      } else {
        waiters_.Add(chunk.id, std::move(w));
      }
    }
  }
}

void ChunkService::MoveSettled(ChunkMeta& chunk, const Mover::Settlement& settled) {
  room_.MoveDone(chunk.id);  // a write-down for room: that room is no longer coming
  sessions_.AddMoved(chunk.owner, settled.crossed);
  if (settled.brought_in) chunk.last_use = ++use_clock_;
  room_freed_.SignalAll();
  AfterMove(chunk, settled.status);
}

void ChunkService::AfterMove(ChunkMeta& chunk, const absl::Status& moved) {
  if (chunk.doomed) {
    // Whoever waited for it learns it is gone; nothing is fetched or evicted for it again.
    waiters_.FailAll(chunk.id, Retired(chunk));
    if (chunk.state != ChunkState::kMoving) Destroy(chunk);
  } else {
    WakeWaiters(chunk, moved);
  }
  room_.RetryQueuedFetches();
}

void ChunkService::Apply(ChunkMeta& chunk, TierKind tier, Access access, SessionId session,
                         const std::shared_ptr<Batch>& batch) {
  ApplyAccess(chunk, tier, access);
  if (!Writes(access)) return;
  if (NeedsMark(chunk)) mover_.Mark(chunk, batch);
  Sessions::State* state = sessions_.Find(session);
  if (state == nullptr) return;
  auto pins = state->pins.find(chunk.id);
  // A write whose acquisition was released before its data arrived has nothing left to guard.
  if (pins == state->pins.end() || pins->second.writes >= pins->second.count) return;
  ++pins->second.writes;
  ++chunk.writers;
}

}  // namespace tierd::daemon
