#include "daemon/tiers/hop.h"

#include <algorithm>
#include <memory>

#include "absl/synchronization/mutex.h"
#include "daemon/tiers/device/device.h"
#include "daemon/tiers/nvme/nvme_tier.h"

namespace tierd::daemon {
namespace {

void* Advance(void* address, uint64_t offset) {
  return address == nullptr ? nullptr : static_cast<char*>(address) + offset;
}

}  // namespace

HopJob Slice(const HopJob& job, uint64_t offset, uint64_t length) {
  HopJob piece = job;
  piece.from.offset += offset;
  piece.to.offset += offset;
  piece.from_address = Advance(job.from_address, offset);
  piece.to_address = Advance(job.to_address, offset);
  piece.size = length;
  return piece;
}

void Hop::CopyInPieces(const HopJob& job, uint64_t /*piece*/, OnPiece on_piece, Done done) {
  Copy(job, [size = job.size, on_piece = std::move(on_piece), done = std::move(done)](
                absl::Status s, uint64_t checksum) {
    if (s.ok() && on_piece) on_piece(0, size);
    done(std::move(s), checksum);
  });
}

void CopyAlong(Hop* first, const HopJob& first_job, Hop* second, const HopJob& second_job,
               uint64_t piece, Hop::Done done) {
  struct Pipeline {
    explicit Pipeline(Hop::Done d) : done(std::move(d)) {}
    absl::Mutex mu;
    size_t pending ABSL_GUARDED_BY(mu) = 0;  // pieces on the second hop
    bool first_done ABSL_GUARDED_BY(mu) = false;
    bool settled ABSL_GUARDED_BY(mu) = false;  // the last piece and the first hop's end race
    absl::Status status ABSL_GUARDED_BY(mu);
    uint64_t checksum ABSL_GUARDED_BY(mu) = 0;
    Hop::Done done;

    void FinishIfDone() {
      absl::Status s;
      uint64_t c = 0;
      {
        absl::MutexLock lock(&mu);
        if (!first_done || pending > 0 || settled) return;
        settled = true;
        s = status;
        c = checksum;
      }
      done(std::move(s), c);
    }
    void Fail(const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      if (status.ok() && !s.ok()) status = s;
    }
  };
  auto pipe = std::make_shared<Pipeline>(std::move(done));
  first->CopyInPieces(
      first_job, piece,
      [pipe, second, second_job](uint64_t offset, uint64_t length) {
        // The last piece may run past the chunk to the first tier's block.
        length = std::min(length, second_job.size - std::min(second_job.size, offset));
        if (length == 0) return;
        {
          absl::MutexLock lock(&pipe->mu);
          ++pipe->pending;
        }
        second->Copy(Slice(second_job, offset, length), [pipe](absl::Status s, uint64_t) {
          {
            absl::MutexLock lock(&pipe->mu);
            --pipe->pending;
            pipe->Fail(s);
          }
          pipe->FinishIfDone();
        });
      },
      [pipe](absl::Status s, uint64_t checksum) {
        {
          absl::MutexLock lock(&pipe->mu);
          pipe->first_done = true;
          pipe->checksum = checksum;
          pipe->Fail(s);
        }
        pipe->FinishIfDone();
      });
}

Tiers NodeTiers(Tier* host, NvmeTier* nvme, Tier* device_pool, Device* device) {
  Tiers t;
  t.tier[TierKind::kHost] = host;
  if (nvme != nullptr) {
    t.tier[TierKind::kNvme] = nvme;
    for (Path p : {Path::kNvmeToHost, Path::kHostToNvme}) t.hop[p] = nvme->hop(p);
    t.index = nvme;
  }
  if (device_pool != nullptr && device != nullptr) {
    t.tier[TierKind::kDevice] = device_pool;
    for (Path p : {Path::kHostToDevice, Path::kDeviceToHost}) {
      t.hop[p] = device->hop(p);
    }
  }
  return t;
}

}  // namespace tierd::daemon
