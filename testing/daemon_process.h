// Starts a real tierd process on a private socket directory, for integration tests and
// benchmarks, and stops it with SIGTERM.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tierd::testing {

struct DaemonOptions {
  std::string binary;             // path of tierd
  std::vector<std::string> args;  // extra flags
  std::string socket_group;       // --socket_group, when set
  // Runs the daemon where io_uring_setup fails with EPERM, as under Docker's default seccomp
  // profile.
  bool without_io_uring = false;
  // Size of the NVMe region made inside the directory (a tier-sized test needs a bigger one).
  std::string nvme_region_size = "256MiB";
  // How long start-up may take before Start gives up: pinning host memory runs at well under
  // 1 GB/s on some machines, so daemons with gigabytes of host capacity need longer.
  absl::Duration start_timeout = absl::Seconds(30);
  // "NAME=value" entries set in the daemon's environment, over the test's own.
  std::vector<std::string> env;
};

// The daemon gets SIGTERM when the thread that started (or restarted) it ends, as when the test's
// process is killed at its timeout: start it from a thread that outlives it, the test's own.
class DaemonProcess {
 public:
  // Makes a temporary directory (mode 0711, so other users can reach the sockets), starts the
  // daemon on it and waits until both sockets accept connections.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(const DaemonOptions& options);
  ~DaemonProcess();

  const std::string& socket_dir() const { return dir_; }
  pid_t pid() const { return pid_; }
  // Sends SIGTERM and waits; returns the exit status (or 128+signal).
  int Stop();
  // Stop, but a daemon still running after `timeout` is killed (SIGKILL) and -1 returned.
  int StopWithin(absl::Duration timeout);
  // SIGKILL: the daemon dies without any cleanup, as in a crash.
  void Kill();
  // Starts the daemon again on the same directory with the same flags.
  absl::Status Restart();
  // What the daemon wrote to stdout and stderr so far.
  std::string Log() const;

 private:
  absl::Status Launch();

  std::string dir_;
  std::vector<std::string> argv_;
  bool without_io_uring_ = false;
  std::vector<std::string> env_;
  absl::Duration start_timeout_ = absl::Seconds(30);
  pid_t pid_ = -1;
};

// Runs `argv` to completion; returns its exit status and, in `output`, its stdout and stderr.
// `without_io_uring`: as in DaemonOptions.
int RunProcess(const std::vector<std::string>& argv, std::string* output,
               bool without_io_uring = false);

// Starts `argv` with its stdout on a pipe; the caller reads `*stdout_fd`, and kills and reaps
// `*pid`. Returns false if it cannot start.
bool StartProcess(const std::vector<std::string>& argv, pid_t* pid, int* stdout_fd);

// The directory of the running executable (tests find the daemon beside their build tree).
std::string ExecutableDir();

// A field of a process's /proc/PID/status given in kB ("VmRSS", "RssAnon", "RssShmem"), in
// bytes; 0 when the process or the field is gone.
uint64_t StatusBytes(pid_t pid, std::string_view field);

// A process's resident set (VmRSS), in bytes; 0 when it is gone.
uint64_t RssBytes(pid_t pid);

}  // namespace tierd::testing
