// The time, behind a seam: what the daemon measures with it (step times, stalls, move durations,
// the deadlines that order NVMe I/O) follows a FakeClock in tests. Waits on condition variables
// and timeouts that guard against a stuck peer stay on real time.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tierd::daemon {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // The process's clock (absl::Now).
  static const Clock& Real();
};

// A clock that moves only when told to. Thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'800'000'000)) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

inline const Clock& Clock::Real() {
  struct RealClock final : Clock {
    absl::Time Now() const override { return absl::Now(); }
  };
  static const RealClock clock;
  return clock;
}

}  // namespace tierd::daemon
