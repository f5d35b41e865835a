// The sessions' schedules: the steps a session declared, or the iteration a trace recorded; the
// step times measured from each session's cursor; and the planner's input they make each round.
// The planner itself (daemon/planner/) is pure; the chunk service carries out its moves.
//
// Not thread-safe: the chunk service keeps it under its lock (ABSL_GUARDED_BY).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/chunks/chunk.h"
#include "daemon/chunks/chunk_table.h"
#include "daemon/chunks/requests.h"
#include "daemon/chunks/session.h"
#include "daemon/chunks/tenant_ledger.h"
#include "daemon/planner/planner.h"
#include "daemon/util/clock.h"

namespace tierd::daemon {

using Schedule = std::vector<std::vector<ScheduledAccess>>;

// A session's schedule: the steps of one iteration (repeated), and the room the planner may fill
// for it in each tier (0: no limit but the tier's).
struct ScheduleRequest {
  Schedule steps;
  TierArray<uint64_t> quota;
  // Trace mode (with no steps): record the session's acquisitions over the next iteration of this
  // many steps, and use them as its schedule from the iteration after on.
  uint32_t trace_steps = 0;
};

// Why the request is no schedule, whatever the session holds: steps without accesses, steps and a
// trace both, an access outside the host and device tiers or in one the node lacks, a chunk paired
// with itself or with a version bit past kVersionBits.
absl::Status CheckScheduleShape(const ScheduleRequest& request, const Tiers& tiers);
// The chunks the request names, each once, in order of first mention.
std::vector<ChunkId> ScheduledChunks(const ScheduleRequest& request);

class Schedules {
 public:
  // `chunks` (a traced chunk freed since is left out of the schedule) and `ledger` (the users'
  // limits on schedules) are the service's.
  Schedules(const ChunkTable& chunks, TenantLedger& ledger, const Clock& clock)
      : chunks_(chunks), ledger_(ledger), clock_(clock) {}
  Schedules(const Schedules&) = delete;
  Schedules& operator=(const Schedules&) = delete;

  // Whether the request fits the user's limits with the session's current schedule replaced
  // (RESOURCE_EXHAUSTED naming the limit).
  absl::Status CheckLimits(const Session& session, const ScheduleRequest& request);
  // Replaces the session's schedule: its steps, a trace of its next iteration, or (neither) none.
  // REQUIRES: CheckLimits passed, and the chunks it names are the session's to use.
  void Set(const Session& session, ScheduleRequest request);
  // Trace mode: records an Acquire at the session's cursor, or installs the trace once the cursor
  // has passed the traced iteration. Nothing for a session that is not tracing.
  void Record(const Session& session, std::span<ChunkMeta* const> chunks, TierKind tier,
              Access access);
  // The session ended: its schedule goes, and its accesses leave the user's count.
  void End(const Session& session);

  // What a planning round needs of the schedules, alive while the plan is computed: the
  // sessions' plans point into it.
  struct Round {
    std::vector<SessionPlan> sessions;
    std::vector<std::shared_ptr<const Schedule>> steps;
    std::vector<std::vector<absl::Duration>> step_times;
    absl::flat_hash_set<ChunkId> named;  // every chunk a schedule names
    // The versions of pairs no step reads, the bits as read this round: each waits for the next
    // step's new weights to be written over it.
    absl::flat_hash_set<ChunkId> unread;
  };
  // Every session with a schedule (a trace whose iteration has passed is installed first), its
  // step times updated from its cursor at `now`.
  void Collect(absl::Time now, Round* round);

  // Sessions with a schedule or a trace.
  size_t count() const { return count_; }
  // The session's schedule as its figures report it.
  struct Figures {
    uint64_t cursor = 0;   // steps started, as last seen
    uint32_t steps = 0;    // of the schedule in force (declared or traced)
    bool tracing = false;  // a trace is waiting for or recording its iteration
  };
  Figures FiguresOf(SessionId session) const;

 private:
  struct Entry {
    // Immutable once installed, so that a planning round can read it without the lock.
    std::shared_ptr<const Session> session;
    std::shared_ptr<const Schedule> steps;
    // A schedule that names pairs: `steps` with each pair resolved by the version bits as last
    // read (`bits`, one per pair in order), made again when a bit has changed.
    bool paired = false;
    std::shared_ptr<const Schedule> resolved;
    std::vector<bool> bits;
    std::vector<ChunkId> named;  // every chunk the schedule names, once (both of a pair)
    // Of `named`, the versions of pairs that no step of `resolved` reads (made with it).
    std::vector<ChunkId> unread;
    uint64_t accesses = 0;  // what the schedule counts against the limits
    TierArray<uint64_t> quota;
    // By step index, measured from the cursor's pace: mean and mean deviation, and the time the
    // planner is told (on the short side).
    std::vector<absl::Duration> step_mean, step_deviation, step_time;
    uint64_t cursor = 0;
    absl::Time step_started;
    // Trace mode: acquisitions made while start < cursor <= start + steps are recorded as step
    // cursor - 1 - start; once the cursor passes the end, they become the schedule.
    struct Trace {
      uint32_t steps = 0;  // 0: not tracing
      uint64_t start = 0;
      TierArray<uint64_t> quota;
      Schedule recorded;
      absl::flat_hash_map<std::tuple<uint64_t, TierKind, ChunkId>, size_t> index;
      size_t accesses = 0;
    } trace;
    bool planned() const { return steps != nullptr || trace.steps > 0; }
  };
  // Makes `steps` the session's schedule, its step times unknown yet and its running step started
  // at `now`. `size` is what it counts against the limits (its accesses, or steps if more).
  void Install(Entry& entry, const Session& session, Schedule steps,
               const TierArray<uint64_t>& quota, uint64_t size, absl::Time now);
  // Installs the recorded trace as of `now` (a planning round's time, when the round finishes it).
  void FinishTrace(Entry& entry, const Session& session, absl::Time now);
  // The schedule a planning round reads: `steps`, or, for one that names pairs, the pairs as
  // the session's version bits say now.
  std::shared_ptr<const Schedule> Resolve(Entry& entry);
  // Folds the time since the cursor last moved into the step times of the steps it passed.
  void UpdateStepTimes(Entry& entry, uint64_t cursor, absl::Time now);

  const ChunkTable& chunks_;
  TenantLedger& ledger_;
  const Clock& clock_;
  absl::flat_hash_map<SessionId, Entry> entries_;
  size_t count_ = 0;
};

}  // namespace tierd::daemon
