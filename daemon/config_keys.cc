#include "daemon/config_keys.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/sizes.h"

namespace tierd::daemon {
namespace {

// The default NVMe region lives in the state directory: moving the directory moves the region,
// unless regions were named.
void FollowStateDir(DaemonConfig& config, const std::string& before) {
  if (config.nvme.regions.size() == 1 &&
      config.nvme.regions[0].path == DefaultRegion(before).path) {
    config.nvme.regions = {DefaultRegion(config.state_dir)};
  }
}

uint64_t* QuotaOf(DaemonConfig& config, TierKind kind) { return &config.quotas.per_uid[kind]; }

constexpr ConfigKey kKeys[] = {
    // [daemon]
    {.key = "daemon.socket_dir",
     .flag = "socket_dir",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.socket_dir; },
     .min = 1,
     .metavar = "DIR",
     .help = "directory for tierd.sock and tierd.session.sock",
     .default_note = "$RUNTIME_DIRECTORY under systemd, else var/run"},
    {.key = "daemon.socket_group",
     .flag = "socket_group",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.socket_group; },
     .metavar = "GROUP",
     .help = "group allowed to connect; sockets are mode 0660",
     .default_note = "the daemon's group"},
    {.key = "daemon.base_groups",
     .flag = "base_groups",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.base_groups; },
     .metavar = "GROUP,...",
     .help = "groups a shared base may be shared with (its creator in them); empty: none",
     .default_note = "none"},
    {.key = "daemon.log_level",
     .flag = "log_level",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.log_level; },
     .check = ValidateLogLevel,
     .metavar = "LEVEL",
     .help = "trace, debug, info, warn, error, critical or off"},
    {.key = "daemon.state_dir",
     .flag = "state_dir",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.state_dir; },
     .min = 1,
     .metavar = "DIR",
     .help = "directory for the instance id and the default NVMe region",
     .default_note = "$STATE_DIRECTORY under systemd, else var/lib",
     .after = FollowStateDir},
    // [host]
    {.key = "host.capacity",
     .flag = "host_capacity",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.host.capacity; },
     .bytes = true,
     .help = "pinned host memory to own, e.g. 64GiB"},
    {.key = "host.segment_size",
     .flag = "host_segment_size",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.host.segment_size; },
     .bytes = true,
     .help = "size of each shared memfd segment, also the largest chunk"},
    {.key = "host.huge_pages",
     .flag = "huge_pages",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.host.huge_pages; },
     .metavar = "POLICY",
     .help = "2 MiB huge pages for the host tier: auto, never or require"},
    {.key = "host.lock_memory",
     .flag = "lock_memory",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.host.lock_memory; },
     .help = "mlock the host tier; false only for development without memlock rights"},
    // [nvme]
    {.key = "nvme.regions",
     .flag = "nvme_regions",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.nvme.regions; },
     .metavar = "PATH:SIZE,...",
     .help = "NVMe regions (files are created and preallocated; SIZE 0 for a whole block device), "
             "or none",
     .default_note = "STATE_DIR/nvme0.region:2GiB"},
    {.key = "nvme.stripe_unit",
     .flag = "nvme_stripe_unit",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.nvme.stripe_unit; },
     .bytes = true,
     .help = "bytes per region before striping moves to the next"},
    {.key = "nvme.io_size",
     .flag = "nvme_io_size",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.nvme.io_size; },
     .bytes = true,
     .help = "largest single I/O, at most the stripe unit"},
    {.key = "nvme.queue_depth",
     .flag = "nvme_queue_depth",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.nvme.queue_depth; },
     .min = 1,
     .max = 4096,
     .help = "I/Os in flight over all regions"},
    {.key = "nvme.sqpoll",
     .flag = "nvme_sqpoll",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.nvme.sqpoll; },
     .help = "kernel-side submission polling (saves system calls, costs a core)"},
    {.key = "nvme.index_size",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.nvme.index_size; },
     .bytes = true,
     .help = "the index of persistent chunks in region 0; 0 sizes it for the regions"},
    {.key = "nvme.io_backend",
     .flag = "nvme_io_backend",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.nvme.io_backend; },
     .metavar = "BACKEND",
     .help = "io_uring, threads (pread/pwrite) or auto: io_uring unless it is unavailable"},
    {.flag = "nvme_reformat",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.nvme.reformat; },
     .help = "format the NVMe regions even if they hold data (discards their persistent chunks)"},
    // [device]
    {.key = "device.backend",
     .flag = "device",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.device.backend; },
     .check = ValidateDeviceBackend,
     .metavar = "BACKEND",
     .help = "device tier backend: auto (a GPU when present), cuda, emulated (host memory "
             "standing in for a GPU, for tests and demos) or none"},
    {.key = "device.capacity",
     .flag = "device_capacity",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.device.capacity; },
     .bytes = true,
     .help = "device pool per GPU"},
    {.key = "device.segment_size",
     .flag = "device_segment_size",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.device.segment_size; },
     .bytes = true,
     .help = "size of each device pool allocation, also the largest device chunk"},
    {.key = "device.emulated_gbps",
     .flag = "emulated_gbps",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.device.emulated_gbps; },
     .metavar = "GBPS",
     .help = "emulated device: copy bandwidth per direction in GB/s"},
    {.key = "device.emulated_latency_us",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.device.emulated_latency_us; },
     .help = "emulated device: latency added to each copy, in microseconds"},
    {.key = "device.emulated_upload_failures_from",
     .flag = "emulated_upload_failures_from",
     .field = [](DaemonConfig& c) -> ConfigField {
       return &c.device.emulated_upload_failures_from;
     },
     .help = "emulated device: the host-to-device copy of this number (from 1) and every later "
             "one fail, as over a failing link (for tests); 0: none fail"},
    // [planner]
    {.key = "planner.probe_bytes",
     .flag = "probe_bytes",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.planner.probe_bytes; },
     .bytes = true,
     .help = "bytes moved over each path at start-up to measure its bandwidth; 0 for no probe"},
    {.key = "planner.max_session_weight",
     .flag = "max_session_weight",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.planner.max_session_weight; },
     .min = 1,
     .max = 1000,
     .help = "the largest bandwidth weight a session may ask for"},
    // [metrics]
    {.key = "metrics.listen",
     .flag = "metrics_listen",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.metrics.listen; },
     .none_word = "none",
     .metavar = "HOST:PORT",
     .help = "the Prometheus endpoint, GET /metrics (port 0: any free one); none for no "
             "endpoint"},
    // [limits]
    {.key = "limits.connections_per_uid",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.limits.connections_per_uid; },
     .min = 1,
     .max = 1'000'000,
     .help = "connections one user may hold open on the session socket"},
    {.key = "limits.sessions_per_uid",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.limits.sessions_per_uid; },
     .min = 1,
     .max = 1'000'000,
     .help = "sessions one user may have open"},
    {.key = "limits.chunks_per_session",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.limits.chunks_per_session; },
     .min = 1,
     .max = 100'000'000,
     .help = "chunks in one session's table"},
    {.key = "limits.chunks_per_uid",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.limits.chunks_per_uid; },
     .min = 1,
     .max = 100'000'000,
     .help = "all of one user's chunks, scratch and persistent"},
    {.key = "limits.schedule_accesses_per_session",
     .field = [](DaemonConfig& c) -> ConfigField {
       return &c.limits.schedule_accesses_per_session;
     },
     .min = 1,
     .max = 100'000'000,
     .help = "accesses in one session's schedule"},
    {.key = "limits.schedule_accesses_per_uid",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.limits.schedule_accesses_per_uid; },
     .min = 1,
     .max = 100'000'000,
     .help = "accesses in all of one user's schedules"},
    {.key = "limits.trace_steps",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.limits.trace_steps; },
     .min = 1,
     .max = 10'000'000,
     .help = "the longest iteration a trace may record"},
    // [quota]
    {.key = "quota.host",
     .field = [](DaemonConfig& c) -> ConfigField { return QuotaOf(c, TierKind::kHost); },
     .bytes = true,
     .help = "bytes of the host tier each user's chunks may hold; 0: no quota"},
    {.key = "quota.device",
     .field = [](DaemonConfig& c) -> ConfigField { return QuotaOf(c, TierKind::kDevice); },
     .bytes = true,
     .help = "bytes of the device tier each user's chunks may hold; 0: no quota"},
    {.key = "quota.nvme",
     .field = [](DaemonConfig& c) -> ConfigField { return QuotaOf(c, TierKind::kNvme); },
     .bytes = true,
     .help = "bytes of the NVMe tier each user's chunks may hold; 0: no quota"},
    {.key = "quota.users",
     .field = [](DaemonConfig& c) -> ConfigField { return &c.quotas; },
     .help = "one user's own quotas: [[quota.users]] user = \"alice\" host = \"64GiB\"",
     .default_note = "none"},
};

}  // namespace

absl::Span<const ConfigKey> ConfigKeys() { return kKeys; }

ConfigField FieldTypeOf(const ConfigKey& key) {
  static DaemonConfig* const scratch = new DaemonConfig();  // never written through
  return key.field(*scratch);
}

bool IsIntegerField(const ConfigField& field) {
  return std::holds_alternative<uint64_t*>(field) || std::holds_alternative<uint32_t*>(field) ||
         std::holds_alternative<int64_t*>(field);
}

std::string RangeText(const ConfigKey& key) {
  if (key.max == 0) {
    return key.min == 0 ? "must be a non-negative integer"
                        : absl::StrCat("must be an integer of at least ", key.min);
  }
  return absl::StrCat("must be an integer from ", key.min, " to ", key.max);
}

const ConfigKey* FindConfigKey(absl::string_view key) {
  for (const ConfigKey& k : kKeys) {
    if (!k.key.empty() && k.key == key) return &k;
  }
  return nullptr;
}

const ConfigKey* FindConfigFlag(absl::string_view flag) {
  for (const ConfigKey& k : kKeys) {
    if (!k.flag.empty() && k.flag == flag) return &k;
  }
  return nullptr;
}

absl::StatusOr<ConfigValue> ReadConfigText(const ConfigKey& key, absl::string_view text) {
  const ConfigField field = FieldTypeOf(key);
  if (std::holds_alternative<bool*>(field)) {
    if (text == "true" || text == "1") return ConfigValue(true);
    if (text == "false" || text == "0") return ConfigValue(false);
    return absl::InvalidArgumentError(absl::StrCat("must be true or false, not '", text, "'"));
  }
  if (std::holds_alternative<uint64_t*>(field) && key.bytes) {
    absl::StatusOr<uint64_t> size = ParseSize(text);
    if (!size.ok()) return size.status();
    return ConfigValue(*size);
  }
  if (IsIntegerField(field)) {
    uint64_t v = 0;
    if (!absl::SimpleAtoi(text, &v)) {
      return absl::InvalidArgumentError(absl::StrCat(RangeText(key), ", not '", text, "'"));
    }
    return ConfigValue(v);
  }
  if (std::holds_alternative<double*>(field)) {
    double v = 0;
    if (!absl::SimpleAtod(text, &v)) {
      return absl::InvalidArgumentError(absl::StrCat("must be a number, not '", text, "'"));
    }
    return ConfigValue(v);
  }
  if (std::holds_alternative<std::vector<RegionSpec>*>(field)) {
    absl::StatusOr<std::vector<RegionSpec>> regions = ParseRegionList(text);
    if (!regions.ok()) return regions.status();
    return ConfigValue(*std::move(regions));
  }
  if (std::holds_alternative<Quotas*>(field)) {
    return absl::InvalidArgumentError("is set in the config file only");
  }
  if (!key.none_word.empty() && text == key.none_word) return ConfigValue(std::string());
  return ConfigValue(std::string(text));
}

absl::Status StoreConfigValue(const ConfigKey& key, ConfigValue value, DaemonConfig* config) {
  const ConfigField field = key.field(*config);
  if (IsIntegerField(field)) {
    const uint64_t* v = std::get_if<uint64_t>(&value);
    const uint64_t max = std::holds_alternative<uint32_t*>(field)  ? UINT32_MAX
                         : std::holds_alternative<int64_t*>(field) ? INT64_MAX
                                                                   : UINT64_MAX;
    if (v == nullptr || *v < key.min || *v > (key.max != 0 ? key.max : max)) {
      if (key.bytes) {
        return absl::InvalidArgumentError("must be a size: bytes, or text such as \"64MiB\"");
      }
      return absl::InvalidArgumentError(RangeText(key));
    }
    if (auto* f = std::get_if<uint64_t*>(&field)) **f = *v;
    if (auto* f = std::get_if<uint32_t*>(&field)) **f = static_cast<uint32_t>(*v);
    if (auto* f = std::get_if<int64_t*>(&field)) **f = static_cast<int64_t>(*v);
    return absl::OkStatus();
  }
  if (auto* f = std::get_if<double*>(&field)) {
    const double* v = std::get_if<double>(&value);
    if (v == nullptr || !(*v > 0) || !std::isfinite(*v)) {
      return absl::InvalidArgumentError("must be a positive number");
    }
    **f = *v;
    return absl::OkStatus();
  }
  if (auto* f = std::get_if<bool*>(&field)) {
    const bool* v = std::get_if<bool>(&value);
    if (v == nullptr) return absl::InvalidArgumentError("must be true or false");
    **f = *v;
    return absl::OkStatus();
  }
  if (auto* f = std::get_if<std::vector<RegionSpec>*>(&field)) {
    auto* v = std::get_if<std::vector<RegionSpec>>(&value);
    if (v == nullptr) return absl::InvalidArgumentError("must be a list of regions");
    **f = std::move(*v);
    return absl::OkStatus();
  }
  if (std::holds_alternative<Quotas*>(field)) {
    return absl::InvalidArgumentError("is set in the config file only");
  }
  // The rest are text.
  const std::string* text = std::get_if<std::string>(&value);
  if (text == nullptr) return absl::InvalidArgumentError("must be a string");
  if (auto* f = std::get_if<HugePagePolicy*>(&field)) {
    absl::StatusOr<HugePagePolicy> policy = ParseHugePagePolicy(*text);
    if (!policy.ok()) return policy.status();
    **f = *policy;
    return absl::OkStatus();
  }
  if (auto* f = std::get_if<IoBackendKind*>(&field)) {
    absl::StatusOr<IoBackendKind> kind = ParseIoBackendKind(*text);
    if (!kind.ok()) return kind.status();
    **f = *kind;
    return absl::OkStatus();
  }
  std::string* f = std::get<std::string*>(field);
  if (key.min > 0 && text->empty()) return absl::InvalidArgumentError("must not be empty");
  if (key.check != nullptr) {
    if (absl::Status s = key.check(*text); !s.ok()) return s;
  }
  std::string before = std::move(*f);
  *f = *text;
  if (key.after != nullptr) key.after(*config, before);
  return absl::OkStatus();
}

std::string SizeText(uint64_t bytes) {
  if (bytes == 0) return "0";
  for (auto [unit, name] : {std::pair{kTiB, "TiB"}, std::pair{kGiB, "GiB"}, std::pair{kMiB, "MiB"},
                            std::pair{kKiB, "KiB"}}) {
    if (bytes % unit == 0) return absl::StrCat(bytes / unit, name);
  }
  return absl::StrCat(bytes);
}

std::string ShowConfigValue(const ConfigKey& key, const DaemonConfig& config) {
  // The accessor takes a mutable config to hand out pointers; nothing is written through them.
  const ConfigField field = key.field(const_cast<DaemonConfig&>(config));
  struct Show {
    const ConfigKey& key;
    std::string operator()(const std::string* v) const {
      return v->empty() && !key.none_word.empty() ? std::string(key.none_word) : *v;
    }
    std::string operator()(const uint64_t* v) const {
      return key.bytes ? SizeText(*v) : absl::StrCat(*v);
    }
    std::string operator()(const uint32_t* v) const { return absl::StrCat(*v); }
    std::string operator()(const int64_t* v) const { return absl::StrCat(*v); }
    std::string operator()(const double* v) const { return absl::StrCat(*v); }
    std::string operator()(const bool* v) const { return *v ? "true" : "false"; }
    std::string operator()(const HugePagePolicy* v) const {
      return std::string(HugePagePolicyName(*v));
    }
    std::string operator()(const IoBackendKind* v) const { return IoBackendName(*v); }
    std::string operator()(const std::vector<RegionSpec>* v) const {
      if (v->empty()) return "none";
      return absl::StrJoin(*v, ",", [](std::string* out, const RegionSpec& r) {
        absl::StrAppend(out, r.path, ":", SizeText(r.size));
      });
    }
    std::string operator()(const Quotas*) const { return ""; }
  };
  return std::visit(Show{key}, field);
}

}  // namespace tierd::daemon
