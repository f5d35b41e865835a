#include "testing/daemon_process.h"

#include <fcntl.h>
#include <grp.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <spawn.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/unique_fd.h"
#include "common/unix_socket.h"

extern char** environ;

namespace tierd::testing {
namespace {

// In the child, before exec: io_uring_setup fails with EPERM from now on.
bool BlockIoUring() {
  struct sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog program = {sizeof(filter) / sizeof(filter[0]), filter};
  return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) == 0;
}

// This process's environment with `overrides` ("NAME=value") replacing or adding entries.
std::vector<std::string> Environment(const std::vector<std::string>& overrides) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string name = entry.substr(0, entry.find('=') + 1);
    const bool overridden = std::any_of(overrides.begin(), overrides.end(),
                                        [&](const std::string& o) { return o.starts_with(name); });
    if (!overridden) env.push_back(entry);
  }
  env.insert(env.end(), overrides.begin(), overrides.end());
  return env;
}

std::vector<char*> Pointers(const std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (const std::string& s : strings) pointers.push_back(const_cast<char*>(s.c_str()));
  pointers.push_back(nullptr);
  return pointers;
}

// `dies_with_parent`: the child gets SIGTERM when the thread that spawned it ends, so that a test
// killed at its timeout leaves no daemon running.
pid_t Spawn(const std::vector<std::string>& argv, const std::string& output_path,
            bool without_io_uring = false, const std::vector<std::string>& env_overrides = {},
            bool dies_with_parent = false) {
  const std::vector<std::string> env_strings = Environment(env_overrides);
  std::vector<char*> env = Pointers(env_strings);
  std::vector<char*> args = Pointers(argv);
  if (without_io_uring || dies_with_parent) {
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid != 0) return pid;
    // Only system calls from here to the exec: the parent has other threads.
    if (dies_with_parent && (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != parent)) {
      _exit(125);
    }
    const int out = open(output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(out, 1);
    dup2(out, 2);
    if (without_io_uring && !BlockIoUring()) _exit(126);
    execve(args[0], args.data(), env.data());
    _exit(127);
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = -1;
  int err = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  return err == 0 ? pid : -1;
}

int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// True once a listener accepts on the socket: the gRPC socket's file exists from bind(), a moment
// before listen(), and a client connecting in between is refused.
bool AcceptsStreamConnections(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return false;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  return fd && connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
}

}  // namespace

uint64_t StatusBytes(pid_t pid, std::string_view field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(in, line);) {
    uint64_t kb = 0;
    if (std::string_view(line).starts_with(field) && line.size() > field.size() &&
        line[field.size()] == ':' &&
        absl::SimpleAtoi(
            absl::StripAsciiWhitespace(absl::StripSuffix(line.substr(field.size() + 1), "kB")),
            &kb)) {
      return kb << 10;
    }
  }
  return 0;
}

uint64_t RssBytes(pid_t pid) { return StatusBytes(pid, "VmRSS"); }

std::string ExecutableDir() {
  return std::filesystem::read_symlink("/proc/self/exe").parent_path().string();
}

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(const DaemonOptions& options) {
  char tmpl[] = "/tmp/tierd-test-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return absl::ErrnoToStatus(errno, "mkdtemp");
  chmod(tmpl, 0711);
  auto daemon = std::unique_ptr<DaemonProcess>(new DaemonProcess());
  daemon->dir_ = tmpl;
  // State and a small NVMe region inside the directory, so that every daemon is independent.
  std::vector<std::string> argv = {
      options.binary, absl::StrCat("--socket_dir=", tmpl),
      absl::StrCat("--state_dir=", tmpl, "/state"),
      absl::StrCat("--nvme_regions=", tmpl, "/nvme0.region:", options.nvme_region_size),
      // A free port: tests run side by side (an arg may override).
      "--metrics_listen=127.0.0.1:0", "--log_level=debug"};
  if (!options.socket_group.empty()) argv.push_back("--socket_group=" + options.socket_group);
  argv.insert(argv.end(), options.args.begin(), options.args.end());
  daemon->argv_ = std::move(argv);
  daemon->without_io_uring_ = options.without_io_uring;
  daemon->env_ = options.env;
  daemon->start_timeout_ = options.start_timeout;
  if (absl::Status s = daemon->Launch(); !s.ok()) return s;
  return daemon;
}

absl::Status DaemonProcess::Launch() {
  pid_ = Spawn(argv_, dir_ + "/daemon.log", without_io_uring_, env_, /*dies_with_parent=*/true);
  if (pid_ < 0) return absl::InternalError("cannot spawn " + argv_[0]);
  const absl::Time deadline = absl::Now() + start_timeout_;
  while (absl::Now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::FailedPreconditionError(
          absl::StrCat("tierd exited during start-up (status ", ExitCode(status), "): ", Log()));
    }
    if (ConnectSeqpacket(dir_ + "/tierd.session.sock").ok() &&
        AcceptsStreamConnections(dir_ + "/tierd.sock")) {
      return absl::OkStatus();
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "tierd did not start within ", absl::FormatDuration(start_timeout_), ": ", Log()));
}

void DaemonProcess::Kill() {
  if (pid_ < 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

absl::Status DaemonProcess::Restart() {
  Kill();
  return Launch();
}

int DaemonProcess::Stop() {
  if (pid_ < 0) return -1;
  kill(pid_, SIGTERM);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return ExitCode(status);
}

int DaemonProcess::StopWithin(absl::Duration timeout) {
  if (pid_ < 0) return -1;
  kill(pid_, SIGTERM);
  for (const absl::Time give_up = absl::Now() + timeout; absl::Now() < give_up;) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return ExitCode(status);
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  Kill();
  return -1;
}

std::string DaemonProcess::Log() const { return ReadFile(dir_ + "/daemon.log"); }

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

int RunProcess(const std::vector<std::string>& argv, std::string* output, bool without_io_uring) {
  char tmpl[] = "/tmp/tierd-run-XXXXXX";
  int fd = mkstemp(tmpl);
  if (fd < 0) return -1;
  close(fd);
  pid_t pid = Spawn(argv, tmpl, without_io_uring);
  int status = 0;
  if (pid > 0) waitpid(pid, &status, 0);
  if (output != nullptr) *output = ReadFile(tmpl);
  unlink(tmpl);
  return pid > 0 ? ExitCode(status) : -1;
}

bool StartProcess(const std::vector<std::string>& argv, pid_t* pid, int* stdout_fd) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return false;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], 1);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int err = posix_spawn(pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  if (err != 0) {
    close(pipe_fds[0]);
    return false;
  }
  *stdout_fd = pipe_fds[0];
  return true;
}

}  // namespace tierd::testing
