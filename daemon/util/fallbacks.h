// What the daemon runs without because the machine does not allow it (io_uring refused, no huge
// pages, host memory the GPU would not register, ...). Each fallback is logged where it is
// chosen and kept here, so that GetNodeInfo (tierctl status) and /metrics report it for as long
// as it holds: a degraded daemon is never silently slower.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace tierd::daemon {

class Fallbacks {
 public:
  // Records (or updates) the fallback `what` (a short stable name, a metric label) and why.
  void Set(const std::string& what, std::string why) {
    absl::MutexLock lock(&mu_);
    entries_[what] = std::move(why);
  }
  // `what` no longer holds.
  void Clear(const std::string& what) {
    absl::MutexLock lock(&mu_);
    entries_.erase(what);
  }
  // (what, why), sorted by what.
  std::vector<std::pair<std::string, std::string>> List() const {
    absl::MutexLock lock(&mu_);
    return {entries_.begin(), entries_.end()};
  }

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::string> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierd::daemon
