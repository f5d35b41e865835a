// The configuration parsers: any document, and any command line, is a configuration or a clear
// error naming where, never a crash; what parses passes or fails the cross-key checks without a
// crash too.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"

#include "daemon/config.h"
#include "daemon/config_flags.h"
#include "spdlog/spdlog.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = [] {
    spdlog::set_level(spdlog::level::off);
    return true;
  }();
  (void)quiet;
  const std::string text(reinterpret_cast<const char*>(data), size);
  tierd::daemon::DaemonConfig config = tierd::daemon::DefaultConfig();
  absl::Status s = tierd::daemon::ApplyToml(text, "fuzz.toml", &config);
  if (s.ok()) {
    (void)tierd::daemon::ValidateConfig(config);
  } else if (s.message().find("fuzz.toml") == absl::string_view::npos) {
    __builtin_trap();  // errors name the document
  }

  // The same bytes as a command line, one argument per line (no config file: it would be read).
  std::vector<std::string> words = absl::StrSplit(text, '\n');
  std::vector<const char*> args = {"tierd"};
  for (const std::string& w : words) args.push_back(w.c_str());
  absl::StatusOr<tierd::daemon::CommandLine> line = tierd::daemon::ParseCommandLine(args);
  if (!line.ok()) return 0;
  line->config_file.clear();
  (void)tierd::daemon::BuildConfig(*line);
  return 0;
}
