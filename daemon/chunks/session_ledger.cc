#include "daemon/chunks/session_ledger.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tierd::daemon {

SessionLedger::State& SessionLedger::Of(const Session& session) {
  auto [it, made] = states_.try_emplace(session.id);
  if (made) {
    it->second.description = session.Describe();
    it->second.job = session.job;
    if (!session.job.empty()) ++jobs_[session.job].sessions;
  }
  return it->second;
}

SessionLedger::State* SessionLedger::Find(SessionId id) {
  auto it = states_.find(id);
  return it == states_.end() ? nullptr : &it->second;
}

const SessionLedger::State* SessionLedger::Find(SessionId id) const {
  auto it = states_.find(id);
  return it == states_.end() ? nullptr : &it->second;
}

std::optional<SessionLedger::State> SessionLedger::End(SessionId id) {
  auto it = states_.find(id);
  if (it == states_.end()) return std::nullopt;
  State state = std::move(it->second);
  states_.erase(it);
  if (auto job = jobs_.find(state.job); job != jobs_.end() && --job->second.sessions == 0) {
    jobs_.erase(job);
  }
  return state;
}

void SessionLedger::CountAcquired(State& state, bool ready) {
  ++(ready ? state.stats.ready : state.stats.waited);
  ++(ready ? totals_.ready : totals_.waited);
}

void SessionLedger::AddStall(SessionId id, TierKind tier, absl::Duration stalled) {
  if (State* s = Find(id)) s->stats.stall[tier] += stalled;
  totals_.stall[tier] += stalled;
}

void SessionLedger::CountPlanner(SessionId owner, PlannerMove move) {
  auto count = [move](SessionStats& stats) -> uint64_t& {
    switch (move) {
      case PlannerMove::kFetch:
        return stats.planner_fetches;
      case PlannerMove::kDrop:
        return stats.planner_drops;
      case PlannerMove::kWriteBack:
        break;
    }
    return stats.planner_write_backs;
  };
  if (State* s = Find(owner)) ++count(s->stats);
  ++count(totals_);
}

void SessionLedger::AddMoved(SessionId holder, const PathArray<uint64_t>& bytes) {
  State* s = Find(holder);
  if (s == nullptr) return;
  Job* job = s->job.empty() ? nullptr : &jobs_[s->job];
  for (Path p : kAllPaths) {
    s->moved[p] += bytes[p];
    if (job != nullptr) job->moved[p] += bytes[p];
  }
}

std::map<std::string, PathArray<uint64_t>> SessionLedger::JobTraffic() const {
  std::map<std::string, PathArray<uint64_t>> out;
  for (const auto& [name, job] : jobs_) out[name] = job.moved;
  return out;
}

IoOrder SessionLedger::OrderFor(SessionId owner, absl::Time deadline) const {
  const State* s = Find(owner);
  return IoOrder{.deadline = deadline, .flow = owner, .weight = s == nullptr ? 1 : s->weight};
}

void SessionLedger::Grant(ChunkId id, SessionId session, bool shared) {
  leases_[id] = Lease{{session}, shared};
}

SessionId SessionLedger::Join(ChunkId id, SessionId session, bool shared) {
  Lease& lease = leases_[id];
  if (std::find(lease.holders.begin(), lease.holders.end(), session) == lease.holders.end()) {
    lease.holders.push_back(session);
  }
  if (lease.holders.size() == 1) lease.shared = shared;
  return lease.holders.front();
}

absl::Status SessionLedger::CheckLease(ChunkId id, absl::string_view name, SessionId session,
                                       bool shared, absl::string_view verb) const {
  auto lease = leases_.find(id);
  if (lease == leases_.end()) return absl::OkStatus();
  for (SessionId holder : lease->second.holders) {
    if (holder == session) continue;
    if (verb == "open" && shared && lease->second.shared) return absl::OkStatus();
    const State* s = Find(holder);
    const std::string who =
        s != nullptr && !s->description.empty() ? s->description : absl::StrCat("session ", holder);
    return absl::FailedPreconditionError(absl::StrCat(
        "persistent chunk '", name, "' (chunk ", id, ") is held by ", who, ": it cannot be ",
        verb == "open" ? "opened" : "freed", " until that session ends",
        verb == "open" ? " (or both open it with shared)" : ""));
  }
  return absl::OkStatus();
}

std::optional<SessionId> SessionLedger::Leave(ChunkId id, SessionId session) {
  auto lease = leases_.find(id);
  if (lease == leases_.end()) return std::nullopt;
  std::erase(lease->second.holders, session);
  if (lease->second.holders.empty()) {
    leases_.erase(lease);
    return SessionId{0};
  }
  return lease->second.holders.front();
}

}  // namespace tierd::daemon
