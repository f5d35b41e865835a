// tierd-bench: measurements of the daemon through the client library, as a training process sees
// them. Every mode prints a table, or with --json one JSON object per line per measurement.
//
//   tierd-bench control [--json] [--socket_dir=DIR] [--chunks=10000] [--samples=2000]
//   tierd-bench nvme [--json] [--dir=DIR] [--total=512MiB] [--io_size=1MiB] [--queue_depth=32]
//                    [--huge_pages=auto|never|require] [--tune] (bench/nvme.cc)
//   tierd-bench pcie [--json] [--device=emulated|cuda] [--total=256MiB] [--dir=DIR]
//   tierd-bench replay [--json] [--policies=on_demand,hints,trace] ... (bench/replay.cc)
//   tierd-bench adam [--json] [--params=1e7,1e8,1e9] [--threads=1,2] ... (bench/adam.cc)
//   tierd-bench offload-step [--json] [--params=1e8] [--dir=DIR] ... (bench/adam.cc)
//
// Without --socket_dir it starts its own tierd (from the build tree) on a temporary directory.
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#ifdef TIERD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/bench_util.h"
#include "bench/nvme.h"
#include "common/sizes.h"
#include "testing/daemon_process.h"
#include "tierd/client.hpp"

namespace {

using tierd::bench::ConnectTo;
using tierd::bench::Die;
using tierd::bench::Dirty;
using tierd::bench::Median;
using tierd::bench::Move;
using tierd::bench::Percentile;
using tierd::bench::Reporter;
using tierd::bench::StartDaemon;
using tierd::bench::TimeMs;

struct Options {
  std::string mode;
  bool json = false;
  std::string socket_dir;
  uint64_t chunks = 10000;
  uint64_t samples = 2000;
  uint64_t chunk_size = 4096;
  std::string dir = "var/bench";    // nvme, pcie: where the regions (and fio's file) go
  uint64_t total = 512ull << 20;    // nvme, pcie: bytes moved per measurement
  tierd::bench::NvmeOptions nvme;   // nvme: the rest of its flags (bench/nvme.h)
  std::string device = "emulated";  // pcie: cuda or emulated
};

// --- pcie -----------------------------------------------------------------------------------

#ifdef TIERD_HAVE_CUDA
// The reference: plain cudaMemcpyAsync between cudaHostAlloc memory and cudaMalloc memory, chunk by
// chunk on one stream per direction, in the same program run.
struct Reference {
  double h2d = 0, d2h = 0, bidir = 0;
};
Reference MeasureReference(uint64_t total, uint64_t chunk) {
  Reference r;
  void *host = nullptr, *dev = nullptr, *host2 = nullptr, *dev2 = nullptr;
  cudaStream_t up, down;
  if (cudaHostAlloc(&host, total, cudaHostAllocDefault) != cudaSuccess ||
      cudaHostAlloc(&host2, total, cudaHostAllocDefault) != cudaSuccess ||
      cudaMalloc(&dev, total) != cudaSuccess || cudaMalloc(&dev2, total) != cudaSuccess ||
      cudaStreamCreate(&up) != cudaSuccess || cudaStreamCreate(&down) != cudaSuccess) {
    Die(absl::InternalError("cudaHostAlloc/cudaMalloc failed"), "reference");
  }
  auto run = [&](bool h2d, bool d2h) {
    double best = 0;
    for (int round = 0; round < 3; ++round) {
      double ms = TimeMs([&] {
        for (uint64_t off = 0; off < total; off += chunk) {
          if (h2d) {
            cudaMemcpyAsync(static_cast<char*>(dev) + off, static_cast<char*>(host) + off, chunk,
                            cudaMemcpyHostToDevice, up);
          }
          if (d2h) {
            cudaMemcpyAsync(static_cast<char*>(host2) + off, static_cast<char*>(dev2) + off, chunk,
                            cudaMemcpyDeviceToHost, down);
          }
        }
        cudaStreamSynchronize(up);
        cudaStreamSynchronize(down);
      });
      best = std::max(best, static_cast<double>(total) * (h2d + d2h) / ms / 1e6);
    }
    return best;
  };
  r.h2d = run(true, false);
  r.d2h = run(false, true);
  r.bidir = run(true, true);
  cudaFreeHost(host);
  cudaFreeHost(host2);
  cudaFree(dev);
  cudaFree(dev2);
  cudaStreamDestroy(up);
  cudaStreamDestroy(down);
  return r;
}
#endif

int Pcie(const Options& o) {
  Reporter out(o.mode, o.json);
  const uint64_t chunk = 16 << 20;
  const uint64_t total = std::max<uint64_t>(o.total, 2 * chunk);
  const size_t n = total / chunk;
  tierd::bench::RegionFile region(o.dir + "/pcie-region");
  auto daemon = StartDaemon(
      {absl::StrCat("--device=", o.device),
       absl::StrCat("--device_capacity=", tierd::AlignUp(2 * (total >> 20), 256), "MiB"),
       absl::StrCat("--host_capacity=", tierd::AlignUp(2 * (total >> 20) + 256, 256), "MiB"),
       absl::StrCat("--nvme_regions=", o.dir, "/pcie-region:", 2 * (total >> 20) + 256, "MiB"),
       "--nvme_reformat", "--log_level=warn"});
  auto c = ConnectTo(daemon->socket_dir());
  auto info = c->GetNodeInfo();
  if (!info.ok() || info->devices.empty()) {
    Die(absl::FailedPreconditionError(info.ok() ? info->device_status : "no node info"),
        "device tier");
  }
  const std::string& device = info->devices[0];
  const std::string backend = o.device;
  if (!o.json) {
    std::printf("tierd-bench pcie: %s in %s chunks, device %s\n", tierd::FormatSize(total).c_str(),
                tierd::FormatSize(chunk).c_str(), device.c_str());
  }
  std::vector<tierd::ChunkSpec> specs(n, tierd::ChunkSpec{.size = chunk});
  auto a = c->AllocateIds(specs);
  auto b = c->AllocateIds(specs);
  if (!a.ok() || !b.ok()) Die(a.ok() ? b.status() : a.status(), "Allocate");
  const double bytes = static_cast<double>(total);
  double h2d = 0, d2h = 0, bidir = 0;
  for (int round = 0; round < 3; ++round) {
    Dirty(*c, *a, tierd::Tier::kHost);
    h2d = std::max(h2d, bytes / Move(*c, *a, tierd::Tier::kDevice, false) / 1e6);
    Dirty(*c, *a, tierd::Tier::kDevice);
    d2h = std::max(d2h, bytes / Move(*c, *a, tierd::Tier::kHost, true) / 1e6);
    // Both directions at once: A goes up while B comes down.
    Move(*c, *b, tierd::Tier::kDevice, false);
    Dirty(*c, *a, tierd::Tier::kHost);
    Dirty(*c, *b, tierd::Tier::kDevice);
    absl::Status st;
    double ms = TimeMs([&] {
      auto up = c->PrefetchIds(*a, tierd::Tier::kDevice);
      auto down = c->EvictIds(*b, tierd::Tier::kHost);
      st = up.ok() ? c->Wait(*up) : up.status();
      absl::Status st2 = down.ok() ? c->Wait(*down) : down.status();
      if (st.ok()) st = st2;
    });
    if (!st.ok()) Die(st, "bidirectional");
    bidir = std::max(bidir, 2 * bytes / ms / 1e6);
  }
  const std::string params =
      absl::StrFormat(",\"backend\":\"%s\",\"chunk_bytes\":%d", backend, chunk);
#ifdef TIERD_HAVE_CUDA
  if (backend == "cuda") {
    Reference ref = MeasureReference(total, chunk);
    out.Add({"gbps", ref.h2d, "GB/s", ",\"op\":\"ref_h2d\"" + params,
             "cudaMemcpyAsync from cudaHostAlloc memory"});
    out.Add({"gbps", ref.d2h, "GB/s", ",\"op\":\"ref_d2h\"" + params, "the same, device to host"});
    out.Add({"gbps", ref.bidir, "GB/s", ",\"op\":\"ref_bidir\"" + params, "both at once"});
    out.Add({"gbps", h2d, "GB/s", ",\"op\":\"h2d\"" + params,
             absl::StrFormat("h2d: %.2f x reference", h2d / ref.h2d)});
    out.Add({"gbps", d2h, "GB/s", ",\"op\":\"d2h\"" + params,
             absl::StrFormat("d2h: %.2f x reference", d2h / ref.d2h)});
    out.Add({"gbps", bidir, "GB/s", ",\"op\":\"bidir\"" + params,
             absl::StrFormat("bidir: %.2f x reference", bidir / ref.bidir)});
  }
#endif
  if (backend != "cuda") {
    const std::string note = " (emulated device: copies are memcpy paced to --emulated_gbps)";
    out.Add({"gbps", h2d, "GB/s", ",\"op\":\"h2d\"" + params,
             "h2d: host pool -> device chunks" + note});
    out.Add({"gbps", d2h, "GB/s", ",\"op\":\"d2h\"" + params,
             "d2h: device chunks -> host pool" + note});
    out.Add(
        {"gbps", bidir, "GB/s", ",\"op\":\"bidir\"" + params, "bidir: both at once, total" + note});
  }
  // NVMe -> GPU: one pipelined prefetch, beside its two parts done one after the other.
  Move(*c, *a, tierd::Tier::kNvme, true);  // A only on NVMe now
  double pipelined = 0, nvme_to_host = 0, host_to_device = 0;
  for (int round = 0; round < 3; ++round) {
    pipelined = std::max(pipelined, bytes / Move(*c, *a, tierd::Tier::kDevice, false) / 1e6);
    Move(*c, *a, tierd::Tier::kNvme, true);
    const double t1 = Move(*c, *a, tierd::Tier::kHost, false);
    const double t2 = Move(*c, *a, tierd::Tier::kDevice, false);
    nvme_to_host = std::max(nvme_to_host, bytes / t1 / 1e6);
    host_to_device = std::max(host_to_device, bytes / t2 / 1e6);
    Move(*c, *a, tierd::Tier::kNvme, true);
  }
  const double serial = 1.0 / (1.0 / nvme_to_host + 1.0 / host_to_device);
  out.Add({"gbps", pipelined, "GB/s", ",\"op\":\"nvme_to_device\"" + params,
           absl::StrFormat("NVMe->device pipelined; as two steps one after the other: %.2f GB/s "
                           "(NVMe->host %.2f, host->device %.2f)",
                           serial, nvme_to_host, host_to_device)});
  out.Add({"gbps", serial, "GB/s", ",\"op\":\"nvme_to_device_serial\"" + params,
           "NVMe->device as two steps (sum of the parts)"});
  c.reset();
  return daemon->Stop() == 0 ? 0 : 1;
}

int Control(const Options& o, tierd::Client& c) {
  Reporter out(o.mode, o.json);
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
    } else if (a.substr(0, 6) == "--dir=") {
      o->dir = std::string(a.substr(6));
    } else if (a.substr(0, 9) == "--device=") {
      o->device = std::string(a.substr(9));
      if (o->device != "cuda" && o->device != "emulated") return false;
    } else if (a == "--tune") {
      o->nvme.tune = true;
    } else if (a.substr(0, 8) == "--total=") {
      auto v = tierd::ParseSize(std::string(a.substr(8)));
      if (!v.ok()) return false;
      o->total = *v;
    } else if (a.substr(0, 10) == "--io_size=") {
      auto v = tierd::ParseSize(std::string(a.substr(10)));
      if (!v.ok()) return false;
      o->nvme.io_size = *v;
    } else if (a.substr(0, 13) == "--huge_pages=") {
      o->nvme.huge_pages = std::string(a.substr(13));
      if (o->nvme.huge_pages != "auto" && o->nvme.huge_pages != "never" &&
          o->nvme.huge_pages != "require") {
        return false;
      }
    } else if (a.substr(0, 14) == "--queue_depth=") {
      if (!absl::SimpleAtoi(std::string(a.substr(14)), &o->nvme.queue_depth)) return false;
    } else if (!value("--chunks=", &o->chunks) && !value("--samples=", &o->samples) &&
               !value("--chunk_size=", &o->chunk_size)) {
      std::fprintf(stderr, "tierd-bench: unknown or malformed option '%s'\n", argv[i]);
      return false;
    }
  }
  return (o->mode == "control" || o->mode == "nvme" || o->mode == "pcie") && o->chunks > 0 &&
         o->samples > 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::string_view(argv[1]) == "replay") return tierd::bench::Replay(argc, argv);
  if (argc >= 2 && std::string_view(argv[1]) == "adam") return tierd::bench::Adam(argc, argv);
  if (argc >= 2 && std::string_view(argv[1]) == "offload-step") {
    return tierd::bench::OffloadStep(argc, argv);
  }
  if (argc >= 2 && std::string_view(argv[1]) == "soak") return tierd::bench::Soak(argc, argv);
  if (argc >= 2 && std::string_view(argv[1]) == "soak-client") {
    return tierd::bench::SoakClient(argc, argv);
  }
  if (argc >= 2 && std::string_view(argv[1]) == "gpu-adam") {
#ifdef TIERD_HAVE_CUDA
    return tierd::bench::GpuAdam(argc, argv);
#else
    std::fprintf(stderr, "tierd-bench gpu-adam: this build has no CUDA (configure with CUDA)\n");
    return 2;
#endif
  }
  Options o;
  if (!Parse(argc, argv, &o)) {
    std::fprintf(stderr,
                 "usage: tierd-bench control [--json] [--socket_dir=DIR] [--chunks=N] "
                 "[--samples=N] [--chunk_size=BYTES]\n"
                 "       tierd-bench nvme [--json] [--dir=DIR] [--total=512MiB] [--io_size=1MiB] "
                 "[--queue_depth=32] [--huge_pages=auto|never|require] [--tune]\n"
                 "       tierd-bench pcie [--json] [--device=emulated|cuda] [--total=256MiB] "
                 "[--dir=DIR]\n"
                 "       tierd-bench replay --help\n"
                 "       tierd-bench adam --help\n"
                 "       tierd-bench offload-step --help\n"
                 "       tierd-bench gpu-adam --help\n"
                 "       tierd-bench soak [--minutes=30] [--json] (--help)\n");
    return 2;
  }
  if (o.mode == "nvme") {
    o.nvme.json = o.json;  // the flags nvme shares with the other modes
    o.nvme.dir = o.dir;
    o.nvme.total = o.total;
    return tierd::bench::Nvme(o.nvme);
  }
  if (o.mode == "pcie") {
    std::error_code ec;
    std::filesystem::create_directories(o.dir, ec);
    return Pcie(o);
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
