// Prometheus metrics through prometheus-cpp's core (docs/dependencies.md): histograms and
// counters kept as events happen are its Histogram, Counter and Family; what is read from the
// daemon's parts at scrape time is written as its MetricFamily values with Families below; its
// TextSerializer writes the exposition (format 0.0.4).
//
// Conventions (checked by `promtool check metrics` in tests): names are `tierd_` + what + base
// unit, `_total` only on counters; label values are bounded (tiers, paths, operations, status
// codes, devices, regions, users, declared jobs), never a chunk or session id.
#pragma once

#include <string>
#include <vector>

#include "prometheus/client_metric.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"

namespace tierd::daemon::metrics {

// A sample's labels, in the order they are written.
using Labels = std::vector<prometheus::ClientMetric::Label>;

// Buckets growing by `factor` from `start`: {start, start*factor, ...}, `count` of them.
prometheus::Histogram::BucketBoundaries ExponentialBuckets(double start, double factor, int count);

// Families written at scrape time, in order. Each Sample belongs to the family opened last.
class Families {
 public:
  void Family(std::string name, prometheus::MetricType type, std::string help);
  // A counter's or gauge's value.
  void Sample(Labels labels, double value);
  // A histogram (prometheus::Histogram::Collect), under `labels`.
  void Sample(Labels labels, prometheus::ClientMetric histogram);
  // Appends families collected elsewhere (a prometheus::Registry's).
  void Append(std::vector<prometheus::MetricFamily> more);
  const std::vector<prometheus::MetricFamily>& families() const { return families_; }

 private:
  std::vector<prometheus::MetricFamily> families_;
};

// The text exposition (format 0.0.4) of `families`.
std::string Serialize(const std::vector<prometheus::MetricFamily>& families);

}  // namespace tierd::daemon::metrics
