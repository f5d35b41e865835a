#include "daemon/chunks/requests.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/sizes.h"

namespace tierd::daemon {

absl::Status ValidateChunkName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk name must be 1 to ", kMaxNameBytes, " bytes, not ", name.size()));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != '-' && c != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk name '", absl::CHexEscape(name),
                       "' has a character outside letters, digits and '._-/'"));
    }
  }
  for (absl::string_view part : absl::StrSplit(name, '/')) {
    if (part.empty() || part == "." || part == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk name '", name, "' has an empty, '.' or '..' path component"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTierConfigured(const Tiers& tiers, TierKind tier, absl::string_view what) {
  if (tiers.tier[tier] == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the ", TierName(tier), " tier is not configured on this node (see ",
                     tier == TierKind::kNvme ? "[nvme]" : "[device]", " in the tierd config)"));
  }
  return absl::OkStatus();
}

absl::Status CheckChunkRequest(const ChunkRequest& r, const Tiers& tiers) {
  if (absl::Status s = CheckTierConfigured(tiers, r.home, "home tier"); !s.ok()) return s;
  const uint64_t most = tiers.tier[r.home]->max_reservation();
  if (r.size == 0 || r.size > most) {
    return absl::InvalidArgumentError(absl::StrCat(
        "size ", r.size, " bytes is outside 1 byte to ", FormatSize(most),
        " (the largest chunk the ", TierName(r.home), " tier holds",
        r.home == TierKind::kNvme ? "; every chunk moves through host memory, so at most "
                                    "host.segment_size"
                                  : "",
        ")"));
  }
  if (r.persistent && r.name.empty()) {
    return absl::InvalidArgumentError("a persistent chunk needs a name");
  }
  if (r.tags.size() > kMaxTags) {
    return absl::InvalidArgumentError(
        absl::StrCat(r.tags.size(), " tags; at most ", kMaxTags, " are allowed"));
  }
  for (const std::string& tag : r.tags) {
    if (tag.empty() || tag.size() > kMaxTagBytes) {
      return absl::InvalidArgumentError(absl::StrCat("tags must be 1 to ", kMaxTagBytes, " bytes"));
    }
  }
  if (r.must_exist && !(r.open_existing && r.persistent)) {
    return absl::InvalidArgumentError("must_exist goes with open_existing and persistent");
  }
  if (r.transient && r.persistent) {
    return absl::InvalidArgumentError(
        "a transient chunk's contents are wanted briefly: it cannot be persistent");
  }
  return r.name.empty() ? absl::OkStatus() : ValidateChunkName(r.name);
}

absl::Time PrefetchDeadline(absl::Time now, int priority) {
  // Clamped so that the product cannot overflow; the I/O engine caps any wait anyway.
  constexpr int kLimit = 24 * 3600 * 1000;
  return now - kPriorityUnit * std::clamp(priority, -kLimit, kLimit);
}

bool IsOperator(const Session& session) {
  return session.peer.uid == 0 || session.peer.uid == geteuid();
}

}  // namespace tierd::daemon
