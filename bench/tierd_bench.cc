// tierd-bench: measurements of the daemon through the client library, as a training process sees
// them. Every mode prints a table, or with --json one JSON object per line per measurement.
//
//   tierd-bench control [--json] [--socket_dir=DIR] [--chunks=10000] [--samples=2000]
//
// Without --socket_dir it starts its own tierd (from the build tree) on a temporary directory.
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "tests/daemon_process.h"
#include "tierd/client.hpp"

namespace {

struct Options {
  std::string mode;
  bool json = false;
  std::string socket_dir;
  uint64_t chunks = 10000;
  uint64_t samples = 2000;
  uint64_t chunk_size = 4096;
};

struct Result {
  std::string metric;
  double value;
  std::string unit;
  std::string params;      // extra JSON fields: ,"chunks":10000
  std::string comparison;  // for the table
};

class Reporter {
 public:
  explicit Reporter(const Options& o) : o_(o) {}
  void Add(Result r) {
    if (o_.json) {
      std::printf("{\"mode\":\"%s\",\"metric\":\"%s\",\"value\":%.6g,\"unit\":\"%s\"%s}\n",
                  o_.mode.c_str(), r.metric.c_str(), r.value, r.unit.c_str(), r.params.c_str());
    } else {
      std::printf("  %-28s %12.3f %-4s  %s\n", r.metric.c_str(), r.value, r.unit.c_str(),
                  r.comparison.c_str());
    }
    std::fflush(stdout);
  }

 private:
  const Options& o_;
};

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

template <typename F>
double TimeMs(F&& f) {
  absl::Time t0 = absl::Now();
  f();
  return absl::ToDoubleMilliseconds(absl::Now() - t0);
}

[[noreturn]] void Die(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "tierd-bench: %s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

int Control(const Options& o, tierd::Client& c) {
  Reporter out(o);
  const std::string batch_params =
      absl::StrFormat(",\"chunks\":%d,\"chunk_bytes\":%d", o.chunks, o.chunk_size);
  if (!o.json) {
    std::printf("tierd-bench control: %llu chunks of %llu B per batch, %llu single-op samples\n",
                static_cast<unsigned long long>(o.chunks),
                static_cast<unsigned long long>(o.chunk_size),
                static_cast<unsigned long long>(o.samples));
  }

  // Batched operations: 5 rounds, median reported.
  std::vector<tierd::ChunkSpec> specs(o.chunks, tierd::ChunkSpec{.size = o.chunk_size});
  std::vector<double> alloc_ms, acquire_ms, release_ms, free_ms;
  for (int round = 0; round < 5; ++round) {
    absl::StatusOr<std::vector<tierd::ChunkId>> ids;
    alloc_ms.push_back(TimeMs([&] { ids = c.AllocateIds(specs); }));
    if (!ids.ok()) Die(ids.status(), "batch Allocate");
    absl::StatusOr<tierd::Acquired> acquired;
    acquire_ms.push_back(TimeMs([&] {
      acquired = c.AcquireIds(*ids, tierd::Tier::kHost, tierd::AccessMode::kWrite);
      if (acquired.ok()) (void)c.Wait(acquired->ready);
    }));
    if (!acquired.ok()) Die(acquired.status(), "batch Acquire");
    absl::Status s;
    release_ms.push_back(TimeMs([&] { s = c.Release(*ids); }));
    if (!s.ok()) Die(s, "batch Release");
    free_ms.push_back(TimeMs([&] { s = c.Free(*ids); }));
    if (!s.ok()) Die(s, "batch Free");
  }
  const char* target = "target < 20 ms";
  out.Add({"batch_allocate_ms", Median(alloc_ms), "ms", batch_params, target});
  out.Add({"batch_acquire_ms", Median(acquire_ms), "ms", batch_params, target});
  out.Add({"batch_release_ms", Median(release_ms), "ms", batch_params, target});
  out.Add({"batch_free_ms", Median(free_ms), "ms", batch_params, target});

  // Single-chunk operations: the latency of one RPC round trip plus the work.
  auto one = c.AllocateIds(std::vector<tierd::ChunkSpec>{{.size = o.chunk_size}});
  if (!one.ok()) Die(one.status(), "Allocate");
  std::vector<double> acquire_us, release_us;
  acquire_us.reserve(o.samples);
  for (uint64_t i = 0; i < o.samples; ++i) {
    absl::Time t0 = absl::Now();
    auto a = c.AcquireIds(*one, tierd::Tier::kHost, tierd::AccessMode::kRead);
    if (!a.ok()) Die(a.status(), "single Acquire");
    absl::Time t1 = absl::Now();
    c.Abandon(a->ready);
    if (absl::Status s = c.Release(*one); !s.ok()) Die(s, "single Release");
    absl::Time t2 = absl::Now();
    acquire_us.push_back(absl::ToDoubleMicroseconds(t1 - t0));
    release_us.push_back(absl::ToDoubleMicroseconds(t2 - t1));
  }
  const std::string single = absl::StrFormat(",\"chunks\":1,\"samples\":%d", o.samples);
  out.Add({"single_acquire_p50_us", Percentile(acquire_us, 0.5), "us", single, ""});
  out.Add({"single_acquire_p99_us", Percentile(acquire_us, 0.99), "us", single, ""});
  out.Add({"single_release_p50_us", Percentile(release_us, 0.5), "us", single, ""});

  // Completions: re-checking a ready token and waiting on a completed one read shared memory;
  // a system call (getpid, the cheapest there is) is measured beside them for comparison.
  constexpr int kPolls = 2'000'000;
  auto token = c.PrefetchIds(*one, tierd::Tier::kHost);
  if (!token.ok()) Die(token.status(), "Prefetch");
  int ready = 0;
  double poll_ms = TimeMs([&] {
    for (int i = 0; i < kPolls; ++i) ready += c.Poll(*token).ok();
  });
  if (ready != kPolls) Die(absl::InternalError("a completed token read as not ready"), "Poll");
  (void)c.Wait(*token);
  double syscall_ms = TimeMs([&] {
    for (int i = 0; i < kPolls; ++i) syscall(SYS_getpid);
  });
  std::vector<tierd::CompletionToken> tokens;
  for (int i = 0; i < 4000; ++i) {
    auto t = c.PrefetchIds(*one, tierd::Tier::kHost);
    if (!t.ok()) Die(t.status(), "Prefetch");
    tokens.push_back(*t);
  }
  double wait_ms = TimeMs([&] {
    for (const auto& t : tokens) (void)c.Wait(t, absl::ZeroDuration());
  });
  const double syscall_ns = syscall_ms * 1e6 / kPolls;
  const std::string cmp = absl::StrFormat("getpid() syscall: %.1f ns", syscall_ns);
  out.Add({"poll_ready_ns", poll_ms * 1e6 / kPolls, "ns", ",\"op\":\"poll_ready\"", cmp});
  out.Add({"wait_completed_ns", wait_ms * 1e6 / tokens.size(), "ns", ",\"op\":\"wait_completed\"",
           cmp});
  out.Add({"syscall_getpid_ns", syscall_ns, "ns", ",\"op\":\"getpid\"", "the comparison"});
  if (absl::Status s = c.Free(*one); !s.ok()) Die(s, "Free");
  return 0;
}

bool Parse(int argc, char** argv, Options* o) {
  if (argc < 2) return false;
  o->mode = argv[1];
  for (int i = 2; i < argc; ++i) {
    std::string_view a = argv[i];
    auto value = [&](std::string_view flag, auto* out) {
      if (a.substr(0, flag.size()) != flag) return false;
      return absl::SimpleAtoi(std::string(a.substr(flag.size())), out);
    };
    if (a == "--json") {
      o->json = true;
    } else if (a.substr(0, 13) == "--socket_dir=") {
      o->socket_dir = std::string(a.substr(13));
    } else if (!value("--chunks=", &o->chunks) && !value("--samples=", &o->samples) &&
               !value("--chunk_size=", &o->chunk_size)) {
      std::fprintf(stderr, "tierd-bench: unknown or malformed option '%s'\n", argv[i]);
      return false;
    }
  }
  return o->mode == "control" && o->chunks > 0 && o->samples > 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!Parse(argc, argv, &o)) {
    std::fprintf(stderr,
                 "usage: tierd-bench control [--json] [--socket_dir=DIR] [--chunks=N] "
                 "[--samples=N] [--chunk_size=BYTES]\n");
    return 2;
  }
  std::unique_ptr<tierd::testing::DaemonProcess> daemon;
  if (o.socket_dir.empty()) {
    // A pool large enough for the batch, pinned as in production.
    const uint64_t need = o.chunks * ((o.chunk_size + 4095) / 4096 * 4096);
    const uint64_t segments = std::max<uint64_t>(2, (need + (256 << 20) - 1) / (256 << 20) + 1);
    auto d = tierd::testing::DaemonProcess::Start(
        {.binary = tierd::testing::ExecutableDir() + "/../daemon/tierd",
         .args = {absl::StrCat("--host_capacity=", segments * 256, "MiB"), "--log_level=warn"}});
    if (!d.ok()) Die(d.status(), "starting tierd");
    daemon = std::move(*d);
    o.socket_dir = daemon->socket_dir();
  }
  auto client = tierd::Client::Connect({.socket_dir = o.socket_dir, .client_name = "tierd-bench"});
  if (!client.ok()) Die(client.status(), "connect");
  int rc = Control(o, **client);
  client->reset();
  if (daemon != nullptr && daemon->Stop() != 0) {
    std::fprintf(stderr, "tierd-bench: the daemon did not stop cleanly:\n%s\n",
                 daemon->Log().c_str());
    return 1;
  }
  return rc;
}
