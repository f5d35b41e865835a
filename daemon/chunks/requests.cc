#include "daemon/chunks/requests.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

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

absl::Time PrefetchDeadline(absl::Time now, int priority) {
  // Clamped so that the product cannot overflow; the I/O engine caps any wait anyway.
  constexpr int kLimit = 24 * 3600 * 1000;
  return now - kPriorityUnit * std::clamp(priority, -kLimit, kLimit);
}

bool IsOperator(const Session& session) {
  return session.peer.uid == 0 || session.peer.uid == geteuid();
}

}  // namespace tierd::daemon
