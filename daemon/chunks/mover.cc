#include "daemon/chunks/mover.h"

#include <algorithm>
#include <cassert>

#include "absl/strings/str_cat.h"
#include "daemon/chunks/batch.h"
#include "daemon/chunks/chunk_service_internal.h"

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

void Mover::MoveDone(Path path, const ChunkMeta& chunk) {
  listener_.Moved(path, chunk);
  meter_.Done(path, chunk.id, chunk.size, clock_.Now());
}

void Mover::DropAbove(ChunkMeta& chunk, TierKind tier) {
  for (TierKind above : {TierKind::kDevice, TierKind::kHost}) {
    if (Above(above, tier) && chunk.allocated.contains(above)) room_.DropCopy(chunk, above);
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

bool Mover::EnsureSpace(ChunkMeta& chunk, TierKind tier, const std::shared_ptr<Batch>& batch) {
  if (chunk.allocated.contains(tier)) return true;
  absl::StatusOr<Placement> p =
      room_.ReserveIn(tier, chunk.tenant, room_.SpaceIn(tier, chunk.size, chunk.persistent));
  if (!p.ok()) {
    batch->Add();
    batch->Done(absl::Status(p.status().code(),
                             absl::StrCat("chunk ", chunk.id, ": ", p.status().message())));
    return false;
  }
  chunk.placement[tier] = *p;
  chunk.allocated.insert(tier);
  return true;
}

void Mover::Settled(ChunkMeta& chunk, bool ok) {
  FinishMove(chunk, ok);
  --in_flight_;
}

bool Mover::BeginBatchMove(ChunkMeta& chunk, TierKind to, const std::shared_ptr<Batch>& batch) {
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
  ++in_flight_;
  return true;
}

void Mover::StartWriteDown(ChunkMeta& chunk, TierKind tier, const std::shared_ptr<Batch>& batch,
                           bool keep_source) {
  if (tier == TierKind::kDevice) {
    StartToHost(chunk, batch, /*then_nvme=*/false, keep_source);
  } else {
    StartWrite(chunk, batch, keep_source);
  }
}

void Mover::Mark(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch) {
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

void Mover::StartToDevice(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch,
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
  read.order = listener_.OrderFor(chunk, deadline);
  CopyAlong(hop(Path::kNvmeToHost), read, hop(Path::kHostToDevice), to_device, kPiece,
            std::move(settle));
}

void Mover::SettleToDevice(ChunkId id, const absl::Status& status, bool host_filled) {
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
  listener_.Used(chunk);
  listener_.MoveSettled(chunk, status);
}

void Mover::StartToHost(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch, bool then_nvme,
                        bool keep_source) {
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

void Mover::SettleToHost(ChunkId id, const absl::Status& status, bool then_nvme, bool keep_source,
                         const std::shared_ptr<Batch>& batch) {
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
  listener_.MoveSettled(chunk, status);
}

void Mover::StartRead(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch, absl::Time deadline) {
  if (!EnsureSpace(chunk, TierKind::kHost, batch)) return;
  if (!BeginBatchMove(chunk, TierKind::kHost, batch)) return;
  if (chunk.written) MoveStarted(Path::kNvmeToHost, chunk);
  HopJob read = JobFor(chunk, TierKind::kNvme, TierKind::kHost);
  read.order = listener_.OrderFor(chunk, deadline);
  hop(Path::kNvmeToHost)
      ->Copy(read, Tracked([this, id = chunk.id, batch](absl::Status s, uint64_t) {
               SettleRead(id, s);
               batch->Done(s);
             }));
}

void Mover::SettleRead(ChunkId id, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  ChunkMeta& chunk = Moving(id);
  Settled(chunk, status.ok());
  if (chunk.written) MoveDone(Path::kNvmeToHost, chunk);
  if (!status.ok()) {
    room_.DropCopy(chunk, TierKind::kHost);
    if (absl::IsDataLoss(status)) chunk.resident.erase(TierKind::kNvme);  // never trusted again
  }
  listener_.Used(chunk);
  listener_.MoveSettled(chunk, status);
}

void Mover::StartWrite(ChunkMeta& chunk, const std::shared_ptr<Batch>& batch, bool keep_source) {
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
    previous = chunk.placement[TierKind::kNvme];
    chunk.placement[TierKind::kNvme] = *fresh;
  }
  if (!EnsureSpace(chunk, TierKind::kNvme, batch)) return;
  if (!BeginBatchMove(chunk, TierKind::kNvme, batch)) {
    if (previous) {
      room_.ReleaseSpace(chunk.tenant, chunk.placement[TierKind::kNvme]);
      chunk.placement[TierKind::kNvme] = *previous;
    }
    return;
  }
  MoveStarted(Path::kHostToNvme, chunk);
  HopJob write = JobFor(chunk, TierKind::kHost, TierKind::kNvme);
  write.order = listener_.OrderFor(chunk, clock_.Now());
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

void Mover::SettleWrite(ChunkId id, const absl::StatusOr<uint64_t>& checksum, bool keep_source,
                        const std::optional<Placement>& previous) {
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
      room_.ReleaseSpace(chunk.tenant, chunk.placement[TierKind::kNvme]);
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
  room_.MoveDone(id);
  listener_.MoveSettled(chunk, checksum.status());
}

}  // namespace tierd::daemon
