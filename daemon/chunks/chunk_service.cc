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
#include "daemon/tiers/device.h"
#include "daemon/tiers/nvme_tier.h"
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

}  // namespace

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

// A batch of asynchronous moves sharing one completion token. Holds the session so that its
// completion page outlives the moves.
struct ChunkService::Batch {
  std::shared_ptr<const Session> session;
  SlotToken token;
  absl::Mutex mu;
  size_t remaining ABSL_GUARDED_BY(mu) = 1;  // the issuer's own reference, dropped last
  absl::Status status ABSL_GUARDED_BY(mu);
  // For the daemon's own batches (no session): called with the result instead.
  std::function<void(const absl::Status&)> on_done;

  void Add() {
    absl::MutexLock lock(&mu);
    ++remaining;
  }
  void Done(const absl::Status& s) {
    absl::Status result;
    {
      absl::MutexLock lock(&mu);
      if (status.ok() && !s.ok()) status = s;
      if (--remaining > 0) return;
      result = status;
    }
    if (session != nullptr) session->completions->Complete(token, result);
    if (on_done) on_done(result);
  }
  absl::Status Status() {
    absl::MutexLock lock(&mu);
    return status;
  }
};

ChunkService::ChunkService(std::array<Tier*, kTierKinds> tiers, NvmeTier* nvme, Device* device)
    : tiers_(tiers), nvme_(nvme), device_(device) {
  assert(tiers_[static_cast<int>(TierKind::kHost)] != nullptr);
  // First guesses (a datacenter NVMe drive, a PCIe 4.0 x16 link), replaced by what the first moves
  // on each path measure.
  paths_[static_cast<int>(Path::kNvmeToHost)].bytes_per_second = 2e9;
  paths_[static_cast<int>(Path::kHostToNvme)].bytes_per_second = 1.5e9;
  paths_[static_cast<int>(Path::kHostToDevice)].bytes_per_second = 20e9;
  paths_[static_cast<int>(Path::kDeviceToHost)].bytes_per_second = 20e9;
}

std::shared_ptr<void> ChunkService::BeginTierOp() {
  {
    absl::MutexLock lock(&ops_mu_);
    ++tier_ops_;
  }
  return std::shared_ptr<void>(this, [](void* service) {
    auto* self = static_cast<ChunkService*>(service);
    absl::MutexLock lock(&self->ops_mu_);
    --self->tier_ops_;
  });
}

template <typename F>
auto ChunkService::Tracked(F callback) {
  return [op = BeginTierOp(), callback = std::move(callback)](auto&&... args) mutable {
    callback(std::forward<decltype(args)>(args)...);
  };
}

void ChunkService::WaitForIdle() {
  absl::MutexLock lock(&ops_mu_);
  ops_mu_.Await(absl::Condition(
      +[](uint64_t* ops) { return *ops == 0; }, &tier_ops_));
}

void ChunkService::MoveStarted(Path path, const ChunkMeta& chunk) {
  const absl::Time now = absl::Now();
  PathMeter& m = paths_[static_cast<int>(path)];
  if (m.in_flight++ == 0) {
    m.window_start = now;
    m.window_bytes = 0;
  }
  m.queued_bytes += chunk.size;
  move_started_[chunk.id] = now;
}

ChunkService::SessionState& ChunkService::StateOf(const Session& session) {
  auto [it, made] = sessions_.try_emplace(session.id);
  if (made) {
    it->second.description = session.Describe();
    it->second.job = session.job;
    if (!session.job.empty()) ++jobs_[session.job].sessions;
  }
  return it->second;
}

void ChunkService::MoveDone(Path path, const ChunkMeta& chunk) {
  const uint64_t bytes = chunk.size;
  // The traffic is the holder's: a scratch chunk's session, a persistent one's first lease.
  if (auto holder = sessions_.find(chunk.owner); holder != sessions_.end()) {
    SessionState& state = holder->second;
    state.moved[static_cast<int>(path)] += bytes;
    if (!state.job.empty()) jobs_[state.job].moved[static_cast<int>(path)] += bytes;
  }
  PathMeter& m = paths_[static_cast<int>(path)];
  m.queued_bytes -= std::min(m.queued_bytes, bytes);
  m.window_bytes += bytes;
  m.bytes_total += bytes;
  ++m.moves_total;
  --m.in_flight;
  const absl::Time now = absl::Now();
  // How long one move took (the transfer-latency histogram) and, per byte, latency and queueing
  // included: mean and mean deviation, as TCP estimates round trips (plans use mean + 4
  // deviations).
  const auto started = move_started_.find(chunk.id);
  const double took =
      started != move_started_.end() ? absl::ToDoubleSeconds(now - started->second) : -1;
  if (took >= 0) transfer_seconds_[static_cast<int>(path)].Observe(took);
  if (took >= 0 && bytes > 0) {
    const double sample = took / static_cast<double>(bytes);
    if (m.move_seconds_per_byte == 0) {
      m.move_seconds_per_byte = sample;
      m.move_deviation_per_byte = sample / 2;
    } else {
      m.move_deviation_per_byte =
          0.75 * m.move_deviation_per_byte + 0.25 * std::abs(sample - m.move_seconds_per_byte);
      m.move_seconds_per_byte = 0.875 * m.move_seconds_per_byte + 0.125 * sample;
    }
  }
  // A sample per busy period, or every 20 ms of a long one; short ones say more about latency.
  const absl::Duration busy = now - m.window_start;
  if ((m.in_flight == 0 && busy >= absl::Milliseconds(1)) || busy >= absl::Milliseconds(20)) {
    const double sample = static_cast<double>(m.window_bytes) / absl::ToDoubleSeconds(busy);
    m.bytes_per_second = m.measured ? 0.7 * m.bytes_per_second + 0.3 * sample : sample;
    m.measured = true;
    m.window_start = now;
    m.window_bytes = 0;
  }
}

ChunkMeta& ChunkService::Insert(uint32_t tenant, SessionId owner, uint64_t size,
                                const Placement& home, const std::string& name, bool persistent) {
  const ChunkId id = next_id_++;
  ChunkMeta& chunk = chunks_[id];
  chunk.id = id;
  chunk.size = size;
  chunk.owner = owner;
  chunk.tenant = tenant;
  chunk.home = home.tier;
  chunk.allocated.insert(home.tier);
  chunk.resident.insert(home.tier);
  chunk.placement[static_cast<int>(home.tier)] = home;
  chunk.persistent = persistent;
  chunk.memory_home = persistent && home.tier != TierKind::kNvme;
  chunk.name = name;
  if (!name.empty()) names_[NameKey(tenant, name)] = id;
  if (persistent) persistent_[tenant].insert(id);
  return chunk;
}

size_t ChunkService::Recover(const std::vector<IndexEntry>& entries) {
  absl::MutexLock lock(&mu_);
  size_t recovered = 0;
  for (const IndexEntry& e : entries) {
    Placement p{TierKind::kNvme, 0, 0, e.offset, e.reserved};
    const bool has_copy = e.reserved != 0;
    if (has_copy && (nvme_ == nullptr || !nvme_->Claim(p))) {
      spdlog::error("NVMe index: persistent chunk '{}' of uid {} overlaps another; not recovered",
                    e.name, e.tenant);
      continue;
    }
    // Counted against the user's quota and chunk limit, which they may now exceed: that blocks new
    // allocations, never the recovery of what was stored.
    if (has_copy) ledger_.AddBytes(e.tenant, TierKind::kNvme, p.size);
    ledger_.AddChunks(e.tenant, 1);
    ChunkMeta& chunk = Insert(e.tenant, /*owner=*/0, e.chunk_size, p, e.name, /*persistent=*/true);
    chunk.memory_home = e.memory_home;
    chunk.checksum = e.checksum;
    chunk.written = has_copy;
    if (!has_copy) chunk.allocated = TierSet();
    if (e.in_memory || !has_copy) {
      // Its current version was in memory when the daemon stopped without writing it down: what
      // NVMe holds (if anything) is older. Kept, named, until its owner frees it.
      chunk.lost = true;
      chunk.marked = true;
      chunk.resident = TierSet();
      spdlog::error(
          "persistent chunk '{}' of uid {} was lost: its current version was in memory when the "
          "daemon stopped without a clean shutdown; opening it fails with DATA_LOSS until it is "
          "freed",
          e.name, e.tenant);
      continue;
    }
    ++recovered;
  }
  return recovered;
}

absl::StatusOr<std::shared_ptr<ChunkService::Batch>> ChunkService::NewBatch(
    const Session& session) {
  absl::StatusOr<SlotToken> token = session.completions->Post();
  if (!token.ok()) return token.status();
  auto batch = std::make_shared<Batch>();
  batch->session = session.shared_from_this();
  batch->token = *token;
  return batch;
}

void ChunkService::DropCopy(ChunkMeta& chunk, TierKind tier) {
  const int t = static_cast<int>(tier);
  if (chunk.allocated.contains(tier)) ReleaseSpace(chunk.tenant, chunk.placement[t]);
  chunk.allocated.erase(tier);
  chunk.resident.erase(tier);
  chunk.dirty.erase(tier);
}

namespace {

// Tiers from fastest to slowest.
int Rank(TierKind tier) {
  switch (tier) {
    case TierKind::kDevice:
      return 2;
    case TierKind::kHost:
      return 1;
    case TierKind::kNvme:
      return 0;
  }
  return -1;
}

// A copy in `tier` is clean when a lower tier holds a valid copy too.
bool CleanIn(const ChunkMeta& c, TierKind tier) {
  if (!c.resident.contains(tier)) return false;
  for (TierKind lower : {TierKind::kHost, TierKind::kNvme}) {
    if (Rank(lower) < Rank(tier) && c.resident.contains(lower)) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<Placement> ChunkService::ReserveSpace(TierKind kind, uint32_t tenant, uint64_t size,
                                                     bool quota) {
  absl::StatusOr<Placement> p = tier(kind)->Reserve(tenant, size);
  if (!p.ok()) return p;
  if (absl::Status s = quota ? ledger_.CheckBytes(tenant, kind, p->size) : absl::OkStatus();
      !s.ok()) {
    tier(kind)->Unreserve(*p);
    return s;
  }
  ledger_.AddBytes(tenant, kind, p->size);
  return p;
}

void ChunkService::ReleaseSpace(uint32_t tenant, const Placement& placement) {
  tier(placement.tier)->Unreserve(placement);
  ledger_.RemoveBytes(tenant, placement.tier, placement.size);
}

absl::StatusOr<Placement> ChunkService::ReserveIn(TierKind tier, uint32_t tenant, uint64_t size) {
  for (;;) {
    // When the tenant's quota is what is full, only its own copies make room for it.
    const uint64_t needed = AlignUp(size, kSegmentAlignment);
    const bool quota_full = ledger_.Headroom(tenant, tier) < needed;
    if (quota_full && planning_) return ledger_.CheckBytes(tenant, tier, needed);
    absl::StatusOr<Placement> p =
        quota_full ? absl::ResourceExhaustedError("over quota") : ReserveSpace(tier, tenant, size);
    if (p.ok() || !absl::IsResourceExhausted(p.status()) || planning_) return p;
    // Full: drop the least recently used copy there that a lower tier also holds (a clean copy
    // costs nothing to drop). A linear scan; the planner replaces this policy.
    ChunkMeta* victim = nullptr;
    for (auto& [id, c] : chunks_) {
      if (c.state != ChunkState::kReady || c.pins > 0 || c.doomed || !CleanIn(c, tier)) continue;
      if (quota_full && c.tenant != tenant) continue;
      if (victim == nullptr || c.last_use < victim->last_use) victim = &c;
    }
    if (victim == nullptr) return quota_full ? ledger_.CheckBytes(tenant, tier, needed) : p;
    DropCopy(*victim, tier);
  }
}

uint64_t ChunkService::SpaceIn(TierKind t, uint64_t size, bool persistent) const {
  if (t != TierKind::kNvme || !persistent || nvme_ == nullptr) return size;
  return std::max(size, nvme_->persistent_granule());
}

uint64_t ChunkService::FreeFor(uint32_t tenant, TierKind t) const {
  const TierUsage u = tier(t)->Usage();
  const uint64_t free = u.capacity_bytes - std::min(u.capacity_bytes, u.used_bytes);
  return std::min(free, ledger_.Headroom(tenant, t));
}

void ChunkService::DropAbove(ChunkMeta& chunk, TierKind tier) {
  for (TierKind above : {TierKind::kDevice, TierKind::kHost}) {
    if (Rank(above) > Rank(tier) && chunk.allocated.contains(above)) DropCopy(chunk, above);
  }
}

absl::Status ChunkService::CheckFetchable(const ChunkMeta& chunk, TierKind tier) const {
  if (chunk.resident.empty()) {
    return absl::DataLossError(absl::StrCat("chunk ", chunk.id, " has no valid copy in any tier"));
  }
  if (chunk.writers > 0 && !chunk.resident.contains(tier)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "chunk ", chunk.id, " is acquired for write; release it before copying it to the ",
        TierName(tier), " tier"));
  }
  const bool from_device =
      !chunk.resident.contains(TierKind::kHost) && chunk.resident.contains(TierKind::kDevice);
  if (from_device && chunk.pins > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "chunk ", chunk.id, " is acquired on the device; release it before copying it out"));
  }
  if (!from_device && !chunk.resident.contains(TierKind::kHost) && nvme_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "chunk ", chunk.id, ": this daemon has no data path into the ", TierName(tier), " tier"));
  }
  return absl::OkStatus();
}

IoOrder ChunkService::OrderFor(const ChunkMeta& chunk, absl::Time deadline) const {
  auto it = sessions_.find(chunk.owner);
  return IoOrder{.deadline = deadline,
                 .flow = chunk.owner,
                 .weight = it == sessions_.end() ? 1 : it->second.weight};
}

absl::Status ChunkService::StartFetch(ChunkMeta& chunk, TierKind tier, absl::Time deadline) {
  // The moves report to a batch; this one only catches a start that fails (no space). Whoever
  // waits for the chunk is a Waiter, woken when the move settles.
  auto start = std::make_shared<Batch>();
  if (tier == TierKind::kDevice) {
    StartToDevice(chunk, start, deadline);
  } else if (chunk.resident.contains(TierKind::kDevice) &&
             !chunk.resident.contains(TierKind::kNvme)) {
    StartToHost(chunk, start, /*then_nvme=*/false, /*keep_source=*/true);
  } else {
    StartRead(chunk, start, deadline);
  }
  absl::Status started = start->Status();
  if (chunk.state != ChunkState::kMoving && started.ok()) {
    started = absl::InternalError(absl::StrCat("chunk ", chunk.id, ": no move into the ",
                                               TierName(tier), " tier could start"));
  }
  start->Done(absl::OkStatus());  // the issuer's reference
  return started;
}

absl::Status ChunkService::CheckAcquirable(const ChunkMeta& chunk, TierKind tier) const {
  if (chunk.resident.contains(tier)) return absl::OkStatus();  // the pin keeps this copy
  if (chunk.state == ChunkState::kMoving && chunk.moving_to == tier) return absl::OkStatus();
  // Not there (or on its way elsewhere: fetched once that move settles).
  return CheckFetchable(chunk, tier);
}

void ChunkService::BringIn(ChunkMeta& chunk, TierKind tier, const std::shared_ptr<Batch>& batch,
                           SessionId session, std::optional<Access> pin, absl::Time deadline) {
  if (chunk.state == ChunkState::kReady && chunk.resident.contains(tier)) {
    if (pin) Apply(chunk, tier, *pin, session, batch);
    return;
  }
  batch->Add();
  waiters_[chunk.id].push_back(Waiter{batch, session, tier, pin, absl::Now()});
  if (chunk.state == ChunkState::kMoving) return;  // woken when the move settles
  // An Acquire's space was reserved up front (its location is final); other requests may queue
  // for room.
  if (absl::Status s =
          pin ? StartFetch(chunk, tier, deadline) : FetchOrQueue(chunk, tier, deadline);
      !s.ok()) {
    // Nothing will settle: fail the waiter now (an Acquire's pin stays until Release).
    std::vector<Waiter>& w = waiters_[chunk.id];
    w.pop_back();
    if (w.empty()) waiters_.erase(chunk.id);
    batch->Done(s);
  }
}

void ChunkService::WakeWaiters(ChunkMeta& chunk, const absl::Status& moved) {
  if (chunk.state != ChunkState::kReady) return;  // a chained move is still on its way
  auto it = waiters_.find(chunk.id);
  if (it == waiters_.end()) return;
  std::vector<Waiter> waiting = std::move(it->second);
  waiters_.erase(it);
  const absl::Time now = absl::Now();
  for (Waiter& w : waiting) {
    if (w.evict_keep_source) {
      if (chunk.state == ChunkState::kMoving) {  // an earlier waiter started a move
        waiters_[chunk.id].push_back(std::move(w));
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
      waiters_[chunk.id].push_back(std::move(w));
    } else if (chunk.resident.contains(w.tier)) {
      if (w.pin) {
        Apply(chunk, w.tier, *w.pin, w.session, w.batch);
        if (auto state = sessions_.find(w.session); state != sessions_.end()) {
          state->second.stats.stall[static_cast<int>(w.tier)] += now - w.since;
        }
        totals_.stall[static_cast<int>(w.tier)] += now - w.since;
        acquire_wait_seconds_[static_cast<int>(w.tier)].Observe(
            absl::ToDoubleSeconds(now - w.since));
      }
      w.batch->Done(absl::OkStatus());
    } else if (!moved.ok()) {
      w.batch->Done(absl::Status(moved.code(),
                                 absl::StrCat("chunk ", chunk.id, " could not be brought into the ",
                                              TierName(w.tier), " tier: ", moved.message())));
    } else if (absl::Status s = CheckFetchable(chunk, w.tier); !s.ok()) {
      w.batch->Done(s);
    } else if (chunk.state == ChunkState::kMoving) {
      // An earlier waiter's fetch has just started: wait for it too.
      waiters_[chunk.id].push_back(std::move(w));
    } else {
      // The move that ended went elsewhere (or dropped the copy): fetch for this waiter now.
      if (absl::Status f = FetchOrQueue(chunk, w.tier, now); !f.ok()) {
        w.batch->Done(f);
      } else {
        waiters_[chunk.id].push_back(std::move(w));
      }
    }
  }
}

absl::Status ChunkService::FetchOrQueue(ChunkMeta& chunk, TierKind tier, absl::Time deadline) {
  absl::Status started = StartFetch(chunk, tier, deadline);
  if (started.ok() || !absl::IsResourceExhausted(started)) return started;
  if (!MakeRoomFor(chunk, tier)) return started;
  for (const QueuedFetch& q : queued_fetches_) {
    if (q.id == chunk.id && q.tier == tier) return absl::OkStatus();
  }
  queued_fetches_.push_back({chunk.id, tier, deadline});
  return absl::OkStatus();
}

namespace {

// The tiers a fetch of the chunk into `tier` needs space in: a fetch into the device stages
// through (or copies from) the chunk's host space. An overwrite fetches nothing: it needs room
// only where it lands.
std::vector<TierKind> RoomNeeded(const ChunkMeta& chunk, TierKind tier,
                                 Access access = Access::kRead) {
  std::vector<TierKind> needs;
  if (access == Access::kOverwrite && chunk.state == ChunkState::kReady) {
    if (!chunk.allocated.contains(tier)) needs.push_back(tier);
    return needs;
  }
  if (!chunk.allocated.contains(TierKind::kHost)) needs.push_back(TierKind::kHost);
  if (tier == TierKind::kDevice && !chunk.allocated.contains(TierKind::kDevice)) {
    needs.push_back(TierKind::kDevice);
  }
  return needs;
}

}  // namespace

absl::StatusOr<bool> ChunkService::ReserveForAcquire(std::span<ChunkMeta* const> chunks,
                                                     TierKind tier, Access access) {
  // Held meanwhile, so that room for one is never made by dropping another.
  for (ChunkMeta* c : chunks) Hold(*c);
  absl::StatusOr<bool> reserved = true;
  std::vector<std::pair<ChunkMeta*, TierKind>> made;  // given back if the Acquire fails
  for (ChunkMeta* c : chunks) {
    if (c->resident.contains(tier)) continue;
    if (c->state == ChunkState::kMoving && c->moving_to == tier) continue;  // its move has room
    for (TierKind t : RoomNeeded(*c, tier, access)) {
      absl::StatusOr<Placement> p = ReserveIn(t, c->tenant, SpaceIn(t, c->size, c->persistent));
      if (p.ok()) {
        c->placement[static_cast<int>(t)] = *p;
        c->allocated.insert(t);
        made.emplace_back(c, t);
      } else if (absl::IsResourceExhausted(p.status()) && MakeRoomFor(*c, tier, access)) {
        reserved = false;  // wait for the room being made
      } else {
        reserved = absl::Status(p.status().code(),
                                absl::StrCat("chunk ", c->id, ": ", p.status().message()));
      }
      if (!p.ok()) break;
    }
    if (!reserved.ok() || !*reserved) break;
  }
  if (!reserved.ok()) {
    for (auto [c, t] : made) DropCopy(*c, t);  // space only: nothing had arrived there
  }
  for (ChunkMeta* c : chunks) Unpin(*c);
  return reserved;
}

bool ChunkService::MakeRoomFor(const ChunkMeta& chunk, TierKind tier, Access access) {
  const std::vector<TierKind> needs = RoomNeeded(chunk, tier, access);
  bool coming = false;
  bool tried = false;
  for (TierKind t : needs) {
    if (FreeFor(chunk.tenant, t) >= chunk.size && room_coming_[static_cast<int>(t)] == 0) continue;
    tried = true;
    coming |= MakeRoomIn(t, chunk.size, chunk.tenant);
  }
  if (!tried) {  // enough bytes free but not in one piece: free some more
    for (TierKind t : needs) coming |= MakeRoomIn(t, chunk.size, chunk.tenant);
  }
  return coming;
}

uint64_t ChunkService::RoomComingFor(uint32_t tenant, TierKind t) const {
  uint64_t coming = 0;
  for (const auto& [id, freed] : room_moves_) {
    auto it = chunks_.find(id);
    if (freed == t && it != chunks_.end() && it->second.tenant == tenant) {
      coming += it->second.size;
    }
  }
  return coming;
}

bool ChunkService::MakeRoomIn(TierKind t, uint64_t bytes, uint32_t tenant) {
  const int k = static_cast<int>(t);
  // When the tenant's quota, not the tier, is what is full, only its own copies make its room.
  const bool own = ledger_.Headroom(tenant, t) < AlignUp(bytes, kSegmentAlignment);
  const uint64_t free = FreeFor(tenant, t);
  uint64_t coming = own ? RoomComingFor(tenant, t) : room_coming_[k];
  if (coming > 0 && free + coming >= bytes) return true;
  // Dirty copies go down a tier: the device's to the host, the host's to NVMe.
  const bool can_write_down =
      t == TierKind::kDevice ? device_ != nullptr : t == TierKind::kHost && nvme_ != nullptr;
  if (!can_write_down) return coming > 0 || (!own && moves_in_flight_ > 0);
  // Least recently used first. A linear scan, as in ReserveIn; it runs only when a tier is full
  // of dirty copies.
  std::vector<ChunkMeta*> dirty;
  for (auto& [id, c] : chunks_) {
    if (c.state != ChunkState::kReady || c.pins > 0 || c.doomed || !c.resident.contains(t) ||
        CleanIn(c, t) || (own && c.tenant != tenant)) {
      continue;
    }
    dirty.push_back(&c);
  }
  std::sort(dirty.begin(), dirty.end(),
            [](const ChunkMeta* a, const ChunkMeta* b) { return a->last_use < b->last_use; });
  bool started = false;  // at least one, in case the free bytes are there but not in one piece
  bool below = false;    // room is being made in the tier below for these to go to
  for (ChunkMeta* c : dirty) {
    if (started && free + coming >= bytes) break;
    auto batch = std::make_shared<Batch>();
    if (t == TierKind::kDevice) {
      StartToHost(*c, batch, /*then_nvme=*/false, /*keep_source=*/false);
    } else {
      StartWrite(*c, batch, /*keep_source=*/false);
    }
    batch->Done(absl::OkStatus());
    if (c->state != ChunkState::kMoving) {
      // No room below it either: the host's own dirty copies go down to NVMe first, and the
      // waiter tries again when they have.
      if (t == TierKind::kDevice && !below) below = MakeRoomIn(TierKind::kHost, c->size, c->tenant);
      continue;
    }
    room_moves_[c->id] = t;
    room_coming_[k] += c->size;
    coming += c->size;
    started = true;
  }
  // Moves in flight end as copies that can be dropped or written down, or free what they leave
  // (other tenants' moves free nothing under this one's quota).
  return coming > 0 || (!own && moves_in_flight_ > 0) || below;
}

void ChunkService::RoomMoveDone(ChunkId id) {
  auto it = room_moves_.find(id);
  if (it == room_moves_.end()) return;
  uint64_t& coming = room_coming_[static_cast<int>(it->second)];
  coming -= std::min(coming, chunks_.at(id).size);
  room_moves_.erase(it);
}

void ChunkService::RetryQueuedFetches() {
  while (!queued_fetches_.empty()) {
    const QueuedFetch q = queued_fetches_.front();
    auto it = chunks_.find(q.id);
    auto w = waiters_.find(q.id);
    const bool waited_for = w != waiters_.end() &&
                            std::any_of(w->second.begin(), w->second.end(), [&](const Waiter& x) {
                              return x.tier == q.tier && !x.evict_keep_source;
                            });
    // Gone, given up on, or on its way by another move (whose end wakes its waiters).
    if (it == chunks_.end() || !waited_for || it->second.state != ChunkState::kReady ||
        it->second.resident.contains(q.tier)) {
      queued_fetches_.pop_front();
      continue;
    }
    absl::Status s = StartFetch(it->second, q.tier, q.deadline);
    if (!s.ok() && absl::IsResourceExhausted(s) && MakeRoomFor(it->second, q.tier)) return;
    queued_fetches_.pop_front();
    if (!s.ok()) FailWaiters(q.id, q.tier, s);
  }
}

void ChunkService::FailWaiters(ChunkId id, TierKind tier, const absl::Status& status) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  std::vector<Waiter> failed;
  std::erase_if(it->second, [&](Waiter& w) {
    if (w.tier != tier || w.evict_keep_source) return false;
    failed.push_back(std::move(w));
    return true;
  });
  if (it->second.empty()) waiters_.erase(it);
  for (Waiter& w : failed) w.batch->Done(status);
}

ChunkMeta& ChunkService::Moving(ChunkId id) {
  // A moving chunk cannot be freed (Free refuses, a session end defers it), so it is there.
  auto it = chunks_.find(id);
  assert(it != chunks_.end() && it->second.state == ChunkState::kMoving);
  return it->second;
}

bool ChunkService::EnsureSpace(ChunkMeta& chunk, TierKind tier,
                               const std::shared_ptr<Batch>& batch) {
  if (chunk.allocated.contains(tier)) return true;
  absl::StatusOr<Placement> p =
      ReserveIn(tier, chunk.tenant, SpaceIn(tier, chunk.size, chunk.persistent));
  if (!p.ok()) {
    batch->Add();
    batch->Done(absl::Status(p.status().code(),
                             absl::StrCat("chunk ", chunk.id, ": ", p.status().message())));
    return false;
  }
  chunk.placement[static_cast<int>(tier)] = *p;
  chunk.allocated.insert(tier);
  return true;
}

void ChunkService::Settled(ChunkMeta& chunk, bool ok) {
  FinishMove(chunk, ok);
  --moves_in_flight_;
  room_freed_.SignalAll();
}

bool ChunkService::BeginBatchMove(ChunkMeta& chunk, TierKind to,
                                  const std::shared_ptr<Batch>& batch) {
  batch->Add();
  if (chunk.doomed) {
    // Retired: the chunk goes once its last move settles, and nothing new starts for it.
    batch->Done(Retired(chunk));
    return false;
  }
  if (chunk.writers > 0) {
    // The client may be writing the only valid copy (the planner's and queued fetches land here
    // without a request's validation).
    batch->Done(absl::FailedPreconditionError(
        absl::StrCat("chunk ", chunk.id, " is acquired for write; release it before moving it")));
    return false;
  }
  absl::Status begin = BeginMove(chunk, to);
  assert(begin.ok());  // callers validated the batch: no chunk is moving
  (void)begin;
  ++moves_in_flight_;
  return true;
}

absl::Status ChunkService::Retired(const ChunkMeta& chunk) {
  return absl::AbortedError(absl::StrCat(
      "chunk ", chunk.id, " was freed while it moved (its session ended); it is gone"));
}

void ChunkService::Retire(ChunkMeta& chunk) {
  if (chunk.state == ChunkState::kMoving) {
    chunk.doomed = true;  // AfterMove destroys it
    return;
  }
  FailAllWaiters(chunk.id, Retired(chunk));
  Destroy(chunk);
}

void ChunkService::AfterMove(ChunkMeta& chunk, const absl::Status& moved) {
  if (chunk.doomed) {
    // Whoever waited for it learns it is gone; nothing is fetched or evicted for it again.
    FailAllWaiters(chunk.id, Retired(chunk));
    if (chunk.state != ChunkState::kMoving) Destroy(chunk);
  } else {
    WakeWaiters(chunk, moved);
  }
  RetryQueuedFetches();
}

void ChunkService::Apply(ChunkMeta& chunk, TierKind tier, Access access, SessionId session,
                         const std::shared_ptr<Batch>& batch) {
  ApplyAccess(chunk, tier, access);
  if (!Writes(access)) return;
  if (NeedsMark(chunk)) Mark(chunk, batch);
  auto state = sessions_.find(session);
  if (state == sessions_.end()) return;
  auto pins = state->second.pins.find(chunk.id);
  // A write whose acquisition was released before its data arrived has nothing left to guard.
  if (pins == state->second.pins.end() || pins->second.writes >= pins->second.count) return;
  ++pins->second.writes;
  ++chunk.writers;
}

void ChunkService::Mark(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch) {
  constexpr int kNvme = static_cast<int>(TierKind::kNvme);
  IndexEntry e{chunk.tenant,         chunk.name,        chunk.size, 0, 0, chunk.checksum,
               /*memory_home=*/true, /*in_memory=*/true};
  if (chunk.written && chunk.allocated.contains(TierKind::kNvme)) {
    e.offset = chunk.placement[kNvme].offset;  // the older version stays where it is
    e.reserved = chunk.placement[kNvme].size;
  }
  batch->Add();
  nvme_->Persist(std::move(e), Tracked([this, id = chunk.id, batch](absl::Status s) {
                   {
                     absl::MutexLock lock(&mu_);
                     if (auto it = chunks_.find(id); s.ok() && it != chunks_.end())
                       it->second.marked = true;
                   }
                   if (!s.ok()) {
                     s = absl::Status(
                         s.code(),
                         absl::StrCat("chunk ", id,
                                      ": could not record in the NVMe index that its current "
                                      "version is in memory (a crash must report it lost, not "
                                      "return an older one): ",
                                      s.message()));
                   }
                   batch->Done(s);
                 }));
}

size_t ChunkService::WriteDownForStop() {
  constexpr size_t kNamed = 16;  // chunks named in the log; the rest are counted
  auto batch = std::make_shared<Batch>();
  absl::Notification written;
  batch->on_done = [&written](const absl::Status&) { written.Notify(); };
  std::vector<ChunkId> ids;
  uint64_t bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [tenant, set] : persistent_) {
      for (ChunkId id : set) {
        ChunkMeta& chunk = chunks_.at(id);
        const bool in_memory =
            chunk.state == ChunkState::kMoving ||
            (!chunk.resident.empty() && !chunk.resident.contains(TierKind::kNvme));
        if (chunk.lost || !in_memory) continue;
        ids.push_back(id);
        bytes += chunk.size;
        if (nvme_ == nullptr) continue;
        if (absl::Status s = CheckEvictable(chunk, TierKind::kNvme); !s.ok()) {
          batch->Add();
          batch->Done(s);
          continue;
        }
        EvictOne(chunk, TierKind::kNvme, /*keep_source=*/false, batch, /*session=*/0);
      }
    }
  }
  if (ids.empty()) {
    batch->Done(absl::OkStatus());
    return 0;
  }
  if (nvme_ == nullptr) {
    spdlog::warn(
        "{} persistent chunks ({}) lived in host memory only (no NVMe tier): lost with "
        "this stop",
        ids.size(), FormatSize(bytes));
    batch->Done(absl::OkStatus());
    return ids.size();
  }
  spdlog::info(
      "stopping: writing {} persistent chunks ({}) whose current version is in memory "
      "to NVMe",
      ids.size(), FormatSize(bytes));
  const absl::Time start = absl::Now();
  batch->Done(absl::OkStatus());
  written.WaitForNotification();
  absl::MutexLock lock(&mu_);
  size_t failed = 0;
  for (ChunkId id : ids) {
    auto it = chunks_.find(id);
    if (it == chunks_.end() || it->second.resident.contains(TierKind::kNvme)) continue;
    if (++failed <= kNamed) {
      spdlog::error("persistent chunk '{}' of uid {} could not be written to NVMe: {}",
                    it->second.name, it->second.tenant,
                    it->second.marked ? "the next start reports it lost"
                                      : "the next start finds its last copy there, if any");
    }
  }
  if (failed > 0) {
    spdlog::error("{} of {} persistent chunks could not be written to NVMe ({} named above): {}",
                  failed, ids.size(), std::min(failed, kNamed), batch->Status().message());
  } else {
    spdlog::info("stopping: {} persistent chunks written to NVMe in {:.2f} s", ids.size(),
                 absl::ToDoubleSeconds(absl::Now() - start));
  }
  return failed;
}

void ChunkService::FailAllWaiters(ChunkId id, const absl::Status& status) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  std::vector<Waiter> failed = std::move(it->second);
  waiters_.erase(it);
  for (Waiter& w : failed) w.batch->Done(status);
}

void ChunkService::StartToDevice(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                                 absl::Time deadline) {
  constexpr int kHost = static_cast<int>(TierKind::kHost);
  constexpr int kNvme = static_cast<int>(TierKind::kNvme);
  constexpr int kDev = static_cast<int>(TierKind::kDevice);
  const bool from_host = chunk.resident.contains(TierKind::kHost);
  // Without a host copy, the chunk's host space stages it on the way from NVMe.
  if (!EnsureSpace(chunk, TierKind::kHost, batch) ||
      !EnsureSpace(chunk, TierKind::kDevice, batch)) {
    return;
  }
  if (!BeginBatchMove(chunk, TierKind::kDevice, batch)) return;
  MoveStarted(Path::kHostToDevice, chunk);
  if (!from_host && chunk.written) MoveStarted(Path::kNvmeToHost, chunk);
  const ChunkId id = chunk.id;
  char* host = static_cast<char*>(tier(TierKind::kHost)->Address(chunk.placement[kHost]));
  char* dev = static_cast<char*>(tier(TierKind::kDevice)->Address(chunk.placement[kDev]));
  if (from_host) {
    device_->CopyToDevice(dev, host, chunk.size, Tracked([this, id, batch](absl::Status s) {
                            SettleToDevice(id, s, /*host_filled=*/false);
                            batch->Done(s);
                          }));
    return;
  }
  if (!chunk.written) {  // never written: zeros on both
    nvme_->ZeroFill(chunk.placement[kHost], chunk.size,
                    Tracked([this, id, batch, dev, host, size = chunk.size](absl::Status s) {
                      if (!s.ok()) {
                        SettleToDevice(id, s, /*host_filled=*/true);
                        batch->Done(s);
                        return;
                      }
                      device_->CopyToDevice(dev, host, size,
                                            Tracked([this, id, batch](absl::Status s2) {
                                              SettleToDevice(id, s2, /*host_filled=*/true);
                                              batch->Done(s2);
                                            }));
                    }));
    return;
  }
  // NVMe -> host -> GPU, pipelined: each piece goes to the GPU as soon as it has been read.
  struct Pipeline {
    absl::Mutex mu;
    size_t copies_pending = 0;
    bool reads_done = false;
    bool settled = false;  // the last copy and the end of the reads can race to settle
    absl::Status status;
  };
  auto pipe = std::make_shared<Pipeline>();
  auto finish_if_done = [this, id, batch, pipe]() {
    absl::Status status;
    {
      absl::MutexLock lock(&pipe->mu);
      if (!pipe->reads_done || pipe->copies_pending > 0 || pipe->settled) return;
      pipe->settled = true;
      status = pipe->status;
    }
    SettleToDevice(id, status, /*host_filled=*/true);
    batch->Done(status);
  };
  constexpr uint64_t kPiece = 4 << 20;
  nvme_->ReadPieces(
      id, chunk.placement[kHost], chunk.placement[kNvme], chunk.size, chunk.checksum, kPiece,
      Tracked([this, pipe, dev, host, finish_if_done, size = chunk.size](uint64_t off,
                                                                         uint64_t len) {
        len = std::min(len, size - std::min(size, off));  // the last piece ends at the chunk's end
        if (len == 0) return;
        {
          absl::MutexLock lock(&pipe->mu);
          ++pipe->copies_pending;
        }
        device_->CopyToDevice(dev + off, host + off, len,
                              Tracked([pipe, finish_if_done](absl::Status s) {
                                {
                                  absl::MutexLock lock(&pipe->mu);
                                  --pipe->copies_pending;
                                  if (pipe->status.ok() && !s.ok()) pipe->status = s;
                                }
                                finish_if_done();
                              }));
      }),
      Tracked([pipe, finish_if_done](absl::Status s) {
        {
          absl::MutexLock lock(&pipe->mu);
          pipe->reads_done = true;
          if (pipe->status.ok() && !s.ok()) pipe->status = s;
        }
        finish_if_done();
      }),
      OrderFor(chunk, deadline));
}

void ChunkService::SettleToDevice(ChunkId id, const absl::Status& status, bool host_filled) {
  absl::MutexLock lock(&mu_);
  ChunkMeta& chunk = Moving(id);
  Settled(chunk, status.ok());
  MoveDone(Path::kHostToDevice, chunk);
  if (host_filled && chunk.written) MoveDone(Path::kNvmeToHost, chunk);
  if (status.ok()) {
    if (host_filled) chunk.resident.insert(TierKind::kHost);
  } else {
    DropCopy(chunk, TierKind::kDevice);
    if (host_filled) DropCopy(chunk, TierKind::kHost);
    if (absl::IsDataLoss(status)) chunk.resident.erase(TierKind::kNvme);
  }
  chunk.last_use = ++use_clock_;
  AfterMove(chunk, status);
}

void ChunkService::StartToHost(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                               bool then_nvme, bool keep_source) {
  constexpr int kHost = static_cast<int>(TierKind::kHost);
  constexpr int kDev = static_cast<int>(TierKind::kDevice);
  if (!EnsureSpace(chunk, TierKind::kHost, batch)) return;
  if (!BeginBatchMove(chunk, TierKind::kHost, batch)) return;
  MoveStarted(Path::kDeviceToHost, chunk);
  const ChunkId id = chunk.id;
  device_->CopyToHost(tier(TierKind::kHost)->Address(chunk.placement[kHost]),
                      tier(TierKind::kDevice)->Address(chunk.placement[kDev]), chunk.size,
                      Tracked([this, id, batch, then_nvme, keep_source](absl::Status s) {
                        SettleToHost(id, s, then_nvme, keep_source, batch);
                        batch->Done(s);
                      }));
}

void ChunkService::SettleToHost(ChunkId id, const absl::Status& status, bool then_nvme,
                                bool keep_source, const std::shared_ptr<Batch>& batch) {
  absl::MutexLock lock(&mu_);
  ChunkMeta& chunk = Moving(id);
  Settled(chunk, status.ok());
  MoveDone(Path::kDeviceToHost, chunk);
  if (!status.ok()) {
    DropCopy(chunk, TierKind::kHost);
  } else if (chunk.doomed) {
    // Destroyed below.
  } else if (then_nvme) {
    StartWrite(chunk, batch, keep_source);  // drops host and device copies once durable
  } else if (!keep_source && chunk.pins == 0) {
    DropCopy(chunk, TierKind::kDevice);
  }
  RoomMoveDone(id);
  AfterMove(chunk, status);
}

void ChunkService::StartRead(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                             absl::Time deadline) {
  constexpr int kHost = static_cast<int>(TierKind::kHost);
  constexpr int kNvme = static_cast<int>(TierKind::kNvme);
  if (!EnsureSpace(chunk, TierKind::kHost, batch)) return;
  if (!BeginBatchMove(chunk, TierKind::kHost, batch)) return;
  if (chunk.written) MoveStarted(Path::kNvmeToHost, chunk);
  const ChunkId id = chunk.id;
  auto done = Tracked([this, id, batch](absl::Status s) {
    SettleRead(id, s);
    batch->Done(s);
  });
  if (!chunk.written) {
    nvme_->ZeroFill(chunk.placement[kHost], chunk.size, std::move(done));
  } else {
    nvme_->Read(id, chunk.placement[kHost], chunk.placement[kNvme], chunk.size, chunk.checksum,
                std::move(done), OrderFor(chunk, deadline));
  }
}

void ChunkService::SettleRead(ChunkId id, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  ChunkMeta& chunk = Moving(id);
  Settled(chunk, status.ok());
  if (chunk.written) MoveDone(Path::kNvmeToHost, chunk);
  if (!status.ok()) {
    DropCopy(chunk, TierKind::kHost);
    if (absl::IsDataLoss(status)) chunk.resident.erase(TierKind::kNvme);  // never trusted again
  }
  chunk.last_use = ++use_clock_;
  AfterMove(chunk, status);
}

void ChunkService::StartWrite(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                              bool keep_source) {
  constexpr int kHost = static_cast<int>(TierKind::kHost);
  constexpr int kNvme = static_cast<int>(TierKind::kNvme);
  if (chunk.resident.contains(TierKind::kNvme)) {  // already current there
    if (!keep_source) DropAbove(chunk, TierKind::kNvme);
    return;
  }
  // A persistent chunk's durable version stays whole where the index says it is until the new
  // one is durable: the rewrite goes to fresh space, and the index switch is its commit point.
  std::optional<Placement> previous;
  if (chunk.persistent && chunk.written && chunk.allocated.contains(TierKind::kNvme)) {
    // Briefly two copies: the second is not held against the user's quota.
    absl::StatusOr<Placement> fresh = ReserveSpace(
        TierKind::kNvme, chunk.tenant, SpaceIn(TierKind::kNvme, chunk.size, true), false);
    if (!fresh.ok()) {
      batch->Add();
      batch->Done(
          absl::Status(fresh.status().code(),
                       absl::StrCat("chunk ", chunk.id,
                                    ": its new version is written beside the durable one "
                                    "until it is durable itself, and there is no room for it: ",
                                    fresh.status().message())));
      return;
    }
    previous = chunk.placement[kNvme];
    chunk.placement[kNvme] = *fresh;
  }
  if (!EnsureSpace(chunk, TierKind::kNvme, batch)) return;
  if (!BeginBatchMove(chunk, TierKind::kNvme, batch)) {
    if (previous) {
      ReleaseSpace(chunk.tenant, chunk.placement[kNvme]);
      chunk.placement[kNvme] = *previous;
    }
    return;
  }
  MoveStarted(Path::kHostToNvme, chunk);
  const ChunkId id = chunk.id;
  const Placement nvme = chunk.placement[kNvme];
  std::optional<IndexEntry> entry;
  if (chunk.persistent) {
    entry = IndexEntry{chunk.tenant, chunk.name, chunk.size,        nvme.offset,
                       nvme.size,    0,          chunk.memory_home, /*in_memory=*/false};
  }
  nvme_->Write(
      id, chunk.placement[kHost], nvme, chunk.size,
      Tracked([this, id, batch, keep_source, entry, previous](absl::StatusOr<uint64_t> checksum) {
        if (!checksum.ok() || !entry) {
          SettleWrite(id, checksum, keep_source, previous);
          batch->Done(checksum.status());
          return;
        }
        // A persistent chunk is durable once the index says where it is.
        IndexEntry e = *entry;
        e.checksum = *checksum;
        nvme_->Persist(e,
                       Tracked([this, id, batch, keep_source, checksum, previous](absl::Status s) {
                         if (s.ok()) {
                           SettleWrite(id, checksum, keep_source, previous);
                         } else {
                           SettleWrite(id, s, keep_source, previous);
                         }
                         batch->Done(s);
                       }));
      }),
      OrderFor(chunk, absl::Now()), /*durable=*/chunk.persistent);
}

void ChunkService::SettleWrite(ChunkId id, const absl::StatusOr<uint64_t>& checksum,
                               bool keep_source, const std::optional<Placement>& previous) {
  constexpr int kNvme = static_cast<int>(TierKind::kNvme);
  absl::MutexLock lock(&mu_);
  ChunkMeta& chunk = Moving(id);
  Settled(chunk, checksum.ok());
  MoveDone(Path::kHostToNvme, chunk);
  if (previous) {
    // Committed: the previous version's space is free. Not: the new one's, and the previous
    // version stays what the index (and the chunk) name.
    if (checksum.ok()) {
      ReleaseSpace(chunk.tenant, *previous);
    } else {
      ReleaseSpace(chunk.tenant, chunk.placement[kNvme]);
      chunk.placement[kNvme] = *previous;
    }
  }
  if (checksum.ok()) {
    chunk.written = true;
    chunk.checksum = *checksum;
    chunk.marked = false;  // the index now names this version
    chunk.dirty = TierSet();
    if (!keep_source && chunk.pins == 0) DropAbove(chunk, TierKind::kNvme);
  }
  RoomMoveDone(id);
  AfterMove(chunk, checksum.status());
}

std::string ChunkService::NameKey(uint32_t tenant, absl::string_view name) {
  return absl::StrCat(tenant, "/", name);
}

absl::Status ChunkService::CheckTier(TierKind tier, absl::string_view what) const {
  if (tiers_[static_cast<int>(tier)] == nullptr) {
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
    auto existing = names_.find(NameKey(tenant, r.name));
    if (existing == names_.end()) {
      if (r.must_exist) {
        return fail(
            absl::NotFoundError(absl::StrCat("uid ", tenant, " has no persistent chunk named '",
                                             r.name, "' to open (create it without must_exist)")));
      }
      continue;
    }
    const ChunkMeta& found = chunks_.at(existing->second);
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
    if (absl::Status s = CheckLease(found, session.id, r.shared, "open"); !s.ok()) return fail(s);
    result[i] = found.id;
  }

  SessionState& state = StateOf(session);
  const uint64_t fresh = std::count(result.begin(), result.end(), ChunkId{0});
  if (absl::Status s = ledger_.CheckChunks(tenant, state.owned.size(), fresh); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("Allocate: ", s.message()));
  }

  // Reserve space for the new chunks; give it all back if any reservation fails.
  std::vector<Placement> placements(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    if (result[i] != 0) continue;
    absl::StatusOr<Placement> p =
        ReserveSpace(requests[i].home, tenant,
                     SpaceIn(requests[i].home, requests[i].size, requests[i].persistent));
    if (!p.ok()) {
      for (size_t j = 0; j < i; ++j) {
        if (result[j] == 0) ReleaseSpace(tenant, placements[j]);
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
      Lease& lease = leases_[result[i]];
      if (std::find(lease.holders.begin(), lease.holders.end(), session.id) ==
          lease.holders.end()) {
        lease.holders.push_back(session.id);
      }
      if (lease.holders.size() == 1) lease.shared = r.shared;
      chunks_.at(result[i]).owner = lease.holders.front();
      continue;
    }
    ChunkMeta& chunk = Insert(tenant, session.id, r.size, placements[i], r.name, r.persistent);
    chunk.tags = r.tags;
    if (r.persistent && nvme_ == nullptr) ++volatile_persistent;
    if (r.persistent) leases_[chunk.id] = Lease{{session.id}, r.shared};
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

void ChunkService::Destroy(ChunkMeta& chunk) {
  assert(chunk.state != ChunkState::kMoving);  // Retire defers it to the move's end
  for (int t = 1; t < kTierKinds; ++t) {
    if (chunk.allocated.contains(static_cast<TierKind>(t))) {
      ReleaseSpace(chunk.tenant, chunk.placement[t]);
    }
  }
  ledger_.AddChunks(chunk.tenant, -1);
  // A chunk at home in memory may have a record without a copy (or one being written): forgetting
  // a name the index does not hold costs nothing.
  if (chunk.persistent && nvme_ != nullptr && (chunk.written || chunk.memory_home))
    nvme_->Forget(chunk.tenant, chunk.name);
  if (!chunk.name.empty()) names_.erase(NameKey(chunk.tenant, chunk.name));
  if (chunk.persistent) {
    auto it = persistent_.find(chunk.tenant);
    it->second.erase(chunk.id);
    if (it->second.empty()) persistent_.erase(it);
  } else if (auto it = sessions_.find(chunk.owner); it != sessions_.end()) {
    it->second.owned.erase(chunk.id);
  }
  move_started_.erase(chunk.id);
  leases_.erase(chunk.id);
  chunks_.erase(chunk.id);
}

absl::Status ChunkService::CheckLease(const ChunkMeta& chunk, SessionId session, bool shared,
                                      std::string_view verb) const {
  auto lease = leases_.find(chunk.id);
  if (lease == leases_.end()) return absl::OkStatus();
  for (SessionId holder : lease->second.holders) {
    if (holder == session) continue;
    if (verb == "open" && shared && lease->second.shared) return absl::OkStatus();
    auto it = sessions_.find(holder);
    const std::string who = it != sessions_.end() && !it->second.description.empty()
                                ? it->second.description
                                : absl::StrCat("session ", holder);
    return absl::FailedPreconditionError(absl::StrCat(
        "persistent chunk '", chunk.name, "' (chunk ", chunk.id, ") is held by ", who,
        ": it cannot be ", verb == "open" ? "opened" : "freed", " until that session ends",
        verb == "open" ? " (or both open it with shared)" : ""));
  }
  return absl::OkStatus();
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
    if (absl::Status s = CheckLease(*chunk, session.id, false, "free"); !s.ok()) return s;
  }
  for (ChunkMeta* chunk : *chunks) Destroy(*chunk);
  RetryQueuedFetches();
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
  const absl::Time arrived = absl::Now();
  const absl::Time give_up = arrived + absl::Minutes(1);
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
    absl::StatusOr<bool> reserved = ReserveForAcquire(*chunks, tier, access);
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
  SessionState& state = StateOf(session);
  if (waited_for_room) {
    const absl::Duration stalled = absl::Now() - arrived;
    state.stats.stall[static_cast<int>(tier)] += stalled;
    totals_.stall[static_cast<int>(tier)] += stalled;
  }
  for (ChunkMeta* chunk : *chunks) {
    Hold(*chunk);
    chunk->last_use = ++use_clock_;
    state.pins[chunk->id].count += 1;
    const bool ready = CheckPin(*chunk, tier).ok();
    ++(ready ? state.stats.ready : state.stats.waited);
    ++(ready ? totals_.ready : totals_.waited);
    BringIn(*chunk, tier, batch, session.id, access, absl::Now());
    // Final even for a chunk still on its way: its space in `tier` was reserved above or by the
    // move it joined.
    result.locations.push_back(chunk->placement[static_cast<int>(tier)]);
  }
  batch->Done(absl::OkStatus());  // the issuer's reference
  if (state.trace.steps > 0) Trace(state, session, *chunks, tier, access);
  return result;
}

absl::Status ChunkService::Release(const Session& session, std::span<const ChunkId> ids) {
  if (absl::Status s = CheckBatch(ids.size(), "Release"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids);
  if (!chunks.ok()) return chunks.status();
  SessionState& state = StateOf(session);
  for (const ChunkMeta* chunk : *chunks) {
    if (!state.pins.contains(chunk->id)) {
      return absl::FailedPreconditionError(
          absl::StrCat("chunk ", chunk->id, " is not acquired by ", session.Describe()));
    }
  }
  for (ChunkMeta* chunk : *chunks) {
    Unpin(*chunk);
    auto it = state.pins.find(chunk->id);
    SessionState::Pins& pins = it->second;
    // Reads are released first: a write in effect keeps the chunk from being copied longest.
    if (--pins.count < pins.writes) {
      --pins.writes;
      --chunk->writers;
    }
    if (pins.count == 0) state.pins.erase(it);
  }
  // Released copies may be what waiting fetches need dropped.
  RetryQueuedFetches();
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
  const absl::Time due = PrefetchDeadline(absl::Now(), priority);
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
  const bool device_only_above =
      chunk.resident.contains(TierKind::kDevice) && !chunk.resident.contains(TierKind::kHost);
  if (tier == TierKind::kHost) {
    if (!chunk.resident.contains(TierKind::kDevice)) return;
    if (device_only_above) {
      StartToHost(chunk, batch, /*then_nvme=*/false, keep_source);
    } else if (!keep_source) {
      DropCopy(chunk, TierKind::kDevice);  // the host copy is current
    }
    return;
  }
  if (device_only_above && !chunk.resident.contains(TierKind::kNvme)) {
    StartToHost(chunk, batch, /*then_nvme=*/true, keep_source);
  } else {
    StartWrite(chunk, batch, keep_source);
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

bool IsOperator(const Session& session) {
  return session.peer.uid == 0 || session.peer.uid == geteuid();
}

namespace {

absl::Status CheckOperator(const Session& session, absl::string_view what) {
  if (IsOperator(session)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      what, " acts on every session's chunks: only root or the daemon's own user (uid ", geteuid(),
      ") may; ", session.Describe(), " is neither"));
}

}  // namespace

absl::StatusOr<DrainResult> ChunkService::Drain(const Session& session, TierKind tier,
                                                std::span<const ChunkId> ids) {
  if (absl::Status s = CheckOperator(session, "Drain"); !s.ok()) return s;
  if (absl::Status s = CheckTier(tier, "Drain"); !s.ok()) return s;
  if (tier == TierKind::kNvme) {
    return absl::InvalidArgumentError(
        "Drain: the NVMe tier is the bottom tier; its chunks leave it only when freed");
  }
  const TierKind below = tier == TierKind::kDevice ? TierKind::kHost : TierKind::kNvme;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  if (below == TierKind::kNvme && nvme_ == nullptr) {
    return absl::FailedPreconditionError(
        "Drain: this daemon has no NVMe tier to move the host tier's chunks into");
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
  if (page_size == 0) page_size = kDefaultPageSize;
  page_size = std::min(page_size, kMaxPageSize);
  absl::MutexLock lock(&mu_);
  std::vector<ChunkId> ids;
  for (const auto& [id, chunk] : chunks_) {
    if (id >= page_token) ids.push_back(id);
  }
  ChunkPage page;
  const size_t n = std::min<size_t>(ids.size(), page_size);
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end());
  for (size_t i = 0; i < n; ++i) page.chunks.push_back(chunks_.at(ids[i]));
  if (ids.size() > n) page.next_page_token = *std::min_element(ids.begin() + n, ids.end());
  return page;
}

std::map<SessionId, SessionHoldings> ChunkService::Holdings() const {
  absl::MutexLock lock(&mu_);
  std::map<SessionId, SessionHoldings> out;
  for (const auto& [id, state] : sessions_) {
    SessionHoldings& h = out[id];
    h.chunks = state.owned.size();
    for (ChunkId c : state.owned) h.bytes += chunks_.at(c).size;
    h.pinned = state.pins.size();
    for (uint64_t b : state.moved) h.moved_bytes += b;
  }
  // Persistent chunks are the tenant's, but held by the live sessions with a lease on them.
  for (const auto& [id, lease] : leases_) {
    for (SessionId holder : lease.holders) {
      auto it = out.find(holder);
      if (it == out.end()) continue;
      ++it->second.chunks;
      it->second.bytes += chunks_.at(id).size;
    }
  }
  return out;
}

std::map<std::string, std::array<uint64_t, kPaths>> ChunkService::JobTraffic() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, std::array<uint64_t, kPaths>> out;
  for (const auto& [job, j] : jobs_) out[job] = j.moved;
  return out;
}

void ChunkService::EvictOne(ChunkMeta& chunk, TierKind tier, bool keep_source,
                            const std::shared_ptr<Batch>& batch, SessionId session) {
  if (chunk.state == ChunkState::kMoving) {
    // On its way somewhere (a planner write-back, a fetch): evicted once the move settles.
    batch->Add();
    waiters_[chunk.id].push_back(
        Waiter{batch, session, tier, std::nullopt, absl::Now(), keep_source});
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
  if (auto it = sessions_.find(session.id); it != sessions_.end()) owned = &it->second.owned;
  const std::set<ChunkId>* persistent = &kNone;
  if (auto it = persistent_.find(session.peer.uid); it != persistent_.end()) {
    persistent = &it->second;
  }
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

size_t ChunkService::CloseSession(const Session& session) {
  absl::MutexLock lock(&mu_);
  session.ended = true;
  auto it = sessions_.find(session.id);
  if (it == sessions_.end()) return 0;
  SessionState state = std::move(it->second);
  sessions_.erase(it);
  if (auto job = jobs_.find(state.job); job != jobs_.end() && --job->second.sessions == 0) {
    jobs_.erase(job);
  }
  if (state.planned()) --schedules_;
  ledger_.AddScheduleAccesses(session.peer.uid, -static_cast<int64_t>(state.schedule_accesses));
  for (const auto& [id, pins] : state.pins) {
    if (auto w = waiters_.find(id); w != waiters_.end()) {
      std::erase_if(w->second, [&](const Waiter& x) { return x.session == session.id; });
      if (w->second.empty()) waiters_.erase(w);
    }
    ChunkMeta& chunk = chunks_.at(id);
    for (uint32_t i = 0; i < pins.count; ++i) Unpin(chunk);
    chunk.writers -= pins.writes;
  }
  size_t freed = 0;
  for (ChunkId id : state.owned) {
    ChunkMeta& chunk = chunks_.at(id);
    assert(chunk.pins == 0);  // only its owner can pin a scratch chunk
    ++freed;
    Retire(chunk);
  }
  if (auto p = persistent_.find(session.peer.uid); p != persistent_.end()) {
    for (ChunkId id : p->second) {
      ChunkMeta& chunk = chunks_.at(id);
      auto lease = leases_.find(id);
      if (lease == leases_.end()) continue;
      std::erase(lease->second.holders, session.id);
      if (lease->second.holders.empty()) {
        leases_.erase(lease);
        chunk.owner = 0;
      } else {
        chunk.owner = lease->second.holders.front();
      }
    }
  }
  RetryQueuedFetches();
  room_freed_.SignalAll();
  return freed;
}

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
  state.step_started = absl::Now();
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

bool ChunkService::has_schedules() const {
  absl::MutexLock lock(&mu_);
  return schedules_ > 0;
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
    for (int p = 0; p < kPaths; ++p) {
      in.bytes_per_second[p] = paths_[p].bytes_per_second;
      in.queued_bytes[p] = paths_[p].queued_bytes;
      in.move_seconds_per_byte[p] =
          paths_[p].move_seconds_per_byte + 4 * paths_[p].move_deviation_per_byte;
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
  planning_ = true;
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
        DropCopy(c, m.tier);
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
        DropCopy(c, m.tier);
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
          if (device_ == nullptr || !c.resident.contains(TierKind::kDevice)) break;
          StartToHost(c, batch, /*then_nvme=*/false, /*keep_source=*/true);
        } else {
          if (nvme_ == nullptr || !c.resident.contains(TierKind::kHost)) break;
          StartWrite(c, batch, /*keep_source=*/true);
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
  planning_ = false;
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

std::vector<std::vector<ScheduledAccess>> ChunkService::schedule(const Session& session) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session.id);
  if (it == sessions_.end() || it->second.steps == nullptr) return {};
  return *it->second.steps;
}

std::array<PathStatus, kPaths> ChunkService::path_status() const {
  absl::MutexLock lock(&mu_);
  std::array<PathStatus, kPaths> out;
  for (int p = 0; p < kPaths; ++p) {
    out[p] = PathStatus{.path = static_cast<Path>(p),
                        .bytes = paths_[p].bytes_total,
                        .moves = paths_[p].moves_total,
                        .bytes_per_second = paths_[p].bytes_per_second,
                        .measured = paths_[p].measured,
                        .probed_bytes_per_second = paths_[p].probed};
  }
  return out;
}

void ChunkService::SeedBandwidth(const std::array<double, kPaths>& bytes_per_second) {
  absl::MutexLock lock(&mu_);
  for (int p = 0; p < kPaths; ++p) {
    if (bytes_per_second[p] <= 0) continue;
    paths_[p].probed = bytes_per_second[p];
    paths_[p].bytes_per_second = bytes_per_second[p];
    paths_[p].measured = true;
  }
}

size_t ChunkService::chunk_count() const {
  absl::MutexLock lock(&mu_);
  return chunks_.size();
}

NodeStats ChunkService::node_stats() const {
  absl::MutexLock lock(&mu_);
  NodeStats out;
  out.totals = totals_;
  for (const auto& [id, c] : chunks_) {
    ++(c.state == ChunkState::kMoving ? out.chunks_moving : out.chunks_ready);
    if (c.pins > 0) ++out.chunks_pinned;
    if (c.persistent) ++out.chunks_persistent;
    for (TierKind t : {TierKind::kDevice, TierKind::kHost, TierKind::kNvme}) {
      if (c.pins > 0 && c.allocated.contains(t)) out.pinned_bytes[static_cast<int>(t)] += c.size;
      if (!c.resident.contains(t)) continue;
      ++out.resident_chunks[static_cast<int>(t)];
      out.resident_bytes[static_cast<int>(t)] += c.size;
    }
  }
  for (int p = 0; p < kPaths; ++p) {
    out.in_flight[p] = paths_[p].in_flight;
    out.queued_bytes[p] = paths_[p].queued_bytes;
  }
  return out;
}

}  // namespace tierd::daemon
