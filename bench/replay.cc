// tierd-bench replay: one training iteration's accesses, replayed through a real daemon with the
// compute simulated by sleeping, under three policies in one run:
//
//   on_demand  no schedule: every chunk is brought in when acquired, least recently used out;
//   hints      the iteration declared up front with SetSchedule;
//   trace      TraceSchedule: the daemon records the first iteration and plans from the next.
//
// The model is a GPT-style stack scaled down to fit a small machine: per layer, bf16 parameters
// and gradients of 12·h² elements, fp32 master weights, Adam m and v of the same count, and one
// activation checkpoint of tokens·h bf16 values; tensors are cut into chunks of at most --chunk.
// Everything lives on NVMe at the start, the host tier holds less than the working set and the
// device tier less than the parameters, so every tier and path is in the loop:
//
//   forward l    params[l] on the device (read), acts[l] on the device (overwritten)
//   backward l   params[l], acts[l] on the device (read), grads[l] on the device (overwritten)
//   optimizer l  grads[l] on the host (read); master[l], m[l], v[l] on the host (written);
//                params[l] on the host (overwritten: the new weights in low precision)
//
// An overwrite (AccessMode::kOverwrite) writes every byte before reading any, so the daemon
// fetches nothing for it; a write reads the old contents first.
//
// Each iteration reports its time, the time acquisitions waited (stall), the bytes moved on each
// path (from the daemon's counters) and the lower bound max(compute, busiest path's bytes over
// its bandwidth), the bandwidths measured by this program through the daemon before the
// policies run. NVMe reads and writes share the drive, so they count as one path: read bytes over
// the read bandwidth plus write bytes over the write bandwidth.
//
// Every write stamps its chunk and every read checks the stamp (where this process can see the
// bytes), so a stale copy handed out under pressure fails the run.
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/bench_util.h"
#include "common/sizes.h"

namespace tierd::bench {
namespace {

struct ReplayOptions {
  bool json = false;
  std::string dir = "var/bench";
  std::string device = "emulated";
  int layers = 8;
  uint64_t hidden = 768;
  uint64_t tokens = 4096;  // per micro-batch: batch × sequence
  uint64_t chunk = 16 << 20;
  uint64_t host = 256ull << 20;
  uint64_t device_bytes = 96ull << 20;
  // Compute per layer: about the time the NVMe needs per layer for the optimizer state, so that
  // hiding the I/O behind compute is possible but not trivial.
  absl::Duration forward = absl::Milliseconds(40);
  absl::Duration backward = absl::Milliseconds(80);
  absl::Duration optimizer = absl::Milliseconds(60);
  int iterations = 3;  // measured, per policy, after the warm-up
  std::vector<std::string> policies = {"on_demand", "hints", "trace"};
};

struct Tensor {
  std::string name;
  uint64_t bytes = 0;
  std::vector<ChunkId> chunks;
  std::vector<uint64_t> sizes;
};

struct Layer {
  Tensor params, grads, master, m, v, acts;
};

struct Group {
  std::vector<ChunkId> ids;
  Tier tier = Tier::kHost;
  AccessMode mode = AccessMode::kRead;
};

struct Step {
  std::vector<Group> groups;
  absl::Duration compute;
};

struct Bandwidth {  // bytes per second, measured through the daemon
  double nvme_read = 0, nvme_write = 0, h2d = 0, d2h = 0;
};

// What moved on each path, from the daemon's counters.
struct PathBytes {
  uint64_t nvme_read = 0, nvme_write = 0, h2d = 0, d2h = 0;
  PathBytes operator-(const PathBytes& o) const {
    return {nvme_read - o.nvme_read, nvme_write - o.nvme_write, h2d - o.h2d, d2h - o.d2h};
  }
};

PathBytes ReadPaths(Client& c) {
  absl::StatusOr<NodeInfo> info = c.GetNodeInfo();
  if (!info.ok()) Die(info.status(), "GetNodeInfo");
  auto bytes = [&](const char* name) {
    const PathStatus* p = info->path(name);
    return p == nullptr ? 0 : p->bytes;
  };
  return {bytes("nvme_to_host"), bytes("host_to_nvme"), bytes("host_to_device"),
          bytes("device_to_host")};
}

struct Iteration {
  double seconds = 0;
  double stall = 0;         // measured by the client: acquire until ready
  double daemon_stall = 0;  // what the daemon counted for the session
  double compute = 0;       // slept
  uint64_t waited = 0;      // acquisitions that found a chunk missing
  uint64_t acquisitions = 0;
  PathBytes bytes;
  double bound = 0;
  const char* busiest = "";
};

std::vector<std::string> DaemonArgs(const ReplayOptions& o, uint64_t nvme_bytes) {
  return {
      absl::StrCat("--host_capacity=", o.host >> 20, "MiB"),
      // Whole-tier segments (up to 256 MiB): chunks of mixed sizes pack without holes.
      absl::StrCat("--host_segment_size=", std::min<uint64_t>(o.host, 256ull << 20) >> 20, "MiB"),
      absl::StrCat("--device=", o.device),
      absl::StrCat("--device_capacity=", o.device_bytes >> 20, "MiB"),
      absl::StrCat("--device_segment_size=", std::min<uint64_t>(o.device_bytes, 256ull << 20) >> 20,
                   "MiB"),
      absl::StrCat("--nvme_regions=", o.dir, "/replay-region:",
                   AlignUp(nvme_bytes + nvme_bytes / 4 + (256ull << 20), 1 << 20) >> 20, "MiB"),
      "--nvme_reformat", "--log_level=warn"};
}

Tensor MakeTensor(Client& c, std::string name, uint64_t bytes, uint64_t chunk) {
  Tensor t{std::move(name), bytes, {}, {}};
  std::vector<ChunkSpec> specs;
  for (uint64_t off = 0; off < bytes; off += chunk) {
    t.sizes.push_back(std::min(chunk, bytes - off));
    specs.push_back({.size = t.sizes.back(), .home = Tier::kNvme});
  }
  absl::StatusOr<std::vector<ChunkId>> ids = c.AllocateIds(specs);
  if (!ids.ok()) Die(ids.status(), "Allocate");
  t.chunks = std::move(*ids);
  return t;
}

std::vector<Layer> MakeModel(Client& c, const ReplayOptions& o) {
  const uint64_t params = 12 * o.hidden * o.hidden;
  std::vector<Layer> layers;
  for (int l = 0; l < o.layers; ++l) {
    layers.push_back({MakeTensor(c, absl::StrCat("params", l), 2 * params, o.chunk),
                      MakeTensor(c, absl::StrCat("grads", l), 2 * params, o.chunk),
                      MakeTensor(c, absl::StrCat("master", l), 4 * params, o.chunk),
                      MakeTensor(c, absl::StrCat("m", l), 4 * params, o.chunk),
                      MakeTensor(c, absl::StrCat("v", l), 4 * params, o.chunk),
                      MakeTensor(c, absl::StrCat("acts", l), 2 * o.tokens * o.hidden, o.chunk)});
  }
  return layers;
}

std::vector<ChunkId> Ids(std::initializer_list<const Tensor*> tensors) {
  std::vector<ChunkId> out;
  for (const Tensor* t : tensors) out.insert(out.end(), t->chunks.begin(), t->chunks.end());
  return out;
}

std::vector<Step> MakeSteps(const std::vector<Layer>& model, const ReplayOptions& o) {
  std::vector<Step> steps;
  for (const Layer& l : model) {
    steps.push_back({{{Ids({&l.params}), Tier::kDevice, AccessMode::kRead},
                      {Ids({&l.acts}), Tier::kDevice, AccessMode::kOverwrite}},
                     o.forward});
  }
  for (auto l = model.rbegin(); l != model.rend(); ++l) {
    steps.push_back({{{Ids({&l->params, &l->acts}), Tier::kDevice, AccessMode::kRead},
                      {Ids({&l->grads}), Tier::kDevice, AccessMode::kOverwrite}},
                     o.backward});
  }
  for (const Layer& l : model) {
    steps.push_back({{{Ids({&l.grads}), Tier::kHost, AccessMode::kRead},
                      {Ids({&l.master, &l.m, &l.v}), Tier::kHost, AccessMode::kWrite},
                      {Ids({&l.params}), Tier::kHost, AccessMode::kOverwrite}},
                     o.optimizer});
  }
  return steps;
}

std::vector<ScheduleStep> ToSchedule(const std::vector<Step>& steps) {
  std::vector<ScheduleStep> out;
  for (const Step& s : steps) {
    ScheduleStep& step = out.emplace_back();
    for (const Group& g : s.groups) {
      for (ChunkId id : g.ids) step.push_back({id, g.tier, g.mode});
    }
  }
  return out;
}

// Writes every chunk once through the host, in batches the host tier holds, and sends it all to
// NVMe: the state each policy starts from.
void Initialize(Client& c, const std::vector<Layer>& model, uint64_t host,
                absl::flat_hash_map<ChunkId, uint64_t>& stamps) {
  std::vector<ChunkId> batch;
  uint64_t bytes = 0;
  auto flush = [&] {
    if (batch.empty()) return;
    auto a = c.AcquireIds(batch, Tier::kHost, AccessMode::kWrite);
    if (!a.ok()) Die(a.status(), "Acquire (initialize)");
    WaitOrDie(c, a->ready, "Acquire (initialize)");
    for (size_t i = 0; i < batch.size(); ++i) {
      std::memset(a->chunks[i].data, 0x5A, a->chunks[i].size);
      stamps[batch[i]] = batch[i];
      std::memcpy(a->chunks[i].data, &stamps[batch[i]], sizeof(uint64_t));
    }
    if (absl::Status s = c.Release(batch); !s.ok()) Die(s, "Release (initialize)");
    auto down = c.EvictIds(batch, Tier::kNvme);
    if (!down.ok()) Die(down.status(), "Evict (initialize)");
    WaitOrDie(c, *down, "Evict (initialize)");
    batch.clear();
    bytes = 0;
  };
  for (const Layer& l : model) {
    for (const Tensor* t : {&l.params, &l.grads, &l.master, &l.m, &l.v, &l.acts}) {
      for (size_t i = 0; i < t->chunks.size(); ++i) {
        if (bytes + t->sizes[i] > host / 2) flush();
        batch.push_back(t->chunks[i]);
        bytes += t->sizes[i];
      }
    }
  }
  flush();
}

// Bandwidth of each path through the daemon, each the best of three bulk moves.
Bandwidth Probe(const ReplayOptions& o) {
  RegionFile region(o.dir + "/replay-region");
  auto daemon = StartDaemon(DaemonArgs(o, o.host));
  auto c = ConnectTo(daemon->socket_dir());
  auto alloc = [&](uint64_t total) {
    std::vector<ChunkSpec> specs(std::max<uint64_t>(1, total / o.chunk),
                                 ChunkSpec{.size = o.chunk, .home = Tier::kNvme});
    absl::StatusOr<std::vector<ChunkId>> ids = c->AllocateIds(specs);
    if (!ids.ok()) Die(ids.status(), "Allocate (probe)");
    return *ids;
  };

  Bandwidth bw;
  const std::vector<ChunkId> host_set = alloc(o.host * 3 / 4);
  const double host_bytes = static_cast<double>(host_set.size() * o.chunk);
  for (int round = 0; round < 3; ++round) {
    Dirty(*c, host_set, Tier::kHost);
    bw.nvme_write =
        std::max(bw.nvme_write, host_bytes / Move(*c, host_set, Tier::kNvme, true) * 1e3);
    bw.nvme_read =
        std::max(bw.nvme_read, host_bytes / Move(*c, host_set, Tier::kHost, false) * 1e3);
  }
  if (absl::Status s = c->Free(host_set); !s.ok()) Die(s, "Free (probe)");
  const std::vector<ChunkId> device_set = alloc(o.device_bytes * 3 / 4);
  const double device_bytes = static_cast<double>(device_set.size() * o.chunk);
  for (int round = 0; round < 3; ++round) {
    Dirty(*c, device_set, Tier::kHost);
    bw.h2d = std::max(bw.h2d, device_bytes / Move(*c, device_set, Tier::kDevice, false) * 1e3);
    Dirty(*c, device_set, Tier::kDevice);
    bw.d2h = std::max(bw.d2h, device_bytes / Move(*c, device_set, Tier::kHost, true) * 1e3);
  }
  c.reset();
  if (daemon->Stop() != 0) Die(absl::InternalError(daemon->Log()), "the probe's daemon");
  return bw;
}

void Bound(Iteration& it, const Bandwidth& bw) {
  const double nvme = static_cast<double>(it.bytes.nvme_read) / bw.nvme_read +
                      static_cast<double>(it.bytes.nvme_write) / bw.nvme_write;
  const double h2d = static_cast<double>(it.bytes.h2d) / bw.h2d;
  const double d2h = static_cast<double>(it.bytes.d2h) / bw.d2h;
  it.bound = it.compute;
  it.busiest = "compute";
  for (auto [t, name] : {std::pair{nvme, "nvme"}, {h2d, "h2d"}, {d2h, "d2h"}}) {
    if (t > it.bound) {
      it.bound = t;
      it.busiest = name;
    }
  }
}

class Runner {
 public:
  Runner(Client& c, std::vector<Step> steps, absl::flat_hash_map<ChunkId, uint64_t> stamps,
         bool device_visible)
      : c_(c),
        steps_(std::move(steps)),
        stamps_(std::move(stamps)),
        device_visible_(device_visible) {}

  size_t steps() const { return steps_.size(); }
  const std::vector<Step>& step_list() const { return steps_; }

  Iteration Run(uint64_t iteration) {
    Iteration it;
    const PathBytes before = ReadPaths(c_);
    absl::StatusOr<SessionStats> s0 = c_.GetSessionStats();
    if (!s0.ok()) Die(s0.status(), "GetSessionStats");
    const absl::Time start = absl::Now();
    for (size_t k = 0; k < steps_.size(); ++k) {
      const Step& step = steps_[k];
      c_.BeginStep(iteration * steps_.size() + k);
      const absl::Time asked = absl::Now();
      std::vector<Acquired> held;
      for (const Group& g : step.groups) {
        absl::StatusOr<Acquired> a = c_.AcquireIds(g.ids, g.tier, g.mode);
        if (!a.ok()) Die(a.status(), "Acquire");
        held.push_back(std::move(*a));
      }
      for (const Acquired& a : held) WaitOrDie(c_, a.ready, "Acquire");
      const absl::Time ready = absl::Now();
      it.stall += absl::ToDoubleSeconds(ready - asked);
      for (size_t g = 0; g < step.groups.size(); ++g) {
        Stamp(step.groups[g], held[g], (iteration << 32) | (k << 8) | g);
      }
      absl::SleepFor(step.compute);
      it.compute += absl::ToDoubleSeconds(absl::Now() - ready);
      for (const Group& g : step.groups) {
        if (absl::Status s = c_.Release(g.ids); !s.ok()) Die(s, "Release");
        it.acquisitions += g.ids.size();
      }
    }
    it.seconds = absl::ToDoubleSeconds(absl::Now() - start);
    absl::StatusOr<SessionStats> s1 = c_.GetSessionStats();
    if (!s1.ok()) Die(s1.status(), "GetSessionStats");
    it.daemon_stall = absl::ToDoubleSeconds((s1->host_stall - s0->host_stall) +
                                            (s1->device_stall - s0->device_stall));
    it.waited = s1->acquired_waited - s0->acquired_waited;
    it.bytes = ReadPaths(c_) - before;
    return it;
  }

 private:
  // Reads and writes check the chunk's last stamp; writes and overwrites leave a new one.
  void Stamp(const Group& g, const Acquired& a, uint64_t value) {
    if (g.tier == Tier::kDevice && !device_visible_) return;
    for (size_t i = 0; i < g.ids.size(); ++i) {
      uint64_t& expected = stamps_[g.ids[i]];
      uint64_t found;
      std::memcpy(&found, a.chunks[i].data, sizeof(found));
      if (g.mode != AccessMode::kOverwrite && found != expected) {
        Die(absl::DataLossError(absl::StrFormat(
                "chunk %d holds stamp %#x, last written %#x: a stale copy was handed out", g.ids[i],
                found, expected)),
            "replay");
      }
      if (g.mode != AccessMode::kRead) {
        expected = value;
        std::memcpy(a.chunks[i].data, &value, sizeof(value));
      }
    }
  }

  Client& c_;
  std::vector<Step> steps_;
  absl::flat_hash_map<ChunkId, uint64_t> stamps_;
  bool device_visible_;
};

struct PolicyResult {
  std::string policy;
  std::vector<Iteration> iterations;  // the measured ones
};

PolicyResult RunPolicy(const ReplayOptions& o, const std::string& policy, const Bandwidth& bw,
                       uint64_t model_bytes) {
  RegionFile region(o.dir + "/replay-region");
  auto daemon = StartDaemon(DaemonArgs(o, model_bytes));
  auto c = ConnectTo(daemon->socket_dir());
  absl::StatusOr<NodeInfo> info = c->GetNodeInfo();
  if (!info.ok()) Die(info.status(), "GetNodeInfo");
  const std::vector<Layer> model = MakeModel(*c, o);
  absl::flat_hash_map<ChunkId, uint64_t> stamps;
  Initialize(*c, model, o.host, stamps);
  Runner runner(*c, MakeSteps(model, o), std::move(stamps), info->device_emulated);
  int warm_up = 1;  // the planner learns the steps' pace
  if (policy == "hints") {
    if (absl::Status s = c->SetSchedule(ToSchedule(runner.step_list())); !s.ok()) {
      Die(s, "SetSchedule");
    }
  } else if (policy == "trace") {
    if (absl::Status s = c->TraceSchedule(static_cast<uint32_t>(runner.steps())); !s.ok()) {
      Die(s, "TraceSchedule");
    }
    warm_up = 2;  // the first is recorded
  }
  PolicyResult result{policy, {}};
  for (int i = 0; i < warm_up + o.iterations; ++i) {
    Iteration it = runner.Run(static_cast<uint64_t>(i));
    Bound(it, bw);
    if (!o.json) {
      std::printf(
          "  %-9s %s %d  %7.3f s  stall %6.3f s (%4.1f %%)  bound %6.3f s (%s) = %4.2fx  "
          "waited %4" PRIu64 "/%-4" PRIu64 "  MB nvme r %5.0f w %5.0f  h2d %5.0f d2h %5.0f\n",
          policy.c_str(), i < warm_up ? "warm-up " : "iteration", i, it.seconds, it.stall,
          100 * it.stall / it.seconds, it.bound, it.busiest, it.seconds / it.bound, it.waited,
          it.acquisitions, it.bytes.nvme_read / 1e6, it.bytes.nvme_write / 1e6, it.bytes.h2d / 1e6,
          it.bytes.d2h / 1e6);
      std::fflush(stdout);
    }
    if (i >= warm_up) result.iterations.push_back(it);
  }
  c.reset();
  if (daemon->Stop() != 0) Die(absl::InternalError(daemon->Log()), "the replay's daemon");
  return result;
}

bool ParseMilliseconds(absl::string_view text, absl::Duration* out) {
  double ms;
  if (!absl::SimpleAtod(text, &ms) || ms < 0) return false;
  *out = absl::Milliseconds(ms);
  return true;
}

bool Parse(int argc, char** argv, ReplayOptions* o) {
  for (int i = 2; i < argc; ++i) {
    absl::string_view a = argv[i];
    auto flag = [&](absl::string_view name, absl::string_view* value) {
      if (a.substr(0, name.size()) != name) return false;
      *value = a.substr(name.size());
      return true;
    };
    absl::string_view v;
    bool ok = true;
    if (a == "--json") {
      o->json = true;
    } else if (flag("--dir=", &v)) {
      o->dir = std::string(v);
    } else if (flag("--device=", &v)) {
      o->device = std::string(v);
      ok = o->device == "emulated" || o->device == "cuda";
    } else if (flag("--layers=", &v)) {
      ok = absl::SimpleAtoi(v, &o->layers) && o->layers > 0;
    } else if (flag("--hidden=", &v)) {
      ok = absl::SimpleAtoi(v, &o->hidden) && o->hidden > 0;
    } else if (flag("--tokens=", &v)) {
      ok = absl::SimpleAtoi(v, &o->tokens) && o->tokens > 0;
    } else if (flag("--iterations=", &v)) {
      ok = absl::SimpleAtoi(v, &o->iterations) && o->iterations > 0;
    } else if (flag("--chunk=", &v) || flag("--host=", &v) || flag("--device_memory=", &v)) {
      absl::StatusOr<uint64_t> size = ParseSize(std::string(v));
      ok = size.ok() && *size > 0;
      if (ok) {
        uint64_t* target = a.substr(0, 8) == "--chunk="  ? &o->chunk
                           : a.substr(0, 7) == "--host=" ? &o->host
                                                         : &o->device_bytes;
        *target = *size;
      }
    } else if (flag("--forward_ms=", &v)) {
      ok = ParseMilliseconds(v, &o->forward);
    } else if (flag("--backward_ms=", &v)) {
      ok = ParseMilliseconds(v, &o->backward);
    } else if (flag("--optimizer_ms=", &v)) {
      ok = ParseMilliseconds(v, &o->optimizer);
    } else if (flag("--policies=", &v)) {
      o->policies = absl::StrSplit(v, ',');
      for (const std::string& p : o->policies) {
        ok = ok && (p == "on_demand" || p == "hints" || p == "trace");
      }
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "tierd-bench replay: unknown or malformed option '%s'\n", argv[i]);
      return false;
    }
  }
  return true;
}

}  // namespace

int Replay(int argc, char** argv) {
  ReplayOptions o;
  if (!Parse(argc, argv, &o)) {
    std::fprintf(stderr,
                 "usage: tierd-bench replay [--json] [--dir=DIR] [--device=emulated|cuda] "
                 "[--layers=8] [--hidden=768] [--tokens=4096] [--chunk=16MiB] [--host=256MiB] "
                 "[--device_memory=96MiB] [--forward_ms=40] [--backward_ms=80] "
                 "[--optimizer_ms=60] [--iterations=3] [--policies=on_demand,hints,trace]\n");
    return 2;
  }
  std::error_code ec;
  std::filesystem::create_directories(o.dir, ec);
  Reporter out("replay", o.json);
  const uint64_t params = 12 * o.hidden * o.hidden;
  const uint64_t per_layer = 16 * params + 2 * o.tokens * o.hidden;
  const uint64_t model_bytes = per_layer * o.layers;
  if (!o.json) {
    std::printf(
        "tierd-bench replay: %d layers, hidden %" PRIu64 ", %" PRIu64
        " tokens: %s of parameters, gradients, optimizer state and activations (%s per layer) "
        "through a %s host tier and a %s %s device\n",
        o.layers, o.hidden, o.tokens, FormatSize(model_bytes).c_str(),
        FormatSize(per_layer).c_str(), FormatSize(o.host).c_str(),
        FormatSize(o.device_bytes).c_str(), o.device.c_str());
  }
  const Bandwidth bw = Probe(o);
  if (!o.json) {
    std::printf(
        "  measured through the daemon: NVMe read %.2f GB/s, write %.2f GB/s; host->device "
        "%.2f GB/s, device->host %.2f GB/s\n",
        bw.nvme_read / 1e9, bw.nvme_write / 1e9, bw.h2d / 1e9, bw.d2h / 1e9);
  }
  const std::string model = absl::StrFormat(
      ",\"layers\":%d,\"hidden\":%d,\"tokens\":%d,\"model_bytes\":%d,\"host_bytes\":%d,"
      "\"device_bytes\":%d,\"device\":\"%s\"",
      o.layers, o.hidden, o.tokens, model_bytes, o.host, o.device_bytes, o.device);
  for (auto [name, value] : {std::pair{"nvme_read", bw.nvme_read},
                             {"nvme_write", bw.nvme_write},
                             {"host_to_device", bw.h2d},
                             {"device_to_host", bw.d2h}}) {
    if (o.json) {
      out.Add(
          {"path_gbps", value / 1e9, "GB/s", absl::StrCat(",\"path\":\"", name, "\"", model), ""});
    }
  }
  std::vector<PolicyResult> results;
  for (const std::string& policy : o.policies) {
    results.push_back(RunPolicy(o, policy, bw, model_bytes));
  }
  if (!o.json) std::printf("\n  means over %d measured iterations:\n", o.iterations);
  for (const PolicyResult& r : results) {
    double seconds = 0, stall = 0, bound = 0;
    for (const Iteration& it : r.iterations) {
      seconds += it.seconds;
      stall += it.stall;
      bound += it.bound;
    }
    const double n = static_cast<double>(r.iterations.size());
    seconds /= n;
    stall /= n;
    bound /= n;
    const std::string params =
        absl::StrFormat(",\"policy\":\"%s\",\"iterations\":%d", r.policy, r.iterations.size()) +
        model;
    out.Add({"iteration_s", seconds, "s", params,
             absl::StrFormat("%-9s %.2f x its lower bound (target <= 1.10 with hints)", r.policy,
                             seconds / bound)});
    out.Add({"stall_s", stall, "s", params,
             absl::StrFormat("%-9s %.1f %% of the iteration (target <= 5 %% with hints)", r.policy,
                             100 * stall / seconds)});
    out.Add({"lower_bound_s", bound, "s", params,
             absl::StrFormat("%-9s max(compute, busiest path)", r.policy)});
  }
  return 0;
}

}  // namespace tierd::bench
