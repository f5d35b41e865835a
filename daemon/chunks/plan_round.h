// A planning round's two halves, each run with the chunk service's lock held, the plan itself
// computed between them without it (daemon/planner/planner.h): Collect takes the planner's input
// from the schedules, the chunk table, the tiers and the paths; Apply starts the planned moves
// that still make sense, each checked again against the table (it may have changed meanwhile).
//
// Not thread-safe: every call runs with the chunk service's lock held.
#pragma once

#include <cstddef>
#include <vector>

#include "absl/time/time.h"
#include "daemon/chunks/chunk_table.h"
#include "daemon/chunks/mover.h"
#include "daemon/chunks/path_meter.h"
#include "daemon/chunks/schedules.h"
#include "daemon/chunks/session_ledger.h"
#include "daemon/chunks/space.h"
#include "daemon/planner/planner.h"
#include "daemon/tiers/hop.h"
#include "daemon/util/clock.h"
#include "daemon/util/recent_peak.h"

namespace tierd::daemon {

class PlanRound {
 public:
  // How long room that copies placed outside a plan held is kept free for them once they let it
  // go.
  static constexpr absl::Duration kUnplannedWindow = absl::Seconds(1);

  PlanRound(ChunkTable& chunks, Space& space, Mover& mover, SessionLedger& sessions,
            Schedules& schedules, const PathMeter& meter, const Tiers& tiers, const Clock& clock)
      : chunks_(chunks),
        space_(space),
        mover_(mover),
        sessions_(sessions),
        schedules_(schedules),
        meter_(meter),
        tiers_(tiers),
        clock_(clock) {}
  PlanRound(const PlanRound&) = delete;
  PlanRound& operator=(const PlanRound&) = delete;

  // The planner's input at `now`; false when no session has a schedule. `round` holds what the
  // input points into: it must outlive the plan.
  bool Collect(absl::Time now, Schedules::Round& round, PlanInput& in);
  // Starts the planned moves that still make sense; returns how many it started. Drops go first
  // as the planner ordered them; a fetch that finds no room in one piece takes the spares that
  // follow it, one by one, until it starts.
  size_t Apply(const std::vector<PlannedMove>& moves);
  // Records on each chunk when the plan next needs its copy (ChunkMeta::wanted_ns), for room made
  // outside a plan until the next round; a Prefetch's word stands until it is acquired.
  void Stamp(const std::vector<NextUse>& uses, absl::Time now);

 private:
  Tier* tier(TierKind kind) const { return tiers_.tier[kind]; }
  // The tiers among those the fetch of `c` into `target` needs where no piece is large enough.
  TierSet NoRoom(const ChunkMeta& c, TierKind target) const;
  // A planned fetch, its NVMe I/O in its holder's order by the schedule's deadline.
  absl::Status Fetch(ChunkMeta& c, TierKind tier, absl::Time deadline);

  ChunkTable& chunks_;
  Space& space_;
  Mover& mover_;
  SessionLedger& sessions_;
  Schedules& schedules_;
  const PathMeter& meter_;
  const Tiers tiers_;
  const Clock& clock_;
  // The room copies placed outside a plan held in the host and the device tiers lately
  // (PlanInput::headroom).
  TierArray<RecentPeak> unplanned_ =
      TierArray<RecentPeak>::Generate([] { return RecentPeak(kUnplannedWindow); });
  // Whether a round may have left ChunkMeta::unread_version set: once no schedule is left, the
  // next round clears it.
  bool marked_unread_ = false;
};

}  // namespace tierd::daemon
