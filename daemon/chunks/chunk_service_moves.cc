// ChunkService: the moves between tiers. Each starts with the chunk marked moving and its space
// reserved, hands the copy to its route of hops with a callback (Tracked), and settles under the
// service's lock: the copies change, the path is metered, and the requests waiting for the chunk
// are served.

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

void ChunkService::MoveStarted(Path path, const ChunkMeta& chunk) {
  meter_.Started(path, chunk.id, chunk.size, clock_.Now());
}

void ChunkService::MoveDone(Path path, const ChunkMeta& chunk) {
  // The traffic is the holder's: a scratch chunk's session, a persistent one's first lease.
  if (auto holder = sessions_.find(chunk.owner); holder != sessions_.end()) {
    SessionState& state = holder->second;
    state.moved[static_cast<int>(path)] += chunk.size;
    if (!state.job.empty()) jobs_[state.job].moved[static_cast<int>(path)] += chunk.size;
  }
  meter_.Done(path, chunk.id, chunk.size, clock_.Now());
}

void ChunkService::DropAbove(ChunkMeta& chunk, TierKind tier) {
  for (TierKind above : {TierKind::kDevice, TierKind::kHost}) {
    if (Rank(above) > Rank(tier) && chunk.allocated.contains(above)) room_.DropCopy(chunk, above);
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
  if (!from_device && !chunk.resident.contains(TierKind::kHost) &&
      hop(Path::kNvmeToHost) == nullptr) {
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

HopJob ChunkService::JobFor(const ChunkMeta& chunk, TierKind from, TierKind to) const {
  const Placement& source = chunk.placement[static_cast<int>(from)];
  const Placement& target = chunk.placement[static_cast<int>(to)];
  return HopJob{.chunk_id = chunk.id,
                .from = source,
                .to = target,
                .from_address = tier(from)->Address(source),
                .to_address = tier(to)->Address(target),
                .size = chunk.size,
                .checksum = chunk.checksum,
                .zeros = from == TierKind::kNvme && !chunk.written};
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

void ChunkService::StartWriteDown(ChunkMeta& chunk, TierKind tier) {
  // Whoever needs the room waits for it to be freed (a queued fetch, an Acquire on room_freed_);
  // the write-down itself reports to no one.
  auto batch = std::make_shared<Batch>();
  if (tier == TierKind::kDevice) {
    StartToHost(chunk, batch, /*then_nvme=*/false, /*keep_source=*/false);
  } else {
    StartWrite(chunk, batch, /*keep_source=*/false);
  }
  batch->Done(absl::OkStatus());
}

bool ChunkService::Awaited(ChunkId id, TierKind tier) const {
  auto it = waiters_.find(id);
  return it != waiters_.end() &&
         std::any_of(it->second.begin(), it->second.end(),
                     [&](const Waiter& w) { return w.tier == tier && !w.evict_keep_source; });
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
  waiters_[chunk.id].push_back(Waiter{batch, session, tier, pin, clock_.Now()});
  if (chunk.state == ChunkState::kMoving) return;  // woken when the move settles
  // An Acquire's space was reserved up front (its location is final); other requests may queue
  // for room.
  if (absl::Status s =
          pin ? StartFetch(chunk, tier, deadline) : room_.FetchOrQueue(chunk, tier, deadline);
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
  const absl::Time now = clock_.Now();
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
      if (absl::Status f = room_.FetchOrQueue(chunk, w.tier, now); !f.ok()) {
        w.batch->Done(f);
      } else {
        waiters_[chunk.id].push_back(std::move(w));
      }
    }
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
      room_.ReserveIn(tier, chunk.tenant, room_.SpaceIn(tier, chunk.size, chunk.persistent));
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

void ChunkService::AfterMove(ChunkMeta& chunk, const absl::Status& moved) {
  if (chunk.doomed) {
    // Whoever waited for it learns it is gone; nothing is fetched or evicted for it again.
    FailAllWaiters(chunk.id, Retired(chunk));
    if (chunk.state != ChunkState::kMoving) Destroy(chunk);
  } else {
    WakeWaiters(chunk, moved);
  }
  room_.RetryQueuedFetches();
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
  index_->Persist(std::move(e), Tracked([this, id = chunk.id, batch](absl::Status s) {
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

void ChunkService::FailAllWaiters(ChunkId id, const absl::Status& status) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  std::vector<Waiter> failed = std::move(it->second);
  waiters_.erase(it);
  for (Waiter& w : failed) w.batch->Done(status);
}

void ChunkService::StartToDevice(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                                 absl::Time deadline) {
  const bool from_host = chunk.resident.contains(TierKind::kHost);
  // Without a host copy, the chunk's host space stages it on the way from NVMe.
  if (!EnsureSpace(chunk, TierKind::kHost, batch) ||
      !EnsureSpace(chunk, TierKind::kDevice, batch)) {
    return;
  }
  if (!BeginBatchMove(chunk, TierKind::kDevice, batch)) return;
  MoveStarted(Path::kHostToDevice, chunk);
  if (!from_host && chunk.written) MoveStarted(Path::kNvmeToHost, chunk);
  auto settle = Tracked([this, id = chunk.id, batch, from_host](absl::Status s, uint64_t) {
    SettleToDevice(id, s, /*host_filled=*/!from_host);
    batch->Done(s);
  });
  const HopJob to_device = JobFor(chunk, TierKind::kHost, TierKind::kDevice);
  if (from_host) {
    hop(Path::kHostToDevice)->Copy(to_device, std::move(settle));
    return;
  }
  // NVMe -> host -> GPU: each piece goes on to the GPU as soon as it has been read.
  constexpr uint64_t kPiece = 4 << 20;
  HopJob read = JobFor(chunk, TierKind::kNvme, TierKind::kHost);
  read.order = OrderFor(chunk, deadline);
  CopyAlong(hop(Path::kNvmeToHost), read, hop(Path::kHostToDevice), to_device, kPiece,
            std::move(settle));
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
    room_.DropCopy(chunk, TierKind::kDevice);
    if (host_filled) room_.DropCopy(chunk, TierKind::kHost);
    if (absl::IsDataLoss(status)) chunk.resident.erase(TierKind::kNvme);
  }
  chunk.last_use = ++use_clock_;
  AfterMove(chunk, status);
}

void ChunkService::StartToHost(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                               bool then_nvme, bool keep_source) {
  if (!EnsureSpace(chunk, TierKind::kHost, batch)) return;
  if (!BeginBatchMove(chunk, TierKind::kHost, batch)) return;
  MoveStarted(Path::kDeviceToHost, chunk);
  hop(Path::kDeviceToHost)
      ->Copy(
          JobFor(chunk, TierKind::kDevice, TierKind::kHost),
          Tracked([this, id = chunk.id, batch, then_nvme, keep_source](absl::Status s, uint64_t) {
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
    room_.DropCopy(chunk, TierKind::kHost);
  } else if (chunk.doomed) {
    // Destroyed below.
  } else if (then_nvme) {
    StartWrite(chunk, batch, keep_source);  // drops host and device copies once durable
  } else if (!keep_source && chunk.pins == 0) {
    room_.DropCopy(chunk, TierKind::kDevice);
  }
  room_.MoveDone(id);
  AfterMove(chunk, status);
}

void ChunkService::StartRead(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                             absl::Time deadline) {
  if (!EnsureSpace(chunk, TierKind::kHost, batch)) return;
  if (!BeginBatchMove(chunk, TierKind::kHost, batch)) return;
  if (chunk.written) MoveStarted(Path::kNvmeToHost, chunk);
  HopJob read = JobFor(chunk, TierKind::kNvme, TierKind::kHost);
  read.order = OrderFor(chunk, deadline);
  hop(Path::kNvmeToHost)
      ->Copy(read, Tracked([this, id = chunk.id, batch](absl::Status s, uint64_t) {
               SettleRead(id, s);
               batch->Done(s);
             }));
}

void ChunkService::SettleRead(ChunkId id, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  ChunkMeta& chunk = Moving(id);
  Settled(chunk, status.ok());
  if (chunk.written) MoveDone(Path::kNvmeToHost, chunk);
  if (!status.ok()) {
    room_.DropCopy(chunk, TierKind::kHost);
    if (absl::IsDataLoss(status)) chunk.resident.erase(TierKind::kNvme);  // never trusted again
  }
  chunk.last_use = ++use_clock_;
  AfterMove(chunk, status);
}

void ChunkService::StartWrite(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                              bool keep_source) {
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
    absl::StatusOr<Placement> fresh = room_.ReserveSpace(
        TierKind::kNvme, chunk.tenant, room_.SpaceIn(TierKind::kNvme, chunk.size, true), false);
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
      room_.ReleaseSpace(chunk.tenant, chunk.placement[kNvme]);
      chunk.placement[kNvme] = *previous;
    }
    return;
  }
  MoveStarted(Path::kHostToNvme, chunk);
  HopJob write = JobFor(chunk, TierKind::kHost, TierKind::kNvme);
  write.order = OrderFor(chunk, clock_.Now());
  write.durable = chunk.persistent;
  if (chunk.persistent) {
    // A persistent chunk is durable once the index says where it is.
    write.commit = IndexEntry{chunk.tenant,  chunk.name, chunk.size,        write.to.offset,
                              write.to.size, 0,          chunk.memory_home, /*in_memory=*/false};
  }
  hop(Path::kHostToNvme)
      ->Copy(write, Tracked([this, id = chunk.id, batch, keep_source, previous](absl::Status s,
                                                                                uint64_t checksum) {
               SettleWrite(id, s.ok() ? absl::StatusOr<uint64_t>(checksum) : s, keep_source,
                           previous);
               batch->Done(s);
             }));
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
      room_.ReleaseSpace(chunk.tenant, *previous);
    } else {
      room_.ReleaseSpace(chunk.tenant, chunk.placement[kNvme]);
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
  room_.MoveDone(id);
  AfterMove(chunk, checksum.status());
}

}  // namespace tierd::daemon
