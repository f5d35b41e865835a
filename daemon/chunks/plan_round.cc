#include "daemon/chunks/plan_round.h"

#include <algorithm>
#include <optional>
#include <utility>

namespace tierd::daemon {
namespace {

// When a Prefetch asked for the chunk's copy (its want, unless the plan's own stamp).
absl::Time Asked(const ChunkMeta& c, absl::Time now) {
  return c.wanted_by_plan ? absl::InfiniteFuture() : WantedAt(c, c.wanted_in, now);
}

}  // namespace

bool PlanRound::Collect(absl::Time now, Schedules::Round& round, PlanInput& in) {
  in.now = now;
  if (schedules_.count() == 0) {
    if (marked_unread_) {
      for (auto& [id, c] : chunks_) c.unread_version = false;
      marked_unread_ = false;
    }
    return false;
  }
  marked_unread_ = true;
  schedules_.Collect(now, &round);
  in.sessions = std::move(round.sessions);
  // The scheduled chunks, and every chunk holding space in a tier the planner may need room in.
  TierArray<uint64_t> unplanned;
  for (auto& [id, c] : chunks_) {
    const bool holds =
        c.allocated.contains(TierKind::kHost) || c.allocated.contains(TierKind::kDevice);
    c.unread_version = round.unread.contains(id);
    if (!holds && !round.named.contains(id)) continue;
    for (TierKind t : {TierKind::kHost, TierKind::kDevice}) {
      if (c.unplanned.contains(t) && c.allocated.contains(t)) unplanned[t] += c.placement[t].size;
    }
    in.chunks[id] = PlannerChunk{.id = id,
                                 .size = c.size,
                                 .owner = c.owner,
                                 .home = c.home,
                                 .resident = c.resident,
                                 .dirty = c.dirty,
                                 .moving = c.state == ChunkState::kMoving || c.doomed,
                                 .moving_to = c.moving_to,
                                 .pinned = c.pins > 0,
                                 .transient = c.transient,
                                 .persistent = c.persistent,
                                 .last_use = c.last_use,
                                 .unplanned = c.unplanned,
                                 .asked = Asked(c, now),
                                 .asked_in = c.wanted_in,
                                 .unread_version = c.unread_version};
  }
  for (TierKind t : kAllTiers) {
    if (tier(t) == nullptr) continue;
    const TierUsage u = tier(t)->Usage();
    in.capacity[t] = u.capacity_bytes;
    in.free[t] = u.capacity_bytes - std::min(u.capacity_bytes, u.used_bytes);
    in.largest_free[t] = u.largest_free_bytes;
  }
  for (TierKind t : {TierKind::kHost, TierKind::kDevice}) {
    in.headroom[t] = unplanned_[t].Add(now, unplanned[t]) - unplanned[t];
  }
  const PathArray<PathLoad> load = meter_.Load();
  for (Path p : kAllPaths) {
    in.bytes_per_second[p] = load[p].bytes_per_second;
    in.queued_bytes[p] = load[p].queued_bytes;
    in.latency[p] = load[p].slow_latency;
  }
  return true;
}

size_t PlanRound::Apply(const std::vector<PlannedMove>& moves) {
  size_t started = 0;
  // A fetch that found no room because the free space is in pieces, and its target: its spares
  // (for the tiers it found no room in) are dropped one by one until it starts.
  std::optional<std::pair<ChunkId, TierKind>> unplaced;
  absl::Time unplaced_when;
  // Tiers a fetch found no room in: later fetches (needed later) do not take the pieces there, or
  // they would be dropped again for the earlier one, round after round.
  TierSet stuck;
  TierSet stuck_before_unplaced;  // restored once the unplaced fetch starts
  // The planner's drops are its own choice of victims: no reservation for its fetches drops others.
  space_.set_planning(true);
  for (const PlannedMove& m : moves) {
    if (m.kind != PlannedMove::Kind::kSpare) unplaced.reset();
    auto it = chunks_.find(m.id);
    if (it == chunks_.end()) continue;
    ChunkMeta& c = it->second;
    if (c.state != ChunkState::kReady || c.doomed) continue;
    switch (m.kind) {
      case PlannedMove::Kind::kDrop:
        if (c.pins > 0 || !CleanIn(c.resident, m.tier)) break;
        space_.DropCopy(c, m.tier);
        sessions_.CountPlanner(c.owner, SessionLedger::PlannerMove::kDrop);
        break;
      case PlannedMove::Kind::kFetch: {
        if (c.resident.contains(m.tier) || c.pins > 0 || !mover_.CheckFetchable(c, m.tier).ok())
          break;
        bool waits = false;
        for (TierKind t : RoomNeeded(c, m.tier)) waits = waits || stuck.contains(t);
        if (waits) break;
        if (absl::Status s = Fetch(c, m.tier, m.deadline); !s.ok()) {
          // No room in one piece: the spares that follow make some, or a later round retries.
          if (absl::IsResourceExhausted(s)) {
            unplaced.emplace(c.id, m.tier);
            unplaced_when = m.deadline;
            stuck_before_unplaced = stuck;
            const TierSet full = NoRoom(c, m.tier);
            for (TierKind t : RoomNeeded(c, m.tier)) {
              if (full.contains(t)) stuck.insert(t);
            }
          }
          break;
        }
        sessions_.CountPlanner(c.owner, SessionLedger::PlannerMove::kFetch);
        ++started;
        break;
      }
      case PlannedMove::Kind::kSpare: {
        if (!unplaced || c.pins > 0 || !CleanIn(c.resident, m.tier)) break;
        ChunkMeta& fetch = chunks_.at(unplaced->first);
        // Only where the fetch found no room: a spare dropped elsewhere frees nothing it can use.
        if (!NoRoom(fetch, unplaced->second).contains(m.tier)) break;
        space_.DropCopy(c, m.tier);
        sessions_.CountPlanner(c.owner, SessionLedger::PlannerMove::kDrop);
        if (fetch.state != ChunkState::kReady || !NoRoom(fetch, unplaced->second).empty() ||
            !Fetch(fetch, unplaced->second, unplaced_when).ok()) {
          break;
        }
        unplaced.reset();
        stuck = stuck_before_unplaced;
        sessions_.CountPlanner(fetch.owner, SessionLedger::PlannerMove::kFetch);
        ++started;
        break;
      }
      case PlannedMove::Kind::kWriteBack: {
        // Down a tier: the device's copy to the host, the host's to NVMe.
        const TierKind from = m.tier;
        if (!Below(from) || c.pins > 0 || !c.resident.contains(from) ||
            tiers_.hop[PathDown(from)] == nullptr) {
          break;
        }
        if (mover_
                .WriteDown(c, from, /*batch=*/nullptr, /*keep_source=*/true,
                           sessions_.OrderFor(c.owner, clock_.Now()))
                .ok() &&
            c.state == ChunkState::kMoving) {
          sessions_.CountPlanner(c.owner, SessionLedger::PlannerMove::kWriteBack);
          ++started;
        }
        break;
      }
    }
  }
  space_.set_planning(false);
  return started;
}

void PlanRound::Stamp(const std::vector<NextUse>& uses, absl::Time now) {
  for (const NextUse& u : uses) {
    auto it = chunks_.find(u.id);
    if (it == chunks_.end()) continue;
    ChunkMeta& c = it->second;
    // What a Prefetch asked for stands until it is acquired (the plan counted it already).
    if (Asked(c, now) != absl::InfiniteFuture()) continue;
    if (u.when == absl::InfiniteFuture()) {
      Unwant(c);
    } else {
      Want(c, u.tier, u.when, /*by_plan=*/true);
    }
  }
}

TierSet PlanRound::NoRoom(const ChunkMeta& c, TierKind target) const {
  TierSet full;
  for (TierKind t : RoomNeeded(c, target)) {
    if (tier(t)->Usage().largest_free_bytes < c.size) full.insert(t);
  }
  return full;
}

absl::Status PlanRound::Fetch(ChunkMeta& c, TierKind tier, absl::Time deadline) {
  return mover_.Fetch(c, tier, /*batch=*/nullptr, sessions_.OrderFor(c.owner, deadline));
}

}  // namespace tierd::daemon
