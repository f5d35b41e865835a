#include "daemon/chunks/chunk.h"

#include <algorithm>
#include <cassert>
#include <optional>

#include "absl/strings/str_cat.h"

namespace tierd::daemon {

absl::Status CheckPin(const ChunkMeta& chunk, TierKind tier) {
  if (chunk.state == ChunkState::kMoving) {
    return absl::FailedPreconditionError(absl::StrCat("chunk ", chunk.id, " is being moved to ",
                                                      TierName(chunk.moving_to),
                                                      "; acquire it once the move completes"));
  }
  if (!chunk.resident.contains(tier)) {
    return absl::FailedPreconditionError(absl::StrCat("chunk ", chunk.id,
                                                      " is not resident in the ", TierName(tier),
                                                      " tier; prefetch it first"));
  }
  return absl::OkStatus();
}

void Hold(ChunkMeta& chunk) { chunk.pins += 1; }

void ApplyAccess(ChunkMeta& chunk, TierKind tier, Access access) {
  assert(CheckPin(chunk, tier).ok());
  if (!chunk.wanted_by_plan) Unwant(chunk);  // taken: what a Prefetch asked for has come
  if (Writes(access)) {
    chunk.resident = TierSet();
    chunk.resident.insert(tier);
    chunk.dirty = TierSet();
    if (tier != chunk.home) chunk.dirty.insert(tier);
  }
}

void Want(ChunkMeta& chunk, TierKind tier, absl::Time when, bool by_plan) {
  chunk.wanted_in = tier;
  chunk.wanted_by_plan = by_plan;
  // Never 0, which means not wanted.
  chunk.wanted_ns = std::max<int64_t>(1, absl::ToUnixNanos(when));
}

void Unwant(ChunkMeta& chunk) {
  chunk.wanted_ns = 0;
  chunk.wanted_by_plan = false;
}

absl::Time WantedAt(const ChunkMeta& chunk, TierKind tier, absl::Time now) {
  if (chunk.wanted_ns == 0 || chunk.wanted_in != tier || !chunk.resident.contains(tier)) {
    return absl::InfiniteFuture();
  }
  const absl::Time when = absl::FromUnixNanos(chunk.wanted_ns);
  return now > when + kWantedGrace ? absl::InfiniteFuture() : when;
}

RoomOrder RoomOrderOf(const ChunkMeta& chunk, TierKind tier, absl::Time now) {
  if (const absl::Time when = WantedAt(chunk, tier, now); when != absl::InfiniteFuture()) {
    return {RoomOrder::kWanted, when};
  }
  return {chunk.unread_version ? RoomOrder::kUnreadVersion : RoomOrder::kUnwanted};
}

void Unpin(ChunkMeta& chunk) {
  assert(chunk.pins > 0);
  chunk.pins -= 1;
}

absl::Status CheckFreeable(const ChunkMeta& chunk) {
  if (chunk.pins > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("chunk ", chunk.id, " is acquired (", chunk.pins, " pins); release it first"));
  }
  return absl::OkStatus();
}

absl::Status BeginMove(ChunkMeta& chunk, TierKind to) {
  if (chunk.state == ChunkState::kMoving) {
    return absl::FailedPreconditionError(
        absl::StrCat("chunk ", chunk.id, " is already being moved to ", TierName(chunk.moving_to)));
  }
  if (chunk.resident.empty()) {
    return absl::DataLossError(absl::StrCat("chunk ", chunk.id, " has no valid copy in any tier"));
  }
  chunk.state = ChunkState::kMoving;
  chunk.moving_to = to;
  return absl::OkStatus();
}

void FinishMove(ChunkMeta& chunk, bool ok) {
  assert(chunk.state == ChunkState::kMoving);
  chunk.state = ChunkState::kReady;
  if (ok) {
    chunk.resident.insert(chunk.moving_to);
    if (chunk.moving_to == chunk.home) chunk.dirty = TierSet();
  }
}

TierKind DiscardContents(ChunkMeta& chunk) {
  assert(chunk.state == ChunkState::kReady && chunk.writers == 0);
  TierKind floor = TierKind::kDevice;
  for (std::optional<TierKind> t = TierKind::kDevice; t; t = Below(*t)) {
    if (chunk.allocated.contains(*t)) floor = *t;
  }
  chunk.resident.insert(floor);
  chunk.dirty = TierSet();
  if (floor == TierKind::kNvme) {
    chunk.written = false;
    chunk.checksum = 0;
  }
  Unwant(chunk);
  return floor;
}

absl::Status Retired(const ChunkMeta& chunk) {
  return absl::AbortedError(
      absl::StrCat("chunk ", chunk.id,
                   " was freed while it moved (by its owner, or its session ended); it is gone"));
}

}  // namespace tierd::daemon
