// Rate-limited log lines. Anything a client can cause over and over — a refused connection, a
// malformed message, a session opened and closed in a loop — is logged through a limiter, so that a
// misbehaving client cannot fill the disk with the daemon's log or spend its CPU on formatting.
//
//   TIERD_LOG_LIMITED(warn, "session broker: refused a connection of uid {}", uid);
//
// Each call site allows a burst of lines per period; the first line written after lines were
// dropped says how many.
#pragma once

#include <cstdint>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {

class LogLimiter {
 public:
  explicit LogLimiter(int burst = 10, absl::Duration period = absl::Seconds(10))
      : burst_(burst), period_(period) {}

  // True when a line may be written at `now`; then `*dropped` is how many were not since the
  // last one that was.
  bool Allow(absl::Time now, uint64_t* dropped) {
    absl::MutexLock lock(&mu_);
    if (now - window_start_ >= period_) {
      window_start_ = now;
      written_ = 0;
    }
    if (written_ >= burst_) {
      ++dropped_;
      return false;
    }
    ++written_;
    *dropped = dropped_;
    dropped_ = 0;
    return true;
  }

 private:
  const int burst_;
  const absl::Duration period_;
  absl::Mutex mu_;
  absl::Time window_start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int written_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
};

template <typename... Args>
void LogLimited(LogLimiter& limiter, spdlog::level::level_enum level,
                spdlog::format_string_t<Args...> format, Args&&... args) {
  if (!spdlog::should_log(level)) return;
  uint64_t dropped = 0;
  if (!limiter.Allow(absl::Now(), &dropped)) return;
  if (dropped > 0) spdlog::log(level, "({} similar lines were dropped)", dropped);
  spdlog::log(level, format, std::forward<Args>(args)...);
}

}  // namespace tierd::daemon

// One limiter per call site.
#define TIERD_LOG_LIMITED(severity, ...)                                                    \
  do {                                                                                      \
    static ::tierd::daemon::LogLimiter tierd_log_limiter;                                   \
    ::tierd::daemon::LogLimited(tierd_log_limiter, ::spdlog::level::severity, __VA_ARGS__); \
  } while (0)
