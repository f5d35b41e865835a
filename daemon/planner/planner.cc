#include "daemon/planner/planner.h"

#include <algorithm>
#include <optional>

#include "absl/container/flat_hash_set.h"

namespace tierd::daemon {
namespace {

// A chunk in one tier: the key of needs and drops.
using ChunkIn = std::pair<ChunkId, TierKind>;

struct Demand {
  ChunkId id;
  TierKind tier;
  absl::Time when;
  SessionId session;
  Access access;  // kOverwrite: room only, nothing to fetch
};

struct Needs {
  // The first time each chunk is needed in each tier.
  absl::flat_hash_map<ChunkIn, Demand> first;
  // The first time each chunk is written, in any tier: a copy needed only after it is stale by
  // then (the write's new contents are what that use wants).
  absl::flat_hash_map<ChunkId, absl::Time> first_write;
};

// Over one iteration ahead of each cursor. The running step's chunks are needed now.
Needs NeedTimes(const PlanInput& in) {
  Needs needs;
  auto note = [&](const ScheduledAccess& a, absl::Time when, SessionId session) {
    const Demand d{a.id, a.tier, when, session, a.access};
    auto [it, inserted] = needs.first.try_emplace(ChunkIn{a.id, a.tier}, d);
    if (!inserted && when < it->second.when) it->second = d;
    if (Writes(a.access)) {
      auto [w, new_write] = needs.first_write.try_emplace(a.id, when);
      if (!new_write) w->second = std::min(w->second, when);
    }
  };
  for (const SessionPlan& s : in.sessions) {
    const size_t n = s.steps == nullptr ? 0 : s.steps->size();
    if (n == 0) continue;
    auto duration = [&](size_t j) {
      return s.step_time != nullptr && j < s.step_time->size() ? (*s.step_time)[j]
                                                               : absl::ZeroDuration();
    };
    absl::Time t = in.now;
    if (s.cursor > 0) {
      const size_t running = (s.cursor - 1) % n;
      for (const ScheduledAccess& a : (*s.steps)[running]) note(a, in.now, s.session);
      t = std::max(in.now, s.step_started + duration(running));
    }
    for (size_t d = 0; d < n; ++d) {
      const size_t j = (s.cursor + d) % n;
      for (const ScheduledAccess& a : (*s.steps)[j]) note(a, t, s.session);
      t += duration(j);
    }
  }
  return needs;
}

}  // namespace

Path FetchPath(const PlannerChunk& chunk, TierKind tier) {
  const TierSet& r = chunk.resident;
  // Into the device: from its host copy, else limited by the read into the host on the way.
  if (tier == TierKind::kDevice) {
    return r.contains(TierKind::kHost) ? PathUp(TierKind::kDevice) : PathUp(TierKind::kHost);
  }
  // Into the host: down from the device when NVMe has no copy, else up from NVMe.
  if (r.contains(TierKind::kDevice) && !r.contains(TierKind::kNvme)) {
    return PathDown(TierKind::kDevice);
  }
  return PathUp(TierKind::kHost);
}

namespace {

// When each copy is next needed, from the schedules over one iteration ahead and from what
// Prefetches asked for.
class Uses {
 public:
  explicit Uses(const PlanInput& in) {
    const Needs all = NeedTimes(in);
    // A use after the chunk is written elsewhere wants the new contents: no copy serves it now,
    // and it is no demand yet (it becomes one once the write is done).
    for (const auto& [key, d] : all.first) {
      auto w = all.first_write.find(d.id);
      if (w != all.first_write.end() && w->second < d.when) continue;
      needs_.emplace(key, d);
      auto [it, inserted] = next_use_.try_emplace(d.id, d.when);
      if (!inserted) it->second = std::min(it->second, d.when);
    }
  }
  // The demands: each chunk's first use in each tier.
  const absl::flat_hash_map<ChunkIn, Demand>& needs() const { return needs_; }
  // The chunk's next use in any tier; InfiniteFuture for an unscheduled one.
  absl::Time next(ChunkId id) const {
    auto it = next_use_.find(id);
    return it == next_use_.end() ? absl::InfiniteFuture() : it->second;
  }
  // When the copy in `tier` is next needed: by an access there, or as the source of a fetch to
  // the device (a host copy, while the device has none), or where a Prefetch asked for it. A host
  // copy staged for a device access is not needed again once the device holds the chunk, nor is a
  // copy about to be overwritten.
  absl::Time next_in(const PlannerChunk& c, TierKind tier) const {
    absl::Time when = need(c.id, tier);
    if (tier == TierKind::kHost && !c.resident.contains(TierKind::kDevice)) {
      when = std::min(when, need(c.id, TierKind::kDevice));
    }
    if (c.asked_in == tier) when = std::min(when, c.asked);
    return when;
  }

 private:
  absl::Time need(ChunkId id, TierKind tier) const {
    auto it = needs_.find(ChunkIn{id, tier});
    return it == needs_.end() || it->second.access == Access::kOverwrite ? absl::InfiniteFuture()
                                                                         : it->second.when;
  }

  absl::flat_hash_map<ChunkIn, Demand> needs_;
  absl::flat_hash_map<ChunkId, absl::Time> next_use_;
};

}  // namespace

std::vector<PlannedMove> Plan(const PlanInput& in, std::vector<NextUse>* next_uses) {
  std::vector<PlannedMove> out;
  const Uses uses(in);
  if (next_uses != nullptr) {
    next_uses->clear();
    for (const auto& [id, c] : in.chunks) {
      // The host copy where there is one (room is made most there), else the device's.
      for (TierKind t : {TierKind::kHost, TierKind::kDevice}) {
        if (!c.resident.contains(t)) continue;
        next_uses->push_back({id, t, uses.next_in(c, t)});
        break;
      }
    }
  }
  const absl::flat_hash_map<ChunkIn, Demand>& needs = uses.needs();
  auto next = [&](ChunkId id) { return uses.next(id); };
  auto next_in = [&](const PlannerChunk& c, TierKind tier) { return uses.next_in(c, tier); };

  std::vector<Demand> demands;
  for (const auto& [key, d] : needs) {
    auto it = in.chunks.find(d.id);
    if (it == in.chunks.end()) continue;
    const PlannerChunk& c = it->second;
    if (c.resident.contains(d.tier) || c.moving) continue;  // there, or on its way somewhere
    if (c.pinned) continue;  // in use: its Acquire brings it where it is needed
    if (c.resident.empty() && d.access != Access::kOverwrite) continue;  // nothing to copy from
    demands.push_back(d);
  }
  std::sort(demands.begin(), demands.end(), [](const Demand& a, const Demand& b) {
    return a.when != b.when ? a.when < b.when : a.id < b.id;
  });

  // Victims per tier, in the order they go: unscheduled first (a pair's unread version, then the
  // least recently used first), then the scheduled ones whose next use is furthest away. A dirty
  // copy placed outside a plan is its client's to send down.
  const bool have_nvme = in.capacity[TierKind::kNvme] > 0;
  TierArray<std::vector<const PlannerChunk*>> victims;
  for (const auto& [id, c] : in.chunks) {
    if (c.pinned || c.moving) continue;
    for (TierKind t : {TierKind::kHost, TierKind::kDevice}) {
      if (!c.resident.contains(t)) continue;
      if (CleanIn(c.resident, t) ||
          (!c.unplanned.contains(t) && (t == TierKind::kDevice || have_nvme))) {
        victims[t].push_back(&c);
      }
    }
  }
  for (TierKind t : {TierKind::kHost, TierKind::kDevice}) {
    std::vector<const PlannerChunk*>& list = victims[t];
    std::sort(list.begin(), list.end(), [&](const PlannerChunk* a, const PlannerChunk* b) {
      const absl::Time na = next_in(*a, t), nb = next_in(*b, t);
      if (na != nb) return na > nb;  // InfiniteFuture (unscheduled) first
      if (a->unread_version != b->unread_version) return a->unread_version;
      if (a->last_use != b->last_use) return a->last_use < b->last_use;
      return a->id < b->id;
    });
  }
  TierArray<size_t> victim_pos;

  // Bytes each session holds in each tier, for quotas.
  absl::flat_hash_map<SessionId, TierArray<uint64_t>> held;
  absl::flat_hash_map<SessionId, TierArray<uint64_t>> quota;
  for (const SessionPlan& s : in.sessions) quota[s.session] = s.quota;
  for (const auto& [id, c] : in.chunks) {
    for (TierKind t : {TierKind::kHost, TierKind::kDevice}) {
      if (c.resident.contains(t) || (c.moving && c.moving_to == t)) held[c.owner][t] += c.size;
    }
  }

  TierArray<int64_t> free;
  for (TierKind t : kAllTiers) {
    free[t] = static_cast<int64_t>(in.free[t]) - static_cast<int64_t>(in.headroom[t]);
  }
  TierArray<bool> blocked;  // a demand did not fit: later ones wait (need order)
  absl::flat_hash_set<ChunkId> written_back;
  absl::flat_hash_set<ChunkIn> dropped;
  std::vector<PlannedMove> write_backs;

  struct Accepted {
    Demand demand;
    uint64_t size;
    Path path;
    std::vector<TierKind> room;
    std::vector<PlannedMove> drops;
  };
  std::vector<Accepted> accepted;

  for (const Demand& d : demands) {
    const PlannerChunk& c = in.chunks.at(d.id);
    // A fetch to the device from NVMe stages through host memory: it needs room in both.
    const bool overwrite = d.access == Access::kOverwrite;
    std::vector<TierKind> room = {d.tier};
    if (d.tier == TierKind::kDevice && !overwrite && !c.resident.contains(TierKind::kHost)) {
      room.push_back(TierKind::kHost);
    }
    bool fits = true;
    for (TierKind t : room) fits = fits && !blocked[t];
    const auto q = quota.find(d.session);
    for (TierKind t : room) {
      if (q != quota.end() && q->second[t] != 0 && held[d.session][t] + c.size > q->second[t]) {
        fits = false;  // over its quota: this session waits for its own copies to go
      }
    }
    if (!fits) continue;
    std::vector<PlannedMove> drops;
    TierArray<int64_t> room_left = free;
    TierArray<size_t> pos = victim_pos;
    for (TierKind t : room) {
      std::vector<const PlannerChunk*>& list = victims[t];
      while (room_left[t] < static_cast<int64_t>(c.size) && pos[t] < list.size()) {
        const PlannerChunk* v = list[pos[t]];
        if (next_in(*v, t) <= d.when) break;  // needed no later than this one: keep it
        ++pos[t];
        if (v->id == d.id || dropped.contains(ChunkIn{v->id, t})) continue;
        if (!CleanIn(v->resident, t)) {
          // Dirty: write it down first; its space comes free on a later round.
          if (written_back.insert(v->id).second) {
            write_backs.push_back({PlannedMove::Kind::kWriteBack, v->id, t});
          }
          continue;
        }
        drops.push_back({PlannedMove::Kind::kDrop, v->id, t});
        room_left[t] += static_cast<int64_t>(v->size);
      }
      if (room_left[t] < static_cast<int64_t>(c.size)) fits = false;
    }
    if (!fits) {
      for (TierKind t : room) blocked[t] = true;
      continue;
    }
    for (TierKind t : room) {
      room_left[t] -= static_cast<int64_t>(c.size);
      held[d.session][t] += c.size;
    }
    for (const PlannedMove& m : drops) dropped.insert(ChunkIn{m.id, m.tier});
    free = room_left;
    victim_pos = pos;
    accepted.push_back({d, c.size, FetchPath(c, d.tier), room, std::move(drops)});
  }

  // As late as is safe: on each path, lay the accepted demands out backwards from their deadlines.
  auto seconds = [&](uint64_t bytes, Path p, TierKind tier) {
    double bw = in.bytes_per_second[p];
    absl::Duration latency = in.latency[p];
    if (tier == TierKind::kDevice && p == Path::kNvmeToHost) {
      // Staged through the host: both hops' latencies, at the slower hop's bandwidth.
      bw = std::min(bw, in.bytes_per_second[Path::kHostToDevice]);
      latency += in.latency[Path::kHostToDevice];
    }
    if (bw <= 0) return absl::InfiniteDuration();
    return absl::Seconds(in.safety * static_cast<double>(bytes) / bw) + in.safety * latency;
  };
  std::vector<bool> start_now(accepted.size(), false);
  for (size_t i = 0; i < accepted.size(); ++i) {
    // Room for an overwrite is made now: its victims are needed later than it, and a drop is free.
    if (accepted[i].demand.access == Access::kOverwrite) start_now[i] = true;
  }
  for (Path p : kAllPaths) {
    std::vector<size_t> on_path;
    for (size_t i = 0; i < accepted.size(); ++i) {
      if (accepted[i].path == p && accepted[i].demand.access != Access::kOverwrite) {
        on_path.push_back(i);
      }
    }
    // Bytes already in flight hold the path first.
    const absl::Duration busy =
        in.bytes_per_second[p] > 0
            ? absl::Seconds(static_cast<double>(in.queued_bytes[p]) / in.bytes_per_second[p])
            : absl::ZeroDuration();
    absl::Time limit = absl::InfiniteFuture();
    for (auto it = on_path.rbegin(); it != on_path.rend(); ++it) {
      const Accepted& a = accepted[*it];
      limit = std::min(limit, a.demand.when);
      const absl::Duration takes = seconds(a.size, a.path, a.demand.tier);
      const absl::Time latest_start =
          takes == absl::InfiniteDuration() ? absl::InfinitePast() : limit - takes;
      start_now[*it] = latest_start - busy <= in.now + in.lead;
      limit = latest_start;
    }
  }
  for (size_t i = 0; i < accepted.size(); ++i) {
    if (!start_now[i]) continue;
    const Accepted& a = accepted[i];
    for (const PlannedMove& m : a.drops) out.push_back(m);
    if (a.demand.access == Access::kOverwrite) continue;  // the Acquire lands in the room
    out.push_back(
        {PlannedMove::Kind::kFetch, a.demand.id, a.demand.tier, a.demand.when, a.demand.session});
    // Free space in pieces: the next victims in line, needed later than this fetch, as spares in
    // each tier it needs room in (a fetch to the device from NVMe stages through the host).
    for (TierKind t : a.room) {
      if (in.largest_free[t] >= in.free[t]) continue;
      int spares = 0;
      for (size_t pos = victim_pos[t]; pos < victims[t].size() && spares < 4; ++pos) {
        const PlannerChunk* v = victims[t][pos];
        if (next_in(*v, t) <= a.demand.when) break;
        if (v->id == a.demand.id || !CleanIn(v->resident, t) ||
            dropped.contains(ChunkIn{v->id, t})) {
          continue;
        }
        out.push_back({PlannedMove::Kind::kSpare, v->id, t});
        dropped.insert(ChunkIn{v->id, t});
        ++spares;
      }
    }
  }
  for (const PlannedMove& m : write_backs) out.push_back(m);

  // Early write-back: dirty copies not needed for a while go down while the path is idle, so that
  // dropping them later costs nothing (but a transient chunk's, likely freed before it would be
  // dropped). One per path per round. A scratch chunk's copy is written early only when its tier
  // is short of clean room: beyond the plan's fetches and the headroom, less than the headroom
  // again is free or held by clean copies nothing needs. Otherwise the copy would be rewritten
  // before it is dropped (optimizer state that stays, new weights the next step overwrites), and
  // each such write is a write the step need not make. A persistent chunk's also brings its
  // durable version up to date, so it is written regardless.
  TierArray<bool> short_of_room;
  for (TierKind t : {TierKind::kHost, TierKind::kDevice}) {
    int64_t room = free[t];
    for (size_t pos = victim_pos[t]; pos < victims[t].size(); ++pos) {
      const PlannerChunk* v = victims[t][pos];
      if (next_in(*v, t) != absl::InfiniteFuture()) break;  // needed: the rest are too
      if (CleanIn(v->resident, t) && !dropped.contains(ChunkIn{v->id, t})) {
        room += static_cast<int64_t>(v->size);
      }
    }
    short_of_room[t] = blocked[t] || room < static_cast<int64_t>(in.headroom[t]);
  }
  PathArray<bool> path_used;
  for (const PlannedMove& m : write_backs) path_used[PathDown(m.tier)] = true;
  // The highest copy that exists nowhere below goes one tier down (a device copy already copied to
  // the host is no longer the only one, even though NVMe's is still older).
  auto only_copy = [&](const PlannerChunk& c) -> std::optional<TierKind> {
    if (c.resident.contains(TierKind::kDevice) && !CleanIn(c.resident, TierKind::kDevice)) {
      return TierKind::kDevice;
    }
    if (have_nvme && c.home != TierKind::kHost && c.resident.contains(TierKind::kHost) &&
        !CleanIn(c.resident, TierKind::kHost)) {
      return TierKind::kHost;
    }
    return std::nullopt;
  };
  std::vector<const PlannerChunk*> dirty;
  for (const auto& [id, c] : in.chunks) {
    if (c.pinned || c.moving || c.transient || written_back.contains(id)) continue;
    const std::optional<TierKind> from = only_copy(c);
    if (!from || (!c.persistent && !short_of_room[*from])) continue;
    dirty.push_back(&c);
  }
  std::sort(dirty.begin(), dirty.end(), [&](const PlannerChunk* a, const PlannerChunk* b) {
    const absl::Time na = next(a->id), nb = next(b->id);
    return na != nb ? na > nb : a->id < b->id;
  });
  for (const PlannerChunk* c : dirty) {
    const TierKind from = *only_copy(*c);
    const Path p = PathDown(from);
    if (path_used[p] || in.queued_bytes[p] > 0) continue;
    const double bw = in.bytes_per_second[p];
    const absl::Duration takes =
        bw > 0 ? absl::Seconds(static_cast<double>(c->size) / bw) : absl::InfiniteDuration();
    if (next(c->id) - in.now <= 2 * takes + in.lead) continue;  // needed soon: leave it
    path_used[p] = true;
    out.push_back({PlannedMove::Kind::kWriteBack, c->id, from});
  }
  return out;
}

}  // namespace tierd::daemon
