// The configuration's keys in one table: each key's TOML name, its flag, the field it sets, the
// values it takes and its help. The TOML file (config.cc), the command line and `tierd --help`
// (config_flags.cc) and the test of docs/configuration.md all read this table, so a key is added,
// checked and documented in one place.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "daemon/config.h"

namespace tierd::daemon {

// The field a key sets. The pointer's type says how a value is read: text, an integer (a size
// when the key says `bytes`), a number, true or false, a named policy, a list of regions, or the
// per-user quota tables (the file only).
using ConfigField =
    std::variant<std::string*, uint64_t*, uint32_t*, int64_t*, double*, bool*, HugePagePolicy*,
                 IoBackendKind*, std::vector<RegionSpec>*, Quotas*>;

struct ConfigKey {
  absl::string_view key;   // in the file, "section.name"; empty: a flag only
  absl::string_view flag;  // on the command line, without "--"; empty: the file only
  ConfigField (*field)(DaemonConfig& config);
  // uint64_t fields: bytes, written as an integer or with a unit ("64MiB").
  bool bytes = false;
  // Integer fields: the smallest and largest value (max 0: no bound). Text: min 1 means not empty.
  uint64_t min = 0;
  uint64_t max = 0;
  // Text fields with a fixed set of values: the check, whose message lists them.
  absl::Status (*check)(absl::string_view value) = nullptr;
  // Flags: this word stands for the empty text ("--metrics_listen=none": no endpoint).
  absl::string_view none_word;
  // What the value looks like in --help ("SIZE", "HOST:PORT"); empty: from the field's type.
  absl::string_view metavar;
  absl::string_view help;
  // The default where it depends on the node, as --help and the docs describe it; empty: the
  // built-in value (DefaultConfig) shown as it is.
  absl::string_view default_note;
  // Runs after the field is set, with the value it had before (the default NVMe region follows
  // the state directory).
  void (*after)(DaemonConfig& config, const std::string& before) = nullptr;
};

absl::Span<const ConfigKey> ConfigKeys();

// The type of the field `key` sets, as a pointer into a config nobody reads: only which
// alternative it holds means anything.
ConfigField FieldTypeOf(const ConfigKey& key);
bool IsIntegerField(const ConfigField& field);

// What an integer key takes, as an error says it: "must be an integer from 1 to 4096".
std::string RangeText(const ConfigKey& key);

// The key named `key` in the file, or the flag named `flag`; null when there is none.
const ConfigKey* FindConfigKey(absl::string_view key);
const ConfigKey* FindConfigFlag(absl::string_view flag);

// A value as the file or a flag spells it, before it is checked against its key.
using ConfigValue = std::variant<std::string, uint64_t, double, bool, std::vector<RegionSpec>>;

// Reads a flag's text as `key`'s value ("64MiB", "true", "PATH:SIZE,..."). The message says what
// the value should be, without naming the flag.
absl::StatusOr<ConfigValue> ReadConfigText(const ConfigKey& key, absl::string_view text);

// Checks `value` against `key` (type, range, set of values) and stores it in `config`. A value
// that fails changes nothing; the message names neither the key nor where the value came from.
absl::Status StoreConfigValue(const ConfigKey& key, ConfigValue value, DaemonConfig* config);

// The key's value in `config` as a flag would spell it ("1GiB", "true", "/a:2GiB,/b:0"); empty
// for the per-user quota tables.
std::string ShowConfigValue(const ConfigKey& key, const DaemonConfig& config);

// Bytes as the largest binary unit that divides them exactly: "1GiB", "1536KiB", "4097".
std::string SizeText(uint64_t bytes);

}  // namespace tierd::daemon
