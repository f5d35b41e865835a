// The Prometheus text exposition the daemon writes (daemon/util/metrics.h, through prometheus-cpp)
// and the request metrics the gRPC server counts (daemon/api/daemon_metrics.h).
#include "daemon/util/metrics.h"

#include <cmath>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "daemon/api/daemon_metrics.h"
#include "gtest/gtest.h"

namespace tierd::daemon::metrics {
namespace {

using Type = prometheus::MetricType;

TEST(MetricsExpositionTest, WritesHelpTypeAndSamplesWithEscapedLabelsInTheirOrder) {
  Families w;
  w.Family("tierd_example_bytes", Type::Gauge, "Line one\nline two (a\\b).");
  w.Sample({}, 42);
  // Region paths come from the config and job names from clients: escaped, never breaking a line.
  w.Sample({{"region", "/mnt/a \"b\"\\c\nd"}}, 0.25);
  w.Family("tierd_things_total", Type::Counter, "Things.");
  w.Sample({{"op", "Acquire"}, {"code", "OK"}}, 3);
  EXPECT_EQ(Serialize(w.families()),
            "# HELP tierd_example_bytes Line one\\nline two (a\\\\b).\n"
            "# TYPE tierd_example_bytes gauge\n"
            "tierd_example_bytes 42\n"
            "tierd_example_bytes{region=\"/mnt/a \\\"b\\\"\\\\c\\nd\"} 0.25\n"
            "# HELP tierd_things_total Things.\n"
            "# TYPE tierd_things_total counter\n"
            "tierd_things_total{op=\"Acquire\",code=\"OK\"} 3\n");
}

TEST(MetricsExpositionTest, WritesByteCountsExactlyAndSpecialValuesByName) {
  Families w;
  w.Family("tierd_values", Type::Gauge, "Values.");
  for (double v : std::vector<double>{0.0, static_cast<double>(1ull << 40), -3.0, 0.1, 2.5e20,
                                      INFINITY, -INFINITY, NAN}) {
    w.Sample({}, v);
  }
  EXPECT_EQ(Serialize(w.families()),
            "# HELP tierd_values Values.\n"
            "# TYPE tierd_values gauge\n"
            "tierd_values 0\n"
            "tierd_values 1099511627776\n"
            "tierd_values -3\n"
            "tierd_values 0.1\n"
            "tierd_values 2.5e+20\n"
            "tierd_values +Inf\n"
            "tierd_values -Inf\n"
            "tierd_values Nan\n");
}

TEST(MetricsHistogramTest, BucketsAreCumulativeAndTheCountIsTheInfBucket) {
  prometheus::Histogram h({0.1, 1, 10});
  for (double v : {0.05, 0.1, 0.5, 5.0, 50.0, 500.0}) h.Observe(v);
  Families w;
  w.Family("tierd_wait_seconds", Type::Histogram, "Waits.");
  w.Sample({{"path", "host_to_nvme"}}, h.Collect());
  EXPECT_EQ(Serialize(w.families()),
            "# HELP tierd_wait_seconds Waits.\n"
            "# TYPE tierd_wait_seconds histogram\n"
            "tierd_wait_seconds_count{path=\"host_to_nvme\"} 6\n"
            "tierd_wait_seconds_sum{path=\"host_to_nvme\"} 555.65\n"
            "tierd_wait_seconds_bucket{path=\"host_to_nvme\",le=\"0.1\"} 2\n"
            "tierd_wait_seconds_bucket{path=\"host_to_nvme\",le=\"1\"} 3\n"
            "tierd_wait_seconds_bucket{path=\"host_to_nvme\",le=\"10\"} 4\n"
            "tierd_wait_seconds_bucket{path=\"host_to_nvme\",le=\"+Inf\"} 6\n");
}

TEST(MetricsHistogramTest, ExponentialBucketsDouble) {
  EXPECT_EQ(ExponentialBuckets(25e-6, 2, 4), (std::vector<double>{25e-6, 50e-6, 100e-6, 200e-6}));
}

// The gRPC server records from all its threads at once.
TEST(RpcMetricsTest, ConcurrentRequestsAreAllCountedPerOperationAndCode) {
  RpcMetrics rpc;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&rpc, t] {
      for (int i = 0; i < 10000; ++i) {
        rpc.Record(t % 2 == 0 ? "Acquire" : "Free", i % 2 == 0 ? 0 : 5, absl::Microseconds(i));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  Families w;
  w.Append(rpc.Collect());
  const std::string text = Serialize(w.families());
  EXPECT_NE(text.find("tierd_requests_total{code=\"OK\",op=\"Acquire\"} 10000\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("tierd_requests_total{code=\"NOT_FOUND\",op=\"Free\"} 10000\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("tierd_request_seconds_count{op=\"Acquire\"} 20000\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("tierd_request_seconds_bucket{op=\"Free\",le=\"+Inf\"} 20000\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("# TYPE tierd_requests_total counter\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE tierd_request_seconds histogram\n"), std::string::npos);
}

}  // namespace
}  // namespace tierd::daemon::metrics
