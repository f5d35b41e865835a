// What moves on each path between the tiers (NVMe -> host, host -> NVMe, host -> device,
// device -> host): bytes and moves since start-up, the bandwidth measured over the time the path
// was busy, and how much longer than that bandwidth accounts for one move takes (its latency).
// The planner reads the estimates; the metrics endpoint reads the totals and the
// transfer-latency histogram.
//
// Thread-safe, with a lock of its own that is taken last (after ChunkService's).
#pragma once

#include <array>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/planner/planner.h"
#include "daemon/tiers/tier.h"
#include "daemon/util/metrics.h"

namespace tierd::daemon {

// What has moved on one path since start-up, and the estimate of its bandwidth.
struct PathStatus {
  Path path = Path::kNvmeToHost;
  uint64_t bytes = 0;
  uint64_t moves = 0;
  double bytes_per_second = 0;
  bool measured = false;
  double probed_bytes_per_second = 0;  // what the start-up probe measured (0: not probed)
};

// A path's load now, and what one move on it is expected to take.
struct PathLoad {
  double bytes_per_second = 0;
  uint64_t queued_bytes = 0;  // of the moves in flight
  int in_flight = 0;
  // What one move takes beyond its bytes and the bytes in flight ahead of it at the path's
  // bandwidth, on the long side (mean + 4 mean deviations): the path's latency. Queueing is not
  // in it (the planner counts the bytes in flight apart); 0 until a move has settled.
  absl::Duration slow_latency;
};

class PathMeter {
 public:
  // The first guesses (a datacenter NVMe drive, a PCIe 4.0 x16 link) stand until the start-up
  // probe (Seed) or the first moves on a path replace them.
  PathMeter();

  // A move of `bytes` of chunk `id` started on `path` at `now`, or settled there. A chunk has at
  // most one move in flight on each path, and every start is reported done (a chunk is destroyed
  // only once its moves have settled), so no start outlives its chunk.
  void Started(Path path, ChunkId id, uint64_t bytes, absl::Time now);
  void Done(Path path, ChunkId id, uint64_t bytes, absl::Time now);
  // The start-up probe's figures (0: not probed) become the estimates.
  void Seed(const PathArray<double>& bytes_per_second);

  PathArray<PathStatus> Status() const;
  PathArray<PathLoad> Load() const;
  // How long each move took, start to settle (the daemon's transfer latency).
  prometheus::ClientMetric transfer_seconds(Path path) const {
    return transfer_seconds_[path].Collect();
  }

 private:
  struct Meter {
    int in_flight = 0;
    uint64_t queued_bytes = 0;
    absl::Time window_start;
    uint64_t window_bytes = 0;
    double bytes_per_second = 0;  // the estimate
    bool measured = false;
    double probed = 0;
    double latency_seconds = -1;  // a move's duration beyond its bytes' (-1: none settled yet)
    double latency_deviation = 0;
    uint64_t bytes_total = 0;
    uint64_t moves_total = 0;
    // Each move in flight: when it started, and the bytes in flight ahead of it then.
    struct Start {
      absl::Time at;
      uint64_t ahead = 0;
    };
    absl::flat_hash_map<ChunkId, Start> started;
  };

  mutable absl::Mutex mu_;
  PathArray<Meter> meters_ ABSL_GUARDED_BY(mu_);
  // 100 us to 13 s, doubling.
  PathArray<prometheus::Histogram> transfer_seconds_ = PathArray<prometheus::Histogram>::Generate(
      [] { return prometheus::Histogram(metrics::ExponentialBuckets(1e-4, 2, 18)); });
};

}  // namespace tierd::daemon
