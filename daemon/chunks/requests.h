// The chunk service's requests and answers: the value types its calls take and return, and the
// limits that keep one request from monopolizing the daemon. Values only: the RPC layer builds
// them from the wire and ChunkService (chunk_service.h) acts on them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/completion_page.h"
#include "daemon/chunks/chunk.h"
#include "daemon/chunks/session.h"
#include "daemon/chunks/session_ledger.h"
#include "daemon/tiers/hop.h"
#include "daemon/tiers/tier.h"
#include "daemon/types/tiers.h"

namespace tierd::daemon {

struct ChunkRequest {
  uint64_t size = 0;
  TierKind home = TierKind::kHost;
  std::string name;
  bool persistent = false;
  std::vector<std::string> tags;
  bool open_existing = false;
  bool must_exist = false;  // with open_existing: open only
  bool shared = false;      // the lease on a persistent chunk may be shared
  bool transient = false;   // written down only for room (pb::ChunkSpec.transient)
};

struct AcquireResult {
  std::vector<Placement> locations;  // in request order
  SlotToken ready;                   // completes when every chunk is there
};

// Node-wide figures for the metrics endpoint: what every session's acquisitions cost and what the
// planner did (summed since start-up), the chunks by state and residency, and moves in flight.
struct NodeStats {
  SessionStats totals;
  uint64_t chunks_ready = 0, chunks_moving = 0, chunks_pinned = 0, chunks_persistent = 0;
  TierArray<uint64_t> resident_chunks, resident_bytes{};
  // Space held in each tier by acquired chunks: not reclaimable until they are released.
  TierArray<uint64_t> pinned_bytes;
  PathArray<uint64_t> in_flight, queued_bytes{};
  // Shared bases: how many, the sessions holding them (a session counted once per base), and the
  // bytes of their copies in each tier (counted once, however many hold them).
  uint64_t shared_bases = 0, shared_base_holders = 0;
  TierArray<uint64_t> shared_base_bytes{};
};

struct DrainResult {
  SlotToken token;
  uint64_t chunks = 0, bytes = 0;  // moving out of the tier
  uint64_t pinned = 0;             // left there, acquired
};

// What a session holds: its scratch chunks and the persistent chunks it has a lease on.
struct SessionHoldings {
  uint64_t chunks = 0, bytes = 0, pinned = 0;
  uint64_t moved_bytes = 0;  // of its chunks, over every path, while it held them
};

// Whether the session's user may act on every session's chunks: root, or the daemon's own user.
bool IsOperator(const Session& session);

struct ChunkPage {
  std::vector<ChunkMeta> chunks;
  ChunkId next_page_token = 0;
  std::map<BaseId, std::string> bases;  // the names of the shared bases its chunks belong to
};

// Limits that keep one request from monopolizing the daemon.
inline constexpr size_t kMaxBatch = 1'000'000;
inline constexpr size_t kMaxNameBytes = 255;
inline constexpr size_t kMaxTags = 16;
inline constexpr size_t kMaxTagBytes = 128;
inline constexpr uint32_t kDefaultPageSize = 1000;
inline constexpr uint32_t kMaxPageSize = 100'000;

// A valid chunk name: 1-255 bytes of [A-Za-z0-9._-/], '/'-separated components that are neither
// empty nor "." nor "..".
absl::Status ValidateChunkName(absl::string_view name);

// FAILED_PRECONDITION, after `what`, when the node has no `tier`.
absl::Status CheckTierConfigured(const Tiers& tiers, TierKind tier, absl::string_view what);
// Why Allocate cannot make a chunk as `r` asks, whatever the node holds: its home tier and size,
// its name and tags, and flags that do not go together.
absl::Status CheckChunkRequest(const ChunkRequest& r, const Tiers& tiers);

// One unit of a Prefetch's priority: how much sooner its I/O is due than a request made with a
// priority one lower.
inline constexpr absl::Duration kPriorityUnit = absl::Milliseconds(1);

// When the I/O of a Prefetch made at `now` with `priority` is due.
absl::Time PrefetchDeadline(absl::Time now, int priority);

}  // namespace tierd::daemon
