#include "daemon/tiers/bandwidth_probe.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <utility>
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

// Copies each buffer out to `far` (host -> far) and back (far -> host), timing each direction;
// the way back reads into zeroed buffers and, from NVMe, verifies the checksums the way out made.
absl::Status ProbeOutAndBack(const Tiers& tiers, TierKind far, Path out, Path back,
                             const std::vector<Placement>& buffers, uint64_t piece, uint32_t tenant,
                             PathBandwidth* rates) {
  Tier* host = tiers.tier[TierKind::kHost];
  Tier* there = tiers.tier[far];
  Scratch space(there, tenant);
  std::vector<HopJob> jobs;
  for (size_t i = 0; i < buffers.size(); ++i) {
    absl::StatusOr<Placement> p = space.Reserve(piece);
    if (!p.ok()) return absl::OkStatus();  // no room: the path is not probed
    jobs.push_back(HopJob{.from = buffers[i],
                          .to = *p,
                          .from_address = host->Address(buffers[i]),
                          .to_address = there->Address(*p),
                          .size = piece,
                          .durable = true});
  }
  // Runs every job over `hop` at once; the checksums the hop computed, in job order.
  auto run = [&](Path path) -> absl::StatusOr<std::vector<uint64_t>> {
    std::vector<std::promise<std::pair<absl::Status, uint64_t>>> done(jobs.size());
    const absl::Time start = absl::Now();
    for (size_t i = 0; i < jobs.size(); ++i) {
      tiers.hop[path]->Copy(jobs[i], [&done, i](absl::Status s, uint64_t sum) {
        done[i].set_value({s, sum});
      });
    }
    std::vector<uint64_t> sums;
    for (auto& d : done) {
      auto [s, sum] = d.get_future().get();
      if (!s.ok()) return s;
      sums.push_back(sum);
    }
    (*rates)[path] = Rate(piece * jobs.size(), absl::Now() - start);
    return sums;
  };
  absl::StatusOr<std::vector<uint64_t>> sums = run(out);
  if (!sums.ok()) return sums.status();
  for (size_t i = 0; i < jobs.size(); ++i) {
    std::memset(jobs[i].from_address, 0, piece);
    std::swap(jobs[i].from, jobs[i].to);
    std::swap(jobs[i].from_address, jobs[i].to_address);
    jobs[i].checksum = (*sums)[i];
  }
  return run(back).status();
}

}  // namespace

absl::StatusOr<PathBandwidth> ProbePaths(const Tiers& tiers, uint64_t bytes) {
  Tier* host = tiers.tier[TierKind::kHost];
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
    const double rate = std::min(first[a], first[b]);
    const double affordable = rate * absl::ToDoubleSeconds(kProbeTime) / kPieces;
    return std::min(piece, static_cast<uint64_t>(affordable)) / kMiB * kMiB;
  };
  auto probe = [&](Path a, Path b, auto run) -> absl::Status {
    PathBandwidth first{};
    if (absl::Status s = run(kFirstPiece, &first); !s.ok()) return s;
    const uint64_t p = full_piece(first, a, b);
    if (p == 0) {
      out[a] = first[a];
      out[b] = first[b];
      return absl::OkStatus();
    }
    return run(p, &out);
  };
  struct Far {
    TierKind tier;
    Path out, back;
    const char* what;
  };
  for (const Far& f :
       {Far{TierKind::kNvme, Path::kHostToNvme, Path::kNvmeToHost, "the NVMe tier"},
        Far{TierKind::kDevice, Path::kHostToDevice, Path::kDeviceToHost, "the device"}}) {
    if (tiers.tier[f.tier] == nullptr || tiers.hop[f.out] == nullptr ||
        tiers.hop[f.back] == nullptr) {
      continue;
    }
    absl::Status s = probe(f.out, f.back, [&](uint64_t p, PathBandwidth* r) {
      return ProbeOutAndBack(tiers, f.tier, f.out, f.back, buffers, p, tenant, r);
    });
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("probing ", f.what, ": ", s.message()));
  }
  return out;
}

}  // namespace tierd::daemon
