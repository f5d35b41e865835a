// tierd-bench nvme: chunks evicted to NVMe and prefetched back through the whole stack (client ->
// gRPC -> daemon -> io_uring), beside fio on the same file system with the same I/O size and
// depth, into its own buffers and into the kind of memory the host tier has; and beside each, what
// the block device was asked for (/proc/diskstats): the requests' size, how many were in flight
// and how long each took. Where tierd asks the drive for what fio asks, a difference in bytes per
// second is the drive's, not tierd's.
#include "bench/nvme.h"

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "common/sizes.h"
#include "testing/daemon_process.h"
#include "tierd/client.hpp"

namespace tierd::bench {
namespace {

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

  // GB/s of an Evict of them all to NVMe: acquiring for write first makes the host copies the
  // only valid ones, so the evict writes them.
  double Evict() {
    auto w = c_.AcquireIds(ids_, tierd::Tier::kHost, tierd::AccessMode::kWrite);
    if (!w.ok()) Die(w.status(), "Acquire");
    c_.Abandon(w->ready);
    if (absl::Status s = c_.Release(ids_); !s.ok()) Die(s, "Release");
    return bytes() / Move(c_, ids_, tierd::Tier::kNvme, /*evict=*/true) / 1e6;
  }

  // GB/s of a Prefetch of them all back to the host tier (read, checksums verified).
  double Prefetch() { return bytes() / Move(c_, ids_, tierd::Tier::kHost, /*evict=*/false) / 1e6; }

  Throughput Round() {
    const double evict = Evict();
    return {evict, Prefetch()};
  }

 private:
  tierd::Client& c_;
  uint64_t chunk_;
  std::vector<tierd::ChunkId> ids_;

  double bytes() const { return static_cast<double>(ids_.size() * chunk_); }
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

// fio on the same file system, same I/O size and depth, O_DIRECT, io_uring with registered buffers
// and files as tierd uses them; its buffers in `iomem` (fio's --iomem: malloc, its default, or
// the kind of memory the host tier has); bytes per second of one run.
double FioOnce(const NvmeOptions& o, const char* rw, const char* iomem) {
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

std::vector<std::string> NvmeDaemonArgs(const NvmeOptions& o, uint64_t io_size, uint32_t depth) {
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

// What a block device did in one direction over the intervals counted (/proc/diskstats).
struct DiskCounts {
  uint64_t requests = 0;
  uint64_t sectors = 0;  // of 512 bytes
  uint64_t wait_ms = 0;  // the requests' times, summed
  uint64_t busy_ms = 0;  // time with any request in flight, either direction

  double request_kib() const { return requests == 0 ? 0 : sectors * 512.0 / 1024 / requests; }
  // How many were in flight while the device was busy (Little's law).
  double in_flight() const { return busy_ms == 0 ? 0 : static_cast<double>(wait_ms) / busy_ms; }

  // "512 KiB, 63.8 in flight, 20.1 ms each".
  std::string Describe() const {
    if (requests == 0) return "no requests counted";
    return absl::StrFormat("%.0f KiB, %.1f in flight, %.1f ms each", request_kib(), in_flight(),
                           static_cast<double>(wait_ms) / requests);
  }
  std::string Json(const char* prefix) const {
    return absl::StrFormat(",\"%srequest_kib\":%.1f,\"%sin_flight\":%.2f", prefix, request_kib(),
                           prefix, in_flight());
  }
};

// The block device the directory's file system is on, as /proc/diskstats counts it (a partition,
// a device-mapper volume or a whole disk), or none (tmpfs, a network file system: then nothing is
// counted and the figures say so).
class Disk {
 public:
  explicit Disk(const std::string& dir) {
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0) return;
    major_ = major(st.st_dev);
    minor_ = minor(st.st_dev);
    if (auto now = Read(); now.has_value()) name_ = now->name;
  }
  const std::string& name() const { return name_; }

  // Runs f and adds to *into what the device did meanwhile in one direction; returns f's result.
  template <typename F>
  auto Count(bool write, DiskCounts* into, F&& f) const {
    const std::optional<Raw> before = Read();
    auto result = f();
    const std::optional<Raw> after = Read();
    if (before.has_value() && after.has_value()) {
      into->requests += after->requests[write] - before->requests[write];
      into->sectors += after->sectors[write] - before->sectors[write];
      into->wait_ms += after->wait_ms[write] - before->wait_ms[write];
      into->busy_ms += after->busy_ms - before->busy_ms;
    }
    return result;
  }

 private:
  struct Raw {
    std::string name;
    uint64_t requests[2], sectors[2], wait_ms[2], busy_ms;  // [0] reads, [1] writes
  };

  std::optional<Raw> Read() const {
    if (major_ == 0 && minor_ == 0) return std::nullopt;
    std::ifstream in("/proc/diskstats");
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      unsigned maj = 0, min = 0;
      Raw r;
      uint64_t merged, in_flight;
      if (fields >> maj >> min >> r.name >> r.requests[0] >> merged >> r.sectors[0] >>
              r.wait_ms[0] >> r.requests[1] >> merged >> r.sectors[1] >> r.wait_ms[1] >>
              in_flight >> r.busy_ms &&
          maj == major_ && min == minor_) {
        return r;
      }
    }
    return std::nullopt;
  }

  unsigned major_ = 0, minor_ = 0;
  std::string name_;
};

}  // namespace

int Nvme(const NvmeOptions& o) {
  Reporter out("nvme", o.json);
  RegionFile region(o.dir + "/region0");
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
  // Each case's requests as the drive saw them, summed over its rounds, beside fio's.
  const Disk disk(o.dir);
  if (!o.json && disk.name().empty()) {
    std::printf("  no block device under %s: the drive's requests are not counted\n",
                o.dir.c_str());
  } else if (!o.json) {
    std::printf("  the requests as /dev/%s saw them: mean size, in flight while busy, time each\n",
                disk.name().c_str());
  }
  // One direction of a case: GB/s of each round, and what the drive saw over them all.
  struct Side {
    std::vector<double> fio, like, tierd;
    DiskCounts fio_seen, like_seen, tierd_seen;
  };
  auto spread = [](const std::vector<double>& v) {
    return absl::StrFormat("%.2f-%.2f", *std::min_element(v.begin(), v.end()),
                           *std::max_element(v.begin(), v.end()));
  };
  // op: evict or prefetch; rw: fio's write or read; from: "from" or "into" the memory.
  auto report = [&](uint64_t chunk, const char* op, const char* rw, const char* from,
                    const Side& s) {
    const std::string params = absl::StrFormat(",\"chunk_bytes\":%d", chunk) + io;
    const double f = Median(s.fio), l = Median(s.like), t = Median(s.tierd);
    out.Add({"gbps", f, "GB/s", absl::StrCat(",\"op\":\"fio_", rw, "\"", params),
             absl::StrCat("fio ", rw, ", median of 5 (range ", spread(s.fio), ")")});
    out.Add({"gbps", l, "GB/s", absl::StrCat(",\"op\":\"fio_", rw, "_", like, "\"", params),
             absl::StrCat("fio ", rw, " ", from, " ", like, " memory, median of 5 (range ",
                          spread(s.like), ")")});
    out.Add({"gbps", t, "GB/s", absl::StrCat(",\"op\":\"", op, "\"", params),
             absl::StrFormat("%s %s chunks: %.2f x fio, %.2f x fio %s %s (range %s)", op,
                             tierd::FormatSize(chunk), t / f, t / l, from, like, spread(s.tierd))});
    if (disk.name().empty()) return;
    out.Add({"request_kib", s.tierd_seen.request_kib(), "KiB",
             absl::StrCat(",\"op\":\"", op, "_requests\"", params, s.tierd_seen.Json(""),
                          s.fio_seen.Json("fio_"), s.like_seen.Json("fio_like_")),
             absl::StrCat(op, " ", tierd::FormatSize(chunk), " chunks: ", s.tierd_seen.Describe(),
                          "; fio: ", s.fio_seen.Describe(), "; fio ", from, " ", like, ": ",
                          s.like_seen.Describe())});
  };
  for (uint64_t chunk : {1ull << 20, 4ull << 20, 16ull << 20, 64ull << 20}) {
    NvmeCase run(*c, chunk, o.total);
    (void)run.Round();  // warm-up: the first write of fresh extents
    Side write, read;
    auto fio = [&](const char* rw, const char* iomem, DiskCounts* counts) {
      return disk.Count(rw[0] == 'w', counts, [&] { return FioOnce(o, rw, iomem) / 1e9; });
    };
    for (int i = 0; i < kRounds; ++i) {
      write.fio.push_back(fio("write", "malloc", &write.fio_seen));
      read.fio.push_back(fio("read", "malloc", &read.fio_seen));
      write.like.push_back(fio("write", like, &write.like_seen));
      read.like.push_back(fio("read", like, &read.like_seen));
      write.tierd.push_back(disk.Count(true, &write.tierd_seen, [&] { return run.Evict(); }));
      read.tierd.push_back(disk.Count(false, &read.tierd_seen, [&] { return run.Prefetch(); }));
    }
    report(chunk, "evict", "write", "from", write);
    report(chunk, "prefetch", "read", "into", read);
  }
  c.reset();
  std::filesystem::remove(o.dir + "/fio.dat", ec);
  return daemon->Stop() == 0 ? 0 : 1;
}

}  // namespace tierd::bench
