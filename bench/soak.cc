// tierd-bench soak: one daemon shared for N minutes by clients of every kind — movers that check
// every byte they read back, a keeper of persistent chunks that must survive daemon crashes, and a
// hostile tenant (another user where the bench runs as root) — while clients and the daemon are
// SIGKILLed along the way. Reports operations, kills, faults, reclaim times, leaks (bytes, fds,
// RSS) and wrong bytes; exits 1 when any of crashes, wrong or lost bytes, escapes or leaks is not
// 0.
//
// The clients, one role a process, are in bench/soak_client.cc.
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/soak.h"

namespace tierd::bench {
namespace {

struct SoakOptions {
  double minutes = 30;
  int movers = 3;
  absl::Duration client_kill_every = absl::Seconds(10);
  absl::Duration daemon_kill_every = absl::Minutes(4);
  std::string dir = "/tmp";
  bool json = false;
};

struct Totals {
  std::map<std::string, uint64_t> counters;  // summed over every client
  uint64_t client_kills = 0, daemon_kills = 0, daemon_crashes = 0, client_failures = 0;
  uint64_t reclaim_timeouts = 0;
  std::vector<double> reclaim_ms, probe_ms, restart_ms;
  std::vector<std::string> problems;
};

struct Child {
  std::string role;
  pid_t pid = -1;
  int out = -1;
  std::string pending;  // a partial line
  uint64_t session = 0;
  bool killed = false;
};

std::string ProcState(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat;
  std::getline(in, stat);
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? "" : stat.substr(paren + 2, 1);
}

size_t OpenFds(pid_t pid) {
  std::error_code ec;
  size_t n = 0;
  for (auto it = std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

// In a forked child as root: drops to the other user (nobody), groups and all.
bool BecomeNobody() {
  return setgroups(0, nullptr) == 0 && setgid(kNobody) == 0 && setuid(kNobody) == 0;
}

// Whether the other user can run `binary`: not where a directory above it is closed to others
// (a checkout in a home directory of mode 700).
bool OtherUserCanRun(const std::string& binary) {
  const pid_t pid = fork();
  if (pid == 0) _exit(BecomeNobody() && access(binary.c_str(), X_OK) == 0 ? 0 : 1);
  int status = 0;
  return pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
         WEXITSTATUS(status) == 0;
}

class SoakRun {
 public:
  explicit SoakRun(const SoakOptions& o) : o_(o), rng_(std::random_device{}()) {}

  int Run() {
    const bool root = geteuid() == 0;
    // Decided once, before the daemon's quota names the hostile tenant's user.
    hostile_uid_ = root && OtherUserCanRun(Self()) ? kNobody : geteuid();
    std::error_code ec;
    std::filesystem::create_directories(o_.dir, ec);
    region_ = std::make_unique<RegionFile>(absl::StrCat(o_.dir, "/soak-", getpid(), ".region"));
    config_ = absl::StrCat(o_.dir, "/soak-", getpid(), ".toml");
    state_ = absl::StrCat(o_.dir, "/soak-", getpid(), ".kept");
    std::ofstream(config_) << "[limits]\nconnections_per_uid = " << kConnections
                           << "\nsessions_per_uid = 16\nschedule_accesses_per_session = "
                           << kScheduleAccesses << "\n\n[[quota.users]]\nuid = " << hostile_uid_
                           << "\nhost = \"" << (kHostQuota >> 20) << "MiB\"\nnvme = \"256MiB\"\n";
    std::vector<std::string> args = {"--config=" + config_,
                                     "--host_capacity=1GiB",
                                     "--host_segment_size=64MiB",
                                     "--device=emulated",
                                     "--device_capacity=512MiB",
                                     "--device_segment_size=64MiB",
                                     absl::StrCat("--nvme_regions=", region_->path(), ":2GiB"),
                                     "--probe_bytes=16MiB",
                                     "--log_level=info"};
    auto d = testing::DaemonProcess::Start({.binary = testing::ExecutableDir() + "/../daemon/tierd",
                                            .args = args,
                                            .socket_group = root ? "nogroup" : ""});
    if (!d.ok()) Die(d.status(), "starting tierd");
    daemon_ = std::move(*d);
    Baseline();
    for (int i = 0; i < o_.movers; ++i) Spawn("mover");
    Spawn("keeper");
    Spawn("hostile");

    const absl::Time start = absl::Now();
    const absl::Time end = start + absl::Seconds(o_.minutes * 60);
    absl::Time next_client_kill = start + o_.client_kill_every;
    absl::Time next_daemon_kill = start + o_.daemon_kill_every;
    absl::Time next_probe = start;
    absl::Time next_status = start + absl::Minutes(1);
    while (absl::Now() < end) {
      Pump(absl::Milliseconds(100));
      Reap(/*respawn=*/true);
      if (!DaemonAlive()) {
        t_.daemon_crashes++;
        t_.problems.push_back("the daemon died on its own:\n" + Tail(daemon_->Log()));
        RestartDaemon(/*crashed=*/true);
        continue;
      }
      const absl::Time now = absl::Now();
      if (now >= next_probe) {
        Probe();
        next_probe = now + absl::Seconds(1);
      }
      if (now >= next_client_kill) {
        KillAClient();
        next_client_kill = absl::Now() + o_.client_kill_every;
      }
      if (now >= next_daemon_kill && end - now > absl::Minutes(1)) {
        t_.daemon_kills++;
        RestartDaemon(/*crashed=*/false);
        next_daemon_kill = absl::Now() + o_.daemon_kill_every;
      }
      if (now >= next_status && !o_.json) {
        std::fprintf(stderr,
                     "soak: %.0f s: %" PRIu64 " ops, %" PRIu64 " client kills, %" PRIu64
                     " daemon kills, %" PRIu64 " wrong bytes\n",
                     absl::ToDoubleSeconds(now - start), t_.counters["ops"], t_.client_kills,
                     t_.daemon_kills, t_.counters["wrong_bytes"]);
        next_status = now + absl::Minutes(1);
      }
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    Finish();
    return Print(seconds);
  }

 private:
  static constexpr uint32_t kConnections = 32;
  static constexpr uint64_t kScheduleAccesses = 4096;
  static constexpr uint64_t kHostQuota = 128ull << 20;

  std::string Self() const { return testing::ExecutableDir() + "/tierd-bench"; }

  void Spawn(const std::string& role, bool final_pass = false) {
    std::vector<std::string> argv = {Self(),
                                     "soak-client",
                                     "--role=" + role,
                                     "--socket_dir=" + daemon_->socket_dir(),
                                     absl::StrCat("--seed=", rng_()),
                                     "--state=" + state_,
                                     absl::StrCat("--quota_host=", kHostQuota),
                                     absl::StrCat("--connections=", kConnections),
                                     absl::StrCat("--schedule_accesses=", kScheduleAccesses)};
    if (final_pass) argv.push_back("--final");
    const bool as_other = role == "hostile" && hostile_uid_ != geteuid();
    if (as_other) argv.push_back("--other_user");
    int pipe_fds[2];
    if (pipe2(pipe_fds, O_CLOEXEC) != 0) Die(absl::ErrnoToStatus(errno, "pipe"), "soak");
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(pipe_fds[1], 1);
      if (as_other && !BecomeNobody()) _exit(126);
      execv(args[0], args.data());
      _exit(127);
    }
    close(pipe_fds[1]);
    fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
    children_.push_back({.role = role, .pid = pid, .out = pipe_fds[0]});
  }

  // Reads what the children reported, for up to `wait`.
  void Pump(absl::Duration wait) {
    std::vector<pollfd> fds;
    for (const Child& c : children_) fds.push_back({c.out, POLLIN, 0});
    poll(fds.data(), fds.size(), static_cast<int>(absl::ToInt64Milliseconds(wait)));
    for (Child& c : children_) Drain(c);
  }

  void Drain(Child& c) {
    char buf[65536];
    for (;;) {
      const ssize_t n = read(c.out, buf, sizeof(buf));
      if (n <= 0) break;
      c.pending.append(buf, n);
    }
    size_t nl;
    while ((nl = c.pending.find('\n')) != std::string::npos) {
      const std::string line = c.pending.substr(0, nl);
      c.pending.erase(0, nl + 1);
      std::vector<std::string> kv = absl::StrSplit(line, ' ');
      uint64_t v = 0;
      if (kv.size() != 2 || !absl::SimpleAtoi(kv[1], &v)) continue;
      if (kv[0] == "session") {
        c.session = v;
      } else {
        t_.counters[kv[0]] += v;
      }
    }
  }

  // Collects the children that ended; a client that ended on its own other than because its
  // daemon went away is a failure (wrong data, an escape, an error it could not survive).
  void Reap(bool respawn) {
    for (size_t i = 0; i < children_.size();) {
      Child& c = children_[i];
      int status = 0;
      if (waitpid(c.pid, &status, WNOHANG) != c.pid) {
        ++i;
        continue;
      }
      Drain(c);
      close(c.out);
      const bool by_us = c.killed && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (!by_us && code != 0 && code != kDaemonGone) {
        t_.client_failures++;
        t_.problems.push_back(absl::StrCat(c.role, " exited with status ", code));
      }
      const std::string role = c.role;
      children_.erase(children_.begin() + i);
      if (respawn) Spawn(role);
    }
  }

  bool DaemonAlive() const {
    const std::string s = ProcState(daemon_->pid());
    return !s.empty() && s != "Z";
  }

  // A call every second from a session of its own: the daemon answers everyone, whatever the
  // others do.
  void Probe() {
    if (probe_ == nullptr) {
      auto c = Client::Connect({.socket_dir = daemon_->socket_dir(), .client_name = "soak-probe"});
      if (!c.ok()) return;
      probe_ = std::move(*c);
    }
    absl::Status s;
    const double ms = TimeMs([&] { s = probe_->GetNodeInfo().status(); });
    if (!s.ok()) {
      probe_.reset();
      return;
    }
    t_.probe_ms.push_back(ms);
  }

  // SIGKILL one client at random and time until the daemon has ended its session.
  void KillAClient() {
    if (children_.empty()) return;
    Child& c = children_[rng_() % children_.size()];
    if (c.session == 0 || c.killed) return;
    const uint64_t session = c.session;
    kill(c.pid, SIGKILL);
    c.killed = true;
    t_.client_kills++;
    const absl::Time killed = absl::Now();
    for (;;) {
      if (probe_ == nullptr) Probe();
      if (probe_ == nullptr) return;
      auto info = probe_->GetNodeInfo(/*list_sessions=*/true);
      if (!info.ok()) return;
      bool open = false;
      for (const SessionSummary& s : info->session_list) open |= s.id == session;
      const absl::Duration took = absl::Now() - killed;
      if (!open) {
        t_.reclaim_ms.push_back(absl::ToDoubleMilliseconds(took));
        return;
      }
      if (took > absl::Seconds(30)) {
        t_.reclaim_timeouts++;
        t_.problems.push_back(
            absl::StrCat("session ", session, " of a killed ", c.role, " still open after 30 s"));
        return;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  // SIGKILL the daemon (unless it died already) and start it again on the same state and
  // regions; the clients notice, end, and are started again.
  void RestartDaemon(bool crashed) {
    Scan(daemon_->Log());
    probe_.reset();
    const absl::Time t0 = absl::Now();
    absl::Status s = daemon_->Restart();
    if (!s.ok()) Die(s, "restarting tierd");
    if (!crashed) t_.restart_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
    // The clients of the old daemon end (UNAVAILABLE); collect them before the baseline.
    for (absl::Time give_up = absl::Now() + absl::Seconds(30);
         !children_.empty() && absl::Now() < give_up;) {
      Pump(absl::Milliseconds(50));
      Reap(/*respawn=*/false);
    }
    for (Child& c : children_) {
      kill(c.pid, SIGKILL);
      c.killed = true;
      t_.problems.push_back(c.role + " did not notice its daemon's death within 30 s");
    }
    while (!children_.empty()) {
      Pump(absl::Milliseconds(50));
      Reap(/*respawn=*/false);
    }
    Baseline();
    for (int i = 0; i < o_.movers; ++i) Spawn("mover");
    Spawn("keeper");
    Spawn("hostile");
  }

  // The daemon's descriptors and memory with only the probe connected.
  void Baseline() {
    Probe();
    absl::SleepFor(absl::Milliseconds(200));
    base_fds_ = OpenFds(daemon_->pid());
    base_rss_ = testing::RssBytes(daemon_->pid());
  }

  void Scan(const std::string& log) {
    for (const char* bad : {"AddressSanitizer", "runtime error", "Assertion", "critical",
                            "use-after-free", "Check failed"}) {
      if (absl::StrContains(log, bad)) {
        t_.problems.push_back(absl::StrCat("the daemon's log says '", bad, "':\n", Tail(log)));
      }
    }
  }

  static std::string Tail(const std::string& log) {
    return log.substr(log.size() > 3000 ? log.size() - 3000 : 0);
  }

  // Ends every client, lets the keeper check and free its chunks, and checks that the daemon holds
  // nothing more than when it started: no bytes, no chunks, no descriptors.
  void Finish() {
    for (Child& c : children_) {
      kill(c.pid, SIGKILL);
      c.killed = true;
    }
    while (!children_.empty()) {
      Pump(absl::Milliseconds(50));
      Reap(/*respawn=*/false);
    }
    for (absl::Time give_up = absl::Now() + absl::Seconds(30);;) {
      Probe();
      auto info = probe_ ? probe_->GetNodeInfo() : absl::UnavailableError("no probe");
      if (info.ok() && info->sessions == 1) break;
      if (absl::Now() > give_up) {
        t_.problems.push_back("sessions of killed clients still open 30 s after the end");
        break;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    Spawn("keeper", /*final_pass=*/true);
    while (!children_.empty()) {
      Pump(absl::Milliseconds(50));
      Reap(/*respawn=*/false);
    }
    absl::SleepFor(absl::Milliseconds(500));
    auto info = probe_ ? probe_->GetNodeInfo() : absl::UnavailableError("no probe");
    if (!info.ok()) Die(info.status(), "GetNodeInfo");
    CheckSpace(*info);
    for (const TierStatus& tier : info->tiers) leaked_bytes_ += tier.used_bytes;
    leaked_chunks_ = info->chunks;
    end_fds_ = OpenFds(daemon_->pid());
    end_rss_ = testing::RssBytes(daemon_->pid());
    probe_.reset();
    Scan(daemon_->Log());
    const int stopped = daemon_->StopWithin(absl::Seconds(60));
    if (stopped != 0) t_.problems.push_back(absl::StrCat("tierd stopped with status ", stopped));
    std::filesystem::remove(config_);
    std::filesystem::remove(state_);
  }

  // Nothing moves: each tier's bytes in use must be the space its chunks take there.
  void CheckSpace(const NodeInfo& info) {
    auto chunks = probe_->ListChunks(/*all_sessions=*/true);
    if (!chunks.ok()) Die(chunks.status(), "ListChunks");
    std::map<Tier, uint64_t> space;
    for (const ChunkInfo& c : *chunks) {
      for (const auto& [tier, bytes] : c.space) space[tier] += bytes;
    }
    for (const TierStatus& tier : info.tiers) {
      if (tier.used_bytes == space[tier.tier]) continue;
      t_.problems.push_back(absl::StrCat("tier ", static_cast<int>(tier.tier), " has ",
                                         tier.used_bytes, " bytes in use; its chunks take ",
                                         space[tier.tier]));
    }
  }

  int Print(double seconds) {
    const uint64_t wrong = t_.counters["wrong_bytes"], lost = t_.counters["lost_bytes"];
    const uint64_t escapes = t_.counters["escapes"];
    const int64_t fds = static_cast<int64_t>(end_fds_) - static_cast<int64_t>(base_fds_);
    const double rss_mib = (static_cast<double>(end_rss_) - base_rss_) / (1 << 20);
    auto pct = [](const std::vector<double>& v, double q) {
      return v.empty() ? 0.0 : Percentile(v, q);
    };
    Reporter out("soak", o_.json);
    if (!o_.json) std::printf("tierd-bench soak: %.1f minutes\n", seconds / 60);
    out.Add({"minutes", seconds / 60, "min", "", ""});
    out.Add({"client_ops", static_cast<double>(t_.counters["ops"]), "ops", "",
             absl::StrFormat("%.0f per second", t_.counters["ops"] / seconds)});
    out.Add({"verified_gib", t_.counters["verified_bytes"] / double(1 << 30), "GiB", "",
             "bytes read back and checked by movers"});
    out.Add({"wrong_bytes", static_cast<double>(wrong), "B", "", "must be 0"});
    out.Add({"persistent_checks", static_cast<double>(t_.counters["persistent_checks"]), "", "",
             absl::StrCat(t_.counters["persisted"], " versions made durable")});
    out.Add(
        {"lost_bytes", static_cast<double>(lost), "B", "", "acknowledged, then gone: must be 0"});
    out.Add({"client_kills", static_cast<double>(t_.client_kills), "", "", "SIGKILL"});
    out.Add({"daemon_kills", static_cast<double>(t_.daemon_kills), "", "", "SIGKILL, restarted"});
    out.Add({"daemon_crashes", static_cast<double>(t_.daemon_crashes), "", "", "must be 0"});
    out.Add({"hostile_attacks", static_cast<double>(t_.counters["attacks"]), "", "",
             hostile_uid_ == geteuid() ? "as the same user" : "as another user"});
    out.Add({"escapes", static_cast<double>(escapes), "", "", "must be 0"});
    out.Add({"refused", static_cast<double>(t_.counters["refused"]), "", "",
             "busy or full: FAILED_PRECONDITION, RESOURCE_EXHAUSTED"});
    out.Add({"errors", static_cast<double>(t_.counters["errors"]), "", "", "other failed calls"});
    out.Add({"reclaim_p50_ms", pct(t_.reclaim_ms, 0.5), "ms", "", "killed client's session ended"});
    out.Add({"reclaim_p99_ms", pct(t_.reclaim_ms, 0.99), "ms", "", ""});
    out.Add({"reclaim_max_ms", pct(t_.reclaim_ms, 1.0), "ms", "", ""});
    out.Add({"probe_p99_ms", pct(t_.probe_ms, 0.99), "ms", "", "GetNodeInfo of a bystander"});
    out.Add({"probe_max_ms", pct(t_.probe_ms, 1.0), "ms", "", ""});
    out.Add({"restart_p50_ms", pct(t_.restart_ms, 0.5), "ms", "", "SIGKILL to serving again"});
    out.Add({"leaked_bytes", static_cast<double>(leaked_bytes_), "B", "",
             absl::StrCat(leaked_chunks_, " chunks left; must be 0")});
    out.Add({"leaked_fds", static_cast<double>(fds), "", "", "since the last start; must be 0"});
    out.Add({"rss_growth_mib", rss_mib, "MiB", "", "since the last start"});
    for (const std::string& p : t_.problems) std::fprintf(stderr, "soak: %s\n", p.c_str());
    const bool clean = wrong == 0 && lost == 0 && escapes == 0 && t_.daemon_crashes == 0 &&
                       t_.client_failures == 0 && t_.reclaim_timeouts == 0 && leaked_bytes_ == 0 &&
                       leaked_chunks_ == 0 && fds == 0 && t_.problems.empty();
    if (!o_.json) std::printf("%s\n", clean ? "clean" : "NOT CLEAN (see above)");
    return clean ? 0 : 1;
  }

  SoakOptions o_;
  std::mt19937_64 rng_;
  uint32_t hostile_uid_ = 0;
  std::unique_ptr<RegionFile> region_;
  std::string config_, state_;
  std::unique_ptr<testing::DaemonProcess> daemon_;
  std::unique_ptr<Client> probe_;
  std::vector<Child> children_;
  Totals t_;
  size_t base_fds_ = 0, end_fds_ = 0;
  uint64_t base_rss_ = 0, end_rss_ = 0;
  uint64_t leaked_bytes_ = 0, leaked_chunks_ = 0;
};

}  // namespace

int Soak(int argc, char** argv) {
  SoakOptions o;
  for (int i = 2; i < argc; ++i) {
    absl::string_view a = argv[i];
    double seconds = 0;
    bool ok = true;
    if (a == "--json") {
      o.json = true;
    } else if (absl::StartsWith(a, "--minutes=")) {
      ok = absl::SimpleAtod(a.substr(10), &o.minutes) && o.minutes > 0;
    } else if (absl::StartsWith(a, "--movers=")) {
      ok = absl::SimpleAtoi(a.substr(9), &o.movers) && o.movers >= 1 && o.movers <= 16;
    } else if (absl::StartsWith(a, "--kill_every=")) {
      ok = absl::SimpleAtod(a.substr(13), &seconds) && seconds > 0;
      o.client_kill_every = absl::Seconds(seconds);
    } else if (absl::StartsWith(a, "--daemon_kill_every=")) {
      ok = absl::SimpleAtod(a.substr(20), &seconds) && seconds > 0;
      o.daemon_kill_every = absl::Seconds(seconds);
    } else if (absl::StartsWith(a, "--dir=")) {
      o.dir = std::string(a.substr(6));
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "usage: tierd-bench soak [--json] [--minutes=30] [--movers=3] "
                   "[--kill_every=SECONDS (10)] [--daemon_kill_every=SECONDS (240)] "
                   "[--dir=DIR (/tmp): the NVMe region]\n");
      return 2;
    }
  }
  return SoakRun(o).Run();
}

}  // namespace tierd::bench
