// Byte sizes as people write them in config files and flags: "4096", "64KiB", "1.5GiB", "2G".
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace tierd {

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = 1024 * kKiB;
inline constexpr uint64_t kGiB = 1024 * kMiB;
inline constexpr uint64_t kTiB = 1024 * kGiB;

// Accepts a non-negative number with an optional binary (KiB, MiB, GiB, TiB) or short (K, M, G, T,
// taken as binary) suffix, or B. Decimal fractions are allowed when the result is a whole number
// of bytes.
absl::StatusOr<uint64_t> ParseSize(absl::string_view text);

// "1.50 GiB", "64 MiB", "4096 B".
std::string FormatSize(uint64_t bytes);

inline constexpr uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace tierd
