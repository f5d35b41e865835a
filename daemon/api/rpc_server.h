// The gRPC server on the daemon's Unix socket. The generated API code stays inside rpc_server.cc
// and node_info.cc (GetNodeInfo's answer).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/api/daemon_metrics.h"
#include "daemon/chunks/chunk_service.h"
#include "daemon/chunks/session.h"
#include "daemon/tiers/device/device_probe.h"
#include "daemon/tiers/nvme/nvme_tier.h"
#include "daemon/tiers/segment_pool.h"
#include "daemon/util/fallbacks.h"
#include "daemon/util/memory_trimmer.h"

namespace tierd::daemon {

struct RpcServerDeps {
  SessionRegistry* sessions = nullptr;
  ChunkService* chunks = nullptr;
  DeviceProbe devices;
  NvmeTier* nvme = nullptr;       // for per-region usage; null without an NVMe tier
  RpcMetrics* metrics = nullptr;  // counts every request when set
  const Fallbacks* fallbacks = nullptr;
  MemoryTrimmer* trimmer = nullptr;  // told of every finished request when set
};

class RpcServer {
 public:
  // The API's service, as the health service and reflection name it.
  static constexpr absl::string_view kServiceName = "tierd.v1.Tierd";

  // Serves the API on unix:`path` (bound now; its mode is the caller's to set: PublishSocket).
  static absl::StatusOr<std::unique_ptr<RpcServer>> Start(const std::string& path,
                                                          RpcServerDeps deps);
  ~RpcServer();
  // What the gRPC health service (grpc.health.v1.Health) says of the daemon, as a whole ("") and
  // of kServiceName: NOT_SERVING from Start until the daemon is ready to serve.
  void SetServing(bool serving);
  // Health says NOT_SERVING for good; then refuses new calls, lets calls in flight finish (up to
  // `grace`), and stops.
  void Shutdown(absl::Duration grace);

 private:
  struct Impl;
  explicit RpcServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tierd::daemon
