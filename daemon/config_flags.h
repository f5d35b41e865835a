// The daemon's command line and the configuration built from it: `--config FILE` and a flag per
// key of config_keys.h, applied over the built-in defaults and the file; `tierd --help` and
// `tierd --check`'s texts. Above config_keys.h, which is above config.h: the configuration's
// struct knows nothing of its keys or its flags.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "daemon/config.h"
#include "daemon/config_keys.h"

namespace tierd::daemon {

// The command line: `--config FILE` and a flag per key, in the forms Abseil's flags take
// (`--name=value`, `--name value`, `-name=value`; for true/false keys also `--name` and
// `--noname`), `--help` and `--version`.
struct CommandLine {
  std::string config_file;
  std::vector<std::pair<const ConfigKey*, std::string>> flags;  // in the order given
  bool help = false;
  bool version = false;
  bool check = false;  // --check: build and check the configuration, then exit
};
// `args` is argv, the program's name first. An unknown flag, a flag without its value or an
// argument that is not a flag is an error naming it.
absl::StatusOr<CommandLine> ParseCommandLine(absl::Span<const char* const> args);

// The built-in defaults, then the file, then the flags in their order, then ValidateConfig. Errors
// name the file and line, or the flag.
absl::StatusOr<DaemonConfig> BuildConfig(const CommandLine& line);

// What `tierd --help` prints: each flag with its value, help, key and default.
std::string UsageText();
// What `tierd --check` prints: each key of the file with its value in `config`, one a line.
std::string ConfigText(const DaemonConfig& config);

}  // namespace tierd::daemon
