// tierd-bench adam: the CPU Adam kernels' parameters per second beside the memory's bound,
// measured by the same program over the same bytes, and torch.optim.AdamW (foreach) on the same
// sizes and threads.
//
// tierd-bench offload-step: the out-of-core optimizer step with its state on NVMe and a host
// budget of a quarter of the state, beside its lower bound: the larger of the same bytes moved
// by the drive (read and written, at the speed this run measures) and the same step in memory.
#include <sys/sysinfo.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/sizes.h"
#include "kernels/cpu_adam.h"
#include "tierd/optimizer.hpp"

namespace tierd::bench {
namespace {

uint64_t AvailableMemory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib << 10;
  }
  return 0;
}

// Worker w's share of n elements, cut at multiples of 64 (as the kernels cut theirs).
std::pair<size_t, size_t> Share(size_t n, int w, int workers) {
  auto cut = [&](int k) {
    return k == workers ? n : static_cast<size_t>(static_cast<double>(n) * k / workers) / 64 * 64;
  };
  return {cut(w), cut(w + 1)};
}

// True when `arg` is `name` followed by a value, which goes to *value ("--params=" "1e8").
bool FlagValue(const std::string& arg, const char* name, std::string* value) {
  if (arg.rfind(name, 0) != 0) return false;
  *value = arg.substr(std::strlen(name));
  return true;
}

struct AdamOptions {
  bool json = false;
  std::vector<uint64_t> sizes = {10'000'000, 100'000'000, 1'000'000'000};
  std::vector<int> threads;  // empty: 1 and all
  bool bf16 = false;
  int iterations = 5;
  bool torch = true;
};

bool ParseAdam(int argc, char** argv, AdamOptions* o) {
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto flag = [&](const char* name, std::string* v) { return FlagValue(a, name, v); };
    std::string v;
    if (a == "--json") {
      o->json = true;
    } else if (a == "--no_torch") {
      o->torch = false;
    } else if (flag("--grad=", &v)) {
      if (v != "f32" && v != "bf16") return false;
      o->bf16 = v == "bf16";
    } else if (flag("--iterations=", &v)) {
      if (!absl::SimpleAtoi(v, &o->iterations) || o->iterations < 1) return false;
    } else if (flag("--params=", &v)) {
      o->sizes.clear();
      for (absl::string_view s : absl::StrSplit(v, ',')) {
        double x;
        if (!absl::SimpleAtod(s, &x) || x < 64) return false;
        o->sizes.push_back(static_cast<uint64_t>(x));
      }
    } else if (flag("--threads=", &v)) {
      for (absl::string_view s : absl::StrSplit(v, ',')) {
        int t;
        if (!absl::SimpleAtoi(s, &t) || t < 1) return false;
        o->threads.push_back(t);
      }
    } else {
      std::fprintf(stderr, "tierd-bench adam: unknown or malformed option '%s'\n", argv[i]);
      return false;
    }
  }
  return true;
}

// Median seconds of `iterations` runs of fn, after one untimed run.
template <typename F>
double MedianSeconds(int iterations, F&& fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < iterations; ++i) t.push_back(TimeMs(fn) / 1e3);
  return Median(t);
}

}  // namespace

double TorchParamsPerSecond(uint64_t n, int threads, int iterations, const std::string& device,
                            std::string* why) {
  std::string out;
  // On the CPU, Debian's interpreter and torch; on a GPU machine, whichever python3 has CUDA torch.
  std::vector<std::string> argv = {"/usr/bin/python3"};
  if (device != "cpu") argv = {"/usr/bin/env", "python3"};
  // The script sits beside the binary (the build copies it there; so does the GPU kit).
  const std::string script = testing::ExecutableDir() + "/adam_torch.py";
  for (std::string a :
       {script, absl::StrCat(n), absl::StrCat(threads), absl::StrCat(iterations), device}) {
    argv.push_back(std::move(a));
  }
  const int rc = testing::RunProcess(argv, &out);
  double v = 0;
  if (rc != 0 || !absl::SimpleAtod(absl::StripAsciiWhitespace(out), &v)) {
    *why = absl::StrCat("torch run failed (exit ", rc, "): ", out.substr(0, 300));
    return 0;
  }
  return v;
}

int Adam(int argc, char** argv) {
  AdamOptions o;
  if (!ParseAdam(argc, argv, &o)) {
    std::fprintf(stderr,
                 "usage: tierd-bench adam [--json] [--params=1e7,1e8,1e9] [--threads=1,2] "
                 "[--grad=f32|bf16] [--iterations=5] [--no_torch]\n");
    return 2;
  }
  if (o.threads.empty()) {
    o.threads = {1};
    const int all = kernels::ThreadPool(0, false).size();
    if (all > 1) o.threads.push_back(all);
  }
  Reporter out("adam", o.json);
  const kernels::Isa isa = kernels::BestIsa();
  const char* grad_dtype = o.bf16 ? "bf16" : "f32";
  if (!o.json) {
    std::printf(
        "CPU Adam (%s), fp32 p/m/v, %s gradients; bound: %d bytes read + 12 written per "
        "parameter at the speed of a plain pass over the same arrays\n",
        kernels::IsaName(isa), grad_dtype, o.bf16 ? 14 : 16);
  }
  for (uint64_t n : o.sizes) {
    const uint64_t bytes = n * (o.bf16 ? 14 : 16);           // the arrays
    const uint64_t traffic = n * ((o.bf16 ? 14 : 16) + 12);  // read and written per step
    if (bytes + (1ull << 30) > AvailableMemory()) {
      std::printf("  %llu parameters: skipped, needs %s and %s is available\n",
                  static_cast<unsigned long long>(n), FormatSize(bytes).c_str(),
                  FormatSize(AvailableMemory()).c_str());
      continue;
    }
    std::unique_ptr<float[]> p(new float[n]), m(new float[n]), v(new float[n]);
    std::unique_ptr<uint16_t[]> g16(o.bf16 ? new uint16_t[n] : nullptr);
    std::unique_ptr<float[]> g32(o.bf16 ? nullptr : new float[n]);
    const void* grad = o.bf16 ? static_cast<const void*>(g16.get()) : g32.get();
    for (int threads : o.threads) {
      kernels::ThreadPool pool(threads);
      // First touch by the workers that will use each share.
      pool.RunOnAll([&](int w) {
        auto [lo, hi] = Share(n, w, pool.size());
        for (size_t i = lo; i < hi; ++i) {
          const float x = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
          p[i] = x;
          m[i] = 0.1f * x;
          v[i] = 0.01f * x * x + 1e-4f;
          if (o.bf16) {
            g16[i] = kernels::ToBF16(x);
          } else {
            g32[i] = x;
          }
        }
      });
      const kernels::AdamTensor t{
          .param = p.get(),
          .m = m.get(),
          .v = v.get(),
          .grad = grad,
          .grad_type = o.bf16 ? kernels::DType::kBF16 : kernels::DType::kF32,
          .n = n};
      int64_t step = 0;
      const double adam_s = MedianSeconds(o.iterations, [&] {
        kernels::AdamStep({&t, 1}, {.lr = 1e-3, .weight_decay = 0.01}, ++step, pool, isa);
      });
      const double stream_s = MedianSeconds(o.iterations, [&] {
        kernels::BandwidthPass({&t, 1}, pool, isa);
      });
      const std::string fields =
          absl::StrFormat(",\"params\":%llu,\"threads\":%d,\"grad_dtype\":\"%s\"",
                          static_cast<unsigned long long>(n), threads, grad_dtype);
      const double tierd_rate = n / adam_s, bound_rate = n / stream_s;
      std::string torch_note = "torch: not run";
      double torch_rate = 0;
      if (o.torch && !o.bf16) {
        // torch keeps its own copies and temporaries beside this run's arrays.
        if (2.5 * n * 16 + (1ull << 30) < AvailableMemory()) {
          torch_rate = TorchParamsPerSecond(n, threads, o.iterations, "cpu", &torch_note);
          if (torch_rate > 0) torch_note = absl::StrFormat("%.2fx torch", tierd_rate / torch_rate);
        } else {
          torch_note = "torch: skipped, not enough memory beside this run's arrays";
        }
      }
      if (!o.json)
        std::printf("  %llu parameters, %d threads\n", static_cast<unsigned long long>(n), threads);
      out.Add({"params_per_s", tierd_rate, "/s", ",\"impl\":\"tierd\"" + fields,
               absl::StrFormat("tierd: %.2f of the bound (%.1f GB/s moved); %s",
                               tierd_rate / bound_rate, traffic / adam_s / 1e9, torch_note)});
      out.Add({"params_per_s", bound_rate, "/s", ",\"impl\":\"bandwidth_bound\"" + fields,
               absl::StrFormat("bandwidth bound (%.1f GB/s)", traffic / stream_s / 1e9)});
      if (torch_rate > 0) {
        out.Add({"params_per_s", torch_rate, "/s", ",\"impl\":\"torch\"" + fields,
                 "torch.optim.AdamW(foreach=True)"});
      }
    }
  }
  return 0;
}

namespace {

struct OffloadOptions {
  bool json = false;
  uint64_t params = 100'000'000;
  int groups = 10;
  int iterations = 3;
  uint64_t shard_params = 0;  // 0: the optimizer's choice
  std::string dir = "/var/tmp";
};

bool ParseOffload(int argc, char** argv, OffloadOptions* o) {
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto flag = [&](const char* name, std::string* v) { return FlagValue(a, name, v); };
    std::string v;
    double x;
    if (a == "--json") {
      o->json = true;
    } else if (flag("--params=", &v)) {
      if (!absl::SimpleAtod(v, &x) || x < 1e6) return false;
      o->params = static_cast<uint64_t>(x);
    } else if (flag("--groups=", &v)) {
      if (!absl::SimpleAtoi(v, &o->groups) || o->groups < 1) return false;
    } else if (flag("--iterations=", &v)) {
      if (!absl::SimpleAtoi(v, &o->iterations) || o->iterations < 1) return false;
    } else if (flag("--shard_params=", &v)) {
      if (!absl::SimpleAtod(v, &x) || x < 16384) return false;
      o->shard_params = static_cast<uint64_t>(x);
    } else if (flag("--dir=", &v)) {
      o->dir = v;
    } else {
      std::fprintf(stderr, "tierd-bench offload-step: unknown or malformed option '%s'\n", argv[i]);
      return false;
    }
  }
  return true;
}

uint64_t RoundUpTo(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Runs `iterations` timed steps (after one untimed) with every group's gradients handed over at
// once; returns the median step time. While it runs, `peak` tracks the host tier's use.
double TimeSteps(OffloadedAdam& opt, const std::vector<ParamGroup>& groups,
                 const std::vector<std::vector<uint16_t>>& grads,
                 std::vector<std::vector<uint16_t>>& outs, int iterations, bool quiet,
                 const char* label) {
  std::vector<double> times;
  for (int it = 0; it <= iterations; ++it) {
    const absl::Time t0 = absl::Now();
    if (absl::Status s = opt.BeginStep(); !s.ok()) Die(s, "BeginStep");
    for (size_t g = groups.size(); g-- > 0;) {  // backward order
      if (absl::Status s = opt.StepGroup(g, grads[g].data(), ScalarType::kBFloat16, outs[g].data(),
                                         ScalarType::kBFloat16);
          !s.ok()) {
        Die(s, "StepGroup");
      }
    }
    absl::StatusOr<OptimizerStepStats> stats = opt.FinishStep();
    if (!stats.ok()) Die(stats.status(), "FinishStep");
    const double s = absl::ToDoubleSeconds(absl::Now() - t0);
    if (!quiet) {
      std::printf(
          "    %s step %lld: %.3f s (compute %.3f s, waiting for state %.3f s, for "
          "write-backs %.3f s)%s\n",
          label, static_cast<long long>(stats->step), s, absl::ToDoubleSeconds(stats->compute),
          absl::ToDoubleSeconds(stats->state_wait), absl::ToDoubleSeconds(stats->write_wait),
          it == 0 ? " (warm-up)" : "");
    }
    if (it > 0) times.push_back(s);
  }
  return Median(times);
}

// The step's I/O without its kernels: `read` chunks come up through a window of `window` chunks
// (read-ahead plus write-backs in flight), and as each arrives, `written`'s chunk of the same
// index is overwritten on the host and written back. With `read` == `written` that is the
// optimizer's own pattern: each chunk rewritten where it was just read from. Returns seconds.
double WindowedIo(Client& c, std::span<const ChunkId> read, std::span<const ChunkId> written,
                  size_t window) {
  return TimeMs([&] {
           std::deque<CompletionToken> reads, writes;
           auto check = [](absl::Status s) {
             if (!s.ok()) Die(s, "windowed I/O");
           };
           auto ask = [&](absl::StatusOr<CompletionToken> t, std::deque<CompletionToken>& q) {
             check(t.status());
             q.push_back(*t);
           };
           size_t next = 0;
           for (; next < std::min(window, read.size()); ++next) {
             ask(c.PrefetchIds(read.subspan(next, 1), Tier::kHost), reads);
           }
           for (size_t i = 0; i < read.size(); ++i) {
             check(c.Wait(reads.front()));
             reads.pop_front();
             absl::StatusOr<Acquired> a =
                 c.AcquireIds(written.subspan(i, 1), Tier::kHost, AccessMode::kOverwrite);
             check(a.status());
             check(c.Wait(a->ready));
             check(c.Release(written.subspan(i, 1)));
             ask(c.EvictIds(written.subspan(i, 1), Tier::kNvme), writes);
             while (reads.size() + writes.size() >= window) {
               check(c.Wait(writes.front()));
               writes.pop_front();
             }
             if (next < read.size())
               ask(c.PrefetchIds(read.subspan(next++, 1), Tier::kHost), reads);
           }
           for (CompletionToken t : writes) check(c.Wait(t));
         }) /
         1e3;
}

}  // namespace

int OffloadStep(int argc, char** argv) {
  OffloadOptions o;
  if (!ParseOffload(argc, argv, &o)) {
    std::fprintf(stderr,
                 "usage: tierd-bench offload-step [--json] [--params=1e8] [--groups=10] "
                 "[--iterations=3] [--dir=/var/tmp]\n");
    return 2;
  }
  Reporter out("offload-step", o.json);
  std::vector<ParamGroup> groups;
  for (int g = 0; g < o.groups; ++g) {
    const uint64_t lo = o.params * g / o.groups, hi = o.params * (g + 1) / o.groups;
    groups.push_back({absl::StrCat("layer", g), hi - lo});
  }
  const uint64_t state = o.params * 12;
  const uint64_t budget = state / 4;
  const uint64_t segment = 64 << 20;  // holds the largest shard (48 MiB)
  // The host tier holds the whole state for the in-memory run, twice for the drive measurement.
  const uint64_t host = RoundUpTo(2 * state + state / 4 + (128 << 20), segment);
  RegionFile region(o.dir + "/tierd-offload-region");
  auto daemon = StartDaemon({absl::StrCat("--host_capacity=", host >> 20, "MiB"),
                             absl::StrCat("--host_segment_size=", segment >> 20, "MiB"),
                             absl::StrCat("--nvme_regions=", region.path(), ":",
                                          RoundUpTo(3 * state + (512 << 20), 1 << 30) >> 20, "MiB"),
                             "--nvme_reformat", "--device=none", "--log_level=warn"});
  ClientOptions client_options{.socket_dir = daemon->socket_dir(), .client_name = "offload-step"};
  if (!o.json) {
    std::printf(
        "offload-step: %llu parameters in %d groups, %s of fp32 state (p, m, v), host "
        "budget %s, bf16 gradients and weights\n",
        static_cast<unsigned long long>(o.params), o.groups, FormatSize(state).c_str(),
        FormatSize(budget).c_str());
  }

  std::vector<std::vector<uint16_t>> grads, outs;
  std::vector<std::vector<float>> initial;
  for (const ParamGroup& g : groups) {
    std::vector<uint16_t> grad(g.params);
    std::vector<float> w(g.params);
    for (size_t i = 0; i < g.params; ++i) {
      const float x = static_cast<float>((i * 2654435761u + g.params) % 2001) * 1e-3f - 1.0f;
      grad[i] = kernels::ToBF16(x);
      w[i] = 0.5f * x;
    }
    grads.push_back(std::move(grad));
    initial.push_back(std::move(w));
    outs.emplace_back(g.params);
  }
  auto create = [&](Tier home, uint64_t host_budget) {
    OffloadedAdamOptions opt_options{
        .client = client_options,
        .name = home == Tier::kHost ? "bench/in-memory" : "bench/offload",
        .home = home,
        .persistent = false,
        .host_budget_bytes = host_budget,
        .shard_params = o.shard_params,
        .hyper = {.lr = 1e-3, .weight_decay = 0.01}};
    auto opt = OffloadedAdam::Create(groups, opt_options);
    if (!opt.ok()) Die(opt.status(), "OffloadedAdam::Create");
    for (size_t g = 0; g < groups.size(); ++g) {
      if (absl::Status s = (*opt)->SetParams(g, initial[g]); !s.ok()) Die(s, "SetParams");
    }
    return std::move(*opt);
  };

  // 1. The same step with the state in memory (the host tier).
  double in_memory_s;
  {
    auto opt = create(Tier::kHost, host);
    in_memory_s = TimeSteps(*opt, groups, grads, outs, o.iterations, o.json, "in memory");
  }

  auto offloaded = create(Tier::kNvme, budget);

  // 2. The drive: the state's bytes written down and read back in chunks of the optimizer's
  // shard size, all queued at once, one direction after the other and both at once (a step does
  // both); the faster is the drive's time for the step's bytes.
  double write_s, read_s, both_s, in_place_s, separate_s;
  {
    auto c = ConnectTo(daemon->socket_dir());
    const uint64_t shard = 3 * RoundUpTo(offloaded->shard_params() * 4, 4096);
    std::vector<ChunkSpec> specs(RoundUpTo(state, shard) / shard,
                                 ChunkSpec{.size = shard, .home = Tier::kNvme});
    auto down = c->Allocate(specs);
    auto up = c->Allocate(specs);
    if (!down.ok() || !up.ok()) Die(down.ok() ? up.status() : down.status(), "Allocate");
    Dirty(*c, down->ids(), Tier::kHost);
    write_s = Move(*c, down->ids(), Tier::kNvme, /*evict=*/true) / 1e3;
    read_s = Move(*c, down->ids(), Tier::kHost, /*evict=*/false) / 1e3;
    Dirty(*c, up->ids(), Tier::kHost);
    if (auto t = c->EvictIds(up->ids(), Tier::kNvme); !t.ok() || !c->Wait(*t).ok()) {
      Die(t.status(), "Evict");
    }
    Dirty(*c, down->ids(), Tier::kHost);  // written again: down goes down while up comes up
    // Interleaved chunk by chunk, as a step issues them, so that the drive's queue holds both.
    both_s = TimeMs([&] {
               std::vector<CompletionToken> tokens;
               for (size_t i = 0; i < specs.size(); ++i) {
                 auto w = c->EvictIds({&down->ids()[i], 1}, Tier::kNvme);
                 auto r = c->PrefetchIds({&up->ids()[i], 1}, Tier::kHost);
                 if (!w.ok() || !r.ok()) Die(w.ok() ? r.status() : w.status(), "Evict/Prefetch");
                 tokens.push_back(*w);
                 tokens.push_back(*r);
               }
               for (CompletionToken t : tokens) {
                 if (absl::Status s = c->Wait(t); !s.ok()) Die(s, "Evict/Prefetch");
               }
             }) /
             1e3;
    // Not the bound: where the step's time goes. The step's I/O alone through the optimizer's
    // window, each chunk rewritten where it was read from (as the optimizer does), then the same
    // with the writes going to a second set of chunks. `down` is on NVMe only after the run above,
    // and again after the first of these; `up` is on the host, and is overwritten.
    const size_t window = std::max<uint64_t>(2, budget / shard - 1);
    in_place_s = WindowedIo(*c, down->ids(), down->ids(), window);
    separate_s = WindowedIo(*c, down->ids(), up->ids(), window);
    if (absl::Status s = down->Free(); !s.ok()) Die(s, "Free");
    if (absl::Status s = up->Free(); !s.ok()) Die(s, "Free");
  }
  const double io_bound_s = std::min(write_s + read_s, both_s);
  const double nvme_gbps = 2.0 * state / io_bound_s / 1e9;

  // 3. The out-of-core step, the host tier's use sampled while it runs.
  double offload_s;
  std::atomic<uint64_t> peak{0};
  {
    std::atomic<bool> done{false};
    auto c = ConnectTo(daemon->socket_dir());
    std::thread sampler([&] {
      while (!done.load()) {
        if (auto info = c->GetNodeInfo(); info.ok()) {
          const TierStatus* h = info->tier(Tier::kHost);
          if (h != nullptr) peak = std::max<uint64_t>(peak.load(), h->used_bytes);
        }
        absl::SleepFor(absl::Milliseconds(5));
      }
    });
    offload_s = TimeSteps(*offloaded, groups, grads, outs, o.iterations, o.json, "offloaded");
    done = true;
    sampler.join();
  }
  const double lower_bound_s = std::max(io_bound_s, in_memory_s);
  const std::string fields = absl::StrFormat(",\"params\":%llu,\"host_budget_bytes\":%llu",
                                             static_cast<unsigned long long>(o.params),
                                             static_cast<unsigned long long>(budget));
  out.Add({"step_s", offload_s, "s", fields,
           absl::StrFormat("offloaded step: %.2fx the lower bound; host tier peak %s (budget %s)",
                           offload_s / lower_bound_s, FormatSize(peak.load()).c_str(),
                           FormatSize(budget).c_str())});
  out.Add({"lower_bound_s", lower_bound_s, "s", fields,
           absl::StrFormat("max(drive %.3f s, in memory %.3f s); the drive moved %s down in "
                           "%.3f s, up in %.3f s, both ways at once in %.3f s",
                           io_bound_s, in_memory_s, FormatSize(state).c_str(), write_s, read_s,
                           both_s)});
  out.Add({"nvme_gbps", nvme_gbps, "GB/s", fields, "the state's bytes read and written, this run"});
  out.Add({"in_memory_step_s", in_memory_s, "s", fields, "the same step, state in the host tier"});
  out.Add({"window_io_in_place_s", in_place_s, "s", fields,
           "the step's I/O alone through its window, each chunk rewritten where it was read "
           "(the optimizer's pattern)"});
  out.Add({"window_io_separate_s", separate_s, "s", fields,
           "the same, the writes going to a second set of chunks"});
  out.Add({"host_peak_bytes", static_cast<double>(peak.load()), "B", fields,
           "host tier use at its highest during the offloaded steps"});
  offloaded.reset();
  if (daemon->Stop() != 0) {
    std::fprintf(stderr, "tierd-bench: the daemon did not stop cleanly:\n%s\n",
                 daemon->Log().c_str());
    return 1;
  }
  return 0;
}

}  // namespace tierd::bench
