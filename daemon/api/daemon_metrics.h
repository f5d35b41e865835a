// The daemon's metrics: what is counted as it happens (API requests by operation and status code,
// and their latency), and the exposition of everything the metrics endpoint serves, read from the
// daemon's parts at scrape time. docs/operations.md lists every metric.
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/time/time.h"
#include "daemon/util/metrics.h"

namespace tierd::daemon {

class ChunkService;
class Fallbacks;
class NvmeTier;
class SessionRegistry;
struct DeviceProbe;

// Counted by the gRPC server for every request (daemon/api/rpc_server.cc).
struct RpcMetrics {
  void Record(absl::string_view op, int grpc_code, absl::Duration took);
  metrics::CounterMap requests;  // op, code
  // 25 us to 0.8 s, doubling.
  metrics::HistogramMap seconds{metrics::ExponentialBuckets(25e-6, 2, 16)};  // op
};

struct MetricsSources {
  const ChunkService* chunks = nullptr;
  const NvmeTier* nvme = nullptr;  // null without an NVMe tier
  const SessionRegistry* sessions = nullptr;
  const DeviceProbe* devices = nullptr;
  const RpcMetrics* rpc = nullptr;
  const Fallbacks* fallbacks = nullptr;
  absl::Time started;
};

// The whole exposition (Prometheus text format 0.0.4).
std::string RenderMetrics(const MetricsSources& sources);

// "OK", "NOT_FOUND", ...: gRPC's names for its status codes, as a bounded label value.
absl::string_view GrpcCodeName(int code);

}  // namespace tierd::daemon
