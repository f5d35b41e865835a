#include "daemon/chunks/schedules.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/fmt_absl.h"
#include "daemon/util/log_limiter.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {
namespace {

// What a schedule costs the planner every round, and counts against the limits: its accesses, or
// its steps if more.
uint64_t SizeOf(const ScheduleRequest& request) {
  uint64_t accesses = 0;
  for (const auto& step : request.steps) accesses += step.size();
  return std::max<uint64_t>(accesses, request.steps.size());
}

}  // namespace

absl::Status CheckScheduleShape(const ScheduleRequest& request, const Tiers& tiers) {
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
      if (absl::Status s = CheckTierConfigured(tiers, a.tier, "SetSchedule"); !s.ok()) {
        return s;
      }
      if (a.other == 0) continue;
      if (a.other == a.id) {
        return absl::InvalidArgumentError(
            absl::StrCat("SetSchedule: chunk ", a.id, " is paired with itself"));
      }
      if (a.version_bit >= kVersionBits) {
        return absl::InvalidArgumentError(
            absl::StrCat("SetSchedule: the pair of chunks ", a.id, " and ", a.other,
                         " names version bit ", a.version_bit, "; there are ", kVersionBits));
      }
    }
  }
  return absl::OkStatus();
}

std::vector<ChunkId> ScheduledChunks(const ScheduleRequest& request) {
  std::vector<ChunkId> ids;
  absl::flat_hash_set<ChunkId> seen;
  for (const auto& step : request.steps) {
    for (const ScheduledAccess& a : step) {
      if (seen.insert(a.id).second) ids.push_back(a.id);
      if (a.other != 0 && seen.insert(a.other).second) ids.push_back(a.other);
    }
  }
  return ids;
}

absl::Status Schedules::CheckLimits(const Session& session, const ScheduleRequest& request) {
  const uint32_t uid = session.peer.uid;
  auto it = entries_.find(session.id);
  const uint64_t held = it == entries_.end() ? 0 : it->second.accesses;
  if (absl::Status s = ledger_.CheckSchedule(uid, held, SizeOf(request), "SetSchedule"); !s.ok()) {
    return s;
  }
  return ledger_.CheckTrace(uid, request.trace_steps);
}

void Schedules::Set(const Session& session, ScheduleRequest request) {
  Entry& entry = entries_[session.id];
  const bool had = entry.planned();
  const uint64_t size = SizeOf(request);
  Install(entry, session, std::move(request.steps), request.quota, size, clock_.Now());
  entry.trace = {};
  if (request.trace_steps > 0) {
    // From the next iteration boundary: the first step number that is a multiple of the length.
    const uint64_t n = request.trace_steps;
    entry.trace.steps = request.trace_steps;
    entry.trace.start = (session.completions->cursor() + n - 1) / n * n;
    entry.trace.quota = request.quota;
    entry.trace.recorded.resize(n);
  }
  count_ += (entry.planned() ? 1 : 0) - (had ? 1 : 0);
}

void Schedules::End(const Session& session) {
  auto it = entries_.find(session.id);
  if (it == entries_.end()) return;
  if (it->second.planned()) --count_;
  ledger_.AddScheduleAccesses(session.peer.uid, -static_cast<int64_t>(it->second.accesses));
  entries_.erase(it);
}

void Schedules::Install(Entry& entry, const Session& session, Schedule steps,
                        const TierArray<uint64_t>& quota, uint64_t size, absl::Time now) {
  ledger_.AddScheduleAccesses(session.peer.uid,
                              static_cast<int64_t>(size) - static_cast<int64_t>(entry.accesses));
  entry.accesses = size;
  entry.session = session.shared_from_this();
  entry.named.clear();
  entry.paired = false;
  absl::flat_hash_set<ChunkId> seen;
  for (const auto& step : steps) {
    for (const ScheduledAccess& a : step) {
      if (seen.insert(a.id).second) entry.named.push_back(a.id);
      if (a.other == 0) continue;
      entry.paired = true;
      if (seen.insert(a.other).second) entry.named.push_back(a.other);
    }
  }
  const size_t n = steps.size();
  entry.steps = n == 0 ? nullptr : std::make_shared<const Schedule>(std::move(steps));
  entry.resolved = nullptr;
  entry.bits.clear();
  entry.unread.clear();
  entry.quota = quota;
  entry.step_time.assign(n, absl::ZeroDuration());
  entry.step_mean.assign(n, absl::ZeroDuration());
  entry.step_deviation.assign(n, absl::ZeroDuration());
  entry.cursor = session.completions->cursor();
  entry.step_started = now;
}

void Schedules::Record(const Session& session, std::span<ChunkMeta* const> chunks, TierKind tier,
                       Access access) {
  auto it = entries_.find(session.id);
  if (it == entries_.end() || it->second.trace.steps == 0) return;
  Entry& entry = it->second;
  Entry::Trace& t = entry.trace;
  const uint64_t cursor = session.completions->cursor();
  if (cursor > t.start + t.steps) {
    FinishTrace(entry, session, clock_.Now());
    return;
  }
  if (cursor <= t.start) return;  // the traced iteration has not begun
  const uint64_t step = cursor - 1 - t.start;
  for (ChunkMeta* c : chunks) {
    auto [at, inserted] =
        t.index.try_emplace(std::tuple{step, tier, c->id}, t.recorded[step].size());
    if (inserted) {
      if (t.accesses == ledger_.limits().schedule_accesses_per_session) {  // as a declared one
        t.index.erase(at);
        continue;
      }
      t.recorded[step].push_back({c->id, tier, access});
      ++t.accesses;
    } else if (Writes(access) && t.recorded[step][at->second].access == Access::kRead) {
      t.recorded[step][at->second].access = Access::kWrite;  // read, then written: a write
    }
  }
}

void Schedules::FinishTrace(Entry& entry, const Session& session, absl::Time now) {
  Entry::Trace t = std::move(entry.trace);
  entry.trace = {};
  // Chunks freed since they were acquired are left out.
  size_t kept = 0;
  for (auto& step : t.recorded) {
    std::erase_if(step, [&](const ScheduledAccess& a) { return !chunks_.contains(a.id); });
    kept += step.size();
  }
  if (kept == 0) {
    TIERD_LOG_LIMITED(info, "{}: the traced iteration acquired nothing; no schedule",
                      session.Describe());
    if (!entry.planned()) --count_;
    return;
  }
  const uint64_t size = std::max<uint64_t>(kept, t.steps);
  if (absl::Status s =
          ledger_.CheckSchedule(session.peer.uid, entry.accesses, size, "the traced schedule");
      !s.ok()) {
    TIERD_LOG_LIMITED(warn, "{}: {}; not installed", session.Describe(), s.message());
    if (!entry.planned()) --count_;
    return;
  }
  TIERD_LOG_LIMITED(info, "{}: traced schedule of {} steps, {} accesses", session.Describe(),
                    t.steps, kept);
  Install(entry, session, std::move(t.recorded), t.quota, size, now);
}

void Schedules::UpdateStepTimes(Entry& entry, uint64_t cursor, absl::Time now) {
  if (cursor == entry.cursor) return;
  // The cursor's pace gives the step times: the time since the last advance, spread over the
  // steps it covered, into a moving average per step. The cursor is whatever the client wrote: a
  // jump of any size updates each step of the iteration at most once.
  if (cursor > entry.cursor && entry.cursor > 0) {
    const uint64_t passed = cursor - entry.cursor;
    const absl::Duration each = (now - entry.step_started) / static_cast<double>(passed);
    const uint64_t n = entry.step_time.size();
    const uint64_t updates = std::min<uint64_t>(passed, n);
    for (uint64_t i = 0; i < updates; ++i) {
      const size_t j = (cursor - 1 - updates + i) % n;
      absl::Duration& mean = entry.step_mean[j];
      absl::Duration& dev = entry.step_deviation[j];
      if (mean == absl::ZeroDuration()) {
        mean = each;
        dev = each / 4;
      } else {
        dev = 0.75 * dev + 0.25 * absl::AbsDuration(each - mean);
        mean = 0.875 * mean + 0.125 * each;
      }
      // Planned as a short step: data early by a little is cheap, late is a stall.
      entry.step_time[j] = std::max(absl::ZeroDuration(), mean - 2 * dev);
    }
    // A step not timed yet (the first pass of an iteration) is planned as the mean of those that
    // are: as none, every chunk of the iteration would be wanted now, and fetches made for the
    // far end of it would only be dropped for room before their turn.
    absl::Duration timed;
    uint64_t count = 0;
    for (uint64_t j = 0; j < n; ++j) {
      if (entry.step_mean[j] == absl::ZeroDuration()) continue;
      timed += entry.step_time[j];
      ++count;
    }
    for (uint64_t j = 0; j < n && count > 0 && count < n; ++j) {
      if (entry.step_mean[j] == absl::ZeroDuration()) entry.step_time[j] = timed / count;
    }
  }
  entry.cursor = cursor;
  entry.step_started = now;
}

std::shared_ptr<const Schedule> Schedules::Resolve(Entry& entry) {
  if (!entry.paired) return entry.steps;
  const CompletionRing& ring = *entry.session->completions;
  std::vector<bool> bits;
  bits.reserve(entry.bits.size());
  for (const auto& step : *entry.steps) {
    for (const ScheduledAccess& a : step) {
      if (a.other != 0) bits.push_back(ring.version(a.version_bit));
    }
  }
  if (entry.resolved != nullptr && bits == entry.bits) return entry.resolved;
  // A pair is one access of the step; two pairs at one version are one access too.
  auto resolved = std::make_shared<Schedule>();
  resolved->reserve(entry.steps->size());
  size_t k = 0;
  for (const auto& step : *entry.steps) {
    std::vector<ScheduledAccess>& out = resolved->emplace_back();
    out.reserve(step.size());
    absl::flat_hash_set<std::pair<ChunkId, TierKind>> in_step;
    for (const ScheduledAccess& a : step) {
      ScheduledAccess one{.id = a.id, .tier = a.tier, .access = a.access};
      if (a.other != 0 && bits[k++]) one.id = a.other;
      if (in_step.insert({one.id, one.tier}).second) out.push_back(one);
    }
  }
  absl::flat_hash_set<ChunkId> read;
  for (const auto& step : *resolved) {
    for (const ScheduledAccess& a : step) read.insert(a.id);
  }
  entry.unread.clear();
  for (ChunkId id : entry.named) {
    if (!read.contains(id)) entry.unread.push_back(id);
  }
  entry.bits = std::move(bits);
  entry.resolved = std::move(resolved);
  return entry.resolved;
}

void Schedules::Collect(absl::Time now, Round* round) {
  // The plans point into the round's vectors: no reallocation while they are filled.
  round->steps.reserve(entries_.size());
  round->step_times.reserve(entries_.size());
  for (auto& [id, entry] : entries_) {
    if (entry.trace.steps > 0 &&
        entry.session->completions->cursor() > entry.trace.start + entry.trace.steps) {
      // As of the round's own time: a running step that started after the round's `now` would
      // put every deadline of the new schedule late by the difference.
      FinishTrace(entry, *entry.session, now);
    }
    if (entry.steps == nullptr) continue;
    const uint64_t cursor = entry.session->completions->cursor();
    UpdateStepTimes(entry, cursor, now);
    round->steps.push_back(Resolve(entry));
    round->step_times.push_back(entry.step_time);
    round->sessions.push_back(SessionPlan{.session = id,
                                          .steps = round->steps.back().get(),
                                          .cursor = cursor,
                                          .step_started = entry.step_started,
                                          .step_time = &round->step_times.back(),
                                          .quota = entry.quota});
    round->named.insert(entry.named.begin(), entry.named.end());
    round->unread.insert(entry.unread.begin(), entry.unread.end());
  }
}

Schedules::Figures Schedules::FiguresOf(SessionId session) const {
  auto it = entries_.find(session);
  if (it == entries_.end()) return {};
  const Entry& e = it->second;
  return Figures{.cursor = e.cursor,
                 .steps = e.steps == nullptr ? 0u : static_cast<uint32_t>(e.steps->size()),
                 .tracing = e.trace.steps > 0};
}

}  // namespace tierd::daemon
