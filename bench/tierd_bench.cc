// tierd-bench: measurements of the daemon through the client library, as a training process sees
// them. Every mode prints a table, or with --json one JSON object per line per measurement.
//
//   tierd-bench control [--json] [--socket_dir=DIR] [--chunks=10000] [--samples=2000]
//   tierd-bench nvme [--json] [--dir=DIR] [--total=512MiB] [--io_size=1MiB] [--queue_depth=32]
//                    [--huge_pages=auto|never|require] [--tune]
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
  std::string dir = "var/bench";  // nvme: where the regions and fio's file go
  uint64_t total = 512ull << 20;  // nvme: bytes moved per measurement
  bool tune = false;              // nvme: sweep I/O size x queue depth
  uint64_t io_size = 1 << 20;
  uint32_t queue_depth = 32;
  std::string huge_pages = "auto";  // nvme: the host tier's pages (the daemon's host.huge_pages)
  std::string device = "emulated";  // pcie: cuda or emulated
};

// --- nvme -----------------------------------------------------------------------------------

struct Throughput {
  double evict_gbps = 0;
  double prefetch_gbps = 0;
};

// `total` bytes in chunks of `chunk`, allocated once; each Round evicts them all to NVMe (after a
// write acquisition, so each evict writes) and prefetches them back.
class NvmeCase {
 public:
  NvmeCase(tierd::Client& c, uint64_t chunk, uint64_t total) : c_(c), chunk_(chunk) {
    const size_t n = std::max<uint64_t>(1, total / chunk);
    std::vector<tierd::ChunkSpec> specs(n, tierd::ChunkSpec{.size = chunk});
    auto ids = c.AllocateIds(specs);
    if (!ids.ok()) Die(ids.status(), "Allocate");
    ids_ = std::move(*ids);
    auto w = c.AcquireIds(ids_, tierd::Tier::kHost, tierd::AccessMode::kWrite);
    if (!w.ok()) Die(w.status(), "Acquire");
    for (const auto& a : w->chunks) std::memset(a.data, 0x5A, a.size);
    c.Abandon(w->ready);
    if (absl::Status s = c.Release(ids_); !s.ok()) Die(s, "Release");
  }
  ~NvmeCase() { (void)c_.Free(ids_); }

  Throughput Round() {
    // Acquiring for write makes the host copies the only valid ones, so the evict writes them.
    auto w = c_.AcquireIds(ids_, tierd::Tier::kHost, tierd::AccessMode::kWrite);
    if (!w.ok()) Die(w.status(), "Acquire");
    c_.Abandon(w->ready);
    if (absl::Status s = c_.Release(ids_); !s.ok()) Die(s, "Release");
    absl::Status st;
    const double evict_ms = TimeMs([&] {
      auto t = c_.EvictIds(ids_, tierd::Tier::kNvme);
      st = t.ok() ? c_.Wait(*t) : t.status();
    });
    if (!st.ok()) Die(st, "Evict");
    const double prefetch_ms = TimeMs([&] {
      auto t = c_.PrefetchIds(ids_, tierd::Tier::kHost);
      st = t.ok() ? c_.Wait(*t) : t.status();
    });
    if (!st.ok()) Die(st, "Prefetch");
    const double bytes = static_cast<double>(ids_.size() * chunk_);
    return {bytes / evict_ms / 1e6, bytes / prefetch_ms / 1e6};
  }

 private:
  tierd::Client& c_;
  uint64_t chunk_;
  std::vector<tierd::ChunkId> ids_;
};

Throughput MoveThroughNvme(tierd::Client& c, uint64_t chunk, uint64_t total) {
  NvmeCase run(c, chunk, total);
  Throughput best;
  for (int round = 0; round < 3; ++round) {
    Throughput t = run.Round();
    best.evict_gbps = std::max(best.evict_gbps, t.evict_gbps);
    best.prefetch_gbps = std::max(best.prefetch_gbps, t.prefetch_gbps);
  }
  return best;
}

double FioOnce(const Options& o, const char* rw, const char* iomem);

// fio on the same file system, same I/O size and depth, O_DIRECT, io_uring with registered buffers
// and files as tierd uses them; its buffers in `iomem` (fio's --iomem: malloc, its default, or
// the kind of memory the host tier has); bytes per second of one run.
double FioOnce(const Options& o, const char* rw, const char* iomem) {
  const std::string file = o.dir + "/fio.dat";
  std::string out;
  int rc = tierd::testing::RunProcess(
      {"/usr/bin/fio", "--name=bench", "--filename=" + file, absl::StrCat("--size=", o.total),
       absl::StrCat("--bs=", o.io_size), absl::StrCat("--iodepth=", o.queue_depth),
       "--ioengine=io_uring", "--fixedbufs=1", "--registerfiles=1", "--direct=1",
       absl::StrCat("--iomem=", iomem), absl::StrCat("--rw=", rw), "--end_fsync=1",
       "--output-format=json"},
      &out);
  if (rc != 0) Die(absl::InternalError(out), "fio (is the fio package installed?)");
  const std::string section =
      std::string("\"") + (std::string(rw) == "write" ? "write" : "read") + "\" : {";
  size_t at = out.find(section);
  if (at == std::string::npos) Die(absl::InternalError(out), "parsing fio's output");
  at = out.find("\"bw_bytes\"", at);
  if (at == std::string::npos) Die(absl::InternalError(out), "parsing fio's output");
  at = out.find(':', at);
  return std::strtod(out.c_str() + at + 1, nullptr);
}

std::vector<std::string> NvmeDaemonArgs(const Options& o, uint64_t io_size, uint32_t depth) {
  const uint64_t stripe = std::max<uint64_t>(io_size, 1 << 20);
  return {absl::StrCat("--host_capacity=", tierd::AlignUp((o.total >> 20) + 256, 256), "MiB"),
          absl::StrCat("--nvme_regions=", o.dir, "/region0:", (o.total >> 20) * 2 + 512, "MiB"),
          absl::StrCat("--nvme_io_size=", io_size),
          absl::StrCat("--nvme_stripe_unit=", stripe),
          absl::StrCat("--nvme_queue_depth=", depth),
          absl::StrCat("--huge_pages=", o.huge_pages),
          "--nvme_reformat",
          "--log_level=warn"};
}

int Nvme(const Options& o) {
  Reporter out(o.mode, o.json);
  tierd::bench::RegionFile region(o.dir + "/region0");
  std::error_code ec;
  std::filesystem::create_directories(o.dir, ec);
  if (o.tune) {
    struct Point {
      uint64_t io_size;
      uint32_t depth;
      double gbps;
    };
    std::vector<Point> points;
    for (uint64_t io : {128ull << 10, 256ull << 10, 512ull << 10, 1ull << 20}) {
      for (uint32_t depth : {4u, 8u, 16u, 32u, 64u}) {
        auto daemon = StartDaemon(NvmeDaemonArgs(o, io, depth));
        auto c = ConnectTo(daemon->socket_dir());
        Throughput t = MoveThroughNvme(*c, 16 << 20, o.total);
        c.reset();
        daemon->Stop();
        const double both = std::min(t.evict_gbps, t.prefetch_gbps);
        points.push_back({io, depth, both});
        out.Add({"gbps", both, "GB/s",
                 absl::StrFormat(",\"op\":\"tune\",\"io_bytes\":%d,\"queue_depth\":%d", io, depth),
                 absl::StrFormat("io_size %s, queue depth %d (slower of evict and prefetch)",
                                 tierd::FormatSize(io), depth)});
      }
    }
    // The smallest depth and I/O size within 3 % of the best: as fast, with less in flight.
    double best = 0;
    for (const Point& p : points) best = std::max(best, p.gbps);
    const Point* pick = nullptr;
    for (const Point& p : points) {
      if (p.gbps >= 0.97 * best &&
          (pick == nullptr || p.depth * p.io_size < pick->depth * pick->io_size)) {
        pick = &p;
      }
    }
    std::printf(
        "\n# best settings for %s (%.2f GB/s); add to the tierd config:\n[nvme]\n"
        "io_size = \"%s\"\nqueue_depth = %u\n",
        o.dir.c_str(), pick->gbps, tierd::FormatSize(pick->io_size).c_str(), pick->depth);
    return 0;
  }

  auto daemon = StartDaemon(NvmeDaemonArgs(o, o.io_size, o.queue_depth));
  auto c = ConnectTo(daemon->socket_dir());
  // fio runs twice: into its own buffers (what the drive gives) and into the kind of memory the
  // host tier has, shared 4 KiB pages or shared 2 MiB huge pages (where the tier's pages cost).
  auto info = c->GetNodeInfo();
  if (!info.ok()) Die(info.status(), "GetNodeInfo");
  const tierd::TierStatus* host = info->tier(tierd::Tier::kHost);
  const bool huge = host != nullptr && host->detail.find("huge pages") != std::string::npos;
  const char* like = huge ? "shmhuge" : "mmapshared";
  if (!o.json) {
    std::printf(
        "tierd-bench nvme: %s moved per case, io_size %s, queue depth %u, in %s; host tier: %s\n",
        tierd::FormatSize(o.total).c_str(), tierd::FormatSize(o.io_size).c_str(), o.queue_depth,
        o.dir.c_str(), host != nullptr ? host->detail.c_str() : "none");
  }
  const std::string io =
      absl::StrFormat(",\"io_bytes\":%d,\"queue_depth\":%d", o.io_size, o.queue_depth);
  // fio and tierd take turns, five rounds each per chunk size, and the medians are compared: a
  // virtual or shared disk drifts by tens of percent from one run to the next, and taking turns
  // exposes both sides to the same drift.
  constexpr int kRounds = 5;
  for (uint64_t chunk : {1ull << 20, 4ull << 20, 16ull << 20, 64ull << 20}) {
    NvmeCase run(*c, chunk, o.total);
    (void)run.Round();  // warm-up: the first write of fresh extents
    std::vector<double> fio_w, fio_r, like_w, like_r, evict, prefetch;
    for (int i = 0; i < kRounds; ++i) {
      fio_w.push_back(FioOnce(o, "write", "malloc") / 1e9);
      fio_r.push_back(FioOnce(o, "read", "malloc") / 1e9);
      like_w.push_back(FioOnce(o, "write", like) / 1e9);
      like_r.push_back(FioOnce(o, "read", like) / 1e9);
      Throughput t = run.Round();
      evict.push_back(t.evict_gbps);
      prefetch.push_back(t.prefetch_gbps);
    }
    const double fw = Median(fio_w), fr = Median(fio_r), lw = Median(like_w), lr = Median(like_r),
                 ev = Median(evict), pf = Median(prefetch);
    const std::string params = absl::StrFormat(",\"chunk_bytes\":%d", chunk) + io;
    auto spread = [](const std::vector<double>& v) {
      return absl::StrFormat("%.2f-%.2f", *std::min_element(v.begin(), v.end()),
                             *std::max_element(v.begin(), v.end()));
    };
    out.Add({"gbps", fw, "GB/s", ",\"op\":\"fio_write\"" + params,
             "fio write, median of 5 (range " + spread(fio_w) + ")"});
    out.Add({"gbps", lw, "GB/s", absl::StrCat(",\"op\":\"fio_write_", like, "\"", params),
             absl::StrCat("fio write from ", like, " memory, median of 5 (range ", spread(like_w),
                          ")")});
    out.Add({"gbps", ev, "GB/s", ",\"op\":\"evict\"" + params,
             absl::StrFormat("evict %s chunks: %.2f x fio, %.2f x fio from %s (range %s)",
                             tierd::FormatSize(chunk), ev / fw, ev / lw, like, spread(evict))});
    out.Add({"gbps", fr, "GB/s", ",\"op\":\"fio_read\"" + params,
             "fio read, median of 5 (range " + spread(fio_r) + ")"});
    out.Add({"gbps", lr, "GB/s", absl::StrCat(",\"op\":\"fio_read_", like, "\"", params),
             absl::StrCat("fio read into ", like, " memory, median of 5 (range ", spread(like_r),
                          ")")});
    out.Add({"gbps", pf, "GB/s", ",\"op\":\"prefetch\"" + params,
             absl::StrFormat("prefetch %s chunks: %.2f x fio, %.2f x fio into %s (range %s)",
                             tierd::FormatSize(chunk), pf / fr, pf / lr, like, spread(prefetch))});
  }
  c.reset();
  std::filesystem::remove(o.dir + "/fio.dat", ec);
  return daemon->Stop() == 0 ? 0 : 1;
}

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
      o->tune = true;
    } else if (a.substr(0, 8) == "--total=") {
      auto v = tierd::ParseSize(std::string(a.substr(8)));
      if (!v.ok()) return false;
      o->total = *v;
    } else if (a.substr(0, 10) == "--io_size=") {
      auto v = tierd::ParseSize(std::string(a.substr(10)));
      if (!v.ok()) return false;
      o->io_size = *v;
    } else if (a.substr(0, 13) == "--huge_pages=") {
      o->huge_pages = std::string(a.substr(13));
      if (o->huge_pages != "auto" && o->huge_pages != "never" && o->huge_pages != "require") {
        return false;
      }
    } else if (a.substr(0, 14) == "--queue_depth=") {
      if (!absl::SimpleAtoi(std::string(a.substr(14)), &o->queue_depth)) return false;
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
  if (o.mode == "nvme") return Nvme(o);
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
