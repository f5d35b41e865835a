// The configuration parser: any document is a configuration or a clear error naming where, never
// a crash; what parses passes or fails the cross-key checks without a crash too.
#include <cstddef>
#include <cstdint>
#include <string>

#include "daemon/config.h"
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
  if (!s.ok()) {
    // Errors name the document.
    if (s.message().find("fuzz.toml") == absl::string_view::npos) __builtin_trap();
    return 0;
  }
  (void)tierd::daemon::ValidateConfig(config);
  return 0;
}
