// Pieces the tierd-bench modes share: reporting, timing, a daemon of their own, chunk moves.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "testing/daemon_process.h"
#include "tierd/client.hpp"

namespace tierd::bench {

struct Result {
  std::string metric;
  double value;
  std::string unit;
  std::string params;      // extra JSON fields: ,"chunks":10000
  std::string comparison;  // for the table
};

class Reporter {
 public:
  Reporter(std::string mode, bool json) : mode_(std::move(mode)), json_(json) {}
  bool json() const { return json_; }
  void Add(const Result& r) {
    if (json_) {
      std::printf("{\"mode\":\"%s\",\"metric\":\"%s\",\"value\":%.6g,\"unit\":\"%s\"%s}\n",
                  mode_.c_str(), r.metric.c_str(), r.value, r.unit.c_str(), r.params.c_str());
    } else {
      std::printf("  %-28s %12.3f %-4s  %s\n", r.metric.c_str(), r.value, r.unit.c_str(),
                  r.comparison.c_str());
    }
    std::fflush(stdout);
  }

 private:
  std::string mode_;
  bool json_;
};

inline double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

inline double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

template <typename F>
double TimeMs(F&& f) {
  absl::Time t0 = absl::Now();
  f();
  return absl::ToDoubleMilliseconds(absl::Now() - t0);
}

[[noreturn]] inline void Die(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "tierd-bench: %s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

// A bench's NVMe region file, removed when the mode returns (declared before its daemon, so that
// the daemon has stopped by then).
class RegionFile {
 public:
  explicit RegionFile(std::string path) : path_(std::move(path)) {}
  ~RegionFile() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  RegionFile(const RegionFile&) = delete;
  RegionFile& operator=(const RegionFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline std::unique_ptr<tierd::testing::DaemonProcess> StartDaemon(
    const std::vector<std::string>& args) {
  auto d = tierd::testing::DaemonProcess::Start(
      {.binary = tierd::testing::ExecutableDir() + "/../daemon/tierd", .args = args});
  if (!d.ok()) Die(d.status(), "starting tierd");
  return std::move(*d);
}

inline std::unique_ptr<tierd::Client> ConnectTo(const std::string& dir) {
  auto client = tierd::Client::Connect({.socket_dir = dir, .client_name = "tierd-bench"});
  if (!client.ok()) Die(client.status(), "connect");
  return std::move(*client);
}

inline void WaitOrDie(tierd::Client& c, tierd::CompletionToken t, const char* what) {
  if (absl::Status s = c.Wait(t); !s.ok()) Die(s, what);
}

// Acquiring for write on `tier` makes those copies the only valid ones (so the next move copies).
// Waits until they are there: a chunk still being brought in cannot be moved on.
inline void Dirty(tierd::Client& c, std::span<const tierd::ChunkId> ids, tierd::Tier tier) {
  auto w = c.AcquireIds(ids, tier, tierd::AccessMode::kWrite);
  if (!w.ok()) Die(w.status(), "Acquire");
  WaitOrDie(c, w->ready, "Acquire");
  if (absl::Status s = c.Release(ids); !s.ok()) Die(s, "Release");
}

inline double Move(tierd::Client& c, std::span<const tierd::ChunkId> ids, tierd::Tier tier,
                   bool evict) {
  absl::Status st;
  double ms = TimeMs([&] {
    auto t = evict ? c.EvictIds(ids, tier) : c.PrefetchIds(ids, tier);
    st = t.ok() ? c.Wait(*t) : t.status();
  });
  if (!st.ok()) Die(st, evict ? "Evict" : "Prefetch");
  return ms;
}

// Modes with files of their own.
int Replay(int argc, char** argv);
int Adam(int argc, char** argv);         // bench/adam.cc
int OffloadStep(int argc, char** argv);  // bench/adam.cc
// torch.optim.AdamW's parameters per second on `device` ("cpu": foreach, `threads` of them;
// "cuda": fused), run by bench/adam_torch.py; 0 with the reason in `why` when it cannot run.
double TorchParamsPerSecond(uint64_t n, int threads, int iterations, const std::string& device,
                            std::string* why);
int GpuAdam(int argc, char** argv);     // bench/gpu_adam.cc (CUDA builds)
int Soak(int argc, char** argv);        // bench/soak.cc
int SoakClient(int argc, char** argv);  // bench/soak.cc: one client of the soak

}  // namespace tierd::bench
