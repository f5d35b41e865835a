// The command line and --help, both read from the key table (config_keys.h): a key with a flag is
// set from the command line exactly as from the file, with the same checks and messages.
#include "daemon/config_flags.h"

#include <optional>
#include <variant>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/config.h"
#include "daemon/config_keys.h"

namespace tierd::daemon {
namespace {

bool IsBool(const ConfigKey& key) { return std::holds_alternative<bool*>(FieldTypeOf(key)); }

std::string Metavar(const ConfigKey& key) {
  if (!key.metavar.empty()) return std::string(key.metavar);
  const ConfigField field = FieldTypeOf(key);
  if (key.bytes) return "SIZE";
  if (std::holds_alternative<double*>(field)) return "NUMBER";
  if (std::holds_alternative<std::string*>(field)) return "TEXT";
  return "N";
}

// Appends `text` wrapped at 100 columns, each line indented by `indent` spaces.
void AppendWrapped(std::string* out, absl::string_view text, size_t indent) {
  constexpr size_t kWidth = 100;
  size_t column = 0;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (column > indent && column + 1 + word.size() > kWidth) {
      out->push_back('\n');
      column = 0;
    }
    if (column == 0) {
      out->append(indent, ' ');
      column = indent;
    } else {
      out->push_back(' ');
      ++column;
    }
    absl::StrAppend(out, word);
    column += word.size();
  }
  out->push_back('\n');
}

}  // namespace

absl::StatusOr<CommandLine> ParseCommandLine(absl::Span<const char* const> args) {
  CommandLine line;
  for (size_t i = 1; i < args.size(); ++i) {
    absl::string_view arg = args[i];
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg, "' (see tierd --help)"));
    }
    absl::string_view name = arg;
    std::optional<absl::string_view> value;
    if (size_t eq = arg.find('='); eq != absl::string_view::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    }
    if (!value && (name == "help" || name == "helpfull" || name == "h")) {
      line.help = true;
      continue;
    }
    if (!value && name == "version") {
      line.version = true;
      continue;
    }
    if (!value && name == "check") {
      line.check = true;
      continue;
    }
    const ConfigKey* key = name == "config" ? nullptr : FindConfigFlag(name);
    if (name != "config" && key == nullptr) {
      // --noX for a true/false flag X.
      absl::string_view positive = name;
      if (!value && absl::ConsumePrefix(&positive, "no")) {
        if (const ConfigKey* k = FindConfigFlag(positive); k != nullptr && IsBool(*k)) {
          line.flags.emplace_back(k, "false");
          continue;
        }
      }
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, " (see tierd --help)"));
    }
    if (!value && key != nullptr && IsBool(*key)) value = "true";
    if (!value) {
      if (i + 1 == args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
      value = args[++i];
    }
    if (key == nullptr) {
      line.config_file = std::string(*value);
    } else {
      line.flags.emplace_back(key, std::string(*value));
    }
  }
  return line;
}

absl::StatusOr<DaemonConfig> BuildConfig(const CommandLine& line) {
  DaemonConfig config = DefaultConfig();
  if (!line.config_file.empty()) {
    if (absl::Status s = ApplyTomlFile(line.config_file, &config); !s.ok()) return s;
  }
  for (const auto& [key, text] : line.flags) {
    absl::StatusOr<ConfigValue> value = ReadConfigText(*key, text);
    absl::Status s =
        value.ok() ? StoreConfigValue(*key, *std::move(value), &config) : value.status();
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--", key->flag, ": ", s.message()));
    }
  }
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  return config;
}

std::string UsageText() {
  std::string out;
  AppendWrapped(&out,
                "tierd, the per-node daemon that owns pinned host memory, NVMe regions and a GPU "
                "memory pool, and moves tensor chunks between them for the training processes "
                "that share it.",
                0);
  absl::StrAppend(&out, "\nUsage: tierd [--config FILE] [flags]\n\n");
  AppendWrapped(&out,
                "Flags override the config file (docs/configuration.md lists every key); each "
                "names its key in [brackets]. Sizes are bytes or take a unit: 64MiB, 2GiB.",
                0);
  out.push_back('\n');
  absl::StrAppend(&out, "  --config=FILE\n");
  AppendWrapped(&out, "TOML config file; flags override it", 6);
  const DaemonConfig defaults = DefaultConfig();
  for (const ConfigKey& key : ConfigKeys()) {
    if (key.flag.empty()) continue;
    absl::StrAppend(&out, "  --", key.flag, IsBool(key) ? "" : "=", IsBool(key) ? "" : Metavar(key),
                    "\n");
    const std::string default_text =
        key.default_note.empty() ? ShowConfigValue(key, defaults) : std::string(key.default_note);
    AppendWrapped(&out,
                  absl::StrCat(key.help, " [", key.key, key.key.empty() ? "" : "; ", "default ",
                               default_text, "]"),
                  6);
  }
  absl::StrAppend(&out, "  --help\n");
  AppendWrapped(&out, "this text", 6);
  absl::StrAppend(&out, "  --version\n");
  AppendWrapped(&out, "the version", 6);
  absl::StrAppend(&out, "  --check\n");
  AppendWrapped(&out,
                "read and check the configuration (file and flags), print it and exit: 0 when the "
                "daemon would start with it, 2 when it would refuse it; nothing is created",
                6);
  return out;
}

std::string ConfigText(const DaemonConfig& config) {
  std::string out;
  for (const ConfigKey& key : ConfigKeys()) {
    // The per-user quota tables have no one-line spelling (the file's [[quota.users]]).
    if (key.key.empty() || std::holds_alternative<Quotas*>(FieldTypeOf(key))) continue;
    absl::StrAppend(&out, key.key, " = ", ShowConfigValue(key, config), "\n");
  }
  return out;
}

}  // namespace tierd::daemon
