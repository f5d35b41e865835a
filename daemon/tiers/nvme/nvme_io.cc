// The NVMe tier's data path: chunk reads and writes between the host tier's segments and the
// regions (with XXH3 checksums and group-committed flushes), the index records of persistent
// chunks, and the two hops (NVMe -> host, host -> NVMe) the chunk service routes moves over.

#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/fmt_absl.h"
#include "common/sizes.h"
#include "daemon/tiers/nvme/nvme_tier.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {
namespace {

absl::Status Annotate(uint64_t chunk_id, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("chunk ", chunk_id, ": ", s.message()));
}

}  // namespace

void NvmeTier::Begin() {
  absl::MutexLock lock(&ops_mu_);
  ++ops_in_flight_;
}

void NvmeTier::End() {
  absl::MutexLock lock(&ops_mu_);
  --ops_in_flight_;
}

void NvmeTier::Write(uint64_t chunk_id, const Placement& host, const Placement& nvme, uint64_t size,
                     std::function<void(absl::StatusOr<uint64_t>)> user_done, IoOrder order,
                     bool durable) {
  Begin();
  auto done = [this, user_done = std::move(user_done)](absl::StatusOr<uint64_t> r) {
    user_done(std::move(r));
    End();
  };
  char* src = static_cast<char*>(host_->Address(host));
  const int32_t index = BufferIndex(host.segment);
  const uint64_t length = AlignUp(size, block_);
  worker_->Post(
      [this, chunk_id, src, index, nvme, size, length, order, durable, done = std::move(done)]() {
        const uint64_t checksum = XXH3_64bits(src, size);
        engine_->Run(
            Spans(IoKind::kWrite, nvme.offset, length, src, index),
            [this, chunk_id, checksum, durable, done](absl::Status s) {
              auto finish = [this, chunk_id, checksum, done](absl::Status status) {
                worker_->Post([chunk_id, checksum, status, done]() {
                  if (status.ok()) {
                    done(checksum);
                  } else {
                    done(Annotate(chunk_id, status));
                  }
                });
              };
              if (!s.ok() || !durable) return finish(s);
              // Durable before anyone may drop the host copy or record it in the index.
              SyncAfterWrite(finish);
            },
            order);
      });
}

void NvmeTier::SyncAfterWrite(StatusCallback done) {
  absl::MutexLock lock(&sync_mu_);
  waiting_for_sync_.push_back(std::move(done));
  if (!sync_in_flight_) StartSync();
}

void NvmeTier::StartSync() {
  sync_in_flight_ = true;
  auto batch = std::make_shared<std::vector<StatusCallback>>(std::move(waiting_for_sync_));
  waiting_for_sync_.clear();
  std::vector<IoSpan> spans;
  for (uint32_t r = 0; r < regions_.size(); ++r) spans.push_back(IoSpan{IoKind::kSync, r});
  // Writes already done wait for it: it goes ahead of everything queued.
  engine_->Run(std::move(spans),
               [this, batch](absl::Status s) {
                 for (StatusCallback& cb : *batch) cb(s);
                 absl::MutexLock lock(&sync_mu_);
                 sync_in_flight_ = false;
                 if (!waiting_for_sync_.empty()) StartSync();
               },
               {.deadline = absl::InfinitePast()});
}

void NvmeTier::Read(uint64_t chunk_id, const Placement& host, const Placement& nvme, uint64_t size,
                    uint64_t checksum, StatusCallback done, IoOrder order) {
  // One piece: the whole chunk as one job.
  ReadPieces(chunk_id, host, nvme, size, checksum, AlignUp(size, block_), nullptr, std::move(done),
             order);
}

void NvmeTier::ReadPieces(uint64_t chunk_id, const Placement& host, const Placement& nvme,
                          uint64_t size, uint64_t checksum, uint64_t piece,
                          std::function<void(uint64_t, uint64_t)> on_piece, StatusCallback done,
                          IoOrder order) {
  Begin();
  char* dst = static_cast<char*>(host_->Address(host));
  const int32_t index = BufferIndex(host.segment);
  const uint64_t length = AlignUp(size, block_);
  piece = std::max<uint64_t>(AlignUp(piece, block_), block_);
  struct State {
    absl::Mutex mu;
    size_t remaining;
    absl::Status status;
  };
  auto state = std::make_shared<State>();
  state->remaining = (length + piece - 1) / piece;
  for (uint64_t off = 0; off < length; off += piece) {
    const uint64_t n = std::min(piece, length - off);
    engine_->Run(
        Spans(IoKind::kRead, nvme.offset + off, n, dst + off, index),
        [this, state, off, n, on_piece, chunk_id, dst, size, checksum, done](absl::Status s) {
          if (s.ok() && on_piece) on_piece(off, n);
          {
            absl::MutexLock lock(&state->mu);
            if (state->status.ok() && !s.ok()) state->status = s;
            if (--state->remaining > 0) return;
          }
          worker_->Post([this, state, chunk_id, dst, size, checksum, done]() {
            absl::Status status = state->status;
            if (!status.ok()) {
              status = Annotate(chunk_id, status);
            } else if (const uint64_t actual = XXH3_64bits(dst, size); actual != checksum) {
              checksum_failures_.fetch_add(1, std::memory_order_relaxed);
              status = absl::DataLossError(
                  absl::StrCat("chunk ", chunk_id, ": the NVMe copy fails its checksum (expected ",
                               absl::Hex(checksum), ", read ", absl::Hex(actual),
                               "); the data on the drive is damaged and was not handed out"));
            }
            done(status);
            End();
          });
        },
        order);
  }
}

void NvmeTier::ZeroFill(const Placement& host, uint64_t size, StatusCallback done) {
  char* dst = static_cast<char*>(host_->Address(host));
  Begin();
  worker_->Post([this, dst, size, done = std::move(done)]() {
    std::memset(dst, 0, size);
    done(absl::OkStatus());
    End();
  });
}

void NvmeTier::Persist(IndexEntry entry, StatusCallback done) {
  // Counted like every other operation, so that Drain waits for its callback too.
  Begin();
  worker_->Post([this, entry = std::move(entry), done = std::move(done)]() {
    done(index_->Put(entry));
    End();
  });
}

void NvmeTier::Forget(uint32_t tenant, std::string name) {
  Begin();
  worker_->Post([this, tenant, name = std::move(name)]() {
    if (absl::Status s = index_->Remove(tenant, name); !s.ok()) {
      spdlog::error("NVMe index: could not remove '{}' of uid {}: {}", name, tenant, s.message());
    }
    End();
  });
}

void NvmeTier::Drain() {
  absl::MutexLock lock(&ops_mu_);
  ops_mu_.Await(absl::Condition(
      +[](int64_t* n) { return *n == 0; }, &ops_in_flight_));
}

void NvmeTier::ReadHop::Copy(const HopJob& job, Done done) {
  auto called_back = [done = std::move(done)](absl::Status s) { done(std::move(s), 0); };
  if (job.zeros) {
    tier_->ZeroFill(job.to, job.size, std::move(called_back));
  } else {
    tier_->Read(job.chunk_id, job.to, job.from, job.size, job.checksum, std::move(called_back),
                job.order);
  }
}

void NvmeTier::ReadHop::CopyInPieces(const HopJob& job, uint64_t piece, OnPiece on_piece,
                                     Done done) {
  if (job.zeros) return Hop::CopyInPieces(job, piece, std::move(on_piece), std::move(done));
  tier_->ReadPieces(
      job.chunk_id, job.to, job.from, job.size, job.checksum, piece, std::move(on_piece),
      [done = std::move(done)](absl::Status s) { done(std::move(s), 0); }, job.order);
}

void NvmeTier::WriteHop::Copy(const HopJob& job, Done done) {
  NvmeTier* tier = tier_;
  tier->Write(
      job.chunk_id, job.from, job.to, job.size,
      [tier, commit = job.commit, done = std::move(done)](absl::StatusOr<uint64_t> checksum) {
        if (!checksum.ok()) return done(checksum.status(), 0);
        if (!commit) return done(absl::OkStatus(), *checksum);
        // A persistent chunk's new version counts once the index says where it is.
        IndexEntry entry = *commit;
        entry.checksum = *checksum;
        tier->Persist(std::move(entry), [done, c = *checksum](absl::Status s) { done(s, c); });
      },
      job.order, job.durable);
}

}  // namespace tierd::daemon
