// PathMeter: the bandwidth and move-latency estimates the planner plans with, measured from moves
// at times the test chooses (the clock seam: daemon/util/clock.h).
#include "daemon/chunks/path_meter.h"

#include "daemon/util/clock.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kMiB = 1 << 20;

TEST(PathMeterTest, StartsFromItsGuessesAndTheProbeReplacesThem) {
  PathMeter meter;
  const auto before = meter.Status();
  EXPECT_FALSE(before[Path::kNvmeToHost].measured);
  EXPECT_GT(before[Path::kNvmeToHost].bytes_per_second, 0);
  PathArray<double> probed;
  probed[Path::kNvmeToHost] = 3e9;
  meter.Seed(probed);
  const auto after = meter.Status();
  EXPECT_EQ(after[Path::kNvmeToHost].bytes_per_second, 3e9);
  EXPECT_EQ(after[Path::kNvmeToHost].probed_bytes_per_second, 3e9);
  EXPECT_TRUE(after[Path::kNvmeToHost].measured);
  // A path the probe did not measure keeps its guess.
  EXPECT_EQ(after[Path::kHostToNvme].bytes_per_second, before[Path::kHostToNvme].bytes_per_second);
}

TEST(PathMeterTest, ABusyPeriodMeasuresBytesOverTheTimeThePathWasBusy) {
  FakeClock clock;
  PathMeter meter;
  // Two 8 MiB moves overlapping on one path over 10 ms: 16 MiB in 10 ms.
  meter.Started(Path::kHostToNvme, 1, 8 * kMiB, clock.Now());
  meter.Started(Path::kHostToNvme, 2, 8 * kMiB, clock.Now());
  EXPECT_EQ(meter.Load()[Path::kHostToNvme].in_flight, 2);
  EXPECT_EQ(meter.Load()[Path::kHostToNvme].queued_bytes, 16 * kMiB);
  clock.Advance(absl::Milliseconds(5));
  meter.Done(Path::kHostToNvme, 1, 8 * kMiB, clock.Now());
  clock.Advance(absl::Milliseconds(5));
  meter.Done(Path::kHostToNvme, 2, 8 * kMiB, clock.Now());
  const PathStatus s = meter.Status()[Path::kHostToNvme];
  EXPECT_TRUE(s.measured);
  EXPECT_DOUBLE_EQ(s.bytes_per_second, 16.0 * kMiB / 0.010);
  EXPECT_EQ(s.bytes, 16 * kMiB);
  EXPECT_EQ(s.moves, 2u);
  const PathLoad load = meter.Load()[Path::kHostToNvme];
  EXPECT_EQ(load.in_flight, 0);
  EXPECT_EQ(load.queued_bytes, 0u);
  const prometheus::ClientMetric h = meter.transfer_seconds(Path::kHostToNvme);
  EXPECT_EQ(h.histogram.sample_count, 2u);
  EXPECT_NEAR(h.histogram.sample_sum, 0.015, 1e-9);
}

// A move's latency is what it takes beyond its bytes and the bytes in flight ahead of it at the
// path's bandwidth: waiting behind others is not latency (the planner counts their bytes apart).
TEST(PathMeterTest, MovesQueuedBehindOthersShowNoLatencyAndASlowMoveShowsItsOwn) {
  FakeClock clock;
  PathMeter meter;
  PathArray<double> probed;
  probed[Path::kNvmeToHost] = 1e9;
  meter.Seed(probed);
  EXPECT_EQ(meter.Load()[Path::kNvmeToHost].slow_latency, absl::ZeroDuration());
  // Eight 1 MB reads issued at once finish one a millisecond: the path streams at 1 GB/s, and the
  // last waited 7 ms behind the others.
  for (ChunkId id = 1; id <= 8; ++id) meter.Started(Path::kNvmeToHost, id, 1'000'000, clock.Now());
  for (ChunkId id = 1; id <= 8; ++id) {
    clock.Advance(absl::Milliseconds(1));
    meter.Done(Path::kNvmeToHost, id, 1'000'000, clock.Now());
  }
  EXPECT_EQ(meter.Load()[Path::kNvmeToHost].slow_latency, absl::ZeroDuration());
  // Alone on an idle path, 1 MB takes 3 ms at a measured 1 GB/s: 2 ms of latency. One such move
  // after eight with none moves the mean by an eighth (0.25 ms) and the mean deviation by a
  // quarter (0.5 ms): planned on the long side, 0.25 + 4 x 0.5 = 2.25 ms.
  ASSERT_NEAR(meter.Status()[Path::kNvmeToHost].bytes_per_second, 1e9, 1);
  clock.Advance(absl::Milliseconds(10));
  meter.Started(Path::kNvmeToHost, 9, 1'000'000, clock.Now());
  clock.Advance(absl::Milliseconds(3));
  meter.Done(Path::kNvmeToHost, 9, 1'000'000, clock.Now());
  EXPECT_NEAR(absl::ToDoubleSeconds(meter.Load()[Path::kNvmeToHost].slow_latency), 0.00225, 1e-9);
}

// A chunk streamed NVMe -> host -> device moves on two paths at once: each path times its own.
TEST(PathMeterTest, OneChunkMovingOnTwoPathsIsTimedOnEach) {
  FakeClock clock;
  PathMeter meter;
  meter.Started(Path::kNvmeToHost, 7, kMiB, clock.Now());
  clock.Advance(absl::Milliseconds(1));
  meter.Started(Path::kHostToDevice, 7, kMiB, clock.Now());
  clock.Advance(absl::Milliseconds(3));
  meter.Done(Path::kNvmeToHost, 7, kMiB, clock.Now());
  meter.Done(Path::kHostToDevice, 7, kMiB, clock.Now());
  EXPECT_NEAR(meter.transfer_seconds(Path::kNvmeToHost).histogram.sample_sum, 0.004, 1e-9);
  EXPECT_NEAR(meter.transfer_seconds(Path::kHostToDevice).histogram.sample_sum, 0.003, 1e-9);
}

}  // namespace
}  // namespace tierd::daemon
