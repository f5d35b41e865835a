#include "daemon/util/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace tierd::daemon::metrics {

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  std::sort(bounds_.begin(), bounds_.end());
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double value) {
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  s.bounds = bounds_;
  uint64_t running = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    running += buckets_[i].load(std::memory_order_relaxed);
    s.cumulative.push_back(running);
  }
  // The count is the +Inf bucket, so that the two always agree within one exposition.
  s.count = running;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> b;
  for (int i = 0; i < count; ++i, start *= factor) b.push_back(start);
  return b;
}

void CounterMap::Add(const Labels& labels, double delta) {
  absl::MutexLock lock(&mu_);
  values_[labels] += delta;
}

std::vector<std::pair<Labels, double>> CounterMap::Read() const {
  absl::MutexLock lock(&mu_);
  return {values_.begin(), values_.end()};
}

Histogram& HistogramMap::At(const Labels& labels) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<Histogram>& h = values_[labels];
  if (h == nullptr) h = std::make_unique<Histogram>(bounds_);
  return *h;
}

std::vector<std::pair<Labels, Histogram::Snapshot>> HistogramMap::Read() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<Labels, Histogram::Snapshot>> out;
  for (const auto& [labels, h] : values_) out.emplace_back(labels, h->Read());
  return out;
}

std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (value == std::floor(value) && std::fabs(value) < 1e15) {
    return absl::StrCat(static_cast<int64_t>(value));
  }
  char buf[32];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), value);  // shortest exact
  return std::string(buf, r.ptr);
}

void Writer::Family(absl::string_view name, Type type, absl::string_view help) {
  family_ = std::string(name);
  type_ = type;
  static constexpr const char* kTypes[] = {"counter", "gauge", "histogram"};
  std::string escaped;
  for (char c : help) escaped += c == '\n' ? std::string("\\n") : std::string(1, c);
  absl::StrAppend(&out_, "# HELP ", name, " ", escaped, "\n# TYPE ", name, " ",
                  kTypes[static_cast<int>(type)], "\n");
}

void Writer::Line(absl::string_view suffix, const Labels& labels, double value,
                  const std::pair<std::string, std::string>* extra) {
  absl::StrAppend(&out_, family_, suffix);
  if (!labels.empty() || extra != nullptr) {
    out_ += '{';
    bool first = true;
    auto add = [&](const std::pair<std::string, std::string>& l) {
      absl::StrAppend(&out_, first ? "" : ",", l.first, "=\"", EscapeLabelValue(l.second), "\"");
      first = false;
    };
    for (const auto& l : labels) add(l);
    if (extra != nullptr) add(*extra);
    out_ += '}';
  }
  absl::StrAppend(&out_, " ", FormatValue(value), "\n");
}

void Writer::Sample(const Labels& labels, double value) { Line("", labels, value); }

void Writer::Sample(const Labels& labels, const Histogram::Snapshot& h) {
  for (size_t i = 0; i < h.cumulative.size(); ++i) {
    const std::pair<std::string, std::string> le{
        "le", i < h.bounds.size() ? FormatValue(h.bounds[i]) : "+Inf"};
    Line("_bucket", labels, static_cast<double>(h.cumulative[i]), &le);
  }
  Line("_sum", labels, h.sum);
  Line("_count", labels, static_cast<double>(h.count));
}

}  // namespace tierd::daemon::metrics
