#include "daemon/chunks/room_maker.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/sizes.h"
#include "daemon/tiers/segment_pool.h"

namespace tierd::daemon {

absl::Status RoomMaker::Fetch(ChunkMeta& chunk, TierKind tier, absl::Time deadline) {
  return mover_.Fetch(chunk, tier, /*batch=*/nullptr, sessions_.OrderFor(chunk.owner, deadline));
}

absl::Status RoomMaker::FetchOrQueue(ChunkMeta& chunk, TierKind tier, absl::Time deadline) {
  absl::Status started = Fetch(chunk, tier, deadline);
  if (started.ok() || !absl::IsResourceExhausted(started)) return started;
  if (!MakeRoomFor(chunk, tier)) return started;
  for (const QueuedFetch& q : queued_fetches_) {
    if (q.id == chunk.id && q.tier == tier) return absl::OkStatus();
  }
  queued_fetches_.push_back({chunk.id, tier, deadline});
  return absl::OkStatus();
}

absl::StatusOr<bool> RoomMaker::ReserveForAcquire(std::span<ChunkMeta* const> chunks, TierKind tier,
                                                  Access access, SessionId session) {
  // Held meanwhile, so that room for one is never made by dropping another.
  for (ChunkMeta* c : chunks) Hold(*c);
  absl::StatusOr<bool> reserved = true;
  std::vector<std::pair<ChunkMeta*, TierKind>> made;  // given back if the Acquire fails
  for (ChunkMeta* c : chunks) {
    if (c->resident.contains(tier)) continue;
    if (c->state == ChunkState::kMoving && c->moving_to == tier) continue;  // its move has room
    for (TierKind t : RoomNeeded(*c, tier, access)) {
      const absl::Status p = space_.PlaceIn(*c, t);
      if (p.ok()) {
        made.emplace_back(c, t);
      } else if (absl::IsResourceExhausted(p) && MakeRoomFor(*c, tier, access)) {
        reserved = false;  // wait for the room being made
      } else if (absl::IsResourceExhausted(p) &&
                 PinsOfOthersHoldRoom(session, c->tenant, t,
                                      space_.SpaceIn(t, c->size, c->persistent))) {
        reserved = false;  // wait for other sessions to let go of their pins
      } else {
        reserved = absl::Status(p.code(), absl::StrCat("chunk ", c->id, ": ", p.message()));
      }
      if (!p.ok()) break;
    }
    if (!reserved.ok() || !*reserved) break;
  }
  if (!reserved.ok()) {
    for (auto [c, t] : made) space_.DropCopy(*c, t);  // space only: nothing had arrived there
  }
  for (ChunkMeta* c : chunks) Unpin(*c);
  return reserved;
}

bool RoomMaker::MakeRoomFor(const ChunkMeta& chunk, TierKind tier, Access access) {
  const std::vector<TierKind> needs = RoomNeeded(chunk, tier, access);
  bool coming = false;
  bool tried = false;
  for (TierKind t : needs) {
    if (space_.FreeFor(chunk.tenant, t) >= chunk.size && room_coming_[t] == 0) continue;
    tried = true;
    coming |= MakeRoomIn(t, chunk.size, chunk.tenant);
  }
  if (!tried) {  // enough bytes free but not in one piece: free some more
    for (TierKind t : needs) coming |= MakeRoomIn(t, chunk.size, chunk.tenant);
  }
  return coming;
}

bool RoomMaker::PinsOfOthersHoldRoom(SessionId session, uint32_t tenant, TierKind tier,
                                     uint64_t size) const {
  const auto pinned_in_tier = [&](ChunkId id) {
    auto it = chunks_.find(id);
    return it != chunks_.end() && it->second.allocated.contains(tier) ? &it->second : nullptr;
  };
  bool others = false;
  for (const auto& [id, state] : sessions_.all()) {
    if (id == session) continue;
    for (const auto& [chunk_id, pins] : state.pins) {
      if (pinned_in_tier(chunk_id) != nullptr) {
        others = true;
        break;
      }
    }
    if (others) break;
  }
  if (!others) return false;
  uint64_t own = 0;
  if (const SessionLedger::State* mine = sessions_.Find(session)) {
    for (const auto& [chunk_id, pins] : mine->pins) {
      if (const ChunkMeta* c = pinned_in_tier(chunk_id)) own += c->placement[tier].size;
    }
  }
  return space_.CouldHold(tenant, tier, size, own);
}

uint64_t RoomMaker::RoomComingFor(uint32_t tenant, TierKind t) const {
  uint64_t coming = 0;
  for (const auto& [id, freed] : room_moves_) {
    auto it = chunks_.find(id);
    if (freed == t && it != chunks_.end() && it->second.tenant == tenant) {
      coming += it->second.size;
    }
  }
  return coming;
}

bool RoomMaker::MakeRoomIn(TierKind t, uint64_t bytes, uint32_t tenant) {
  // When the tenant's quota, not the tier, is what is full, only its own copies make its room.
  const bool own = ledger_.Headroom(tenant, t) < AlignUp(bytes, kSegmentAlignment);
  const uint64_t free = space_.FreeFor(tenant, t);
  uint64_t coming = own ? RoomComingFor(tenant, t) : room_coming_[t];
  if (coming > 0 && free + coming >= bytes) return true;
  // Dirty copies go down a tier: the device's to the host, the host's to NVMe.
  const bool can_write_down = Below(t) && tiers_.hop[PathDown(t)] != nullptr;
  if (!can_write_down) return coming > 0 || (!own && mover_.in_flight() > 0);
  // In RoomOrder, as Space drops clean copies: a pair's version no schedule reads goes down
  // before a copy that stays (optimizer state kept between steps), whatever was used last.
  std::vector<std::pair<RoomOrder, ChunkMeta*>> dirty;
  const absl::Time now = clock_.Now();
  chunks_.VisitOldestIn(t, [&](ChunkMeta& c) {
    if (c.state == ChunkState::kReady && c.pins == 0 && !c.doomed && !CleanIn(c.resident, t) &&
        (!own || c.tenant == tenant)) {
      dirty.emplace_back(RoomOrderOf(c, t, now), &c);
    }
    return true;
  });
  std::stable_sort(dirty.begin(), dirty.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  bool started = false;  // at least one, in case the free bytes are there but not in one piece
  bool below = false;    // room is being made in the tier below for these to go to
  for (const auto& [order, c] : dirty) {
    if (started && free + coming >= bytes) break;
    // Whoever needs the room waits for it (a queued fetch, an Acquire on the service's
    // room_freed_); one that cannot start leaves them to other room.
    mover_
        .WriteDown(*c, t, /*batch=*/nullptr, /*keep_source=*/false,
                   sessions_.OrderFor(c->owner, clock_.Now()))
        .IgnoreError();
    if (c->state != ChunkState::kMoving) {
      // No room below it either: the host's own dirty copies go down to NVMe first, and the
      // waiter tries again when they have.
      if (t == TierKind::kDevice && !below) below = MakeRoomIn(TierKind::kHost, c->size, c->tenant);
      continue;
    }
    room_moves_[c->id] = t;
    room_coming_[t] += c->size;
    coming += c->size;
    started = true;
  }
  // Moves in flight end as copies that can be dropped or written down, or free what they leave
  // (other tenants' moves free nothing under this one's quota).
  return coming > 0 || (!own && mover_.in_flight() > 0) || below;
}

void RoomMaker::MoveDone(ChunkId id) {
  auto it = room_moves_.find(id);
  if (it == room_moves_.end()) return;
  uint64_t& coming = room_coming_[it->second];
  coming -= std::min(coming, chunks_.at(id).size);
  room_moves_.erase(it);
}

void RoomMaker::RetryQueuedFetches() {
  while (!queued_fetches_.empty()) {
    const QueuedFetch q = queued_fetches_.front();
    auto it = chunks_.find(q.id);
    // Gone, given up on, or on its way by another move (whose end wakes its waiters).
    if (it == chunks_.end() || !waiters_.Awaited(q.id, q.tier) ||
        it->second.state != ChunkState::kReady || it->second.resident.contains(q.tier)) {
      queued_fetches_.pop_front();
      continue;
    }
    absl::Status s = Fetch(it->second, q.tier, q.deadline);
    if (!s.ok() && absl::IsResourceExhausted(s) && MakeRoomFor(it->second, q.tier)) return;
    queued_fetches_.pop_front();
    if (!s.ok()) waiters_.Fail(q.id, q.tier, s);
  }
}

}  // namespace tierd::daemon
