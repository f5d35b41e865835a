// ChunkService: schedules (declared or traced), the step times measured from a session's cursor,
// and the planning round that turns them into moves (daemon/planner/planner.h plans; this runs).

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
  // What the schedule costs the planner every round: its accesses, or its steps if more.
  const uint64_t size = std::max<uint64_t>(accesses, request.steps.size());
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  SessionState& state = StateOf(session);
  const uint32_t uid = session.peer.uid;
  if (absl::Status s = ledger_.CheckSchedule(uid, state.schedule_accesses, size, "SetSchedule");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ledger_.CheckTrace(uid, request.trace_steps); !s.ok()) return s;
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
  const bool had = state.planned();
  InstallSchedule(state, session, std::move(request.steps), request.quota, size);
  state.trace = {};
  if (request.trace_steps > 0) {
    // From the next iteration boundary: the first step number that is a multiple of the length.
    const uint64_t n = request.trace_steps;
    state.trace.steps = request.trace_steps;
    state.trace.start = (session.completions->cursor() + n - 1) / n * n;
    state.trace.quota = request.quota;
    state.trace.recorded.resize(n);
  }
  schedules_ += (state.planned() ? 1 : 0) - (had ? 1 : 0);
  state.stats.tracing = state.trace.steps > 0;
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
  StateOf(session).weight = weight;
  return absl::OkStatus();
}

void ChunkService::InstallSchedule(SessionState& state, const Session& session,
                                   std::vector<std::vector<ScheduledAccess>> steps,
                                   const std::array<uint64_t, kTierKinds>& quota, uint64_t size) {
  ledger_.AddScheduleAccesses(
      session.peer.uid, static_cast<int64_t>(size) - static_cast<int64_t>(state.schedule_accesses));
  state.schedule_accesses = size;
  state.session = session.shared_from_this();
  state.named.clear();
  absl::flat_hash_set<ChunkId> seen;
  for (const auto& step : steps) {
    for (const ScheduledAccess& a : step) {
      if (seen.insert(a.id).second) state.named.push_back(a.id);
    }
  }
  const size_t n = steps.size();
  state.steps = n == 0 ? nullptr : std::make_shared<const Schedule>(std::move(steps));
  state.quota = quota;
  state.step_time.assign(n, absl::ZeroDuration());
  state.step_mean.assign(n, absl::ZeroDuration());
  state.step_deviation.assign(n, absl::ZeroDuration());
  state.cursor = session.completions->cursor();
  state.step_started = clock_.Now();
  state.stats.schedule_steps = static_cast<uint32_t>(n);
}

void ChunkService::Trace(SessionState& state, const Session& session,
                         std::span<ChunkMeta* const> chunks, TierKind tier, Access access) {
  SessionState::Trace& t = state.trace;
  const uint64_t cursor = session.completions->cursor();
  if (cursor > t.start + t.steps) {
    FinishTrace(state, session);
    return;
  }
  if (cursor <= t.start) return;  // the traced iteration has not begun
  const uint64_t step = cursor - 1 - t.start;
  for (ChunkMeta* c : chunks) {
    const std::pair<uint64_t, ChunkId> key{step * kTierKinds + static_cast<int>(tier), c->id};
    auto [it, inserted] = t.index.try_emplace(key, t.recorded[step].size());
    if (inserted) {
      if (t.accesses == ledger_.limits().schedule_accesses_per_session) {  // as a declared one
        t.index.erase(it);
        continue;
      }
      t.recorded[step].push_back({c->id, tier, access});
      ++t.accesses;
    } else if (Writes(access) && t.recorded[step][it->second].access == Access::kRead) {
      t.recorded[step][it->second].access = Access::kWrite;  // read, then written: a write
    }
  }
}

void ChunkService::FinishTrace(SessionState& state, const Session& session) {
  SessionState::Trace t = std::move(state.trace);
  state.trace = {};
  state.stats.tracing = false;
  // Chunks freed since they were acquired are left out.
  size_t kept = 0;
  for (auto& step : t.recorded) {
    size_t live = 0;  // in place, not through a predicate: the lock is checked here
    for (const ScheduledAccess& a : step) {
      if (chunks_.contains(a.id)) step[live++] = a;
    }
    step.resize(live);
    kept += step.size();
  }
  if (kept == 0) {
    TIERD_LOG_LIMITED(info, "{}: the traced iteration acquired nothing; no schedule",
                      session.Describe());
    --schedules_;
    return;
  }
  const uint64_t size = std::max<uint64_t>(kept, t.steps);
  if (absl::Status s = ledger_.CheckSchedule(session.peer.uid, state.schedule_accesses, size,
                                             "the traced schedule");
      !s.ok()) {
    TIERD_LOG_LIMITED(warn, "{}: {}; not installed", session.Describe(), s.message());
    --schedules_;
    return;
  }
  TIERD_LOG_LIMITED(info, "{}: traced schedule of {} steps, {} accesses", session.Describe(),
                    t.steps, kept);
  InstallSchedule(state, session, std::move(t.recorded), t.quota, size);
}

void ChunkService::UpdateStepTimes(SessionState& state, uint64_t cursor, absl::Time now) {
  if (cursor == state.cursor) return;
  // The cursor's pace gives the step times: the time since the last advance, spread over the
  // steps it covered, into a moving average per step. The cursor is whatever the client wrote: a
  // jump of any size updates each step of the iteration at most once.
  if (cursor > state.cursor && state.cursor > 0) {
    const uint64_t passed = cursor - state.cursor;
    const absl::Duration each = (now - state.step_started) / static_cast<double>(passed);
    const uint64_t n = state.step_time.size();
    const uint64_t updates = std::min<uint64_t>(passed, n);
    for (uint64_t i = 0; i < updates; ++i) {
      const size_t j = (cursor - 1 - updates + i) % n;
      absl::Duration& mean = state.step_mean[j];
      absl::Duration& dev = state.step_deviation[j];
      if (mean == absl::ZeroDuration()) {
        mean = each;
        dev = each / 4;
      } else {
        dev = 0.75 * dev + 0.25 * absl::AbsDuration(each - mean);
        mean = 0.875 * mean + 0.125 * each;
      }
      // Planned as a short step: data early by a little is cheap, late is a stall.
      state.step_time[j] = std::max(absl::ZeroDuration(), mean - 2 * dev);
    }
  }
  state.cursor = cursor;
  state.step_started = now;
}

size_t ChunkService::PlanRound(absl::Time now) {
  // The planner's input is taken under the lock; the plan is computed without it (other tenants'
  // requests go on meanwhile), and its moves are checked again against the table as they start.
  PlanInput in;
  in.now = now;
  std::vector<std::shared_ptr<const Schedule>> schedules;  // alive while the plan is computed
  std::vector<std::vector<absl::Duration>> step_times;
  {
    absl::MutexLock lock(&mu_);
    if (schedules_ == 0) return 0;
    schedules.reserve(sessions_.size());
    step_times.reserve(sessions_.size());
    absl::flat_hash_set<ChunkId> named;
    for (auto& [id, state] : sessions_) {
      if (state.trace.steps > 0 &&
          state.session->completions->cursor() > state.trace.start + state.trace.steps) {
        FinishTrace(state, *state.session);
      }
      if (state.steps == nullptr) continue;
      const uint64_t cursor = state.session->completions->cursor();
      UpdateStepTimes(state, cursor, now);
      state.stats.cursor = cursor;
      schedules.push_back(state.steps);
      step_times.push_back(state.step_time);
      in.sessions.push_back(SessionPlan{.session = id,
                                        .steps = schedules.back().get(),
                                        .cursor = cursor,
                                        .step_started = state.step_started,
                                        .step_time = &step_times.back(),
                                        .quota = state.quota});
      named.insert(state.named.begin(), state.named.end());
    }
    // The scheduled chunks, and every chunk holding space in a tier the planner may need room in.
    for (auto& [id, c] : chunks_) {
      const bool holds =
          c.allocated.contains(TierKind::kHost) || c.allocated.contains(TierKind::kDevice);
      if (!holds && !named.contains(id)) continue;
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
    for (TierKind t : {TierKind::kHost, TierKind::kNvme, TierKind::kDevice}) {
      if (tier(t) == nullptr) continue;
      const TierUsage u = tier(t)->Usage();
      in.capacity[static_cast<int>(t)] = u.capacity_bytes;
      in.free[static_cast<int>(t)] = u.capacity_bytes - std::min(u.capacity_bytes, u.used_bytes);
      in.largest_free[static_cast<int>(t)] = u.largest_free_bytes;
    }
    const std::array<PathLoad, kPaths> load = meter_.Load();
    for (int p = 0; p < kPaths; ++p) {
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
  room_.set_planning(true);
  for (const PlannedMove& m : moves) {
    if (m.kind != PlannedMove::Kind::kSpare) unplaced.reset();
    auto it = chunks_.find(m.id);
    if (it == chunks_.end()) continue;
    ChunkMeta& c = it->second;
    if (c.state != ChunkState::kReady || c.doomed) continue;
    SessionStats* stats = nullptr;
    if (auto owner = sessions_.find(c.owner); owner != sessions_.end())
      stats = &owner->second.stats;
    switch (m.kind) {
      case PlannedMove::Kind::kDrop:
        if (c.pins > 0 || !CleanIn(c, m.tier)) break;
        room_.DropCopy(c, m.tier);
        if (stats != nullptr) ++stats->planner_drops;
        ++totals_.planner_drops;
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
        if (stats != nullptr) ++stats->planner_fetches;
        ++totals_.planner_fetches;
        ++started;
        break;
      }
      case PlannedMove::Kind::kSpare: {
        if (!unplaced || c.pins > 0 || !CleanIn(c, m.tier)) break;
        ChunkMeta& fetch = chunks_.at(unplaced->first);
        // Only where the fetch found no room: a spare dropped elsewhere frees nothing it can use.
        if (!no_room(fetch, unplaced->second).contains(m.tier)) break;
        room_.DropCopy(c, m.tier);
        if (stats != nullptr) ++stats->planner_drops;
        ++totals_.planner_drops;
        if (fetch.state != ChunkState::kReady || !no_room(fetch, unplaced->second).empty() ||
            !StartFetch(fetch, unplaced->second, unplaced_when).ok()) {
          break;
        }
        unplaced.reset();
        stuck = stuck_before_unplaced;
        if (auto owner = sessions_.find(fetch.owner); owner != sessions_.end()) {
          ++owner->second.stats.planner_fetches;
        }
        ++totals_.planner_fetches;
        ++started;
        break;
      }
      case PlannedMove::Kind::kWriteBack: {
        if (c.pins > 0) break;
        auto batch = std::make_shared<Batch>();
        if (m.tier == TierKind::kDevice) {
          if (hop(Path::kDeviceToHost) == nullptr || !c.resident.contains(TierKind::kDevice)) break;
          mover_.StartToHost(c, batch, /*then_nvme=*/false, /*keep_source=*/true);
        } else {
          if (hop(Path::kHostToNvme) == nullptr || !c.resident.contains(TierKind::kHost)) break;
          mover_.StartWrite(c, batch, /*keep_source=*/true);
        }
        batch->Done(absl::OkStatus());
        if (c.state == ChunkState::kMoving) {
          if (stats != nullptr) ++stats->planner_write_backs;
          ++totals_.planner_write_backs;
          ++started;
        }
        break;
      }
    }
  }
  room_.set_planning(false);
  return started;
}

SessionStats ChunkService::session_stats(const Session& session) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session.id);
  if (it == sessions_.end()) return SessionStats{};
  SessionStats stats = it->second.stats;
  stats.bandwidth_weight = it->second.weight;
  return stats;
}

}  // namespace tierd::daemon
