// MemoryTrimmer: trims after a large request only, and a burst of them makes one trim.
#include "daemon/util/memory_trimmer.h"

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

TEST(MemoryTrimmerTest, TrimsOnlyAfterLargeRequestsAndOnceForABurstOfThem) {
  MemoryTrimmer trimmer(1 << 20, absl::Milliseconds(20));
  for (int i = 0; i < 100; ++i) trimmer.Note(64 << 10);  // small requests
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(trimmer.trims(), 0u);
  for (int i = 0; i < 100; ++i) trimmer.Note(4 << 20);  // a burst of large ones
  for (absl::Time give_up = absl::Now() + absl::Seconds(10);
       trimmer.trims() == 0 && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(trimmer.trims(), 1u);
}

}  // namespace
}  // namespace tierd::daemon
