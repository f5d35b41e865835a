// The NVMe tier: one or more regions striped into one volume (RAID-0 with a configurable stripe
// unit), an extent allocator over the volume, the io_uring engine that moves chunks between the
// host tier's pinned segments and the regions without a bounce buffer, XXH3 checksums on every
// chunk, and the index of persistent chunks.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/io/io_engine.h"
#include "daemon/io/work_queue.h"
#include "daemon/tiers/extent_allocator.h"
#include "daemon/tiers/hop.h"
#include "daemon/tiers/nvme/nvme_index.h"
#include "daemon/tiers/nvme/nvme_region.h"
#include "daemon/tiers/segment_pool.h"
#include "daemon/tiers/tier.h"

namespace tierd::daemon {

struct NvmeOptions {
  std::vector<RegionSpec> regions;
  uint64_t stripe_unit = 1 << 20;
  uint64_t io_size = 1 << 20;  // at most stripe_unit
  uint32_t queue_depth = 32;
  bool sqpoll = false;
  // The index of persistent chunks (fixed when the regions are formatted); 0: sized for the
  // regions, so that it can never fill before their space does (see persistent_granule).
  uint64_t index_size = 0;
  bool reformat = false;  // format the regions even if they hold another set's data
  IoBackendKind io_backend = IoBackendKind::kAuto;
  // Tests: wraps the io_uring backend (fault injection). Null in production.
  std::function<std::unique_ptr<IoBackend>(std::unique_ptr<IoBackend>)> wrap_backend;
};

struct RegionStatus {
  std::string path;
  uint64_t capacity_bytes = 0;  // data area
  uint64_t used_bytes = 0;
  uint32_t block_size = 0;
};

using InstanceId = std::array<uint8_t, 16>;

class NvmeTier final : public Tier, public PersistentIndex {
 public:
  // Opens and locks the regions; formats them when all are blank (or `reformat`); refuses a region
  // listed twice or locked by another process, and regions of another instance, another set,
  // another format or another stripe unit, saying which and why. With a `state_dir`, the set this
  // instance formatted is recorded there (nvme_regions), and a region of it that is missing or
  // blank is refused rather than formatted anew: its persistent chunks would silently vanish.
  static absl::StatusOr<std::unique_ptr<NvmeTier>> Open(const NvmeOptions& options,
                                                        const InstanceId& instance,
                                                        SegmentPool* host,
                                                        const std::string& state_dir = "");
  // Waits for every transfer in flight.
  ~NvmeTier() override;

  TierKind kind() const override { return TierKind::kNvme; }
  // A chunk reaches NVMe through the host tier: no larger than a host segment.
  uint64_t max_reservation() const override {
    return std::min(capacity_, host_->max_reservation());
  }
  absl::StatusOr<Placement> Reserve(uint32_t tenant, uint64_t size) override;
  void Unreserve(const Placement& placement) override;
  TierUsage Usage() const override;
  std::string Describe() const override;

  bool Claim(const Placement& placement) override;
  // Persistent chunks found in the index at start-up.
  std::vector<IndexEntry> RecoveredEntries() const;

  using StatusCallback = std::function<void(absl::Status)>;
  // The index of persistent chunks (PersistentIndex): records a chunk durably / removes it.
  void Persist(IndexEntry entry, StatusCallback done) override;
  void Forget(uint32_t tenant, std::string name) override;
  // The tier's hop on `path`: reads into host memory and writes from it (then records the job's
  // index entry); null on the GPU's paths. The tier's chunk I/O goes through these.
  Hop* hop(Path path) {
    if (path == Path::kNvmeToHost) return &read_hop_;
    if (path == Path::kHostToNvme) return &write_hop_;
    return nullptr;
  }
  // Waits until every request made so far has called back.
  void Drain();

  std::vector<RegionStatus> Regions() const;
  uint64_t stripe_unit() const { return stripe_unit_; }
  uint64_t io_size() const { return engine_->io_size(); }
  uint32_t queue_depth() const { return engine_->queue_depth(); }
  uint32_t block_size() const { return block_; }
  IoEngineStats stats() const { return engine_->stats(); }
  // The least NVMe space a persistent chunk takes: the volume over the live records the index can
  // hold with room to spare for its log, so that persistent chunks run out of space (and their
  // owners into their quotas) before the index runs out of records, however small they are.
  uint64_t persistent_granule() const override { return persistent_granule_; }
  size_t index_records() const { return index_records_; }
  // Chunk reads whose bytes failed their checksum (refused with DATA_LOSS), since start-up.
  uint64_t checksum_failures() const { return checksum_failures_.load(std::memory_order_relaxed); }
  IoBackend* backend() const { return engine_->backend(); }
  // io_uring, or the threads it fell back to (or was told to use).
  IoBackendKind io_backend() const { return io_backend_; }

 private:
  class ReadHop final : public Hop {
   public:
    explicit ReadHop(NvmeTier* tier) : tier_(tier) {}
    void Copy(const HopJob& job, Done done) override;
    void CopyInPieces(const HopJob& job, uint64_t piece, OnPiece on_piece, Done done) override;

   private:
    NvmeTier* const tier_;
  };
  class WriteHop final : public Hop {
   public:
    explicit WriteHop(NvmeTier* tier) : tier_(tier) {}
    void Copy(const HopJob& job, Done done) override;

   private:
    NvmeTier* const tier_;
  };

  NvmeTier() = default;

  // The hops' I/O.
  //
  // Writes `size` bytes of the host copy at `host` to `nvme`, then, if `durable`, makes them
  // durable (a flush shared with the writes finished meanwhile); calls back (not on the caller's
  // thread) with the chunk's checksum. A scratch chunk's copy need not survive a power loss (the
  // chunk does not outlive the daemon), so it skips the flush.
  // `order` places its I/O in the engine's queue (deadline, session, weight).
  void Write(uint64_t chunk_id, const Placement& host, const Placement& nvme, uint64_t size,
             std::function<void(absl::StatusOr<uint64_t>)> done, IoOrder order = {},
             bool durable = true);
  // Reads `size` bytes from `nvme` into the host copy at `host` and verifies `checksum`;
  // DATA_LOSS, naming the chunk, on a mismatch.
  void Read(uint64_t chunk_id, const Placement& host, const Placement& nvme, uint64_t size,
            uint64_t checksum, StatusCallback done, IoOrder order = {});
  // Read, in pieces of `piece` bytes issued as separate jobs: `on_piece(offset, length)` runs as
  // each piece lands (on the engine thread; it must not block; may be null), so that the next stage
  // (a copy to the GPU) can start while later pieces are still read. `done` follows the whole
  // chunk's checksum.
  void ReadPieces(uint64_t chunk_id, const Placement& host, const Placement& nvme, uint64_t size,
                  uint64_t checksum, uint64_t piece,
                  std::function<void(uint64_t offset, uint64_t length)> on_piece,
                  StatusCallback done, IoOrder order = {});
  // Fills a host copy with zeros (a chunk whose NVMe space was never written reads as zeros).
  void ZeroFill(const Placement& host, uint64_t size, StatusCallback done);
  // The spans that move the logical range [offset, offset+length) to or from `buffer`.
  std::vector<IoSpan> Spans(IoKind kind, uint64_t offset, uint64_t length, char* buffer,
                            int32_t buffer_index) const;
  void AddRegionUse(uint64_t offset, uint64_t length, int64_t sign)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int32_t BufferIndex(uint32_t segment) const;
  // Group commit: calls `done` after an fdatasync of every region that started after this call.
  // Writes that finish while a sync runs share the next one.
  void SyncAfterWrite(StatusCallback done);
  // Requests in flight, for Drain.
  void Begin();
  void End();
  void StartSync() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sync_mu_);

  std::vector<std::unique_ptr<NvmeRegion>> regions_;
  uint64_t stripe_unit_ = 0;
  uint64_t data_offset_ = 0;
  uint64_t region_data_bytes_ = 0;
  uint64_t capacity_ = 0;
  uint32_t block_ = 4096;
  uint64_t alignment_ = 4096;
  uint64_t persistent_granule_ = 4096;
  IoBackendKind io_backend_ = IoBackendKind::kUring;
  size_t index_records_ = 0;
  SegmentPool* host_ = nullptr;
  int observer_ = 0;  // our remap observer on the host pool

  mutable absl::Mutex mu_;
  std::unique_ptr<ExtentAllocator> space_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> region_used_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> registered_ ABSL_GUARDED_BY(mu_);  // host segment registered as a buffer

  absl::Mutex ops_mu_;
  int64_t ops_in_flight_ ABSL_GUARDED_BY(ops_mu_) = 0;
  absl::Mutex sync_mu_;
  bool sync_in_flight_ ABSL_GUARDED_BY(sync_mu_) = false;
  std::vector<StatusCallback> waiting_for_sync_ ABSL_GUARDED_BY(sync_mu_);

  std::unique_ptr<NvmeIndex> index_;  // worker thread only (and Open)
  std::vector<IndexEntry> recovered_;
  std::unique_ptr<IoEngine> engine_;
  std::unique_ptr<WorkQueue> worker_;  // checksums, index commits, callbacks
  std::atomic<uint64_t> checksum_failures_{0};
  ReadHop read_hop_{this};
  WriteHop write_hop_{this};
};

// The node's tierd instance id, kept in `state_dir`/instance_id (created on first start).
absl::StatusOr<InstanceId> LoadOrCreateInstanceId(const std::string& state_dir);
std::string InstanceIdHex(const InstanceId& id);

}  // namespace tierd::daemon
