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
#include "common/version.h"
#include "daemon/config.h"
#include "daemon/daemon.h"
#include "daemon/util/daemon_files.h"
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
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Create(*config);
  if (!daemon.ok()) {
    spdlog::critical("{}", daemon.status().message());
    return kStartupError;
  }
  // From here on a signal shuts down in order: the sockets the daemon publishes are removed again.
  signals.Serving();
  if (absl::Status s = (*daemon)->Serve(socket_gid); !s.ok()) {
    spdlog::critical("{}", s.message());
    return kStartupError;
  }
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
  (*daemon)->Stop();
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
