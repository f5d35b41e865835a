// The largest of the values seen over the last `window` of time: a sliding maximum, amortized
// O(1) a sample (a deque of the samples that may still become the maximum).
//
// Not thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <utility>

#include "absl/time/time.h"

namespace tierd::daemon {

class RecentPeak {
 public:
  explicit RecentPeak(absl::Duration window) : window_(window) {}

  // Records `value` at `now` (times never go back) and returns the largest value recorded within
  // the window ending at `now`, this one included.
  uint64_t Add(absl::Time now, uint64_t value) {
    while (!samples_.empty() && samples_.back().second <= value) samples_.pop_back();
    samples_.emplace_back(now, value);
    while (now - samples_.front().first > window_) samples_.pop_front();
    return samples_.front().second;
  }

 private:
  const absl::Duration window_;
  // Decreasing in value, increasing in time: each is the largest from its time on.
  std::deque<std::pair<absl::Time, uint64_t>> samples_;
};

}  // namespace tierd::daemon
