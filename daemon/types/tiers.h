// The tiers, the paths between them and the ladder they form: device above host above NVMe. Every
// "one tier down", "the path there" and "is this copy clean" of the daemon is spelled here once.
// A leaf: nothing of the daemon below it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>

#include "absl/strings/string_view.h"

namespace tierd::daemon {

// Values match tierd.v1.Tier.
enum class TierKind : uint8_t { kHost = 1, kNvme = 2, kDevice = 3 };
inline constexpr size_t kTierKinds = 3;
// Every tier, in the enum's order: the order of TierArray and of every report.
inline constexpr std::array<TierKind, kTierKinds> kAllTiers = {TierKind::kHost, TierKind::kNvme,
                                                               TierKind::kDevice};

absl::string_view TierName(TierKind tier);

// The wire's number for a tier (tierd.v1.Tier), and back: nullopt for a number that names none.
constexpr int WireValue(TierKind tier) { return static_cast<int>(tier); }
constexpr std::optional<TierKind> TierFromWire(int value) {
  if (value < 1 || value > 3) return std::nullopt;
  return static_cast<TierKind>(value);
}

// A set of tiers.
class TierSet {
 public:
  constexpr bool contains(TierKind t) const { return bits_ & Bit(t); }
  constexpr void insert(TierKind t) { bits_ |= Bit(t); }
  constexpr void erase(TierKind t) { bits_ &= ~Bit(t); }
  constexpr bool empty() const { return bits_ == 0; }

 private:
  static constexpr uint8_t Bit(TierKind t) {
    return static_cast<uint8_t>(1u << static_cast<int>(t));
  }
  uint8_t bits_ = 0;
};

// The ways a chunk's bytes move, each with its own measured bandwidth.
enum class Path : uint8_t { kNvmeToHost = 0, kHostToNvme, kHostToDevice, kDeviceToHost };
inline constexpr size_t kPaths = 4;
inline constexpr std::array<Path, kPaths> kAllPaths = {Path::kNvmeToHost, Path::kHostToNvme,
                                                       Path::kHostToDevice, Path::kDeviceToHost};

// "nvme_to_host", "host_to_nvme", "host_to_device", "device_to_host".
const char* PathName(Path path);

// One T per key of an enum with `N` keys numbered from `first`: no slot for a value that names
// nothing. Iterates in the order of the keys.
template <typename Key, typename T, size_t N, int first>
class EnumArray {
 public:
  constexpr EnumArray() = default;
  static constexpr EnumArray Filled(const T& value) {
    EnumArray a;
    a.fill(value);
    return a;
  }
  constexpr void fill(const T& value) { values_.fill(value); }
  // Each value made by `make()`, for types that cannot be copied.
  template <typename F>
  static EnumArray Generate(F make) {
    return EnumArray(make, std::make_index_sequence<N>());
  }
  constexpr T& operator[](Key k) { return values_[Index(k)]; }
  constexpr const T& operator[](Key k) const { return values_[Index(k)]; }
  constexpr auto begin() { return values_.begin(); }
  constexpr auto end() { return values_.end(); }
  constexpr auto begin() const { return values_.begin(); }
  constexpr auto end() const { return values_.end(); }
  bool operator==(const EnumArray&) const = default;

 private:
  template <typename F, size_t... I>
  EnumArray(F& make, std::index_sequence<I...>) : values_{{(static_cast<void>(I), make())...}} {}
  static constexpr size_t Index(Key k) { return static_cast<size_t>(static_cast<int>(k) - first); }
  std::array<T, N> values_{};
};

template <typename T>
using TierArray = EnumArray<TierKind, T, kTierKinds, 1>;
template <typename T>
using PathArray = EnumArray<Path, T, kPaths, 0>;

// ---- the ladder ----

// Whether `a` is above (faster than) `b`.
constexpr bool Above(TierKind a, TierKind b) {
  constexpr auto rank = [](TierKind t) {
    return t == TierKind::kDevice ? 2 : t == TierKind::kHost ? 1 : 0;
  };
  return rank(a) > rank(b);
}

// The tier a copy in `t` is written down to: host below the device, NVMe below the host; none
// below NVMe.
constexpr std::optional<TierKind> Below(TierKind t) {
  if (t == TierKind::kDevice) return TierKind::kHost;
  if (t == TierKind::kHost) return TierKind::kNvme;
  return std::nullopt;
}

// The path a copy in `t` is written down over. REQUIRES: Below(t).
constexpr Path PathDown(TierKind t) {
  return t == TierKind::kDevice ? Path::kDeviceToHost : Path::kHostToNvme;
}

// The path a copy comes up into `t` over, from the tier below. REQUIRES: Below(t).
constexpr Path PathUp(TierKind t) {
  return t == TierKind::kDevice ? Path::kHostToDevice : Path::kNvmeToHost;
}

// A copy in `t` is clean, and may be dropped without losing data, when it is valid and a tier
// below holds a valid copy too.
constexpr bool CleanIn(TierSet resident, TierKind t) {
  if (!resident.contains(t)) return false;
  for (std::optional<TierKind> b = Below(t); b; b = Below(*b)) {
    if (resident.contains(*b)) return true;
  }
  return false;
}

}  // namespace tierd::daemon
