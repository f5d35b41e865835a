// MemoryTrimmer: trims only after work was noted, and once for a burst of it.
#include "daemon/util/memory_trimmer.h"

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

TEST(MemoryTrimmerTest, AQuietDaemonNeverTrims) {
  MemoryTrimmer trimmer(absl::Milliseconds(10));
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(trimmer.trims(), 0u);
}

TEST(MemoryTrimmerTest, TrimsOnceForABurstOfRequestsAndAgainForTheNext) {
  MemoryTrimmer trimmer(absl::Milliseconds(20));
  const auto trims_after = [&](uint64_t seen) {
    for (absl::Time give_up = absl::Now() + absl::Seconds(10);
         trimmer.trims() == seen && absl::Now() < give_up;) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    absl::SleepFor(absl::Milliseconds(200));  // long enough for a second trim, were there one
    return trimmer.trims();
  };
  for (int i = 0; i < 1000; ++i) trimmer.Note();
  EXPECT_EQ(trims_after(0), 1u);
  trimmer.Note();  // a session ends
  EXPECT_EQ(trims_after(1), 2u);
}

}  // namespace
}  // namespace tierd::daemon
