#include "daemon/chunks/chunk_service.h"

#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/fmt_absl.h"
#include "common/sizes.h"
#include "daemon/chunks/batch.h"
#include "daemon/util/log_limiter.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {

namespace {

absl::Status Ended(const Session& session) {
  return absl::UnavailableError(absl::StrCat(session.Describe(), " has ended"));
}

absl::Status CheckBatch(size_t n, absl::string_view what) {
  if (n == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": the batch is empty"));
  if (n > kMaxBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a batch holds at most ", kMaxBatch, " chunks, not ", n));
  }
  return absl::OkStatus();
}

absl::Status CheckOperator(const Session& session, absl::string_view what) {
  if (IsOperator(session)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      what, " acts on every session's chunks: only root or the daemon's own user (uid ", geteuid(),
      ") may; ", session.Describe(), " is neither"));
}

}  // namespace

ChunkService::ChunkService(const Tiers& tiers, const Clock& clock)
    : tiers_(tiers),
      clock_(clock),
      space_(chunks_, ledger_, tiers, clock_),
      bases_(chunks_, sessions_, space_, ledger_),
      report_(chunks_, sessions_, bases_, meter_),
      room_(chunks_, ledger_, tiers, space_, mover_, waiters_, sessions_, clock_),
      schedules_(chunks_, ledger_, clock_),
      round_(chunks_, space_, mover_, sessions_, schedules_, meter_, tiers, clock_),
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
  return CheckTierConfigured(tiers_, tier, what);
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
    if (chunk.base != 0) {
      if (absl::Status s = bases_.CheckHeld(chunk, session); !s.ok()) return s;
    } else if (const bool allowed =
                   chunk.persistent ? chunk.tenant == session.peer.uid : chunk.owner == session.id;
               !allowed) {
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
    if (absl::Status s = CheckChunkRequest(r, tiers_); !s.ok()) return fail(s);
    if (r.name.empty()) continue;
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

  SessionLedger::State& state = sessions_.Of(session);
  const uint64_t fresh = std::count(result.begin(), result.end(), ChunkId{0});
  if (absl::Status s = ledger_.CheckChunks(tenant, state.owned.size(), fresh); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("Allocate: ", s.message()));
  }

  // Reserve space for the new chunks; give it all back if any reservation fails.
  std::vector<Placement> placements(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    if (result[i] != 0) continue;
    absl::StatusOr<Placement> p =
        space_.Reserve(requests[i].home, UserOwner(tenant),
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
    chunk.transient = r.transient;
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
    if (chunk->base != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "chunk ", chunk->id, " belongs to a shared base: it goes with the base (ReleaseBase)"));
    }
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
                                                    Access access, absl::Time deadline) {
  if (absl::Status s = CheckBatch(ids.size(), "Acquire"); !s.ok()) return s;
  if (absl::Status s = CheckTier(tier, "Acquire"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  // When a tier the chunks must come into is full of copies that exist nowhere else, this waits
  // (the lock released) while the oldest of them are written down, or while other sessions hold
  // what fills it pinned, then validates again.
  const absl::Time arrived = clock_.Now();
  // Real time: a condition wait.
  const absl::Time started = absl::Now();
  // It gives up a tenth of the time left before the caller's deadline (at most a second), so
  // that the refusal saying why reaches the caller, and after a minute at most.
  const absl::Duration left = std::max(deadline - started, absl::ZeroDuration());
  const absl::Time give_up =
      std::min(deadline - std::min(absl::Seconds(1), left / 10), started + absl::Minutes(1));
  absl::StatusOr<std::vector<ChunkMeta*>> chunks;
  bool all_ready;
  bool waited_for_room = false;
  for (;;) {
    if (session.ended) return Ended(session);
    chunks = Resolve(session, ids);
    if (!chunks.ok()) return chunks.status();
    for (const ChunkMeta* chunk : *chunks) {
      if (chunk->base == 0) continue;
      if (absl::Status s = bases_.CheckUse(session, *chunk, tier, access); !s.ok()) return s;
    }
    all_ready = true;
    for (const ChunkMeta* chunk : *chunks) {
      if (CheckPin(*chunk, tier).ok()) continue;
      all_ready = false;
      if (access == Access::kOverwrite && chunk->state == ChunkState::kReady) continue;  // no fetch
      if (absl::Status s = CheckAcquirable(*chunk, tier); !s.ok()) return s;
    }
    if (all_ready) break;
    absl::StatusOr<bool> reserved = room_.ReserveForAcquire(*chunks, tier, access, session.id);
    if (!reserved.ok()) return reserved.status();
    if (*reserved) break;
    if (absl::Now() >= give_up) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "Acquire: no room in the ", TierName(tier), " tier came free within ",
          absl::FormatDuration(absl::Now() - started),
          " (the call's deadline, at most a minute); what is there is pinned or moving"));
    }
    SessionLedger::State& state = sessions_.Of(session);
    if (state.acquires_waiting >= kMaxWaitingAcquires) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "Acquire: no room in the ", TierName(tier), " tier now, and ", kMaxWaitingAcquires,
          " Acquires of ", session.Describe(), " already wait for room"));
    }
    ++state.acquires_waiting;
    room_freed_.WaitWithDeadline(&mu_, give_up);
    if (SessionLedger::State* still = sessions_.Find(session.id)) --still->acquires_waiting;
    waited_for_room = true;
  }
  // An overwrite lands in the room reserved for it: the old contents are not wanted.
  if (access == Access::kOverwrite) {
    all_ready = true;
    for (ChunkMeta* chunk : *chunks) {
      if (chunk->state == ChunkState::kReady && chunk->allocated.contains(tier)) {
        chunk->resident.insert(tier);
        chunks_.Reindex(*chunk);
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
  SessionLedger::State& state = sessions_.Of(session);
  if (waited_for_room) sessions_.AddStall(session.id, tier, clock_.Now() - arrived);
  for (ChunkMeta* chunk : *chunks) {
    Hold(*chunk);
    chunk->last_use = ++use_clock_;
    chunks_.Reindex(*chunk);
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
  SessionLedger::State& state = sessions_.Of(session);
  for (const ChunkMeta* chunk : *chunks) {
    if (!state.pins.contains(chunk->id)) {
      return absl::FailedPreconditionError(
          absl::StrCat("chunk ", chunk->id, " is not acquired by ", session.Describe()));
    }
  }
  for (ChunkMeta* chunk : *chunks) {
    Unpin(*chunk);
    auto it = state.pins.find(chunk->id);
    SessionLedger::Pins& pins = it->second;
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
    if (chunk->base != 0) {
      if (absl::Status s = bases_.CheckUse(session, *chunk, tier, std::nullopt); !s.ok()) return s;
    }
    if (chunk->resident.contains(tier) || chunk->state == ChunkState::kMoving) continue;
    if (absl::Status s = mover_.CheckFetchable(*chunk, tier); !s.ok()) return s;
  }
  absl::StatusOr<std::shared_ptr<Batch>> batch = NewBatch(session);
  if (!batch.ok()) return batch.status();
  const absl::Time due = PrefetchDeadline(clock_.Now(), priority);
  for (ChunkMeta* chunk : *chunks) {
    // Wanted there by `due`: room made meanwhile drops copies wanted later first.
    Want(*chunk, tier, due, /*by_plan=*/false);
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
  for (ChunkMeta* chunk : *chunks) {
    if (!keep_source) Unwant(*chunk);  // sent down: not wanted above
    EvictOne(*chunk, tier, keep_source, *batch, session.id);
  }
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

absl::Status ChunkService::Discard(const Session& session, std::span<const ChunkId> ids) {
  if (absl::Status s = CheckBatch(ids.size(), "Discard"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids);
  if (!chunks.ok()) return chunks.status();
  for (const ChunkMeta* chunk : *chunks) {
    absl::string_view why;
    if (chunk->base != 0) {
      why = "belongs to a shared base, which is read-only";
    } else if (chunk->persistent) {
      why = "is persistent: its contents are kept until it is freed";
    } else if (chunk->writers > 0) {
      why = "is acquired for write; release it first";
    }
    if (!why.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("Discard: chunk ", chunk->id, " ", why, "; nothing was discarded"));
    }
  }
  for (ChunkMeta* chunk : *chunks) {
    if (chunk->state == ChunkState::kMoving) continue;  // the move settles as it would
    const TierKind floor = DiscardContents(*chunk);
    if (chunk->pins == 0) mover_.DropAbove(*chunk, floor);
  }
  room_.RetryQueuedFetches();
  room_freed_.SignalAll();
  return absl::OkStatus();
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
  absl::MutexLock lock(&mu_);
  return report_.SessionChunks(session, page_token, page_size);
}

// ---- the requests that wait on moves: a fetch or an eviction that cannot be answered at once
// leaves a Waiter on the chunk and has the Mover start the move; when the Mover reports a move
// settled, the waiters are served, sent after the chunk again, or failed ----

IoOrder ChunkService::OrderFor(const ChunkMeta& chunk, absl::Time deadline) const {
  return sessions_.OrderFor(chunk.owner, deadline);
}

absl::Status ChunkService::StartFetch(ChunkMeta& chunk, TierKind tier, absl::Time deadline) {
  // Whoever waits for the chunk is a Waiter, woken when the move settles.
  return mover_.Fetch(chunk, tier, /*batch=*/nullptr, OrderFor(chunk, deadline));
}

absl::Status ChunkService::CheckAcquirable(const ChunkMeta& chunk, TierKind tier) const {
  if (chunk.resident.contains(tier)) return absl::OkStatus();  // the pin keeps this copy
  if (chunk.state == ChunkState::kMoving && chunk.moving_to == tier) return absl::OkStatus();
  // Not there (or on its way elsewhere: fetched once that move settles).
  return mover_.CheckFetchable(chunk, tier);
}

void ChunkService::BringIn(ChunkMeta& chunk, TierKind tier, const std::shared_ptr<Batch>& batch,
                           SessionId session, std::optional<Access> pin, absl::Time deadline) {
  if (chunk.state == ChunkState::kReady && chunk.resident.contains(tier)) {
    if (pin) Apply(chunk, tier, *pin, session, batch);
    return;
  }
  batch->Add();
  waiters_.Add(chunk.id, Waiter{batch, session, tier, pin, clock_.Now()});
  if (chunk.state == ChunkState::kMoving) return;  // woken when the move settles
  // An Acquire's space was reserved up front (its location is final); other requests may queue
  // for room.
  if (absl::Status s =
          pin ? StartFetch(chunk, tier, deadline) : room_.FetchOrQueue(chunk, tier, deadline);
      !s.ok()) {
    // Nothing will settle: fail the waiter now (an Acquire's pin stays until Release).
    waiters_.TakeLast(chunk.id).batch->Done(s);
  }
}

void ChunkService::WakeWaiters(ChunkMeta& chunk, const absl::Status& moved) {
  if (chunk.state != ChunkState::kReady) return;  // a chained move is still on its way
  std::vector<Waiter> waiting = waiters_.TakeAll(chunk.id);
  const absl::Time now = clock_.Now();
  for (Waiter& w : waiting) {
    if (w.evict_keep_source) {
      if (chunk.state == ChunkState::kMoving) {  // an earlier waiter started a move
        waiters_.Add(chunk.id, std::move(w));
      } else if (absl::Status s = CheckEvictable(chunk, w.tier); !s.ok()) {
        w.batch->Done(s);
      } else {
        EvictSettled(chunk, w.tier, *w.evict_keep_source, w.batch);
        w.batch->Done(absl::OkStatus());
      }
      continue;
    }
    if (chunk.resident.contains(w.tier) && w.pin && chunk.state == ChunkState::kMoving) {
      // An earlier waiter started a move of the chunk: the access applies once it settles.
      waiters_.Add(chunk.id, std::move(w));
    } else if (chunk.resident.contains(w.tier)) {
      if (w.pin) {
        Apply(chunk, w.tier, *w.pin, w.session, w.batch);
        sessions_.AddStall(w.session, w.tier, now - w.since);
        acquire_wait_seconds_[w.tier].Observe(absl::ToDoubleSeconds(now - w.since));
      }
      w.batch->Done(absl::OkStatus());
    } else if (!moved.ok()) {
      w.batch->Done(absl::Status(moved.code(),
                                 absl::StrCat("chunk ", chunk.id, " could not be brought into the ",
                                              TierName(w.tier), " tier: ", moved.message())));
    } else if (absl::Status s = mover_.CheckFetchable(chunk, w.tier); !s.ok()) {
      w.batch->Done(s);
    } else if (chunk.state == ChunkState::kMoving) {
      // An earlier waiter's fetch has just started: wait for it too.
      waiters_.Add(chunk.id, std::move(w));
    } else {
      // The move that ended went elsewhere (or dropped the copy): fetch for this waiter now.
      if (absl::Status f = room_.FetchOrQueue(chunk, w.tier, now); !f.ok()) {
        w.batch->Done(f);
      } else {
        waiters_.Add(chunk.id, std::move(w));
      }
    }
  }
}

void ChunkService::MoveSettled(ChunkMeta& chunk, const Mover::Settlement& settled) {
  mu_.AssertHeld();          // the Mover's call up, which the analysis cannot follow
  room_.MoveDone(chunk.id);  // a write-down for room: that room is no longer coming
  sessions_.AddMoved(chunk.owner, settled.crossed);
  if (settled.brought_in) {
    chunk.last_use = ++use_clock_;
    chunks_.Reindex(chunk);
  }
  room_freed_.SignalAll();
  AfterMove(chunk, settled.status);
}

void ChunkService::AfterMove(ChunkMeta& chunk, const absl::Status& moved) {
  if (chunk.doomed) {
    // Whoever waited for it learns it is gone; nothing is fetched or evicted for it again.
    waiters_.FailAll(chunk.id, Retired(chunk));
    if (chunk.state != ChunkState::kMoving) Destroy(chunk);
  } else {
    WakeWaiters(chunk, moved);
  }
  room_.RetryQueuedFetches();
}

void ChunkService::Apply(ChunkMeta& chunk, TierKind tier, Access access, SessionId session,
                         const std::shared_ptr<Batch>& batch) {
  ApplyAccess(chunk, tier, access);
  chunks_.Reindex(chunk);
  if (!Writes(access)) return;
  if (NeedsMark(chunk)) mover_.Mark(chunk, batch);
  SessionLedger::State* state = sessions_.Find(session);
  if (state == nullptr) return;
  auto pins = state->pins.find(chunk.id);
  // A write whose acquisition was released before its data arrived has nothing left to guard.
  if (pins == state->pins.end() || pins->second.writes >= pins->second.count) return;
  ++pins->second.writes;
  ++chunk.writers;
}

// ---- schedules as clients declare them (kept by Schedules) and the planning
// round (RunPlanningRound: PlanRound collects and applies, daemon/planner/planner.h plans) ----

absl::Status ChunkService::SetSchedule(const Session& session, ScheduleRequest request) {
  if (absl::Status s = CheckScheduleShape(request, tiers_); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  sessions_.Of(session);
  if (absl::Status s = schedules_.CheckLimits(session, request); !s.ok()) return s;
  if (absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ScheduledChunks(request));
      !chunks.ok()) {
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

size_t ChunkService::RunPlanningRound(absl::Time now) {
  // The planner's input is taken under the lock; the plan is computed without it (other tenants'
  // requests go on meanwhile), and its moves are checked again against the table as they start.
  PlanInput in;
  Schedules::Round round;  // alive while the plan is computed: the plans point into it
  {
    absl::MutexLock lock(&mu_);
    if (!round_.Collect(now, round, in)) return 0;
  }
  std::vector<NextUse> uses;
  const std::vector<PlannedMove> moves = Plan(in, &uses);
  absl::MutexLock lock(&mu_);
  round_.Stamp(uses, now);
  return round_.Apply(moves);
}

SessionStats ChunkService::session_stats(const Session& session) const {
  absl::MutexLock lock(&mu_);
  const SessionLedger::State* state = sessions_.Find(session.id);
  if (state == nullptr) return SessionStats{};
  SessionStats stats = state->stats;
  stats.bandwidth_weight = state->weight;
  const Schedules::Figures figures = schedules_.FiguresOf(session.id);
  stats.cursor = figures.cursor;
  stats.schedule_steps = figures.steps;
  stats.tracing = figures.tracing;
  return stats;
}

// ---- a chunk's birth and end (created, freed, retired with its session), and waiting for the
// tiers at the daemon's stop (persistent chunks across a restart: chunk_service_restart.cc) ----

ChunkService::~ChunkService() { WaitForIdle(); }

void ChunkService::WaitForIdle() { mover_.WaitForIdle(); }

ChunkMeta& ChunkService::Insert(uint32_t tenant, SessionId owner, uint64_t size,
                                const Placement& home, const std::string& name, bool persistent) {
  ChunkMeta& chunk = chunks_.Insert(tenant, name, persistent);
  chunk.size = size;
  chunk.owner = owner;
  chunk.home = home.tier;
  chunk.allocated.insert(home.tier);
  chunk.resident.insert(home.tier);
  chunk.placement[home.tier] = home;
  chunk.memory_home = persistent && home.tier != TierKind::kNvme;
  chunks_.Reindex(chunk);
  return chunk;
}

void ChunkService::Retire(ChunkMeta& chunk) {
  if (chunk.state == ChunkState::kMoving) {
    chunk.doomed = true;  // AfterMove destroys it
    return;
  }
  waiters_.FailAll(chunk.id, Retired(chunk));
  Destroy(chunk);
}

void ChunkService::Destroy(ChunkMeta& chunk) {
  assert(chunk.state != ChunkState::kMoving);  // Retire defers it to the move's end
  for (TierKind t : kAllTiers) {
    if (chunk.allocated.contains(t)) space_.Release(chunk.tenant, chunk.placement[t]);
  }
  ledger_.AddChunks(chunk.tenant, -1);
  // A chunk at home in memory may have a record without a copy (or one being written): forgetting
  // a name the index does not hold costs nothing.
  if (chunk.persistent && tiers_.index != nullptr && (chunk.written || chunk.memory_home))
    tiers_.index->Forget(chunk.tenant, chunk.name);
  if (!chunk.persistent) {
    if (SessionLedger::State* owner = sessions_.Find(chunk.owner)) owner->owned.erase(chunk.id);
  }
  sessions_.ForgetLease(chunk.id);
  chunks_.Erase(chunk);
}

size_t ChunkService::CloseSession(const Session& session) {
  absl::MutexLock lock(&mu_);
  session.ended = true;
  std::optional<SessionLedger::State> state = sessions_.End(session.id);
  if (!state) return 0;
  schedules_.End(session);
  for (const auto& [id, pins] : state->pins) {
    waiters_.Forget(id, session.id);
    ChunkMeta& chunk = chunks_.at(id);
    for (uint32_t i = 0; i < pins.count; ++i) Unpin(chunk);
    chunk.writers -= pins.writes;
  }
  size_t freed = 0;
  for (ChunkId id : state->owned) {
    ChunkMeta& chunk = chunks_.at(id);
    assert(chunk.pins == 0);  // only its owner can pin a scratch chunk
    ++freed;
    Retire(chunk);
  }
  for (ChunkId id : chunks_.PersistentOf(session.peer.uid)) {
    if (std::optional<SessionId> holder = sessions_.Leave(id, session.id)) {
      chunks_.at(id).owner = *holder;
    }
  }
  for (ChunkId id : bases_.LeaveAll(session.id)) Retire(chunks_.at(id));
  room_.RetryQueuedFetches();
  room_freed_.SignalAll();
  return freed;
}

// ---- shared bases (their rules are SharedBases'; the service makes and retires their chunks)
// and imports (the daemon writes a file into a chunk a session holds for writing) ----

absl::StatusOr<OpenedBase> ChunkService::OpenBase(const Session& session, absl::string_view name,
                                                  const BaseRequest* create) {
  if (absl::Status s = SharedBases::CheckOpen(name, create, tiers_); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  const size_t owned = sessions_.Of(session).owned.size();
  absl::StatusOr<SharedBases::Opening> opening = bases_.Open(session, name, create, owned);
  if (!opening.ok()) return opening.status();
  Base& base = *opening->base;
  for (size_t i = 0; i < opening->to_make.size(); ++i) {
    bases_.Attach(base, Insert(base.creator, /*owner=*/0, create->sizes[i], opening->to_make[i], "",
                               /*persistent=*/false));
  }
  return bases_.Opened(base, /*created=*/!opening->to_make.empty());
}

absl::Status ChunkService::SealBase(const Session& session, absl::string_view name,
                                    std::string descriptor) {
  absl::MutexLock lock(&mu_);
  return bases_.Seal(session, name, std::move(descriptor));
}

absl::Status ChunkService::ReleaseBase(const Session& session, absl::string_view name) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::vector<ChunkId>> gone = bases_.Release(session, name);
  if (!gone.ok()) return gone.status();
  RetireBaseChunks(*gone);
  return absl::OkStatus();
}

absl::Status ChunkService::PinBase(const Session& session, absl::string_view name, bool pinned) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::vector<ChunkId>> gone = bases_.Pin(session, name, pinned);
  if (!gone.ok()) return gone.status();
  RetireBaseChunks(*gone);
  return absl::OkStatus();
}

void ChunkService::RetireBaseChunks(std::span<const ChunkId> ids) {
  if (ids.empty()) return;
  for (ChunkId id : ids) Retire(chunks_.at(id));
  room_.RetryQueuedFetches();
  room_freed_.SignalAll();
}

std::vector<BaseStatus> ChunkService::ListBases(const Session& session) const {
  absl::MutexLock lock(&mu_);
  return bases_.List(session);
}

absl::StatusOr<bool> ChunkService::MayMapBaseSegment(const Session& session, uint32_t owner) const {
  absl::MutexLock lock(&mu_);
  return bases_.MayMapSegment(session, owner);
}

absl::StatusOr<std::span<char>> ChunkService::BeginImport(const Session& session, ChunkId id) {
  absl::MutexLock lock(&mu_);
  if (session.ended) {
    return absl::FailedPreconditionError(absl::StrCat(session.Describe(), " has ended"));
  }
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, {&id, 1});
  if (!chunks.ok()) return chunks.status();
  ChunkMeta& chunk = *chunks->front();
  SessionLedger::State& state = sessions_.Of(session);
  auto pins = state.pins.find(id);
  // A write in effect leaves the written copy the only valid one: in the host tier, it is there.
  if (pins == state.pins.end() || pins->second.writes == 0 ||
      !chunk.resident.contains(TierKind::kHost) || chunk.state != ChunkState::kReady) {
    return absl::FailedPreconditionError(
        absl::StrCat("import into chunk ", id, ": ", session.Describe(),
                     " must hold it acquired for writing in the host tier, its data there"));
  }
  // One more write pin in the session's name: the chunk is neither moved, copied nor freed until
  // EndImport, whatever the client releases meanwhile.
  Hold(chunk);
  ++pins->second.count;
  ++pins->second.writes;
  ++chunk.writers;
  void* address = tier(TierKind::kHost)->Address(chunk.placement[TierKind::kHost]);
  return std::span<char>(static_cast<char*>(address), chunk.size);
}

void ChunkService::EndImport(const Session& session, ChunkId id) {
  {
    absl::MutexLock lock(&mu_);
    // An ended session's pins went with it (the importer is told before it ends).
    if (session.ended) return;
  }
  if (absl::Status s = Release(session, {&id, 1}); !s.ok()) {
    spdlog::error("{}: the pin of an import into chunk {} was not there to drop: {}",
                  session.Describe(), id, s.message());
  }
}

// ---- operators' requests over every session's chunks (drain a tier, list the node, what each
// session and job holds) and the node-wide figures the metrics endpoint reads ----

absl::StatusOr<DrainResult> ChunkService::Drain(const Session& session, TierKind tier,
                                                std::span<const ChunkId> ids) {
  if (absl::Status s = CheckOperator(session, "Drain"); !s.ok()) return s;
  if (absl::Status s = CheckTier(tier, "Drain"); !s.ok()) return s;
  const std::optional<TierKind> down = Below(tier);
  if (!down) {
    return absl::InvalidArgumentError(
        "Drain: the NVMe tier is the bottom tier; its chunks leave it only when freed");
  }
  const TierKind below = *down;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  if (hop(PathDown(tier)) == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("Drain: this daemon has no ", TierName(below),
                                                      " tier to move the ", TierName(tier),
                                                      " tier's chunks into"));
  }
  auto in_tier = [tier](const ChunkMeta& chunk) {
    return chunk.resident.contains(tier) ||
           (chunk.state == ChunkState::kMoving && chunk.moving_to == tier);
  };
  std::vector<ChunkMeta*> chunks;
  if (ids.empty()) {
    for (auto& [id, chunk] : chunks_) {
      if (in_tier(chunk)) chunks.push_back(&chunk);
    }
  } else {
    if (absl::Status s = CheckBatch(ids.size(), "Drain"); !s.ok()) return s;
    for (ChunkId id : ids) {
      auto it = chunks_.find(id);
      if (it == chunks_.end()) {
        return absl::NotFoundError(absl::StrCat("chunk ", id, " does not exist"));
      }
      if (in_tier(it->second)) chunks.push_back(&it->second);
    }
  }
  absl::StatusOr<std::shared_ptr<Batch>> batch = NewBatch(session);
  if (!batch.ok()) return batch.status();
  DrainResult result{.token = (*batch)->token};
  for (ChunkMeta* chunk : chunks) {
    if (chunk->pins > 0) {
      ++result.pinned;
      continue;
    }
    if (!CheckEvictable(*chunk, below).ok()) continue;  // no copy above `below`: nothing to move
    ++result.chunks;
    result.bytes += chunk->size;
    EvictOne(*chunk, below, /*keep_source=*/false, *batch, session.id);
  }
  spdlog::info("{} drains the {} tier: {} chunks ({}) moving to the {} tier, {} acquired left",
               session.Describe(), TierName(tier), result.chunks, FormatSize(result.bytes),
               TierName(below), result.pinned);
  (*batch)->Done(absl::OkStatus());
  return result;
}

absl::StatusOr<ChunkPage> ChunkService::ListAll(const Session& session, ChunkId page_token,
                                                uint32_t page_size) const {
  if (absl::Status s = CheckOperator(session, "ListChunks(all_sessions)"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  return report_.AllChunks(page_token, page_size);
}

std::map<SessionId, SessionHoldings> ChunkService::Holdings() const {
  absl::MutexLock lock(&mu_);
  return report_.Holdings();
}

std::map<std::string, PathArray<uint64_t>> ChunkService::JobTraffic() const {
  absl::MutexLock lock(&mu_);
  return sessions_.JobTraffic();
}

size_t ChunkService::chunk_count() const {
  absl::MutexLock lock(&mu_);
  return chunks_.size();
}

NodeStats ChunkService::node_stats() const {
  absl::MutexLock lock(&mu_);
  return report_.Stats();
}

}  // namespace tierd::daemon
