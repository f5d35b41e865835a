// The tierd client library (C++ API). A Client holds one session with the node's tierd daemon:
// the session socket (its life is the session's), the gRPC channel, the completion page and the
// host segments it has mapped. Chunks are named by 64-bit ids; every operation takes a batch.
//
// Thread safety: a Client may be used from many threads at once.
// Lifetime: Completion, Acquisition and ChunkSet hold a pointer to their Client and must be
// destroyed (or released) before it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tierd {

using ChunkId = uint64_t;

enum class Tier : int { kHost = 1, kNvme = 2, kDevice = 3 };
// The tier's name, as the daemon's configuration, metrics and tierctl spell it: "host", "nvme",
// "device" ("?" for a value that is none of them).
const char* TierName(Tier tier);
// The tier of that name; nullopt for any other.
std::optional<Tier> ParseTier(std::string_view name);
// kOverwrite: every byte is written before any is read (gradients, activations, an optimizer's
// output). The old contents are not fetched, so the acquired bytes are undefined until written.
enum class AccessMode : int { kRead = 1, kWrite = 2, kOverwrite = 3 };

struct ClientOptions {
  // Directory holding tierd.sock and tierd.session.sock. Empty: $TIERD_SOCKET_DIR, else /run/tierd.
  std::string socket_dir;
  // Shown in the daemon's logs.
  std::string client_name;
  // The job this session belongs to: tierctl status and the daemon's metrics attribute its chunks
  // and traffic to it (1 to 63 of letters, digits and "._:/-"). Empty: $TIERD_JOB, else none.
  std::string job;
  // Deadline of each RPC.
  absl::Duration rpc_timeout = absl::Seconds(60);
  // Once this process uses the daemon's GPU through the client (device-tier chunks, StreamWait,
  // CudaDevice), register the host segments it maps with CUDA (page-locked and mapped for the
  // device, as cudaHostRegister does), so that its own copies between host-tier chunks and the GPU
  // run at full PCIe speed. Registering takes time once per segment (milliseconds per GiB).
  bool cuda_register_host = true;
};

struct ChunkSpec {
  uint64_t size = 0;
  Tier home = Tier::kHost;
  std::string name;         // optional; required when persistent
  bool persistent = false;  // outlives the session; belongs to the user (uid)
  std::vector<std::string> tags;
  bool open_existing = false;  // open the user's persistent chunk of this name if it exists
  bool must_exist = false;     // with open_existing: open only (NOT_FOUND when there is none)
  // This session holds a lease on the persistent chunks it creates or opens until it ends; another
  // session can open (or free) them only when both set shared.
  bool shared = false;
  // Its contents are wanted briefly (a step's gradients): the daemon writes its copies down only
  // when their tier needs the room, never early while a path is idle. Not with persistent.
  bool transient = false;
};

struct ChunkInfo {
  ChunkId id = 0;
  uint64_t size = 0;
  std::string name;
  bool persistent = false;
  std::vector<std::string> tags;
  Tier home = Tier::kHost;
  std::vector<Tier> resident;
  std::vector<Tier> dirty;
  bool moving = false;
  uint32_t pins = 0;
  uint64_t owner_session = 0;
  bool lost = false;       // lost in a daemon crash (see ChunkInfo.lost in the protocol)
  bool transient = false;  // allocated transient (ChunkSpec::transient)
  // The space each tier holds for it (ChunkInfo.space in the protocol): once nothing moves, a
  // tier's used_bytes is the sum of these over its chunks.
  std::vector<std::pair<Tier, uint64_t>> space;
  std::string base;  // the shared base it belongs to (ListChunks with all_sessions)
};

struct RegionStatus {
  std::string path;
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint32_t block_size = 0;
};

struct TierStatus {
  Tier tier = Tier::kHost;
  bool configured = false;
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t free_bytes = 0;
  uint64_t largest_free_bytes = 0;
  std::string detail;
  std::vector<RegionStatus> regions;      // NVMe tier
  std::string io_backend;                 // NVMe tier: io_uring, or threads (pread/pwrite)
  uint64_t persistent_granule_bytes = 0;  // NVMe tier: the least a persistent chunk takes
  // Host and device tiers: the size of each segment, also the largest chunk; a chunk never spans
  // two (0 from a daemon that does not say).
  uint64_t segment_bytes = 0;
};

// A way chunk bytes move between tiers, since the daemon started.
struct PathStatus {
  std::string name;  // nvme_to_host, host_to_nvme, host_to_device, device_to_host
  uint64_t bytes = 0;
  uint64_t moves = 0;
  double bytes_per_second = 0;  // the daemon's estimate (measured when `measured`)
  bool measured = false;
  double probed_bytes_per_second = 0;  // the daemon's start-up probe (0: not probed)
};

// A session open on the node (listed for operators only).
struct SessionSummary {
  uint64_t id = 0;
  std::string client_name;
  uint32_t uid = 0;
  uint32_t pid = 0;
  absl::Time opened;
  uint64_t chunks = 0;  // owned (or opened persistent)
  uint64_t bytes = 0;
  uint64_t pinned_chunks = 0;
  std::string job;           // declared by the session (ClientOptions::job); empty: none
  uint64_t moved_bytes = 0;  // its chunks' bytes moved between tiers while it held them
};

// One user's holdings against its quotas and limits (the caller's own, or every user's for an
// operator).
struct TenantStatus {
  struct TierUse {
    Tier tier = Tier::kHost;
    uint64_t used_bytes = 0;
    uint64_t quota_bytes = 0;  // 0: no quota
  };
  uint32_t uid = 0;
  std::string user;  // when the daemon's quota config names it
  uint32_t sessions = 0;
  uint64_t chunks = 0;
  uint64_t schedule_accesses = 0;
  std::vector<TierUse> tiers;
  std::vector<std::pair<std::string, uint64_t>> refusals;  // limit key, requests refused
};

// The daemon's per-user and per-session limits ([limits] in its config).
struct LimitsStatus {
  uint32_t connections_per_uid = 0;
  uint32_t sessions_per_uid = 0;
  uint64_t chunks_per_session = 0;
  uint64_t chunks_per_uid = 0;
  uint64_t schedule_accesses_per_session = 0;
  uint64_t schedule_accesses_per_uid = 0;
  uint32_t trace_steps = 0;
};

struct NodeInfo {
  std::string hostname;
  std::string version;
  bool cuda = false;
  int64_t uptime_seconds = 0;
  std::vector<SessionSummary> session_list;  // asked for, by an operator
  std::vector<TierStatus> tiers;
  std::vector<std::string> devices;  // "GPU-uuid name (bytes)"
  std::string device_status;
  // The device the daemon serves, when it has a device tier.
  std::string device_uuid;
  bool device_emulated = false;
  uint64_t device_memory_bytes = 0;
  uint32_t sessions = 0;
  uint64_t chunks = 0;
  std::vector<PathStatus> paths;
  std::vector<TenantStatus> tenants;
  LimitsStatus limits;
  // What the daemon runs without because its machine does not allow it: (what, why), e.g.
  // ("nvme_io_threads", "io_uring is unavailable ..."). Empty when nothing is degraded.
  std::vector<std::pair<std::string, std::string>> fallbacks;

  const TierStatus* tier(Tier t) const;
  const PathStatus* path(std::string_view name) const;
};

// One chunk a schedule step acquires, where and how.
struct StepAccess {
  ChunkId id = 0;
  Tier tier = Tier::kHost;
  AccessMode mode = AccessMode::kRead;
  // A pair: the access is to `id` while version bit `version_bit` (SetVersion) is clear, to
  // `other` while it is set. 0: no pair.
  ChunkId other = 0;
  uint32_t version_bit = 0;
};
using ScheduleStep = std::vector<StepAccess>;

struct ScheduleOptions {
  // Bytes of each tier the planner may fill for this session (0: no limit but the tier's).
  uint64_t host_quota_bytes = 0;
  uint64_t device_quota_bytes = 0;
};

// What this session's acquisitions cost it, and what the planner did for it.
struct SessionStats {
  uint64_t acquired_ready = 0;   // chunks in place when acquired
  uint64_t acquired_waited = 0;  // chunks that had to be brought in or waited for
  absl::Duration host_stall;     // time acquisitions waited, by tier
  absl::Duration device_stall;
  uint64_t planner_fetches = 0;
  uint64_t planner_drops = 0;
  uint64_t planner_write_backs = 0;
  uint64_t cursor = 0;          // steps started, as the daemon last saw
  uint32_t schedule_steps = 0;  // steps of the schedule in force, declared or traced
  bool tracing = false;         // a trace is waiting for or recording its iteration
  uint32_t bandwidth_weight = 1;
};

// An asynchronous request's handle. Ready() and a Wait() on a completed request read shared
// memory only (no system call); a Wait() on a pending one sleeps on a futex.
// A shared base (docs/streaming.md, "One copy per node"): a named, read-only set of chunks one
// session loads and seals and every session its creator allows opens.
struct BaseChunkSpec {
  uint64_t size_bytes = 0;
  Tier home_tier = Tier::kHost;  // host or NVMe
};
struct BaseCreate {
  std::vector<BaseChunkSpec> chunks;
  std::string descriptor;  // what the chunks hold, as the loader says (compared byte for byte)
  std::optional<uint32_t> share_with_group;  // a gid the operator named in daemon.base_groups
  // The ranks of this session's job write it (their shared weights); needs a declared job.
  bool job_writable = false;
};
struct OpenedBase {
  bool created = false;  // this session made it: write the chunks, then SealBase
  std::vector<ChunkId> chunk_ids;
  std::vector<BaseChunkSpec> chunks;
  std::string descriptor;
  uint32_t creator_uid = 0;
};
struct BaseStatus {
  std::string name;
  uint32_t creator_uid = 0;
  std::optional<uint32_t> group;
  bool sealed = false, pinned = false;
  std::string job;  // a base its job's ranks write: the job
  uint64_t chunks = 0, bytes = 0;
  uint64_t host_bytes = 0, nvme_bytes = 0;  // with a copy in each tier
  std::vector<std::string> holders;
};

struct CompletionToken {
  uint32_t slot = 0;
  uint32_t sequence = 0;
};

// What a Drain started.
struct DrainStarted {
  CompletionToken done;
  uint64_t chunks = 0;  // chunks whose copies are moving out of the tier
  uint64_t bytes = 0;
  uint64_t pinned_chunks = 0;  // left in the tier: acquired by a session now
};

// A chunk pinned by Acquire: where its bytes are, in this process's address space.
struct AcquiredChunk {
  ChunkId id = 0;
  Tier tier = Tier::kHost;
  // Host tier: the chunk's bytes in the shared segment. Device tier: a device pointer on the
  // daemon's GPU (imported into this process), or with an emulated device, host memory.
  void* data = nullptr;
  uint64_t size = 0;            // bytes usable (the requested size rounded up to 4 KiB)
  bool host_accessible = true;  // false for real GPU memory
};

struct Acquired {
  std::vector<AcquiredChunk> chunks;  // in request order
  CompletionToken ready;              // the chunks may be used once this completes
};

class Client;

// Move-only; completes or abandons its token on destruction.
class Completion {
 public:
  Completion() = default;
  Completion(Client* client, CompletionToken token) : client_(client), token_(token) {}
  Completion(Completion&& other) noexcept;
  Completion& operator=(Completion&& other) noexcept;
  ~Completion();

  bool Ready() const;
  absl::Status Wait(absl::Duration timeout = absl::InfiniteDuration());
  // Orders work on a CUDA stream after this request (Client::StreamWait); the token stays
  // waitable on the host for its status.
  absl::Status StreamWait(uintptr_t stream);
  CompletionToken token() const { return token_; }

 private:
  Client* client_ = nullptr;
  CompletionToken token_;
  bool waited_ = false;
};

// Chunks pinned by Acquire; released (one batched RPC) on destruction.
class Acquisition {
 public:
  Acquisition() = default;
  Acquisition(Client* client, Acquired acquired);
  Acquisition(Acquisition&& other) noexcept;
  Acquisition& operator=(Acquisition&& other) noexcept;
  ~Acquisition();

  std::span<const AcquiredChunk> chunks() const { return chunks_; }
  const AcquiredChunk& operator[](size_t i) const { return chunks_[i]; }
  size_t size() const { return chunks_.size(); }
  bool Ready() const { return ready_.Ready(); }
  absl::Status Wait(absl::Duration timeout = absl::InfiniteDuration()) {
    return ready_.Wait(timeout);
  }
  // Work enqueued on `stream` after this call runs once the chunks are ready (no host wait).
  absl::Status StreamWait(uintptr_t stream) { return ready_.StreamWait(stream); }
  // Releases now and reports the outcome (the destructor can only log it).
  absl::Status Release();

 private:
  Client* client_ = nullptr;
  std::vector<AcquiredChunk> chunks_;
  Completion ready_;
};

// Chunks owned by this handle; freed (one batched RPC) on destruction unless detached.
class ChunkSet {
 public:
  ChunkSet() = default;
  ChunkSet(Client* client, std::vector<ChunkId> ids) : client_(client), ids_(std::move(ids)) {}
  ChunkSet(ChunkSet&& other) noexcept
      : client_(std::exchange(other.client_, nullptr)), ids_(std::exchange(other.ids_, {})) {}
  ChunkSet& operator=(ChunkSet&& other) noexcept;
  ~ChunkSet();

  std::span<const ChunkId> ids() const { return ids_; }
  ChunkId operator[](size_t i) const { return ids_[i]; }
  size_t size() const { return ids_.size(); }
  // Frees now and reports the outcome.
  absl::Status Free();
  // Gives up ownership: the chunks stay until freed by id (or the session ends, for scratch ones).
  std::vector<ChunkId> Detach() { return std::exchange(ids_, {}); }

 private:
  Client* client_ = nullptr;
  std::vector<ChunkId> ids_;
};

class Client {
 public:
  // Opens a session with the daemon. UNAVAILABLE (naming the socket) when no daemon listens.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options = {});
  // Ends the session: the daemon releases this session's pins and frees its scratch chunks.
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  uint64_t session_id() const;
  uint32_t uid() const;

  // --- batch operations on ids ---
  absl::StatusOr<std::vector<ChunkId>> AllocateIds(std::span<const ChunkSpec> specs);
  absl::Status Free(std::span<const ChunkId> ids);
  absl::StatusOr<Acquired> AcquireIds(std::span<const ChunkId> ids, Tier tier, AccessMode mode);
  absl::Status Release(std::span<const ChunkId> ids);
  // Brings chunks into `tier` without pinning them. `priority` orders this session's I/O: the
  // reads are due `priority` milliseconds before now (after, when negative), and the daemon serves
  // the session's reads and writes by when they are due.
  absl::StatusOr<CompletionToken> PrefetchIds(std::span<const ChunkId> ids, Tier tier,
                                              int priority = 0);
  // Moves chunks down to `tier` (writing them there durably if needed) and drops the copies above
  // it, unless keep_source.
  absl::StatusOr<CompletionToken> EvictIds(std::span<const ChunkId> ids, Tier tier,
                                           bool keep_source = false);
  // The chunks' contents are dead until this session next writes them (a buffer about to be
  // overwritten): the daemon drops their copies without writing them, at once where they are not
  // acquired, else when it needs the room. A chunk read before it is written again holds undefined
  // bytes. FAILED_PRECONDITION, nothing discarded, for one acquired for write, a persistent one or
  // a shared base's.
  absl::Status Discard(std::span<const ChunkId> ids);
  absl::StatusOr<std::vector<ChunkInfo>> Stat(std::span<const ChunkId> ids);
  // Every chunk this session can see (its own and its user's persistent ones), by id.
  // This session's chunks and its user's persistent ones; with all_sessions, every chunk on the
  // node (operators only: root or the daemon's user; PERMISSION_DENIED otherwise).
  absl::StatusOr<std::vector<ChunkInfo>> ListChunks(bool all_sessions = false);
  // With list_sessions, an operator's answer also lists the open sessions (it costs the daemon a
  // walk over every session's chunks).
  absl::StatusOr<NodeInfo> GetNodeInfo(bool list_sessions = false);
  // Operators only: moves the chunks' copies out of `tier` (device: to the host; host: to NVMe),
  // whichever session owns them; every chunk with a copy there when `ids` is empty. Chunks
  // acquired now stay and are counted. `done` completes when the moves started have settled.
  absl::StatusOr<DrainStarted> Drain(Tier tier, std::span<const ChunkId> ids = {});

  // --- RAII forms ---
  absl::StatusOr<ChunkSet> Allocate(std::span<const ChunkSpec> specs);
  absl::StatusOr<Acquisition> Acquire(std::span<const ChunkId> ids, Tier tier, AccessMode mode);
  absl::StatusOr<Completion> Prefetch(std::span<const ChunkId> ids, Tier tier, int priority = 0);
  absl::StatusOr<Completion> Evict(std::span<const ChunkId> ids, Tier tier,
                                   bool keep_source = false);

  // --- completions (no system call once complete) ---
  // OK when completed successfully, UNAVAILABLE while pending, or the request's error.
  absl::Status Poll(CompletionToken token) const;
  // Waits, then acknowledges the token (it cannot be waited on again).
  absl::Status Wait(CompletionToken token, absl::Duration timeout = absl::InfiniteDuration());
  // Acknowledges a token without waiting: the daemon may reuse its slot once it completes.
  void Abandon(CompletionToken token);
  // If the daemon goes away (its session socket closes), every pending request of this session
  // completes with UNAVAILABLE, so that no wait on it, host or GPU, blocks forever.

  // --- schedules (docs/schedules.md) ---
  // Declares the steps of one training iteration, repeated: each names the chunks it acquires,
  // where and how. Replaces the session's schedule; no steps clears it. Every chunk must be one
  // this session may use.
  absl::Status SetSchedule(std::span<const ScheduleStep> steps,
                           const ScheduleOptions& options = {});
  // Trace mode, for a session that does not declare its steps: the daemon records this session's
  // acquisitions over the next iteration of `steps_per_iteration` steps — from the next step
  // number that is a multiple of it, each acquisition belonging to the step BeginStep last
  // announced — and uses them as the schedule from the iteration after on. Replaces any schedule.
  absl::Status TraceSchedule(uint32_t steps_per_iteration, const ScheduleOptions& options = {});
  // Says that step `k` has started, counting across iterations (iteration * steps + index): one
  // store into shared memory, no RPC. The daemon's planner brings each step's chunks in ahead of
  // it, at the pace the steps keep.
  void BeginStep(uint64_t k);
  // Sets version bit `bit` (< 4096, TIERD_VERSION_BITS; INVALID_ARGUMENT beyond), which picks one
  // chunk of each pair a schedule names with it: one store into shared memory, no RPC.
  absl::Status SetVersion(uint32_t bit, bool value);
  absl::StatusOr<SessionStats> GetSessionStats();
  // This session's share of NVMe bandwidth while other sessions' I/O waits too: bytes in
  // proportion to its weight (default 1; at most the daemon's planner.max_session_weight,
  // INVALID_ARGUMENT beyond). Within the session, reads and writes go by deadline.
  absl::Status SetBandwidthWeight(uint32_t weight);

  // --- shared bases ---
  // Opens the base `name`, held until ReleaseBase or the session's end; with `create` and no base
  // of that name, makes it for this session to write and seal. ALREADY_EXISTS when it exists with
  // other chunks or descriptor than `create`, UNAVAILABLE while another session loads it,
  // PERMISSION_DENIED when it is not shared with this user, NOT_FOUND without `create`.
  absl::StatusOr<OpenedBase> OpenBase(const std::string& name, const BaseCreate* create = nullptr);
  // `descriptor`, when not empty, replaces the one given when the base was made.
  absl::Status SealBase(const std::string& name, const std::string& descriptor = "");
  absl::Status ReleaseBase(const std::string& name);
  absl::Status PinBase(const std::string& name, bool pinned);
  absl::StatusOr<std::vector<BaseStatus>> ListBases();

  // --- imports: the daemon reads a file into a chunk ---
  // Has the daemon read byte ranges of the file `fd` (a regular file open for reading) into chunk
  // `id`, which this session holds acquired for writing in the host tier; waits for it. The bytes
  // never pass through this process (nor, where the file system allows O_DIRECT, the page cache).
  // `file_size` and `file_mtime_ns` are what the caller saw (fstat) when it read the file's
  // layout: FAILED_PRECONDITION when the file is not that file any more, ABORTED when it changed
  // while it was read, OUT_OF_RANGE when it ended early, INVALID_ARGUMENT for a range outside the
  // file or the chunk or overlapping another in the chunk. On an error the chunk holds part of
  // the ranges at most; it is still the session's, acquired as before.
  struct FileRange {
    uint64_t file_offset = 0;
    uint64_t chunk_offset = 0;
    uint64_t length = 0;
  };
  struct Imported {
    uint64_t bytes = 0;
    bool direct = false;  // read with O_DIRECT throughout
  };
  absl::StatusOr<Imported> Import(ChunkId id, int fd, uint64_t file_size, int64_t file_mtime_ns,
                                  std::span<const FileRange> ranges);

  // --- the daemon's GPU in this process ---
  // Opens the daemon's GPU through CUDA (found by UUID; its primary context, the one the CUDA
  // runtime and PyTorch use) and returns its ordinal in this process, for cudaSetDevice or
  // torch.device("cuda", n). FAILED_PRECONDITION with the emulated device (there is no GPU),
  // NOT_FOUND without a device tier or when this process cannot see that GPU.
  absl::StatusOr<int> CudaDevice();
  // Enqueues on `stream` (a cudaStream_t / CUstream as an integer; 0 is the legacy default stream)
  // a wait for the request's completion, without blocking this thread: kernels enqueued after it
  // run once the daemon has finished the request (cuStreamWaitValue32 on the request's completion
  // word, which this process maps). The wait ends on failure too (and when the daemon goes away):
  // check the status on the host (Poll or Wait) before trusting what the kernels computed.
  absl::Status StreamWait(CompletionToken token, uintptr_t stream);

  struct Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tierd
