// The daemon's configuration: built-in defaults, then a TOML file, then command-line flags. The
// keys are one table (config_keys.h), documented in docs/configuration.md and deploy/tierd.toml.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

#include "absl/status/statusor.h"
#include "daemon/chunks/limits.h"
#include "daemon/tiers/host/host_memory.h"
#include "daemon/tiers/nvme/nvme_tier.h"

namespace tierd::daemon {

struct DaemonConfig {
  // [daemon]
  std::string socket_dir;    // holds tierd.sock (gRPC) and tierd.session.sock
  std::string socket_group;  // group that may connect (sockets are 0660); empty: the daemon's
  // Groups (names or gids, comma-separated) whose members a shared base may be shared with by a
  // creator in them; empty: bases are opened by their creator's uid and operators only.
  std::string base_groups;
  std::string log_level = "info";
  std::string state_dir;  // instance id and the default NVMe region
  // [host]
  HostPoolOptions host{.capacity = 1ull << 30, .segment_size = 256ull << 20};
  // [nvme]; `regions` empty means no NVMe tier.
  NvmeOptions nvme;
  // [device]
  struct Device {
    std::string backend = "auto";  // auto (a GPU when present), cuda, emulated, none
    uint64_t capacity = 8ull << 30;
    uint64_t segment_size = 256ull << 20;
    double emulated_gbps = 24.0;
    int64_t emulated_latency_us = 10;
    int64_t emulated_upload_failures_from = 0;
  } device;
  // [planner]
  struct Planner {
    // Bytes each path moves at start-up to measure its bandwidth before the first real move (0:
    // no probe; first guesses until moves are measured).
    uint64_t probe_bytes = 64ull << 20;
    uint32_t max_session_weight = 16;  // the largest bandwidth weight a session may ask for
  } planner;
  // [metrics]
  struct Metrics {
    // HOST:PORT of the Prometheus endpoint (GET /metrics); empty: none. Loopback by default.
    std::string listen = "127.0.0.1:9477";
  } metrics;
  // [limits] and [quota]: what one user or session may hold.
  Limits limits;
  Quotas quotas;
};

// The default NVMe region: a 2 GiB file in the state directory, for a working tier out of the box.
// Production nodes name their drives in nvme.regions.
RegionSpec DefaultRegion(const std::string& state_dir);

// Parses "PATH:SIZE[,PATH:SIZE...]" (the --nvme_regions flag); "none" for no NVMe tier.
absl::StatusOr<std::vector<RegionSpec>> ParseRegionList(absl::string_view text);

// The defaults: sockets in $RUNTIME_DIRECTORY and state in $STATE_DIRECTORY when systemd provides
// them, else ./var/run and ./var/lib; one NVMe region in the state directory.
DaemonConfig DefaultConfig();

// Applies the keys of a TOML document on top of `config`. Unknown keys, wrong types and bad values
// are errors that name the key and its line in `source`.
absl::Status ApplyToml(absl::string_view toml_text, absl::string_view source, DaemonConfig* config);
absl::Status ApplyTomlFile(const std::string& path, DaemonConfig* config);

// Checks what no single key can: sizes that must divide each other, regions named twice. The
// daemon runs this before it touches anything; an error is a configuration error (exit 2).
absl::Status ValidateConfig(const DaemonConfig& config);

absl::StatusOr<HugePagePolicy> ParseHugePagePolicy(absl::string_view text);
absl::string_view HugePagePolicyName(HugePagePolicy policy);
absl::Status ValidateLogLevel(absl::string_view level);
absl::Status ValidateDeviceBackend(absl::string_view backend);

}  // namespace tierd::daemon
