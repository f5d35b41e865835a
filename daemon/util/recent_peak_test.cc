// RecentPeak: the largest value over a sliding window of time.
#include "daemon/util/recent_peak.h"

#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1'000'000);

TEST(RecentPeakTest, APeakHoldsForTheWindowThenTheLargestSinceTakesOver) {
  RecentPeak peak(absl::Seconds(1));
  EXPECT_EQ(peak.Add(kStart, 5), 5u);
  EXPECT_EQ(peak.Add(kStart + absl::Milliseconds(200), 9), 9u);
  EXPECT_EQ(peak.Add(kStart + absl::Milliseconds(400), 2), 9u);
  EXPECT_EQ(peak.Add(kStart + absl::Milliseconds(600), 4), 9u);
  EXPECT_EQ(peak.Add(kStart + absl::Milliseconds(1200), 1), 9u);  // 9 is a second old, no more
  EXPECT_EQ(peak.Add(kStart + absl::Milliseconds(1201), 1), 4u);  // then 4, the largest since
  EXPECT_EQ(peak.Add(kStart + absl::Milliseconds(1700), 0), 1u);
  EXPECT_EQ(peak.Add(kStart + absl::Seconds(5), 3), 3u);  // a quiet while: only the new one
}

TEST(RecentPeakTest, ARisingSeriesKeepsOnlyItsLatestSample) {
  RecentPeak peak(absl::Seconds(1));
  for (uint64_t v = 0; v < 10'000; ++v) {
    EXPECT_EQ(peak.Add(kStart + absl::Microseconds(v), v), v);
  }
}

}  // namespace
}  // namespace tierd::daemon
