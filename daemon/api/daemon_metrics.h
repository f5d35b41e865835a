// The daemon's metrics: what is counted as it happens (API requests by operation and status code,
// and their latency), and the exposition of everything the metrics endpoint serves, read from the
// daemon's parts at scrape time. docs/operations.md lists every metric.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace tierd::daemon {

class ChunkService;
class Fallbacks;
class Importer;
class NvmeTier;
class SessionRegistry;
struct DeviceProbe;

// Counted by the gRPC server for every request (daemon/api/rpc_server.cc): tierd_requests_total
// by operation and status code, tierd_request_seconds by operation. Thread-safe.
class RpcMetrics {
 public:
  RpcMetrics();
  void Record(absl::string_view op, int grpc_code, absl::Duration took);
  std::vector<prometheus::MetricFamily> Collect() const { return registry_.Collect(); }

 private:
  prometheus::Registry registry_;
  prometheus::Family<prometheus::Counter>& requests_;   // op, code
  prometheus::Family<prometheus::Histogram>& seconds_;  // op
};

struct MetricsSources {
  const ChunkService* chunks = nullptr;
  const NvmeTier* nvme = nullptr;  // null without an NVMe tier
  const SessionRegistry* sessions = nullptr;
  const DeviceProbe* devices = nullptr;
  const RpcMetrics* rpc = nullptr;
  const Fallbacks* fallbacks = nullptr;
  const Importer* importer = nullptr;  // null: none counted
  absl::Time started;
};

// The whole exposition (Prometheus text format 0.0.4).
std::string RenderMetrics(const MetricsSources& sources);

// "OK", "NOT_FOUND", ...: gRPC's names for its status codes, as a bounded label value.
absl::string_view GrpcCodeName(int code);

}  // namespace tierd::daemon
