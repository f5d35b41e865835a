// What the chunk service keeps of each session it has served: the chunks it owns and holds
// acquired, its job, its share of NVMe bandwidth, its figures, and the sessions' leases on
// persistent chunks. Every figure counted for a session is counted in the node's totals in the
// same call. A leaf: it knows chunk ids, not chunks' copies or moves.
//
// Not thread-safe: the chunk service keeps it under its lock.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/chunks/session.h"
#include "daemon/io/io_engine.h"
#include "daemon/types/ids.h"
#include "daemon/types/tiers.h"

namespace tierd::daemon {

// What a session's acquisitions cost it — how many found their chunks in place, how many waited,
// and for how long, by the tier they waited for — and what the planner did for it.
struct SessionStats {
  uint64_t ready = 0;   // chunks resident when acquired
  uint64_t waited = 0;  // chunks that had to be brought in (or were on their way)
  TierArray<absl::Duration> stall;
  uint64_t planner_fetches = 0;
  uint64_t planner_drops = 0;
  uint64_t planner_write_backs = 0;
  uint64_t cursor = 0;          // steps started, as last seen
  uint32_t schedule_steps = 0;  // steps of the schedule in force (declared or traced)
  bool tracing = false;         // a trace is waiting for or recording its iteration
  uint32_t bandwidth_weight = 1;
};

class SessionLedger {
 public:
  struct Pins {
    uint32_t count = 0;   // Acquires not yet released
    uint32_t writes = 0;  // of them, writes in effect (counted in ChunkMeta::writers)
  };
  struct State {
    std::string description;    // "session 3 (uid 1000, pid 42, trainer)", for lease errors
    std::string job;            // as the session declared it; empty: none
    PathArray<uint64_t> moved;  // bytes of the chunks it holds, by path
    std::set<ChunkId> owned;    // non-persistent (the persistent ones it holds are leased)
    absl::flat_hash_map<ChunkId, Pins> pins;
    SessionStats stats;             // its schedule's figures are the Schedules'
    uint32_t weight = 1;            // its share of NVMe bandwidth against other sessions'
    uint32_t acquires_waiting = 0;  // its Acquires waiting for room now
  };
  // The live sessions holding a lease on a persistent chunk: its creator or openers, several
  // only when every one of them asked to share.
  struct Lease {
    std::vector<SessionId> holders;
    bool shared = false;
  };

  // The session's state, made on its first request.
  State& Of(const Session& session);
  State* Find(SessionId id);
  const State* Find(SessionId id) const;
  const absl::flat_hash_map<SessionId, State>& all() const { return states_; }
  // The session ended: its state, removed (its job is forgotten with its last session); nullopt
  // when it had made no request.
  std::optional<State> End(SessionId id);

  // ---- figures: the session's (if it is still there) and the node's ----
  void CountAcquired(State& state, bool ready);
  void AddStall(SessionId id, TierKind tier, absl::Duration stalled);
  enum class PlannerMove { kFetch, kDrop, kWriteBack };
  void CountPlanner(SessionId owner, PlannerMove move);
  // A chunk held by `holder` moved these bytes over each path: the session's and its job's.
  void AddMoved(SessionId holder, const PathArray<uint64_t>& bytes);
  const SessionStats& totals() const { return totals_; }
  // Bytes moved on each path of chunks held by sessions of each declared job, since the job's
  // first session here did anything; a job is forgotten when its last session ends.
  std::map<std::string, PathArray<uint64_t>> JobTraffic() const;

  // Where the NVMe I/O of a chunk `owner` holds goes in the engine's queue: its flow and weight.
  IoOrder OrderFor(SessionId owner, absl::Time deadline) const;

  // ---- leases on persistent chunks ----
  // The creator of a persistent chunk holds its lease.
  void Grant(ChunkId id, SessionId session, bool shared);
  // `session` opened the chunk: it holds the lease too. Returns the chunk's holder (the first).
  SessionId Join(ChunkId id, SessionId session, bool shared);
  // Another live session's lease keeps the chunk from being opened (unless both share it) or
  // freed (`verb`: "open" or "free"); the error names the holder.
  absl::Status CheckLease(ChunkId id, absl::string_view name, SessionId session, bool shared,
                          absl::string_view verb) const;
  // The session let go of its lease (it ended): the chunk's holder now (0: none); nullopt when
  // the chunk has no lease.
  std::optional<SessionId> Leave(ChunkId id, SessionId session);
  void ForgetLease(ChunkId id) { leases_.erase(id); }
  const absl::flat_hash_map<ChunkId, Lease>& leases() const { return leases_; }

 private:
  struct Job {
    uint32_t sessions = 0;  // with state here
    PathArray<uint64_t> moved;
  };
  absl::flat_hash_map<SessionId, State> states_;
  absl::flat_hash_map<std::string, Job> jobs_;
  absl::flat_hash_map<ChunkId, Lease> leases_;  // few chunks are persistent
  SessionStats totals_;                         // every session's, since start-up
};

}  // namespace tierd::daemon
