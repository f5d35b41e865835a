#include "daemon/config.h"

#include <pwd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <tuple>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/sizes.h"
#include "daemon/config_keys.h"
#include "toml++/toml.h"

namespace tierd::daemon {

RegionSpec DefaultRegion(const std::string& state_dir) {
  return RegionSpec{state_dir + "/nvme0.region", 2ull << 30};
}

DaemonConfig DefaultConfig() {
  DaemonConfig config;
  const char* runtime_dir = std::getenv("RUNTIME_DIRECTORY");  // set by systemd's RuntimeDirectory=
  config.socket_dir = runtime_dir != nullptr && *runtime_dir != '\0' ? runtime_dir : "var/run";
  const char* state_dir = std::getenv("STATE_DIRECTORY");  // set by systemd's StateDirectory=
  config.state_dir = state_dir != nullptr && *state_dir != '\0' ? state_dir : "var/lib";
  config.nvme.regions = {DefaultRegion(config.state_dir)};
  return config;
}

absl::StatusOr<std::vector<RegionSpec>> ParseRegionList(absl::string_view text) {
  std::vector<RegionSpec> regions;
  if (text == "none") return regions;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const size_t colon = item.rfind(':');
    if (colon == absl::string_view::npos || colon == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("NVMe region '", item,
                       "' is not PATH:SIZE (e.g. /mnt/nvme0/tierd.region:800GiB, or "
                       "/dev/nvme1n1:0 for a whole device)"));
    }
    absl::StatusOr<uint64_t> size = ParseSize(item.substr(colon + 1));
    if (!size.ok()) return size.status();
    regions.push_back({std::string(item.substr(0, colon)), *size});
  }
  if (regions.empty()) return absl::InvalidArgumentError("empty NVMe region list");
  return regions;
}

absl::StatusOr<HugePagePolicy> ParseHugePagePolicy(absl::string_view text) {
  if (text == "auto") return HugePagePolicy::kAuto;
  if (text == "never") return HugePagePolicy::kNever;
  if (text == "require") return HugePagePolicy::kRequire;
  return absl::InvalidArgumentError(
      absl::StrCat("huge_pages must be 'auto', 'never' or 'require', not '", text, "'"));
}

absl::string_view HugePagePolicyName(HugePagePolicy policy) {
  switch (policy) {
    case HugePagePolicy::kAuto:
      return "auto";
    case HugePagePolicy::kNever:
      return "never";
    case HugePagePolicy::kRequire:
      return "require";
  }
  return "?";
}

absl::Status ValidateDeviceBackend(absl::string_view backend) {
  if (backend == "auto" || backend == "cuda" || backend == "emulated" || backend == "none") {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device backend must be auto, cuda, emulated or none, not '", backend, "'"));
}

absl::Status ValidateLogLevel(absl::string_view level) {
  static constexpr absl::string_view kLevels[] = {"trace", "debug",    "info", "warn",
                                                  "error", "critical", "off"};
  for (absl::string_view l : kLevels) {
    if (level == l) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "log_level must be one of ", absl::StrJoin(kLevels, ", "), ", not '", level, "'"));
}

namespace {

std::string Where(absl::string_view source, const toml::node& node) {
  const toml::source_region& region = node.source();
  return absl::StrCat(source, ":", region.begin.line);
}

absl::Status KeyError(absl::string_view source, const toml::node& node, absl::string_view key,
                      absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(Where(source, node), ": ", key, ": ", what));
}

absl::StatusOr<std::string> GetString(absl::string_view source, const toml::node& node,
                                      absl::string_view key) {
  if (const auto* s = node.as_string()) return std::string(s->get());
  return KeyError(source, node, key, "must be a string");
}

// Sizes may be written as integers (bytes) or strings with a unit ("64MiB").
absl::StatusOr<uint64_t> GetSize(absl::string_view source, const toml::node& node,
                                 absl::string_view key) {
  if (const auto* i = node.as_integer()) {
    if (i->get() < 0) return KeyError(source, node, key, "must not be negative");
    return static_cast<uint64_t>(i->get());
  }
  if (const auto* s = node.as_string()) {
    absl::StatusOr<uint64_t> size = ParseSize(s->get());
    if (!size.ok()) return KeyError(source, node, key, size.status().message());
    return size;
  }
  return KeyError(source, node, key, "must be a size: bytes, or a string such as \"64MiB\"");
}

// quota.host / quota.device / quota.nvme, or the same keys of a user's quota: bytes, 0 for none.
absl::StatusOr<std::pair<TierKind, uint64_t>> GetTierBytes(absl::string_view source,
                                                           const toml::node& node,
                                                           const std::string& key) {
  const absl::string_view tier = absl::string_view(key).substr(key.rfind('.') + 1);
  TierKind kind;
  if (tier == "host") {
    kind = TierKind::kHost;
  } else if (tier == "device") {
    kind = TierKind::kDevice;
  } else if (tier == "nvme") {
    kind = TierKind::kNvme;
  } else {
    return KeyError(source, node, key, "unknown key (a quota names host, device or nvme bytes)");
  }
  absl::StatusOr<uint64_t> bytes = GetSize(source, node, key);
  if (!bytes.ok()) return bytes.status();
  return std::make_pair(kind, *bytes);
}

absl::Status ApplyUserQuotas(absl::string_view source, const toml::node& node,
                             const std::string& key, Quotas* quotas) {
  const toml::array* list = node.as_array();
  if (list == nullptr) {
    return KeyError(
        source, node, key,
        "must be an array of tables: [[quota.users]] user = \"alice\" host = \"64GiB\"");
  }
  for (const toml::node& item : *list) {
    const toml::table* t = item.as_table();
    if (t == nullptr || t->contains("uid") == t->contains("user")) {
      return KeyError(source, item, key, "each entry names either a uid or a user");
    }
    uint32_t uid = 0;
    std::string name;
    if (const toml::node* u = t->get("uid")) {
      const auto* i = u->as_integer();
      if (i == nullptr || i->get() < 0 || i->get() > UINT32_MAX - 1) {
        return KeyError(source, *u, key + ".uid", "must be a uid (a non-negative integer)");
      }
      uid = static_cast<uint32_t>(i->get());
    } else {
      absl::StatusOr<std::string> user = GetString(source, *t->get("user"), key + ".user");
      if (!user.ok()) return user.status();
      struct passwd* pw = getpwnam(user->c_str());
      if (pw == nullptr) {
        return KeyError(source, *t->get("user"), key + ".user",
                        absl::StrCat("no user named '", *user, "' on this node"));
      }
      uid = pw->pw_uid;
      name = *user;
    }
    if (quotas->by_uid.contains(uid)) {
      return KeyError(source, item, key, absl::StrCat("uid ", uid, " has two quota entries"));
    }
    TierBytes bytes = quotas->per_uid;  // what the entry does not name stays the default
    for (auto&& [k, v] : *t) {
      if (k.str() == "uid" || k.str() == "user") continue;
      absl::StatusOr<std::pair<TierKind, uint64_t>> q =
          GetTierBytes(source, v, absl::StrCat(key, ".", std::string(k.str())));
      if (!q.ok()) return q.status();
      bytes[q->first] = q->second;
    }
    quotas->by_uid[uid] = bytes;
    if (!name.empty()) quotas->names[uid] = name;
  }
  return absl::OkStatus();
}

// Reads `node` as the value of `key`, by the type of the field the key sets.
absl::StatusOr<ConfigValue> ReadToml(absl::string_view source, const toml::node& node,
                                     const ConfigKey& key) {
  const ConfigField field = FieldTypeOf(key);
  const std::string name(key.key);
  if (std::holds_alternative<bool*>(field)) {
    if (const auto* b = node.as_boolean()) return ConfigValue(b->get());
    return KeyError(source, node, name, "must be true or false");
  }
  if (std::holds_alternative<double*>(field)) {
    if (std::optional<double> v = node.value<double>()) return ConfigValue(*v);
    return KeyError(source, node, name, "must be a positive number");
  }
  if (std::holds_alternative<uint64_t*>(field) && key.bytes) {
    absl::StatusOr<uint64_t> v = GetSize(source, node, name);
    if (!v.ok()) return v.status();
    return ConfigValue(*v);
  }
  if (IsIntegerField(field)) {
    const auto* i = node.as_integer();
    if (i == nullptr || i->get() < 0) return KeyError(source, node, name, RangeText(key));
    return ConfigValue(static_cast<uint64_t>(i->get()));
  }
  if (std::holds_alternative<std::vector<RegionSpec>*>(field)) {
    const toml::array* list = node.as_array();
    if (list == nullptr) {
      return KeyError(source, node, name,
                      "must be an array of tables: [{ path = \"...\", size = \"800GiB\" }]");
    }
    std::vector<RegionSpec> regions;
    for (const toml::node& item : *list) {
      const toml::table* t = item.as_table();
      if (t == nullptr || !t->contains("path")) {
        return KeyError(source, item, name, "each region needs a path (and a size)");
      }
      for (auto&& [k, v] : *t) {
        if (k.str() != "path" && k.str() != "size") {
          return KeyError(source, v, name,
                          absl::StrCat("unknown region key '", std::string(k.str()), "'"));
        }
      }
      absl::StatusOr<std::string> path = GetString(source, *t->get("path"), name + ".path");
      if (!path.ok()) return path.status();
      uint64_t size = 0;
      if (const toml::node* sz = t->get("size")) {
        absl::StatusOr<uint64_t> v = GetSize(source, *sz, name + ".size");
        if (!v.ok()) return v.status();
        size = *v;
      }
      regions.push_back({*path, size});
    }
    return ConfigValue(std::move(regions));
  }
  absl::StatusOr<std::string> text = GetString(source, node, name);
  if (!text.ok()) return text.status();
  return ConfigValue(*std::move(text));
}

}  // namespace

absl::Status ApplyToml(absl::string_view toml_text, absl::string_view source,
                       DaemonConfig* config) {
  toml::table root;
  try {
    root = toml::parse(std::string_view(toml_text.data(), toml_text.size()),
                       std::string_view(source.data(), source.size()));
  } catch (const toml::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ":", e.source().begin.line, ":",
                                                   e.source().begin.column, ": ",
                                                   std::string(e.description())));
  }
  // The sections are those of the keys, in the table's order.
  std::vector<absl::string_view> sections;
  for (const ConfigKey& k : ConfigKeys()) {
    if (k.key.empty()) continue;
    const absl::string_view section = k.key.substr(0, k.key.find('.'));
    if (std::find(sections.begin(), sections.end(), section) == sections.end()) {
      sections.push_back(section);
    }
  }
  for (auto&& [section_key, section_node] : root) {
    const std::string section(section_key.str());
    const toml::table* table = section_node.as_table();
    if (table == nullptr ||
        std::find(sections.begin(), sections.end(), section) == sections.end()) {
      return KeyError(source, section_node, section,
                      absl::StrCat("unknown section (known: ",
                                   absl::StrJoin(sections, ", ",
                                                 [](std::string* out, absl::string_view s) {
                                                   absl::StrAppend(out, "[", s, "]");
                                                 }),
                                   ")"));
    }
    for (auto&& [key_name, node] : *table) {
      const std::string name = absl::StrCat(section, ".", std::string(key_name.str()));
      const ConfigKey* key = FindConfigKey(name);
      if (key == nullptr) {
        return KeyError(source, node, name, "unknown key (see docs/configuration.md)");
      }
      if (std::holds_alternative<Quotas*>(key->field(*config))) {
        if (absl::Status s = ApplyUserQuotas(source, node, name, &config->quotas); !s.ok()) {
          return s;
        }
        continue;
      }
      absl::StatusOr<ConfigValue> value = ReadToml(source, node, *key);
      if (!value.ok()) return value.status();
      if (absl::Status s = StoreConfigValue(*key, *std::move(value), config); !s.ok()) {
        return KeyError(source, node, name, s.message());
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateConfig(const DaemonConfig& config) {
  constexpr uint64_t kTwoMiB = 2 * kMiB;
  for (auto [section, capacity, segment] :
       {std::tuple{"host", config.host.capacity, config.host.segment_size},
        std::tuple{"device", config.device.capacity, config.device.segment_size}}) {
    if (segment == 0 || segment % kTwoMiB != 0) {
      return absl::InvalidArgumentError(absl::StrCat(section, ".segment_size (",
                                                     FormatSize(segment),
                                                     ") must be a non-zero multiple of 2 MiB"));
    }
    if (capacity == 0 || capacity % segment != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(section, ".capacity (", FormatSize(capacity), ") must be a non-zero ",
                       "multiple of ", section, ".segment_size (", FormatSize(segment), ")"));
    }
  }
  const NvmeOptions& nvme = config.nvme;
  if (!nvme.regions.empty()) {
    const uint64_t unit = nvme.stripe_unit;
    if (unit < 4096 || (unit & (unit - 1)) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "nvme.stripe_unit (", unit, " bytes) must be a power of two of at least 4 KiB"));
    }
    if (nvme.io_size < 4096 || nvme.io_size > unit || nvme.io_size % 4096 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "nvme.io_size (", FormatSize(nvme.io_size),
          ") must be a multiple of 4 KiB and at most nvme.stripe_unit (", FormatSize(unit), ")"));
    }
    for (size_t i = 0; i < nvme.regions.size(); ++i) {
      if (nvme.regions[i].path.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("nvme.regions[", i, "] has no path"));
      }
      for (size_t j = 0; j < i; ++j) {
        if (nvme.regions[j].path == nvme.regions[i].path) {
          return absl::InvalidArgumentError(
              absl::StrCat("nvme.regions lists '", nvme.regions[i].path,
                           "' twice; each region must be a file or device of its own"));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ApplyTomlFile(const std::string& path, DaemonConfig* config) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read config file '", path, "'"));
  }
  std::stringstream text;
  text << in.rdbuf();
  return ApplyToml(text.str(), path, config);
}

}  // namespace tierd::daemon
