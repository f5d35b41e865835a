// The daemon built from any configuration that parses: its tiers started for real (the host tier's
// memfd segments, NVMe regions formatted and recovered through the I/O engine, the emulated
// device, the bandwidth probe, the planner) and stopped again, or refused with an error; never a
// crash. The parser alone is config_fuzz's.
//
// Every file the configuration names is moved into a scratch directory, keeping its path below
// it, so that a region whose directory is missing stays missing; a region named directly in
// /proc/self stays there (a directory in which no file can be created). Sizes are scaled down
// to at most kMaxBytes per tier, so that one input takes milliseconds. Each input starts with an
// empty scratch directory: no state carries over from one input to the next.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/config.h"
#include "daemon/daemon.h"
#include "daemon/util/daemon_files.h"
#include "fuzz/scratch_dir.h"
#include "spdlog/spdlog.h"

namespace {

constexpr uint64_t kMaxBytes = 64ull << 20;

// A path the configuration named, inside `root`: its components below it, without ".." (so it
// cannot climb out), or a /proc/self entry that does not exist.
std::string Confined(const std::string& root, const std::string& path) {
  if (absl::StartsWith(path, "/proc/self/") &&
      path.find('/', sizeof("/proc/self/") - 1) == std::string::npos && path.size() > 11) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec) && !ec) return path;
  }
  std::filesystem::path out(root);
  for (const std::filesystem::path& part : std::filesystem::path(path).relative_path()) {
    if (part == ".." || part == ".") continue;
    out /= part;
  }
  return out.string();
}

// A pool of at most kMaxBytes whose segment size still divides it (and stays a 2 MiB multiple).
void Shrink(uint64_t& capacity, uint64_t& segment) {
  if (capacity <= kMaxBytes) return;
  capacity = kMaxBytes;
  if (segment == 0 || segment > capacity || capacity % segment != 0) segment = capacity / 4;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string scratch = [] {
    spdlog::set_level(spdlog::level::off);
    return tierd::FuzzScratchDir("/tmp", "config-tiers");
  }();
  const std::string root = scratch + "/case";
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  std::filesystem::create_directories(root, ec);

  tierd::daemon::DaemonConfig config = tierd::daemon::DefaultConfig();
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (!tierd::daemon::ApplyToml(text, "fuzz.toml", &config).ok()) return 0;

  config.socket_dir = Confined(root, config.socket_dir);
  config.state_dir = Confined(root, config.state_dir);
  for (tierd::daemon::RegionSpec& r : config.nvme.regions) {
    r.path = Confined(root, r.path);
    r.size = std::min(r.size, kMaxBytes);
  }
  config.nvme.index_size = std::min<uint64_t>(config.nvme.index_size, 4ull << 20);
  Shrink(config.host.capacity, config.host.segment_size);
  Shrink(config.device.capacity, config.device.segment_size);
  // The emulated device copies at emulated_gbps: a slow one would make the probe take minutes.
  config.device.emulated_gbps = std::clamp(config.device.emulated_gbps, 1.0, 1000.0);
  config.device.emulated_latency_us = std::min<int64_t>(config.device.emulated_latency_us, 1000);
  config.planner.probe_bytes = std::min<uint64_t>(config.planner.probe_bytes, 1ull << 20);
  config.metrics.listen.clear();  // a port per input would collide with other processes
  if (!tierd::daemon::ValidateConfig(config).ok()) return 0;
  // The daemon's own directories, as main() prepares them before it builds the daemon.
  for (const std::string& dir : {config.socket_dir, config.state_dir}) {
    if (!tierd::daemon::PrepareDirectory(dir, 0750, "fuzz").ok()) return 0;
  }

  absl::StatusOr<std::unique_ptr<tierd::daemon::Daemon>> daemon =
      tierd::daemon::Daemon::Create(config);
  if (daemon.ok()) (*daemon)->Stop();
  return 0;
}
