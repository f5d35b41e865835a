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

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/fmt_absl.h"
#include "common/version.h"
#include "daemon/config.h"
#include "daemon/config_flags.h"
#include "daemon/daemon.h"
#include "daemon/util/daemon_files.h"
#include "daemon/util/memory_trimmer.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {
namespace {

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

int Run(const CommandLine& line) {
  absl::StatusOr<DaemonConfig> config = BuildConfig(line);
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
  tierd::daemon::MemoryTrimmer::ConfigureAllocator();
  absl::StatusOr<tierd::daemon::CommandLine> line =
      tierd::daemon::ParseCommandLine(absl::MakeConstSpan(argv, argc));
  if (!line.ok()) {
    std::fprintf(stderr, "tierd: %s\n", std::string(line.status().message()).c_str());
    return tierd::daemon::kConfigError;
  }
  if (line->help) {
    std::fputs(tierd::daemon::UsageText().c_str(), stdout);
    return 0;
  }
  if (line->version) {
    std::printf("tierd %s\n", TIERD_VERSION);
    return 0;
  }
  if (line->check) {  // as Run reads it, and nothing more: no directory, file or memory touched
    absl::StatusOr<tierd::daemon::DaemonConfig> config = tierd::daemon::BuildConfig(*line);
    if (!config.ok()) {
      std::fprintf(stderr, "tierd: %s\n", std::string(config.status().message()).c_str());
      return tierd::daemon::kConfigError;
    }
    std::fputs(tierd::daemon::ConfigText(*config).c_str(), stdout);
    std::fputs("tierd: the configuration is valid\n", stderr);
    return 0;
  }
  return tierd::daemon::Run(*line);
}
