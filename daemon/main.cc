// tierd: the per-node daemon that owns the memory tiers.
#include <signal.h>
#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <tuple>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/fmt_absl.h"
#include "common/sizes.h"
#include "common/unix_socket.h"
#include "common/version.h"
#include "common/wire.h"
#include "daemon/api/daemon_metrics.h"
#include "daemon/api/metrics_server.h"
#include "daemon/api/rpc_server.h"
#include "daemon/api/session_broker.h"
#include "daemon/chunks/chunk_service.h"
#include "daemon/chunks/plan_loop.h"
#include "daemon/chunks/session.h"
#include "daemon/config.h"
#include "daemon/tiers/bandwidth_probe.h"
#include "daemon/tiers/device.h"
#include "daemon/tiers/device_probe.h"
#include "daemon/tiers/host_memory.h"
#include "daemon/tiers/nvme_tier.h"
#include "daemon/util/daemon_files.h"
#include "daemon/util/log_limiter.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, config, "",
          "TOML config file (see docs/configuration.md); flags override it");
ABSL_FLAG(std::string, socket_dir, "",
          "directory for tierd.sock and tierd.session.sock [daemon.socket_dir; default "
          "$RUNTIME_DIRECTORY under systemd, else var/run]");
ABSL_FLAG(std::string, socket_group, "",
          "group allowed to connect; sockets are mode 0660 [daemon.socket_group]");
ABSL_FLAG(std::string, log_level, "",
          "trace, debug, info, warn, error, critical or off [daemon.log_level; default info]");
ABSL_FLAG(std::string, host_capacity, "",
          "pinned host memory to own, e.g. 64GiB [host.capacity; default 1GiB]");
ABSL_FLAG(std::string, host_segment_size, "",
          "size of each shared memfd segment, also the largest chunk [host.segment_size; default "
          "256MiB]");
ABSL_FLAG(std::string, huge_pages, "",
          "2 MiB huge pages for the host tier: auto, never or require [host.huge_pages; default "
          "auto]");

ABSL_FLAG(std::string, state_dir, "",
          "directory for the instance id and the default NVMe region [daemon.state_dir; default "
          "$STATE_DIRECTORY under systemd, else var/lib]");
ABSL_FLAG(
    std::string, nvme_regions, "",
    "NVMe regions as PATH:SIZE[,PATH:SIZE...] (files are created and preallocated; SIZE 0 "
    "for a whole block device), or 'none' [nvme.regions; default STATE_DIR/nvme0.region:2GiB]");
ABSL_FLAG(std::string, nvme_stripe_unit, "",
          "bytes per region before striping moves to the next [nvme.stripe_unit; default 1MiB]");
ABSL_FLAG(std::string, nvme_io_size, "",
          "largest single I/O, at most the stripe unit [nvme.io_size; default 1MiB]");
ABSL_FLAG(int32_t, nvme_queue_depth, 0, "I/Os in flight [nvme.queue_depth; default 32]");
ABSL_FLAG(bool, nvme_sqpoll, false, "kernel-side submission polling [nvme.sqpoll]");
ABSL_FLAG(std::string, nvme_io_backend, "",
          "io_uring, threads (pread/pwrite) or auto: io_uring unless it is unavailable "
          "[nvme.io_backend; default auto]");
ABSL_FLAG(bool, nvme_reformat, false,
          "format the NVMe regions even if they hold data (discards their persistent chunks)");
ABSL_FLAG(std::string, device, "",
          "device tier backend: auto (a GPU when present), cuda, emulated (host memory standing in "
          "for a GPU, for tests and demos) or none [device.backend; default auto]");
ABSL_FLAG(std::string, device_capacity, "", "device pool per GPU [device.capacity; default 8GiB]");
ABSL_FLAG(std::string, device_segment_size, "",
          "size of each device pool allocation, also the largest device chunk "
          "[device.segment_size; default 256MiB]");
ABSL_FLAG(
    double, emulated_gbps, 0,
    "emulated device: copy bandwidth per direction in GB/s [device.emulated_gbps; default 24]");
ABSL_FLAG(std::string, probe_bytes, "",
          "bytes moved over each path at start-up to measure its bandwidth; 0 for no probe "
          "[planner.probe_bytes; default 64MiB]");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT of the Prometheus endpoint, GET /metrics (port 0: any free one); none for "
          "no endpoint [metrics.listen; default 127.0.0.1:9477]");
ABSL_FLAG(int32_t, max_session_weight, 0,
          "the largest bandwidth weight a session may ask for [planner.max_session_weight; "
          "default 16]");
ABSL_FLAG(std::string, lock_memory, "",
          "true or false: mlock the host tier; false only for development without memlock "
          "rights [host.lock_memory; default true]");

namespace tierd::daemon {
namespace {

absl::StatusOr<DaemonConfig> BuildConfig() {
  DaemonConfig config = DefaultConfig();
  if (std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    if (absl::Status s = ApplyTomlFile(path, &config); !s.ok()) return s;
  }
  if (!absl::GetFlag(FLAGS_socket_dir).empty()) config.socket_dir = absl::GetFlag(FLAGS_socket_dir);
  if (!absl::GetFlag(FLAGS_socket_group).empty())
    config.socket_group = absl::GetFlag(FLAGS_socket_group);
  if (!absl::GetFlag(FLAGS_log_level).empty()) {
    config.log_level = absl::GetFlag(FLAGS_log_level);
    if (absl::Status s = ValidateLogLevel(config.log_level); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--log_level: ", s.message()));
    }
  }
  if (!absl::GetFlag(FLAGS_host_capacity).empty()) {
    absl::StatusOr<uint64_t> v = ParseSize(absl::GetFlag(FLAGS_host_capacity));
    if (!v.ok())
      return absl::InvalidArgumentError(absl::StrCat("--host_capacity: ", v.status().message()));
    config.host.capacity = *v;
  }
  if (!absl::GetFlag(FLAGS_host_segment_size).empty()) {
    absl::StatusOr<uint64_t> v = ParseSize(absl::GetFlag(FLAGS_host_segment_size));
    if (!v.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--host_segment_size: ", v.status().message()));
    }
    config.host.segment_size = *v;
  }
  if (!absl::GetFlag(FLAGS_huge_pages).empty()) {
    absl::StatusOr<HugePagePolicy> v = ParseHugePagePolicy(absl::GetFlag(FLAGS_huge_pages));
    if (!v.ok())
      return absl::InvalidArgumentError(absl::StrCat("--huge_pages: ", v.status().message()));
    config.host.huge_pages = *v;
  }
  if (std::string v = absl::GetFlag(FLAGS_state_dir); !v.empty()) {
    const bool default_region = config.nvme.regions.size() == 1 &&
                                config.nvme.regions[0].path == DefaultRegion(config.state_dir).path;
    config.state_dir = v;
    if (default_region) config.nvme.regions = {DefaultRegion(v)};
  }
  if (std::string v = absl::GetFlag(FLAGS_nvme_regions); !v.empty()) {
    absl::StatusOr<std::vector<RegionSpec>> regions = ParseRegionList(v);
    if (!regions.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--nvme_regions: ", regions.status().message()));
    }
    config.nvme.regions = *regions;
  }
  for (auto [flag, value, target] :
       {std::tuple{"--nvme_stripe_unit", absl::GetFlag(FLAGS_nvme_stripe_unit),
                   &config.nvme.stripe_unit},
        std::tuple{"--nvme_io_size", absl::GetFlag(FLAGS_nvme_io_size), &config.nvme.io_size}}) {
    if (value.empty()) continue;
    absl::StatusOr<uint64_t> v = ParseSize(value);
    if (!v.ok()) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", v.status().message()));
    *target = *v;
  }
  if (int32_t depth = absl::GetFlag(FLAGS_nvme_queue_depth); depth != 0) {
    if (depth < 1 || depth > 4096) {
      return absl::InvalidArgumentError("--nvme_queue_depth must be 1 to 4096");
    }
    config.nvme.queue_depth = static_cast<uint32_t>(depth);
  }
  if (absl::GetFlag(FLAGS_nvme_sqpoll)) config.nvme.sqpoll = true;
  if (std::string v = absl::GetFlag(FLAGS_nvme_io_backend); !v.empty()) {
    absl::StatusOr<IoBackendKind> kind = ParseIoBackendKind(v);
    if (!kind.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--nvme_io_backend: ", kind.status().message()));
    }
    config.nvme.io_backend = *kind;
  }
  config.nvme.reformat = absl::GetFlag(FLAGS_nvme_reformat);
  if (std::string v = absl::GetFlag(FLAGS_device); !v.empty()) {
    if (absl::Status s = ValidateDeviceBackend(v); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--device: ", s.message()));
    }
    config.device.backend = v;
  }
  for (auto [flag, value, target] :
       {std::tuple{"--device_capacity", absl::GetFlag(FLAGS_device_capacity),
                   &config.device.capacity},
        std::tuple{"--device_segment_size", absl::GetFlag(FLAGS_device_segment_size),
                   &config.device.segment_size},
        std::tuple{"--probe_bytes", absl::GetFlag(FLAGS_probe_bytes),
                   &config.planner.probe_bytes}}) {
    if (value.empty()) continue;
    absl::StatusOr<uint64_t> v = ParseSize(value);
    if (!v.ok()) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", v.status().message()));
    *target = *v;
  }
  if (double gbps = absl::GetFlag(FLAGS_emulated_gbps); gbps != 0) {
    if (gbps < 0) return absl::InvalidArgumentError("--emulated_gbps must be positive");
    config.device.emulated_gbps = gbps;
  }
  if (int32_t w = absl::GetFlag(FLAGS_max_session_weight); w != 0) {
    if (w < 1 || w > 1000) {
      return absl::InvalidArgumentError("--max_session_weight must be from 1 to 1000");
    }
    config.planner.max_session_weight = static_cast<uint32_t>(w);
  }
  if (std::string v = absl::GetFlag(FLAGS_metrics_listen); !v.empty()) {
    config.metrics.listen = v == "none" ? "" : v;
  }
  if (std::string v = absl::GetFlag(FLAGS_lock_memory); !v.empty()) {
    if (v != "true" && v != "false") {
      return absl::InvalidArgumentError(
          absl::StrCat("--lock_memory must be true or false, not '", v, "'"));
    }
    config.host.lock_memory = v == "true";
  }
  return config;
}

// Signals: SIGTERM and SIGINT are blocked in every thread and taken by one thread of their own.
// Before the daemon serves, a signal ends the start-up at once (nothing has been handed out; a
// long pinning or probe must not make the operator wait); after, it starts the orderly shutdown.
class SignalWatcher {
 public:
  SignalWatcher() {
    sigemptyset(&signals_);
    sigaddset(&signals_, SIGTERM);
    sigaddset(&signals_, SIGINT);
    pthread_sigmask(SIG_BLOCK, &signals_, nullptr);
    thread_ = std::thread([this] {
      int sig = 0;
      while (sigwait(&signals_, &sig) != 0) {
      }
      if (quitting_.load()) return;  // the daemon returns on its own (a start-up error)
      received_ = sig;
      {
        // Held to the exit: Serving() cannot return, nor a socket be published, meanwhile.
        absl::MutexLock lock(&mu_);
        if (!serving_) {
          spdlog::warn("received {} during start-up; stopping",
                       sig == SIGTERM ? "SIGTERM" : "SIGINT");
          spdlog::default_logger()->flush();
          _exit(0);
        }
      }
      stop_.Notify();
    });
  }
  ~SignalWatcher() {
    if (!stop_.HasBeenNotified()) {
      quitting_.store(true);
      pthread_kill(thread_.native_handle(), SIGTERM);
    }
    thread_.join();
  }
  // From now on a signal asks for an orderly shutdown (Wait returns at once if one came already).
  void Serving() {
    absl::MutexLock lock(&mu_);
    serving_ = true;
  }
  // Waits for a signal, calling `tick` every `interval`. Returns the signal's name.
  const char* Wait(absl::Duration interval, const std::function<void()>& tick) {
    while (!stop_.WaitForNotificationWithTimeout(interval)) tick();
    return received_ == SIGTERM ? "SIGTERM" : "SIGINT";
  }

 private:
  sigset_t signals_;
  absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> quitting_{false};
  absl::Notification stop_;
  int received_ = 0;  // written before stop_ is notified
  std::thread thread_;
};

// Exit statuses: 2 for a configuration the daemon refuses to run with (a bad key, a directory
// others may write into, another daemon's state directory), 1 when the node cannot provide what
// the configuration asks for.
constexpr int kConfigError = 2;
constexpr int kStartupError = 1;

int Run() {
  absl::StatusOr<DaemonConfig> config = BuildConfig();
  if (config.ok()) {
    if (absl::Status s = ValidateConfig(*config); !s.ok()) config = s;
  }
  if (!config.ok()) {
    std::fprintf(stderr, "tierd: %s\n", std::string(config.status().message()).c_str());
    return kConfigError;
  }
  spdlog::set_level(spdlog::level::from_str(config->log_level));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  spdlog::info("tierd {} starting (pid {})", TIERD_VERSION, getpid());
  // Whatever the daemon creates is never writable by its group or others, and its state not even
  // readable by others, whatever umask it was started with; sockets get their modes explicitly.
  umask(027);
  // Before any thread starts: every thread inherits the blocked signals.
  SignalWatcher signals;
  signal(SIGPIPE, SIG_IGN);

  std::optional<gid_t> socket_gid;
  if (!config->socket_group.empty()) {
    absl::StatusOr<gid_t> gid = ResolveGroup(config->socket_group);
    if (!gid.ok()) {
      spdlog::critical("daemon.socket_group: {}", gid.status().message());
      return kConfigError;
    }
    socket_gid = *gid;
  }
  // The daemon's directories, and locks that keep a second daemon off them.
  std::vector<UniqueFd> locks;
  for (auto [dir, mode, key] : {std::tuple{config->socket_dir, 0755, "daemon.socket_dir"},
                                std::tuple{config->state_dir, 0750, "daemon.state_dir"}}) {
    if (absl::Status s = PrepareDirectory(dir, mode, key); !s.ok()) {
      spdlog::critical("{}", s.message());
      return kConfigError;
    }
    if (!locks.empty() && std::filesystem::equivalent(config->socket_dir, config->state_dir)) {
      continue;  // one directory for both: locked once
    }
    absl::StatusOr<UniqueFd> lock = LockDirectory(dir, key);
    if (!lock.ok()) {
      spdlog::critical("{}", lock.status().message());
      return kConfigError;
    }
    locks.push_back(std::move(*lock));
  }
  const std::string rpc_path = absl::StrCat(config->socket_dir, "/", kRpcSocketName);
  const std::string session_path = absl::StrCat(config->socket_dir, "/", kSessionSocketName);

  // What this machine made the daemon do without, for status and /metrics.
  Fallbacks fallbacks;
  absl::StatusOr<std::unique_ptr<SegmentPool>> host = CreateHostPool(config->host);
  if (!host.ok()) {
    spdlog::critical("host tier: {}", host.status().message());
    return kStartupError;
  }
  if (config->host.huge_pages == HugePagePolicy::kAuto &&
      !static_cast<const MemfdBacking*>((*host)->backing())->huge_pages()) {
    fallbacks.Set("host_small_pages",
                  "no free 2 MiB huge pages for host.capacity: the host tier uses 4 KiB pages "
                  "(slower to pin, more TLB misses); reserve vm.nr_hugepages");
  }
  std::unique_ptr<NvmeTier> nvme;
  if (!config->nvme.regions.empty()) {
    absl::StatusOr<InstanceId> instance = LoadOrCreateInstanceId(config->state_dir);
    if (!instance.ok()) {
      spdlog::critical("state_dir: {}", instance.status().message());
      return kStartupError;
    }
    absl::StatusOr<std::unique_ptr<NvmeTier>> opened =
        NvmeTier::Open(config->nvme, *instance, host->get(), config->state_dir);
    if (!opened.ok()) {
      spdlog::critical("NVMe tier: {}", opened.status().message());
      return kStartupError;
    }
    nvme = std::move(*opened);
    if (nvme->io_backend() == IoBackendKind::kThreads &&
        config->nvme.io_backend != IoBackendKind::kThreads) {
      fallbacks.Set("nvme_io_threads",
                    "io_uring is unavailable (see the start-up log): NVMe I/O runs on pread/pwrite "
                    "threads, with more CPU per byte");
    }
  } else {
    spdlog::info("NVMe tier: none configured (nvme.regions is empty)");
  }
  // The device tier: the first GPU (by the CUDA driver, loaded at run time), or an emulated one
  // when configured, or none.
  DeviceProbe devices;
  std::unique_ptr<Device> device;
  const std::string& backend = config->device.backend;
  if (backend == "emulated") {
    // Host memory stands in for the GPU's: it must be there, beside the host tier's.
    if (absl::Status s = CheckAvailable(
            config->device.capacity + (config->host.lock_memory ? 0 : config->host.capacity),
            "device.capacity (the emulated device's memory)");
        !s.ok()) {
      spdlog::critical("device tier: {}", s.message());
      return kStartupError;
    }
    device = MakeEmulatedDevice({config->device.capacity, config->device.emulated_gbps,
                                 absl::Microseconds(config->device.emulated_latency_us)});
    spdlog::warn("device tier: EMULATED ({}): host memory stands in for GPU memory",
                 device->description().name);
  } else if (backend == "auto" || backend == "cuda") {
    std::vector<std::unique_ptr<Device>> gpus = OpenCudaDevices(&devices.status);
    if (!gpus.empty()) {
      device = std::move(gpus[0]);
      for (size_t i = 1; i < gpus.size(); ++i) {
        spdlog::warn("GPU {} ({}) is not served: this version serves one GPU per daemon",
                     gpus[i]->description().uuid, gpus[i]->description().name);
      }
    } else if (backend == "cuda") {
      spdlog::critical("device tier: device.backend is cuda but {}", devices.status);
      return kStartupError;
    }
  } else {
    devices.status = "device tier disabled (device.backend = none)";
  }
  std::unique_ptr<SegmentPool> device_pool;
  std::unique_ptr<HostRegistration> host_registration;
  if (device != nullptr) {
    const DeviceDescription& d = device->description();
    devices.devices.push_back(d);
    absl::StatusOr<std::unique_ptr<SegmentPool>> pool =
        SegmentPool::Create(TierKind::kDevice, "device", config->device.capacity,
                            config->device.segment_size, device->MakeBacking());
    if (!pool.ok()) {
      spdlog::critical("device tier on {}: {}", d.uuid, pool.status().message());
      return kStartupError;
    }
    device_pool = std::move(*pool);
    // The GPU copies straight from and into the host tier's pinned segments.
    host_registration = std::make_unique<HostRegistration>(host->get(), device.get(), &fallbacks);
    spdlog::info("device tier: {} {}: {}", d.uuid, d.name, device_pool->Describe());
  } else {
    spdlog::info("device tier: none ({}); serving the host{} tier{}", devices.status,
                 nvme != nullptr ? " and NVMe" : "", nvme != nullptr ? "s" : "");
  }

  std::array<Tier*, kTierKinds> tiers{};
  tiers[static_cast<int>(TierKind::kHost)] = host->get();
  tiers[static_cast<int>(TierKind::kNvme)] = nvme.get();
  tiers[static_cast<int>(TierKind::kDevice)] = device_pool.get();
  ChunkService chunks(tiers, nvme.get(), device.get());
  chunks.set_limits(config->limits, config->quotas);
  if (nvme != nullptr) {
    const size_t recovered = chunks.Recover(nvme->RecoveredEntries());
    spdlog::info("NVMe tier: recovered {} persistent chunks", recovered);
  }
  chunks.set_max_bandwidth_weight(config->planner.max_session_weight);
  if (config->planner.probe_bytes > 0) {
    absl::StatusOr<PathBandwidth> probed = ProbePaths(host->get(), nvme.get(), device_pool.get(),
                                                      device.get(), config->planner.probe_bytes);
    if (!probed.ok()) {
      spdlog::critical(
          "start-up bandwidth probe: {}; check the drive (dmesg) or start without the probe "
          "(planner.probe_bytes = 0)",
          probed.status().message());
      return kStartupError;
    }
    std::string figures;
    for (int p = 0; p < kPaths; ++p) {
      if ((*probed)[p] <= 0) continue;
      absl::StrAppend(&figures, figures.empty() ? "" : ", ", PathName(static_cast<Path>(p)), " ",
                      absl::StrFormat("%.2f", (*probed)[p] / 1e9), " GB/s");
    }
    spdlog::info("start-up bandwidth probe: {}", figures.empty() ? "no path probed" : figures);
    chunks.SeedBandwidth(*probed);
  }
  SessionRegistry sessions(config->limits.sessions_per_uid);
  // Stops before the chunk service and the tiers it plans for.
  PlanLoop planner(&chunks, absl::Milliseconds(1));

  // The metrics endpoint comes up before the sockets: a daemon that cannot serve its metrics
  // stops before any client has connected to it.
  RpcMetrics rpc_metrics;
  std::unique_ptr<MetricsServer> metrics_server;
  if (!config->metrics.listen.empty()) {
    const MetricsSources sources{.chunks = &chunks,
                                 .nvme = nvme.get(),
                                 .sessions = &sessions,
                                 .devices = &devices,
                                 .rpc = &rpc_metrics,
                                 .fallbacks = &fallbacks,
                                 .started = absl::Now()};
    absl::StatusOr<std::unique_ptr<MetricsServer>> m =
        MetricsServer::Start(config->metrics.listen, [sources] { return RenderMetrics(sources); });
    if (!m.ok()) {
      spdlog::critical(
          "metrics: {} (set metrics.listen / --metrics_listen; \"none\" or an empty "
          "metrics.listen for no endpoint)",
          m.status().message());
      return kStartupError;
    }
    metrics_server = std::move(*m);
    if (!metrics_server->loopback()) {
      spdlog::warn(
          "metrics: {} is reachable from other hosts; the figures name users, chunks and "
          "devices. Bind it to 127.0.0.1 unless a firewall guards it",
          metrics_server->address());
    }
    spdlog::info("serving metrics on {}", metrics_server->url());
  }

  // From here on a signal shuts down in order: the sockets it publishes are removed again.
  signals.Serving();
  constexpr mode_t kSocketMode = 0660;
  UniqueFd session_listener;
  if (absl::Status s =
          PublishSocket(config->socket_dir, kSessionSocketName, kSocketMode, socket_gid,
                        [&](const std::string& path) -> absl::Status {
                          absl::StatusOr<UniqueFd> l = ListenSeqpacket(path, 0600);
                          if (!l.ok()) return l.status();
                          session_listener = std::move(*l);
                          return absl::OkStatus();
                        });
      !s.ok()) {
    spdlog::critical("session socket: {}", s.message());
    return kStartupError;
  }
  absl::StatusOr<std::unique_ptr<SessionBroker>> broker =
      SessionBroker::Start(std::move(session_listener), &sessions, &chunks, host->get(),
                           device_pool.get(), devices, config->limits.connections_per_uid);
  if (!broker.ok()) {
    spdlog::critical("session socket: {}", broker.status().message());
    return kStartupError;
  }
  std::unique_ptr<RpcServer> rpc;
  if (absl::Status s = PublishSocket(
          config->socket_dir, kRpcSocketName, kSocketMode, socket_gid,
          [&](const std::string& path) -> absl::Status {
            absl::StatusOr<std::unique_ptr<RpcServer>> r = RpcServer::Start(
                path,
                RpcServerDeps{&sessions, &chunks, devices, nvme.get(), &rpc_metrics, &fallbacks});
            if (!r.ok()) return r.status();
            rpc = std::move(*r);
            return absl::OkStatus();
          });
      !s.ok()) {
    spdlog::critical("gRPC socket: {}", s.message());
    return kStartupError;
  }
  spdlog::info("serving gRPC on unix:{} and sessions on {}", rpc_path, session_path);
  sd_notify(0, "READY=1\nSTATUS=serving");

  // Wait for SIGTERM/SIGINT, pinging the systemd watchdog when it is enabled.
  uint64_t watchdog_usec = 0;
  const bool watchdog = sd_watchdog_enabled(0, &watchdog_usec) > 0;
  const char* sig =
      signals.Wait(watchdog ? absl::Microseconds(watchdog_usec / 2) : absl::Hours(1), [watchdog] {
        if (watchdog) sd_notify(0, "WATCHDOG=1");
      });
  spdlog::info("received {}; shutting down", sig);
  sd_notify(0, "STOPPING=1");
  metrics_server.reset();
  rpc->Shutdown(absl::Seconds(5));
  broker->reset();            // ends every session
  chunks.WriteDownForStop();  // persistent chunks whose current version is only in memory
  // Transfers in flight settle before the chunk table goes. A move can hand over between the two
  // (NVMe -> GPU pipelining, GPU -> host -> NVMe write-back), so drain both twice.
  for (int round = 0; round < 2; ++round) {
    if (device != nullptr) device->Drain();
    if (nvme != nullptr) nvme->Drain();
  }
  host_registration.reset();
  unlink(rpc_path.c_str());
  unlink(session_path.c_str());
  spdlog::info("tierd stopped");
  return 0;
}

}  // namespace
}  // namespace tierd::daemon

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "the tierd daemon: owns pinned host memory, NVMe regions and a GPU memory pool, and moves "
      "tensor chunks between them for the training processes that share it.\n\nUsage: tierd "
      "[--config FILE] [flags]\n"
      "Flags override the config file; each flag names its config key in [brackets].");
  absl::SetFlagsUsageConfig(
      {.contains_helpshort_flags =
           [](absl::string_view f) { return f.find("daemon/main") != absl::string_view::npos; },
       .contains_help_flags =
           [](absl::string_view f) { return f.find("daemon/main") != absl::string_view::npos; },
       .version_string = [] { return std::string("tierd " TIERD_VERSION "\n"); }});
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "tierd: unexpected argument '%s' (see tierd --help)\n", rest[1]);
    return 2;
  }
  return tierd::daemon::Run();
}
