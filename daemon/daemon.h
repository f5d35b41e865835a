// The daemon's assembly: builds the tiers, the chunk service, the planner and the endpoints in
// order, and takes them down in the reverse order. main.cc holds only what belongs to the process
// (flags, signals, the directories' locks); everything the daemon serves is built and stopped here.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/config.h"

namespace tierd::daemon {

class ChunkService;
class Device;
class HostRegistration;
class MetricsServer;
class NvmeTier;
class PlanLoop;
class RpcServer;
class SegmentPool;
class SessionBroker;
class SessionRegistry;
struct DaemonParts;

class Daemon {
 public:
  // Builds everything that does not face clients yet: the host tier (pinning its memory), the
  // NVMe tier (opening its regions and recovering their persistent chunks), the device tier, the
  // start-up bandwidth probe, the planner and the metrics endpoint. An error names the part that
  // failed; whatever was built is taken down again.
  static absl::StatusOr<std::unique_ptr<Daemon>> Create(const DaemonConfig& config);
  // Publishes the session and gRPC sockets in config.socket_dir (their group `socket_gid`, else the
  // daemon's); the daemon serves from here on.
  absl::Status Serve(std::optional<gid_t> socket_gid);
  // The orderly stop: the endpoints stop taking work (calls in flight finish), every session ends,
  // persistent chunks whose current version is only in memory are written down, and once no
  // operation handed to a tier is in flight (persists included) the chunk service goes, then the
  // tiers. The sockets are removed. Once; the destructor stops a daemon not stopped yet.
  void Stop();
  ~Daemon();

  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

 private:
  explicit Daemon(const DaemonConfig& config);
  const DaemonConfig config_;
  std::unique_ptr<DaemonParts> parts_;
  bool stopped_ = false;
};

}  // namespace tierd::daemon
