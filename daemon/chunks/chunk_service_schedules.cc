// ChunkService: schedules as clients declare them (validated here, kept by Schedules) and the
// planning round that turns them into moves (daemon/planner/planner.h plans; this runs its moves).

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

absl::Status ChunkService::SetSchedule(const Session& session, ScheduleRequest request) {
  uint64_t accesses = 0;
  for (const auto& step : request.steps) accesses += step.size();
  if (request.steps.empty() != (accesses == 0)) {
    return absl::InvalidArgumentError("SetSchedule: a schedule with steps but no accesses");
  }
  if (request.trace_steps > 0 && !request.steps.empty()) {
    return absl::InvalidArgumentError(
        "SetSchedule: either declare steps or ask for a trace (trace_steps), not both");
  }
  for (const auto& step : request.steps) {
    for (const ScheduledAccess& a : step) {
      if (a.tier != TierKind::kHost && a.tier != TierKind::kDevice) {
        return absl::InvalidArgumentError(
            absl::StrCat("SetSchedule: chunk ", a.id, " is scheduled in the ", TierName(a.tier),
                         " tier; steps acquire chunks in the host or device tier"));
      }
      if (absl::Status s = CheckTier(a.tier, "SetSchedule"); !s.ok()) return s;
    }
  }
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  sessions_.Of(session);
  if (absl::Status s = schedules_.CheckLimits(session, request); !s.ok()) return s;
  std::vector<ChunkId> ids;
  {
    absl::flat_hash_set<ChunkId> seen;
    for (const auto& step : request.steps) {
      for (const ScheduledAccess& a : step) {
        if (seen.insert(a.id).second) ids.push_back(a.id);
      }
    }
  }
  if (absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids); !chunks.ok()) {
    return chunks.status();
  }
  schedules_.Set(session, std::move(request));
  return absl::OkStatus();
}

absl::Status ChunkService::SetBandwidthWeight(const Session& session, uint32_t weight) {
  absl::MutexLock lock(&mu_);
  if (weight < 1 || weight > max_weight_) {
    return absl::InvalidArgumentError(absl::StrCat("SetBandwidthWeight: weight ", weight,
                                                   " is not between 1 and ", max_weight_,
                                                   " (the daemon's planner.max_session_weight)"));
  }
  if (session.ended) return Ended(session);
  sessions_.Of(session).weight = weight;
  return absl::OkStatus();
}

size_t ChunkService::PlanRound(absl::Time now) {
  // The planner's input is taken under the lock; the plan is computed without it (other tenants'
  // requests go on meanwhile), and its moves are checked again against the table as they start.
  PlanInput in;
  in.now = now;
  Schedules::Round round;  // alive while the plan is computed: the plans point into it
  {
    absl::MutexLock lock(&mu_);
    if (schedules_.count() == 0) return 0;
    schedules_.Collect(now, &round);
    in.sessions = std::move(round.sessions);
    // The scheduled chunks, and every chunk holding space in a tier the planner may need room in.
    for (auto& [id, c] : chunks_) {
      const bool holds =
          c.allocated.contains(TierKind::kHost) || c.allocated.contains(TierKind::kDevice);
      if (!holds && !round.named.contains(id)) continue;
      in.chunks[id] = PlannerChunk{.id = id,
                                   .size = c.size,
                                   .owner = c.owner,
                                   .home = c.home,
                                   .resident = c.resident,
                                   .dirty = c.dirty,
                                   .moving = c.state == ChunkState::kMoving || c.doomed,
                                   .moving_to = c.moving_to,
                                   .pinned = c.pins > 0,
                                   .last_use = c.last_use};
    }
    for (TierKind t : kAllTiers) {
      if (tier(t) == nullptr) continue;
      const TierUsage u = tier(t)->Usage();
      in.capacity[t] = u.capacity_bytes;
      in.free[t] = u.capacity_bytes - std::min(u.capacity_bytes, u.used_bytes);
      in.largest_free[t] = u.largest_free_bytes;
    }
    const PathArray<PathLoad> load = meter_.Load();
    for (Path p : kAllPaths) {
      in.bytes_per_second[p] = load[p].bytes_per_second;
      in.queued_bytes[p] = load[p].queued_bytes;
      in.move_seconds_per_byte[p] = load[p].slow_seconds_per_byte;
    }
  }
  const std::vector<PlannedMove> moves = Plan(in);

  absl::MutexLock lock(&mu_);
  size_t started = 0;
  // A fetch that found no room because the free space is in pieces, and its target: its spares
  // (for the tiers it found no room in) are dropped one by one until it starts.
  std::optional<std::pair<ChunkId, TierKind>> unplaced;
  absl::Time unplaced_when;
  // Tiers a fetch found no room in: later fetches (needed later) do not take the pieces there, or
  // they would be dropped again for the earlier one, round after round.
  TierSet stuck;
  TierSet stuck_before_unplaced;  // restored once the unplaced fetch starts
  auto no_room = [&](const ChunkMeta& c, TierKind target) {
    TierSet full;
    for (TierKind t : RoomNeeded(c, target)) {
      if (tier(t)->Usage().largest_free_bytes < c.size) full.insert(t);
    }
    return full;
  };
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
        sessions_.CountPlanner(c.owner, Sessions::PlannerMove::kDrop);
        break;
      case PlannedMove::Kind::kFetch: {
        if (c.resident.contains(m.tier) || c.pins > 0 || !CheckFetchable(c, m.tier).ok()) break;
        bool waits = false;
        for (TierKind t : RoomNeeded(c, m.tier)) waits = waits || stuck.contains(t);
        if (waits) break;
        if (absl::Status s = StartFetch(c, m.tier, m.deadline); !s.ok()) {
          // No room in one piece: the spares that follow make some, or a later round retries.
          if (absl::IsResourceExhausted(s)) {
            unplaced.emplace(c.id, m.tier);
            unplaced_when = m.deadline;
            stuck_before_unplaced = stuck;
            const TierSet full = no_room(c, m.tier);
            for (TierKind t : RoomNeeded(c, m.tier)) {
              if (full.contains(t)) stuck.insert(t);
            }
          }
          break;
        }
        sessions_.CountPlanner(c.owner, Sessions::PlannerMove::kFetch);
        ++started;
        break;
      }
      case PlannedMove::Kind::kSpare: {
        if (!unplaced || c.pins > 0 || !CleanIn(c.resident, m.tier)) break;
        ChunkMeta& fetch = chunks_.at(unplaced->first);
        // Only where the fetch found no room: a spare dropped elsewhere frees nothing it can use.
        if (!no_room(fetch, unplaced->second).contains(m.tier)) break;
        space_.DropCopy(c, m.tier);
        sessions_.CountPlanner(c.owner, Sessions::PlannerMove::kDrop);
        if (fetch.state != ChunkState::kReady || !no_room(fetch, unplaced->second).empty() ||
            !StartFetch(fetch, unplaced->second, unplaced_when).ok()) {
          break;
        }
        unplaced.reset();
        stuck = stuck_before_unplaced;
        sessions_.CountPlanner(fetch.owner, Sessions::PlannerMove::kFetch);
        ++started;
        break;
      }
      case PlannedMove::Kind::kWriteBack: {
        // Down a tier: the device's copy to the host, the host's to NVMe.
        const TierKind from = m.tier;
        if (!Below(from) || c.pins > 0 || !c.resident.contains(from) ||
            hop(PathDown(from)) == nullptr) {
          break;
        }
        if (mover_
                .WriteDown(c, from, /*batch=*/nullptr, /*keep_source=*/true,
                           OrderFor(c, clock_.Now()))
                .ok() &&
            c.state == ChunkState::kMoving) {
          sessions_.CountPlanner(c.owner, Sessions::PlannerMove::kWriteBack);
          ++started;
        }
        break;
      }
    }
  }
  space_.set_planning(false);
  return started;
}

SessionStats ChunkService::session_stats(const Session& session) const {
  absl::MutexLock lock(&mu_);
  const Sessions::State* state = sessions_.Find(session.id);
  if (state == nullptr) return SessionStats{};
  SessionStats stats = state->stats;
  stats.bandwidth_weight = state->weight;
  const Schedules::Figures figures = schedules_.FiguresOf(session.id);
  stats.cursor = figures.cursor;
  stats.schedule_steps = figures.steps;
  stats.tracing = figures.tracing;
  return stats;
}

}  // namespace tierd::daemon
