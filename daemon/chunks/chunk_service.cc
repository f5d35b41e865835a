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

absl::Status ValidateChunkName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk name must be 1 to ", kMaxNameBytes, " bytes, not ", name.size()));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != '-' && c != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk name '", absl::CHexEscape(name),
                       "' has a character outside letters, digits and '._-/'"));
    }
  }
  for (absl::string_view part : absl::StrSplit(name, '/')) {
    if (part.empty() || part == "." || part == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk name '", name, "' has an empty, '.' or '..' path component"));
    }
  }
  return absl::OkStatus();
}

ChunkService::ChunkService(const Tiers& tiers, const Clock& clock)
    : tiers_(tiers),
      clock_(clock),
      space_(chunks_, ledger_, tiers),
      room_(chunks_, ledger_, tiers, space_, mover_, waiters_, sessions_, clock_),
      schedules_(chunks_, ledger_, clock_),
      mover_(mu_, chunks_, space_, tiers, meter_, clock_, *this) {
  assert(tier(TierKind::kHost) != nullptr);
}

absl::StatusOr<std::shared_ptr<Batch>> ChunkService::NewBatch(const Session& session) {
  absl::StatusOr<SlotToken> token = session.completions->Post();
  if (!token.ok()) return token.status();
  auto batch = std::make_shared<Batch>();
  batch->session = session.shared_from_this();
  batch->token = *token;
  return batch;
}

absl::Status ChunkService::CheckTier(TierKind tier, absl::string_view what) const {
  if (tiers_.tier[tier] == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the ", TierName(tier), " tier is not configured on this node (see ",
                     tier == TierKind::kNvme ? "[nvme]" : "[device]", " in the tierd config)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ChunkMeta*>> ChunkService::Resolve(const Session& session,
                                                              std::span<const ChunkId> ids) {
  std::vector<ChunkMeta*> out;
  out.reserve(ids.size());
  absl::flat_hash_set<ChunkId> seen;
  if (ids.size() > 1) seen.reserve(ids.size());
  for (ChunkId id : ids) {
    auto it = chunks_.find(id);
    if (it == chunks_.end()) {
      return absl::NotFoundError(absl::StrCat("chunk ", id, " does not exist"));
    }
    ChunkMeta& chunk = it->second;
    const bool allowed =
        chunk.persistent ? chunk.tenant == session.peer.uid : chunk.owner == session.id;
    if (!allowed) {
      return absl::PermissionDeniedError(absl::StrCat("chunk ", id, " belongs to another ",
                                                      chunk.persistent ? "tenant" : "session", "; ",
                                                      session.Describe(), " cannot use it"));
    }
    if (ids.size() > 1 && !seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("chunk ", id, " appears twice in the batch"));
    }
    out.push_back(&chunk);
  }
  return out;
}

absl::StatusOr<std::vector<ChunkId>> ChunkService::Allocate(
    const Session& session, std::span<const ChunkRequest> requests) {
  if (absl::Status s = CheckBatch(requests.size(), "Allocate"); !s.ok()) return s;
  const uint32_t tenant = session.peer.uid;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);

  // Validate everything before reserving anything.
  std::vector<ChunkId> result(requests.size(), 0);
  absl::flat_hash_set<absl::string_view> batch_names;
  for (size_t i = 0; i < requests.size(); ++i) {
    const ChunkRequest& r = requests[i];
    auto fail = [i](const absl::Status& s) {
      return absl::Status(s.code(), absl::StrCat("Allocate, chunk #", i, ": ", s.message()));
    };
    if (absl::Status s = CheckTier(r.home, "home tier"); !s.ok()) return fail(s);
    Tier* home = tier(r.home);
    if (r.size == 0 || r.size > home->max_reservation()) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "size ", r.size, " bytes is outside 1 byte to ", FormatSize(home->max_reservation()),
          " (the largest chunk the ", TierName(r.home), " tier holds",
          r.home == TierKind::kNvme ? "; every chunk moves through host memory, so at most "
                                      "host.segment_size"
                                    : "",
          ")")));
    }
    if (r.persistent && r.name.empty()) {
      return fail(absl::InvalidArgumentError("a persistent chunk needs a name"));
    }
    if (r.tags.size() > kMaxTags) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat(r.tags.size(), " tags; at most ", kMaxTags, " are allowed")));
    }
    for (const std::string& tag : r.tags) {
      if (tag.empty() || tag.size() > kMaxTagBytes) {
        return fail(
            absl::InvalidArgumentError(absl::StrCat("tags must be 1 to ", kMaxTagBytes, " bytes")));
      }
    }
    if (r.must_exist && !(r.open_existing && r.persistent)) {
      return fail(absl::InvalidArgumentError("must_exist goes with open_existing and persistent"));
    }
    if (r.name.empty()) continue;
    if (absl::Status s = ValidateChunkName(r.name); !s.ok()) return fail(s);
    if (!batch_names.insert(r.name).second) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("name '", r.name, "' appears twice in the batch")));
    }
    const ChunkMeta* existing = chunks_.FindByName(tenant, r.name);
    if (existing == nullptr) {
      if (r.must_exist) {
        return fail(
            absl::NotFoundError(absl::StrCat("uid ", tenant, " has no persistent chunk named '",
                                             r.name, "' to open (create it without must_exist)")));
      }
      continue;
    }
    const ChunkMeta& found = *existing;
    if (!(r.open_existing && r.persistent && found.persistent)) {
      return fail(absl::AlreadyExistsError(absl::StrCat(
          "uid ", tenant, " already has ", found.persistent ? "a persistent" : "a scratch",
          " chunk named '", r.name, "' (chunk ", found.id, ")",
          found.lost         ? ", lost in a crash; free it first"
          : found.persistent ? "; set open_existing to open it"
                             : "")));
    }
    if (found.lost) {
      return fail(absl::DataLossError(absl::StrCat(
          "persistent chunk '", r.name, "' (chunk ", found.id,
          ") was lost: its current version was in memory when the daemon stopped without a "
          "clean shutdown (NVMe holds no copy of that version); free it to create it afresh")));
    }
    if (found.size != r.size) {
      return fail(absl::FailedPreconditionError(absl::StrCat("persistent chunk '", r.name,
                                                             "' (chunk ", found.id, ") has size ",
                                                             found.size, ", not ", r.size)));
    }
    if (absl::Status s = sessions_.CheckLease(found.id, found.name, session.id, r.shared, "open");
        !s.ok())
      return fail(s);
    result[i] = found.id;
  }

  Sessions::State& state = sessions_.Of(session);
  const uint64_t fresh = std::count(result.begin(), result.end(), ChunkId{0});
  if (absl::Status s = ledger_.CheckChunks(tenant, state.owned.size(), fresh); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("Allocate: ", s.message()));
  }

  // Reserve space for the new chunks; give it all back if any reservation fails.
  std::vector<Placement> placements(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    if (result[i] != 0) continue;
    absl::StatusOr<Placement> p =
        space_.Reserve(requests[i].home, tenant,
                       space_.SpaceIn(requests[i].home, requests[i].size, requests[i].persistent));
    if (!p.ok()) {
      for (size_t j = 0; j < i; ++j) {
        if (result[j] == 0) space_.Release(tenant, placements[j]);
      }
      return absl::Status(p.status().code(),
                          absl::StrCat("Allocate, chunk #", i, ": ", p.status().message()));
    }
    placements[i] = *p;
  }

  ledger_.AddChunks(tenant, static_cast<int64_t>(fresh));
  size_t volatile_persistent = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const ChunkRequest& r = requests[i];
    if (result[i] != 0) {  // an opened persistent chunk: this session holds a lease on it too
      chunks_.at(result[i]).owner = sessions_.Join(result[i], session.id, r.shared);
      continue;
    }
    ChunkMeta& chunk = Insert(tenant, session.id, r.size, placements[i], r.name, r.persistent);
    chunk.tags = r.tags;
    if (r.persistent && tiers_.index == nullptr) ++volatile_persistent;
    if (r.persistent) sessions_.Grant(chunk.id, session.id, r.shared);
    if (!r.persistent) state.owned.insert(chunk.id);
    result[i] = chunk.id;
  }
  if (volatile_persistent > 0) {
    TIERD_LOG_LIMITED(warn,
                      "{} created {} persistent chunks, but this daemon has no NVMe tier: they "
                      "live in host memory only and are lost when the daemon stops",
                      session.Describe(), volatile_persistent);
  }
  return result;
}

absl::Status ChunkService::Free(const Session& session, std::span<const ChunkId> ids) {
  if (absl::Status s = CheckBatch(ids.size(), "Free"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids);
  if (!chunks.ok()) return chunks.status();
  for (const ChunkMeta* chunk : *chunks) {
    if (absl::Status s = CheckFreeable(*chunk); !s.ok()) return s;
    // Nothing frees state another live session holds.
    if (absl::Status s = sessions_.CheckLease(chunk->id, chunk->name, session.id, false, "free");
        !s.ok())
      return s;
  }
  // One being moved (a write-back its owner did not ask for, or a move it did not wait for) ends
  // when that move settles, as at a session's end.
  for (ChunkMeta* chunk : *chunks) Retire(*chunk);
  room_.RetryQueuedFetches();
  room_freed_.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<AcquireResult> ChunkService::Acquire(const Session& session,
                                                    std::span<const ChunkId> ids, TierKind tier,
                                                    Access access) {
  if (absl::Status s = CheckBatch(ids.size(), "Acquire"); !s.ok()) return s;
  if (absl::Status s = CheckTier(tier, "Acquire"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  // When a tier the chunks must come into is full of copies that exist nowhere else, this waits
  // (the lock released) while the oldest of them are written down, then validates again.
  const absl::Time arrived = clock_.Now();
  const absl::Time give_up = absl::Now() + absl::Minutes(1);  // real time: a condition wait
  absl::StatusOr<std::vector<ChunkMeta*>> chunks;
  bool all_ready;
  bool waited_for_room = false;
  for (;;) {
    if (session.ended) return Ended(session);
    chunks = Resolve(session, ids);
    if (!chunks.ok()) return chunks.status();
    all_ready = true;
    for (const ChunkMeta* chunk : *chunks) {
      if (CheckPin(*chunk, tier).ok()) continue;
      all_ready = false;
      if (access == Access::kOverwrite && chunk->state == ChunkState::kReady) continue;  // no fetch
      if (absl::Status s = CheckAcquirable(*chunk, tier); !s.ok()) return s;
    }
    if (all_ready) break;
    absl::StatusOr<bool> reserved = room_.ReserveForAcquire(*chunks, tier, access);
    if (!reserved.ok()) return reserved.status();
    if (*reserved) break;
    if (absl::Now() >= give_up) {
      return absl::ResourceExhaustedError(
          absl::StrCat("Acquire: no room in the ", TierName(tier),
                       " tier came free within a minute; what is there is pinned or moving"));
    }
    room_freed_.WaitWithDeadline(&mu_, give_up);
    waited_for_room = true;
  }
  // An overwrite lands in the room reserved for it: the old contents are not wanted.
  if (access == Access::kOverwrite) {
    all_ready = true;
    for (ChunkMeta* chunk : *chunks) {
      if (chunk->state == ChunkState::kReady && chunk->allocated.contains(tier)) {
        chunk->resident.insert(tier);
      }
      all_ready = all_ready && CheckPin(*chunk, tier).ok();
    }
  }
  // A write to a chunk at home in memory whose NVMe copy the index calls current waits for the
  // index to say otherwise (Mark): the token cannot be completed up front.
  const bool marks =
      Writes(access) && std::any_of(chunks->begin(), chunks->end(),
                                    [this](const ChunkMeta* c)
                                        ABSL_NO_THREAD_SAFETY_ANALYSIS { return NeedsMark(*c); });
  std::shared_ptr<Batch> batch;
  if (all_ready && !marks) {
    absl::StatusOr<SlotToken> token = session.completions->PostCompleted(absl::OkStatus());
    if (!token.ok()) return token.status();
    batch = std::make_shared<Batch>();
    batch->token = *token;
  } else {
    absl::StatusOr<std::shared_ptr<Batch>> b = NewBatch(session);
    if (!b.ok()) return b.status();
    batch = std::move(*b);
  }

  AcquireResult result;
  result.ready = batch->token;
  result.locations.reserve(ids.size());
  Sessions::State& state = sessions_.Of(session);
  if (waited_for_room) sessions_.AddStall(session.id, tier, clock_.Now() - arrived);
  for (ChunkMeta* chunk : *chunks) {
    Hold(*chunk);
    chunk->last_use = ++use_clock_;
    state.pins[chunk->id].count += 1;
    const bool ready = CheckPin(*chunk, tier).ok();
    sessions_.CountAcquired(state, ready);
    BringIn(*chunk, tier, batch, session.id, access, clock_.Now());
    // Final even for a chunk still on its way: its space in `tier` was reserved above or by the
    // move it joined.
    result.locations.push_back(chunk->placement[tier]);
  }
  batch->Done(absl::OkStatus());  // the issuer's reference
  schedules_.Record(session, *chunks, tier, access);
  return result;
}

absl::Status ChunkService::Release(const Session& session, std::span<const ChunkId> ids) {
  if (absl::Status s = CheckBatch(ids.size(), "Release"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids);
  if (!chunks.ok()) return chunks.status();
  Sessions::State& state = sessions_.Of(session);
  for (const ChunkMeta* chunk : *chunks) {
    if (!state.pins.contains(chunk->id)) {
      return absl::FailedPreconditionError(
          absl::StrCat("chunk ", chunk->id, " is not acquired by ", session.Describe()));
    }
  }
  for (ChunkMeta* chunk : *chunks) {
    Unpin(*chunk);
    auto it = state.pins.find(chunk->id);
    Sessions::Pins& pins = it->second;
    // Reads are released first: a write in effect keeps the chunk from being copied longest.
    if (--pins.count < pins.writes) {
      --pins.writes;
      --chunk->writers;
    }
    if (pins.count == 0) state.pins.erase(it);
  }
  // Released copies may be what waiting fetches need dropped.
  room_.RetryQueuedFetches();
  room_freed_.SignalAll();
  return absl::OkStatus();
}

absl::Time PrefetchDeadline(absl::Time now, int priority) {
  // Clamped so that the product cannot overflow; the I/O engine caps any wait anyway.
  constexpr int kLimit = 24 * 3600 * 1000;
  return now - kPriorityUnit * std::clamp(priority, -kLimit, kLimit);
}

absl::StatusOr<SlotToken> ChunkService::Prefetch(const Session& session,
                                                 std::span<const ChunkId> ids, TierKind tier,
                                                 int priority) {
  // Prefetch into NVMe is a flush: write there, keep the host copy.
  if (tier == TierKind::kNvme) return Evict(session, ids, tier, /*keep_source=*/true);
  if (absl::Status s = CheckBatch(ids.size(), "Prefetch"); !s.ok()) return s;
  if (absl::Status s = CheckTier(tier, "Prefetch"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids);
  if (!chunks.ok()) return chunks.status();
  for (const ChunkMeta* chunk : *chunks) {
    if (chunk->resident.contains(tier) || chunk->state == ChunkState::kMoving) continue;
    if (absl::Status s = CheckFetchable(*chunk, tier); !s.ok()) return s;
  }
  absl::StatusOr<std::shared_ptr<Batch>> batch = NewBatch(session);
  if (!batch.ok()) return batch.status();
  const absl::Time due = PrefetchDeadline(clock_.Now(), priority);
  for (ChunkMeta* chunk : *chunks) {
    // A chunk on its way anywhere is waited for, then fetched if it did not land in `tier`.
    BringIn(*chunk, tier, *batch, session.id, std::nullopt, due);
  }
  const SlotToken token = (*batch)->token;
  (*batch)->Done(absl::OkStatus());  // the issuer's reference
  return token;
}

absl::Status ChunkService::CheckEvictable(const ChunkMeta& chunk, TierKind tier) const {
  if (chunk.state == ChunkState::kMoving) return absl::OkStatus();
  if (tier == TierKind::kHost && !chunk.resident.contains(TierKind::kDevice)) {
    if (!chunk.resident.contains(TierKind::kHost)) {
      // A state the caller may not have seen coming: the daemon moves unpinned chunks down on
      // its own (room for another chunk, a quota, a drain).
      return absl::FailedPreconditionError(
          absl::StrCat("chunk ", chunk.id,
                       " has no copy on the host or above to evict (it is on NVMe); use "
                       "Prefetch to bring it up"));
    }
    return absl::OkStatus();  // nothing above the host copy: nothing to do
  }
  // Copies that are read or dropped must not change meanwhile.
  if (chunk.pins > 0) {
    return absl::FailedPreconditionError(absl::StrCat("chunk ", chunk.id, " is acquired (",
                                                      chunk.pins,
                                                      " pins); release it before evicting it "
                                                      "to the ",
                                                      TierName(tier), " tier"));
  }
  if (chunk.resident.empty()) {
    return absl::DataLossError(absl::StrCat("chunk ", chunk.id, " has no valid copy in any tier"));
  }
  return absl::OkStatus();
}

void ChunkService::EvictSettled(ChunkMeta& chunk, TierKind tier, bool keep_source,
                                const std::shared_ptr<Batch>& batch) {
  const std::optional<Mover::Route> route = Mover::RouteFor(chunk, tier, Mover::Direction::kDown);
  if (!route) {  // a copy there is current: only the copies above go, unless kept
    if (!keep_source) mover_.DropAbove(chunk, tier);
    return;
  }
  if (absl::Status s =
          mover_.Start(chunk, *route, batch, keep_source, OrderFor(chunk, clock_.Now()));
      !s.ok()) {
    batch->Add();
    batch->Done(s);
  }
}

absl::StatusOr<SlotToken> ChunkService::Evict(const Session& session, std::span<const ChunkId> ids,
                                              TierKind tier, bool keep_source) {
  if (absl::Status s = CheckBatch(ids.size(), "Evict"); !s.ok()) return s;
  if (absl::Status s = CheckTier(tier, "Evict"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids);
  if (!chunks.ok()) return chunks.status();
  if (tier == TierKind::kDevice) {
    return absl::InvalidArgumentError(
        "Evict: the device tier is the top tier; nothing can be evicted into it (use Prefetch)");
  }
  for (const ChunkMeta* chunk : *chunks) {
    if (absl::Status s = CheckEvictable(*chunk, tier); !s.ok()) return s;
  }
  absl::StatusOr<std::shared_ptr<Batch>> batch = NewBatch(session);
  if (!batch.ok()) return batch.status();
  for (ChunkMeta* chunk : *chunks) EvictOne(*chunk, tier, keep_source, *batch, session.id);
  const SlotToken token = (*batch)->token;
  (*batch)->Done(absl::OkStatus());
  return token;
}

void ChunkService::EvictOne(ChunkMeta& chunk, TierKind tier, bool keep_source,
                            const std::shared_ptr<Batch>& batch, SessionId session) {
  if (chunk.state == ChunkState::kMoving) {
    // On its way somewhere (a planner write-back, a fetch): evicted once the move settles.
    batch->Add();
    waiters_.Add(chunk.id, Waiter{batch, session, tier, std::nullopt, clock_.Now(), keep_source});
    return;
  }
  EvictSettled(chunk, tier, keep_source, batch);
}

absl::StatusOr<std::vector<ChunkMeta>> ChunkService::Stat(const Session& session,
                                                          std::span<const ChunkId> ids) {
  if (absl::Status s = CheckBatch(ids.size(), "Stat"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids);
  if (!chunks.ok()) return chunks.status();
  std::vector<ChunkMeta> out;
  out.reserve(chunks->size());
  for (const ChunkMeta* chunk : *chunks) out.push_back(*chunk);
  return out;
}

ChunkPage ChunkService::List(const Session& session, ChunkId page_token, uint32_t page_size) const {
  if (page_size == 0) page_size = kDefaultPageSize;
  page_size = std::min(page_size, kMaxPageSize);
  absl::MutexLock lock(&mu_);
  static const std::set<ChunkId> kNone;
  const std::set<ChunkId>* owned = &kNone;
  if (const Sessions::State* state = sessions_.Find(session.id)) owned = &state->owned;
  const std::set<ChunkId>* persistent = &chunks_.PersistentOf(session.peer.uid);
  ChunkPage page;
  auto a = owned->lower_bound(page_token);
  auto b = persistent->lower_bound(page_token);
  while (a != owned->end() || b != persistent->end()) {
    ChunkId next;
    if (b == persistent->end() || (a != owned->end() && *a < *b)) {
      next = *a++;
    } else {
      next = *b++;
    }
    if (page.chunks.size() == page_size) {
      page.next_page_token = next;
      break;
    }
    page.chunks.push_back(chunks_.at(next));
  }
  return page;
}

}  // namespace tierd::daemon
