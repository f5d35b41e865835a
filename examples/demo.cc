// The tierd demo: what a training process does with the daemon, on a small scale. It allocates
// chunks in the shared host tier, writes them through the zero-copy mapping, evicts them to NVMe
// and prefetches them back (checksummed), reads them back, frees them, and prints a summary.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "tierd/client.hpp"

namespace {

int Fail(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "demo: %s failed: %s\n", what, s.ToString().c_str());
  return 1;
}

std::string Mib(uint64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

// A pattern that differs per chunk and per 8-byte word, so misplaced or stale data shows.
uint64_t Word(tierd::ChunkId id, size_t i) { return (id * 0x9E3779B97F4A7C15ull) ^ (i * 31 + 7); }

}  // namespace

int main(int argc, char** argv) {
  tierd::ClientOptions options;
  options.client_name = "tierd-demo";
  if (argc > 1) options.socket_dir = argv[1];
  absl::StatusOr<std::unique_ptr<tierd::Client>> client = tierd::Client::Connect(options);
  if (!client.ok()) return Fail(client.status(), "connect");
  tierd::Client& c = **client;

  absl::StatusOr<tierd::NodeInfo> node = c.GetNodeInfo();
  if (!node.ok()) return Fail(node.status(), "GetNodeInfo");
  const tierd::TierStatus* host = node->tier(tierd::Tier::kHost);
  std::printf("connected: session %llu on %s, tierd %s\n",
              static_cast<unsigned long long>(c.session_id()), node->hostname.c_str(),
              node->version.c_str());
  std::printf("host tier: %s\n", host->detail.c_str());
  std::printf("devices: %s\n",
              node->devices.empty() ? node->device_status.c_str() : node->devices.front().c_str());

  // A layer's worth of chunks: weights, gradients and optimizer state of different sizes.
  const std::vector<uint64_t> sizes = {1 << 20, 4 << 20, 16 << 20, 4 << 20,
                                       1 << 20, 2 << 20, 8 << 20,  64 << 10};
  std::vector<tierd::ChunkSpec> specs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    tierd::ChunkSpec spec;
    spec.size = sizes[i];
    spec.tags = {i % 2 == 0 ? "weights" : "optimizer"};
    specs.push_back(spec);
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<tierd::ChunkSet> chunks = c.Allocate(specs);
  if (!chunks.ok()) return Fail(chunks.status(), "Allocate");
  uint64_t total = 0;
  for (uint64_t s : sizes) total += s;
  std::printf("allocated %zu chunks, %s\n", chunks->size(), Mib(total).c_str());

  {
    absl::StatusOr<tierd::Acquisition> w =
        c.Acquire(chunks->ids(), tierd::Tier::kHost, tierd::AccessMode::kWrite);
    if (!w.ok()) return Fail(w.status(), "Acquire for write");
    if (absl::Status s = w->Wait(); !s.ok()) return Fail(s, "wait for write acquisition");
    for (const tierd::AcquiredChunk& chunk : w->chunks()) {
      auto* words = static_cast<uint64_t*>(chunk.data);
      for (size_t i = 0; i < chunk.size / 8; ++i) words[i] = Word(chunk.id, i);
    }
    if (absl::Status s = w->Release(); !s.ok()) return Fail(s, "Release");
  }
  std::printf("wrote every chunk through the shared mapping (no copy through the daemon)\n");

  // Down to NVMe (written durably through io_uring straight from the shared pages, then the host
  // copies are dropped), and back up.
  const tierd::TierStatus* nvme_tier = node->tier(tierd::Tier::kNvme);
  uint64_t host_after_evict = 0, nvme_after_evict = 0;
  absl::Duration evict_time, prefetch_time;
  if (nvme_tier != nullptr && nvme_tier->configured) {
    std::printf("nvme tier: %s\n", nvme_tier->detail.c_str());
    absl::Time t0 = absl::Now();
    absl::StatusOr<tierd::Completion> evict = c.Evict(chunks->ids(), tierd::Tier::kNvme);
    if (!evict.ok()) return Fail(evict.status(), "Evict");
    if (absl::Status s = evict->Wait(); !s.ok()) return Fail(s, "wait for evict");
    evict_time = absl::Now() - t0;
    absl::StatusOr<tierd::NodeInfo> after = c.GetNodeInfo();
    if (!after.ok()) return Fail(after.status(), "GetNodeInfo");
    host_after_evict = after->tier(tierd::Tier::kHost)->used_bytes;
    nvme_after_evict = after->tier(tierd::Tier::kNvme)->used_bytes;
    std::printf("evicted to NVMe in %s: host tier now holds %s, NVMe %s\n",
                absl::FormatDuration(evict_time).c_str(), Mib(host_after_evict).c_str(),
                Mib(nvme_after_evict).c_str());
  }
  absl::Time t1 = absl::Now();
  absl::StatusOr<tierd::Completion> prefetch = c.Prefetch(chunks->ids(), tierd::Tier::kHost);
  if (!prefetch.ok()) return Fail(prefetch.status(), "Prefetch");
  if (absl::Status s = prefetch->Wait(); !s.ok()) return Fail(s, "wait for prefetch");
  prefetch_time = absl::Now() - t1;
  std::printf("prefetched back to the host tier in %s (checksums verified)\n",
              absl::FormatDuration(prefetch_time).c_str());

  // Up to the GPU and back, when the node has a device tier.
  const tierd::TierStatus* device_tier = node->tier(tierd::Tier::kDevice);
  bool device_checked = false;
  if (device_tier != nullptr && device_tier->configured) {
    absl::StatusOr<tierd::Completion> up = c.Prefetch(chunks->ids(), tierd::Tier::kDevice);
    if (!up.ok()) return Fail(up.status(), "Prefetch to the device");
    if (absl::Status s = up->Wait(); !s.ok()) return Fail(s, "wait for device prefetch");
    absl::StatusOr<tierd::Acquisition> d =
        c.Acquire(chunks->ids(), tierd::Tier::kDevice, tierd::AccessMode::kRead);
    if (!d.ok()) return Fail(d.status(), "Acquire on the device");
    size_t device_bad = 0;
    if (d->chunks().front().host_accessible) {  // an emulated device: its memory is readable here
      for (const tierd::AcquiredChunk& chunk : d->chunks()) {
        const auto* words = static_cast<const uint64_t*>(chunk.data);
        for (size_t i = 0; i < chunk.size / 8; ++i) device_bad += words[i] != Word(chunk.id, i);
      }
      device_checked = true;
    }
    if (absl::Status s = d->Release(); !s.ok()) return Fail(s, "Release on the device");
    std::printf("copied to the device tier (%s)%s\n", node->devices.front().c_str(),
                device_checked
                    ? absl::StrFormat(" and verified there: %zu bad words", device_bad).c_str()
                    : "");
    if (device_bad != 0) return 1;
  }

  size_t bad = 0;
  {
    absl::StatusOr<tierd::Acquisition> r =
        c.Acquire(chunks->ids(), tierd::Tier::kHost, tierd::AccessMode::kRead);
    if (!r.ok()) return Fail(r.status(), "Acquire for read");
    if (absl::Status s = r->Wait(); !s.ok()) return Fail(s, "wait for read acquisition");
    for (const tierd::AcquiredChunk& chunk : r->chunks()) {
      const auto* words = static_cast<const uint64_t*>(chunk.data);
      for (size_t i = 0; i < chunk.size / 8; ++i) bad += words[i] != Word(chunk.id, i);
    }
  }
  std::printf("read back and verified: %zu bad words\n", bad);

  absl::StatusOr<std::vector<tierd::ChunkInfo>> listed = c.ListChunks();
  if (!listed.ok()) return Fail(listed.status(), "ListChunks");
  node = c.GetNodeInfo();
  if (!node.ok()) return Fail(node.status(), "GetNodeInfo");
  const uint64_t used_with_chunks = node->tier(tierd::Tier::kHost)->used_bytes;

  if (absl::Status s = chunks->Free(); !s.ok()) return Fail(s, "Free");
  node = c.GetNodeInfo();
  if (!node.ok()) return Fail(node.status(), "GetNodeInfo");
  const absl::Duration elapsed = absl::Now() - start;

  std::printf("\nsummary\n");
  std::printf("  chunks allocated, written, verified, freed  %zu (%zu listed)\n", sizes.size(),
              listed->size());
  std::printf("  bytes written and verified                  %s\n", Mib(total).c_str());
  std::printf("  host tier used with chunks / after free     %s / %s of %s\n",
              Mib(used_with_chunks).c_str(),
              Mib(node->tier(tierd::Tier::kHost)->used_bytes).c_str(),
              Mib(node->tier(tierd::Tier::kHost)->capacity_bytes).c_str());
  if (nvme_after_evict > 0) {
    std::printf("  after evict to NVMe: host / NVMe used       %s / %s\n",
                Mib(host_after_evict).c_str(), Mib(nvme_after_evict).c_str());
    std::printf("  evict / prefetch of %s                  %s / %s\n", Mib(total).c_str(),
                absl::FormatDuration(evict_time).c_str(),
                absl::FormatDuration(prefetch_time).c_str());
  }
  std::printf("  data errors                                 %zu\n", bad);
  std::printf("  time                                        %s\n",
              absl::FormatDuration(elapsed).c_str());
  return bad == 0 ? 0 : 1;
}
