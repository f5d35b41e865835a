#include "daemon/util/metrics.h"

#include <cassert>
#include <utility>

#include "absl/strings/str_replace.h"
#include "prometheus/text_serializer.h"

namespace tierd::daemon::metrics {

prometheus::Histogram::BucketBoundaries ExponentialBuckets(double start, double factor, int count) {
  prometheus::Histogram::BucketBoundaries b;
  for (int i = 0; i < count; ++i, start *= factor) b.push_back(start);
  return b;
}

void Families::Family(std::string name, prometheus::MetricType type, std::string help) {
  // The serializer writes HELP as it is given; the format wants backslashes and newlines escaped.
  help = absl::StrReplaceAll(help, {{"\\", "\\\\"}, {"\n", "\\n"}});
  families_.push_back(
      prometheus::MetricFamily{.name = std::move(name), .help = std::move(help), .type = type});
}

void Families::Sample(Labels labels, double value) {
  assert(!families_.empty());
  prometheus::MetricFamily& f = families_.back();
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  switch (f.type) {
    case prometheus::MetricType::Counter:
      m.counter.value = value;
      break;
    case prometheus::MetricType::Gauge:
      m.gauge.value = value;
      break;
    default:
      m.untyped.value = value;
      break;
  }
  f.metric.push_back(std::move(m));
}

void Families::Sample(Labels labels, prometheus::ClientMetric histogram) {
  assert(!families_.empty() && families_.back().type == prometheus::MetricType::Histogram);
  histogram.label = std::move(labels);
  families_.back().metric.push_back(std::move(histogram));
}

void Families::Append(std::vector<prometheus::MetricFamily> more) {
  for (prometheus::MetricFamily& f : more) families_.push_back(std::move(f));
}

std::string Serialize(const std::vector<prometheus::MetricFamily>& families) {
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace tierd::daemon::metrics
