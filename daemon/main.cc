// tierd: the per-node daemon that owns the memory tiers.
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "common/fmt_absl.h"
#include "common/sizes.h"
#include "common/version.h"
#include "daemon/chunk_service.h"
#include "daemon/config.h"
#include "daemon/device_probe.h"
#include "daemon/host_segment_pool.h"
#include "daemon/rpc_server.h"
#include "daemon/session.h"
#include "daemon/session_broker.h"
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

ABSL_FLAG(std::string, lock_memory, "",
          "true or false: mlock the host tier; false only for development without memlock "
          "rights [host.lock_memory; default true]");

namespace tierd {
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
  if (std::string v = absl::GetFlag(FLAGS_lock_memory); !v.empty()) {
    if (v != "true" && v != "false") {
      return absl::InvalidArgumentError(
          absl::StrCat("--lock_memory must be true or false, not '", v, "'"));
    }
    config.host.lock_memory = v == "true";
  }
  return config;
}

absl::Status SetGroup(const std::string& path, const std::string& group) {
  if (group.empty()) return absl::OkStatus();
  struct group* g = getgrnam(group.c_str());
  if (g == nullptr) {
    return absl::NotFoundError(absl::StrCat("socket_group '", group, "' does not exist"));
  }
  if (chown(path.c_str(), static_cast<uid_t>(-1), g->gr_gid) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("chown('", path, "', group ", group, ")"));
  }
  return absl::OkStatus();
}

int Run() {
  absl::StatusOr<DaemonConfig> config = BuildConfig();
  if (!config.ok()) {
    std::fprintf(stderr, "tierd: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  spdlog::set_level(spdlog::level::from_str(config->log_level));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  spdlog::info("tierd {} starting (pid {})", TIERD_VERSION, getpid());

  // Signals are taken synchronously by this thread; block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::error_code ec;
  std::filesystem::create_directories(config->socket_dir, ec);
  if (ec) {
    spdlog::critical("cannot create socket_dir '{}': {}", config->socket_dir, ec.message());
    return 1;
  }
  const std::string rpc_path = config->socket_dir + "/tierd.sock";
  const std::string session_path = config->socket_dir + "/tierd.session.sock";

  absl::StatusOr<std::unique_ptr<HostSegmentPool>> host = HostSegmentPool::Create(config->host);
  if (!host.ok()) {
    spdlog::critical("host tier: {}", host.status().message());
    return 1;
  }
  DeviceProbe devices = ProbeDevices();
  if (devices.devices.empty()) {
    spdlog::info("device tier: none ({}); serving the host tier only", devices.status);
  } else {
    for (const GpuDevice& d : devices.devices) {
      spdlog::info("GPU {} {} ({}); the device tier is not enabled in this version", d.uuid, d.name,
                   FormatSize(d.memory_bytes));
    }
  }

  std::array<Tier*, kTierKinds> tiers{};
  tiers[static_cast<int>(TierKind::kHost)] = host->get();
  ChunkService chunks(tiers);
  SessionRegistry sessions;

  constexpr unsigned kSocketMode = 0660;
  absl::StatusOr<std::unique_ptr<SessionBroker>> broker =
      SessionBroker::Start(session_path, kSocketMode, &sessions, &chunks, host->get());
  if (!broker.ok()) {
    spdlog::critical("session socket: {}", broker.status().message());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<RpcServer>> rpc =
      RpcServer::Start(rpc_path, kSocketMode, RpcServerDeps{&sessions, &chunks, devices});
  if (!rpc.ok()) {
    spdlog::critical("gRPC socket: {}", rpc.status().message());
    return 1;
  }
  for (const std::string& path : {rpc_path, session_path}) {
    if (absl::Status s = SetGroup(path, config->socket_group); !s.ok()) {
      spdlog::critical("{}", s.message());
      return 1;
    }
  }
  spdlog::info("serving gRPC on unix:{} and sessions on {}", rpc_path, session_path);
  sd_notify(0, "READY=1\nSTATUS=serving");

  // Wait for SIGTERM/SIGINT, pinging the systemd watchdog when it is enabled.
  uint64_t watchdog_usec = 0;
  const bool watchdog = sd_watchdog_enabled(0, &watchdog_usec) > 0;
  timespec tick =
      absl::ToTimespec(watchdog ? absl::Microseconds(watchdog_usec / 2) : absl::Hours(1));
  int sig;
  for (;;) {
    sig = sigtimedwait(&signals, nullptr, &tick);
    if (sig > 0) break;
    if (watchdog) sd_notify(0, "WATCHDOG=1");
  }
  spdlog::info("received {}; shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  sd_notify(0, "STOPPING=1");
  (*rpc)->Shutdown(absl::Seconds(5));
  broker->reset();  // ends every session
  unlink(rpc_path.c_str());
  unlink(session_path.c_str());
  spdlog::info("tierd stopped; {} persistent chunks were held in memory only",
               chunks.chunk_count());
  return 0;
}

}  // namespace
}  // namespace tierd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "the tierd daemon: owns pinned host memory (and later NVMe and GPU memory) and serves "
      "chunks of it to training processes.\n\nUsage: tierd [--config FILE] [flags]\n"
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
  return tierd::Run();
}
