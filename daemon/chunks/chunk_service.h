// The daemon's chunk operations, independent of the RPC layer: every batch is validated as a whole
// before anything changes, so a failed request leaves the daemon as it was.
//
// Concurrency: one mutex serializes the chunk table. A batch takes it once, which makes batches
// atomic with respect to each other and costs ~100 ns per chunk (docs/benchmarks.md); tier
// reservations take the tier's own lock inside it (lock order: ChunkService, then tier).
//
// The coordinator of the chunk layer: it validates a batch, takes the lock and calls the parts
// below it, which never call back but through the Mover's one word up (a move settled):
//   RoomMaker (room made by writing copies down), Schedules and PlanRound (the planner's rounds)
//   -> Mover (moves over routes of hops; settles under this lock), NodeReport (listings and
//      figures), SharedBases (the bases' rules; this class makes and retires their chunks)
//   -> Space (reservations against tier and quota), WaitList (requests waiting on chunks),
//      SessionLedger (per-session state, leases, figures), ChunkTable, TenantLedger, PathMeter
//      (the paths' bandwidth, under a lock of its own).
// All but the PathMeter are kept under this class's lock (docs/architecture.md, "chunks/").
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/completion_page.h"
#include "daemon/chunks/chunk.h"
#include "daemon/chunks/chunk_table.h"
#include "daemon/chunks/mover.h"
#include "daemon/chunks/node_report.h"
#include "daemon/chunks/path_meter.h"
#include "daemon/chunks/plan_round.h"
#include "daemon/chunks/requests.h"
#include "daemon/chunks/room_maker.h"
#include "daemon/chunks/schedules.h"
#include "daemon/chunks/session.h"
#include "daemon/chunks/session_ledger.h"
#include "daemon/chunks/shared_bases.h"
#include "daemon/chunks/space.h"
#include "daemon/chunks/tenant_ledger.h"
#include "daemon/chunks/wait_list.h"
#include "daemon/io/io_engine.h"
#include "daemon/planner/planner.h"
#include "daemon/tiers/hop.h"
#include "daemon/tiers/nvme/nvme_index.h"
#include "daemon/tiers/tier.h"
#include "daemon/util/clock.h"
#include "daemon/util/metrics.h"

namespace tierd::daemon {

struct Batch;

class ChunkService : private Mover::Listener {
 public:
  // `tiers`: the tiers by kind, the hops between them and the index of persistent chunks, null
  // where the node has none (NodeTiers assembles them); the host tier must exist.
  // `clock` is what step times, stalls and move durations are measured with.
  explicit ChunkService(const Tiers& tiers, const Clock& clock = Clock::Real());
  // Waits (WaitForIdle) until the tiers have let go of every callback handed to them: the last
  // one's release touches the service. REQUIRES: the tiers outlive the service and run what they
  // were handed.
  ~ChunkService() override;
  ChunkService(const ChunkService&) = delete;
  ChunkService& operator=(const ChunkService&) = delete;

  // Re-creates the persistent chunks found in the NVMe index at start-up (detached, resident on
  // NVMe). Returns how many were recovered; those whose current version was in memory when the
  // daemon stopped without WriteDownForStop are re-created lost (opening them is DATA_LOSS).
  size_t Recover(const std::vector<IndexEntry>& entries);
  // A clean stop, after every session has ended: writes each persistent chunk whose current
  // version is only in memory to NVMe (durably, in the index) and waits for it. Without an NVMe
  // tier it says what is lost. Returns how many could not be written.
  size_t WriteDownForStop();
  // Waits until every operation the service handed to a tier (NVMe I/O, index records, device
  // copies) has called back and let its callback go. With no session left to start more, nothing
  // calls into the service afterwards: the daemon's shutdown can destroy it. Runs without mu_,
  // which the last callbacks take: it touches only the Mover's count of them.
  void WaitForIdle() ABSL_LOCKS_EXCLUDED(mu_) ABSL_NO_THREAD_SAFETY_ANALYSIS;

  absl::StatusOr<std::vector<ChunkId>> Allocate(const Session& session,
                                                std::span<const ChunkRequest> requests);
  absl::Status Free(const Session& session, std::span<const ChunkId> ids);
  // Pins the chunks in `tier`. Chunks not there yet are brought in (or, on their way, waited
  // for): the locations are final at once, and `ready` completes when the last one has arrived.
  // Where the tier has no room now but will (write-downs under way, or copies other sessions
  // hold pinned and will release), it waits, the lock released, counted as a stall, until a
  // tenth of the time to `deadline` (the caller's RPC deadline; at most a second) before it, so
  // that the refusal saying why reaches the caller, and at most a minute; what cannot fit beside
  // the session's own pins is refused at once. At most kMaxWaitingAcquires of a session wait at a
  // time.
  absl::StatusOr<AcquireResult> Acquire(const Session& session, std::span<const ChunkId> ids,
                                        TierKind tier, Access access,
                                        absl::Time deadline = absl::InfiniteFuture());
  static constexpr uint32_t kMaxWaitingAcquires = 4;
  absl::Status Release(const Session& session, std::span<const ChunkId> ids);
  // Brings the chunks into `tier` without pinning them. Their reads are due `priority` units
  // before now (see PrefetchDeadline): the session's I/O is served by deadline, so a negative
  // priority lets I/O asked for later, such as write-backs, go first.
  absl::StatusOr<SlotToken> Prefetch(const Session& session, std::span<const ChunkId> ids,
                                     TierKind tier, int priority);
  absl::StatusOr<SlotToken> Evict(const Session& session, std::span<const ChunkId> ids,
                                  TierKind tier, bool keep_source = false);
  // The caller's word that the chunks' contents are dead until it next writes them (a buffer
  // about to be overwritten): their copies go without being written (DiscardContents), at once
  // where nobody has them acquired, else when their tier needs the room. A chunk on its way
  // somewhere is left as it is. Refused, and nothing discarded, for a chunk acquired for write, a
  // persistent one (kept until freed, across sessions) or a shared base's (read-only).
  absl::Status Discard(const Session& session, std::span<const ChunkId> ids);
  absl::StatusOr<std::vector<ChunkMeta>> Stat(const Session& session, std::span<const ChunkId> ids);
  // The session's chunks and its tenant's persistent chunks with id >= page_token, by id.
  ChunkPage List(const Session& session, ChunkId page_token, uint32_t page_size) const;

  // The session ended: drops its pins, frees its non-persistent chunks and detaches its persistent
  // ones. Returns the number of chunks freed.
  size_t CloseSession(const Session& session);

  // --- Shared bases (shared_bases.h; docs/streaming.md, "One copy per node"). ---
  // Opens the base `name` (it must be sealed, and shared with the session), holding it until
  // ReleaseBase or the session's end. When there is none and `create` is given, makes it, empty,
  // for this session to fill and seal; a base that exists with other chunk sizes or another
  // descriptor than `create` says is ALREADY_EXISTS, one still being loaded UNAVAILABLE.
  absl::StatusOr<OpenedBase> OpenBase(const Session& session, absl::string_view name,
                                      const BaseRequest* create);
  // The loader is done: nobody writes the base from now on, and its descriptor is `descriptor`
  // unless that is empty. FAILED_PRECONDITION while the loader still holds a chunk of it acquired
  // for writing.
  absl::Status SealBase(const Session& session, absl::string_view name,
                        std::string descriptor = "");
  // Drops the session's hold (the loader's, before sealing: the base is abandoned). The base goes
  // when nobody holds it and it is not pinned. FAILED_PRECONDITION while the session has a chunk
  // of it acquired.
  absl::Status ReleaseBase(const Session& session, absl::string_view name);
  // Keeps a sealed base without holders (its creator or an operator), or lets it go.
  absl::Status PinBase(const Session& session, absl::string_view name, bool pinned);
  // The bases the session may open (operators: every one), by name.
  std::vector<BaseStatus> ListBases(const Session& session) const;
  // For the session socket: whether the session may map a segment of `owner` (a base's segments,
  // kFirstBaseOwner up), and whether for writing (the loader, before sealing). PERMISSION_DENIED
  // when it holds no such base.
  absl::StatusOr<bool> MayMapBaseSegment(const Session& session, uint32_t owner) const;
  // The operator's groups that bases may be shared with (daemon.base_groups).
  void set_base_groups(std::vector<uint32_t> gids) {
    absl::MutexLock lock(&mu_);
    bases_.set_share_groups(std::move(gids));
  }

  // --- Imports (daemon/api/importer.h reads the files). ---
  // The host memory of a chunk that the session holds acquired for writing in the host tier (its
  // data there), for the daemon to write: held by one more write pin in the session's name until
  // EndImport, so that the chunk is neither moved, copied nor freed meanwhile, whatever the client
  // releases. FAILED_PRECONDITION when the session does not hold it so.
  absl::StatusOr<std::span<char>> BeginImport(const Session& session, ChunkId id);
  // Drops BeginImport's pin. REQUIRES: the session has not ended since (its end drops it).
  void EndImport(const Session& session, ChunkId id);

  SessionStats session_stats(const Session& session) const;
  PathArray<PathStatus> path_status() const { return meter_.Status(); }
  // The start-up probe's figures (0: not probed) become the bandwidth estimates.
  void SeedBandwidth(const PathArray<double>& bytes_per_second) { meter_.Seed(bytes_per_second); }

  // Declares, replaces or (with no steps) clears the session's schedule. Every chunk it names must
  // be one the session may use (NOT_FOUND, PERMISSION_DENIED), in the host or device tier.
  absl::Status SetSchedule(const Session& session, ScheduleRequest request);
  // The session's share of NVMe bandwidth against other sessions' (1 .. max_bandwidth_weight).
  absl::Status SetBandwidthWeight(const Session& session, uint32_t weight);

  // --- Operators' requests (root, or the daemon's own user): PERMISSION_DENIED for others. ---
  // Moves the chunks' copies out of `tier` (device: to the host; host: to NVMe), whichever session
  // owns them; every chunk with a copy there when `ids` is empty. Chunks acquired now are left.
  absl::StatusOr<DrainResult> Drain(const Session& session, TierKind tier,
                                    std::span<const ChunkId> ids);
  // Every chunk on the node with id >= page_token, by id.
  absl::StatusOr<ChunkPage> ListAll(const Session& session, ChunkId page_token,
                                    uint32_t page_size) const;
  // What each open session holds, by session id.
  std::map<SessionId, SessionHoldings> Holdings() const;
  // Bytes moved on each path of chunks held by sessions of each declared job, since the job's
  // first session here did anything; a job is forgotten when its last session ends.
  std::map<std::string, PathArray<uint64_t>> JobTraffic() const;
  void set_max_bandwidth_weight(uint32_t max) {
    absl::MutexLock lock(&mu_);
    max_weight_ = max;
  }
  // What one user or session may hold (daemon/chunks/limits.h). Before any session opens.
  void set_limits(const Limits& limits, const Quotas& quotas) {
    absl::MutexLock lock(&mu_);
    ledger_.Configure(limits, quotas);
  }
  // What each user holds, against its limits and quotas.
  std::map<uint32_t, TenantUsage> tenant_usage() const {
    absl::MutexLock lock(&mu_);
    return ledger_.Usage();
  }
  TenantUsage tenant_usage(uint32_t uid) const {
    absl::MutexLock lock(&mu_);
    return ledger_.UsageOf(uid);
  }
  Limits limits() const {
    absl::MutexLock lock(&mu_);
    return ledger_.limits();
  }
  Quotas quotas() const {
    absl::MutexLock lock(&mu_);
    return ledger_.quotas();
  }
  // One planning round: reads the scheduled sessions' cursors, updates their step times, plans
  // (daemon/planner/planner.h, without holding the service's lock) and starts the moves that still
  // make sense. Returns how many it started.
  size_t RunPlanningRound(absl::Time now);
  size_t chunk_count() const;
  NodeStats node_stats() const;
  // How long each move took, start to settle, by path (the daemon's transfer latency).
  prometheus::ClientMetric transfer_seconds(Path path) const {
    return meter_.transfer_seconds(path);
  }
  // How long acquisitions whose chunk was not in place waited for it to arrive, by tier.
  prometheus::ClientMetric acquire_wait_seconds(TierKind tier) const {
    return acquire_wait_seconds_[tier].Collect();
  }
  Tier* tier(TierKind kind) const { return tiers_.tier[kind]; }

 private:
  // Resolves `ids` to chunks the session may use, rejecting duplicates, unknown ids and foreign
  // chunks. The pointers stay valid while mu_ is held.
  absl::StatusOr<std::vector<ChunkMeta*>> Resolve(const Session& session,
                                                  std::span<const ChunkId> ids)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckTier(TierKind tier, absl::string_view what) const;
  // REQUIRES: no move of the chunk is in flight (see Retire).
  void Destroy(ChunkMeta& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Retires the chunks of bases that went, and wakes what waits for their room.
  void RetireBaseChunks(std::span<const ChunkId> ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Creates a chunk resident in its home tier at `home` and indexes its name; the caller records
  // a scratch chunk in its session's state.
  ChunkMeta& Insert(uint32_t tenant, SessionId owner, uint64_t size, const Placement& home,
                    const std::string& name, bool persistent) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Why Evict cannot move the chunk down to `tier` now (OK for a chunk that is moving: it waits).
  absl::Status CheckEvictable(const ChunkMeta& chunk, TierKind tier) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves a settled chunk down to `tier` for `batch`, dropping the copies above unless
  // keep_source. REQUIRES: CheckEvictable(chunk, tier) is OK and the chunk is not moving.
  void EvictSettled(ChunkMeta& chunk, TierKind tier, bool keep_source,
                    const std::shared_ptr<Batch>& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same for a chunk that may be moving: then it is evicted once its move settles.
  // REQUIRES: CheckEvictable(chunk, tier) is OK.
  void EvictOne(ChunkMeta& chunk, TierKind tier, bool keep_source,
                const std::shared_ptr<Batch>& batch, SessionId session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why Acquire cannot pin the chunk in `tier` with a final location now: it is on its way to
  // another tier where it has no copy, or it cannot be fetched.
  absl::Status CheckAcquirable(const ChunkMeta& chunk, TierKind tier) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Has `batch` follow the chunk into `tier`: nothing when it is there and ready, a wait when it
  // is moving, a fetch otherwise. With `pin`, applies the access once it is there.
  // A fetch it starts is due at `deadline` (an Acquire's: now).
  void BringIn(ChunkMeta& chunk, TierKind tier, const std::shared_ptr<Batch>& batch,
               SessionId session, std::optional<Access> pin, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts bringing a ready chunk into `tier`, or says why it cannot start (no space). Its NVMe
  // I/O is queued by `deadline` (when the chunk is needed: now, for a request that waits).
  absl::Status StartFetch(ChunkMeta& chunk, TierKind tier, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Mover::Listener, called by mover_ with mu_ held.
  // Counts the move's bytes as the holder's traffic (a scratch chunk's session, a persistent
  // one's first lease, and the session's job) and a fetch as a use; wakes those waiting for room
  // and serves (or, for a doomed chunk, fails) the requests waiting for the chunk; a doomed chunk
  // is destroyed once no move of it is left.
  void MoveSettled(ChunkMeta& chunk, const Mover::Settlement& settled) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A move of the chunk settled with `moved`: serves the requests waiting for it (fetching again
  // for those whose tier it did not fill). REQUIRES: the chunk is not doomed.
  void WakeWaiters(ChunkMeta& chunk, const absl::Status& moved) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Where the chunk's NVMe I/O goes in the engine's queue: its owner's flow and weight.
  IoOrder OrderFor(const ChunkMeta& chunk, absl::Time deadline) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A chunk's life ends by Retire (Free, which refuses a pinned chunk, or its session's end):
  // destroyed now when no move is in flight, else marked doomed, and AfterMove destroys it when
  // the last move settles. Nothing starts a
  // move of a doomed chunk (the Mover refuses), and its waiters fail instead of being served.
  void Retire(ChunkMeta& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The end of every move, once its effect on the chunk is applied: serves (or, for a doomed
  // chunk, fails) the requests waiting for it, destroys a doomed chunk, and retries the fetches
  // queued for room.
  void AfterMove(ChunkMeta& chunk, const absl::Status& moved) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An acquisition's access takes effect (its data is there): a write makes that copy the only
  // valid one and, until released, keeps copies from being made of the chunk. A write to a chunk
  // at home in memory that the index calls durable makes `batch` wait for the Mover's Mark.
  void Apply(ChunkMeta& chunk, TierKind tier, Access access, SessionId session,
             const std::shared_ptr<Batch>& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A persistent chunk at home in memory whose index record does not yet say that its current
  // version is in memory.
  bool NeedsMark(const ChunkMeta& chunk) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return chunk.persistent && chunk.memory_home && !chunk.marked && !chunk.lost &&
           tiers_.index != nullptr;
  }
  absl::StatusOr<std::shared_ptr<Batch>> NewBatch(const Session& session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The hop on `path`, or null where the node has none.
  Hop* hop(Path path) const { return tiers_.hop[path]; }

  const Tiers tiers_;
  const Clock& clock_;
  mutable absl::Mutex mu_;
  uint64_t use_clock_ ABSL_GUARDED_BY(mu_) = 0;
  ChunkTable chunks_ ABSL_GUARDED_BY(mu_);
  SessionLedger sessions_ ABSL_GUARDED_BY(mu_);
  WaitList waiters_ ABSL_GUARDED_BY(mu_);
  PathMeter meter_;  // thread-safe; its lock is taken after mu_
  // 10 us to 21 s, doubling.
  TierArray<prometheus::Histogram> acquire_wait_seconds_ =
      TierArray<prometheus::Histogram>::Generate(
          [] { return prometheus::Histogram(metrics::ExponentialBuckets(1e-5, 2, 22)); });
  absl::CondVar room_freed_;  // a move settled, or pins or chunks went
  uint32_t max_weight_ ABSL_GUARDED_BY(mu_) = 16;
  TenantLedger ledger_ ABSL_GUARDED_BY(mu_);
  // Space in the tiers (over chunks_ and ledger_), and room made on demand by moving copies down.
  Space space_ ABSL_GUARDED_BY(mu_);
  SharedBases bases_ ABSL_GUARDED_BY(mu_);
  // Listings and figures, read under the lock.
  const NodeReport report_ ABSL_GUARDED_BY(mu_);
  RoomMaker room_ ABSL_GUARDED_BY(mu_);
  // The sessions' schedules and traces, and the planner's input they make.
  Schedules schedules_ ABSL_GUARDED_BY(mu_);
  // The halves of a planning round that run under the lock.
  PlanRound round_ ABSL_GUARDED_BY(mu_);
  // The moves, which borrow mu_ and settle under it (WaitForIdle alone runs without it).
  // Declared last: destroyed first, once the last callback handed to a hop has let go.
  Mover mover_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierd::daemon
