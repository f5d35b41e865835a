#include "daemon/tiers/bandwidth_probe.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kFirstPiece = 64 << 10;
constexpr absl::Duration kProbeTime = absl::Milliseconds(100);
// The probe moves its bytes as this many chunks at once, as a plan's fetches would: one chunk's
// checksum overlaps another's I/O.
constexpr int kPieces = 4;

double Rate(uint64_t bytes, absl::Duration took) {
  const double s = absl::ToDoubleSeconds(took);
  return s > 0 ? static_cast<double>(bytes) / s : 0;
}

// Space in `tier`, given back when this goes.
class Scratch {
 public:
  Scratch(Tier* tier, uint32_t tenant) : tier_(tier), tenant_(tenant) {}
  ~Scratch() {
    for (const Placement& p : placements_) tier_->Unreserve(p);
  }
  absl::StatusOr<Placement> Reserve(uint64_t size) {
    absl::StatusOr<Placement> p = tier_->Reserve(tenant_, size);
    if (p.ok()) placements_.push_back(*p);
    return p;
  }

 private:
  Tier* tier_;
  uint32_t tenant_;
  std::vector<Placement> placements_;
};

absl::Status ProbeNvme(Tier* host, NvmeTier* nvme, const std::vector<Placement>& buffers,
                       uint64_t piece, uint32_t tenant, PathBandwidth* out) {
  Scratch space(nvme, tenant);
  std::vector<Placement> on_nvme;
  for (size_t i = 0; i < buffers.size(); ++i) {
    absl::StatusOr<Placement> p = space.Reserve(piece);
    if (!p.ok()) return absl::OkStatus();  // no room: the path is not probed
    on_nvme.push_back(*p);
  }
  const uint64_t total = piece * buffers.size();

  std::vector<std::promise<absl::StatusOr<uint64_t>>> wrote(buffers.size());
  absl::Time start = absl::Now();
  for (size_t i = 0; i < buffers.size(); ++i) {
    nvme->Write(0, buffers[i], on_nvme[i], piece,
                [&wrote, i](absl::StatusOr<uint64_t> sum) { wrote[i].set_value(sum); });
  }
  std::vector<uint64_t> checksums;
  for (auto& w : wrote) {
    absl::StatusOr<uint64_t> sum = w.get_future().get();
    if (!sum.ok()) return sum.status();
    checksums.push_back(*sum);
  }
  (*out)[static_cast<int>(Path::kHostToNvme)] = Rate(total, absl::Now() - start);

  for (const Placement& b : buffers) std::memset(host->Address(b), 0, piece);
  std::vector<std::promise<absl::Status>> read(buffers.size());
  start = absl::Now();
  for (size_t i = 0; i < buffers.size(); ++i) {
    nvme->Read(0, buffers[i], on_nvme[i], piece, checksums[i],
               [&read, i](absl::Status s) { read[i].set_value(s); });
  }
  for (auto& r : read) {  // each read verified its checksum
    if (absl::Status s = r.get_future().get(); !s.ok()) return s;
  }
  (*out)[static_cast<int>(Path::kNvmeToHost)] = Rate(total, absl::Now() - start);
  return absl::OkStatus();
}

absl::Status ProbeDevice(Tier* host, Tier* pool, Device* device,
                         const std::vector<Placement>& buffers, uint64_t piece, uint32_t tenant,
                         PathBandwidth* out) {
  Scratch space(pool, tenant);
  std::vector<void*> on_device;
  for (size_t i = 0; i < buffers.size(); ++i) {
    absl::StatusOr<Placement> p = space.Reserve(piece);
    if (!p.ok()) return absl::OkStatus();  // no room: the path is not probed
    on_device.push_back(pool->Address(*p));
  }
  const uint64_t total = piece * buffers.size();
  auto copy_all = [&](bool to_device) -> absl::StatusOr<double> {
    std::vector<std::promise<absl::Status>> copied(buffers.size());
    const absl::Time start = absl::Now();
    for (size_t i = 0; i < buffers.size(); ++i) {
      auto done = [&copied, i](absl::Status s) { copied[i].set_value(s); };
      if (to_device) {
        device->CopyToDevice(on_device[i], host->Address(buffers[i]), piece, done);
      } else {
        device->CopyToHost(host->Address(buffers[i]), on_device[i], piece, done);
      }
    }
    for (auto& c : copied) {
      if (absl::Status s = c.get_future().get(); !s.ok()) return s;
    }
    return Rate(total, absl::Now() - start);
  };
  absl::StatusOr<double> h2d = copy_all(true);
  if (!h2d.ok()) return h2d.status();
  absl::StatusOr<double> d2h = copy_all(false);
  if (!d2h.ok()) return d2h.status();
  (*out)[static_cast<int>(Path::kHostToDevice)] = *h2d;
  (*out)[static_cast<int>(Path::kDeviceToHost)] = *d2h;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PathBandwidth> ProbePaths(Tier* host, NvmeTier* nvme, Tier* device_pool,
                                         Device* device, uint64_t bytes) {
  PathBandwidth out{};
  const uint32_t tenant = getuid();  // the daemon's own: recycled before a client's chunks use it
  const uint64_t piece =
      std::min({bytes, host->max_reservation() * kPieces, host->Usage().largest_free_bytes}) /
      kPieces / kMiB * kMiB;
  if (piece == 0) return out;
  Scratch host_space(host, tenant);
  std::vector<Placement> buffers;
  for (int i = 0; i < kPieces; ++i) {
    absl::StatusOr<Placement> p = host_space.Reserve(piece);
    if (!p.ok()) return out;  // the free space is in pieces too small: probe nothing
    buffers.push_back(*p);
    auto* bytes_at = static_cast<uint8_t*>(host->Address(*p));
    for (uint64_t j = 0; j < piece; ++j) bytes_at[j] = static_cast<uint8_t>(j * 131 + i);
  }
  // Each path moves a little first (which also pays for setting it up), then as much as it moves
  // in about kProbeTime at that pace, up to `bytes`: a slow path costs no more start-up time.
  auto full_piece = [&](const PathBandwidth& first, Path a, Path b) {
    const double rate = std::min(first[static_cast<int>(a)], first[static_cast<int>(b)]);
    const double affordable = rate * absl::ToDoubleSeconds(kProbeTime) / kPieces;
    return std::min(piece, static_cast<uint64_t>(affordable)) / kMiB * kMiB;
  };
  auto probe = [&](Path a, Path b, auto run) -> absl::Status {
    PathBandwidth first{};
    if (absl::Status s = run(kFirstPiece, &first); !s.ok()) return s;
    const uint64_t p = full_piece(first, a, b);
    if (p == 0) {
      out[static_cast<int>(a)] = first[static_cast<int>(a)];
      out[static_cast<int>(b)] = first[static_cast<int>(b)];
      return absl::OkStatus();
    }
    return run(p, &out);
  };
  if (nvme != nullptr) {
    absl::Status s = probe(Path::kHostToNvme, Path::kNvmeToHost, [&](uint64_t p, PathBandwidth* r) {
      return ProbeNvme(host, nvme, buffers, p, tenant, r);
    });
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("probing the NVMe tier: ", s.message()));
    }
  }
  if (device != nullptr && device_pool != nullptr) {
    absl::Status s =
        probe(Path::kHostToDevice, Path::kDeviceToHost, [&](uint64_t p, PathBandwidth* r) {
          return ProbeDevice(host, device_pool, device, buffers, p, tenant, r);
        });
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("probing the device: ", s.message()));
  }
  return out;
}

}  // namespace tierd::daemon
