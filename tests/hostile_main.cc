// tierd-hostile: hostile traffic (tests/hostile_traffic.h) against a daemon of its own, in rounds,
// with the daemon's resident set and its tiers' accounting after each round. The long form of
// HostileTrafficTest, for docs/benchmarks/daemon.md:
//
//   tierd-hostile [--rounds=10] [--requests=10000] [--seed=1] [--env=NAME=VALUE]...
//                 [-- DAEMON FLAGS...]
//
// Prints a line a round: requests sent, RSS (all, anonymous, shared memory), each tier's bytes in
// use against the bytes of the chunk copies it holds, chunks left by the round (persistent ones,
// freed before the next). Exits 1 when a tier's bytes in use differ from its copies, or the daemon
// fails a request.
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "testing/daemon_process.h"
#include "tests/hostile_traffic.h"

namespace {

using namespace tierd::testing;

bool Flag(std::string_view arg, std::string_view name, uint64_t* out) {
  if (!arg.starts_with(name) || arg.size() <= name.size() || arg[name.size()] != '=') return false;
  const std::string value(arg.substr(name.size() + 1));
  return absl::SimpleAtoi(value, out);
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t rounds = 10, requests = 10000, seed = 1;
  std::vector<std::string> env;  // --env=NAME=VALUE: the daemon's environment
  std::vector<std::string> daemon_args = {"--host_capacity=256MiB",  "--host_segment_size=16MiB",
                                          "--lock_memory=false",     "--device=emulated",
                                          "--device_capacity=64MiB", "--device_segment_size=16MiB",
                                          "--probe_bytes=0",         "--log_level=warn"};
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "--") {
      for (++i; i < argc; ++i) daemon_args.push_back(argv[i]);
      break;
    }
    if (a.starts_with("--env=")) {
      env.emplace_back(a.substr(6));
      continue;
    }
    if (!Flag(a, "--rounds", &rounds) && !Flag(a, "--requests", &requests) &&
        !Flag(a, "--seed", &seed)) {
      std::fprintf(stderr,
                   "usage: tierd-hostile [--rounds=10] [--requests=10000] [--seed=1] "
                   "[-- DAEMON FLAGS...]\n");
      return 2;
    }
  }
  auto daemon = DaemonProcess::Start({.binary = ExecutableDir() + "/../daemon/tierd",
                                      .args = daemon_args,
                                      .nvme_region_size = "512MiB",
                                      .env = env});
  if (!daemon.ok()) {
    std::fprintf(stderr, "tierd-hostile: %s\n", std::string(daemon.status().message()).c_str());
    return 1;
  }
  const std::string& dir = (*daemon)->socket_dir();
  std::printf(
      "round  requests  rss_mib  anon_mib  shmem_mib  host used/copies  nvme used/copies  device "
      "used/copies  "
      "left\n");
  std::printf("start         0  %7.1f  %8.1f  %9.1f\n", RssBytes((*daemon)->pid()) / 1048576.0,
              StatusBytes((*daemon)->pid(), "RssAnon") / 1048576.0,
              StatusBytes((*daemon)->pid(), "RssShmem") / 1048576.0);
  bool ok = true;
  for (uint64_t r = 1; r <= rounds && ok; ++r) {
    absl::StatusOr<HostileTrafficReport> sent =
        SendHostileTraffic({.socket_dir = dir, .seed = seed * 1000 + r, .requests = requests});
    if (!sent.ok()) {
      std::fprintf(stderr, "tierd-hostile: %s\n", std::string(sent.status().message()).c_str());
      ok = false;
      break;
    }
    absl::StatusOr<TierAccounting> a = SettledAccounting(dir);
    if (!a.ok()) {
      std::fprintf(stderr, "tierd-hostile: %s\n", std::string(a.status().message()).c_str());
      ok = false;
      break;
    }
    if (absl::Status s = FreeEverything(dir); !s.ok()) {
      std::fprintf(stderr, "tierd-hostile: %s\n", std::string(s.message()).c_str());
      ok = false;
    }
    // The daemon gives memory back at most every 2 s after large requests: read it after that.
    absl::SleepFor(absl::Seconds(3));
    const pid_t pid = (*daemon)->pid();
    std::printf("%5llu  %8llu  %7.1f  %8.1f  %9.1f", static_cast<unsigned long long>(r),
                static_cast<unsigned long long>(r * requests), RssBytes(pid) / 1048576.0,
                StatusBytes(pid, "RssAnon") / 1048576.0, StatusBytes(pid, "RssShmem") / 1048576.0);
    for (int t = 1; t < 4; ++t) {
      std::printf("  %8llu/%-8llu", static_cast<unsigned long long>(a->used_bytes[t]),
                  static_cast<unsigned long long>(a->copies_bytes[t]));
      ok = ok && a->used_bytes[t] == a->copies_bytes[t];
    }
    std::printf("  %llu\n", static_cast<unsigned long long>(a->chunks));
    std::fflush(stdout);
  }
  if (!ok)
    std::fprintf(stderr, "tierd-hostile: FAILED; the daemon's log is %s/daemon.log\n", dir.c_str());
  const int stopped = (*daemon)->Stop();
  return ok && stopped == 0 ? 0 : 1;
}
