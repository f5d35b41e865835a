// The Prometheus text exposition the daemon writes (daemon/util/metrics.h).
#include "daemon/util/metrics.h"

#include <cmath>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace tierd::daemon::metrics {
namespace {

TEST(MetricsWriterTest, WritesHelpTypeAndSamplesWithEscapedLabels) {
  Writer w;
  w.Family("tierd_example_bytes", Writer::Type::kGauge, "Line one\nline two.");
  w.Sample({}, 42);
  w.Sample({{"region", "/mnt/a \"b\"\\c\nd"}}, 0.25);
  w.Family("tierd_things_total", Writer::Type::kCounter, "Things.");
  w.Sample({{"op", "Acquire"}, {"code", "OK"}}, 3);
  EXPECT_EQ(w.text(),
            "# HELP tierd_example_bytes Line one\\nline two.\n"
            "# TYPE tierd_example_bytes gauge\n"
            "tierd_example_bytes 42\n"
            "tierd_example_bytes{region=\"/mnt/a \\\"b\\\"\\\\c\\nd\"} 0.25\n"
            "# HELP tierd_things_total Things.\n"
            "# TYPE tierd_things_total counter\n"
            "tierd_things_total{op=\"Acquire\",code=\"OK\"} 3\n");
}

TEST(MetricsWriterTest, FormatsValuesExactlyAndSpecialValuesByName) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(1ull << 40), "1099511627776");
  EXPECT_EQ(FormatValue(-3), "-3");
  EXPECT_EQ(FormatValue(0.1), "0.1");
  EXPECT_EQ(FormatValue(1e-4 * 1024), "0.1024");
  EXPECT_EQ(FormatValue(2.5e20), "2.5e+20");
  EXPECT_EQ(FormatValue(INFINITY), "+Inf");
  EXPECT_EQ(FormatValue(-INFINITY), "-Inf");
  EXPECT_EQ(FormatValue(NAN), "NaN");
}

TEST(MetricsHistogramTest, BucketsAreCumulativeAndTheCountIsTheInfBucket) {
  Histogram h({0.1, 1, 10});
  for (double v : {0.05, 0.1, 0.5, 5.0, 50.0, 500.0}) h.Observe(v);
  const Histogram::Snapshot s = h.Read();
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{2, 3, 4, 6}));  // <= 0.1, 1, 10, +Inf
  EXPECT_EQ(s.count, 6u);
  EXPECT_DOUBLE_EQ(s.sum, 555.65);

  Writer w;
  w.Family("tierd_wait_seconds", Writer::Type::kHistogram, "Waits.");
  w.Sample({{"path", "host_to_nvme"}}, s);
  EXPECT_EQ(w.text(),
            "# HELP tierd_wait_seconds Waits.\n"
            "# TYPE tierd_wait_seconds histogram\n"
            "tierd_wait_seconds_bucket{path=\"host_to_nvme\",le=\"0.1\"} 2\n"
            "tierd_wait_seconds_bucket{path=\"host_to_nvme\",le=\"1\"} 3\n"
            "tierd_wait_seconds_bucket{path=\"host_to_nvme\",le=\"10\"} 4\n"
            "tierd_wait_seconds_bucket{path=\"host_to_nvme\",le=\"+Inf\"} 6\n"
            "tierd_wait_seconds_sum{path=\"host_to_nvme\"} 555.65\n"
            "tierd_wait_seconds_count{path=\"host_to_nvme\"} 6\n");
}

TEST(MetricsHistogramTest, ConcurrentObservationsAreAllCounted) {
  Histogram h(ExponentialBuckets(1e-3, 2, 10));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&h, t] {
      for (int i = 0; i < 10000; ++i) h.Observe(1e-3 * ((i + t) % 700));
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(h.Read().count, 40000u);
}

TEST(MetricsMapsTest, CountersAndHistogramsAreKeptPerLabelSet) {
  CounterMap c;
  c.Add({{"op", "Free"}, {"code", "NOT_FOUND"}});
  c.Add({{"op", "Free"}, {"code", "NOT_FOUND"}}, 2);
  c.Add({{"op", "Free"}, {"code", "OK"}});
  const auto counts = c.Read();
  ASSERT_EQ(counts.size(), 2u);
  EXPECT_EQ(counts[0].second, 3);  // NOT_FOUND sorts before OK
  EXPECT_EQ(counts[1].second, 1);

  HistogramMap hm({1});
  hm.At({{"op", "Acquire"}}).Observe(0.5);
  hm.At({{"op", "Acquire"}}).Observe(2);
  hm.At({{"op", "Release"}}).Observe(0.1);
  const auto hs = hm.Read();
  ASSERT_EQ(hs.size(), 2u);
  EXPECT_EQ(hs[0].second.count, 2u);
  EXPECT_EQ(hs[1].second.count, 1u);
}

}  // namespace
}  // namespace tierd::daemon::metrics
