#include "daemon/chunks/mover.h"

#include <algorithm>
#include <cassert>

#include "absl/strings/str_cat.h"
#include "daemon/chunks/batch.h"

namespace tierd::daemon {

template <typename F>
auto Mover::Tracked(F callback) {
  return [op = BeginOp(), callback = std::move(callback)](auto&&... args) mutable {
    callback(std::forward<decltype(args)>(args)...);
  };
}

std::shared_ptr<void> Mover::BeginOp() {
  {
    absl::MutexLock lock(&ops_mu_);
    ++ops_;
  }
  return std::shared_ptr<void>(this, [](void* mover) {
    auto* self = static_cast<Mover*>(mover);
    absl::MutexLock lock(&self->ops_mu_);
    --self->ops_;
  });
}

Mover::~Mover() { WaitForIdle(); }

void Mover::WaitForIdle() {
  absl::MutexLock lock(&ops_mu_);
  ops_mu_.Await(absl::Condition(
      +[](uint64_t* ops) { return *ops == 0; }, &ops_));
}

void Mover::MoveStarted(Path path, const ChunkMeta& chunk) {
  meter_.Started(path, chunk.id, chunk.size, clock_.Now());
}

void Mover::MoveDone(Path path, const ChunkMeta& chunk, Settlement& settled) {
  settled.crossed[path] += chunk.size;
  meter_.Done(path, chunk.id, chunk.size, clock_.Now());
}

void Mover::DropAbove(ChunkMeta& chunk, TierKind tier) {
  mu_.AssertHeld();
  for (TierKind above : {TierKind::kDevice, TierKind::kHost}) {
    if (Above(above, tier) && chunk.allocated.contains(above)) space_.DropCopy(chunk, above);
  }
}

HopJob Mover::JobFor(const ChunkMeta& chunk, TierKind from, TierKind to) const {
  const Placement& source = chunk.placement[from];
  const Placement& target = chunk.placement[to];
  return HopJob{.chunk_id = chunk.id,
                .from = source,
                .to = target,
                .from_address = tier(from)->Address(source),
                .to_address = tier(to)->Address(target),
                .size = chunk.size,
                .checksum = chunk.checksum,
                .zeros = from == TierKind::kNvme && !chunk.written};
}

ChunkMeta& Mover::Moving(ChunkId id) {
  // A moving chunk cannot be freed (Free refuses, a session end defers it), so it is there.
  auto it = chunks_.find(id);
  assert(it != chunks_.end() && it->second.state == ChunkState::kMoving);
  return it->second;
}

absl::Status Mover::EnsureSpace(ChunkMeta& chunk, TierKind tier) {
  if (chunk.allocated.contains(tier)) return absl::OkStatus();
  if (absl::Status s = space_.PlaceIn(chunk, tier); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("chunk ", chunk.id, ": ", s.message()));
  }
  return absl::OkStatus();
}

void Mover::Settled(ChunkMeta& chunk, bool ok) {
  FinishMove(chunk, ok);
  --in_flight_;
}

absl::Status Mover::BeginMoving(ChunkMeta& chunk, TierKind to) {
  // Retired: the chunk goes once its last move settles, and nothing new starts for it.
  if (chunk.doomed) return Retired(chunk);
  if (chunk.writers > 0) {
    // The client may be writing the only valid copy (the planner's and queued fetches land here
    // without a request's validation).
    return absl::FailedPreconditionError(
        absl::StrCat("chunk ", chunk.id, " is acquired for write; release it before moving it"));
  }
  absl::Status begin = BeginMove(chunk, to);
  assert(begin.ok());  // callers validated the batch: no chunk is moving
  (void)begin;
  ++in_flight_;
  return absl::OkStatus();
}

std::optional<Mover::Route> Mover::RouteFor(const ChunkMeta& chunk, TierKind to,
                                            Direction direction) {
  const TierSet& r = chunk.resident;
  if (r.contains(to)) return std::nullopt;
  switch (to) {
    case TierKind::kDevice:
      return r.contains(TierKind::kHost) ? Route::kHostToDevice : Route::kNvmeToDevice;
    case TierKind::kHost:
      if (direction == Direction::kDown) {
        // The device's copy comes down; NVMe's, if any, stays where it is.
        if (!r.contains(TierKind::kDevice)) return std::nullopt;
        return Route::kDeviceToHost;
      }
      // Up: NVMe's copy, leaving a device copy (perhaps acquired) alone; else the device's.
      return r.contains(TierKind::kDevice) && !r.contains(TierKind::kNvme) ? Route::kDeviceToHost
                                                                           : Route::kNvmeToHost;
    case TierKind::kNvme:
      return r.contains(TierKind::kDevice) && !r.contains(TierKind::kHost) ? Route::kDeviceToNvme
                                                                           : Route::kHostToNvme;
  }
  return std::nullopt;
}

absl::Status Mover::CheckFetchable(const ChunkMeta& chunk, TierKind tier) const {
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

absl::Status Mover::Start(ChunkMeta& chunk, Route route, const std::shared_ptr<Batch>& batch,
                          bool keep_source, const IoOrder& order) {
  mu_.AssertHeld();
  switch (route) {
    case Route::kHostToDevice:
    case Route::kNvmeToDevice:
      return StartToDevice(chunk, batch, order);
    case Route::kNvmeToHost:
      return StartRead(chunk, batch, order);
    case Route::kDeviceToHost:
      return StartToHost(chunk, batch, /*then_nvme=*/false, keep_source, order);
    case Route::kDeviceToNvme:
      return StartToHost(chunk, batch, /*then_nvme=*/true, keep_source, order);
    case Route::kHostToNvme:
      return StartWrite(chunk, batch, keep_source, order);
  }
  return absl::InternalError("unknown route");
}

absl::Status Mover::Fetch(ChunkMeta& chunk, TierKind tier, const std::shared_ptr<Batch>& batch,
                          const IoOrder& order) {
  std::optional<Route> route = RouteFor(chunk, tier, Direction::kUp);
  if (!route) {
    return absl::InternalError(
        absl::StrCat("chunk ", chunk.id, " is in the ", TierName(tier), " tier: nothing to fetch"));
  }
  return Start(chunk, *route, batch, /*keep_source=*/true, order);
}

absl::Status Mover::WriteDown(ChunkMeta& chunk, TierKind tier, const std::shared_ptr<Batch>& batch,
                              bool keep_source, const IoOrder& order) {
  const std::optional<TierKind> below = Below(tier);
  std::optional<Route> route;
  if (below) route = RouteFor(chunk, *below, Direction::kDown);
  if (!below) {
    return absl::InternalError(
        absl::StrCat("chunk ", chunk.id, ": nothing is below the ", TierName(tier), " tier"));
  }
  if (!route) {  // the copy below is current: nothing to write
    if (!keep_source) DropAbove(chunk, *below);
    return absl::OkStatus();
  }
  return Start(chunk, *route, batch, keep_source, order);
}

void Mover::Mark(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch) {
  mu_.AssertHeld();
  IndexEntry e{chunk.tenant,         chunk.name,        chunk.size, 0, 0, chunk.checksum,
               /*memory_home=*/true, /*in_memory=*/true};
  if (chunk.written && chunk.allocated.contains(TierKind::kNvme)) {
    e.offset = chunk.placement[TierKind::kNvme].offset;  // the older version stays where it is
    e.reserved = chunk.placement[TierKind::kNvme].size;
  }
  batch->Add();
  tiers_.index->Persist(
      std::move(e), Tracked([this, id = chunk.id, batch](absl::Status s) {
        {
          absl::MutexLock lock(&mu_);
          if (auto it = chunks_.find(id); s.ok() && it != chunks_.end()) it->second.marked = true;
        }
        if (!s.ok()) {
          s = absl::Status(s.code(),
                           absl::StrCat("chunk ", id,
                                        ": could not record in the NVMe index that its current "
                                        "version is in memory (a crash must report it lost, not "
                                        "return an older one): ",
                                        s.message()));
        }
        batch->Done(s);
      }));
}

absl::Status Mover::StartToDevice(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                                  const IoOrder& order) {
  const bool from_host = chunk.resident.contains(TierKind::kHost);
  // Without a host copy, the chunk's host space stages it on the way from NVMe.
  if (absl::Status s = EnsureSpace(chunk, TierKind::kHost); !s.ok()) return s;
  if (absl::Status s = EnsureSpace(chunk, TierKind::kDevice); !s.ok()) return s;
  if (absl::Status s = BeginMoving(chunk, TierKind::kDevice); !s.ok()) return s;
  if (batch) batch->Add();
  MoveStarted(Path::kHostToDevice, chunk);
  if (!from_host && chunk.written) MoveStarted(Path::kNvmeToHost, chunk);
  auto settle = Tracked([this, id = chunk.id, batch, from_host](absl::Status s, uint64_t) {
    SettleToDevice(id, s, /*host_filled=*/!from_host);
    if (batch) batch->Done(s);
  });
  const HopJob to_device = JobFor(chunk, TierKind::kHost, TierKind::kDevice);
  if (from_host) {
    hop(Path::kHostToDevice)->Copy(to_device, std::move(settle));
    return absl::OkStatus();
  }
  // NVMe -> host -> GPU: each piece goes on to the GPU as soon as it has been read.
  constexpr uint64_t kPiece = 4 << 20;
  HopJob read = JobFor(chunk, TierKind::kNvme, TierKind::kHost);
  read.order = order;
  CopyAlong(hop(Path::kNvmeToHost), read, hop(Path::kHostToDevice), to_device, kPiece,
            std::move(settle));
  return absl::OkStatus();
}

void Mover::SettleToDevice(ChunkId id, const absl::Status& status, bool host_filled) {
  absl::MutexLock lock(&mu_);
  ChunkMeta& chunk = Moving(id);
  Settled(chunk, status.ok());
  Settlement settled{.status = status, .brought_in = true};
  MoveDone(Path::kHostToDevice, chunk, settled);
  if (host_filled && chunk.written) MoveDone(Path::kNvmeToHost, chunk, settled);
  if (status.ok()) {
    if (host_filled) chunk.resident.insert(TierKind::kHost);
  } else {
    space_.DropCopy(chunk, TierKind::kDevice);
    if (host_filled) space_.DropCopy(chunk, TierKind::kHost);
    if (absl::IsDataLoss(status)) chunk.resident.erase(TierKind::kNvme);
  }
  chunks_.Reindex(chunk);
  listener_.MoveSettled(chunk, settled);
}

absl::Status Mover::StartToHost(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                                bool then_nvme, bool keep_source, const IoOrder& order) {
  if (absl::Status s = EnsureSpace(chunk, TierKind::kHost); !s.ok()) return s;
  if (absl::Status s = BeginMoving(chunk, TierKind::kHost); !s.ok()) return s;
  if (batch) batch->Add();
  MoveStarted(Path::kDeviceToHost, chunk);
  hop(Path::kDeviceToHost)
      ->Copy(JobFor(chunk, TierKind::kDevice, TierKind::kHost),
             Tracked([this, id = chunk.id, batch, then_nvme, keep_source, order](absl::Status s,
                                                                                 uint64_t) {
               const absl::Status settled =
                   SettleToHost(id, s, then_nvme, keep_source, batch, order);
               if (batch) batch->Done(settled);
             }));
  return absl::OkStatus();
}

absl::Status Mover::SettleToHost(ChunkId id, const absl::Status& status, bool then_nvme,
                                 bool keep_source, const std::shared_ptr<Batch>& batch,
                                 const IoOrder& order) {
  absl::MutexLock lock(&mu_);
  ChunkMeta& chunk = Moving(id);
  Settled(chunk, status.ok());
  Settlement settled{.status = status};
  MoveDone(Path::kDeviceToHost, chunk, settled);
  absl::Status out = status;
  if (!status.ok()) {
    space_.DropCopy(chunk, TierKind::kHost);
  } else if (chunk.doomed) {
    // Destroyed below.
  } else if (then_nvme) {
    IoOrder now = order;
    now.deadline = clock_.Now();
    out = StartWrite(chunk, batch, keep_source, now);  // drops host and device copies once durable
  } else if (!keep_source && chunk.pins == 0) {
    space_.DropCopy(chunk, TierKind::kDevice);
  }
  chunks_.Reindex(chunk);
  listener_.MoveSettled(chunk, settled);
  return out;
}

absl::Status Mover::StartRead(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                              const IoOrder& order) {
  if (absl::Status s = EnsureSpace(chunk, TierKind::kHost); !s.ok()) return s;
  if (absl::Status s = BeginMoving(chunk, TierKind::kHost); !s.ok()) return s;
  if (batch) batch->Add();
  if (chunk.written) MoveStarted(Path::kNvmeToHost, chunk);
  HopJob read = JobFor(chunk, TierKind::kNvme, TierKind::kHost);
  read.order = order;
  hop(Path::kNvmeToHost)
      ->Copy(read, Tracked([this, id = chunk.id, batch](absl::Status s, uint64_t) {
               SettleRead(id, s);
               if (batch) batch->Done(s);
             }));
  return absl::OkStatus();
}

void Mover::SettleRead(ChunkId id, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  ChunkMeta& chunk = Moving(id);
  Settled(chunk, status.ok());
  Settlement settled{.status = status, .brought_in = true};
  if (chunk.written) MoveDone(Path::kNvmeToHost, chunk, settled);
  if (!status.ok()) {
    space_.DropCopy(chunk, TierKind::kHost);
    if (absl::IsDataLoss(status)) chunk.resident.erase(TierKind::kNvme);  // never trusted again
  }
  chunks_.Reindex(chunk);
  listener_.MoveSettled(chunk, settled);
}

absl::Status Mover::StartWrite(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
                               bool keep_source, const IoOrder& order) {
  if (chunk.resident.contains(TierKind::kNvme)) {  // already current there
    if (!keep_source) DropAbove(chunk, TierKind::kNvme);
    return absl::OkStatus();
  }
  // A persistent chunk's durable version stays whole where the index says it is until the new
  // one is durable: the rewrite goes to fresh space, and the index switch is its commit point.
  std::optional<Placement> previous;
  if (chunk.persistent && chunk.written && chunk.allocated.contains(TierKind::kNvme)) {
    // Briefly two copies: the second is not held against the user's quota.
    absl::StatusOr<Placement> fresh = space_.Reserve(
        TierKind::kNvme, OwnerOf(chunk), space_.SpaceIn(TierKind::kNvme, chunk.size, true), false);
    if (!fresh.ok()) {
      return absl::Status(fresh.status().code(),
                          absl::StrCat("chunk ", chunk.id,
                                       ": its new version is written beside the durable one "
                                       "until it is durable itself, and there is no room for it: ",
                                       fresh.status().message()));
    }
    previous = chunk.placement[TierKind::kNvme];
    chunk.placement[TierKind::kNvme] = *fresh;
  }
  if (absl::Status s = EnsureSpace(chunk, TierKind::kNvme); !s.ok()) return s;
  if (absl::Status s = BeginMoving(chunk, TierKind::kNvme); !s.ok()) {
    if (previous) {
      space_.Release(chunk.tenant, chunk.placement[TierKind::kNvme]);
      chunk.placement[TierKind::kNvme] = *previous;
    }
    return s;
  }
  if (batch) batch->Add();
  MoveStarted(Path::kHostToNvme, chunk);
  HopJob write = JobFor(chunk, TierKind::kHost, TierKind::kNvme);
  write.order = order;
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
               if (batch) batch->Done(s);
             }));
  return absl::OkStatus();
}

void Mover::SettleWrite(ChunkId id, const absl::StatusOr<uint64_t>& checksum, bool keep_source,
                        const std::optional<Placement>& previous) {
  absl::MutexLock lock(&mu_);
  ChunkMeta& chunk = Moving(id);
  Settled(chunk, checksum.ok());
  Settlement settled{.status = checksum.status()};
  MoveDone(Path::kHostToNvme, chunk, settled);
  if (previous) {
    // Committed: the previous version's space is free. Not: the new one's, and the previous
    // version stays what the index (and the chunk) name.
    if (checksum.ok()) {
      space_.Release(chunk.tenant, *previous);
    } else {
      space_.Release(chunk.tenant, chunk.placement[TierKind::kNvme]);
      chunk.placement[TierKind::kNvme] = *previous;
    }
  }
  if (checksum.ok()) {
    chunk.written = true;
    chunk.checksum = *checksum;
    chunk.marked = false;  // the index now names this version
    chunk.dirty = TierSet();
    if (!keep_source && chunk.pins == 0) DropAbove(chunk, TierKind::kNvme);
  }
  chunks_.Reindex(chunk);
  listener_.MoveSettled(chunk, settled);
}

}  // namespace tierd::daemon
