#include "common/sizes.h"

#include <cmath>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tierd {

absl::StatusOr<uint64_t> ParseSize(absl::string_view text) {
  absl::string_view s = absl::StripAsciiWhitespace(text);
  size_t split = 0;
  while (split < s.size() && (absl::ascii_isdigit(s[split]) || s[split] == '.')) ++split;
  absl::string_view number = s.substr(0, split);
  std::string suffix = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(s.substr(split)));
  if (number.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("size '", text, "' does not start with a number"));
  }
  uint64_t unit = 0;
  if (suffix.empty() || suffix == "B") {
    unit = 1;
  } else if (suffix == "K" || suffix == "KB" || suffix == "KIB") {
    unit = kKiB;
  } else if (suffix == "M" || suffix == "MB" || suffix == "MIB") {
    unit = kMiB;
  } else if (suffix == "G" || suffix == "GB" || suffix == "GIB") {
    unit = kGiB;
  } else if (suffix == "T" || suffix == "TB" || suffix == "TIB") {
    unit = kTiB;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("size '", text, "' has unknown unit '", suffix,
                                                   "' (use B, KiB, MiB, GiB or TiB)"));
  }
  uint64_t whole = 0;
  if (absl::SimpleAtoi(number, &whole)) {
    if (whole > UINT64_MAX / unit) {
      return absl::InvalidArgumentError(absl::StrCat("size '", text, "' is too large"));
    }
    return whole * unit;
  }
  double value = 0;
  if (!absl::SimpleAtod(number, &value) || !std::isfinite(value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrCat("size '", text, "' is not a number"));
  }
  double bytes = value * static_cast<double>(unit);
  if (bytes >= 1.8e19) {
    return absl::InvalidArgumentError(absl::StrCat("size '", text, "' is too large"));
  }
  if (bytes != std::floor(bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("size '", text, "' is not a whole number of bytes"));
  }
  return static_cast<uint64_t>(bytes);
}

std::string FormatSize(uint64_t bytes) {
  struct Unit {
    uint64_t size;
    const char* name;
  };
  static constexpr Unit kUnits[] = {{kTiB, "TiB"}, {kGiB, "GiB"}, {kMiB, "MiB"}, {kKiB, "KiB"}};
  for (const Unit& unit : kUnits) {
    if (bytes >= unit.size) {
      if (bytes % unit.size == 0) return absl::StrCat(bytes / unit.size, " ", unit.name);
      return absl::StrFormat("%.2f %s", static_cast<double>(bytes) / unit.size, unit.name);
    }
  }
  return absl::StrCat(bytes, " B");
}

}  // namespace tierd
