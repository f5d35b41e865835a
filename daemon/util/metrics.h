// Prometheus metrics without a client library (Debian 12 packages none; docs/dependencies.md):
// the text exposition format 0.0.4, written at scrape time from the daemon's own counters, plus
// the two kinds of state that must be accumulated as events happen — counters keyed by bounded
// labels, and histograms.
//
// Conventions (checked by `promtool check metrics` in tests): names are `tierd_` + what + base
// unit,
// `_total` only on counters; label values are bounded (tiers, paths, operations, status codes,
// devices, regions), never a chunk or session id.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/synchronization/mutex.h"

namespace tierd::daemon::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

// A histogram with fixed bucket upper bounds; Observe is lock-free.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // per bound, then +Inf (== count)
    uint64_t count = 0;
    double sum = 0;
  };
  Snapshot Read() const;

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1 (the last is +Inf)
  std::atomic<uint64_t> count_{0};
  std::atomic<double> sum_{0};
};

// Buckets growing by `factor` from `start`: {start, start*factor, ...}, `count` of them.
std::vector<double> ExponentialBuckets(double start, double factor, int count);

// Counters keyed by label values (one family), for events counted as they happen.
class CounterMap {
 public:
  void Add(const Labels& labels, double delta = 1);
  std::vector<std::pair<Labels, double>> Read() const;

 private:
  mutable absl::Mutex mu_;
  std::map<Labels, double> values_ ABSL_GUARDED_BY(mu_);
};

// Histograms keyed by label values (one family).
class HistogramMap {
 public:
  explicit HistogramMap(std::vector<double> bounds) : bounds_(std::move(bounds)) {}
  // The histogram for these labels, created on first use; stays valid for the map's lifetime.
  Histogram& At(const Labels& labels);
  std::vector<std::pair<Labels, Histogram::Snapshot>> Read() const;

 private:
  std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  std::map<Labels, std::unique_ptr<Histogram>> values_ ABSL_GUARDED_BY(mu_);
};

// Writes one exposition. Families must not repeat; each family's samples follow its Family call.
class Writer {
 public:
  enum class Type { kCounter, kGauge, kHistogram };
  void Family(absl::string_view name, Type type, absl::string_view help);
  // A sample of the current counter or gauge family.
  void Sample(const Labels& labels, double value);
  // A histogram sample (its _bucket, _sum and _count lines) of the current histogram family.
  void Sample(const Labels& labels, const Histogram::Snapshot& h);
  const std::string& text() const { return out_; }

 private:
  void Line(absl::string_view suffix, const Labels& labels, double value,
            const std::pair<std::string, std::string>* extra = nullptr);
  std::string out_;
  std::string family_;
  Type type_ = Type::kGauge;
};

// Label value escaping and number formatting per the exposition format.
std::string EscapeLabelValue(absl::string_view value);
std::string FormatValue(double value);

}  // namespace tierd::daemon::metrics
