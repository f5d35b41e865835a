#include "daemon/daemon.h"

#include <unistd.h>

#include <array>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/fmt_absl.h"
#include "common/unix_socket.h"
#include "common/wire.h"
#include "daemon/api/daemon_metrics.h"
#include "daemon/api/metrics_server.h"
#include "daemon/api/rpc_server.h"
#include "daemon/api/session_broker.h"
#include "daemon/chunks/chunk_service.h"
#include "daemon/chunks/plan_loop.h"
#include "daemon/chunks/session.h"
#include "daemon/tiers/bandwidth_probe.h"
#include "daemon/tiers/device/device.h"
#include "daemon/tiers/device/device_probe.h"
#include "daemon/tiers/host/host_memory.h"
#include "daemon/tiers/nvme/nvme_tier.h"
#include "daemon/util/daemon_files.h"
#include "daemon/util/fallbacks.h"
#include "daemon/util/memory_trimmer.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {

// What the daemon is made of, in the order it is built.
struct DaemonParts {
  // What this machine made the daemon do without, for status and /metrics.
  Fallbacks fallbacks;
  std::unique_ptr<SegmentPool> host;
  std::unique_ptr<NvmeTier> nvme;
  DeviceProbe devices;
  std::unique_ptr<Device> device;
  std::unique_ptr<SegmentPool> device_pool;
  std::unique_ptr<HostRegistration> host_registration;
  std::unique_ptr<ChunkService> chunks;
  // Outlives the session broker, which tells it of sessions that end; goes before the chunks.
  std::unique_ptr<Importer> importer;
  std::unique_ptr<SessionRegistry> sessions;
  std::unique_ptr<PlanLoop> planner;
  RpcMetrics rpc_metrics;
  // Outlives the RPC server and the session broker, which tell it of requests and sessions.
  std::unique_ptr<MemoryTrimmer> trimmer;
  std::unique_ptr<MetricsServer> metrics_server;
  std::unique_ptr<SessionBroker> broker;
  std::unique_ptr<RpcServer> rpc;
  std::vector<std::string> published;  // socket paths, removed at the stop
};

namespace {

absl::Status Named(absl::string_view part, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(part, ": ", status.message()));
}

// The device tier: the first GPU (by the CUDA driver, loaded at run time), or an emulated one when
// configured, or none.
absl::Status OpenDevice(const DaemonConfig& config, DaemonParts& d) {
  const std::string& backend = config.device.backend;
  if (backend == "emulated") {
    // Host memory stands in for the GPU's: it must be there, beside the host tier's.
    if (absl::Status s = CheckAvailable(
            config.device.capacity + (config.host.lock_memory ? 0 : config.host.capacity),
            "device.capacity (the emulated device's memory)");
        !s.ok()) {
      return Named("device tier", s);
    }
    d.device =
        MakeEmulatedDevice({.memory_bytes = config.device.capacity,
                            .gbps = config.device.emulated_gbps,
                            .latency = absl::Microseconds(config.device.emulated_latency_us),
                            .upload_failures_from = config.device.emulated_upload_failures_from});
    spdlog::warn("device tier: EMULATED ({}): host memory stands in for GPU memory",
                 d.device->description().name);
  } else if (backend == "auto" || backend == "cuda") {
    std::vector<std::unique_ptr<Device>> gpus = OpenCudaDevices(&d.devices.status);
    if (!gpus.empty()) {
      d.device = std::move(gpus[0]);
      for (size_t i = 1; i < gpus.size(); ++i) {
        spdlog::warn("GPU {} ({}) is not served: this version serves one GPU per daemon",
                     gpus[i]->description().uuid, gpus[i]->description().name);
      }
    } else if (backend == "cuda") {
      return absl::FailedPreconditionError(
          absl::StrCat("device tier: device.backend is cuda but ", d.devices.status));
    }
  } else {
    d.devices.status = "device tier disabled (device.backend = none)";
  }
  if (d.device == nullptr) {
    spdlog::info("device tier: none ({}); serving the host{} tier{}", d.devices.status,
                 d.nvme != nullptr ? " and NVMe" : "", d.nvme != nullptr ? "s" : "");
    return absl::OkStatus();
  }
  const DeviceDescription& desc = d.device->description();
  d.devices.devices.push_back(desc);
  absl::StatusOr<std::unique_ptr<SegmentPool>> pool =
      SegmentPool::Create(TierKind::kDevice, "device", config.device.capacity,
                          config.device.segment_size, d.device->MakeBacking());
  if (!pool.ok()) return Named(absl::StrCat("device tier on ", desc.uuid), pool.status());
  d.device_pool = std::move(*pool);
  // The GPU copies straight from and into the host tier's pinned segments.
  d.host_registration =
      std::make_unique<HostRegistration>(d.host.get(), d.device.get(), &d.fallbacks);
  spdlog::info("device tier: {} {}: {}", desc.uuid, desc.name, d.device_pool->Describe());
  return absl::OkStatus();
}

absl::Status OpenTiers(const DaemonConfig& config, DaemonParts& d) {
  absl::StatusOr<std::unique_ptr<SegmentPool>> host = CreateHostPool(config.host);
  if (!host.ok()) return Named("host tier", host.status());
  d.host = std::move(*host);
  if (config.host.huge_pages == HugePagePolicy::kAuto &&
      !static_cast<const MemfdBacking*>(d.host->backing())->huge_pages()) {
    d.fallbacks.Set("host_small_pages",
                    "no free 2 MiB huge pages for host.capacity: the host tier uses 4 KiB pages "
                    "(slower to pin, more TLB misses); reserve vm.nr_hugepages");
  }
  if (!config.nvme.regions.empty()) {
    absl::StatusOr<InstanceId> instance = LoadOrCreateInstanceId(config.state_dir);
    if (!instance.ok()) return Named("state_dir", instance.status());
    absl::StatusOr<std::unique_ptr<NvmeTier>> opened =
        NvmeTier::Open(config.nvme, *instance, d.host.get(), config.state_dir);
    if (!opened.ok()) return Named("NVMe tier", opened.status());
    d.nvme = std::move(*opened);
    if (d.nvme->io_backend() == IoBackendKind::kThreads &&
        config.nvme.io_backend != IoBackendKind::kThreads) {
      d.fallbacks.Set("nvme_io_threads",
                      "io_uring is unavailable (see the start-up log): NVMe I/O runs on "
                      "pread/pwrite threads, with more CPU per byte");
    }
  } else {
    spdlog::info("NVMe tier: none configured (nvme.regions is empty)");
  }
  return OpenDevice(config, d);
}

absl::Status ProbeBandwidth(const DaemonConfig& config, DaemonParts& d) {
  absl::StatusOr<PathBandwidth> probed =
      ProbePaths(NodeTiers(d.host.get(), d.nvme.get(), d.device_pool.get(), d.device.get()),
                 config.planner.probe_bytes);
  if (!probed.ok()) {
    return absl::Status(probed.status().code(),
                        absl::StrCat("start-up bandwidth probe: ", probed.status().message(),
                                     "; check the drive (dmesg) or start without the probe "
                                     "(planner.probe_bytes = 0)"));
  }
  std::string figures;
  for (Path p : kAllPaths) {
    if ((*probed)[p] <= 0) continue;
    absl::StrAppend(&figures, figures.empty() ? "" : ", ", PathName(p), " ",
                    absl::StrFormat("%.2f", (*probed)[p] / 1e9), " GB/s");
  }
  spdlog::info("start-up bandwidth probe: {}", figures.empty() ? "no path probed" : figures);
  d.chunks->SeedBandwidth(*probed);
  return absl::OkStatus();
}

// The metrics endpoint comes up before the sockets: a daemon that cannot serve its metrics stops
// before any client has connected to it.
absl::Status StartMetrics(const DaemonConfig& config, DaemonParts& d) {
  if (config.metrics.listen.empty()) return absl::OkStatus();
  const MetricsSources sources{.chunks = d.chunks.get(),
                               .nvme = d.nvme.get(),
                               .sessions = d.sessions.get(),
                               .devices = &d.devices,
                               .rpc = &d.rpc_metrics,
                               .fallbacks = &d.fallbacks,
                               .importer = d.importer.get(),
                               .started = absl::Now()};
  absl::StatusOr<std::unique_ptr<MetricsServer>> m =
      MetricsServer::Start(config.metrics.listen, [sources] { return RenderMetrics(sources); });
  if (!m.ok()) {
    return absl::Status(m.status().code(),
                        absl::StrCat("metrics: ", m.status().message(),
                                     " (set metrics.listen / --metrics_listen; \"none\" or an "
                                     "empty metrics.listen for no endpoint)"));
  }
  d.metrics_server = std::move(*m);
  if (!d.metrics_server->loopback()) {
    spdlog::warn(
        "metrics: {} is reachable from other hosts; the figures name users, chunks and devices. "
        "Bind it to 127.0.0.1 unless a firewall guards it",
        d.metrics_server->address());
  }
  spdlog::info("serving metrics on {}", d.metrics_server->url());
  return absl::OkStatus();
}

}  // namespace

Daemon::Daemon(const DaemonConfig& config)
    : config_(config), parts_(std::make_unique<DaemonParts>()) {}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Create(const DaemonConfig& config) {
  std::unique_ptr<Daemon> daemon(new Daemon(config));
  DaemonParts& d = *daemon->parts_;
  if (absl::Status s = OpenTiers(config, d); !s.ok()) return s;

  d.chunks = std::make_unique<ChunkService>(
      NodeTiers(d.host.get(), d.nvme.get(), d.device_pool.get(), d.device.get()));
  d.chunks->set_limits(config.limits, config.quotas);
  d.chunks->set_max_bandwidth_weight(config.planner.max_session_weight);
  std::vector<uint32_t> base_gids;
  for (absl::string_view group : absl::StrSplit(config.base_groups, ',', absl::SkipWhitespace())) {
    absl::StatusOr<gid_t> gid = ResolveGroup(std::string(absl::StripAsciiWhitespace(group)));
    if (!gid.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("daemon.base_groups: ", gid.status().message()));
    }
    base_gids.push_back(*gid);
  }
  d.chunks->set_base_groups(std::move(base_gids));
  if (d.nvme != nullptr) {
    const size_t recovered = d.chunks->Recover(d.nvme->RecoveredEntries());
    spdlog::info("NVMe tier: recovered {} persistent chunks", recovered);
  }
  if (config.planner.probe_bytes > 0) {
    if (absl::Status s = ProbeBandwidth(config, d); !s.ok()) return s;
  }
  d.sessions = std::make_unique<SessionRegistry>(config.limits.sessions_per_uid);
  d.importer = std::make_unique<Importer>(d.chunks.get());
  d.planner = std::make_unique<PlanLoop>(d.chunks.get(), absl::Milliseconds(1));
  if (absl::Status s = StartMetrics(config, d); !s.ok()) return s;
  return daemon;
}

absl::Status Daemon::Serve(std::optional<gid_t> socket_gid) {
  DaemonParts& d = *parts_;
  constexpr mode_t kSocketMode = 0660;
  // Memory that requests and ended sessions free goes back to the kernel within two seconds.
  d.trimmer = std::make_unique<MemoryTrimmer>(absl::Seconds(2));
  UniqueFd session_listener;
  if (absl::Status s =
          PublishSocket(config_.socket_dir, kSessionSocketName, kSocketMode, socket_gid,
                        [&](const std::string& path) -> absl::Status {
                          absl::StatusOr<UniqueFd> l = ListenSeqpacket(path, 0600);
                          if (!l.ok()) return l.status();
                          session_listener = std::move(*l);
                          return absl::OkStatus();
                        });
      !s.ok()) {
    return Named("session socket", s);
  }
  d.published.push_back(absl::StrCat(config_.socket_dir, "/", kSessionSocketName));
  absl::StatusOr<std::unique_ptr<SessionBroker>> broker = SessionBroker::Start(
      std::move(session_listener), d.sessions.get(), d.chunks.get(), d.importer.get(), d.host.get(),
      d.device_pool.get(), d.devices, config_.limits.connections_per_uid, d.trimmer.get());
  if (!broker.ok()) return Named("session socket", broker.status());
  d.broker = std::move(*broker);
  if (absl::Status s = PublishSocket(
          config_.socket_dir, kRpcSocketName, kSocketMode, socket_gid,
          [&](const std::string& path) -> absl::Status {
            absl::StatusOr<std::unique_ptr<RpcServer>> r = RpcServer::Start(
                path, RpcServerDeps{d.sessions.get(), d.chunks.get(), d.devices, d.nvme.get(),
                                    &d.rpc_metrics, &d.fallbacks, d.trimmer.get()});
            if (!r.ok()) return r.status();
            d.rpc = std::move(*r);
            return absl::OkStatus();
          });
      !s.ok()) {
    return Named("gRPC socket", s);
  }
  d.published.push_back(absl::StrCat(config_.socket_dir, "/", kRpcSocketName));
  d.rpc->SetServing(true);  // the tiers are up and both sockets published
  spdlog::info("serving gRPC on unix:{}/{} and sessions on {}/{}", config_.socket_dir,
               kRpcSocketName, config_.socket_dir, kSessionSocketName);
  return absl::OkStatus();
}

void Daemon::Stop() {
  if (stopped_) return;
  stopped_ = true;
  DaemonParts& d = *parts_;
  if (d.rpc != nullptr) d.rpc->SetServing(false);  // health probes see the stop first
  d.metrics_server.reset();
  if (d.rpc != nullptr) d.rpc->Shutdown(absl::Seconds(5));
  d.broker.reset();    // ends every session
  d.importer.reset();  // and its running import, if any: then that session's end
  d.planner.reset();   // no round starts a move from here on
  if (d.chunks != nullptr) {
    d.chunks->WriteDownForStop();  // persistent chunks whose current version is only in memory
    d.chunks->WaitForIdle();       // every move, write-down and index record has called back
  }
  // The tiers' own threads are idle too (the last callbacks have returned).
  if (d.device != nullptr) d.device->Drain();
  if (d.nvme != nullptr) d.nvme->Drain();
  d.rpc.reset();
  d.trimmer.reset();
  d.chunks.reset();
  d.host_registration.reset();
  for (const std::string& path : d.published) unlink(path.c_str());
  d.published.clear();
}

Daemon::~Daemon() { Stop(); }

}  // namespace tierd::daemon
